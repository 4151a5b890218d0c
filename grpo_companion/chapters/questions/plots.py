"""Chapter 14's figures: each takes what `chapters.questions.runs` computed and returns a
matplotlib Figure."""

import matplotlib.pyplot as plt
import pandas as pd


def _plot_runs(tables: dict[str, pd.DataFrame], columns: tuple[str, str, str]):
    """(fig, axes): three panels, panel k one line per run of `tables` (label -> `runs.train`'s
    table) of `columns[k]` against the step, from every row for the exact "objective" and from
    the rows where TRL logged (a loss) for the others."""
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4), layout="constrained")
    for color, (label, table) in enumerate(tables.items()):
        logged = table.dropna(subset=["loss"])
        for ax, column in zip(axes, columns, strict=True):
            rows = table if column == "objective" else logged
            ax.plot(rows["global_step"], rows[column], color=f"C{color}", label=label)
    return fig, axes


def plot_loss_and_kl(tables: dict[str, pd.DataFrame]) -> plt.Figure:
    """Three panels against the step, one line per run of `tables` (label -> `runs.train`'s
    table): the logged loss, the logged "kl", and the exact J."""
    fig, axes = _plot_runs(tables, ("loss", "kl", "objective"))
    axes[0].set(xlabel="optimizer step", ylabel="logged loss", title="loss (what TRL logs)")
    axes[1].set(xlabel="optimizer step", ylabel="logged kl", title="kl (mean per-token k3)")
    axes[2].set(xlabel="optimizer step", ylabel=r"$J = \mathbb{E}_\pi[r]$", title="exact J")
    axes[0].legend(fontsize="small")
    return fig


def plot_clip_by_iteration(rows: pd.DataFrame) -> plt.Figure:
    """TRL's clip ratio and the largest |rho - 1| of a batch at each inner iteration
    (`runs.grpo_update`'s rows, one per iteration)."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
    axes[0].plot(rows["iteration"], rows["clip_ratio"], "o-", color="C0")
    axes[0].set(xlabel="inner iteration (num_iterations)", ylabel="clip_ratio/region_mean")
    axes[1].plot(rows["iteration"], rows["max_ratio_deviation"], "o-", color="C1")
    axes[1].set(xlabel="inner iteration (num_iterations)", ylabel=r"max $|\rho - 1|$")
    for ax in axes:
        ax.set_xticks(rows["iteration"])
    return fig


def plot_collapse(tables: dict[str, pd.DataFrame]) -> plt.Figure:
    """One seed in each arm (label -> `runs.train`'s table): the exact J, the logged "kl" and
    the logged "grad_norm" against the optimizer step, the last two on a log scale."""
    fig, axes = _plot_runs(tables, ("objective", "kl", "grad_norm"))
    axes[0].set(xlabel="optimizer step", ylabel=r"exact $J$", title="exact J")
    axes[1].set(xlabel="optimizer step", ylabel="logged kl", title="kl")
    axes[1].set_yscale("symlog", linthresh=1e-2)
    axes[2].set(xlabel="optimizer step", ylabel="grad_norm", yscale="log", title="grad_norm")
    axes[0].legend(fontsize="small")
    return fig
