r"""Chapter 9: the advantage zoo on one exact yardstick, and the length weighting f_alpha.

The zoo
-------
`advantage_zoo` lists the methods compared: GRPO, Dr. GRPO, RLOO, Sign, SoftmaxGRPO at a few
temperatures, and DAPO's dynamic sampling and Reinforce-Rej (GRPO and Sign with the degenerate
groups dropped, counted per *drawn* group so that every method has the same sampling cost); the
chapter's main text teaches `CORE_METHODS` and shows SoftmaxGRPO and verl's estimators
(`verl_zoo`) as extensions (`split_methods`). Each
is a (method, options) pair of `grpo_companion.core.exact.estimator_moments`, whose exact sums
over the number of correct completions give the weight w(p) (`zoo_weights`), the largest weight
over pass rates (`sup_weights`), the bias and variance averaged over a Beta prior on the pass
rate and the scale-free error at the best step (`zoo_table`, `best_step_errors`).

The length weighting f_alpha(L) = L^(alpha - 1), on a toy with two lengths
--------------------------------------------------------------------------
`grpo_companion.core.losses.aggregate` with ``loss_type="length_alpha"`` weights completion i's
token sum by f_alpha(L_i) (`grpo_companion.core.losses.length_weights`), so at ratio 1 one
completion adds f_alpha(L_i) A_i s(y_i) to the update, s = grad log pi(y) = the sum of its L
tokens' scores. Two properties one would like:

(P1) unbiased: E[f(L) A s] is a positive multiple of grad J. With A = r - b this needs f
     constant in L (alpha = 1, Dr. GRPO), and then any constant b is free. For alpha != 1 even
     the baseline is not: E[f(L) b s] = b grad E[f(L)] != 0, a push towards the lengths f favours.
(P2) length-invariant: a trajectory's effective contribution does not depend on its length.
     Read as the total weight of its tokens, L f(L) = L^alpha, this needs alpha = 0 (GRPO).
     Read as the size of its gradient, f(L) ||s||: token scores are martingale differences
     (E[s_t | earlier tokens] = 0), so E||s||^2 is the sum of the tokens' E||s_t||^2, ~ L, and
     the root-mean-square size is ~ L^(alpha - 1/2), invariant at alpha = 1/2 instead.

With two lengths L_short != L_long, P1 holds only at alpha = 1 and P2 only at alpha = 0 (or
1/2): no alpha has both.

The toy
-------
The first token decides the form, long with probability q = sigmoid(long_logit); then come
n = L - 1 step tokens, each right with probability s = sigmoid(step_logit), independently; the
reward is 1 when every step is right. theta = (long_logit, step_logit), and with
c = the number of right steps,

    score = (d - q, c - n s),   d = 1 for the long form,
    J = (1 - q) s^(n_short) + q s^(n_long).

Long completions have more steps to get wrong, so the true gradient prefers the short form.
Everything is a sum over d and c ~ Binomial(n_d, s): exact, O(L).
"""

from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import binom

from grpo_companion.core.exact import (
    best_step_error,
    estimator_moments,
    grad_pass_at_g,
)
from grpo_companion.core.losses import length_weights

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


@dataclass(frozen=True)
class TwoLengthToy:
    """Completions of `short_length` or `long_length` tokens (form token included), see above."""

    short_length: int
    long_length: int
    long_logit: float = 0.0
    step_logit: float = 2.0

    def __post_init__(self):
        if not 2 <= self.short_length < self.long_length:
            raise ValueError(
                f"need 2 <= short_length < long_length, got {self.short_length}, {self.long_length}"
            )

    @property
    def lengths(self) -> np.ndarray:
        return np.array([self.short_length, self.long_length])

    def outcomes(self):
        """Every outcome (form, number c of right steps), all orders of the steps lumped together:
        probabilities, lengths and rewards, each (M,), and scores (M, 2); the score depends on
        the steps only through c."""
        q = 1 / (1 + np.exp(-self.long_logit))
        s = 1 / (1 + np.exp(-self.step_logit))
        rows = []
        for form, (form_prob, length) in enumerate(zip([1 - q, q], self.lengths)):
            steps = length - 1
            right = np.arange(steps + 1)
            probs = form_prob * binom.pmf(right, steps, s)
            scores = np.stack([np.full(steps + 1, form - q), right - steps * s], axis=1)
            rows.append((probs, np.full(steps + 1, length), (right == steps).astype(float), scores))
        return [np.concatenate(parts) for parts in zip(*rows)]

    def objective(self) -> float:
        """J = P(every step right)."""
        probs, _, rewards, _ = self.outcomes()
        return float(probs @ rewards)

    def true_gradient(self) -> np.ndarray:
        """grad J with respect to (long_logit, step_logit), (2,)."""
        return self.expected_update(alpha=1.0, baseline=0.0)

    def expected_update(self, alpha: float, baseline: float) -> np.ndarray:
        """E[f_alpha(L) (r - b) s], (2,). With the group-mean baseline of a group of G the
        expected update is exactly (1 - 1/G) times this at b = J (the other G - 1 rewards are
        independent of the completion, and E[r] = J)."""
        probs, lengths, rewards, scores = self.outcomes()
        weights = length_weights(torch.from_numpy(lengths.astype(np.float64)), alpha).numpy()
        return (probs * weights * (rewards - baseline)) @ scores

    def baseline_push(self, alpha: float, baseline: float) -> np.ndarray:
        """The part of `expected_update` due to the baseline: -b grad E[f_alpha(L)], (2,); zero
        at alpha = 1."""
        return self.expected_update(alpha, baseline) - self.expected_update(alpha, 0.0)

    def relative_baseline_push(self, alpha: float, baseline: float) -> float:
        """||`baseline_push`|| in units of ||grad J||."""
        push = np.linalg.norm(self.baseline_push(alpha, baseline))
        return push / np.linalg.norm(self.true_gradient())

    def bias_angle(self, alpha: float, baseline: float) -> float:
        """Angle in degrees between `expected_update` and grad J: 0 is P1 (unbiased up to scale)."""
        update, gradient = self.expected_update(alpha, baseline), self.true_gradient()
        cosine = update @ gradient / (np.linalg.norm(update) * np.linalg.norm(gradient))
        return float(np.degrees(np.arccos(np.clip(cosine, -1.0, 1.0))))

    def token_weight_ratio(self, alpha: float) -> float:
        """P2 as token weight: L f(L) of a long over a short completion, (L_long/L_short)^alpha."""
        return float((self.long_length / self.short_length) ** alpha)

    def gradient_size_ratio(self, alpha: float) -> float:
        """P2 read as gradient size: sqrt(E[f(L)^2 ||s||^2 | long] / E[f(L)^2 ||s||^2 | short])."""
        probs, lengths, _, scores = self.outcomes()
        squared = probs * (scores**2).sum(axis=1)
        long = lengths == self.long_length
        mean_square = [squared[form].sum() / probs[form].sum() for form in (~long, long)]
        sizes = np.sqrt(mean_square) * self.lengths ** (alpha - 1.0)
        return float(sizes[1] / sizes[0])


def length_tradeoff(toy: TwoLengthToy, alphas) -> dict[str, np.ndarray]:
    """P1 and P2 along `alphas`, each `(len(alphas),)`: "angle_group_mean" and
    "angle_no_baseline", `bias_angle` at b = J and b = 0; "token_weight" and "gradient_size",
    the long-over-short ratios `token_weight_ratio` and `gradient_size_ratio`."""
    value = toy.objective()
    return {
        "angle_group_mean": np.array([toy.bias_angle(a, value) for a in alphas]),
        "angle_no_baseline": np.array([toy.bias_angle(a, 0.0) for a in alphas]),
        "token_weight": np.array([toy.token_weight_ratio(a) for a in alphas]),
        "gradient_size": np.array([toy.gradient_size_ratio(a) for a in alphas]),
    }


def length_summary(toy: TwoLengthToy) -> dict[str, float]:
    """GRPO's (alpha = 0) angle to grad J with and without the baseline b = J and its baseline
    push, and Dr. GRPO's (alpha = 1) long-over-short token weight and gradient size."""
    value = toy.objective()
    return {
        "angle_grpo_group_mean": toy.bias_angle(0.0, value),
        "angle_grpo_no_baseline": toy.bias_angle(0.0, 0.0),
        "baseline_push_grpo": float(toy.relative_baseline_push(0.0, value)),
        "dr_grpo_token_weight_ratio": toy.token_weight_ratio(1.0),
        "dr_grpo_gradient_size_ratio": toy.gradient_size_ratio(1.0),
    }


def opo_baseline_comparison(toy: TwoLengthToy) -> dict[str, float]:
    """OPO's length-weighted baseline E[L r] / E[L] (population version of
    `grpo_companion.core.advantages.opo_advantages`) against E[r] and the optimal constant
    b* = E[||s||^2 r] / E[||s||^2], for the plain sum (alpha = 1, where any constant baseline is
    unbiased): the three baselines and Var[g_b] / Var[g_b*] - 1 of E[r] and of OPO's."""
    probs, lengths, rewards, scores = toy.outcomes()
    norms = (scores**2).sum(axis=1)
    gradient_norm = np.sum(toy.true_gradient() ** 2)
    baselines = {
        "opo_baseline": probs @ (lengths * rewards) / (probs @ lengths),
        "toy_mean_reward": probs @ rewards,
        "toy_optimal_baseline": (probs * norms) @ rewards / (probs @ norms),
    }
    variance = {key: (probs * norms) @ (rewards - b) ** 2 - gradient_norm
                for key, b in baselines.items()}  # fmt: skip
    best = variance["toy_optimal_baseline"]
    return {
        **{key: float(value) for key, value in baselines.items()},
        "opo_excess_variance": float(variance["opo_baseline"] / best - 1),
        "mean_reward_excess_variance": float(variance["toy_mean_reward"] / best - 1),
    }


def length_alpha_choices(alphas, tradeoff: dict) -> dict[str, float]:
    """The alpha on the grid that is closest to unbiased (least angle, group-mean baseline), to
    equal token weight and to equal gradient size (ratio nearest 1 on a log scale)."""
    return {
        "unbiased_alpha": float(alphas[np.argmin(tradeoff["angle_group_mean"])]),
        "token_invariant_alpha": float(alphas[np.argmin(np.abs(np.log(tradeoff["token_weight"])))]),
        "size_invariant_alpha": float(alphas[np.argmin(np.abs(np.log(tradeoff["gradient_size"])))]),
    }


def length_tradeoff_table(toy: TwoLengthToy, alphas=(0.0, 0.5, 1.0)):
    """P1 and P2 at a few alphas (GRPO's 0, 1/2, Dr. GRPO's 1): a DataFrame indexed by alpha."""
    import pandas as pd

    value = toy.objective()
    return pd.DataFrame(
        {
            "alpha": list(alphas),
            "angle, b = J (deg)": [toy.bias_angle(a, value) for a in alphas],
            "angle, b = 0 (deg)": [toy.bias_angle(a, 0.0) for a in alphas],
            "baseline push / |grad J|": [toy.relative_baseline_push(a, value) for a in alphas],
            "token weight ratio": [toy.token_weight_ratio(a) for a in alphas],
            "gradient size ratio": [toy.gradient_size_ratio(a) for a in alphas],
        }
    ).set_index("alpha")
