r"""Exact moments of a group estimator under a binary reward, as functions of the pass rate p.

One of three exact treatments of g = (1/G) sum_i A_i s_i, none a duplicate of another: here the
reward is binary, so g depends on a group only through its number of correct completions
k ~ Binomial(G, p) and every moment is a sum over k = 0..G, for any policy (the mean) and for
the Bernoulli-logit prompt plus score noise (the variance).
`core.group_estimators.group_estimator_moments` instead enumerates every group of an enumerable
`SequencePolicy` (any reward table), and `chapters.group_size.ustatistic` gives the moments of
the U-statistic view of chapter 10.

Chapter: :doc:`/book/09_advantage_zoo` (section 0: the weight w(p) and the reduction of any
binary-reward policy to the Bernoulli-logit prompt with score noise; section 2: the error at the
best step; section 3: Sign and pass@G; section 6: the batch-coupled methods in the limit of
many prompts). w(p) is derived in :doc:`/book/02_group_baseline`, section 3.

`estimator_moments` gives the mean, variance, bias, MSE and w(p) per pass rate;
`degenerate_contributions` splits E[g] by the group's outcome; `average_over_pass_rates` and
`best_step_error` average over prompts, with `beta_quadrature` for Beta-distributed pass rates;
`batch_limit_scale` is the many-prompt limit of `BATCH_METHODS`. Only per-group options are
supported: scale_rewards="batch" couples the groups of a batch and has no per-prompt law.
`degenerate_rate` is the one home of f(p) = p^G + (1 - p)^G (:doc:`/book/06_sparsity`).
"""

import numpy as np
import torch
from scipy.special import roots_jacobi
from scipy.stats import binom

from grpo_companion.core.advantages import BATCH_METHODS, METHODS, group_advantages
from grpo_companion.core.policy_gradient import SequencePolicy

# Baselines that do not look at the group: REINFORCE, and the true value p as baseline.
GROUP_FREE = ("no_baseline", "oracle")


def binary_group_advantages(group_size, method="grpo", **options):
    """Advantages (a_correct, a_incorrect) in a binary group with k = 0..G correct.

    Row k of the canonical rewards, shape (G + 1, G), is k ones then G - k zeros; the methods
    are permutation-equivariant, so its first and last entries are a_c(k) and a_i(k).
    `options` are passed to `group_advantages`.

    Returns: a_correct, a_incorrect, float64 arrays of shape (G + 1,); a_correct[0] and
    a_incorrect[G] are nan (no such completion in the group).
    """
    group_size = check_group_size(group_size)
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS + GROUP_FREE}")
    if method in BATCH_METHODS:
        raise ValueError(
            f"{method!r} couples the groups of a batch: use estimator_moments with "
            "batch_pass_rates=(values, weights), its many-prompt limit"
        )
    if options.get("scale_rewards") == "batch":
        raise ValueError(
            "scale_rewards='batch' couples the groups of a batch; exact moments support only "
            "the per-group options 'group' and 'none'"
        )
    successes = np.arange(group_size + 1)
    rewards = (np.arange(group_size) < successes[:, None]).astype(np.float64)
    advantages = group_advantages(torch.from_numpy(rewards), method, **options).numpy()
    a_correct = np.where(successes > 0, advantages[:, 0], np.nan)
    a_incorrect = np.where(successes < group_size, advantages[:, -1], np.nan)
    return a_correct, a_incorrect


def estimator_moments(
    pass_rates,
    group_size,
    method="grpo",
    *,
    filter_degenerate=False,
    per_drawn_group=False,
    score_noise=0.0,
    **options,
):
    """Exact moments of a group estimator under a binary reward, per pass rate p: sums over
    k ~ Binomial(G, p), not over groups (that is `group_estimators.group_estimator_moments`).

    On the Bernoulli-logit prompt g = (1/G) sum_i A_i s_i is g(k) = (k a_c(k) (1 - p) -
    (G - k) a_i(k) p) / G, with a_c, a_i of `binary_group_advantages`.

    Chapter: :doc:`/book/02_group_baseline` (section 3), :doc:`/book/09_advantage_zoo` (section 0)

    Args:
        pass_rates: (P,) or scalar, values in [0, 1].
        group_size: G >= 2 (G >= 1 for the `GROUP_FREE` baselines).
        method: one of `grpo_companion.core.advantages.METHODS` or `GROUP_FREE`.
        filter_degenerate: drop groups with k = 0 or k = G (Reinforce-Rej / DAPO): moments of
            one kept group, the binomial weights renormalised over 0 < k < G (nan at p in {0, 1}).
        per_drawn_group: with filter_degenerate, moments per drawn group (a dropped group is a
            zero update) instead of per kept group.
        score_noise: v, or (v_correct, v_incorrect): the trace of the score's covariance within
            each reward class, in units of ||u||^2 (chapter 9, section 0). 0 is the plain
            Bernoulli-logit prompt.
        options: per-group options of `group_advantages` (eps, unbiased_std, temperature, ...).

    Returns: dict of float64 arrays of shape (P,): mean, variance, bias, mse, weight (E[g] over
    p (1 - p), nan at p in {0, 1}) and degenerate_rate = p^G + (1 - p)^G.
    """
    p = check_pass_rates(pass_rates)[:, None]
    if per_drawn_group and not filter_degenerate:
        raise ValueError("per_drawn_group=True only makes sense with filter_degenerate=True")
    estimates, squared_noise = _conditional_moments(p, group_size, method, score_noise, **options)
    k = np.arange(estimates.shape[1])
    probs = binom.pmf(k, group_size, p)  # (P, G + 1)
    degenerate_rate = probs[:, 0] + probs[:, -1]
    if per_drawn_group:  # a dropped group is drawn, and updates nothing
        estimates[:, [0, -1]] = squared_noise[:, [0, -1]] = 0.0
    elif filter_degenerate:
        probs[:, [0, -1]] = 0.0
        # Sum the kept terms instead of 1 - degenerate_rate: no cancellation near 0 or 1.
        with np.errstate(invalid="ignore"):
            probs /= probs.sum(axis=1, keepdims=True)
    mean = (probs * estimates).sum(axis=1)
    variance = (probs * ((estimates - mean[:, None]) ** 2 + squared_noise)).sum(axis=1)
    true_gradient = (p * (1 - p))[:, 0]
    bias = mean - true_gradient
    with np.errstate(invalid="ignore", divide="ignore"):
        weight = mean / true_gradient
    return {
        "mean": mean,
        "variance": variance,
        "bias": bias,
        "mse": variance + bias**2,
        "weight": weight,
        "degenerate_rate": degenerate_rate,
    }


def reward_geometry(policy: SequencePolicy, logits: torch.Tensor, rewards: torch.Tensor) -> dict:
    """What the moments of any binary-reward group estimator depend on (chapter 9, section 0).

    `rewards: (num_sequences,)`, binary, with 0 < p < 1. Returns floats: "pass_rate" p = J;
    "kappa" = ||u||^2 with u = grad p / (p (1 - p)); and "noise_correct", "noise_incorrect":
    tr Cov(s | r) for r = 1 and r = 0, divided by kappa (the `score_noise` of
    `estimator_moments`).
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


def degenerate_contributions(pass_rates, group_size, method="grpo", **options):
    """How E[g] splits over the outcome of the group, for each pass rate p.

    Returns: dict of float64 arrays of shape (P,): "all_incorrect" = E[g 1{k = 0}],
    "all_correct" = E[g 1{k = G}] and "mixed" = E[g 1{0 < k < G}]; they sum to E[g]. For "sign",
    all_incorrect is grad pass@G / G and all_correct is grad p^G / G (chapter 9, section 3).
    """
    p = check_pass_rates(pass_rates)[:, None]
    estimates, _ = _conditional_moments(p, group_size, method, 0.0, **options)
    probs = binom.pmf(np.arange(estimates.shape[1]), group_size, p)
    contributions = probs * estimates
    return {
        "all_incorrect": contributions[:, 0],
        "all_correct": contributions[:, -1],
        "mixed": contributions[:, 1:-1].sum(axis=1),
    }


def _conditional_moments(p, group_size, method, score_noise, **options):
    """g(k) and tr Cov(g | k) from score noise, each (P, G + 1), for p of shape (P, 1)."""
    if method in GROUP_FREE:
        group_size = check_group_size(group_size, minimum=1)
        ones = np.ones((1, group_size + 1))
        baseline = 0.0 if method == "no_baseline" else p
        a_correct, a_incorrect = (1 - baseline) * ones, -baseline * ones
    elif method in BATCH_METHODS:
        if "batch_pass_rates" not in options:
            raise ValueError(
                f"{method!r} needs batch_pass_rates=(values, weights), the prior "
                "of the batch's pass rates"
            )
        scale = batch_limit_scale(method, group_size, *options.pop("batch_pass_rates"))
        a_correct, a_incorrect = binary_group_advantages(group_size, "dr_grpo", **options)
        a_correct, a_incorrect = scale * a_correct, scale * a_incorrect
    else:
        a_correct, a_incorrect = binary_group_advantages(group_size, method, **options)
    noise = np.broadcast_to(np.asarray(score_noise, dtype=np.float64), (2,))
    noise_correct, noise_incorrect = noise
    if noise_correct < 0 or noise_incorrect < 0:
        raise ValueError(f"score_noise must be >= 0, got {score_noise}")
    k = np.arange(group_size + 1)
    # The undefined advantages (nan) enter with multiplicity k = 0 or G - k = 0.
    correct = np.where(k > 0, k * a_correct, 0.0)
    incorrect = np.where(k < group_size, (group_size - k) * a_incorrect, 0.0)
    estimates = (correct * (1 - p) - incorrect * p) / group_size
    squared_noise = (
        np.where(k > 0, correct * a_correct, 0.0) * noise_correct
        + np.where(k < group_size, incorrect * a_incorrect, 0.0) * noise_incorrect
    )
    return estimates, np.broadcast_to(squared_noise / group_size**2, estimates.shape).copy()


def batch_limit_scale(method, group_size, pass_rates, weights):
    """c(G) of a `BATCH_METHODS` method in a batch of infinitely many prompts whose pass rates are
    `pass_rates` (P,) with probabilities `weights` (P,): its advantages are c(G) times Dr. GRPO's
    (chapter 9, section 6). "gpg": 1 / E_p[p] (GPG's B G / number correct);
    "reinforce_plus_plus_baseline": 1 / sqrt(E_p[(1 - 1/G) p (1 - p)] + 1e-8), the batch std of
    the group-centred rewards, whose batch mean is exactly 0."""
    group_size = check_group_size(group_size)
    pass_rates, weights = check_pass_rates(pass_rates), _check_weights(weights, pass_rates)
    if method == "gpg":
        return float(1 / (weights @ pass_rates))
    if method == "reinforce_plus_plus_baseline":
        variance = (1 - 1 / group_size) * (weights @ (pass_rates * (1 - pass_rates)))
        return float(1 / np.sqrt(variance + 1e-8))
    raise ValueError(f"no batch limit for {method!r}; expected one of {BATCH_METHODS}")


def average_over_pass_rates(pass_rates, weights, group_size, method="grpo", **kwargs):
    """E_p of every entry of `estimator_moments`, for p = pass_rates[j] with prob. weights[j].

    Args:
        pass_rates: (P,) values in [0, 1].
        weights: (P,) non-negative, normalised here to sum to 1.
        kwargs: forwarded to `estimator_moments` (filter_degenerate and advantage options).

    Returns: dict of floats with the keys of `estimator_moments`. Each is the plain prompt
    average; with filter_degenerate, prompts are not reweighted by their keep rate. With
    `beta_quadrature` nodes, unfiltered moments (polynomials of degree <= 2G + 2) are exact; the
    filtered weight grows like 1 / (p (1 - p)), so its Beta average is infinite for a <= 1 or
    b <= 1: average the mean instead.
    """
    pass_rates, weights = check_pass_rates(pass_rates), _check_weights(weights, pass_rates)
    moments = estimator_moments(pass_rates, group_size, method, **kwargs)
    return {key: float(weights @ value) for key, value in moments.items()}


def best_step_error(pass_rates, weights, group_size, method="grpo", **kwargs):
    """How close c g comes to the true gradient at the best step size c, over many prompts
    (chapter 9, section 2).

    Prompt j (probability weights[j]) has its own logit, so its true-gradient coordinate is
    t_j = p_j (1 - p_j); its group's estimate has mean m_j and variance v_j, and the best step
    is c* = E[m t] / E[m^2 + v]. Args: as `average_over_pass_rates`.

    Returns: dict of floats: "relative_error" = 1 - E[m t]^2 / (E[m^2 + v] E[t^2]), the error
    left at c* in units of E[t^2] (in [0, 1]); "alignment" = E[m t] / sqrt(E[m^2] E[t^2]), the
    cosine between E[g] and the true gradient; "best_step" = c*.
    """
    pass_rates, weights = check_pass_rates(pass_rates), _check_weights(weights, pass_rates)
    moments = estimator_moments(pass_rates, group_size, method, **kwargs)
    mean, variance = moments["mean"], moments["variance"]
    true_gradient = pass_rates * (1 - pass_rates)
    cross = weights @ (mean * true_gradient)
    second, target = weights @ (mean**2 + variance), weights @ true_gradient**2
    return {
        "relative_error": float(1 - cross**2 / (second * target)),
        "alignment": float(cross / np.sqrt((weights @ mean**2) * target)),
        "best_step": float(cross / second),
    }


def beta_quadrature(a, b, num_nodes=128):
    """Nodes and weights with sum_j weights[j] f(pass_rates[j]) ~= E[f(p)], p ~ Beta(a, b).

    Gauss-Jacobi on [-1, 1] with weight (1 - x)^(b - 1) (1 + x)^(a - 1), mapped by
    p = (1 + x) / 2; the density singularities for a < 1 or b < 1 sit in the weight, so the
    rule stays exact for polynomials of degree < 2 * num_nodes.

    Returns: pass_rates, weights, each float64 of shape (num_nodes,), in (0, 1) and summing to 1.
    """
    if not (a > 0 and b > 0):
        raise ValueError(f"Beta parameters must be > 0, got a={a}, b={b}")
    # scipy divides by zero at a + b = 1 in a branch that np.where then discards: harmless.
    with np.errstate(divide="ignore", invalid="ignore"):
        nodes, weights = roots_jacobi(num_nodes, b - 1, a - 1)
    return (1 + nodes) / 2, weights / weights.sum()


def pass_at_g(pass_rates, group_size):
    """P(at least one of G completions is correct) = 1 - (1 - p)^G; (P,) like pass_rates."""
    group_size = check_group_size(group_size)
    return 1 - (1 - check_pass_rates(pass_rates)) ** group_size


def grad_pass_at_g(pass_rates, group_size):
    """d/dtheta pass@G = G (1 - p)^(G - 1) * p (1 - p), with theta = logit(p); (P,)."""
    group_size = check_group_size(group_size)
    p = check_pass_rates(pass_rates)
    return group_size * (1 - p) ** group_size * p


def degenerate_rate(pass_rates, group_size):
    """f(p) = p^G + (1 - p)^G, the probability that G i.i.d. completions all agree; (P,) like
    pass_rates.

    Chapter: :doc:`/book/06_sparsity`
    """
    group_size = check_group_size(group_size, minimum=1)
    p = check_pass_rates(pass_rates)
    return p**group_size + (1 - p) ** group_size


def degenerate_rate_slope(pass_rates, group_size):
    """f'(p) = G (p^(G - 1) - (1 - p)^(G - 1)), the slope of the degenerate rate
    f(p) = p^G + (1 - p)^G in the pass rate; (P,) like pass_rates. Negative below p = 1/2, zero
    at 1/2, positive above: along any flow dE_j[f(p_j)]/dt = E_j[f'(p_j) dp_j/dt].

    Chapter: :doc:`/book/06_sparsity`
    """
    group_size = check_group_size(group_size, minimum=1)
    p = check_pass_rates(pass_rates)
    return group_size * (p ** (group_size - 1) - (1 - p) ** (group_size - 1))


def check_group_size(group_size, minimum=2):
    if int(group_size) != group_size or group_size < minimum:
        raise ValueError(f"group_size must be an integer >= {minimum}, got {group_size}")
    return int(group_size)


def _check_weights(weights, pass_rates):
    """weights as float64, normalised to sum to 1."""
    weights = np.asarray(weights, dtype=np.float64)
    if weights.shape != np.shape(pass_rates) or not np.all(weights >= 0) or weights.sum() <= 0:
        raise ValueError(
            f"weights must be non-negative, not all zero, with the shape of pass_rates "
            f"{np.shape(pass_rates)}; got shape {weights.shape}"
        )
    return weights / weights.sum()


def check_pass_rates(pass_rates):
    p = np.atleast_1d(np.asarray(pass_rates, dtype=np.float64))
    if p.ndim != 1:
        raise ValueError(f"pass_rates must be a scalar or 1-D, got shape {p.shape}")
    outside = p[~((p >= 0) & (p <= 1))]  # also catches nan
    if outside.size:
        raise ValueError(f"pass_rates must lie in [0, 1], got {outside[:5]}")
    return p


def best_step_errors(pass_rates, weights, group_size, zoo, score_noise) -> dict[str, float]:
    """`best_step_error`'s relative error of every method at one G and score noise v."""
    return {
        label: best_step_error(
            pass_rates, weights, group_size, method, score_noise=score_noise, **kwargs
        )["relative_error"]
        for label, (method, kwargs) in zoo.items()
    }


def errors_against_score_noise(pass_rates, weights, group_size, zoo, noises):
    """`best_step_errors` at each score noise v in `noises`: label -> `(len(noises),)`."""
    by_noise = [best_step_errors(pass_rates, weights, group_size, zoo, v) for v in noises]
    return {label: np.array([errors[label] for errors in by_noise]) for label in zoo}
