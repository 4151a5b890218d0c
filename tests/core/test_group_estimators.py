"""The group estimators of chapters 2, 8 and 10 against brute force and closed forms.

Monte Carlo tolerances: seeds are fixed, so each check is deterministic; every bound is at least
four standard errors of the quantity it checks and was checked not to sit near it.
"""

import itertools
import math

import pytest
import torch
from conftest import sum_mod_setup

from grpo_companion.core import exact
from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.group_estimators import (
    gradient_weight,
    group_estimator_moments,
    multisets,
    sample_group_estimates,
)

F64 = torch.float64


def test_multisets_count_every_ordered_group_once():
    members, log_multiplicity = multisets(num_outcomes=4, group_size=3)
    assert members.shape == (math.comb(6, 3), 3)
    ordered = {}
    for group in itertools.product(range(4), repeat=3):
        key = tuple(sorted(group))
        ordered[key] = ordered.get(key, 0) + 1
    assert {
        tuple(row.tolist()): round(math.exp(m))
        for row, m in zip(members, log_multiplicity.tolist())
    } == ordered


def test_multisets_refuse_too_many_groups():
    with pytest.raises(ValueError, match="exceed max_groups"):
        multisets(64, 8)


@pytest.mark.parametrize("method", ["dr_grpo", "rloo", "grpo"])
def test_multiset_sum_equals_brute_force_over_ordered_groups(method):
    """All 4^3 = 64 ordered groups of a vocab-2, length-2 policy, one by one."""
    policy, logits, rewards = sum_mod_setup(vocab_size=2, length=2, seed=0)
    probs, scores = policy.probs(logits), policy.scores(logits, policy.all_sequences())
    groups = torch.tensor(list(itertools.product(range(policy.num_sequences), repeat=3)))
    weights = probs[groups].prod(dim=1)
    advantages = group_advantages(rewards[groups], method)
    estimates = torch.einsum("mg,mgp->mp", advantages, scores[groups]) / 3
    mean = weights @ estimates
    variance = weights @ (estimates - mean).square().sum(dim=1)
    moments = group_estimator_moments(policy, logits, rewards, 3, method)
    torch.testing.assert_close(moments["mean"], mean, rtol=0, atol=1e-14)
    assert moments["variance"].item() == pytest.approx(variance.item(), rel=1e-12)


@pytest.mark.parametrize("group_size", range(2, 9))
def test_mean_including_self_scales_by_one_minus_one_over_g_and_rloo_is_unbiased(group_size):
    policy, logits, rewards = sum_mod_setup(vocab_size=2, length=3, seed=0)
    exact_gradient = policy.exact_gradient(logits, rewards)
    mean_self = group_estimator_moments(policy, logits, rewards, group_size, "dr_grpo")["mean"]
    leave_one_out = group_estimator_moments(policy, logits, rewards, group_size, "rloo")["mean"]
    torch.testing.assert_close(mean_self, (1 - 1 / group_size) * exact_gradient, rtol=0, atol=1e-9)
    torch.testing.assert_close(leave_one_out, exact_gradient, rtol=0, atol=1e-9)


@pytest.mark.parametrize("unbiased_std", [True, False])
def test_std_scaling_is_the_bernoulli_weight_of_the_pass_rate(unbiased_std):
    """On a 3-token policy E[g_grpo] = w(p) grad J with exact.py's one-parameter w(p)."""
    policy, _, rewards = sum_mod_setup(vocab_size=2, length=3, seed=0)
    for seed in range(3):
        logits = policy.init_logits(seed + 10, scale=2.0)
        pass_rate = policy.objective(logits, rewards).item()
        moments = group_estimator_moments(
            policy, logits, rewards, 5, "grpo", unbiased_std=unbiased_std
        )
        weight, residual = gradient_weight(moments["mean"], policy.exact_gradient(logits, rewards))
        expected = exact.estimator_moments(pass_rate, 5, "grpo", unbiased_std=unbiased_std)[
            "weight"
        ][0]
        assert weight == pytest.approx(expected, abs=1e-9)
        assert residual < 1e-12


def test_group_variance_matches_monte_carlo():
    policy, logits, rewards = sum_mod_setup(vocab_size=3, length=2, seed=0)
    group_size, num_groups = 4, 200_000
    estimates = sample_group_estimates(
        policy, logits, rewards, group_size, num_groups, torch.Generator().manual_seed(5), "rloo"
    )
    moments = group_estimator_moments(policy, logits, rewards, group_size, "rloo")
    # 200k groups: the sample variance is within ~1% (its relative sd is ~0.3% here).
    assert estimates.var(dim=0).sum().item() == pytest.approx(moments["variance"].item(), rel=0.02)
    # and the sample mean within 5 standard errors of the exact mean
    standard_error = math.sqrt(moments["variance"].item() / num_groups)
    assert (estimates.mean(dim=0) - moments["mean"]).norm().item() < 5 * standard_error


def test_sampled_group_estimates_are_the_per_member_sums():
    policy, logits, rewards = sum_mod_setup(vocab_size=3, length=2, seed=0)
    estimates = sample_group_estimates(
        policy, logits, rewards, 5, 7, torch.Generator().manual_seed(3), "grpo"
    )
    draws = policy.sample(logits, 35, torch.Generator().manual_seed(3)).view(7, 5)
    scores = policy.scores(logits, policy.all_sequences())[draws]
    by_member = torch.einsum("ng,ngp->np", group_advantages(rewards[draws], "grpo"), scores) / 5
    torch.testing.assert_close(estimates, by_member, rtol=0, atol=1e-14)


def test_gradient_weight_splits_scale_and_direction():
    direction = torch.tensor([3.0, 4.0], dtype=F64)
    assert gradient_weight(0.5 * direction, direction) == pytest.approx((0.5, 0.0), abs=1e-15)
    weight, residual = gradient_weight(direction + torch.tensor([-4.0, 3.0], dtype=F64), direction)
    assert (weight, residual) == pytest.approx((1.0, 1.0), abs=1e-15)
