r"""The advantage zoo: every method on one exact yardstick, the weight w(p) of its expected
update and its bias and variance over a distribution of prompts.

`advantage_zoo` lists the methods compared: GRPO, Dr. GRPO, RLOO, Sign, SoftmaxGRPO at a few
temperatures, and DAPO's dynamic sampling and Reinforce-Rej (GRPO and Sign with the degenerate
groups dropped, counted per *drawn* group so that every method has the same sampling cost); the
chapter's main text teaches `CORE_METHODS` and shows SoftmaxGRPO and verl's estimators
(`verl_zoo`) as extensions (`split_methods`). Each is a (method, options) pair of
`grpo_companion.core.exact.estimator_moments`, whose exact sums over the number of correct
completions give the weight w(p) (`zoo_weights`), the largest weight over pass rates
(`sup_weights`), the bias and variance averaged over a Beta prior on the pass rate and the
scale-free error at the best step (`zoo_table`). `which_one_when` builds the chapter's closing
table. The length weighting f_alpha is in `grpo_companion.chapters.advantage_zoo.length`, the
figures in `grpo_companion.chapters.advantage_zoo.plots`.

Chapter: :doc:`/book/09_advantage_zoo` (sections 0 to 3: the yardstick, the learning signal,
bias and variance, Sign and pass@G; section 5: which one when; section 6: the extensions)
"""

import numpy as np

from grpo_companion.core.exact import best_step_error, estimator_moments, grad_pass_at_g

# Dropped degenerate groups, counted per drawn group (a dropped group is a zero update).
FILTER = {"filter_degenerate": True, "per_drawn_group": True}
# The methods of the chapter's main text; the others (SoftmaxGRPO, verl's) are its extensions.
CORE_METHODS = ("GRPO", "Dr. GRPO", "RLOO", "Sign", "DAPO filter", "Reinforce-Rej")


def advantage_zoo(temperatures) -> dict[str, tuple[str, dict]]:
    """The methods of the chapter: label -> (method, keyword arguments of `estimator_moments`),
    with one SoftmaxGRPO per temperature (label "Softmax τ=<t>")."""
    return {
        "GRPO": ("grpo", {}),
        "Dr. GRPO": ("dr_grpo", {}),
        "RLOO": ("rloo", {}),
        "Sign": ("sign", {}),
        **{f"Softmax τ={tau:g}": ("softmax", {"temperature": tau}) for tau in temperatures},
        "DAPO filter": ("grpo", FILTER),
        "Reinforce-Rej": ("sign", FILTER),
    }


def split_methods(labels) -> tuple[list[str], list[str]]:
    """`labels` in their order, split into the main text's (`CORE_METHODS`) and the rest, the
    extensions."""
    labels = list(labels)
    return [label for label in labels if label in CORE_METHODS], [
        label for label in labels if label not in CORE_METHODS
    ]


def verl_zoo(pass_rates, weights) -> dict[str, tuple[str, dict]]:
    """verl's group estimators that the binary toy allows, as `advantage_zoo` entries: GRPO
    pass@k (verl's default, divided by the std), and GPG and REINFORCE++-baseline in the limit of
    many prompts per batch whose pass rates are `pass_rates` with probabilities `weights`
    (`grpo_companion.core.exact`, "Batch-coupled methods")."""
    batch = {"batch_pass_rates": (pass_rates, weights)}
    return {
        "GRPO pass@k": ("grpo_passk", {}),
        "GPG": ("gpg", batch),
        "REINFORCE++ baseline": ("reinforce_plus_plus_baseline", batch),
    }


def verl_summary(table, pass_rates, group_size: int) -> dict[str, float]:
    """What section 2 reads of `verl_zoo` at G = `group_size` from `zoo_table`'s DataFrame: error
    at the best step and alignment of pass@k, GPG and REINFORCE++-baseline next to Dr. GRPO's;
    and section 3's check that pass@k without the std has E[g] = grad pass@G / G on
    `pass_rates`."""
    rows = table[table["G"] == group_size].set_index("method")
    keys = [("GRPO pass@k", "passk"), ("GPG", "gpg"), ("REINFORCE++ baseline", "rfpp_baseline"),
            ("Dr. GRPO", "dr_grpo")]  # fmt: skip
    passk = estimator_moments(pass_rates, group_size, "grpo_passk", scale_rewards="none")["mean"]
    identity = np.max(np.abs(passk - grad_pass_at_g(pass_rates, group_size) / group_size))
    return {
        **{f"{key}_error_default_noise": float(rows.loc[label, "error at best step"])
           for label, key in keys},
        "passk_alignment": float(rows.loc["GRPO pass@k", "alignment"]),
        "passk_pass_at_g_identity_error": float(identity),
    }  # fmt: skip


def pass_rate_grid(num_pass_rates: int) -> np.ndarray:
    """`num_pass_rates` evenly spaced pass rates strictly inside (0, 1)."""
    return np.linspace(0, 1, num_pass_rates + 2)[1:-1]


def nearest_index(pass_rates, pass_rate: float) -> int:
    """Index of the grid point nearest to `pass_rate`."""
    return int(np.argmin(np.abs(pass_rates - pass_rate)))


def zoo_weights(pass_rates, group_size, zoo) -> dict[str, np.ndarray]:
    """The weight w(p) = E[g] / grad p of every method at each pass rate: label -> `(P,)`."""
    return {
        label: estimator_moments(pass_rates, group_size, method, **kwargs)["weight"]
        for label, (method, kwargs) in zoo.items()
    }


def sup_weights(pass_rates, group_sizes, zoo) -> dict[str, list[float]]:
    """max_p w(p) at each G for GRPO, RLOO and the Softmax methods: label -> list.

    The largest weights sit at the ends, so the grid is refined there: 200 geometric points in
    [1e-5, 0.05] and their mirror images are added to `pass_rates`.
    """
    near_zero = np.geomspace(1e-5, 0.05, 200)
    fine_rates = np.unique(np.concatenate([near_zero, pass_rates, 1 - near_zero]))
    return {
        label: [
            np.nanmax(estimator_moments(fine_rates, G, method, **kwargs)["weight"])
            for G in group_sizes
        ]
        for label, (method, kwargs) in zoo.items()
        if label in ("GRPO", "RLOO") or label.startswith("Softmax")
    }


def signal_summary(weights: dict, hard: int, middle: int, temperatures) -> dict[str, float]:
    """What section 1 reads off `zoo_weights`: w(hard) / w(0.5) of GRPO, RLOO and the coldest
    Softmax (grid indices `hard`, `middle`), and the largest |w_DAPO - w_GRPO|."""
    lowest = f"Softmax τ={min(temperatures):g}"
    summary = {
        f"{key}_hard_over_middle": float(weights[label][hard] / weights[label][middle])
        for label, key in [
            ("GRPO", "grpo"),
            ("RLOO", "rloo"),
            (lowest, "softmax_lowest_temperature"),
        ]
    }
    dapo_gap = np.max(np.abs(weights["DAPO filter"] - weights["GRPO"]))
    return {**summary, "dapo_max_abs_difference_from_grpo": float(dapo_gap)}


def growth_summary(sup_weight: dict, group_sizes, temperatures) -> dict[str, float]:
    """What the large-G figure reads off `sup_weights` at the largest G: GRPO's largest weight
    and it over sqrt(G); the coldest and warmest Softmax's largest weight and their bound
    e^(1/tau) - 1."""
    largest = group_sizes[-1]
    summary = {
        "grpo_sup_weight_over_sqrt_g": float(sup_weight["GRPO"][-1] / np.sqrt(largest)),
        "grpo_sup_weight": float(sup_weight["GRPO"][-1]),
    }
    for key, temperature in [("lowest", min(temperatures)), ("highest", max(temperatures))]:
        sup_at_largest = sup_weight[f"Softmax τ={temperature:g}"][-1]
        summary[f"softmax_{key}_temperature_sup_weight"] = float(sup_at_largest)
        summary[f"softmax_{key}_temperature_bound"] = float(np.expm1(1 / temperature))
    return summary


def softmax_weight_bounds(temperatures) -> dict[str, float]:
    """e^(1/tau) - 1, the bound on SoftmaxGRPO's weight at every G (section 1), per label of
    `advantage_zoo`."""
    return {f"Softmax τ={tau:g}": float(np.expm1(1 / tau)) for tau in temperatures}


def grpo_scaled_weights(pass_rates, group_sizes) -> dict[int, np.ndarray]:
    """GRPO's w(p) sqrt(p (1 - p)) at each G: G -> `(P,)`; it tends to 1 as G grows."""
    spread = np.sqrt(pass_rates * (1 - pass_rates))
    return {G: estimator_moments(pass_rates, G, "grpo")["weight"] * spread for G in group_sizes}


def grpo_limit_deviation(pass_rates, group_size, inner=(0.1, 0.9)) -> float:
    """max |w(p) sqrt(p (1 - p)) - 1| of GRPO at G over the pass rates strictly inside `inner`."""
    scaled = grpo_scaled_weights(pass_rates, [group_size])[group_size]
    inside = (pass_rates > inner[0]) & (pass_rates < inner[1])
    return float(np.max(np.abs(scaled[inside] - 1)))


def zoo_table(pass_rates, weights, zoo, group_sizes, score_noise):
    """Bias, variance and scale-free errors of every method at each G, averaged over prompts
    whose pass rates are `pass_rates` with probabilities `weights` (`beta_quadrature`).

    Returns a DataFrame with a row per (method, G): "mean weight" E_p[E g] / E_p[p (1 - p)],
    "squared bias" E_p[(E g - p (1 - p))^2], "variance" E_p[Var[g]], and `best_step_error`'s
    "alignment" and "error at best step" (its relative_error).
    """
    import pandas as pd

    true_gradient = weights @ (pass_rates * (1 - pass_rates))  # E_p[p (1 - p)]
    rows = []
    for label, (method, kwargs) in zoo.items():
        for G in group_sizes:
            moments = estimator_moments(pass_rates, G, method, score_noise=score_noise, **kwargs)
            scale_free = best_step_error(
                pass_rates, weights, G, method, score_noise=score_noise, **kwargs
            )
            rows.append(
                {
                    "method": label,
                    "G": G,
                    "mean weight": weights @ moments["mean"] / true_gradient,
                    "squared bias": weights @ moments["bias"] ** 2,
                    "variance": weights @ moments["variance"],
                    "alignment": scale_free["alignment"],
                    "error at best step": scale_free["relative_error"],
                }
            )
    return pd.DataFrame(rows)


def score_noise_summary(table, errors: dict, group_size: int) -> dict[str, float]:
    """What section 2 reads at G = `group_size`: the error at the best step of Sign and RLOO
    without score noise (`errors_against_score_noise`, first noise 0), of Sign, RLOO and
    Reinforce-Rej at the chapter's noise (`zoo_table`), and GRPO's alignment."""
    at_default = table[table["G"] == group_size].set_index("method")["error at best step"]
    alignment = table.set_index(["method", "G"]).loc[("GRPO", group_size), "alignment"]
    return {
        "sign_error_no_noise": float(errors["Sign"][0]),
        "rloo_error_no_noise": float(errors["RLOO"][0]),
        "sign_error_default_noise": float(at_default["Sign"]),
        "rloo_error_default_noise": float(at_default["RLOO"]),
        "reinforce_rej_error_default_noise": float(at_default["Reinforce-Rej"]),
        "grpo_alignment": float(alignment),
    }


def best_of(errors: dict[str, float]) -> tuple[str, str]:
    """The labels within rounding (1e-9, relative) of the least error, joined (a rescaled
    method ties), and that error to 4 decimals."""
    least = min(errors.values())
    winners = [label for label, error in errors.items() if error <= least * (1 + 1e-9)]
    return ", ".join(winners), f"{least:.4f}"


def which_one_when(weights, pass_rates, hard, middle, group_size, best_step_rows, length_alphas):
    """The chapter's closing table: question, answer, number, each computed by its rule.

    `weights`: `zoo_weights` at G = `group_size` on `pass_rates`; `hard`, `middle`: grid
    indices of a hard prompt and of p = 0.5; `best_step_rows`: (question, label -> error at the
    best step) pairs; `length_alphas`: `length_alpha_choices`'s dict.
    """
    import pandas as pd

    spread = {label: np.ptp(weight) / np.mean(weight) for label, weight in weights.items()}
    unbiased = [label for label, weight in weights.items() if np.max(np.abs(weight - 1)) < 1e-9]
    aligned = [label for label, relative_spread in spread.items() if relative_spread < 1e-9]
    hard_focus = {label: weight[hard] / weight[middle] for label, weight in weights.items()}
    most_hard_focus = max(hard_focus, key=hard_focus.get)
    hard_question = (
        f"most weight on hard prompts: w({pass_rates[hard]:.2f}) / w(0.5), G = {group_size}"
    )
    return pd.DataFrame(
        [
            ("unbiased at every pass rate: max_p |w - 1| < 1e-9", ", ".join(unbiased), "w = 1"),
            (
                "points along the gradient (a learning rate fixes the scale): w flat to 1e-9",
                ", ".join(aligned),
                "alignment 1",
            ),
            *[(question, *best_of(errors)) for question, errors in best_step_rows],
            (
                hard_question,
                most_hard_focus,
                f"{hard_focus[most_hard_focus]:.2f}",
            ),
            (
                "length weighting f_alpha that is unbiased (P1)",
                f"alpha = {length_alphas['unbiased_alpha']:.2f}",
                "angle 0",
            ),
            (
                "length weighting with equal token weight per completion (P2)",
                f"alpha = {length_alphas['token_invariant_alpha']:.2f}",
                "ratio 1",
            ),
        ],
        columns=["question", "answer here", "number"],
    )
