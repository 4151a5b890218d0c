"""Chapter 6's figures: the degenerate rate in theory, over training, and under the remedies.

Each function takes the chapter's computed data (from `sparsity` and `sparsity_lm`) and
returns a matplotlib Figure; nothing here computes a number that the chapter records.
"""

import matplotlib.pyplot as plt
import numpy as np

from grpo_companion.chapters.sparsity.rate import iid_degenerate_rate
from grpo_companion.chapters.sparsity.remedies import runs_of, smoothed
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


def plot_easy_start(table, predicted_change: float, last_step: int) -> plt.Figure:
    """The easy start, per seed: the training prompts' mean probed pass rate (left) and the
    degenerate fraction D (right) at step 0 and `last_step`, with the exact flow's predicted D
    (the mean D at step 0 plus `predicted_change`).

    table: `easy_start.run_changes`, one row per seed."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    steps = [0, last_step]
    for ax, kind, title in (
        (axes[0], "pass_rate", "mean pass rate of the training prompts"),
        (axes[1], "degenerate", "degenerate fraction D at G = 4"),
    ):
        for i, (_, row) in enumerate(table.iterrows()):
            ax.plot(steps, [row[f"{kind}_first"], row[f"{kind}_last"]], "-o", color="0.6",
                    ms=3, lw=1, label="one seed" if i == 0 else None)  # fmt: skip
        means = [table[f"{kind}_first"].mean(), table[f"{kind}_last"].mean()]
        ax.plot(steps, means, "-o", color="C0", lw=2.5, label="mean over seeds")
        ax.set(title=title, xlabel="step (probe)", xticks=steps, ylim=(-0.02, 1.02))
    start = table["degenerate_first"].mean()
    axes[1].plot(steps, [start, start + predicted_change], "--x", color="C3", ms=8,
                 label="exact flow's prediction")  # fmt: skip
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_micro(tunings: dict, comparisons: dict, arms, reference: str, other: str) -> plt.Figure:
    """Section 6: for each regime, the tuning (mean validation gain in exact J against the
    learning rate, each arm's choice circled; a diverging rate is clipped at the bottom) and,
    last, `other` minus `reference` per confirmation seed in each regime with its mean.

    tunings: regime -> `lm.compare.Tuning`; comparisons: regime -> `lm.compare.compare`'s table.
    """
    fig, axes = plt.subplots(1, len(tunings) + 1, figsize=(5 * (len(tunings) + 1), 4))
    for axis, (regime, tuning) in zip(axes, tunings.items()):
        means = tuning.table.groupby(["arm", "learning_rate"])[tuning.score].mean()
        for arm in arms:
            if arm not in tuning.choice:
                continue
            curve = means[arm]
            line = axis.plot(curve.index, curve.clip(lower=-0.2), marker="o",
                             label=REMEDY_LABELS.get(arm, arm))[0]  # fmt: skip
            chosen = tuning.rates[arm]
            axis.plot([chosen], [max(curve[chosen], -0.2)], "o", markersize=13, fillstyle="none",
                      color=line.get_color())  # fmt: skip
        axis.set_xscale("log")
        axis.axhline(0, color="gray", linewidth=0.8)
        axis.set_xlabel("learning rate")
        axis.set_ylabel("mean gain in exact J, validation (tuning seeds)")
        axis.set_title(f"tuning: {regime} regime")
        axis.legend(fontsize=8)
    axis = axes[-1]
    for position, table in enumerate(comparisons.values()):
        by_arm = table.pivot_table(index="seed", columns="arm", values="gain")
        differences = by_arm[other] - by_arm[reference]
        jitter = np.linspace(-0.15, 0.15, len(differences))
        axis.plot(position + jitter, differences, "o", alpha=0.6)
        axis.plot([position - 0.25, position + 0.25], [differences.mean()] * 2, color="black")
    axis.axhline(0, color="gray", linewidth=0.8)
    axis.set_xticks(range(len(comparisons)), [f"{regime} regime" for regime in comparisons])
    axis.set_ylabel(f"{REMEDY_LABELS[other]} - {REMEDY_LABELS[reference]}: gain in exact J, test")
    axis.set_title("confirmation seeds, paired (bar: mean)")
    fig.tight_layout()
    return fig
