r"""Chapter 2: GRPO's estimator on the enumerable sequence policy, in exact expectation.

The exact moments over every group are `grpo_companion.core.group_estimators`; this module holds
the chapter's two measurements with them and their figures.

`weights_by_group_size` writes the exact E[g] of each advantage method as w grad J plus a
residual orthogonal to grad J, for each group size G: w = 1 - 1/G for the mean including the
completion itself ("dr_grpo"), w = 1 for leave-one-out ("rloo").

`prompt_weights` sets the weight w(p) of a binary reward, E[g] = w(p) grad p for any policy
(evaluated by `grpo_companion.core.exact.estimator_moments(p, G, method)["weight"]`), beside the
exact E[g] of sequence policies with different pass rates.

Chapter: :doc:`/book/02_group_baseline` (section 2: the factor 1 - 1/G; section 3: w(p) and why
it does not depend on the policy).
"""

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from torch import Tensor

from grpo_companion.core import exact
from grpo_companion.core.figures import legend_outside
from grpo_companion.core.group_estimators import (
    gradient_weight,
    group_estimator_moments,
    multisets,
)
from grpo_companion.core.policy_gradient import SequencePolicy

# Mean including self, leave-one-out, and mean and standard deviation.
METHODS = ("dr_grpo", "rloo", "grpo")
STYLE = {"dr_grpo": ("C0", "o"), "rloo": ("C1", "s"), "grpo": ("C2", "^")}


def weights_by_group_size(
    policy: SequencePolicy, logits: Tensor, rewards: Tensor, group_sizes: list[int]
) -> pd.DataFrame:
    """Per group size G: w in E[g] = w grad J + residual for each of `METHODS`, the largest
    residual over them (in units of ||grad J||), 1 - 1/G, and how many multisets the exact sum
    runs over against the ordered groups. `rewards: (num_sequences,)`; index "G"."""
    exact_gradient = policy.exact_gradient(logits, rewards)
    rows = []
    for size in group_sizes:
        weights = {
            method: gradient_weight(
                group_estimator_moments(policy, logits, rewards, size, method)["mean"],
                exact_gradient,
            )
            for method in METHODS
        }
        rows.append(
            {
                "G": size,
                "multisets": len(multisets(policy.num_sequences, size)[0]),
                "ordered groups": policy.num_sequences**size,
                "1 - 1/G": 1 - 1 / size,
                **{f"w {method}": weights[method][0] for method in METHODS},
                "max residual": max(residual for _, residual in weights.values()),
            }
        )
    return pd.DataFrame(rows).set_index("G")


def prompt_weights(
    policy: SequencePolicy,
    rewards: Tensor,
    group_size: int,
    num_prompts: int,
    seed: int,
    logit_scale: float,
) -> pd.DataFrame:
    """One row per prompt, sorted by pass rate p: the exact E[g] of each of `METHODS` written as
    w grad p + residual on the prompt's own sequence policy, and w(p) from `exact`.

    Prompt j is the policy with logits `policy.init_logits(seed + 100 + j, scale=logit_scale)`;
    `rewards: (num_sequences,)`. Columns "pass rate p", "w <method>", "residual <method>",
    "w <method>, exact.py"; index "prompt".
    """
    rows = []
    for prompt in range(num_prompts):
        logits = policy.init_logits(seed + 100 + prompt, scale=logit_scale)
        pass_rate = float(policy.objective(logits, rewards))
        true_gradient = policy.exact_gradient(logits, rewards)
        row = {"prompt": prompt, "pass rate p": pass_rate}
        for method in ("grpo", "dr_grpo", "rloo"):
            mean = group_estimator_moments(policy, logits, rewards, group_size, method)["mean"]
            row[f"w {method}"], row[f"residual {method}"] = gradient_weight(mean, true_gradient)
            row[f"w {method}, exact.py"] = float(
                exact.estimator_moments(pass_rate, group_size, method)["weight"][0]
            )
        rows.append(row)
    return pd.DataFrame(rows).set_index("prompt").sort_values("pass rate p")


def plot_gradient_weight_vs_group_size(scaling: pd.DataFrame, pass_rate: float) -> plt.Figure:
    """The exact w of each method against G (`weights_by_group_size`'s table), and 1 - 1/G."""
    fig, ax = plt.subplots()
    sizes = np.array(scaling.index)
    fine = np.linspace(sizes.min(), sizes.max(), 200)
    ax.plot(fine, 1 - 1 / fine, "-", color="C0", alpha=0.6, label="$1 - 1/G$")
    labels = {
        "dr_grpo": "mean including self (dr_grpo), exact",
        "rloo": "leave-one-out (rloo), exact",
        "grpo": "mean and std (grpo), exact",
    }
    for method in METHODS:
        color, marker = STYLE[method]
        ax.plot(sizes, scaling[f"w {method}"], marker, color=color, label=labels[method])
    ax.axhline(1, color="gray", lw=0.8)
    ax.set(
        xlabel="group size $G$",
        ylabel=r"$w$ in $\mathbb{E}[g] = w\,\nabla J$",
        title=rf"Expected update in units of $\nabla J$ (pass rate {pass_rate:.2f})",
    )
    legend_outside(ax)
    return fig


def plot_prompt_weight_vs_pass_rate(prompts: pd.DataFrame, group_size: int) -> plt.Figure:
    """w(p) of each method over p, the sequence-policy prompts of `prompt_weights` on it, and
    grpo's large-G limit 1 / sqrt(p (1 - p))."""
    fig, ax = plt.subplots()
    grid = np.linspace(0.005, 0.995, 400)
    for method in ("grpo", "dr_grpo", "rloo"):
        color, marker = STYLE[method]
        weight = exact.estimator_moments(grid, group_size, method)["weight"]
        ax.plot(grid, weight, "-", color=color, alpha=0.6, label=f"{method}: $w(p)$ from exact.py")
        ax.plot(
            prompts["pass rate p"],
            prompts[f"w {method}"],
            marker,
            color=color,
            label=f"{method}: sequence-policy prompts",
        )
    ax.plot(
        grid,
        1 / np.sqrt(grid * (1 - grid)),
        ":",
        color="gray",
        label=r"$1/\sqrt{p(1-p)}$ ($G \to \infty$ limit of grpo)",
    )
    ax.set(
        xlabel="pass rate $p$ of the prompt",
        ylabel=r"$w$ in $\mathbb{E}[g] = w\,\nabla p$",
        ylim=(0, 6),
        title=f"Weight of a prompt in the expected update, G = {group_size}",
    )
    legend_outside(ax)
    return fig
