"""Chapter 10's figures: functions that take the computed curves and return a Figure."""

import matplotlib.pyplot as plt
import numpy as np

from grpo_companion.core.figures import legend_outside

# One colour per estimator of `group_size.ESTIMATORS`, the same in every figure.
COLORS = {
    "no baseline": "C7",
    "oracle, b = J": "k",
    "group mean": "C1",
    "RLOO = U": "C2",
    "GRPO (std)": "C0",
}


def _log_group_size_axis(ax, ticks):
    ax.set_xticks(ticks, [str(tick) for tick in ticks])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())


def plot_mse_vs_group_size(group_sizes, exact: dict, sampled: dict) -> plt.Figure:
    """One group's MSE against G (left) and G times it (right): `exact` label -> curve,
    `sampled` label -> (Monte Carlo mean, standard error), drawn as dots and 95% bands."""
    G = np.array(group_sizes)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    for label, (mean, standard_error) in sampled.items():
        color = COLORS[label]
        for ax, scale in [(left, 1), (right, G)]:
            ax.plot(G, exact[label] * scale, color=color, label=label)
            band = 1.96 * standard_error
            ax.fill_between(
                G, (mean - band) * scale, (mean + band) * scale, color=color, alpha=0.25, lw=0
            )
            ax.plot(G, mean * scale, "o", color=color, ms=3)
    left.set(ylabel="$\\mathbb{E}\\|g - \\nabla J\\|^2$", title="MSE of one group's update")
    right.set(ylabel="$G \\times$ MSE", title="$G \\times$ MSE: flat for i.i.d. samples")
    for ax in (left, right):
        ax.set(xscale="log", yscale="log", xlabel="group size $G$")
        _log_group_size_axis(ax, group_sizes[::2])
    legend_outside(
        right, title="lines: exact\ndots, bands: Monte Carlo, 95%", title_fontsize="small"
    )
    return fig


def plot_mse_at_fixed_budget(
    group_sizes,
    curves: dict,
    check_group_sizes,
    checks: dict,
    best: dict,
    budget: int,
    beta: tuple[float, float],
) -> plt.Figure:
    """The batch update's MSE against G at budget N, pass rates ~ Beta(*beta): `curves` label ->
    exact MSE at each of `group_sizes`; `checks` label -> Monte Carlo squared errors at each of
    `check_group_sizes` (dots with 95% error bars); `best` label -> (best G, its MSE), a star."""
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    for label, curve in curves.items():
        color = COLORS[label]
        ax.plot(group_sizes, curve, color=color, label=label)
        means = np.array([errors.mean() for errors in checks[label]])
        standard_errors = np.array(
            [errors.std() / np.sqrt(len(errors)) for errors in checks[label]]
        )
        ax.errorbar(
            check_group_sizes, means, yerr=1.96 * standard_errors, fmt="o", color=color, ms=4,
            capsize=3,
        )  # fmt: skip
        ax.plot(*best[label], "*", color=color, ms=14, mec="white")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel=f"group size $G$ (B = {budget} / G prompts)",
        ylabel="MSE of the batch update",
        title=f"N = {budget} completions per step, pass rates ~ Beta({beta[0]:g}, {beta[1]:g})",
    )
    _log_group_size_axis(ax, 2 ** np.arange(int(np.log2(group_sizes[-1])) + 1))
    legend_outside(
        ax, title="lines: exact; stars: best G\ndots: Monte Carlo, 95%", title_fontsize="small"
    )
    return fig


def plot_best_group_size_table(table, means, concentrations, score_noise) -> plt.Figure:
    """Heat map of RLOO's best G, `table: (len(concentrations), len(means))`."""
    fig, ax = plt.subplots(figsize=(8.5, 3.8))
    image = ax.imshow(table, cmap="viridis", aspect="auto", origin="lower")
    middle = (table.min() + table.max()) / 2
    for i, j in np.ndindex(table.shape):
        ax.text(
            j, i, f"{table[i, j]:.1f}", ha="center", va="center", fontsize="small",
            color="white" if table[i, j] < middle else "black",
        )  # fmt: skip
    ax.set_xticks(range(len(means)), [f"{mean:g}" for mean in means])
    ax.set_yticks(range(len(concentrations)), [f"{c:g}" for c in concentrations])
    ax.set(
        xlabel="mean pass rate a / (a + b)",
        ylabel="concentration a + b",
        title=f"RLOO's best group size (any budget), score noise v = {score_noise:g} (chosen)",
    )
    fig.colorbar(image, ax=ax, label="$G^*$")
    ax.grid(False)
    return fig
