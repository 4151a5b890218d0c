r"""The length weighting f_alpha(L) = L^(alpha - 1), on a toy with two completion lengths.

`grpo_companion.core.losses.aggregate` with ``loss_type="length_alpha"`` weights completion i's
token sum by f_alpha(L_i) (`grpo_companion.core.losses.length_weights`): alpha = 0 is GRPO's mean
over each completion's tokens, alpha = 1 Dr. GRPO's plain sum. Two properties one would like,
(P1) unbiased: E[f(L) A s] is a positive multiple of grad J, and (P2) length-invariant: a
completion's contribution does not depend on its length, cannot hold together when the lengths
move with the policy. P1 needs alpha = 1; P2 needs alpha = 0 read as the total weight of a
completion's tokens, L f(L) = L^alpha, or alpha = 1/2 read as the size of its gradient,
f(L) ||s|| ~ L^(alpha - 1/2) in root mean square since token scores are martingale differences
and E||s||^2 ~ L. `TwoLengthToy` measures both exactly (`length_tradeoff`,
`length_tradeoff_table`, `length_alpha_choices`, `length_summary`), and
`opo_baseline_comparison` sets OPO's length-weighted baseline against E[r] and b* on it.

Chapter: :doc:`/book/09_advantage_zoo` (section 4: the length trade-off; section 6: OPO's
baseline)
"""

from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import binom

from grpo_companion.core.losses import length_weights


@dataclass(frozen=True)
class TwoLengthToy:
    """Completions of `short_length` or `long_length` tokens (form token included).

    The first token decides the form, long with probability q = sigmoid(long_logit); then come
    n = L - 1 step tokens, each right with probability s = sigmoid(step_logit), independently,
    and the reward is 1 when every step is right. With theta = (long_logit, step_logit) and c the
    number of right steps, the score is (d - q, c - n s), d = 1 for the long form, and
    J = (1 - q) s^(n_short) + q s^(n_long). Every expectation is a sum over d and
    c ~ Binomial(n_d, s): exact, O(L).
    """

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
    `grpo_companion.core.verl_estimators.opo_advantages`) against E[r] and the optimal constant
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
