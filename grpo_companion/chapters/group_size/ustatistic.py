r"""Chapter 10: the group size G, through the U-statistic view of GRPO's gradient.

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
rate p. The model (`budget_moments`) is chapter 9's Bernoulli-logit prompt with one parameter
shared by all prompts, a skill theta with p_x = sigmoid(theta - difficulty_x), plus reward-
irrelevant score noise (`grpo_companion.core.exact`, "Score noise"). With m_x, sigma_x^2 the mean
and variance of one prompt's group estimate and t_x = p_x (1 - p_x) its true gradient, the batch
estimate (1/B) sum_b g_b has

    MSE(G) = (E_x m_x - E_x t_x)^2 + (G / N) (E_x sigma_x^2 + Var_x m_x).

The bias does not shrink with the budget; the rest does, like G / N. For an unbiased estimator
(m_x = t_x) the budget factors out: the best G is the same for every N. For RLOO,

    N MSE(G) = 4 zeta_1 + (2 zeta_2 - 4 zeta_1) / (G - 1) + G Var_x t_x    (zetas averaged over x),

minimised at G* = 1 + sqrt((2 zeta_2 - 4 zeta_1) / Var_x t_x) (`rloo_best_group_size`): a
budget-free "scaling law" that still depends on the pass-rate distribution (through Var_x t_x)
and on the score geometry (through the zetas). With score noise v, a prompt's pair noise is
2 zeta_2 - 4 zeta_1 = Var(r) E||s||^2 + ||grad J||^2 = t_x (t_x + v) + t_x^2 (chapter 8's
leave-one-out term), so G* = 1 + sqrt((2 E_x t_x^2 + v E_x t_x) / Var_x t_x)
(`bernoulli_g_star`): it grows like sqrt(v).
"""

import math

import numpy as np
import torch
from torch import Tensor

from grpo_companion.core.exact import (
    GROUP_FREE,
    beta_quadrature,
    estimator_moments,
    reward_geometry,
)
from grpo_companion.core.group_estimators import (
    estimator_advantages,
    group_gradient,
    sample_group_estimates,
)
from grpo_companion.core.policy_gradient import SequencePolicy

# The estimators of the chapter: label -> method of `estimator_advantages` / `estimator_moments`.
ESTIMATORS = {
    "no baseline": "no_baseline",
    "oracle, b = J": "oracle",
    "group mean": "dr_grpo",
    "RLOO = U": "rloo",
    "GRPO (std)": "grpo",
}
# The budget comparison leaves GRPO's std out: it rescales prompts, a separate question (ch. 9).
BUDGET_ESTIMATORS = {label: method for label, method in ESTIMATORS.items() if method != "grpo"}

# -- the U-statistic on a sampled group -------------------------------------------------------


def u_statistic(scores: Tensor, rewards: Tensor) -> Tensor:
    """U = C(G, 2)^{-1} sum_{i < j} (r_i - r_j)(s_i - s_j) / 2, pair by pair.

    Chapter: :doc:`/book/10_group_size`

    `scores: (..., G, num_params)`, `rewards: (..., G)`; returns `(..., num_params)`. Built from
    the pairs on purpose (O(G^2)): it is the definition, against which the O(G) forms are tested.
    """
    group_size = rewards.shape[-1]
    reward_gaps = rewards[..., :, None] - rewards[..., None, :]  # (..., G, G)
    score_gaps = scores[..., :, None, :] - scores[..., None, :, :]  # (..., G, G, P)
    # Summing over ordered pairs i != j counts each pair twice: / 4 = / 2 (kernel) / 2 (twice).
    pair_sum = (reward_gaps[..., None] * score_gaps).sum(dim=(-3, -2)) / 4
    return pair_sum / math.comb(group_size, 2)


def u_statistic_identity_error(
    policy: SequencePolicy,
    logits: Tensor,
    rewards: Tensor,
    group_sizes,
    num_groups: int,
    generator: torch.Generator,
) -> float:
    """Largest |entry| of g_mean - (1 - 1/G) U and g_rloo - U over `num_groups` sampled groups
    at each G in `group_sizes` (drawn in that order): zero up to rounding.

    `rewards: (num_sequences,)` is the reward table; g is `group_gradient` of the group's
    advantages, U the pairwise `u_statistic`.
    """
    score_table = policy.scores(logits, policy.all_sequences())
    largest_gap = 0.0
    for G in group_sizes:
        draws = policy.sample(logits, num_groups * G, generator).view(num_groups, G)
        scores, group_rewards = score_table[draws], rewards[draws]
        u = u_statistic(scores, group_rewards)
        mean_self = group_gradient(scores, estimator_advantages(group_rewards, "dr_grpo"))
        rloo = group_gradient(scores, estimator_advantages(group_rewards, "rloo"))
        gaps = [mean_self - (1 - 1 / G) * u, rloo - u]
        largest_gap = max(largest_gap, *(float(gap.abs().max()) for gap in gaps))
    return largest_gap


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


def kernel_table(kernel: dict, variance_oracle: float, variance_no_baseline: float):
    """`kernel_variances` next to chapter 1's one-sample variances Var[g_J] (oracle) and
    Var[g_0] (no baseline): a one-column DataFrame, 4 zeta_1 = Var[g_J] to rounding."""
    import pandas as pd

    return pd.Series(
        {
            "J (pass rate)": kernel["value"],
            "zeta_1": kernel["zeta_1"],
            "zeta_2": kernel["zeta_2"],
            "4 zeta_1": 4 * kernel["zeta_1"],
            "Var[g_J], chapter 1": variance_oracle,
            "Var[g_0], chapter 1": variance_no_baseline,
            "||grad J||^2": kernel["gradient_sq_norm"],
        },
        name="value",
    ).to_frame()


def u_statistic_variance(zeta_1, zeta_2, group_size):
    """Var(U) = C(G, 2)^{-1} [2 (G - 2) zeta_1 + zeta_2]; broadcasts over numpy arrays."""
    group_size = np.asarray(group_size, dtype=np.float64)
    return (2 * (group_size - 2) * zeta_1 + zeta_2) / (group_size * (group_size - 1) / 2)


def closed_form_mse(kernel: dict, variance_no_baseline: float, group_sizes) -> dict:
    """The MSE column of the module docstring's table, for each G: label -> `(len(group_sizes),)`.

    `kernel` is `kernel_variances`'s dict, `variance_no_baseline` chapter 1's Var[g_0] = Var(r s)
    of one sample. GRPO with its std has no such closed form and is left out.
    """
    G = np.asarray(group_sizes, dtype=np.float64)
    variance_u = u_statistic_variance(kernel["zeta_1"], kernel["zeta_2"], G)
    return {
        "no baseline": variance_no_baseline / G,
        "oracle, b = J": 4 * kernel["zeta_1"] / G,
        "group mean": (1 - 1 / G) ** 2 * variance_u + kernel["gradient_sq_norm"] / G**2,
        "RLOO = U": variance_u,
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


def exact_mse(policy, logits, rewards, group_sizes, estimators=ESTIMATORS) -> dict:
    """`sequence_policy_moments`'s MSE for each G: label -> `(len(group_sizes),)`."""
    return {
        label: np.array(
            [
                sequence_policy_moments(policy, logits, rewards, G, method)["mse"]
                for G in group_sizes
            ]
        )
        for label, method in estimators.items()
    }


def sampled_mse(
    policy, logits, rewards, group_sizes, num_groups, generator, estimators=ESTIMATORS
) -> dict:
    """Monte Carlo MSE E||g - grad J||^2 from `num_groups` groups at each G (label by label,
    then G by G, from one `generator`): label -> (mean, standard error), each
    `(len(group_sizes),)`."""
    gradient = policy.exact_gradient(logits, rewards)
    sampled = {}
    for label, method in estimators.items():
        estimates = [
            sample_group_estimates(policy, logits, rewards, G, num_groups, generator, method)
            for G in group_sizes
        ]
        errors = [(estimate - gradient).square().sum(dim=1) for estimate in estimates]
        sampled[label] = (
            np.array([float(e.mean()) for e in errors]),
            np.array([float(e.std()) for e in errors]) / np.sqrt(num_groups),
        )
    return sampled


def max_relative_gap(curves: dict, references: dict) -> float:
    """max over labels and points of |curves[label] / references[label] - 1|."""
    return float(max(np.max(np.abs(curves[label] / ref - 1)) for label, ref in references.items()))


def z_scores(sampled: dict, exact: dict) -> np.ndarray:
    """(Monte Carlo mean - exact) / standard error, every label's points concatenated."""
    return np.concatenate(
        [
            (mean - exact[label]) / standard_error
            for label, (mean, standard_error) in sampled.items()
        ]
    )


# -- a fixed budget N = B x G over prompts of different difficulty ----------------------------


def smallest_group_size(method: str) -> int:
    """1 for the group-free baselines, 2 for a baseline built from the group."""
    return 1 if method in GROUP_FREE else 2


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


def budget_mse_curves(pass_rates, weights, group_sizes, budget, estimators, *, score_noise=0.0):
    """`budget_moments`'s MSE at budget N for each G: label -> `(len(group_sizes),)`, nan where
    G is below the estimator's `smallest_group_size`."""
    return {
        label: np.array(
            [
                budget_moments(pass_rates, weights, G, budget, method, score_noise=score_noise)[
                    "mse"
                ]
                if G >= smallest_group_size(method)
                else np.nan
                for G in group_sizes
            ]
        )
        for label, method in estimators.items()
    }


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


def best_group_sizes(pass_rates, weights, budgets, max_group_size, estimators, **kwargs) -> dict:
    """`best_group_size` searched over every integer G from the estimator's
    `smallest_group_size` to `max_group_size`: label -> {budget: best G}."""
    best = {}
    for label, method in estimators.items():
        search = list(range(smallest_group_size(method), max_group_size + 1))
        best_sizes, _ = best_group_size(pass_rates, weights, budgets, search, method, **kwargs)
        best[label] = dict(zip(budgets, best_sizes.tolist(), strict=True))
    return best


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


def bernoulli_g_star(pass_rates, weights, *, score_noise=0.0) -> float:
    """G* = 1 + sqrt((2 E_x t_x^2 + v E_x t_x) / Var_x t_x), t_x = p_x (1 - p_x), v =
    `score_noise`: `rloo_best_group_size` in closed form for the shared-skill Bernoulli-logit
    prompts, whose pair noise is 2 zeta_2 - 4 zeta_1 = t_x (t_x + v) + t_x^2 per prompt (derived
    in chapter 10, section 3). `pass_rates` with probabilities `weights`, as there."""
    weights = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    t = np.asarray(pass_rates, dtype=np.float64) * (1 - np.asarray(pass_rates, dtype=np.float64))
    mean_t = weights @ t
    return 1 + float(
        np.sqrt((2 * weights @ t**2 + score_noise * mean_t) / (weights @ (t - mean_t) ** 2))
    )


def beta_with_mean(mean, concentration, num_nodes=128):
    """`beta_quadrature` of the Beta(a, b) with a / (a + b) = mean and a + b = concentration."""
    return beta_quadrature(mean * concentration, (1 - mean) * concentration, num_nodes)


def rloo_best_group_size_table(means, concentrations, *, score_noise=0.0) -> np.ndarray:
    """`rloo_best_group_size` for Beta pass rates of each mean (columns) and concentration a + b
    (rows): `(len(concentrations), len(means))`."""
    return np.array(
        [
            [
                rloo_best_group_size(*beta_with_mean(mean, concentration), score_noise=score_noise)
                for mean in means
            ]
            for concentration in concentrations
        ]
    )


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


def budget_monte_carlo(
    pass_rates, weights, beta, group_sizes, budget, num_batches, rng, estimators, **kwargs
):
    """Monte Carlo check of `budget_moments` at budget N: `sample_batch_errors` with pass rates
    ~ Beta(*beta), for each estimator then each G in `group_sizes` (one `rng`, in that order).

    `pass_rates`, `weights` are the quadrature of that Beta (`beta_quadrature`), which gives the
    true gradient and the exact MSEs. Returns: label -> list of `(num_batches,)` squared errors,
    and the z-scores (mean - exact MSE) / standard error of every point, a list.
    """
    true_gradient = float(weights @ (pass_rates * (1 - pass_rates)))

    def beta_sampler(generator, size):
        return generator.beta(*beta, size)

    checks = {
        label: [
            sample_batch_errors(
                beta_sampler, G, budget, num_batches, rng, method, true_gradient=true_gradient,
                **kwargs,
            )
            for G in group_sizes
        ]
        for label, method in estimators.items()
    }  # fmt: skip
    exact = budget_mse_curves(pass_rates, weights, group_sizes, budget, estimators, **kwargs)
    z = [
        (errors.mean() - mse) / (errors.std() / np.sqrt(num_batches))
        for label, errors_by_size in checks.items()
        for errors, mse in zip(errors_by_size, exact[label], strict=True)
    ]
    return checks, z


def budget_optima(pass_rates, weights, best: dict, budget, estimators, **kwargs) -> dict:
    """The best G at budget N and its `budget_moments` MSE: label -> (G, mse); `best` is
    `best_group_sizes`'s dict."""
    return {
        label: (
            best[label][budget],
            budget_moments(pass_rates, weights, best[label][budget], budget, method, **kwargs)[
                "mse"
            ],
        )
        for label, method in estimators.items()
    }


def oracle_property_summary(exact: dict, group_sizes) -> dict[str, float]:
    """How far RLOO and the group mean sit from the oracle, from `exact_mse`'s curves: RLOO's
    relative excess MSE at the smallest and largest G, that excess times the largest G, and the
    group mean's MSE over the oracle's at the smallest G."""
    rloo_excess = exact["RLOO = U"] / exact["oracle, b = J"] - 1
    group_mean_over_oracle = exact["group mean"] / exact["oracle, b = J"]
    return {
        "rloo_excess_smallest": float(rloo_excess[0]),
        "rloo_excess_largest": float(rloo_excess[-1]),
        "rloo_excess_times_g_largest": float(rloo_excess[-1] * group_sizes[-1]),
        "group_mean_over_oracle_smallest": float(group_mean_over_oracle[0]),
    }
