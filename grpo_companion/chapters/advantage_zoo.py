r"""Chapter 7: the length weighting f_alpha(L) = L^(alpha - 1), on a toy with two lengths.

The trade-off
-------------
`grpo_companion.core.losses.aggregate` with ``loss_type="length_alpha"`` weights completion i's token
sum by f_alpha(L_i), so at ratio 1 one completion adds f_alpha(L_i) A_i s(y_i) to the update,
s = grad log pi(y) = the sum of its L tokens' scores. Two properties one would like:

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

from grpo_companion.core.losses import length_weights


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
