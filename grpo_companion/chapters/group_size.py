r"""Chapter 8: the group size G, through the U-statistic view of GRPO's gradient.

The U-statistic
---------------
With the mean-including-self baseline (Dr. GRPO's advantage A_i = r_i - mean(r), i.e. GRPO with
``scale_rewards="none"``) and s = grad log pi,

    sum_i (r_i - mean r) s_i = (1/G) sum_{i != j} (r_i - r_j) s_i
                             = (1/G) sum_{i < j} (r_i - r_j)(s_i - s_j),

so the group's gradient estimate is

    g_mean = (1/G) sum_i A_i s_i = (1 - 1/G) U,     U = C(G, 2)^{-1} sum_{i < j} h(y_i, y_j),
    h(y, y') = (r - r') (s - s') / 2.

U is a U-statistic of order 2 with E[h] = E[r s] - E[r] E[s] = grad J: it is unbiased, and it is
exactly RLOO's estimator. Hoeffding's decomposition, with

    h_1(y) = E[h(y, Y')] - grad J = ((r - J) s - grad J) / 2,
    zeta_1 = E||h_1(Y)||^2,        zeta_2 = E||h(Y, Y') - grad J||^2,

gives Var(U) = C(G, 2)^{-1} [2 (G - 2) zeta_1 + zeta_2] (variances are traces of covariances,
as in chapter 1). Since 4 zeta_1 = Var((r - J) s) is one sample's variance with the oracle
baseline b = J (the true value),

    Var(U) - Var(oracle, G samples) = (2 zeta_2 - 4 zeta_1) / (G (G - 1)):

the group baseline costs O(1/G^2) over knowing the value, the "oracle property". The three
estimators of the chapter and their exact MSE at group size G, for one prompt:

    no baseline    (1/G) sum_i r_i s_i           MSE = Var(r s) / G
    oracle         (1/G) sum_i (r_i - J) s_i     MSE = 4 zeta_1 / G
    group mean     (1 - 1/G) U                   MSE = (1 - 1/G)^2 Var(U) + ||grad J||^2 / G^2

A fixed sampling budget
-----------------------
A step samples N = B x G completions: B prompts, a group of G for each. Prompts differ in pass
rate p. The model (`budget_moments`) is chapter 7's Bernoulli-logit prompt with one parameter
shared by all prompts, a skill theta with p_x = sigmoid(theta - difficulty_x), plus reward-
irrelevant score noise (`grpo_companion.core.exact`, "Score noise"). With m_x, v_x the mean and
variance of one prompt's group estimate and t_x = p_x (1 - p_x) its true gradient, the batch
estimate (1/B) sum_b g_b has

    MSE(G) = (E_x m_x - E_x t_x)^2 + (G / N) (E_x v_x + Var_x m_x).

The bias does not shrink with the budget; the rest does, like G / N. For an unbiased estimator
(m_x = t_x) the budget factors out: the best G is the same for every N. For RLOO,

    N MSE(G) = 4 zeta_1 + (2 zeta_2 - 4 zeta_1) / (G - 1) + G Var_x t_x    (zetas averaged over x),

minimised at G* = 1 + sqrt((2 zeta_2 - 4 zeta_1) / Var_x t_x) (`rloo_best_group_size`): a
budget-free "scaling law" that still depends on the pass-rate distribution (through Var_x t_x)
and on the score geometry (through the zetas).
"""

import math

import numpy as np
import torch
from torch import Tensor

from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.exact import estimator_moments
from grpo_companion.core.policy_gradient import SequencePolicy

# -- the U-statistic on a sampled group -------------------------------------------------------


def u_statistic(scores: Tensor, rewards: Tensor) -> Tensor:
    """U = C(G, 2)^{-1} sum_{i < j} (r_i - r_j)(s_i - s_j) / 2, pair by pair.

    `scores: (..., G, num_params)`, `rewards: (..., G)`; returns `(..., num_params)`. Built from
    the pairs on purpose (O(G^2)): it is the definition, against which the O(G) forms are tested.
    """
    group_size = rewards.shape[-1]
    reward_gaps = rewards[..., :, None] - rewards[..., None, :]  # (..., G, G)
    score_gaps = scores[..., :, None, :] - scores[..., None, :, :]  # (..., G, G, P)
    # Summing over ordered pairs i != j counts each pair twice: / 4 = / 2 (kernel) / 2 (twice).
    pair_sum = (reward_gaps[..., None] * score_gaps).sum(dim=(-3, -2)) / 4
    return pair_sum / math.comb(group_size, 2)


def estimator_advantages(rewards: Tensor, method: str, value=None, **options) -> Tensor:
    """Advantages `(..., G)` of the chapter's estimators.

    `method` in `grpo_companion.core.advantages.METHODS` goes to `group_advantages` with `options`;
    "no_baseline" is A = r and "oracle" A = r - value, with `value` the true value J of the
    group's prompt (a number, or a tensor broadcastable to `(..., 1)`).
    """
    if method == "no_baseline":
        return rewards
    if method == "oracle":
        if value is None:
            raise ValueError("method 'oracle' needs the true value J as value=...")
        return rewards - value
    flat = rewards.reshape(-1, rewards.shape[-1])
    return group_advantages(flat, method, **options).reshape(rewards.shape)


def group_gradient(
    scores: Tensor, rewards: Tensor, method: str = "dr_grpo", *, value=None, **options
) -> Tensor:
    """GRPO's per-group estimate g = (1/G) sum_i A_i s_i at ratio 1 (the first step on a batch).

    `scores: (..., G, num_params)`, `rewards: (..., G)`; returns `(..., num_params)`.
    """
    advantages = estimator_advantages(rewards, method, value, **options)
    return (advantages[..., None] * scores).mean(dim=-2)


def sample_group_gradients(
    policy: SequencePolicy,
    logits: Tensor,
    rewards: Tensor,
    group_size: int,
    num_groups: int,
    generator: torch.Generator,
    method: str = "dr_grpo",
    **options,
) -> Tensor:
    """`group_gradient` of `num_groups` independent groups of G sequences drawn from pi,
    `(num_groups, num_params)`; `rewards: (num_sequences,)` is the reward table.

    Each group's A_i / G are added onto the sequences it holds, `(num_groups, num_sequences)`,
    and one matmul with the score table gives every g: no `(num_groups, G, num_params)` tensor.
    """
    draws = policy.sample(logits, num_groups * group_size, generator).view(num_groups, group_size)
    value = float(policy.objective(logits, rewards)) if method == "oracle" else None
    advantages = estimator_advantages(rewards[draws], method, value, **options)
    per_sequence = torch.zeros(num_groups, policy.num_sequences, dtype=advantages.dtype)
    per_sequence.scatter_add_(1, draws, advantages / group_size)
    return per_sequence @ policy.scores(logits, policy.all_sequences())


# -- exact moments on the enumerable sequence policy ------------------------------------------


def kernel_variances(policy: SequencePolicy, logits: Tensor, rewards: Tensor) -> dict[str, float]:
    """Hoeffding's zeta_1 and zeta_2 of the kernel h, by enumerating every pair of sequences.

    Returns "zeta_1", "zeta_2", "value" (J) and "gradient_sq_norm" (||grad J||^2). Cost: one
    `(num_sequences, num_sequences, num_params)` tensor.
    """
    probs = policy.probs(logits).detach()
    scores = policy.scores(logits, policy.all_sequences())
    gradient = policy.exact_gradient(logits, rewards)
    reward_gaps = rewards[:, None, None] - rewards[None, :, None]
    centred = reward_gaps * (scores[:, None] - scores[None, :]) / 2 - gradient  # h - grad J
    zeta_2 = torch.einsum("i,j,ijp->", probs, probs, centred.square())
    first_projection = torch.einsum("j,ijp->ip", probs, centred)  # h_1(y) for every y
    zeta_1 = probs @ first_projection.square().sum(dim=1)
    return {
        "zeta_1": float(zeta_1),
        "zeta_2": float(zeta_2),
        "value": float(probs @ rewards),
        "gradient_sq_norm": float(gradient.square().sum()),
    }


def u_statistic_variance(zeta_1, zeta_2, group_size):
    """Var(U) = C(G, 2)^{-1} [2 (G - 2) zeta_1 + zeta_2]; broadcasts over numpy arrays."""
    group_size = np.asarray(group_size, dtype=np.float64)
    return (2 * (group_size - 2) * zeta_1 + zeta_2) / (group_size * (group_size - 1) / 2)


def reward_geometry(policy: SequencePolicy, logits: Tensor, rewards: Tensor) -> dict[str, float]:
    """What the moments of any binary-reward group estimator depend on (`grpo_companion.core.exact`).

    Returns "pass_rate" p = J; "kappa" = ||u||^2 with u = grad p / (p (1 - p)); and
    "noise_correct", "noise_incorrect": tr Cov(s | r) for r = 1 and r = 0, divided by kappa
    (the `score_noise` of `estimator_moments`). `rewards` must be binary and 0 < p < 1.
    """
    if not ((rewards == 0) | (rewards == 1)).all():
        raise ValueError("reward_geometry needs binary rewards in {0, 1}")
    probs = policy.probs(logits).detach()
    p = float(probs @ rewards)
    if not 0 < p < 1:
        raise ValueError(f"need 0 < pass rate < 1, got {p}")
    squared_norms = policy.scores(logits, policy.all_sequences()).square().sum(dim=1)
    gradient_sq_norm = float(policy.exact_gradient(logits, rewards).square().sum())
    kappa = gradient_sq_norm / (p * (1 - p)) ** 2
    # E[||s||^2 | r] - ||E[s | r]||^2, with E[s | 1] = grad p / p and E[s | 0] = -grad p / (1 - p).
    noise_correct = float((probs * rewards) @ squared_norms) / p - gradient_sq_norm / p**2
    noise_incorrect = (
        float((probs * (1 - rewards)) @ squared_norms) / (1 - p) - gradient_sq_norm / (1 - p) ** 2
    )
    return {
        "pass_rate": p,
        "kappa": kappa,
        "noise_correct": noise_correct / kappa,
        "noise_incorrect": noise_incorrect / kappa,
    }


def sequence_policy_moments(
    policy: SequencePolicy,
    logits: Tensor,
    rewards: Tensor,
    group_size: int,
    method: str = "dr_grpo",
    **options,
) -> dict[str, float]:
    """Exact moments of one group's estimate on the sequence policy, in O(G) (no enumeration of
    groups): `estimator_moments` on the policy's `reward_geometry`, rescaled by kappa.

    Returns "weight" (E[g] = weight * grad J), "variance" (trace), "bias_sq"
    (||E[g] - grad J||^2) and "mse". `method`: `grpo_companion.core.advantages.METHODS` or
    `grpo_companion.core.exact.GROUP_FREE`.
    """
    geometry = reward_geometry(policy, logits, rewards)
    noise = (geometry["noise_correct"], geometry["noise_incorrect"])
    moments = estimator_moments(
        geometry["pass_rate"], group_size, method, score_noise=noise, **options
    )
    kappa = geometry["kappa"]
    return {
        "weight": float(moments["weight"][0]),
        "variance": kappa * float(moments["variance"][0]),
        "bias_sq": kappa * float(moments["bias"][0] ** 2),
        "mse": kappa * float(moments["mse"][0]),
    }


# -- a fixed budget N = B x G over prompts of different difficulty ----------------------------


def budget_moments(
    pass_rates, weights, group_size, budget, method="dr_grpo", *, score_noise=0.0, **options
):
    """Exact squared bias, variance and MSE of a batch estimate with B = budget / G prompts.

    The shared-skill model of the module docstring: prompt pass rates p = pass_rates[j] with
    probability weights[j] (e.g. `grpo_companion.core.exact.beta_quadrature`), one group of G per
    prompt, the true gradient E_x[p_x (1 - p_x)]. `budget` N may be a number or an array; B
    need not be an integer (the formula for B prompts, at B = N / G).

    Returns: dict "bias_sq" (float), "variance" and "mse" (floats, or arrays shaped like budget).
    """
    weights = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    pass_rates = np.asarray(pass_rates, dtype=np.float64)
    moments = estimator_moments(pass_rates, group_size, method, score_noise=score_noise, **options)
    true_gradient = weights @ (pass_rates * (1 - pass_rates))
    mean = weights @ moments["mean"]
    # One prompt's E||g_b - E g||^2: its own noise plus how far its mean sits from the others'.
    spread = weights @ moments["variance"] + weights @ (moments["mean"] - mean) ** 2
    bias_sq = float((mean - true_gradient) ** 2)
    variance = spread * group_size / np.asarray(budget, dtype=np.float64)
    return {"bias_sq": bias_sq, "variance": variance, "mse": bias_sq + variance}


def best_group_size(pass_rates, weights, budgets, group_sizes, method="dr_grpo", **kwargs):
    """For each budget N, the G in `group_sizes` with the least `budget_moments` MSE.

    Returns: best, (len(budgets),) ints, and mse, (len(budgets), len(group_sizes)), with inf
    where G > N (fewer than one prompt).
    """
    budgets = np.atleast_1d(np.asarray(budgets, dtype=np.float64))
    mse = np.stack(
        [
            budget_moments(pass_rates, weights, G, budgets, method, **kwargs)["mse"]
            for G in group_sizes
        ],
        axis=1,
    )
    mse[budgets[:, None] < np.asarray(group_sizes)[None, :]] = np.inf
    return np.asarray(group_sizes)[np.argmin(mse, axis=1)], mse


def rloo_best_group_size(pass_rates, weights, *, score_noise=0.0):
    """G* = 1 + sqrt((2 zeta_2 - 4 zeta_1) / Var_x t_x) for RLOO (module docstring), real-valued.

    The zetas come from exact moments: 4 zeta_1 is the oracle's one-sample variance and zeta_2
    the variance of RLOO with G = 2 (U with a single pair is the kernel itself).
    """
    weights = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    pass_rates = np.asarray(pass_rates, dtype=np.float64)
    oracle = estimator_moments(pass_rates, 1, "oracle", score_noise=score_noise)
    pair = estimator_moments(pass_rates, 2, "rloo", score_noise=score_noise)
    four_zeta_1, zeta_2 = weights @ oracle["variance"], weights @ pair["variance"]
    true_gradients = pass_rates * (1 - pass_rates)
    between_prompts = weights @ (true_gradients - weights @ true_gradients) ** 2
    return 1 + float(np.sqrt((2 * zeta_2 - four_zeta_1) / between_prompts))


def sample_batch_errors(
    pass_rate_sampler,
    group_size,
    budget,
    num_batches,
    rng,
    method="dr_grpo",
    *,
    true_gradient,
    score_noise=0.0,
    **options,
):
    """Squared errors ||g_batch - grad J||^2 of `num_batches` sampled batches: (num_batches,).

    The model of `budget_moments`, with B = budget // G prompts. `pass_rate_sampler(rng, size)`
    draws prompt pass rates (e.g. a Beta), `true_gradient` is E_x[p_x (1 - p_x)] of that
    distribution. Each completion's score is (r - p, eps) with eps ~ N(0, score_noise): only the
    noise's variance enters the MSE.
    """
    num_prompts = budget // group_size
    pass_rates = pass_rate_sampler(rng, (num_batches, num_prompts, 1))
    rewards = (rng.random((num_batches, num_prompts, group_size)) < pass_rates).astype(np.float64)
    advantages = estimator_advantages(
        torch.from_numpy(rewards), method, value=torch.from_numpy(pass_rates), **options
    ).numpy()
    noise = rng.normal(0.0, np.sqrt(score_noise), rewards.shape)
    skill = (advantages * (rewards - pass_rates)).mean(axis=2).mean(axis=1)
    style = (advantages * noise).mean(axis=2).mean(axis=1)
    return (skill - true_gradient) ** 2 + style**2
