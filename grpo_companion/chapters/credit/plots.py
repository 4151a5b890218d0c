"""Chapter 5's figures: token-by-coefficient heatmaps, estimator errors, credit by token class,
and the gain of step-level credit in training.

Each function takes the chapter's computed data (from `credit` and `credit_exact`) and returns
a matplotlib Figure; nothing here computes a number that the chapter records.
"""

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
import torch
from torch import Tensor

from grpo_companion.chapters.credit.exact import position_roles
from grpo_companion.chapters.credit.tokens import SHARE_COLUMNS
from grpo_companion.chapters.credit.training import ARM_LABELS, ARMS


def plot_toy_token_advantages(
    coefficients: dict[str, Tensor],
    sequences: Tensor,
    rewards: Tensor,
    shown: Tensor,
    result_positions: list[int],
) -> plt.Figure:
    """Side by side, the coefficient of each token's score for the `shown` sequences.

    coefficients: "outcome" (r - J on every token) and "token" (delta_t), each (n, length);
    sequences: (n, length) token ids, written in the cells; rewards: (n,); shown: (k,) sequence
    numbers. One colour scale for both panels, so that their magnitudes compare.
    """
    outcome_coefficients, token_coefficients = coefficients["outcome"], coefficients["token"]
    roles = position_roles(sequences.shape[1], result_positions)
    limit = max(
        outcome_coefficients[shown].abs().max(), token_coefficients[shown].abs().max()
    ).item()
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.35 * len(shown) + 1.6), sharey=True)
    panels = (
        (outcome_coefficients, "outcome: $r - J$ on every token"),
        (token_coefficients, r"token level: exact $\delta_t = V(s_{t+1}) - V(s_t)$"),
    )
    for ax, (matrix, title) in zip(axes, panels):
        sns.heatmap(
            matrix[shown].numpy(),
            ax=ax,
            cmap="RdBu_r",
            vmin=-limit,
            vmax=limit,
            center=0,
            annot=sequences[shown].numpy(),
            fmt="d",
            cbar=ax is axes[1],
            linewidths=0.5,
        )
        ax.set(title=title, xlabel="position t")
        ax.set_xticklabels([f"{t}\n{name}" for t, name in enumerate(roles)])
    axes[0].set_ylabel("sampled sequence (reward)")
    axes[0].set_yticklabels([f"{int(r)}" for r in rewards[shown]], rotation=0)
    fig.suptitle("Coefficient of each token's score; the number in a cell is the token")
    fig.tight_layout()
    return fig


ESTIMATOR_LABELS = {"outcome": "outcome ($r - J$)", "token": r"token level ($\delta_t$)"}


def plot_estimator_errors(
    sample_sizes: list[int],
    errors: dict[str, Tensor],
    moments: dict[str, tuple[Tensor, Tensor]],
    num_repeats: int,
) -> plt.Figure:
    """Mean squared error of the n-sample mean, sampled (dots) against exact variance / n (line).

    errors[name]: (len(sample_sizes), num_repeats) from `credit.sampled_errors`; moments[name]:
    (mean, single-sample variance) from `credit.exact_moments`; names "outcome" and "token".
    """
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, table in errors.items():
        label = ESTIMATOR_LABELS.get(name, name)
        (line,) = ax.plot(sample_sizes, table.mean(dim=1).numpy(), "o", label=f"{label}: sampled")
        exact = (moments[name][1] / torch.tensor(sample_sizes)).numpy()
        ax.plot(
            sample_sizes, exact, "-", color=line.get_color(), label=f"{label}: exact variance / n"
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="rollouts n",
        ylabel=r"mean $\|\hat g_n - \nabla J\|^2$",
        title=f"Same expectation, different variance ({num_repeats} repeats)",
    )
    ax.legend(fontsize="small")
    return fig


def token_labels(tokenizer, completion_ids: Tensor, completion_mask: Tensor) -> np.ndarray:
    """Printable text of each completion token, (N, T) strings: "⏎" for a newline, "E" for the end
    of text, "␣" for a blank token, "" on padding."""
    text = {tokenizer.eos_token_id: "E", tokenizer.pad_token_id: ""}

    def label(token: int) -> str:
        return text.get(token, tokenizer.decode([token])).replace("\n", "⏎").strip() or "␣"

    return np.array(
        [
            [label(token) if keep else "" for token, keep in zip(row, keeps)]
            for row, keeps in zip(completion_ids.tolist(), completion_mask.tolist())
        ]
    )


def plot_rollout_credit(
    tokenizer, rollouts, outcome_matrix: Tensor, credit: Tensor, num_resamples: int
) -> plt.Figure:
    """The outcome advantages (top) and the resampled credit (bottom) of each token of each rollout.

    rollouts: `rollouts.Rollouts` of N completions of width T, in groups of G (separated by black
    lines); outcome_matrix, credit: (N, T), e.g. `credit.token_advantages` and
    `credit.PrefixValues.credit`. Each cell shows its token (`token_labels`).
    """
    labels = token_labels(tokenizer, rollouts.completion_ids, rollouts.completion_mask)
    num_rollouts, width = labels.shape
    group_size = rollouts.rewards.shape[1]
    padding = ~rollouts.completion_mask.bool().numpy()
    row_names = [f"r={int(r)}" for r in rollouts.rewards.reshape(-1)]
    height = 2 * (0.32 * num_rollouts + 1.2)
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.34 * width + 2), height))
    panels = (
        (outcome_matrix, r"outcome: $r_i - \bar r$ on every token"),
        (
            credit,
            r"token level: $\hat\delta_t = \hat V(s_{t+1}) - \hat V(s_t)$, " f"K = {num_resamples}",
        ),
    )
    for ax, (matrix, title) in zip(axes, panels):
        sns.heatmap(
            matrix.numpy(),
            ax=ax,
            mask=padding,
            cmap="RdBu_r",
            vmin=-1,
            vmax=1,
            center=0,
            annot=labels,
            fmt="",
            annot_kws={"fontsize": 7},
            linewidths=0.3,
            cbar_kws={"shrink": 0.8},
        )
        ax.set(title=title, xlabel="completion token t", ylabel="rollout (reward)")
        ax.set_yticklabels(row_names, rotation=0, fontsize=8)
        for boundary in range(group_size, num_rollouts, group_size):
            ax.axhline(boundary, color="black", linewidth=1.5)
    fig.tight_layout()
    return fig


def plot_class_shares(shares: pd.DataFrame) -> plt.Figure:
    """Bars of `credit.class_share_table`: per token class, its share of each column."""
    fig, ax = plt.subplots(figsize=(7, 4))
    columns = {
        SHARE_COLUMNS["outcome"]: r"outcome $A_i^2$",
        SHARE_COLUMNS["credit"]: r"credit $\delta_t^2$ (noise-corrected)",
    }
    shares.rename(columns=columns).plot.bar(ax=ax, rot=0)
    ax.set(
        ylabel="share",
        title="Share of tokens and of squared coefficients, by token class",
        xlabel="token class",
    )
    ax.legend(title=None)
    return fig


def plot_credit_gain(records: dict, num_eval_prompts: int) -> plt.Figure:
    """Section 5: held-out accuracy of each arm (left) and the gain of step-level over outcome
    credit (right) against the number of steps k, means with 95% t-intervals over seeds.

    records: `credit_training.credit_gain_summary`'s. The dashed line on the right is the fitted
    slope of the gain against k through the mean gain, the dotted one the predicted slope.
    """
    step_counts = records["credit_step_counts"]
    keys = [str(k) for k in step_counts]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    initial = [records["credit_initial_accuracy"][k] for k in keys]
    axes[0].plot(step_counts, initial, "k--", marker="x", label="warm start", alpha=0.7)
    arms = [arm for arm in ARMS if arm in records["credit_final_accuracy"]]
    for i, arm in enumerate(arms):
        final = records["credit_final_accuracy"][arm]
        offset = 0.06 * (2 * i - len(arms) + 1)
        _error_bars(axes[0], np.array(step_counts) + offset, [final[k] for k in keys],
                    f"C{i}", ARM_LABELS[arm])  # fmt: skip
    kind = "sampled" if records.get("credit_metric") == "sampled_accuracy" else "greedy"
    axes[0].set(
        title=f"held-out {kind} accuracy after training ({num_eval_prompts} problems)",
        xlabel="steps per problem k",
        ylabel="accuracy",
        xticks=step_counts,
    )
    axes[0].legend(fontsize="small")
    gains = [records["credit_gain"][k] for k in keys]
    _error_bars(axes[1], step_counts, gains, "C2", "paired gain, process - outcome")
    mean_k = np.mean(step_counts)
    mean_gain = np.mean([gain["mean"] for gain in gains])
    fitted = mean_gain + records["credit_gain_slope"] * (np.array(step_counts) - mean_k)
    axes[1].plot(step_counts, fitted, "--", color="C2", alpha=0.7,
                 label=f"fitted slope {records['credit_gain_slope']:+.3f} per step")  # fmt: skip
    predicted = records["predicted_credit_gain_slope"]
    if predicted is not None:
        axes[1].plot(step_counts, mean_gain + predicted * (np.array(step_counts) - mean_k), ":",
                     color="C3", label=f"predicted slope {predicted:+.3f} per step")  # fmt: skip
    for i, arm in enumerate(arms[2:], start=3):  # the arms that separate what process adds
        other = [records[f"credit_{arm}_gain"][k] for k in keys]
        _error_bars(axes[1], np.array(step_counts) + 0.08 * (i - 2), other, f"C{i}",
                    f"paired gain, {ARM_LABELS[arm]} - outcome")  # fmt: skip
    axes[1].axhline(0, color="black", linewidth=0.8)
    axes[1].set(
        title="paired gain over outcome credit against k",
        xlabel="steps per problem k",
        ylabel="accuracy gain",
        xticks=step_counts,
    )
    axes[1].legend(fontsize="small")
    fig.suptitle(
        f"mean and 95% t-interval over {records['credit_num_seeds']} seeds; "
        "every arm shares prompts, seeds and rollout budget"
    )
    fig.tight_layout()
    return fig


def _error_bars(ax, x, intervals: list[dict], color: str, label: str) -> None:
    means = np.array([interval["mean"] for interval in intervals])
    low = np.array([interval["low"] for interval in intervals], dtype=float)
    high = np.array([interval["high"] for interval in intervals], dtype=float)
    ax.errorbar(x, means, yerr=[means - low, high - means], fmt="o-", color=color, label=label,
                capsize=3, ms=5)  # fmt: skip


def plot_chain_rollouts(records: dict) -> plt.Figure:
    """Rollouts to reach J >= target against k for each arm of the exact chain (section 6), at
    the arm's best learning rate: the median over seeds and its bootstrap interval, log scale.
    records: `credit_toy.toy_summary`'s."""
    ks = records["toy_chain_step_counts"]
    fig, ax = plt.subplots(figsize=(6, 4))
    colors = {"outcome": "tab:blue", "token": "tab:green", "process": "tab:orange"}
    labels = {
        "outcome": "outcome (GRPO)",
        "token": r"oracle token credit $\delta_j$",
        "process": "process rule",
    }
    for offset, arm in zip((-0.08, 0.0, 0.08), colors):
        rows = [records[f"toy_chain_{arm}"][str(k)] for k in ks]
        x = np.asarray(ks, dtype=float) + offset
        median = np.array([np.nan if r["median"] is None else r["median"] for r in rows])
        low = np.array([np.nan if r["low"] is None else r["low"] for r in rows])
        high = np.array([np.nan if r["high"] is None else r["high"] for r in rows])
        ax.errorbar(
            x,
            median,
            yerr=[median - low, high - median],
            marker="o",
            capsize=3,
            color=colors[arm],
            label=labels[arm],
        )
    ax.set(
        yscale="log",
        xlabel="steps k",
        ylabel="rollouts to reach the target J (median over seeds)",
        xticks=ks,
        title="Exact chain: each arm at its own best learning rate",
    )
    ax.legend()
    fig.tight_layout()
    return fig


MICRO_LABELS = {
    "outcome": "outcome GRPO",
    "process": "process (step labels)",
    "process_placebo": "placebo (labels shuffled)",
    "value": "critic from outcomes",
}


def plot_micro_credit(gains: pd.DataFrame, slopes: dict) -> plt.Figure:
    """Section 7: each arm's gain in exact test J against k (mean and 95% t interval over
    seeds), and each arm's per-seed slope over k of its paired difference from outcome GRPO.

    gains: one row per run with "k", "arm", "seed", "gain"; slopes: arm -> per-seed slopes."""
    from grpo_companion.core.stats import mean_interval

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for arm, label in MICRO_LABELS.items():
        rows = gains[gains["arm"] == arm]
        ks = sorted(rows["k"].unique())
        intervals = [mean_interval(rows.loc[rows["k"] == k, "gain"].to_numpy()) for k in ks]
        means = [interval["mean"] for interval in intervals]
        line = left.plot(ks, means, marker="o", label=label)[0]
        if all(interval["low"] is not None for interval in intervals):
            left.fill_between(ks, [i["low"] for i in intervals], [i["high"] for i in intervals],
                              color=line.get_color(), alpha=0.15)  # fmt: skip
    left.axhline(0, color="gray", linewidth=0.8)
    left.set_xlabel("k, steps per problem")
    left.set_ylabel("gain in exact test J (95% t band over seeds)")
    left.set_title("each arm at its own tuned rate, same rollouts")
    left.legend(fontsize=8)
    for position, values in enumerate(slopes.values()):
        jitter = np.linspace(-0.15, 0.15, len(values))
        right.plot(position + jitter, values, "o", alpha=0.6)
        right.plot([position - 0.25, position + 0.25], [np.mean(values)] * 2, color="black")
    right.axhline(0, color="gray", linewidth=0.8)
    right.set_xticks(range(len(slopes)), [MICRO_LABELS[arm] for arm in slopes], fontsize=8)
    right.set_ylabel("slope over k of (arm - outcome GRPO), per seed")
    right.set_title("the arm x k interaction (bar: mean)")
    fig.tight_layout()
    return fig
