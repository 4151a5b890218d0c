r"""Chapter 6: when is the group mean the best baseline?

The optimal constant baseline and the mean reward
-------------------------------------------------
For one sample, g_b = (r - b) s with s = grad log pi has variance (chapter 1)

    V(b) = E[(r - b)^2 ||s||^2] - ||grad J||^2,     minimised by  b* = E[||s||^2 r] / E[||s||^2].

Writing E[||s||^2 r] = E||s||^2 E[r] + Cov(||s||^2, r) gives the gap exactly,

    b* - E[r] = Cov(||s||^2, r) / E||s||^2,     V(E[r]) - V(b*) = E||s||^2 (b* - E[r])^2,

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

X is the oracle estimator with b = mu: E[X] = grad J, Var X = V(mu) / G. Y has mean zero
(s_i is independent of d_j and E[s] = 0) and is uncorrelated with X. In E||Y||^2 only the
pairings (i, j) = (k, l) and (i, j) = (l, k) survive, contributing Var(r) E||s||^2 and
E[d s] . E[d s] = ||grad J||^2 for each of the G (G - 1) pairs:

    Var[g_rloo] = V(mu) / G  +  (Var(r) E||s||^2 + ||grad J||^2) / (G (G - 1)).

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
"""

import torch
from torch import Tensor

from grpo_companion.core.policy_gradient import SequencePolicy, estimator_variance, optimal_baseline


def squared_score_norms(policy: SequencePolicy, logits: Tensor) -> Tensor:
    """||s(y)||^2 for every sequence, `(num_sequences,)`."""
    return policy.scores(logits, policy.all_sequences()).square().sum(dim=1)


def baseline_gap(policy: SequencePolicy, logits: Tensor, rewards: Tensor) -> dict[str, float]:
    """The optimal constant baseline against the mean reward, `rewards: (num_sequences,)`.

    Returns mean_reward E[r], optimal_baseline b*, gap b* - E[r], covariance Cov(||s||^2, r),
    correlation (their correlation coefficient; nan when either is constant, up to rounding),
    mean_squared_norm E||s||^2, variance_at_mean V(E[r]), variance_at_optimal V(b*) and
    excess_variance V(E[r]) / V(b*) - 1: what using the mean costs, relative to b*.
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

    r' = r - c (||s||^2 - E||s||^2) with c = Cov(||s||^2, r) / Var(||s||^2); `(num_sequences,)`.
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

    Returns oracle_optimal V(b*) / G and oracle_mean V(E[r]) / G (baselines known exactly),
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
    probs = policy.probs(logits).detach()
    return torch.stack(
        [_conditional_mean(policy, probs, rewards, step) for step in range(policy.length)], dim=1
    )


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
