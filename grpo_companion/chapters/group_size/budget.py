r"""Which group size is best at a fixed sampling budget N = B x G, over prompts of different
difficulty, exactly.

A step samples N completions: B = N / G prompts with a group of G each. The model is chapter 9's
Bernoulli-logit prompt with one parameter shared by all prompts, a skill theta with pass rate
p_x = sigmoid(theta - difficulty_x), plus reward-irrelevant score noise v
(`grpo_companion.core.exact`, "Score noise"); the pass rates are quadrature nodes with
probability weights (`grpo_companion.core.exact.beta_quadrature`, `beta_with_mean`).
`budget_moments` gives a batch estimate's exact squared bias, variance and MSE, `best_group_size`
and `best_group_sizes` search the best G at each budget, and `rloo_best_group_size` and
`bernoulli_g_star` give RLOO's budget-free optimum G* = 1 + sqrt((2 zeta_2 - 4 zeta_1) /
Var_x t_x), t_x = p_x (1 - p_x), the zetas those of `grpo_companion.chapters.group_size.ustatistic`
averaged over prompts. `sample_batch_errors` and `budget_monte_carlo` check the exact moments on
sampled batches.

Chapter: :doc:`/book/10_group_size` (section 3: a fixed budget N = B x G, and whether the best G
is universal)
"""

import numpy as np
import torch

from grpo_companion.chapters.group_size.ustatistic import ESTIMATORS
from grpo_companion.core.exact import GROUP_FREE, beta_quadrature, estimator_moments
from grpo_companion.core.group_estimators import estimator_advantages

# The budget comparison leaves GRPO's std out: it rescales prompts, a separate question (ch. 9).
BUDGET_ESTIMATORS = {label: method for label, method in ESTIMATORS.items() if method != "grpo"}


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
    """G* = 1 + sqrt((2 zeta_2 - 4 zeta_1) / Var_x t_x) for RLOO (chapter 10, section 3),
    real-valued.

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
