r"""Chapter 8: when is the group mean the best baseline?

The optimal constant baseline and the mean reward
-------------------------------------------------
For one sample, g_b = (r - b) s with s = grad log pi has variance (chapter 1)

    Var[g_b] = E[(r - b)^2 ||s||^2] - ||grad J||^2,   minimised by  b* = E[||s||^2 r] / E[||s||^2].

Writing E[||s||^2 r] = E||s||^2 E[r] + Cov(||s||^2, r) gives the gap exactly,

    b* - E[r] = Cov(||s||^2, r) / E||s||^2,     Var[g_E[r]] - Var[g_b*] = E||s||^2 (b* - E[r])^2,

so the mean reward, which GRPO's group mean estimates, is the optimal constant baseline if and
only if the squared score norm is uncorrelated with the reward. It holds for every reward when
||s||^2 is the same for every sequence (a uniform tabular policy), and for a reward built to be
uncorrelated (`uncorrelated_reward`); it fails when right answers are rarer or likelier than the
policy's typical sequence (`rank_reward`).

Leave-one-out against mean-including-self
-----------------------------------------
With G i.i.d. samples, leave-one-out (RLOO) uses b_i = mean of the other G - 1 rewards:
g = (1/G) sum_i (r_i - b_i) s_i. Write mu = E[r], d_j = r_j - mu. Then

    g = (1/G) sum_i d_i s_i  -  1/(G (G - 1)) sum_{i != j} d_j s_i  =  X - Y.

X is the oracle estimator with b = mu: E[X] = grad J, Var[X] = Var[g_mu] / G. Y has mean zero
(s_i is independent of d_j and E[s] = 0) and is uncorrelated with X. In E||Y||^2 only the
pairings (i, j) = (k, l) and (i, j) = (l, k) survive, contributing Var[r] E||s||^2 and
E[d s] . E[d s] = ||grad J||^2 for each of the G (G - 1) pairs:

    Var[g_rloo] = Var[g_mu] / G  +  (Var[r] E||s||^2 + ||grad J||^2) / (G (G - 1)).

The mean-including-self baseline gives r_i - mean(r) = (1 - 1/G)(r_i - b_i) for every group, so
g_mean = (1 - 1/G) g_rloo exactly: the same direction, variance (1 - 1/G)^2 Var[g_rloo], and a
bias -grad J / G. Neither is better after an optimiser that normalises the step (Adam); with
plain SGD the two differ only by a learning rate.

Per-token baselines
-------------------
The tabular policy's score is a sum of per-token scores s_t = grad log pi(y_t | y_<t) on disjoint
parameters (step t owns rows (t, .)). A baseline per token that depends only on the prefix,
b_t(y_<t), keeps the estimator g = sum_t (r - b_t(y_<t)) s_t unbiased, because
E[s_t | y_<t] = 0. Disjoint blocks make ||g||^2 = sum_t (r - b_t)^2 ||s_t||^2, so each prefix has
its own optimal baseline,

    b_t*(h) = E[||s_t||^2 r | y_<t = h] / E[||s_t||^2 | y_<t = h],

next to the value function V(h) = E[r | y_<t = h] that a critic (PPO) learns. Both are computed
exactly here; an algorithm would have to estimate them.

verl's baselines (`verl_baseline_table`)
----------------------------------------
ReMax subtracts the reward of the policy's greedy completion (`greedy_sequence`): a constant,
so the estimator stays unbiased and its variance is Var[g_b] at b = r(greedy), a point on the
same parabola; for a right-or-wrong reward b is 0 or 1, the far ends of it. verl's optimal token
baseline (OTB) gives token t the baseline B_t = E[r W_t] / E[W_t] with W_t = sum_{j <= t}
||s_j||^2, a constant per position (population version of
`grpo_companion.core.advantages.optimal_token_baseline_advantages`); at the last token W_L =
||s||^2 and B_L = b*. OPO's E[L r] / E[L] is E[r] here, where every sequence has L tokens.

KL in the reward or in the loss (`kl_placement`)
------------------------------------------------
In the reward (verl's use_kl_in_reward, RLOO): r' = r - beta k1(y), k1 = log pi(y) - log
pi_ref(y) detached, and the score-function update E[(r' - b) s] = grad J - beta E[k1 s] =
grad J - beta grad KL(pi || pi_ref), because E[k1 s] = sum_y grad pi (log pi - log pi_ref) and
sum_y pi grad log pi = 0. The baseline acts on the KL too: the group mean shrinks it by 1 - 1/G
like the reward, and k1's spread multiplies ||s|| in the variance.
In the loss (TRL, GRPO): the estimate k(y) = sum_t k(x_t), with x_t = log pi(y_t | .) -
log pi_ref(y_t | .), is differentiated through log pi: grad k = sum_t k'(x_t) s_t, added after
the baseline. For k1, k' = 1 and E[grad k1] = E[s] = 0: no expected gradient at all. For k3,
k' = 1 - pi_ref / pi,
E[grad k3] = -sum_t E_{y<t ~ pi}[sum_a pi_ref(a | .) grad log pi(a | .)]: the gradient of the
per-token KL(pi_ref || pi) at the policy's own contexts, held fixed: the forward direction
(chapter 3's name for it), and not the gradient of the sequence-level KL(pi || pi_ref). This is
k3 without the ratio (TRL's use_bias_correction_kl=False); TRL 1.16's default multiplies k3 by
pi / pi_old, whose gradient at pi = pi_old follows the per-token reverse KL(pi || pi_ref).
The KL quantities are `grpo_companion.core.kl`'s: `kl_penalty`, `kl_in_reward`, `exact_kl` and
the per-sequence gradients grad k(y), `kl_estimate_gradients`.
"""

import torch
from torch import Tensor

from grpo_companion.core.group_estimators import sample_group_estimates
from grpo_companion.core.kl import exact_kl, kl_estimate_gradients, kl_in_reward, kl_penalty
from grpo_companion.core.policy_gradient import (
    SequencePolicy,
    estimator_variance,
    exact_prefix_values,
    optimal_baseline,
    sum_mod_reward,
)


def squared_score_norms(policy: SequencePolicy, logits: Tensor) -> Tensor:
    """||s(y)||^2 for every sequence, `(num_sequences,)`."""
    return policy.scores(logits, policy.all_sequences()).square().sum(dim=1)


def baseline_gap(policy: SequencePolicy, logits: Tensor, rewards: Tensor) -> dict[str, float]:
    """The optimal constant baseline against the mean reward, `rewards: (num_sequences,)`.

    Returns mean_reward E[r], optimal_baseline b*, gap b* - E[r], covariance Cov(||s||^2, r),
    correlation (their correlation coefficient; nan when either is constant, up to rounding),
    mean_squared_norm E||s||^2, variance_at_mean Var[g_E[r]], variance_at_optimal Var[g_b*] and
    excess_variance Var[g_E[r]] / Var[g_b*] - 1: what using the mean costs, relative to b*.
    """
    probs = policy.probs(logits).detach()
    norms = squared_score_norms(policy, logits)
    mean_reward = float(probs @ rewards)
    mean_squared_norm = float(probs @ norms)
    covariance = float(probs @ ((norms - mean_squared_norm) * (rewards - mean_reward)))
    norm_variance = float(probs @ (norms - mean_squared_norm) ** 2)
    reward_variance = float(probs @ (rewards - mean_reward) ** 2)
    # A constant norm or reward has no correlation; rounding would otherwise invent one.
    constant = (
        norm_variance <= (1e-12 * mean_squared_norm) ** 2
        or reward_variance <= (1e-12 * (1 + abs(mean_reward))) ** 2
    )
    b_star = optimal_baseline(policy, logits, rewards)
    variance_at_mean = float(estimator_variance(policy, logits, rewards, mean_reward))
    variance_at_optimal = float(estimator_variance(policy, logits, rewards, b_star))
    return {
        "mean_reward": mean_reward,
        "optimal_baseline": b_star,
        "gap": b_star - mean_reward,
        "covariance": covariance,
        "correlation": float("nan")
        if constant
        else covariance / (norm_variance * reward_variance) ** 0.5,
        "mean_squared_norm": mean_squared_norm,
        "variance_at_mean": variance_at_mean,
        "variance_at_optimal": variance_at_optimal,
        "excess_variance": variance_at_mean / variance_at_optimal - 1,
    }


def uncorrelated_reward(policy: SequencePolicy, logits: Tensor, rewards: Tensor) -> Tensor:
    """`rewards` minus its regression on ||s||^2 under pi: Cov(||s||^2, r') = 0, E[r'] = E[r].

    r' = r - c (||s||^2 - E||s||^2) with c = Cov(||s||^2, r) / Var[||s||^2]; `(num_sequences,)`.
    A reward constructed so that the mean reward is the optimal baseline.
    """
    probs = policy.probs(logits).detach()
    norms = squared_score_norms(policy, logits)
    centered_norms = norms - probs @ norms
    slope = (probs @ (centered_norms * rewards)) / (probs @ centered_norms.square())
    return rewards - slope * centered_norms


def rank_reward(policy: SequencePolicy, logits: Tensor, num_rewarded: int, rarest: bool) -> Tensor:
    """Reward 1 on the `num_rewarded` least likely sequences (`rarest=True`) or most likely ones,
    0 elsewhere, `(num_sequences,)`: a prompt whose right answers the policy finds hard or easy."""
    if not 0 < num_rewarded < policy.num_sequences:
        raise ValueError(
            f"num_rewarded must be in 1..{policy.num_sequences - 1}, got {num_rewarded}"
        )
    order = policy.probs(logits).detach().argsort(descending=not rarest)
    rewards = torch.zeros(policy.num_sequences, dtype=torch.float64)
    rewards[order[:num_rewarded]] = 1.0
    return rewards


def group_variances(
    policy: SequencePolicy, logits: Tensor, rewards: Tensor, group_size: int
) -> dict[str, float]:
    """Variances of G-sample gradient estimators, in closed form (module docstring).

    Returns oracle_optimal Var[g_b*] / G and oracle_mean Var[g_E[r]] / G (baselines known exactly),
    rloo (leave-one-out, unbiased), mean_self (mean including self, "dr_grpo") and
    mean_self_mse, its variance plus its squared bias ||grad J||^2 / G^2.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for a leave-one-out baseline, got {group_size}")
    probs = policy.probs(logits).detach()
    mean_reward = float(probs @ rewards)
    reward_variance = float(probs @ (rewards - mean_reward) ** 2)
    mean_squared_norm = float(probs @ squared_score_norms(policy, logits))
    squared_gradient_norm = float(policy.exact_gradient(logits, rewards).square().sum())
    variance_at_mean = float(estimator_variance(policy, logits, rewards, mean_reward))
    rloo = variance_at_mean / group_size + (
        reward_variance * mean_squared_norm + squared_gradient_norm
    ) / (group_size * (group_size - 1))
    mean_self = (1 - 1 / group_size) ** 2 * rloo
    b_star = optimal_baseline(policy, logits, rewards)
    return {
        "oracle_optimal": float(estimator_variance(policy, logits, rewards, b_star)) / group_size,
        "oracle_mean": variance_at_mean / group_size,
        "rloo": rloo,
        "mean_self": mean_self,
        "mean_self_mse": mean_self + squared_gradient_norm / group_size**2,
    }


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


# -- the chapter's comparisons, built from the functions above --------------------------------


def baseline_cases(
    policy: SequencePolicy, logits: Tensor, peaked_logits: Tensor, num_rewarded: int
) -> dict[str, tuple[str, Tensor, Tensor]]:
    """The six (policy, reward) cases of section 2: key -> (label, logits, rewards), the rewards
    `(num_sequences,)`. `logits` is chapter 1's policy, `peaked_logits` a more confident one."""
    sum_mod = sum_mod_reward(policy.all_sequences(), policy.vocab_size)
    uniform = torch.zeros(policy.logits_shape, dtype=torch.float64)
    uncorrelated = uncorrelated_reward(policy, logits, sum_mod)
    rare = rank_reward(policy, logits, num_rewarded, rarest=True)
    likely = rank_reward(policy, logits, num_rewarded, rarest=False)
    return {
        "uniform": ("uniform policy, sum-mod reward", uniform, sum_mod),
        "chapter1": ("chapter 1 policy, sum-mod reward", logits, sum_mod),
        "uncorrelated": ("chapter 1 policy, uncorrelated reward", logits, uncorrelated),
        "peaked": ("peaked policy, sum-mod reward", peaked_logits, sum_mod),
        "rare": ("rare answers rewarded", logits, rare),
        "likely": ("likely answers rewarded", logits, likely),
    }


def gap_table(gaps: dict[str, dict], cases: dict):
    """`baseline_gap` of every case as a DataFrame indexed by the case labels, with the identity's
    right-hand side Cov / E||s||^2 next to the gap."""
    import pandas as pd

    table = pd.DataFrame({label: gaps[key] for key, (label, _, _) in cases.items()}).T
    table["Cov / E||s||^2"] = table["covariance"] / table["mean_squared_norm"]
    return table


def variance_curve(
    policy: SequencePolicy, logits: Tensor, rewards: Tensor, gap: dict, num_baselines: int
) -> tuple[Tensor, Tensor]:
    """Var[g_b] / Var[g_b*] at `num_baselines` constant baselines b around b*, in a window wide
    enough to show b*, E[r] and the parabola's curvature; `gap` is `baseline_gap`'s dict."""
    half_width = max(3 * abs(gap["gap"]), 0.1)
    baselines = torch.linspace(
        gap["optimal_baseline"] - half_width,
        gap["optimal_baseline"] + half_width,
        num_baselines,
        dtype=torch.float64,
    )
    variance = estimator_variance(policy, logits, rewards, baselines) / gap["variance_at_optimal"]
    return baselines, variance


def group_variance_table(
    policy: SequencePolicy,
    logits: Tensor,
    rewards: Tensor,
    group_sizes,
    num_groups: int,
    generator: torch.Generator,
):
    """`group_variances` at each G, next to the variance of `num_groups` sampled RLOO estimates
    (`sample_group_estimates`, G by G from one `generator`): a DataFrame indexed by G, with the
    ratios the chapter reads (Monte Carlo / closed form - 1, rloo / oracle E[r], mean-self MSE /
    rloo)."""
    import pandas as pd

    rows = []
    for size in group_sizes:
        closed = group_variances(policy, logits, rewards, size)
        estimates = sample_group_estimates(
            policy, logits, rewards, size, num_groups, generator, "rloo"
        )
        rows.append({"G": size, **closed, "rloo, Monte Carlo": float(estimates.var(dim=0).sum())})
    groups = pd.DataFrame(rows).set_index("G")
    groups["Monte Carlo / closed form - 1"] = groups["rloo, Monte Carlo"] / groups["rloo"] - 1
    groups["rloo / oracle E[r]"] = groups["rloo"] / groups["oracle_mean"]
    groups["mean-self MSE / rloo"] = groups["mean_self_mse"] / groups["rloo"]
    return groups


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


# -- verl's baselines, and where the KL penalty goes -------------------------------------------


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


def shrinkage_with_kl_cosine(
    true_gradient: Tensor, kl_gradient: Tensor, beta: float, group_size: int
) -> float:
    """cos((1 - 1/G) grad J - beta E[grad k], grad J - beta E[grad k]), both `(num_params,)`:
    the expected updates of the mean-including-self baseline and of RLOO with the KL estimate in
    the loss, which the shrinkage leaves out (1 without a KL term; chapter 8, section 6)."""
    shrunk = (1 - 1 / group_size) * true_gradient - beta * kl_gradient
    rloo = true_gradient - beta * kl_gradient
    return float(shrunk @ rloo / (shrunk.norm() * rloo.norm()))


def kl_placement(
    policy: SequencePolicy, logits: Tensor, ref_logits: Tensor, rewards: Tensor, beta: float
) -> dict[str, float]:
    """Where beta KL(pi || pi_ref) goes, exactly (module docstring). One-sample updates with the
    oracle baseline (the group baselines scale the mean as in section 3):

    reward: (r' - E r') s with r' = r - beta k1;  loss_k3 / loss_k1: (r - E r) s - beta grad k.

    Returns floats: "divergence" KL(pi || pi_ref); "reward_error"
    max |E[g] - (grad J - beta grad KL)|;
    "loss_k1_norm" ||E[grad k1]||; "loss_k3_cosine" cos(E[grad k3], grad KL); "loss_k3_ratio"
    ||E[grad k3]|| / ||grad KL||; "reward_variance", "loss_k3_variance": Var[g] over Var[g] at
    beta = 0 (E||g - E g||^2).
    """
    sequences = policy.all_sequences()
    probs = policy.probs(logits).detach()
    token_log_probs = policy.token_log_probs(logits, sequences)
    k1 = kl_penalty(token_log_probs, policy.token_log_probs(ref_logits, sequences), "k1").sum(1)
    theta = logits.detach().requires_grad_(True)
    ref_log_probs = policy.log_prob(ref_logits, sequences).detach()
    kl = exact_kl(policy.log_prob(theta, sequences), ref_log_probs)
    (grad_kl,) = torch.autograd.grad(kl, theta)
    grad_kl = grad_kl.flatten()
    scores = policy.scores(logits, sequences)

    def moments(estimates):  # (num_sequences, num_params) -> mean, E||g - E g||^2
        mean = probs @ estimates
        return mean, float(probs @ (estimates - mean).square().sum(dim=1))

    shaped = kl_in_reward(rewards[None], k1[None], beta)[0]
    plain_mean, plain_variance = moments((rewards - probs @ rewards)[:, None] * scores)
    reward_mean, reward_variance = moments((shaped - probs @ shaped)[:, None] * scores)
    k3 = kl_estimate_gradients(policy, logits, ref_logits, "k3")
    _, loss_variance = moments((rewards - probs @ rewards)[:, None] * scores - beta * k3)
    expected_k1 = probs @ kl_estimate_gradients(policy, logits, ref_logits, "k1")
    expected_k3 = probs @ k3
    return {
        "divergence": float(kl.detach()),
        "reward_error": float((reward_mean - (plain_mean - beta * grad_kl)).abs().max()),
        "loss_k1_norm": float(expected_k1.norm()),
        "loss_k3_cosine": float(expected_k3 @ grad_kl / (expected_k3.norm() * grad_kl.norm())),
        "loss_k3_ratio": float(expected_k3.norm() / grad_kl.norm()),
        "reward_variance": reward_variance / plain_variance,
        "loss_k3_variance": loss_variance / plain_variance,
    }
