"""Chapter 2's group estimators, KL estimators and token weights against brute force and closed forms.

Monte Carlo tolerances: seeds are fixed, so each check is deterministic; every bound is at least
four standard errors of the quantity it checks and was checked not to sit near it.
"""

import itertools
import math

import numpy as np
import pytest
import torch

from grpo_companion.core import exact
from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.group_estimators import (
    batch_loss,
    gradient_weight,
    group_estimator_moments,
    kl_divergence,
    kl_estimator_moments,
    multisets,
    optimize_on_batch,
    sample_group_estimates,
    sequence_kl_estimates,
    token_weights,
)
from grpo_companion.core.policy_gradient import SequencePolicy, reinforce_gradient, sum_mod_reward

F64 = torch.float64


def _setup(vocab_size, length, seed=0):
    policy = SequencePolicy(vocab_size=vocab_size, length=length)
    logits = policy.init_logits(seed, scale=1.5)
    rewards = sum_mod_reward(policy.all_sequences(), vocab_size)
    return policy, logits, rewards


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
    policy, logits, rewards = _setup(vocab_size=2, length=2)
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
    policy, logits, rewards = _setup(vocab_size=2, length=3)
    exact_gradient = policy.exact_gradient(logits, rewards)
    mean_self = group_estimator_moments(policy, logits, rewards, group_size, "dr_grpo")["mean"]
    leave_one_out = group_estimator_moments(policy, logits, rewards, group_size, "rloo")["mean"]
    torch.testing.assert_close(mean_self, (1 - 1 / group_size) * exact_gradient, rtol=0, atol=1e-9)
    torch.testing.assert_close(leave_one_out, exact_gradient, rtol=0, atol=1e-9)


@pytest.mark.parametrize("unbiased_std", [True, False])
def test_std_scaling_is_the_bernoulli_weight_of_the_pass_rate(unbiased_std):
    """On a 3-token policy E[g_grpo] = w(p) grad J with exact.py's one-parameter w(p)."""
    policy, _, rewards = _setup(vocab_size=2, length=3)
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
    policy, logits, rewards = _setup(vocab_size=3, length=2)
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
    policy, logits, rewards = _setup(vocab_size=3, length=2)
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


def test_kl_estimators_exact_moments():
    policy, ref_logits, _ = _setup(vocab_size=3, length=3)
    logits = ref_logits + 0.5 * policy.init_logits(seed=1)
    probs = policy.probs(logits)
    by_definition = (probs * (probs / policy.probs(ref_logits)).log()).sum().item()
    kl = kl_divergence(policy, logits, ref_logits)
    assert kl == pytest.approx(by_definition, rel=1e-12)
    moments = kl_estimator_moments(policy, logits, ref_logits)
    assert abs(moments["k1"]["bias"]) < 1e-12 and abs(moments["k3"]["bias"]) < 1e-12
    assert abs(moments["k2"]["bias"]) > 1e-3  # k2 is biased
    # k3 = k1 + (pi_ref / pi - 1) per token; the exact variance matches a sample variance.
    draws = policy.sample(logits, 400_000, torch.Generator().manual_seed(2))
    for estimator in ("k1", "k3"):
        samples = sequence_kl_estimates(
            policy, logits, ref_logits, policy.all_sequences()[draws], estimator
        )
        # k3's tail (pi_ref / pi) is heavy: its sample variance is within ~1.5% here, so 4%.
        assert samples.var().item() == pytest.approx(moments[estimator]["variance"], rel=0.04)
        assert abs(samples.mean().item() - kl) < 5 * math.sqrt(
            moments[estimator]["variance"] / len(draws)
        )


def test_token_weights_closed_forms():
    lengths = torch.tensor([2, 5, 8])
    mask = (torch.arange(10) < lengths[:, None]).to(F64)
    batch = len(lengths)
    torch.testing.assert_close(
        token_weights(mask, "grpo"), mask / (batch * lengths[:, None]), rtol=0, atol=1e-15
    )
    torch.testing.assert_close(
        token_weights(mask, "dr_grpo", max_completion_length=16),
        mask / (batch * 16),
        rtol=0,
        atol=1e-15,
    )
    torch.testing.assert_close(
        token_weights(mask, "dapo"), mask / lengths.sum(), rtol=0, atol=1e-15
    )
    torch.testing.assert_close(
        token_weights(mask, "length_alpha", alpha=0.0),
        token_weights(mask, "grpo"),
        rtol=0,
        atol=1e-15,
    )


def test_first_step_loss_is_zero_but_its_gradient_is_the_group_estimator():
    policy, logits, rewards = _setup(vocab_size=2, length=3)
    draws = policy.sample(logits, 6 * 4, torch.Generator().manual_seed(0))
    sequences = policy.all_sequences()[draws]
    advantages = group_advantages(rewards[draws].view(6, 4)).flatten()
    leaf = logits.clone().requires_grad_(True)
    loss, stats = batch_loss(policy, leaf, logits, sequences, advantages)
    (gradient,) = torch.autograd.grad(loss, leaf)
    assert abs(loss.item()) < 1e-15 and stats["clip_ratio"] == 0.0
    # grpo's loss_type averages the L tokens of a sequence: the gradient is -1/L times g.
    estimator = reinforce_gradient(policy.scores(logits, sequences), advantages)
    torch.testing.assert_close(gradient.flatten(), -estimator / policy.length, rtol=0, atol=1e-15)
    assert gradient.norm().item() > 1e-2


def test_optimize_on_batch_takes_plain_gradient_steps():
    policy, logits, rewards = _setup(vocab_size=2, length=3)
    draws = policy.sample(logits, 16, torch.Generator().manual_seed(1))
    sequences = policy.all_sequences()[draws]
    advantages = group_advantages(rewards[draws].view(4, 4)).flatten()
    history = optimize_on_batch(
        policy, logits, rewards, sequences, advantages, 2, 0.5, epsilon=math.inf
    )
    assert history["kl"][0] == 0.0 and history["clip_ratio"] == [0.0, 0.0]
    assert history["objective"][0] == pytest.approx(
        policy.objective(logits, rewards).item(), rel=1e-15
    )
    leaf = logits.clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(
        batch_loss(policy, leaf, logits, sequences, advantages)[0], leaf
    )
    assert history["kl"][1] == pytest.approx(
        kl_divergence(policy, logits - 0.5 * gradient, logits), rel=1e-12
    )
    # with a tiny epsilon the second step already clips tokens
    clipped = optimize_on_batch(
        policy, logits, rewards, sequences, advantages, 2, 0.5, epsilon=1e-3
    )
    assert clipped["clip_ratio"][1] > 0
    assert np.isfinite(clipped["kl"]).all()
