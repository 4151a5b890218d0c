r"""Per-token baselines and verl's baselines on chapter 1's sequence policy, exactly.

The tabular policy's score is a sum of per-token scores s_t = grad log pi(y_t | y_<t) on disjoint
parameters, so a baseline b_t(y_<t) per token that depends on the prefix alone keeps
g = sum_t (r - b_t(y_<t)) s_t unbiased (`token_baseline_moments` checks that it does), and its
variance splits token by token. `optimal_token_baselines` gives each prefix its optimal
baseline, `value_baselines` the value V(y_<t) = E[r | y_<t] that a critic learns;
`token_baseline_comparison` sets them against the constants E[r] and b* of
`grpo_companion.chapters.baselines.optimal`. verl's critic-free baselines are ReMax's reward of
the greedy completion (`greedy_sequence`), a constant, and the optimal token baseline
(`otb_baselines`, the population version of
`grpo_companion.core.verl_estimators.optimal_token_baseline_advantages`), compared by
`verl_baseline_table`. All of them are exact: as if a critic or enough rollouts per prefix had
learned them perfectly.

Chapter: :doc:`/book/08_baselines` (section 4: per-token baselines; section 5: ReMax and the
optimal token baseline)
"""

import torch
from torch import Tensor

from grpo_companion.chapters.baselines.optimal import baseline_gap, group_variances
from grpo_companion.core.policy_gradient import (
    SequencePolicy,
    estimator_variance,
    exact_prefix_values,
)


def _prefix_ids(policy: SequencePolicy, step: int) -> Tensor:
    """Which prefix y_<step each sequence has, `(num_sequences,)`: sequences are numbered in
    lexicographic order, so the prefix is the sequence number's leading base-V digits."""
    return torch.arange(policy.num_sequences) // policy.vocab_size ** (policy.length - step)


def _conditional_mean(policy: SequencePolicy, probs: Tensor, values: Tensor, step: int) -> Tensor:
    """E[values | y_<step] evaluated at each sequence, `(num_sequences,)`."""
    prefix = _prefix_ids(policy, step)
    num_prefixes = policy.vocab_size**step
    mass = torch.zeros(num_prefixes, dtype=torch.float64).index_add_(0, prefix, probs)
    total = torch.zeros(num_prefixes, dtype=torch.float64).index_add_(0, prefix, probs * values)
    return (total / mass)[prefix]


def token_score_norms(policy: SequencePolicy, logits: Tensor) -> Tensor:
    """||s_t(y)||^2 per token, `(num_sequences, length)`; the rows sum to ||s(y)||^2 because the
    tokens' parameter blocks are disjoint (the flat score is laid out step by step)."""
    scores = policy.scores(logits, policy.all_sequences())
    return scores.view(policy.num_sequences, policy.length, -1).square().sum(dim=2)


def value_baselines(policy: SequencePolicy, logits: Tensor, rewards: Tensor) -> Tensor:
    """V(y_<t) = E[r | y_<t], the critic's baseline, `(num_sequences, length)`."""
    return exact_prefix_values(policy, logits, rewards)[:, :-1]


def optimal_token_baselines(policy: SequencePolicy, logits: Tensor, rewards: Tensor) -> Tensor:
    """b_t*(y_<t) = E[||s_t||^2 r | y_<t] / E[||s_t||^2 | y_<t], `(num_sequences, length)`."""
    probs = policy.probs(logits).detach()
    norms = token_score_norms(policy, logits)
    return torch.stack(
        [
            _conditional_mean(policy, probs, norms[:, step] * rewards, step)
            / _conditional_mean(policy, probs, norms[:, step], step)
            for step in range(policy.length)
        ],
        dim=1,
    )


def token_baseline_moments(
    policy: SequencePolicy, logits: Tensor, rewards: Tensor, baselines: Tensor
) -> dict[str, Tensor]:
    """Exact mean and variance of one sample's g = sum_t (r - b_t(y_<t)) s_t.

    `baselines: (num_sequences, length)`, column t a function of the prefix y_<t only (checked:
    a baseline that sees y_t would bias the estimator). Returns "mean": `(num_params,)` and
    "variance": E||g - E[g]||^2, a scalar tensor.
    """
    probs = policy.probs(logits).detach()
    for step in range(policy.length):
        column = baselines[:, step]
        if (column - _conditional_mean(policy, probs, column, step)).abs().max() > 1e-12 * (
            1 + column.abs().max()
        ):
            raise ValueError(f"baselines[:, {step}] must depend only on the prefix y_<{step}")
    scores = policy.scores(logits, policy.all_sequences()).view(
        policy.num_sequences, policy.length, -1
    )
    estimates = ((rewards[:, None] - baselines)[..., None] * scores).flatten(start_dim=1)
    mean = probs @ estimates
    return {"mean": mean, "variance": probs @ (estimates - mean).square().sum(dim=1)}


# -- the chapter's comparison of per-token baselines ------------------------------------------


def token_baseline_candidates(
    policy: SequencePolicy, logits: Tensor, rewards: Tensor
) -> dict[str, Tensor]:
    """The baselines of section 4, each `(num_sequences, length)`: none, the constants E[r] and
    b*, the per-token value V(y_<t) and the per-token optimal b*_t(y_<t)."""
    shape = (policy.num_sequences, policy.length)
    mean_reward = float(policy.objective(logits, rewards))
    b_star = baseline_gap(policy, logits, rewards)["optimal_baseline"]
    return {
        "none": torch.zeros(shape, dtype=torch.float64),
        "constant E[r]": torch.full(shape, mean_reward, dtype=torch.float64),
        "constant b*": torch.full(shape, b_star, dtype=torch.float64),
        "per-token value V(y_<t)": value_baselines(policy, logits, rewards),
        "per-token optimal b*_t(y_<t)": optimal_token_baselines(policy, logits, rewards),
    }


def token_baseline_comparison(
    policy: SequencePolicy, policies: dict[str, tuple[str, Tensor]], rewards: Tensor
):
    """`token_baseline_moments` of every `token_baseline_candidates` baseline, for each policy
    (key -> (label, logits)).

    Returns: a DataFrame of variances relative to the constant E[r] (rows: baselines, columns:
    policy labels); the largest |E[g] - grad J| entry over all of them (each is unbiased); and
    key -> the last token's optimal baseline's probability-weighted mean distance from the
    prefix value, E|b*_L(y_<L) - V(y_<L)|.
    """
    import pandas as pd

    rows, last_token_gaps, unbiased_error = {}, {}, 0.0
    for key, (label, logits) in policies.items():
        candidates = token_baseline_candidates(policy, logits, rewards)
        exact_gradient = policy.exact_gradient(logits, rewards)
        variances = {}
        for name, baselines in candidates.items():
            moments = token_baseline_moments(policy, logits, rewards, baselines)
            variances[name] = float(moments["variance"])
            error = float((moments["mean"] - exact_gradient).abs().max())
            unbiased_error = max(unbiased_error, error)
        reference = variances["constant E[r]"]
        rows[label] = {name: value / reference for name, value in variances.items()}
        last_token = (
            candidates["per-token optimal b*_t(y_<t)"][:, -1]
            - candidates["per-token value V(y_<t)"][:, -1]
        )
        last_token_gaps[key] = float(policy.probs(logits) @ last_token.abs())
    return pd.DataFrame(rows), unbiased_error, last_token_gaps


# -- verl's baselines -------------------------------------------------------------------------


def greedy_sequence(policy: SequencePolicy, logits: Tensor) -> int:
    """The number of the greedy completion: the likeliest token at each step given the last."""
    context, number = policy.vocab_size, 0  # BOS
    for step in range(policy.length):
        context = int(logits[step, context].argmax())
        number = number * policy.vocab_size + context
    return number


def otb_baselines(policy: SequencePolicy, logits: Tensor, rewards: Tensor) -> Tensor:
    """verl's optimal token baseline, population version: B_t = E[r W_t] / E[W_t] with
    W_t = sum_{j <= t} ||s_j||^2, the same for every sequence, `(num_sequences, length)`."""
    probs = policy.probs(logits).detach()
    cumulative = token_score_norms(policy, logits).cumsum(dim=1)
    per_step = (probs * rewards) @ cumulative / (probs @ cumulative)
    return per_step.expand(policy.num_sequences, -1).clone()


def verl_baseline_table(
    policy: SequencePolicy, policies: dict[str, tuple[str, Tensor]], rewards: Tensor, group_sizes
):
    """Variance of one update relative to the oracle E[r] at the same G, for verl's baselines and
    the group's, on each policy (key -> (label, logits)): ReMax's r(greedy) and the constant b*
    (any G), the population OTB (any G), RLOO at the smallest and largest G. Returns
    (DataFrame: rows baselines, columns policy labels; key -> r(greedy))."""
    import pandas as pd

    columns, greedy_rewards = {}, {}
    for key, (label, logits) in policies.items():
        gap = baseline_gap(policy, logits, rewards)
        greedy_rewards[key] = float(rewards[greedy_sequence(policy, logits)])
        remax = float(estimator_variance(policy, logits, rewards, greedy_rewards[key]))
        otb_baseline = otb_baselines(policy, logits, rewards)
        otb = token_baseline_moments(policy, logits, rewards, otb_baseline)
        column = {
            "ReMax: r(greedy)": remax / gap["variance_at_mean"],
            "constant b*": gap["variance_at_optimal"] / gap["variance_at_mean"],
            "OTB: E[r W_t] / E[W_t]": float(otb["variance"]) / gap["variance_at_mean"],
        }
        for size in (min(group_sizes), max(group_sizes)):
            variances = group_variances(policy, logits, rewards, size)
            column[f"RLOO, G = {size}"] = variances["rloo"] / variances["oracle_mean"]
        columns[label] = column
    return pd.DataFrame(columns), greedy_rewards
