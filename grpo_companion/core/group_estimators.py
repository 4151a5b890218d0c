"""Exact moments of a group estimator on an enumerable `SequencePolicy`, summed over every group.

GRPO's estimator at the first step on a batch (ratio 1, no KL term) is
g = (1/G) sum_i A_i s(y_i), s = grad log pi, over a group of G i.i.d. completions
(`group_gradient`). `group_estimator_moments` gives its exact mean and variance for any reward
table, without sampling: the methods are permutation-equivariant, so it sums over the
C(N + G - 1, G) multisets of the N sequences (`multisets`), each with its multinomial
probability. It is not `core.exact.estimator_moments` (binary rewards, a sum over the number of
correct completions at a pass rate p) nor the U-statistic moments of `chapters.group_size`.

Chapter: :doc:`/book/02_group_baseline` (section 2: the mean including the completion itself
costs a factor 1 - 1/G, leave-one-out none); also used by chapters 8 and 10. The loss around the
estimator is chapter 3's, `grpo_companion.chapters.grpo_loss.loss`.
"""

import itertools
import math

import torch
from torch import Tensor

from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.policy_gradient import SequencePolicy


def multisets(
    num_outcomes: int, group_size: int, max_groups: int = 2_000_000
) -> tuple[Tensor, Tensor]:
    """Every multiset of `group_size` outcomes out of `num_outcomes`, once.

    Returns `members: (M, group_size)` outcome ids, each row sorted, and
    `log_multiplicity: (M,)` = log(G! / prod_y c_y!), the number of ordered groups that are
    that multiset; M = C(num_outcomes + group_size - 1, group_size). Refuses M > `max_groups`.
    """
    if num_outcomes < 1 or group_size < 1:
        raise ValueError(
            f"need num_outcomes >= 1 and group_size >= 1, got {num_outcomes}, {group_size}"
        )
    count = math.comb(num_outcomes + group_size - 1, group_size)
    if count > max_groups:
        raise ValueError(
            f"{count:,} multisets of {group_size} out of {num_outcomes} outcomes exceed "
            f"max_groups = {max_groups:,}; use a smaller policy or group size"
        )
    members = torch.tensor(
        list(itertools.combinations_with_replacement(range(num_outcomes), group_size))
    )
    counts = torch.nn.functional.one_hot(members, num_outcomes).sum(dim=1).to(torch.float64)
    log_multiplicity = math.lgamma(group_size + 1) - torch.lgamma(counts + 1).sum(dim=1)
    return members, log_multiplicity


def group_gradient(scores: Tensor, advantages: Tensor) -> Tensor:
    """The group's gradient estimate g = (1/G) sum_i A_i s_i, at ratio 1 (first step on a batch).

    Chapter: :doc:`/book/02_group_baseline`

    `scores: (..., G, num_params)` (s_i = grad log pi(y_i)), `advantages: (..., G)`; returns
    `(..., num_params)`, one g per group. The 1/G is the group mean of GRPO's loss (the gradient
    of -(1/G) sum_i A_i log pi(y_i)); the plain sum S^T A, which some derivations use, is G g.
    `advantages` is cast to the dtype of `scores`.
    """
    return (advantages.to(scores.dtype)[..., None] * scores).mean(dim=-2)


def group_estimator_moments(
    policy: SequencePolicy,
    logits: Tensor,
    rewards: Tensor,
    group_size: int,
    method: str = "dr_grpo",
    **options,
) -> dict[str, Tensor]:
    """Exact mean and variance of a group estimator, summed over every group of G i.i.d. draws
    of the sequence policy: g = (1/G) sum_i A_i s(y_i), any reward table.

    `rewards: (num_sequences,)`; `method` and `options` go to `group_advantages`. Returns
    "mean": `(num_params,)`, E[g], and "variance": a scalar tensor, E||g - E[g]||^2 (the trace
    of the covariance, as in chapter 1's `estimator_variance`).
    """
    members, log_multiplicity = multisets(policy.num_sequences, group_size)
    log_probs = policy.log_prob(logits, policy.all_sequences()).detach()
    group_probs = (log_multiplicity + log_probs[members].sum(dim=1)).exp()  # (M,)
    advantages = group_advantages(rewards[members], method, **options)  # (M, G)
    score_table = policy.scores(logits, policy.all_sequences())  # (N, P)
    estimates = torch.einsum("mg,mgp->mp", advantages, score_table[members]) / group_size
    mean = group_probs @ estimates
    variance = group_probs @ (estimates - mean).square().sum(dim=1)
    return {"mean": mean, "variance": variance}


def estimator_advantages(rewards: Tensor, method: str, value=None, **options) -> Tensor:
    """Advantages `(..., G)` of `rewards: (..., G)` for the group estimators of the book.

    `method` in `grpo_companion.core.advantages.METHODS` goes to `group_advantages` with
    `options`; the group-free baselines of `grpo_companion.core.exact.GROUP_FREE` are
    "no_baseline", A = r, and "oracle", A = r - value, with `value` the true value J of the
    group's prompt (a number, or a tensor broadcastable to `(..., 1)`).
    """
    if method == "no_baseline":
        return rewards
    if method == "oracle":
        if value is None:
            raise ValueError("method 'oracle' needs the true value J as value=...")
        return rewards - value
    flat = rewards.reshape(-1, rewards.shape[-1])
    return group_advantages(flat, method, **options).reshape(rewards.shape)


def sample_group_estimates(
    policy: SequencePolicy,
    logits: Tensor,
    rewards: Tensor,
    group_size: int,
    num_groups: int,
    generator: torch.Generator,
    method: str = "dr_grpo",
    **options,
) -> Tensor:
    """`group_gradient` of `num_groups` independent groups of G sequences drawn from pi:
    `(num_groups, num_params)`; `rewards: (num_sequences,)` is the reward table.

    The draws are one `policy.sample` of num_groups * G sequences, group by group. `method` and
    `options` go to `estimator_advantages`; "oracle" gets the exact J of the policy as its
    value. Each group's A_i / G are added onto the sequences it holds,
    `(num_groups, num_sequences)`, and one matmul with the score table gives every g: no
    `(num_groups, G, num_params)` tensor is built.
    """
    members = policy.sample(logits, num_groups * group_size, generator).view(num_groups, group_size)
    value = float(policy.objective(logits, rewards)) if method == "oracle" else None
    advantages = estimator_advantages(rewards[members], method, value, **options)
    per_sequence = torch.zeros(num_groups, policy.num_sequences, dtype=advantages.dtype)
    per_sequence.scatter_add_(1, members, advantages / group_size)
    return per_sequence @ policy.scores(logits, policy.all_sequences())


def gradient_weight(expected: Tensor, true_gradient: Tensor) -> tuple[float, float]:
    """Write `expected = w * true_gradient + residual`, both `(num_params,)`.

    Returns w = <expected, grad J> / ||grad J||^2 and ||residual|| / ||grad J||: w = 1 and a zero
    residual is an unbiased estimator, w != 1 with a zero residual a rescaled one.
    """
    squared_norm = true_gradient.square().sum()
    weight = expected @ true_gradient / squared_norm
    residual = (expected - weight * true_gradient).norm() / squared_norm.sqrt()
    return float(weight), float(residual)
