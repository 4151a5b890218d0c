"""Chapter 3's figures: each takes what `chapters.grpo_loss.loss` computed and returns a
matplotlib Figure."""

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from torch import Tensor

from grpo_companion.core.kl import KL_ESTIMATORS

COLORS = ["C0", "C1", "C2", "C3"]


def plot_clipped_objective(
    ratios: Tensor, curves: dict[float, tuple[Tensor, Tensor]], epsilon: float
) -> plt.Figure:
    """The clipped per-token objective against the ratio, one panel per advantage A, with the
    ratios where it has zero gradient shaded; `curves[A]` is `clipped_objective`'s pair."""
    fig, axes = plt.subplots(1, len(curves), figsize=(10, 3.8), sharey=True, layout="constrained")
    for ax, (advantage, (objective, is_clipped)) in zip(axes, curves.items()):
        ax.plot(ratios, advantage * ratios, "--", color="gray", label=r"unclipped $\rho A$")
        ax.plot(ratios, objective, color="C0", label="clipped objective")
        ax.fill_between(
            ratios,
            -1.6,
            1.6,
            where=is_clipped.numpy(),
            color="C3",
            alpha=0.15,
            label="zero gradient",
        )
        ax.axvline(1, color="black", lw=0.6)
        ax.set(
            xlabel=r"ratio $\rho = \pi_\theta / \pi_{\mathrm{old}}$",
            title=rf"$A = {advantage:+.0f}$, $\epsilon$ = {epsilon}",
            ylim=(-1.6, 1.6),
        )
    axes[0].set_ylabel("per-token objective")
    axes[0].legend(fontsize="small", loc="upper left")
    return fig


def plot_clipping_trajectories(
    histories: dict, learning_rates: list[float], settings: list[str], initial_objective: float
) -> plt.Figure:
    """Exact KL to pi_old (top) and exact J (bottom) over the steps on one batch, per learning
    rate (columns) and clip setting (colours): mean over batches, band from smallest to largest.

    `histories`: `clipping_histories`'s {(learning rate, setting): one history per batch}.
    """
    fig, axes = plt.subplots(
        2,
        len(learning_rates),
        figsize=(5 * len(learning_rates), 7),
        sharex=True,
        squeeze=False,
        layout="constrained",
    )
    for column, rate in enumerate(learning_rates):
        for name, color in zip(settings, ["C0", "C1", "C3"]):
            for row, key in enumerate(["kl", "objective"]):
                # step 0 is pi_old itself with KL 0, off a log axis: the curves start at step 1
                curves = np.array([history[key] for history in histories[(rate, name)]])[:, 1:]
                steps = np.arange(1, curves.shape[1] + 1)
                axes[row, column].plot(
                    steps, curves.mean(axis=0), color=color, label=f"{name}, mean over batches"
                )
                axes[row, column].fill_between(
                    steps, curves.min(axis=0), curves.max(axis=0), color=color, alpha=0.15
                )
        axes[1, column].axhline(
            initial_objective, color="gray", ls="--", lw=0.8, label=r"$J$ of $\pi_{\mathrm{old}}$"
        )
        axes[0, column].set(title=f"learning rate {rate}", yscale="log")
        axes[1, column].set(xlabel="gradient steps on the same batch")
    axes[0, 0].set_ylabel(r"exact KL$(\pi_\theta \,\|\, \pi_{\mathrm{old}})$")
    axes[1, 0].set_ylabel(r"exact $J = \mathbb{E}_{\pi_\theta}[r]$")
    axes[1, 0].legend(fontsize="small")
    fig.suptitle("Several steps on one batch (bands: smallest to largest over batches)")
    return fig


def plot_kl_estimators(kl_table: pd.DataFrame) -> plt.Figure:
    """Relative bias (left) and relative standard deviation (right) of one sequence's KL
    estimate against the exact KL, per estimator; `kl_table` from `kl_estimator_table`."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
    for estimator, color in zip(KL_ESTIMATORS, COLORS):
        rows = kl_table[kl_table["estimator"] == estimator]
        axes[0].plot(rows["exact KL"], rows["relative bias"], "o-", color=color, label=estimator)
        axes[1].plot(rows["exact KL"], rows["relative std"], "o-", color=color, label=estimator)
    kl_label = r"exact KL$(\pi_\theta \,\|\, \pi_{\mathrm{ref}})$"
    axes[0].set(
        xscale="log", xlabel=kl_label, ylabel="bias / KL", title="Bias of one sequence's estimate"
    )
    axes[1].set(
        xscale="log",
        yscale="log",
        xlabel=kl_label,
        ylabel="standard deviation / KL",
        title="Spread of one sequence's estimate",
    )
    axes[0].legend()
    return fig


def plot_token_weights(lengths: Tensor, weights: dict[str, Tensor]) -> plt.Figure:
    """Weight of each token (left) and of the whole completion (right) against the completion's
    length, per loss type; `weights[loss_type]: (batch, seq_len)` from `token_weights`."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
    for (loss_type, weight), color in zip(weights.items(), COLORS):
        axes[0].plot(lengths, weight[:, 0], "o-", color=color, label=loss_type)
        axes[1].plot(lengths, weight.sum(dim=1), "o-", color=color, label=loss_type)
    axes[0].set(
        yscale="log",
        xlabel="completion length $L_i$ (tokens)",
        ylabel=r"$\partial \mathcal{L} / \partial \ell_{i,t}$",
        title="Weight of each token",
    )
    axes[1].set(
        yscale="log",
        xlabel="completion length $L_i$ (tokens)",
        ylabel=r"$\sum_t \partial \mathcal{L} / \partial \ell_{i,t}$",
        title="Weight of the whole completion",
    )
    axes[0].legend()
    return fig


def plot_policy_variant_weights(weights: pd.DataFrame) -> plt.Figure:
    """w(rho) of each policy loss, one panel per sign of the advantage (`policy_gradient_weights`
    on a grid of ratios); the dotted line is plain REINFORCE with importance weight, w = rho.
    Line styles tell apart the variants whose curves coincide over a range."""
    signs = list(dict.fromkeys(weights.columns.get_level_values(0)))
    fig, axes = plt.subplots(1, len(signs), figsize=(11, 4.8), layout="constrained", sharey=True)
    ratios = weights.index.to_numpy()
    styles = [("-", 3.0), ("--", 2.0), ("-.", 1.6), ((0, (1, 1)), 2.2), ("-", 1.4), ("-", 1.4)]
    for ax, sign in zip(np.atleast_1d(axes), signs):
        ax.plot(ratios, ratios, ":", color="gray", lw=1, label="unclipped, w = ρ")
        for i, (name, values) in enumerate(weights[sign].items()):
            style, width = styles[i % len(styles)]
            ax.plot(ratios, values, linestyle=style, lw=width, color=f"C{i}", label=name)
        ax.set(title=f"{sign}", xlabel="importance ratio ρ = π / π_old",
               ylabel="weight w(ρ) on A ∇log π")  # fmt: skip
    handles, labels = np.atleast_1d(axes)[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=3, fontsize="small")
    return fig
