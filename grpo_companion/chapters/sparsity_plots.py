"""Chapter 6's figures: the degenerate rate in theory, over training, and under the remedies.

Each function takes the chapter's computed data (from `sparsity` and `sparsity_lm`) and
returns a matplotlib Figure; nothing here computes a number that the chapter records.
"""

import matplotlib.pyplot as plt
import numpy as np

from grpo_companion.chapters.sparsity import iid_degenerate_rate
from grpo_companion.chapters.sparsity_lm import runs_of, smoothed
from grpo_companion.core.stats import seed_band

REMEDY_LABELS = {
    "grpo": "GRPO",
    "dr_grpo": "Dr. GRPO",
    "sign": "Sign (A = 2r - 1)",
    "filter": "Dr. GRPO, degenerate groups filtered",
}


def plot_degenerate_rate_theory(
    group_sizes, iid: np.ndarray, beta_rates: dict, simulated: dict, pass_rate_mean: float
) -> plt.Figure:
    """Left: f(p) = p^4 + (1-p)^4 is convex, so a chord (two prompts) lies above the curve.
    Right: the degenerate rate against G, i.i.d. at the mean pass rate and for Beta prompts.

    iid: (len(group_sizes),) from `sparsity.iid_rate_curve`; beta_rates, simulated: kappa ->
    (len(group_sizes),) from `sparsity.beta_rate_curves` and `sparsity.simulated_beta_rates`
    (every third G from G = 2 drawn as a dot).
    """
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ax = axes[0]
    grid = np.linspace(0, 1, 201)
    two_point = np.array([0.1, 0.7])  # an example: half the prompts at each pass rate
    chord = iid_degenerate_rate(two_point, 4)["degenerate"]
    ax.plot(
        grid, iid_degenerate_rate(grid, 4)["degenerate"], color="C0", label="$f(p) = p^4 + (1-p)^4$"
    )
    ax.plot(two_point, chord, "o--", color="C3", label="chord between two prompts")
    mean_point = two_point.mean()
    ax.plot(
        [mean_point],
        [chord.mean()],
        "s",
        color="C3",
        label=r"$\mathbb{E}[f(p)]$ (the batch's rate)",
    )
    ax.plot(
        [mean_point],
        iid_degenerate_rate(mean_point, 4)["degenerate"],
        "D",
        color="C0",
        label=r"$f(\mathbb{E}[p])$ (i.i.d. prediction)",
    )
    ax.set(
        title="convexity: the chord lies above the curve (G = 4)",
        xlabel="pass rate $p$",
        ylabel="P(group degenerate)",
        ylim=(0, 1.02),
    )
    ax.legend(fontsize="small")
    ax = axes[1]
    group_sizes = np.asarray(group_sizes)
    ax.plot(
        group_sizes, iid, color="black", lw=2, label=f"i.i.d. prediction $f({pass_rate_mean:g})$"
    )
    for i, kappa in enumerate(beta_rates):
        label = rf"Beta prompts, $\kappa$ = {kappa:g}"
        ax.plot(group_sizes, beta_rates[kappa], color=f"C{i}", label=label)
        ax.plot(group_sizes[1::3], simulated[kappa][1::3], "o", color=f"C{i}", ms=4)
    ax.set(
        title=f"degenerate rate against G (mean pass rate {pass_rate_mean:g}; dots: simulated)",
        xlabel="group size G",
        ylabel="fraction of degenerate groups",
        ylim=(0, 1.02),
    )
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def plot_exact_flow(starts: list[dict], flow: dict, concentration: float) -> plt.Figure:
    """The degenerate fraction D against the mean pass rate along the exact flows
    (`sparsity_flow.flow_grid`) from the Beta starts of one concentration: one line per start
    mean, solid for each prompt its own logit (sharing 0), dashed for one common shift (sharing
    1); left the Beta starts, right the same shapes moved into [1/2, 1]. A dotted line marks
    p = 1/2, where f' changes sign.
    """
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    means = sorted({start["mean"] for start in starts})
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(means)))
    for axis, upper in zip(axes, (False, True)):
        for index, start in enumerate(starts):
            if start["upper_half"] != upper or start["concentration"] != concentration:
                continue
            if start["sharing"] not in (0, 1):
                continue
            axis.plot(
                flow["pass_rate"][index], flow["degenerate"][index],
                color=colors[means.index(start["mean"])],
                linestyle="-" if start["sharing"] == 0 else "--",
                label=f"start mean {start['mean']}" if start["sharing"] == 0 else None,
            )  # fmt: skip
        axis.axvline(0.5, color="gray", linestyle=":")
        axis.set_xlabel("mean pass rate of the prompts")
        axis.set_title(
            "starts with every p_j >= 1/2"
            if upper
            else f"Beta starts, concentration {concentration}"
        )
    axes[0].set_ylabel("degenerate fraction D")
    axes[0].legend(fontsize=8, title="solid: own logits; dashed: common shift", title_fontsize=8)
    fig.tight_layout()
    return fig


def plot_sparsity_dynamics(tables: dict, titles: dict) -> plt.Figure:
    """Observed against predicted degenerate fractions over a long run, per seed.

    tables: start -> {seed: `sparsity_dynamics.observed_vs_predicted` table}; titles: start ->
    a title. One column per starting point. Top: the fractions of all-correct (green) and
    all-wrong (red) groups among the training steps after each probe (solid, one line per seed)
    and their prediction from the probe's pass rates (dashed); bottom: the probed mean pass rate
    and the share of training prompts with pass rate >= 0.9.
    """
    fig, axes = plt.subplots(
        2,
        len(tables),
        figsize=(6 * len(tables), 7.5),
        squeeze=False,
        sharex="col",
        height_ratios=[3, 2],
    )
    for column, (start, runs) in enumerate(tables.items()):
        top, bottom = axes[0, column], axes[1, column]
        for i, table in enumerate(runs.values()):
            label = i == 0
            for kind, color in (("all_correct", "C2"), ("all_wrong", "C3")):
                words = kind.replace("_", " ")
                top.plot(
                    table["step"],
                    table[f"observed_{kind}"],
                    "-o",
                    color=color,
                    ms=3,
                    alpha=0.8,
                    label=f"{words}: observed" if label else None,
                )
                top.plot(
                    table["step"],
                    table[f"predicted_{kind}"],
                    "--",
                    color=color,
                    alpha=0.8,
                    label=f"{words}: predicted from the probe" if label else None,
                )
            bottom.plot(
                table["step"],
                table["pass_rate"],
                "-o",
                color="C0",
                ms=3,
                label="mean pass rate" if label else None,
            )
            bottom.plot(
                table["step"],
                table["share_near_one"],
                "-s",
                color="C1",
                ms=3,
                label="share of prompts with pass rate >= 0.9" if label else None,
            )
        top.set(title=titles.get(start, start), ylabel="fraction of the groups", ylim=(-0.02, 1.02))
        bottom.set(xlabel="step (probe)", ylabel="training prompts", ylim=(-0.02, 1.02))
        top.legend(fontsize="x-small", loc="upper right")
        bottom.legend(fontsize="x-small", loc="upper left")
    fig.suptitle(
        "paper: sparsity intensifies as prompts become all-correct; measured here "
        f"({len(next(iter(tables.values())))} seeds per starting point)"
    )
    fig.tight_layout()
    return fig


def plot_remedies(histories: dict, methods, window: int, num_eval_prompts: int) -> plt.Figure:
    """Held-out accuracy (left) and the degenerate rate (right, `window`-step moving average) of
    each method over training: mean and 95% t-band over its seeds.

    histories: (method, seed) -> `trainer.train` history, as `sparsity_lm.runs_of` reads it.
    """
    num_seeds = len([key for key in histories if key[0] == next(iter(methods))])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, name in enumerate(methods):
        for ax, metric in zip(axes, ("eval_accuracy", "frac_reward_zero_std")):
            metric_steps, values = runs_of(histories, name, metric)
            accuracy = metric == "eval_accuracy"
            band = seed_band(values if accuracy else smoothed(values, window))
            ax.plot(
                metric_steps,
                band["mean"],
                "o-" if accuracy else "-",
                color=f"C{i}",
                label=REMEDY_LABELS.get(name, name),
                ms=4,
            )
            ax.fill_between(metric_steps, band["low"], band["high"], color=f"C{i}", alpha=0.15)
    axes[0].set(
        title=f"held-out greedy accuracy ({num_eval_prompts} problems)",
        xlabel="step",
        ylabel="accuracy",
    )
    axes[1].set(
        title=f"degenerate groups, {window}-step moving average",
        xlabel="step",
        ylabel="fraction of groups",
        ylim=(-0.02, 1.02),
    )
    axes[0].legend(fontsize="small")
    fig.suptitle(
        f"mean and 95% t-band over {num_seeds} seeds, same prompts and budget for every method"
    )
    fig.tight_layout()
    return fig


def plot_sign_toy(regimes: dict, methods, names: dict, reference: str, other: str) -> plt.Figure:
    """Sign-S: exact J over rollouts of each method at its tuned learning rate, mean and 95%
    t-band over the evaluation seeds, one panel per regime; last panel: the paired final
    difference other - reference per regime with its 95% interval, and the prediction.

    regimes: name -> `sparsity_sign.toy_regime`'s output (with "records", "runs", "comparison").
    """
    fig, axes = plt.subplots(1, len(regimes) + 1, figsize=(5 * (len(regimes) + 1), 4.2))
    for ax, (name, out) in zip(axes, regimes.items()):
        runs, comparison = out["runs"], out["comparison"]
        num_tune = len(runs["J"][0, 0]) - len(comparison["final"][reference])
        for i, method in enumerate(methods):
            values = runs["J"][i, comparison["best_index"][method], num_tune:]
            band = seed_band(values)
            label = f"{names.get(method, method)}, lr {comparison['best_lr'][method]:g}"
            ax.plot(runs["rollouts"], band["mean"], color=f"C{i}", label=label)
            ax.fill_between(runs["rollouts"], band["low"], band["high"], color=f"C{i}", alpha=0.2)
        mean = out["records"][f"tabular_{name}_mean"]
        ax.set(title=f"{name}: start mean pass rate {mean:g}", xlabel="rollouts", ylabel="exact J")
        ax.legend(fontsize="small")
    ax = axes[-1]
    for x, (name, out) in enumerate(regimes.items()):
        key = f"tabular_{name}_{other}_minus_{reference}"
        record = out["records"]
        ax.errorbar(
            [x], [record[key]],
            yerr=[[record[key] - record[f"{key}_low"]], [record[f"{key}_high"] - record[key]]],
            fmt="o", color="C0", capsize=4, label="measured, 95% t-interval" if x == 0 else None,
        )  # fmt: skip
        ax.plot([x], [record[f"predicted_{key}"]], "x", color="C3", ms=9,
                label="predicted (exact best-step model)" if x == 0 else None)  # fmt: skip
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(regimes)), list(regimes))
    ax.set_xlim(-0.5, len(regimes) - 0.5)
    ax.set(title=f"{names.get(other, other)} - {names.get(reference, reference)}, final J",
           ylabel="paired difference")  # fmt: skip
    ax.legend(fontsize="small")
    fig.suptitle("each method at its own tuned learning rate, same draws for every method")
    fig.tight_layout()
    return fig
