"""Chapter 7's figures: each helper takes the measured data and returns a matplotlib Figure."""

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from torch import Tensor

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
