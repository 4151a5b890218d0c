r"""Gradient sparsity: how often a group of G completions carries no learning signal.

A group is *degenerate* when all its rewards are equal: every group-relative advantage of it is
zero (GRPO, Dr. GRPO, RLOO), so it costs G rollouts and moves nothing. With binary rewards and G
i.i.d. completions at pass rate p that happens with probability f(p) = p^G + (1 - p)^G
(`grpo_companion.core.exact.degenerate_rate`; `iid_degenerate_rate` splits it into all correct
and all wrong). Prompts differ, and f is convex, so over a distribution of pass rates the rate
E[f(p)] is never below the i.i.d. prediction f(E[p]) (the Jensen gap, `jensen_gap`); for
Beta-distributed pass rates it is exact (`beta_degenerate_rate`), and `beta_concentration_for`
finds the spread that gives a target rate.

Section 1 checks the closed forms by simulation: `simulated_beta_rates` draws prompts and
groups, `monte_carlo_check` compares, and `random_jensen_gaps` evaluates the gap on random
discrete pass-rate distributions. Estimators take plain tensors from any rollout batch: rewards
(num_prompts, G), advantages (num_prompts, G) or flattened, and completion_mask
(num_prompts * G, max_completion_length); `gradient_share` says how much of a batch's gradient
the mixed groups carry. The measurements on language models are in `sparsity.lm_runs` and
`sparsity.remedies`, the figures in `sparsity.plots`.

Chapter: :doc:`/book/06_sparsity` (section 1: the Jensen gap and the Beta moments; section 5: a
reported rate)
"""

import numpy as np
import pandas as pd
import torch
from scipy.optimize import brentq
from torch import Tensor

from grpo_companion.core.advantages import zero_std_groups
from grpo_companion.core.exact import check_group_size, check_pass_rates
from grpo_companion.core.exact import degenerate_rate as exact_degenerate_rate
from grpo_companion.core.group_estimators import group_gradient


def iid_degenerate_rate(pass_rates, group_size):
    """P(all G correct) = p^G and P(all G wrong) = (1 - p)^G for each pass rate p.

    Chapter: :doc:`/book/06_sparsity`

    Returns: dict of float64 arrays of shape (P,): all_correct, all_wrong and their sum,
    degenerate (= `exact.estimator_moments(...)["degenerate_rate"]`).
    """
    p = check_pass_rates(pass_rates)
    group_size = check_group_size(group_size, minimum=1)
    return {
        "all_correct": p**group_size,
        "all_wrong": (1 - p) ** group_size,
        "degenerate": exact_degenerate_rate(p, group_size),
    }


def mixture_degenerate_rate(pass_rates, weights, group_size):
    """E of `iid_degenerate_rate` for p = pass_rates[j] with probability weights[j] (P,).

    Use `exact.beta_quadrature(a, b)` as (pass_rates, weights) for p ~ Beta(a, b).
    Returns: dict of floats with the keys of `iid_degenerate_rate`.
    """
    rates = iid_degenerate_rate(pass_rates, group_size)
    weights = np.asarray(weights, dtype=np.float64)
    shape = rates["degenerate"].shape
    if weights.shape != shape or not np.all(weights >= 0) or weights.sum() <= 0:
        raise ValueError(
            f"weights must be non-negative, not all zero, with the shape of "
            f"pass_rates {shape}; got shape {weights.shape}"
        )
    return {key: float(weights @ value / weights.sum()) for key, value in rates.items()}


def beta_degenerate_rate(a, b, group_size):
    """Exact `mixture_degenerate_rate` for p ~ Beta(a, b), from the product formula.

    Unlike quadrature it stays exact for any a, b > 0 (Gauss-Jacobi nodes break down for
    a + b >~ 1e4, which `beta_concentration_for` needs). Returns: dict of floats.
    """
    if not (a > 0 and b > 0):
        raise ValueError(f"Beta parameters must be > 0, got a={a}, b={b}")
    j = np.arange(check_group_size(group_size, minimum=1))
    return _split(float(np.prod((a + j) / (a + b + j))), float(np.prod((b + j) / (a + b + j))))


def jensen_gap(pass_rates, weights, group_size):
    """E[f(p)] - f(E[p]) >= 0 with f = `exact.degenerate_rate`, convex (chapter 6, section 1);
    a float."""
    mixture = mixture_degenerate_rate(pass_rates, weights, group_size)["degenerate"]
    mean = np.average(np.asarray(pass_rates, dtype=np.float64), weights=weights)
    return mixture - float(iid_degenerate_rate(mean, group_size)["degenerate"][0])


def iid_pass_rates_for(degenerate_rate, group_size):
    """The pass rates (p, 1 - p), p <= 1/2, at which i.i.d. groups are degenerate at this rate.

    f is symmetric about 1/2 and decreases on [0, 1/2] from 1 to its minimum 2^(1 - G), so a
    rate in [2^(1 - G), 1] has exactly one root there. Below that minimum no pass rate works,
    and heterogeneity only raises the rate (Jensen).
    """
    group_size = check_group_size(group_size)
    floor = 2.0 ** (1 - group_size)
    if not floor <= degenerate_rate <= 1:
        raise ValueError(
            f"at G = {group_size} an i.i.d. degenerate rate lies in "
            f"[2^(1-G), 1] = [{floor:.4g}, 1], got {degenerate_rate}"
        )
    p = brentq(
        lambda p: exact_degenerate_rate([p], group_size)[0] - degenerate_rate, 0.0, 0.5, xtol=1e-14
    )
    return p, 1 - p


def beta_concentration_for(degenerate_rate, mean, group_size):
    """Concentration kappa = a + b of the Beta(mean kappa, (1 - mean) kappa) with this rate.

    Smaller kappa = more heterogeneous prompts (std of p: sqrt(m (1 - m) / (kappa + 1))).
    Each factor (m kappa + j) / (kappa + j) of E[p^G] (and likewise of E[(1 - p)^G]) has
    derivative j (m - 1) / (kappa + j)^2 <= 0 in kappa, so the rate falls monotonically from 1
    (kappa -> 0) to f(mean) (kappa -> inf), and a rate strictly between has one root, found in
    log kappa over [1e-12, 1e12].
    """
    group_size = check_group_size(group_size)
    if not 0 < mean < 1:
        raise ValueError(f"mean pass rate must lie in (0, 1), got {mean}")
    iid = float(iid_degenerate_rate(mean, group_size)["degenerate"][0])
    if not iid < degenerate_rate < 1:
        raise ValueError(
            f"at G = {group_size} and mean pass rate {mean} a Beta gives a rate in "
            f"(f(mean), 1) = ({iid:.4g}, 1), got {degenerate_rate}"
        )

    def excess(log_kappa):
        a, b = mean * np.exp(log_kappa), (1 - mean) * np.exp(log_kappa)
        return beta_degenerate_rate(a, b, group_size)["degenerate"] - degenerate_rate

    bound = np.log(1e12)
    if excess(-bound) < 0 or excess(bound) > 0:
        raise ValueError(
            f"rate {degenerate_rate} is too close to the limits ({iid:.4g}, 1) "
            f"to solve for kappa in [1e-12, 1e12]"
        )
    return float(np.exp(brentq(excess, -bound, bound, xtol=1e-12)))


def group_gradients(advantages: Tensor, scores: Tensor) -> Tensor:
    """Per-group estimates (1/G) sum_i A_i s_i, (num_prompts, P): the one `group_gradient` of
    `core.group_estimators`, on scores laid out one row per rollout.

    Args: advantages (num_prompts, G); scores (num_prompts * G, P), one row s_i = grad log
    pi(o_i) per rollout, in prompt-major order.
    """
    if advantages.dim() != 2 or scores.dim() != 2 or scores.shape[0] != advantages.numel():
        raise ValueError(
            f"need advantages (num_prompts, G) and scores (num_prompts * G, P), got "
            f"shapes {tuple(advantages.shape)} and {tuple(scores.shape)}"
        )
    num_prompts, group_size = advantages.shape
    return group_gradient(scores.view(num_prompts, group_size, -1), advantages)


def gradient_share(group_gradients: Tensor, mask: Tensor) -> float:
    """||sum of the masked groups' gradients|| / ||sum of all||, group_gradients (num_groups, P).

    With mask = ~zero_std_groups(rewards) and a method whose advantages vanish on a constant
    group (GRPO, Dr. GRPO, RLOO, softmax) this is exactly 1: degenerate groups cost rollouts,
    not direction. It differs from 1 for methods that move degenerate groups ("sign": A = -1
    on all-wrong groups). It can exceed 1 when groups cancel; inf or nan if the total is zero.
    """
    shape = tuple(group_gradients.shape)
    if len(shape) != 2 or tuple(mask.shape) != shape[:1] or mask.dtype != torch.bool:
        raise ValueError(
            f"need group_gradients (num_groups, P) and a bool mask (num_groups,), "
            f"got shapes {shape} and {tuple(mask.shape)} ({mask.dtype})"
        )
    return (group_gradients[mask].sum(dim=0).norm() / group_gradients.sum(dim=0).norm()).item()


def kept_groups(rewards: Tensor, atol: float = 1e-8) -> Tensor:
    """Indices (num_kept,) of the non-degenerate groups: the filter of Reinforce-Rej / DAPO."""
    return torch.nonzero(~zero_std_groups(rewards, atol)).flatten()


def dynamic_sampling(rewards: Tensor, num_groups: int, seed: int, atol: float = 1e-8) -> Tensor:
    """DAPO dynamic sampling on an oversampled batch of groups, rewards (num_drawn, G).

    Keeps a seeded random choice of `num_groups` non-degenerate groups, or all of them if fewer
    (the caller then draws more). Returns: sorted indices (<= num_groups,).
    """
    if int(num_groups) != num_groups or num_groups < 1:
        raise ValueError(f"num_groups must be an integer >= 1, got {num_groups}")
    kept = kept_groups(rewards, atol)
    order = torch.randperm(kept.numel(), generator=torch.Generator().manual_seed(seed))
    return kept[order[:num_groups]].sort().values


def _split(all_correct, all_wrong):
    total = all_correct + all_wrong
    return {"all_correct": all_correct, "all_wrong": all_wrong, "degenerate": total}


# --- section 1: the closed forms against simulation --------------------------------------------


def iid_rate_curve(pass_rate: float, group_sizes) -> np.ndarray:
    """f(p) = p^G + (1 - p)^G at one pass rate for each G of group_sizes, (len(group_sizes),)."""
    return np.array([iid_degenerate_rate(pass_rate, g)["degenerate"][0] for g in group_sizes])


def beta_rate_curves(pass_rate_mean: float, concentrations, group_sizes) -> dict:
    """kappa -> exact degenerate rate at each G, (len(group_sizes),), for prompts whose pass
    rate is Beta(m kappa, (1 - m) kappa) with mean m = pass_rate_mean."""
    return {
        kappa: np.array(
            [
                beta_degenerate_rate(pass_rate_mean * kappa, (1 - pass_rate_mean) * kappa, g)[
                    "degenerate"
                ]
                for g in group_sizes
            ]
        )
        for kappa in concentrations
    }


def simulated_beta_rates(
    rng: np.random.Generator, pass_rate_mean: float, concentrations, group_sizes, num_prompts: int
) -> dict:
    """kappa -> simulated degenerate frequency at each G, (len(group_sizes),).

    For each kappa in turn, draws `num_prompts` pass rates p ~ Beta(m kappa, (1 - m) kappa) from
    `rng`, then k ~ Binomial(G, p) correct completions per prompt and G; a group is degenerate
    when k is 0 or G. Advances `rng`.
    """
    group_sizes = np.asarray(group_sizes)
    simulated = {}
    for kappa in concentrations:
        p = rng.beta(pass_rate_mean * kappa, (1 - pass_rate_mean) * kappa, size=num_prompts)
        correct = rng.binomial(group_sizes[:, None], p[None, :])  # (num_group_sizes, prompts)
        simulated[kappa] = ((correct == 0) | (correct == group_sizes[:, None])).mean(axis=1)
    return simulated


def monte_carlo_check(simulated: dict, exact: dict, num_prompts: int) -> dict:
    """How far the simulated rates are from the exact ones, in binomial standard errors.

    Both dicts as from `simulated_beta_rates` and `beta_rate_curves` over group sizes 1, 2, ...;
    G = 1 is left out: its rate is 1 with no noise. Returns "monte_carlo_prompts",
    "monte_carlo_max_z" (the largest |simulated - exact| / standard error) and
    "monte_carlo_checks" (the number of (kappa, G) pairs compared).
    """
    z_scores = []
    for kappa, rate in exact.items():
        standard_error = np.sqrt(rate * (1 - rate) / num_prompts)
        z_scores.append(np.abs(simulated[kappa] - rate)[1:] / standard_error[1:])
    return {
        "monte_carlo_prompts": num_prompts,
        "monte_carlo_max_z": float(np.max(z_scores)),
        "monte_carlo_checks": int(np.size(z_scores)),
    }


def random_jensen_gaps(
    rng: np.random.Generator,
    num_distributions: int,
    max_support: int = 20,
    max_group_size: int = 64,
) -> np.ndarray:
    """`jensen_gap` of random discrete pass-rate distributions, (num_distributions,).

    Each has 2 to `max_support` uniform pass rates with Dirichlet(1, ..., 1) weights and a group
    size from 1 to `max_group_size`, all drawn from `rng` (advanced).
    """
    gaps = []
    for _ in range(num_distributions):
        support = rng.integers(2, max_support + 1)
        pass_rates, weights = rng.random(support), rng.dirichlet(np.ones(support))
        gaps.append(jensen_gap(pass_rates, weights, int(rng.integers(1, max_group_size + 1))))
    return np.array(gaps)


def jensen_gap_summary(gaps: np.ndarray) -> dict:
    """ "num_random_distributions", "jensen_gap_min", "jensen_gap_median" of `random_jensen_gaps`,
    and "jensen_gaps_below_rounding": how many are below -1e-12. E[f] and f(E[p]) are each
    computed to ~1e-16, so a zero gap can come out as -1e-16; a real violation could not."""
    return {
        "num_random_distributions": len(gaps),
        "jensen_gap_min": gaps.min(),
        "jensen_gaps_below_rounding": int((gaps < -1e-12).sum()),
        "jensen_gap_median": float(np.median(gaps)),
    }


# --- section 5: a reported rate -------------------------------------------------------------------


def explain_reported_rate(rate: float, group_size: int, means) -> tuple[dict, pd.DataFrame]:
    """Which pass rates give a reported degenerate `rate` at `group_size`.

    Returns records "reported_degenerate_rate", "reported_group_size", "reported_iid_low" and
    "reported_iid_high" (the i.i.d. pass rates, `iid_pass_rates_for`), and for the last of
    `means` "reported_example_{mean,kappa,std}"; and a table by mean pass rate m: f(m), the Beta
    concentration giving the rate (`beta_concentration_for`) and the std of p it implies.
    """
    low, high = iid_pass_rates_for(rate, group_size)
    rows = []
    for mean in means:
        kappa = beta_concentration_for(rate, mean, group_size)
        rows.append(
            {
                "mean pass rate m": mean,
                "i.i.d. rate f(m)": iid_degenerate_rate(mean, group_size)["degenerate"][0],
                "kappa giving the reported rate": kappa,
                "std of p": np.sqrt(mean * (1 - mean) / (kappa + 1)),
            }
        )
    table = pd.DataFrame(rows).set_index("mean pass rate m")
    records = {
        "reported_degenerate_rate": rate,
        "reported_group_size": group_size,
        "reported_iid_low": low,
        "reported_iid_high": high,
        "reported_example_mean": means[-1],
        "reported_example_kappa": table["kappa giving the reported rate"].iloc[-1],
        "reported_example_std": table["std of p"].iloc[-1],
    }
    return records, table
