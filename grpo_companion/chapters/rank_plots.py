"""Chapter 7's figures: each helper takes the measured data and returns a matplotlib Figure."""

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure
from torch import Tensor

from grpo_companion.core.spectra import orthogonal_stable_rank

# Colour and marker of each per-group candidate in `plot_ranks`.
CANDIDATE_STYLE = {"scores": ("C7", "s"), "weighted": ("C3", "o"), "level_sums": ("C0", "^")}


def plot_singular_values(spectra: dict[str, Tensor], group_size: int) -> Figure:
    """The singular values sigma_k of each candidate of one group of `group_size` on the
    sequence policy, `spectra: {name: (k,)}` descending, on a log axis from 1e-17: the rounding
    floor of float64 shows where a rank ends."""
    title = f"one group of G = {group_size} on the sequence policy"
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for name, sigma in spectra.items():
        ax.semilogy(np.arange(1, len(sigma) + 1), sigma.numpy(), "o-", label=name)
    ax.set(title=title, xlabel="index k", ylabel=r"singular value $\sigma_k$", ylim=(1e-17, None))
    ax.legend()
    return fig


def plot_ranks(summary: pd.DataFrame, group_sizes: list[int], subject: str) -> Figure:
    """Mean entropy effective rank against G with its interval, one panel per (model, stage)
    row and reward column, one line per candidate of `CANDIDATE_STYLE`; `summary` is a
    `rank_verdict.summarise_ranks` table with columns model, stage, reward, candidate,
    group_size, measure, mean, low, high. `subject` ("sequence policy") starts the title."""
    summary = summary[summary["measure"] == "entropy"]
    settings = summary[["model", "stage"]].drop_duplicates().values.tolist()
    rewards = list(dict.fromkeys(summary["reward"]))
    fig, axes = plt.subplots(
        len(settings),
        len(rewards),
        figsize=(3.6 * len(rewards), 2.9 * len(settings)),
        sharex=True,
        sharey=True,
        squeeze=False,
    )
    for (model, stage), row in zip(settings, axes):
        for reward, ax in zip(rewards, row):
            part = summary[
                (summary["model"] == model)
                & (summary["stage"] == stage)
                & (summary["reward"] == reward)
            ]
            for candidate, (color, marker) in CANDIDATE_STYLE.items():
                line = part[part["candidate"] == candidate].sort_values("group_size")
                if line.empty:
                    continue
                # A group count of one has no interval (None): draw no bar there.
                low = (line["mean"] - line["low"].astype(float)).fillna(0).clip(lower=0)
                high = (line["high"].astype(float) - line["mean"]).fillna(0).clip(lower=0)
                ax.errorbar(
                    line["group_size"], line["mean"], yerr=[low, high], color=color,
                    marker=marker, capsize=3, label=candidate,
                )  # fmt: skip
            ax.axhline(2, color="k", lw=0.8, ls=":")
            ax.set_ylim(bottom=0)  # a t interval from two groups can reach below any rank
            ax.set_xscale("log", base=2)
            ax.minorticks_off()
            ax.set(title=f"{model}, {stage}, {reward}", xticks=group_sizes, xticklabels=group_sizes)
            ax.title.set_fontsize("small")
    for ax in axes[-1]:
        ax.set_xlabel("group size G")
    for ax in axes[:, 0]:
        ax.set_ylabel("effective rank")
    axes[0, 0].legend(fontsize="x-small")
    fig.suptitle(f"{subject}: entropy effective rank (dotted: 2)")
    fig.tight_layout()
    return fig


def plot_weight_spectra(measured: dict, group_sizes: list[int], title: str) -> Figure:
    """sigma_k / sigma_1 of one group's weight gradient, one panel per matrix, one line per G,
    from one `rank.measure` result: `measured["spectra"]: {(G, name): (k,)}` (a G without a
    mixed group is missing and drawn as no line), `measured["matrices"]` the names."""
    spectra, matrices = measured["spectra"], measured["matrices"]
    fig, axes = plt.subplots(1, len(matrices), figsize=(4 * len(matrices), 3.4), squeeze=False)
    for ax, name in zip(axes[0], matrices):
        for size in group_sizes:
            if (size, name) in spectra:
                sigma = spectra[(size, name)]
                ax.semilogy(
                    np.arange(1, len(sigma) + 1), (sigma / sigma[0]).numpy(), label=f"G = {size}"
                )
        ax.set(title=name, xlabel="index k", ylabel=r"$\sigma_k / \sigma_1$", ylim=(1e-8, 2))
        ax.title.set_fontsize("small")
    axes[0, 0].legend(fontsize="x-small")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


# Colour of each (reward, advantage) cell of `plot_factorial`.
FACTORIAL_STYLE = {
    ("binary", "grpo"): "C0",
    ("binary", "sign"): "C1",
    ("ternary", "grpo"): "C2",
    ("ternary", "sign"): "C3",
}


def plot_factorial(summary: pd.DataFrame, group_sizes: list[int]) -> Figure:
    """The factorial: mean rank against G, one panel per (model, matrix) row and measure
    column, one colour per (reward, advantage); solid measured, dotted the null model
    (orthogonal equal-norm scores). `summary` is a `rank_verdict.factorial_summary` table."""
    rows = summary[["model", "matrix"]].drop_duplicates()
    rows = rows[rows["matrix"] != "scores"].values.tolist()
    measures = list(dict.fromkeys(summary["measure"]))
    fig, axes = plt.subplots(
        len(rows), len(measures), figsize=(3.4 * len(measures), 2.6 * len(rows)),
        sharex=True, squeeze=False,
    )  # fmt: skip
    for (model, matrix), row in zip(rows, axes):
        for measure, ax in zip(measures, row):
            part = summary[
                (summary["model"] == model)
                & (summary["matrix"] == matrix)
                & (summary["measure"] == measure)
            ]
            for (reward, advantage), color in FACTORIAL_STYLE.items():
                line = part[(part["reward"] == reward) & (part["advantage"] == advantage)]
                line = line.sort_values("group_size")
                if line.empty:
                    continue
                label = f"{reward}, {advantage}"
                ax.plot(line["group_size"], line["mean"], "o-", color=color, label=label)
                ax.plot(line["group_size"], line["null"], ":", color=color)
            ax.axhline(2, color="k", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.minorticks_off()
            ax.set(
                xticks=group_sizes, xticklabels=group_sizes, title=f"{model}: {matrix}, {measure}"
            )
            ax.title.set_fontsize("small")
    for ax in axes[-1]:
        ax.set_xlabel("group size G")
    axes[0, 0].legend(fontsize="x-small")
    fig.suptitle("reward levels x zero-sum x measure (dotted: orthogonal equal-norm scores)")
    fig.tight_layout()
    return fig


def plot_stable_rank_by_k(table: pd.DataFrame) -> Figure:
    """Stable rank of diag(A) S against the number k of correct completions, one panel per G,
    markers per model (`rank_verdict.stable_rank_by_k`), the line the closed form
    G min(k, G - k) / max(k, G - k) of orthogonal equal-norm scores."""
    sizes = sorted(table["group_size"].unique())
    fig, axes = plt.subplots(1, max(len(sizes), 1), figsize=(3.4 * max(len(sizes), 1), 3.0),
                             squeeze=False)  # fmt: skip
    for ax, size in zip(axes[0], sizes):
        part = table[table["group_size"] == size]
        k = torch.arange(1, size)
        closed_form = orthogonal_stable_rank(size, k).numpy()
        ax.plot(k.numpy(), closed_form, "k_-", lw=1, ms=14, label="closed form")
        for i, (model, rows) in enumerate(part.groupby("model", sort=False)):
            ax.plot(rows["k"], rows["measured"], "o", color=f"C{i}", label=model)
        ax.axhline(2, color="k", lw=0.8, ls="--")
        ax.set(title=f"G = {size}", xlabel="k correct", xticks=k.numpy())
    axes[0, 0].set_ylabel("stable rank of diag(A) S")
    axes[0, 0].legend(fontsize="x-small")
    fig.tight_layout()
    return fig
