r"""Chapter 6, section 3: the exact expected GRPO flow of many prompts, and where sparsity grows.

The degenerate fraction of a batch is D = mean_j f(p_j), f(p) = p^G + (1 - p)^G. Along any
change of the pass rates, by the chain rule,

    dD = mean_j f'(p_j) dp_j,        f'(p) = G (p^(G-1) - (1 - p)^(G-1)),

and f' < 0 below p = 1/2, f' > 0 above. So D rises when the prompts that move sit above 1/2
and falls when they sit below: "sparsity intensifies as training goes on" holds only once the
moving prompts are past 1/2. If every p_j >= 1/2 and none decreases, D does not decrease (f
increases on [1/2, 1]).

The model. J prompts, prompt j a Bernoulli logit theta_j with pass rate p_j = sigmoid(theta_j).
The expected GRPO update of theta_j from one group of G is `exact.estimator_moments(p_j, G,
"grpo")["mean"]` (the Bessel std, eps as TRL), m(p_j) > 0 for 0 < p_j < 1. A real model shares
parameters across prompts: with sharing s, prompt j moves by

    d theta_j = eta ((1 - s) m(p_j) + s mean_i m(p_i)),

s = 0 each prompt its own logit, s = 1 one common logit shift. The flow takes `num_steps` such
steps of size eta from prompts placed at the J quantiles (j + 1/2) / J of a Beta(m kappa,
(1 - m) kappa) (`beta_prompts`): no sampling, so every number here is exact up to the step size.
"""

import numpy as np
from scipy import optimize, stats
from scipy.special import expit, logit

from grpo_companion.chapters.sparsity.rate import iid_degenerate_rate
from grpo_companion.core.exact import degenerate_rate_slope, estimator_moments

# A step change of D smaller than this is rounding: its sign is not read.
ROUNDING = 1e-12


def beta_prompts(mean: float, concentration: float, num_prompts: int) -> np.ndarray:
    """Pass rates at the quantiles (j + 1/2) / J of Beta(mean kappa, (1 - mean) kappa): (J,)."""
    quantiles = (np.arange(num_prompts) + 0.5) / num_prompts
    return stats.beta.ppf(quantiles, mean * concentration, (1 - mean) * concentration)


def upper_half(pass_rates: np.ndarray) -> np.ndarray:
    """(1 + p) / 2: the same shape of pass rates moved into [1/2, 1] (a start with every p_j >=
    1/2)."""
    return (1 + np.asarray(pass_rates)) / 2


def grpo_mean_polynomial(group_size: int) -> np.polynomial.Polynomial:
    """m(p) = `estimator_moments(p, G, "grpo")["mean"]` as a polynomial in p.

    m(p) = sum_k C(G, k) p^k (1 - p)^(G - k) g(k) with g(k) linear in p (`core.exact`), a
    polynomial of degree G + 1: interpolating it at G + 2 Chebyshev points is exact up to
    rounding, and evaluating it costs nothing next to the binomial sums (the flow evaluates m
    some 10^7 times).
    """
    nodes = (1 - np.cos(np.pi * (np.arange(group_size + 2) + 0.5) / (group_size + 2))) / 2
    values = estimator_moments(nodes, group_size, "grpo")["mean"]
    return np.polynomial.Polynomial.fit(nodes, values, group_size + 1, domain=[0, 1])


def expected_grpo_step(pass_rates: np.ndarray, group_size: int, sharing) -> np.ndarray:
    """Expected change of every logit per unit step size, (S, J), for pass rates (S, J) and
    sharing (S,) (module docstring): (1 - s) m(p_j) + s mean_i m(p_i)."""
    pass_rates = np.asarray(pass_rates, dtype=np.float64)
    sharing = np.asarray(sharing, dtype=np.float64)[:, None]
    own = _mean_polynomial(group_size)(pass_rates)
    return (1 - sharing) * own + sharing * own.mean(axis=1, keepdims=True)


_POLYNOMIALS = {}


def _mean_polynomial(group_size: int) -> np.polynomial.Polynomial:
    if group_size not in _POLYNOMIALS:
        _POLYNOMIALS[group_size] = grpo_mean_polynomial(group_size)
    return _POLYNOMIALS[group_size]


def exact_flow(pass_rates, group_size: int, sharing, step_size: float, num_steps: int) -> dict:
    """The expected GRPO flow of S batches of J prompts (module docstring).

    pass_rates: (S, J) at the start; sharing: (S,). Returns float arrays: "pass_rate",
    "all_correct", "all_wrong", "degenerate" (S, num_steps + 1), means over prompts after each
    step; "criterion" (S, num_steps), mean_j f'(p_j) (p_j' - p_j) of each step (the first-order
    change of D); "final" (S, J), the pass rates after the last step.
    """
    p = np.asarray(pass_rates, dtype=np.float64)
    theta = logit(p)
    rows = {key: [] for key in ("pass_rate", "all_correct", "all_wrong", "degenerate")}
    criterion = []
    for step in range(num_steps + 1):
        rates = iid_degenerate_rate(p.ravel(), group_size)
        rows["pass_rate"].append(p.mean(axis=1))
        for key in ("all_correct", "all_wrong", "degenerate"):
            rows[key].append(rates[key].reshape(p.shape).mean(axis=1))
        if step == num_steps:
            break
        theta = theta + step_size * expected_grpo_step(p, group_size, sharing)
        moved = expit(theta)
        slope = degenerate_rate_slope(p.ravel(), group_size).reshape(p.shape)
        criterion.append((slope * (moved - p)).mean(axis=1))
        p = moved
    return {
        **{key: np.stack(value, axis=1) for key, value in rows.items()},
        "criterion": np.stack(criterion, axis=1),
        "final": p,
    }


def flow_grid(means, concentrations, sharings, *, num_prompts: int, group_size: int,
              step_size: float, num_steps: int) -> tuple[list[dict], dict]:  # fmt: skip
    """Every start (Beta mean x concentration, and its `upper_half`) under every sharing.

    Returns (starts, flow): starts, one dict per trajectory {"mean", "concentration", "sharing",
    "upper_half"} (mean: the Beta's, before `upper_half`); flow: `exact_flow` of them all.
    """
    starts, rates = [], []
    for upper in (False, True):
        for mean in means:
            for concentration in concentrations:
                prompts = beta_prompts(mean, concentration, num_prompts)
                for sharing in sharings:
                    starts.append({"mean": mean, "concentration": concentration,
                                   "sharing": sharing, "upper_half": upper})  # fmt: skip
                    rates.append(upper_half(prompts) if upper else prompts)
    sharing = [start["sharing"] for start in starts]
    return starts, exact_flow(np.stack(rates), group_size, sharing, step_size, num_steps)


def flow_summary(starts: list[dict], flow: dict, high_mean: float = 0.6) -> dict:
    """What the grid of flows says about the claim, exactly.

    Records "p3_flow_trajectories", "p3_flow_steps" (steps of all trajectories);
    "p3_flow_min_step_change" (the most D falls in one step, anywhere); "p3_falling_share" (the
    share of trajectories along which D falls below its start); "p3_sign_agreement" (share of
    steps with |dD| > `ROUNDING` whose sign is that of the criterion mean_j f'(p_j) dp_j) over
    "p3_sign_steps" such steps; "p3_high_start_min_step_change" (over the Beta starts of mean
    >= `high_mean`) and "p3_half_start_min_step_change" (over the `upper_half` starts: every
    p_j >= 1/2).
    """
    change = np.diff(flow["degenerate"], axis=1)  # (S, T)
    readable = np.abs(change) > ROUNDING
    agree = np.sign(change) == np.sign(flow["criterion"])
    upper = np.array([start["upper_half"] for start in starts])
    high = np.array([start["mean"] >= high_mean for start in starts]) & ~upper
    falls = flow["degenerate"].min(axis=1) < flow["degenerate"][:, 0] - ROUNDING
    return {
        "p3_flow_trajectories": len(starts),
        "p3_flow_steps": int(change.size),
        "p3_flow_min_step_change": float(change.min()),
        "p3_falling_share": float(falls.mean()),
        "p3_sign_agreement": float(agree[readable].mean()),
        "p3_sign_steps": int(readable.sum()),
        "p3_high_start_mean": high_mean,
        "p3_high_start_min_step_change": float(change[high].min()),
        "p3_half_start_min_step_change": float(change[upper].min()),
    }


def counterexample(starts: list[dict], flow: dict, mean: float, concentration: float,
                   sharing: float) -> dict:  # fmt: skip
    """The flow from one Beta start: D falls while the mean pass rate rises.

    Records "p3_counter_{mean, concentration, sharing}" (the start), "p3_counter_degenerate_start"
    (D_0), "p3_counter_degenerate_min" (the least D along the flow), "p3_counter_degenerate_fall"
    (min D - D_0, < 0 when D falls), "p3_counter_pass_rate_start", "p3_counter_pass_rate_at_min"
    and "p3_counter_pass_rate_change" (mean pass rate at the least D minus at the start), and
    "p3_counter_degenerate_end" with "p3_counter_pass_rate_end" (after the last step).
    """
    index = next(
        i for i, start in enumerate(starts)
        if (start["mean"], start["concentration"], start["sharing"], start["upper_half"])
        == (mean, concentration, sharing, False)
    )  # fmt: skip
    degenerate, pass_rate = flow["degenerate"][index], flow["pass_rate"][index]
    lowest = int(degenerate.argmin())
    return {
        "p3_counter_mean": mean,
        "p3_counter_concentration": concentration,
        "p3_counter_sharing": sharing,
        "p3_counter_degenerate_start": float(degenerate[0]),
        "p3_counter_degenerate_min": float(degenerate[lowest]),
        "p3_counter_degenerate_fall": float(degenerate[lowest] - degenerate[0]),
        "p3_counter_pass_rate_start": float(pass_rate[0]),
        "p3_counter_pass_rate_at_min": float(pass_rate[lowest]),
        "p3_counter_pass_rate_change": float(pass_rate[lowest] - pass_rate[0]),
        "p3_counter_degenerate_end": float(degenerate[-1]),
        "p3_counter_pass_rate_end": float(pass_rate[-1]),
    }


def fit_beta_binomial(correct, num_samples: int) -> tuple[float, float]:
    """Maximum-likelihood (mean, concentration) of a Beta prior of pass rates from counts
    `correct` (N,) of `num_samples` each (beta-binomial likelihood; concentration kept in
    [1e-3, 1e4])."""
    correct = np.asarray(correct)

    def loss(x):
        a, b = np.exp(x)
        return -stats.betabinom.logpmf(correct, num_samples, a, b).sum()

    bounds = [(np.log(1e-3), np.log(1e4))] * 2
    mean = np.clip(correct.mean() / num_samples, 0.01, 0.99)
    fit = optimize.minimize(loss, np.log([mean, 1 - mean]), bounds=bounds, method="L-BFGS-B")
    a, b = np.exp(fit.x)
    return float(a / (a + b)), float(a + b)


def flow_to_pass_rate(pass_rates, group_size: int, sharing: float, target: float, *,
                      step_size: float, max_steps: int) -> np.ndarray:  # fmt: skip
    """The pass rates (J,) when the flow from `pass_rates` (J,) first brings their mean to
    `target` (the last step shortened to land on it; the start if target is not above it, the
    last step's if `max_steps` do not reach it)."""
    p = np.asarray(pass_rates, dtype=np.float64)
    theta = logit(p)
    for _ in range(max_steps):
        if p.mean() >= target:
            break
        drift = step_size * expected_grpo_step(p[None], group_size, [sharing])[0]
        full = expit(theta + drift)
        if full.mean() > target:  # shorten the step: the mean is increasing in its length
            return _landing(theta, drift, target)
        theta, p = theta + drift, full
    return p


def _landing(theta, drift, target):
    """The pass rates after the part c in [0, 1] of the step `drift` whose mean is `target`."""
    length = optimize.brentq(lambda c: expit(theta + c * drift).mean() - target, 0, 1)
    return expit(theta + length * drift)


def predicted_change(start, end, group_size: int) -> dict:
    """The change of D from pass rates `start` (J,) to `end` (J,): "degenerate" over all prompts,
    and "low" / "high", over the prompts that started below / above 1/2 (means over each side)."""
    before = iid_degenerate_rate(start, group_size)["degenerate"]
    after = iid_degenerate_rate(end, group_size)["degenerate"]
    change = after - before
    low = np.asarray(start) < 0.5
    return {
        "degenerate": float(change.mean()),
        "low": float(change[low].mean()) if low.any() else float("nan"),
        "high": float(change[~low].mean()) if (~low).any() else float("nan"),
    }


def fitted_prediction(correct, num_samples: int, group_size: int, target: float, sharing: float,
                      *, num_prompts: int, step_size: float, max_steps: int) -> dict:  # fmt: skip
    """What the exact flow predicts for a run, from its first probe alone.

    correct: (N,) first-probe counts of `num_samples` each (all seeds pooled). Fits a Beta to
    them (`fit_beta_binomial`), places `num_prompts` prompts at its quantiles, lets the flow with
    this `sharing` run until their mean pass rate reaches `target` (the run's observed one) and
    returns floats "fit_mean", "fit_concentration" and the `predicted_change` keys
    ("degenerate", "low", "high").
    """
    mean, concentration = fit_beta_binomial(correct, num_samples)
    start = beta_prompts(mean, concentration, num_prompts)
    end = flow_to_pass_rate(start, group_size, sharing, target, step_size=step_size,
                            max_steps=max_steps)  # fmt: skip
    return {
        "fit_mean": mean,
        "fit_concentration": concentration,
        **predicted_change(start, end, group_size),
    }
