r"""Chapter 1: REINFORCE's error and a constant baseline's variance, measured and drawn.

The estimators and their exact moments are in `grpo_companion.core.policy_gradient`; this module
holds what only chapter 1 does with them: the error of n-sample estimates against n, Monte Carlo
variances to set beside the exact curve Var[g_b] over the baseline b, and the two figures.

One sample's estimate is g_b = (r(y) - b) s(y); its variance (the trace of its covariance) is

    Var[g_b] = E[(r - b)^2 ||s||^2] - ||grad J||^2,

so the mean squared error of the n-sample mean is Var[g_b] / n and its RMS error falls like
n^(-1/2): a slope of -1/2 on log-log axes.
"""

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import Tensor

from grpo_companion.core.figures import legend_outside
from grpo_companion.core.policy_gradient import SequencePolicy


def rms_errors(errors: Tensor) -> np.ndarray:
    """Root-mean-square over repeats of `errors: (num_sample_sizes, num_repeats)`, as in
    `monte_carlo_errors`: `(num_sample_sizes,)`."""
    return errors.square().mean(dim=1).sqrt().numpy()


def error_slope(sample_sizes: list[int], errors: Tensor) -> float:
    """Least-squares slope of log RMS error against log n; -1/2 for an estimator whose mean
    squared error is Var / n. `errors: (len(sample_sizes), num_repeats)`."""
    return float(np.polyfit(np.log(np.array(sample_sizes)), np.log(rms_errors(errors)), 1)[0])


def monte_carlo_variances(
    policy: SequencePolicy,
    logits: Tensor,
    rewards: Tensor,
    baselines: list[float],
    num_samples: int,
    generator: torch.Generator,
) -> list[float]:
    """Sample variance (trace of the covariance) of g_b = (r - b) s at each baseline b.

    One set of `num_samples` draws from pi serves every baseline, so the estimates differ only
    through b. `rewards: (num_sequences,)`.
    """
    draws = policy.sample(logits, num_samples, generator)
    scores, sampled_rewards = policy.scores(logits, policy.all_sequences())[draws], rewards[draws]
    return [float(((sampled_rewards - b)[:, None] * scores).var(dim=0).sum()) for b in baselines]


def plot_error_vs_samples(
    sample_sizes: list[int], errors: dict[str, Tensor], single_sample_variance: dict[str, float]
) -> plt.Figure:
    """Measured RMS error of the n-sample estimate against sqrt(Var / n), one colour per
    baseline; `errors[label]: (len(sample_sizes), num_repeats)`."""
    fig, ax = plt.subplots()
    n = np.array(sample_sizes)
    for (label, table), color in zip(errors.items(), ["C0", "C1"]):
        ax.loglog(n, rms_errors(table), "o", color=color, label=f"{label}: measured RMS error")
        exact_rms = np.sqrt(single_sample_variance[label] / n)
        ax.loglog(
            n, exact_rms, "-", color=color, alpha=0.7, label=r"$\sqrt{\mathrm{Var}/n}$, exact"
        )
    ax.set(
        xlabel="samples $n$",
        ylabel=r"$\|\hat g_n - \nabla J\|$ (RMS over repeats)",
        title="REINFORCE error against sample size",
    )
    legend_outside(ax)
    return fig


def plot_variance_vs_baseline(
    baselines: Tensor,
    variance_curve: Tensor,
    check_baselines: list[float],
    monte_carlo_variance: list[float],
    mean_reward: float,
    optimal_baseline: float,
) -> plt.Figure:
    """The exact Var[g_b] over b, Monte Carlo variances at a few b, and where E[r] and b* sit."""
    fig, ax = plt.subplots()
    ax.plot(baselines, variance_curve, label=r"$\mathrm{Var}[g_b]$, exact")
    ax.plot(check_baselines, monte_carlo_variance, "o", color="C3", label="Monte Carlo variance")
    ax.axvline(
        mean_reward,
        color="C2",
        ls="--",
        label=rf"mean reward $\mathbb{{E}}[r]$ = {mean_reward:.3f}",
    )
    ax.axvline(
        optimal_baseline, color="C1", ls=":", label=rf"optimal $b^*$ = {optimal_baseline:.3f}"
    )
    ax.set(
        xlabel="constant baseline $b$",
        ylabel="variance of one sample's estimate",
        title="Variance against baseline",
    )
    legend_outside(ax)
    return fig
