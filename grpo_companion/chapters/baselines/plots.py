"""Chapter 8's figures: functions that take the computed curves and return a Figure."""

import matplotlib.pyplot as plt

from grpo_companion.core.figures import legend_outside


def plot_variance_vs_baseline(curves: dict, gaps: dict, labels: dict) -> plt.Figure:
    """One panel per case (2 x 3): `curves` key -> (baselines b, Var[g_b] / Var[g_b*]), from
    `baselines.variance_curve`; `gaps` key -> `baseline_gap`'s dict, whose E[r] and b* are
    marked; `labels` key -> panel title."""
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5), layout="constrained")
    for ax, (key, (baselines, variance)) in zip(axes.flat, curves.items(), strict=False):
        ax.plot(baselines, variance, color="C0")
        ax.axvline(gaps[key]["mean_reward"], color="C2", ls="--", label=r"$\mathbb{E}[r]$")
        ax.axvline(gaps[key]["optimal_baseline"], color="C1", ls=":", label="$b^*$")
        ax.set(title=labels[key], xlabel="constant baseline $b$")
    axes[0, 0].legend()
    for ax in axes[:, 0]:
        ax.set_ylabel(r"$\mathrm{Var}[g_b] / \mathrm{Var}[g_{b^*}]$")
    fig.suptitle("Variance of one sample's estimate against the baseline, exact")
    return fig


# column of `baselines.group_variance_table` -> (legend label, colour, line style)
GROUP_CURVES = {
    "oracle_optimal": ("oracle $b^*$", "C1", ":"),
    "oracle_mean": (r"oracle $\mathbb{E}[r]$", "C2", "--"),
    "rloo": ("leave-one-out (rloo), closed form", "C0", "-"),
    "mean_self": ("mean including self: variance", "C3", "-"),
    "mean_self_mse": ("mean including self: variance + bias$^2$", "C4", "-."),
}


def plot_group_estimator_variance(groups) -> plt.Figure:
    """G times each closed-form variance or MSE of `group_variance_table` (a DataFrame indexed
    by G), and G times the Monte Carlo RLOO variance as dots."""
    fig, ax = plt.subplots()
    sizes = groups.index.to_numpy()
    for column, (label, color, style) in GROUP_CURVES.items():
        ax.plot(sizes, sizes * groups[column], style, color=color, label=label)
    ax.plot(
        sizes,
        sizes * groups["rloo, Monte Carlo"],
        "o",
        color="C0",
        label="leave-one-out, Monte Carlo",
    )
    ax.set(
        xscale="log",
        xlabel="group size $G$",
        ylabel=r"$G \times$ (variance or MSE of $g$)",
        title="Group estimators on chapter 1's policy",
    )
    ax.set_xticks(sizes, [str(size) for size in sizes])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    legend_outside(ax)
    return fig
