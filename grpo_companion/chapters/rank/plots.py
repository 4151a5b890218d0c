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


# --- section 10: rank in practice --------------------------------------------------------------


def plot_lora_comparison(choice: dict, table: pd.DataFrame, grids: dict,
                         start: float | None = None) -> Figure:  # fmt: skip
    """Three panels: the validation accuracy of each arm against its learning-rate grid (the
    chosen rate circled; `lora.tuning_choice`; the warm start's, `start`, dotted), the held-out
    gain of each arm with its t interval over seeds, and each adapter's paired difference from
    full fine-tuning with its interval, the rank model's predicted difference (x) and the
    decision point half way to 0 (a bar). `table` is `lora.comparison_records`' table; legends
    outside the panels."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6), gridspec_kw={"wspace": 0.35})
    fig.subplots_adjust(left=0.06, right=0.8, bottom=0.16, top=0.88)
    tune, gains, differences = axes
    markers, styles = "osD^v", ["-", "--", "-.", ":", "-"]
    for i, (arm, grid) in enumerate(grids.items()):
        means = choice[arm]["means"]
        marker, style = markers[i % len(markers)], styles[i % len(styles)]
        tune.plot(grid, means, marker=marker, ls=style, color=f"C{i}", label=arm)
        best = choice[arm]["index"]
        tune.plot(grid[best], means[best], "o", ms=14, mfc="none", color=f"C{i}")
    if start is not None:
        tune.axhline(start, color="k", ls=":", lw=1, label="warm start")
    tune.set(xscale="log", xlabel="learning rate", ylabel="validation accuracy after training",
             title="choosing each arm's rate (circled)")  # fmt: skip
    arms = list(table.index)
    x = np.arange(len(arms))

    def bars(ax, values, low, high, color):
        low = (values - low.astype(float)).fillna(0).clip(lower=0)
        high = (high.astype(float) - values).fillna(0).clip(lower=0)
        ax.errorbar(x[: len(values)], values, yerr=[low, high], fmt="o", color=color, capsize=4)

    bars(gains, table["held-out gain"], table["gain low"], table["gain high"], "C0")
    gains.axhline(0, color="k", lw=0.8)
    gains.set(xticks=x, xticklabels=arms, ylabel="held-out accuracy gain",
              title="gain over the warm start (t interval)")  # fmt: skip
    adapters = table.drop(index="full", errors="ignore")
    ax = differences
    position = np.arange(len(adapters))
    low = (adapters["minus full"] - adapters["difference low"].astype(float)).fillna(0)
    high = (adapters["difference high"].astype(float) - adapters["minus full"]).fillna(0)
    ax.errorbar(position, adapters["minus full"], yerr=[low.clip(lower=0), high.clip(lower=0)],
                fmt="o", color="k", capsize=4, label="measured, paired by seed")  # fmt: skip
    ax.plot(position, adapters["predicted"], "x", color="C4", ms=10, mew=2,
            label="rank model's prediction")  # fmt: skip
    ax.plot(position, adapters["predicted"] / 2, "_", color="C7", ms=24, mew=2,
            label="decision point (half way to 0)")  # fmt: skip
    ax.axhline(0, color="k", lw=0.8)
    ax.set(xticks=position, xticklabels=list(adapters.index), ylabel="adapter minus full",
           title="difference from full fine-tuning")  # fmt: skip
    handles = [h for ax in (tune, differences) for h in ax.get_legend_handles_labels()[0]]
    labels = [lab for ax in (tune, differences) for lab in ax.get_legend_handles_labels()[1]]
    fig.legend(handles, labels, fontsize="small", loc="center left", bbox_to_anchor=(0.81, 0.5))
    for ax in axes:
        ax.title.set_fontsize("small")
    return fig


# How each matrix is drawn in `plot_accumulated_update`.
UPDATE_STYLE = {
    "accumulated": ("C3", r"$W_t - W_0$"),
    "gradient": ("C0", r"step gradient $\nabla_W L_t$"),
}


def plot_accumulated_update(frame: pd.DataFrame, spectra: dict[str, np.ndarray],
                            kind: str) -> Figure:  # fmt: skip
    """One layer type `kind` ("q_proj"): the mean normalised spectrum sigma_j / sigma_1 of the
    accumulated update and of the step gradient at the last step (`spectra`: {"accumulated",
    "gradient"}: `(J,)`, `accumulated.mean_normalised_spectrum`), and, against the step, the
    stable and entropy effective ranks and the top direction's share of each, means over the
    layers and seeds of `frame` (`accumulated.spectra_frame`). Legend outside, on the right."""
    part = frame[frame["layer_type"] == kind]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6), gridspec_kw={"wspace": 0.3})
    fig.subplots_adjust(left=0.06, right=0.8, bottom=0.16, top=0.84)
    spectrum_ax, rank_ax, share_ax = axes
    for matrix, (color, label) in UPDATE_STYLE.items():
        values = spectra[matrix]
        spectrum_ax.semilogy(np.arange(1, len(values) + 1), values, ".-", color=color, label=label)
        means = part[part["kind"] == matrix].groupby("step")[["stable", "entropy", "top_share"]]
        means = means.mean()
        rank_ax.plot(means.index, means["stable"], "o-", color=color, label=f"{label}, stable")
        rank_ax.plot(means.index, means["entropy"], "s--", color=color,
                     label=f"{label}, entropy")  # fmt: skip
        share_ax.plot(means.index, means["top_share"], "o-", color=color, label=label)
    spectrum_ax.set(xlabel="index j", ylabel=r"$\sigma_j / \sigma_1$",
                    title="spectrum at the last step")  # fmt: skip
    ranks = part[["stable", "entropy"]].to_numpy(dtype=float)
    # A log axis needs a positive value; a run too short to track any step draws none.
    scale = "log" if np.any(np.isfinite(ranks) & (ranks > 0)) else "linear"
    rank_ax.set(xlabel="step t", ylabel="effective rank", yscale=scale,
                title="stable (solid) and entropy (dashed) rank")  # fmt: skip
    share_ax.set(xlabel="step t", ylabel=r"$\sigma_1^2 / \sum_j \sigma_j^2$", ylim=(0, 1.02),
                 title="share of the top direction")  # fmt: skip
    fig.legend(*rank_ax.get_legend_handles_labels(), fontsize="small", loc="center left",
               bbox_to_anchor=(0.81, 0.5))  # fmt: skip
    for ax in axes:
        ax.title.set_fontsize("small")
    fig.suptitle(f"{kind}: the accumulated update against each step's gradient (full fine-tuning)")
    return fig


def plot_lora_micro(tuning, table: pd.DataFrame, ranks, margin: float) -> Figure:
    """Section 11: each arm's tuning curve (mean validation gain in exact J against the learning
    rate, its choice circled), and each adapter's paired difference from full fine-tuning per
    confirmation seed with its 90% t interval against the margin -M.

    tuning: `lm.compare.Tuning`; table: `lm.compare.compare`'s rows (arms "full", "r<rank>")."""
    from grpo_companion.core.stats import mean_interval

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    means = tuning.table.groupby(["arm", "learning_rate"])["gain"].mean()
    for arm in ["full", *(f"r{rank}" for rank in ranks)]:
        curve = means[arm]
        line = left.plot(curve.index, curve.clip(lower=-0.3), marker="o", label=arm)[0]
        chosen = tuning.rates[arm]
        left.plot([chosen], [max(curve[chosen], -0.3)], "o", markersize=13, fillstyle="none",
                  color=line.get_color())  # fmt: skip
    left.set_xscale("log")
    left.axhline(0, color="gray", linewidth=0.8)
    left.set_xlabel("learning rate")
    left.set_ylabel("mean gain in exact J, validation (tuning seeds)")
    left.set_title("tuning (a gain below -0.3 is drawn at -0.3)")
    left.legend(fontsize=8)
    by_arm = table.pivot_table(index="seed", columns="arm", values="gain")
    for position, rank in enumerate(ranks):
        differences = by_arm[f"r{rank}"] - by_arm["full"]
        jitter = np.linspace(-0.15, 0.15, len(differences))
        right.plot(position + jitter, differences, "o", alpha=0.5)
        interval = mean_interval(differences.to_numpy(), 0.90)
        if interval["low"] is not None:
            right.errorbar([position + 0.3], [interval["mean"]], color="black", capsize=4,
                           yerr=[[interval["mean"] - interval["low"]],
                                 [interval["high"] - interval["mean"]]])  # fmt: skip
    right.axhline(0, color="gray", linewidth=0.8)
    right.axhline(-margin, color="tab:red", linestyle="--", label="-M (non-inferiority margin)")
    right.set_xticks(range(len(ranks)), [f"rank {rank}" for rank in ranks])
    right.set_ylabel("adapter - full fine-tuning: gain in exact J, test")
    right.set_title("confirmation seeds, paired (bar: 90% t interval)")
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig
