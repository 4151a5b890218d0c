"""The group gradient g = (1/G) sum_i A_i s_i and the one sampler of group estimates, in core.

Checked against a loop over the members written out here, against the plain sum S^T A (G g), and
the sampler against `group_gradient` on the very groups it drew.
"""

import pytest
import torch

from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.group_estimators import (
    estimator_advantages,
    group_gradient,
    sample_group_estimates,
)
from grpo_companion.core.policy_gradient import SequencePolicy, sum_mod_reward

F64 = torch.float64


def test_group_gradient_is_the_member_average_of_advantage_times_score():
    scores = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, -1.0]], dtype=F64)  # (G = 3, P = 2)
    advantages = torch.tensor([0.5, -1.0, 2.0], dtype=F64)
    # (1/3) [0.5 (1, 0) - (0, 2) + 2 (3, -1)] = (1/3) (6.5, -4)
    torch.testing.assert_close(
        group_gradient(scores, advantages), torch.tensor([6.5 / 3, -4 / 3], dtype=F64)
    )


def test_group_gradient_is_one_over_g_times_the_plain_sum_and_batches():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 5, 6, generator=generator, dtype=F64)  # (groups, G, P)
    advantages = torch.randn(4, 5, generator=generator, dtype=F64)
    batched = group_gradient(scores, advantages)
    assert batched.shape == (4, 6)
    for b in range(4):
        loop = sum(advantages[b, i] * scores[b, i] for i in range(5)) / 5
        torch.testing.assert_close(batched[b], loop, rtol=0, atol=1e-14)
        torch.testing.assert_close(5 * batched[b], advantages[b] @ scores[b], rtol=0, atol=1e-13)


def test_group_gradient_casts_advantages_to_the_scores_dtype():
    scores = torch.ones(2, 3, dtype=F64)
    advantages = torch.tensor([1.0, -0.5], dtype=torch.float32)
    gradient = group_gradient(scores, advantages)
    assert gradient.dtype == F64
    torch.testing.assert_close(gradient, torch.full((3,), 0.25, dtype=F64))


def test_dr_grpo_group_gradient_of_a_binary_group_is_the_centroid_difference():
    """k correct of G: g = (k (G - k) / G^2) (m_correct - m_incorrect) for A = r - mean(r)."""
    generator = torch.Generator().manual_seed(1)
    scores = torch.randn(5, 3, generator=generator, dtype=F64)
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0, 0.0]], dtype=F64)
    gradient = group_gradient(scores, group_advantages(rewards, "dr_grpo")[0])
    difference = scores[[0, 2]].mean(dim=0) - scores[[1, 3, 4]].mean(dim=0)
    torch.testing.assert_close(gradient, 2 * 3 / 25 * difference, rtol=0, atol=1e-14)


def test_estimator_advantages_of_the_group_free_baselines():
    rewards = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]], dtype=F64)
    torch.testing.assert_close(estimator_advantages(rewards, "no_baseline"), rewards)
    torch.testing.assert_close(estimator_advantages(rewards, "oracle", 0.25), rewards - 0.25)
    # any leading shape goes to group_advantages one group per row
    stacked = torch.stack([rewards, rewards.flip(0)])  # (2, 2, 3)
    torch.testing.assert_close(
        estimator_advantages(stacked, "rloo")[1], group_advantages(rewards.flip(0), "rloo")
    )
    torch.testing.assert_close(
        estimator_advantages(rewards, "rloo")[0], torch.tensor([0.5, -1.0, 0.5], dtype=F64)
    )
    with pytest.raises(ValueError, match="value"):
        estimator_advantages(rewards, "oracle")


@pytest.mark.parametrize("method", ["no_baseline", "oracle", "dr_grpo", "rloo", "grpo"])
def test_sampler_is_group_gradient_of_the_groups_it_draws(method):
    """Replays the draws (one `policy.sample` of num_groups * G, group by group) and applies
    `group_gradient` member by member; "oracle" uses the exact J."""
    policy = SequencePolicy(vocab_size=3, length=2)
    logits = policy.init_logits(seed=3, scale=1.5)
    rewards = sum_mod_reward(policy.all_sequences(), policy.vocab_size)
    estimates = sample_group_estimates(
        policy, logits, rewards, 5, 7, torch.Generator().manual_seed(2), method
    )
    draws = policy.sample(logits, 35, torch.Generator().manual_seed(2)).view(7, 5)
    scores = policy.scores(logits, policy.all_sequences())[draws]
    value = float(policy.probs(logits) @ rewards)
    advantages = {
        "no_baseline": rewards[draws],
        "oracle": rewards[draws] - value,
    }.get(method)
    if advantages is None:
        advantages = group_advantages(rewards[draws], method)
    torch.testing.assert_close(estimates, group_gradient(scores, advantages), rtol=0, atol=1e-14)
