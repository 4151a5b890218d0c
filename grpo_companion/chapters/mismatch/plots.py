"""Chapter 13's figure: the exact bias and variance of each correction against the size of the
mismatch, from `chapters.mismatch.exact.mismatch_table`."""

import matplotlib.pyplot as plt
import pandas as pd

# How each mismatch is put on the x axis: (label, reversed axis, one tick per size).
AXES = {
    "temperature": ("the sampler's temperature (the policy's: 1)", False, False),
    "top_p": ("top_p (1: the whole vocabulary)", True, False),
    "rounding": (
        "significant bits of the rounded logits\n(bf16: 8; float64: 53, no rounding)",
        False,
        True,
    ),
}
MARKERS = "osD^v<>pP*XhH8"


def plot_bias_variance(table: pd.DataFrame, corrections: list[str]) -> plt.Figure:
    """Bias (top row) and variance (bottom row) of each correction in `corrections` (one line
    each, in that order) against the mismatch's size, one column per mismatch; the variance is
    in units of the on-policy estimator's, the bias of the on-policy mean's norm. Rows that
    coincide draw over each other; the table tells them apart."""
    mismatches = list(dict.fromkeys(table["mismatch"]))
    fig, axes = plt.subplots(
        2, len(mismatches), figsize=(4.2 * len(mismatches), 7.2), sharey="row", squeeze=False
    )
    colors = plt.get_cmap("tab20").colors
    for column, mismatch in enumerate(mismatches):
        label, reverse, categorical = AXES[mismatch]
        rows = table[table["mismatch"] == mismatch]
        sizes = sorted(set(rows["size"]), reverse=categorical)
        for index, name in enumerate(corrections):
            line = rows[rows["correction"] == name].sort_values("size", ascending=not categorical)
            x = [sizes.index(size) for size in line["size"]] if categorical else line["size"]
            style = {
                "color": "black" if name == "none" else colors[(2 * index) % 20 + index // 10],
                "marker": MARKERS[index % len(MARKERS)],
                "linestyle": "-" if index % 2 == 0 else "--",
                "markersize": 4,
                "linewidth": 1.2,
                "label": name,
            }
            axes[0, column].plot(x, line["bias"], **style)
            axes[1, column].plot(x, line["variance"], **style)
        axes[0, column].set_title(mismatch.replace("_", "-"))
        axes[1, column].set_xlabel(label)
        for ax in axes[:, column]:
            if categorical:
                ax.set_xticks(range(len(sizes)), [f"{size:g}" for size in sizes])
            if reverse:
                ax.invert_xaxis()
    axes[0, 0].set_yscale("symlog", linthresh=1e-2)
    axes[1, 0].set_yscale("symlog", linthresh=1e-1)
    for ax in axes[:, 0]:
        ax.set_ylim(bottom=0)
    axes[0, 0].set_ylabel("bias, ||E g - E_pi g|| / ||E_pi g||")
    axes[1, 0].set_ylabel("Var g / on-policy Var g")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), title="correction")
    fig.tight_layout()
    return fig
