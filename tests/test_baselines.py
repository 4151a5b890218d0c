"""Chapter 6's baseline identities against brute force and exact enumeration.

Monte Carlo tolerance (one test): 400k groups with a fixed seed; the bound is several standard
errors of the sample variance and was checked not to sit near it.
"""

import pytest
import torch

from grpo_companion.chapters.baselines import (
    baseline_gap,
    group_variances,
    optimal_token_baselines,
    rank_reward,
    squared_score_norms,
    token_baseline_moments,
    token_score_norms,
    uncorrelated_reward,
    value_baselines,
)
from grpo_companion.core.group_estimators import group_estimator_moments, sample_group_estimates
from grpo_companion.core.policy_gradient import SequencePolicy, estimator_variance, sum_mod_reward

F64 = torch.float64


@pytest.fixture
def setup():
    policy = SequencePolicy(vocab_size=3, length=3)
    logits = policy.init_logits(seed=1, scale=1.5)
    rewards = sum_mod_reward(policy.all_sequences(), policy.vocab_size)
    return policy, logits, rewards


def test_gap_is_covariance_over_mean_squared_norm(setup):
    policy, logits, rewards = setup
    for reward in (
        rewards,
        rank_reward(policy, logits, 9, rarest=True),
        torch.linspace(-1, 2, 27, dtype=F64),
    ):
        gap = baseline_gap(policy, logits, reward)
        assert gap["gap"] == pytest.approx(
            gap["covariance"] / gap["mean_squared_norm"], rel=1e-9, abs=1e-15
        )
        # the parabola: the excess variance of the mean baseline is E||s||^2 gap^2
        excess = gap["variance_at_mean"] - gap["variance_at_optimal"]
        assert excess == pytest.approx(
            gap["mean_squared_norm"] * gap["gap"] ** 2, rel=1e-9, abs=1e-15
        )
        assert gap["excess_variance"] >= 0


def test_uniform_policy_makes_the_mean_optimal_for_any_reward(setup):
    policy, _, _ = setup
    uniform = torch.zeros(policy.logits_shape, dtype=F64)
    # ||s||^2 = sum_t (1 - 1/V) for every sequence
    torch.testing.assert_close(
        squared_score_norms(policy, uniform),
        torch.full((27,), 3 * (1 - 1 / 3), dtype=F64),
        rtol=0,
        atol=1e-14,
    )
    reward = torch.rand(27, generator=torch.Generator().manual_seed(0), dtype=F64)
    gap = baseline_gap(policy, uniform, reward)
    assert abs(gap["gap"]) < 1e-14 and gap["excess_variance"] == pytest.approx(0, abs=1e-12)
    assert gap["correlation"] != gap["correlation"]  # nan: the norm is constant


def test_uncorrelated_reward_closes_the_gap(setup):
    policy, logits, rewards = setup
    assert abs(baseline_gap(policy, logits, rewards)["gap"]) > 1e-3
    constructed = uncorrelated_reward(policy, logits, rewards)
    gap = baseline_gap(policy, logits, constructed)
    assert abs(gap["covariance"]) < 1e-14 and abs(gap["gap"]) < 1e-14
    assert gap["mean_reward"] == pytest.approx(policy.objective(logits, rewards).item(), rel=1e-12)


def test_rank_reward_picks_the_rarest_or_likeliest(setup):
    policy, logits, _ = setup
    probs = policy.probs(logits)
    rare, likely = (
        rank_reward(policy, logits, 5, rarest=True),
        rank_reward(policy, logits, 5, rarest=False),
    )
    assert rare.sum() == likely.sum() == 5
    assert probs[rare == 1].max() < probs[rare == 0].min()
    assert probs[likely == 1].min() > probs[likely == 0].max()
    with pytest.raises(ValueError, match="num_rewarded"):
        rank_reward(policy, logits, 27, rarest=True)


@pytest.mark.parametrize("group_size", [2, 3, 5])
def test_group_variance_closed_forms_against_exact_enumeration(setup, group_size):
    policy, logits, rewards = setup
    closed = group_variances(policy, logits, rewards, group_size)
    rloo = group_estimator_moments(policy, logits, rewards, group_size, "rloo")
    mean_self = group_estimator_moments(policy, logits, rewards, group_size, "dr_grpo")
    exact_gradient = policy.exact_gradient(logits, rewards)
    assert closed["rloo"] == pytest.approx(rloo["variance"].item(), rel=1e-9)
    assert closed["mean_self"] == pytest.approx(mean_self["variance"].item(), rel=1e-9)
    mse = mean_self["variance"] + (mean_self["mean"] - exact_gradient).square().sum()
    assert closed["mean_self_mse"] == pytest.approx(mse.item(), rel=1e-9)
    mean_reward = policy.objective(logits, rewards).item()
    assert closed["oracle_mean"] == pytest.approx(
        estimator_variance(policy, logits, rewards, mean_reward).item() / group_size, rel=1e-12
    )
    assert closed["oracle_optimal"] <= closed["oracle_mean"] < closed["rloo"]


def test_group_variance_closed_form_against_monte_carlo_at_large_g(setup):
    policy, logits, rewards = setup
    group_size, num_groups = 32, 100_000  # C(58, 32) multisets: too many to enumerate
    estimates = sample_group_estimates(
        policy, logits, rewards, group_size, num_groups, torch.Generator().manual_seed(4), "rloo"
    )
    # relative sd of a 100k-sample variance of a near-Gaussian 30-dimensional vector: well under 1%
    assert estimates.var(dim=0).sum().item() == pytest.approx(
        group_variances(policy, logits, rewards, group_size)["rloo"], rel=0.03
    )
    with pytest.raises(ValueError, match="group_size"):
        group_variances(policy, logits, rewards, 1)


def test_token_score_norms_add_up_to_the_sequence_norm(setup):
    policy, logits, _ = setup
    torch.testing.assert_close(
        token_score_norms(policy, logits).sum(dim=1),
        squared_score_norms(policy, logits),
        rtol=0,
        atol=1e-13,
    )


def test_constant_token_baseline_is_chapter_one(setup):
    policy, logits, rewards = setup
    for b in [0.0, 0.4]:
        moments = token_baseline_moments(policy, logits, rewards, torch.full((27, 3), b, dtype=F64))
        assert moments["variance"].item() == pytest.approx(
            estimator_variance(policy, logits, rewards, b).item(), rel=1e-12
        )
        torch.testing.assert_close(
            moments["mean"], policy.exact_gradient(logits, rewards), rtol=0, atol=1e-14
        )


def test_value_baselines_are_conditional_success_rates(setup):
    policy, logits, rewards = setup
    values = value_baselines(policy, logits, rewards)
    probs = policy.probs(logits)
    assert values[:, 0].unique().tolist() == pytest.approx(
        [policy.objective(logits, rewards).item()], rel=1e-12
    )
    # prefix (1, 2): sequences 1*9 + 2*3 + {0, 1, 2}; the reward needs y_3 = 0
    block = slice(15, 18)
    by_hand = (probs[block] @ rewards[block] / probs[block].sum()).item()
    assert values[15, 2].item() == pytest.approx(by_hand, rel=1e-12)
    assert values[15, 2].item() == pytest.approx(
        torch.softmax(logits[2, 2], -1)[0].item(), rel=1e-12
    )


def test_optimal_token_baselines_are_unbiased_and_locally_optimal(setup):
    policy, logits, rewards = setup
    best = optimal_token_baselines(policy, logits, rewards)
    moments = token_baseline_moments(policy, logits, rewards, best)
    torch.testing.assert_close(
        moments["mean"], policy.exact_gradient(logits, rewards), rtol=0, atol=1e-14
    )
    for other in (value_baselines(policy, logits, rewards), torch.full((27, 3), 0.3, dtype=F64)):
        assert (
            moments["variance"] < token_baseline_moments(policy, logits, rewards, other)["variance"]
        )
    # moving any one prefix's baseline either way raises the variance
    for step, first, last in [(0, 0, 27), (1, 9, 18), (2, 3, 6)]:
        for delta in (-1e-3, 1e-3):
            moved = best.clone()
            moved[first:last, step] += delta
            assert (
                token_baseline_moments(policy, logits, rewards, moved)["variance"]
                > moments["variance"]
            )


def test_token_baselines_that_see_the_token_are_refused(setup):
    policy, logits, rewards = setup
    cheating = rewards[:, None].repeat(1, 3)  # b_t = r: zero "variance", but biased
    with pytest.raises(ValueError, match="prefix"):
        token_baseline_moments(policy, logits, rewards, cheating)
