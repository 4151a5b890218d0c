"""Chapter 9's figures: functions that take the computed curves and return a Figure.

Every method keeps one line style across figures (`zoo_styles`): Reinforce-Rej is dashed in
Sign's colour, DAPO dashed grey over the GRPO line it equals. The main text's figures draw the
methods named by `methods` (the chapter passes `zoo.CORE_METHODS`); `plot_extensions` draws the
others from the same computed curves and table.
"""

import matplotlib.pyplot as plt
import numpy as np

from grpo_companion.core.figures import legend_outside

FIXED_STYLES = {
    "GRPO": {"color": "C0"},
    "Dr. GRPO": {"color": "C1"},
    "RLOO": {"color": "C2"},
    "Sign": {"color": "C3"},
    "DAPO filter": {"color": "C7", "ls": "--"},
    "Reinforce-Rej": {"color": "C3", "ls": "--"},
    # verl's estimators (`verl_zoo`): GPG and REINFORCE++-baseline are rescaled Dr. GRPO
    "GRPO pass@k": {"color": "k", "ls": "-."},
    "GPG": {"color": "C1", "ls": ":"},
    "REINFORCE++ baseline": {"color": "C1", "ls": "-."},
}
SOFTMAX_COLORS = ["C4", "C5", "C9", "C6", "C8"]


def zoo_styles(labels) -> dict[str, dict]:
    """Line style of each label of `advantage_zoo`; the Softmax methods take the colours of
    `SOFTMAX_COLORS` in their order of appearance."""
    softmax = [label for label in labels if label.startswith("Softmax")]
    return {
        label: FIXED_STYLES.get(label)
        or {"color": SOFTMAX_COLORS[softmax.index(label) % len(SOFTMAX_COLORS)]}
        for label in labels
    }


def _selected(labels, methods) -> list:
    """The labels of `labels` that `methods` names, in the order of `labels`; all if None."""
    chosen = None if methods is None else set(methods)
    return [label for label in labels if chosen is None or label in chosen]


def _plot_weight_curves(ax, pass_rates, weights: dict, labels, styles, group_size, ylabel):
    """w(p) of each of `labels` (`weights` label -> `(P,)`) on a log axis of `ax`."""
    for label in labels:
        ax.semilogy(pass_rates, weights[label], label=label, **styles[label])
    ax.set(
        xlabel="pass rate $p$",
        ylabel=ylabel,
        title=f"Learning signal against difficulty, G = {group_size}",
    )


def _group_size_ticks(ax, group_sizes):
    ax.set_xticks(group_sizes, [str(G) for G in group_sizes], minor=False)
    ax.xaxis.set_minor_formatter(plt.NullFormatter())


def plot_weights(pass_rates, weights: dict, group_size: int, methods=None) -> plt.Figure:
    """w(p) of the methods named by `methods` (all by default), `weights` label -> `(P,)`, on a
    log axis."""
    styles = zoo_styles(weights)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    _plot_weight_curves(
        ax, pass_rates, weights, _selected(weights, methods), styles, group_size,
        ylabel="weight $w(p) = \\mathbb{E}[g] / \\nabla p$",
    )  # fmt: skip
    legend_outside(ax)
    return fig


def plot_weights_as_group_grows(
    pass_rates, scaled: dict, sup_weight: dict, methods=None
) -> plt.Figure:
    """Left: GRPO's w(p) sqrt(p (1 - p)), `scaled` G -> `(P,)`. Right: max_p w(p) against G of
    the methods named by `methods` (all by default), `sup_weight` label -> one value per G of
    `scaled`, next to sqrt(G)."""
    group_sizes = list(scaled)
    styles = zoo_styles(sup_weight)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (G, curve) in enumerate(scaled.items()):
        color = plt.cm.viridis(i / len(group_sizes))
        left.plot(pass_rates, curve, color=color, label=f"G = {G}")
    left.axhline(1, color="k", ls=":", lw=1, label="$G \\to \\infty$")
    left.set(
        xlabel="pass rate $p$",
        ylabel="$w(p)\\,\\sqrt{p(1-p)}$",
        title="GRPO: $w \\to 1/\\sqrt{p(1-p)}$",
    )
    left.legend(fontsize="small")
    for label in _selected(sup_weight, methods):
        right.loglog(
            group_sizes, sup_weight[label], "o-", label=label, color=styles[label]["color"]
        )
    right.loglog(group_sizes, np.sqrt(group_sizes), "k:", lw=1, label="$\\sqrt{G}$")
    right.set(
        xlabel="group size $G$", ylabel="$\\max_p w(p)$", title="Largest weight on any prompt"
    )
    _group_size_ticks(right, group_sizes)
    legend_outside(right)
    return fig


def plot_bias_and_variance(zoo, group_sizes, methods=None) -> plt.Figure:
    """Squared bias and variance against G of the methods named by `methods` (all by default),
    from `zoo_table`'s DataFrame."""
    styles = zoo_styles(zoo["method"].unique())
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharex=True)
    columns = ["squared bias", "variance"]
    drawn = zoo[zoo["method"].isin(_selected(zoo["method"].unique(), methods))]
    for label, rows_of_method in drawn.groupby("method", sort=False):
        for ax, column in zip(axes, columns, strict=True):
            # An unbiased estimator's squared bias (rounding-level) has no place on a log axis.
            values = rows_of_method[column].where(rows_of_method[column] > 1e-20)
            ax.plot(rows_of_method["G"], values, marker="o", label=label, **styles[label])
    for ax, column in zip(axes, columns, strict=True):
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="group size $G$",
            ylabel=f"{column} (averaged over prompts)",
            title=f"{column.capitalize()}, learning rate 1",
        )
        _group_size_ticks(ax, group_sizes)
    legend_outside(axes[1])
    return fig


def plot_error_vs_score_noise(
    noises, errors: dict, score_noise, group_size, methods=None
) -> plt.Figure:
    """Error at the best step relative to RLOO's against the score noise v (v > 0 only: log
    axis), `errors` label -> `(len(noises),)`, of the methods named by `methods` (all by
    default); the chapter's v marked."""
    styles = zoo_styles(errors)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label in _selected(errors, methods):
        values = errors[label]
        ax.plot(noises[1:], values[1:] / errors["RLOO"][1:], label=label, **styles[label])
    ax.axvline(score_noise, color="gray", ls=":", lw=1)
    ax.annotate(
        "this chapter's $v$", (score_noise, 0.02), xycoords=("data", "axes fraction"),
        fontsize="small", color="gray", ha="left",
    )  # fmt: skip
    ax.set(
        xscale="log",
        xlabel="score noise $v$",
        ylabel="error at best step / RLOO's",
        title=f"The ranking depends on the score noise (G = {group_size})",
    )
    legend_outside(ax)
    return fig


def plot_sign_and_pass_at_g(
    pass_rates, parts: dict, sign_mean, pass_at_g_part, weights: dict, group_size: int
) -> plt.Figure:
    """Left: Sign's E[g] split by the group's outcome (`degenerate_contributions`), with
    `pass_at_g_part` = grad pass@G / G in closed form. Right: the weight of Sign and
    Reinforce-Rej (from `weights`), of pass@1 and of pass@G ascent."""
    G = group_size
    styles = zoo_styles(["Sign", "Reinforce-Rej"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(pass_rates, sign_mean, label="Sign: $\\mathbb{E}[g] = 2p(1-p)$", **styles["Sign"])
    left.plot(
        pass_rates, parts["mixed"], label="from mixed groups (Reinforce-Rej keeps these)",
        **styles["Reinforce-Rej"],
    )  # fmt: skip
    left.plot(
        pass_rates, parts["all_incorrect"], color="C4", lw=4, alpha=0.5,
        label="from all-wrong groups",
    )  # fmt: skip
    left.plot(pass_rates, pass_at_g_part, "k:", label="$\\nabla$pass@G / G, closed form")
    left.plot(pass_rates, parts["all_correct"], color="C0", label="from all-correct groups")
    left.set(
        xlabel="pass rate $p$",
        ylabel="expected update",
        ylim=(-0.02, 0.85),
        title=f"Where Sign's update comes from, G = {G}",
    )
    left.legend(fontsize="small", loc="upper left")
    right.semilogy(pass_rates, np.ones_like(pass_rates), color="k", label="pass@1 ascent")
    for label in ("Sign", "Reinforce-Rej"):
        right.semilogy(pass_rates, weights[label], label=label, **styles[label])
    right.semilogy(pass_rates, G * (1 - pass_rates) ** (G - 1), color="C4", label="pass@G ascent")
    right.set(
        xlabel="pass rate $p$",
        ylabel="weight $w(p)$",
        ylim=(1e-2, 2 * G),
        title="The weight each one puts on a prompt",
    )
    right.legend(fontsize="small", loc="lower left")
    return fig


def plot_length_tradeoff(alphas, tradeoff: dict) -> plt.Figure:
    """(P1) the angle to grad J and (P2) the long-over-short ratios against alpha, from
    `advantage_zoo.length_tradeoff`."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), layout="constrained")
    left.plot(alphas, tradeoff["angle_group_mean"], label="baseline $b = J$ (group mean)")
    left.plot(alphas, tradeoff["angle_no_baseline"], label="no baseline, $b = 0$")
    left.set(
        xlabel="$\\alpha$",
        ylabel="angle to $\\nabla J$ (degrees)",
        title="(P1) bias of the expected update",
    )
    left.legend(fontsize="small", loc="center right")
    right.plot(
        alphas, tradeoff["token_weight"],
        label="token weight $L f_\\alpha(L)$ (the paper's reading)",
    )  # fmt: skip
    right.plot(
        alphas, tradeoff["gradient_size"], label="gradient size $f_\\alpha(L)\\,\\|s\\|$, RMS"
    )
    right.axhline(1, color="k", ls=":", lw=1)
    right.set(
        yscale="log",
        xlabel="$\\alpha$",
        ylabel="long completion / short completion",
        title="(P2) contribution of a long vs a short completion",
    )
    right.set_yticks([0.5, 1, 2, 4], ["0.5", "1", "2", "4"])
    right.yaxis.set_minor_formatter(plt.NullFormatter())
    right.legend(fontsize="small", loc="lower right")
    for ax in (left, right):
        ax.set_xticks([0, 0.25, 0.5, 0.75, 1], ["0\nGRPO", "0.25", "0.5", "0.75", "1\nDr. GRPO"])
    return fig


def plot_extensions(
    pass_rates, weights: dict, sup_weight: dict, large_group_sizes, bounds: dict, table,
    group_size: int, methods, references=("GRPO", "Dr. GRPO"),
) -> plt.Figure:  # fmt: skip
    """The extensions of the zoo, `methods`, next to the `references`, from the curves and the
    table the main text computed. Left: w(p) at G = `group_size` (`weights`, the methods it
    holds). Middle: max_p w(p) against `large_group_sizes` (`sup_weight`), each SoftmaxGRPO
    with its bound e^(1/tau) - 1 (`bounds` label -> bound) dotted. Right: the error at the best
    step against G from `zoo_table`'s DataFrame `table`: methods that are a reference rescaled
    lie on its line, drawn with markers so that both show."""
    labels = [*references, *methods]
    styles = zoo_styles(labels)
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.4), layout="constrained")
    _plot_weight_curves(
        left, pass_rates, weights, _selected(labels, weights), styles, group_size, "weight $w(p)$"
    )
    left.legend(fontsize="small")
    for label in _selected(labels, sup_weight):
        color = styles[label]["color"]
        middle.loglog(large_group_sizes, sup_weight[label], "o-", label=label, color=color)
        if label in bounds:
            middle.axhline(bounds[label], color=color, ls=":", lw=1)
    middle.set(
        xlabel="group size $G$",
        ylabel="$\\max_p w(p)$",
        title="Largest weight (dotted: $e^{1/\\tau} - 1$)",
    )
    _group_size_ticks(middle, large_group_sizes)
    middle.legend(fontsize="small")
    markers = ["o", "s", "^", "x", "+", "d", "v", "*"]
    for index, label in enumerate(_selected(labels, table["method"].unique())):
        rows = table[table["method"] == label]
        right.plot(
            rows["G"], rows["error at best step"], marker=markers[index % len(markers)],
            label=label, **styles[label],
        )  # fmt: skip
    group_sizes = sorted(table["G"].unique())
    right.set(
        xscale="log",
        xlabel="group size $G$",
        ylabel="error at best step",
        title="Error at the best step",
    )
    _group_size_ticks(right, group_sizes)
    legend_outside(right)
    return fig
