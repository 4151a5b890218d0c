"""Chapter 1's estimators against exact enumeration.

Statistical tolerances: an n-sample REINFORCE mean has E||g_n - grad J||^2 = Var/n exactly, so
||g_n - grad J|| > 5 sqrt(Var/n) has probability below 1/25 by Markov's inequality on the square
for any one draw, and far less in practice (the error is a sum of many small terms); seeds are
fixed, so each test is deterministic and was checked not to sit near its bound.
"""

import math

import pytest
import torch
from conftest import sum_mod_setup

from grpo_companion.core.policy_gradient import (
    SequencePolicy,
    estimator_variance,
    exact_prefix_values,
    monte_carlo_errors,
    optimal_baseline,
    reinforce_estimates,
    reinforce_gradient,
    softmax_policy_gradient,
)


@pytest.fixture
def setup():
    return sum_mod_setup(vocab_size=3, length=3, seed=1)


def test_probabilities_sum_to_one_and_match_token_by_token(setup):
    policy, logits, _ = setup
    probs = policy.probs(logits)
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-12)
    # Sequence 0 2 1: BOS -> 0 at step 0, 0 -> 2 at step 1, 2 -> 1 at step 2.
    step = torch.softmax(logits, dim=-1)
    by_hand = step[0, 3, 0] * step[1, 0, 2] * step[2, 2, 1]
    index = 0 * 9 + 2 * 3 + 1
    assert probs[index].item() == pytest.approx(by_hand.item(), rel=1e-12)


def test_closed_form_scores_equal_autograd(setup):
    policy, logits, _ = setup
    sequences = policy.all_sequences()
    scores = policy.scores(logits, sequences)
    for k in [0, 5, 26]:
        jacobian = torch.autograd.functional.jacobian(
            lambda t, k=k: policy.log_prob(t, sequences[k : k + 1])[0], logits
        )
        torch.testing.assert_close(scores[k], jacobian.flatten(), rtol=0, atol=1e-12)


def test_score_function_identity_is_exact(setup):
    """sum_y pi(y) r(y) s(y) equals autograd's gradient of J: the theorem, to rounding."""
    policy, logits, rewards = setup
    scores = policy.scores(logits, policy.all_sequences())
    theorem = (policy.probs(logits) * rewards) @ scores
    torch.testing.assert_close(theorem, policy.exact_gradient(logits, rewards), rtol=0, atol=1e-14)
    # and the expected score is zero, which is what makes baselines free of bias
    assert (policy.probs(logits) @ scores).abs().max().item() < 1e-15


def test_bandit_closed_form_equals_autograd():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, generator=generator, dtype=torch.float64)
    rewards = torch.randn(6, generator=generator, dtype=torch.float64)
    leaf = logits.clone().requires_grad_(True)
    (autograd,) = torch.autograd.grad(torch.softmax(leaf, -1) @ rewards, leaf)
    torch.testing.assert_close(
        softmax_policy_gradient(logits, rewards), autograd, rtol=0, atol=1e-14
    )


@pytest.mark.parametrize("baseline", [0.0, 0.3, 2.0])
def test_monte_carlo_estimate_is_unbiased(setup, baseline):
    policy, logits, rewards = setup
    num_samples = 400_000
    (estimate,) = reinforce_estimates(
        policy, logits, rewards, num_samples, 1, torch.Generator().manual_seed(7), baseline
    )
    exact = policy.exact_gradient(logits, rewards)
    standard_error = math.sqrt(
        estimator_variance(policy, logits, rewards, baseline).item() / num_samples
    )
    assert (estimate - exact).norm().item() < 5 * standard_error


def test_counting_estimate_equals_per_sample_mean(setup):
    policy, logits, rewards = setup
    draws = policy.sample(logits, 1000, torch.Generator().manual_seed(3))
    per_sample = reinforce_gradient(
        policy.scores(logits, policy.all_sequences())[draws], rewards[draws], baseline=0.4
    )
    (counted,) = reinforce_estimates(
        policy, logits, rewards, 1000, 1, torch.Generator().manual_seed(3), baseline=0.4
    )
    torch.testing.assert_close(counted, per_sample, rtol=0, atol=1e-12)


def test_mean_squared_error_is_v_over_n(setup):
    policy, logits, rewards = setup
    errors = monte_carlo_errors(policy, logits, rewards, [50, 5000], num_repeats=400, seed=0)
    variance = estimator_variance(policy, logits, rewards, 0.0).item()
    mse = errors.square().mean(dim=1)
    # 400 repeats: the mean of squared errors is within ~15% of V/n (its own relative sd ~ 7%).
    torch.testing.assert_close(
        mse, torch.tensor([variance / 50, variance / 5000], dtype=torch.float64), rtol=0.15, atol=0
    )


def test_variance_formula_matches_sample_variance(setup):
    policy, logits, rewards = setup
    draws = policy.sample(logits, 300_000, torch.Generator().manual_seed(11))
    scores = policy.scores(logits, policy.all_sequences())[draws]
    for baseline in [0.0, 0.5]:
        sample_variance = ((rewards[draws] - baseline)[:, None] * scores).var(dim=0).sum().item()
        assert sample_variance == pytest.approx(
            estimator_variance(policy, logits, rewards, baseline).item(), rel=0.02
        )


def test_optimal_baseline_is_the_brute_force_minimiser(setup):
    policy, logits, rewards = setup
    grid = torch.linspace(-1, 2, 30_001, dtype=torch.float64)
    brute_force = grid[estimator_variance(policy, logits, rewards, grid).argmin()].item()
    b_star = optimal_baseline(policy, logits, rewards)
    assert b_star == pytest.approx(brute_force, abs=1e-4)
    # and it is not simply the mean reward on this policy
    mean_reward = policy.objective(logits, rewards).item()
    assert abs(b_star - mean_reward) > 1e-3
    assert estimator_variance(policy, logits, rewards, b_star) < estimator_variance(
        policy, logits, rewards, mean_reward
    )


def test_parabola_identity(setup):
    """V(b) - V(b*) = E||s||^2 (b - b*)^2 for every b."""
    policy, logits, rewards = setup
    b_star = optimal_baseline(policy, logits, rewards)
    mean_squared_norm = policy.probs(logits) @ policy.scores(
        logits, policy.all_sequences()
    ).square().sum(dim=1)
    for b in [-0.5, 0.2, 1.7]:
        gap = estimator_variance(policy, logits, rewards, b) - estimator_variance(
            policy, logits, rewards, b_star
        )
        assert gap.item() == pytest.approx((mean_squared_norm * (b - b_star) ** 2).item(), rel=1e-9)


def test_bad_policy_shape_is_refused():
    with pytest.raises(ValueError, match="vocab_size >= 2"):
        SequencePolicy(vocab_size=1, length=3)


def test_token_log_probs_are_the_softmax_steps_and_sum_to_log_prob(setup):
    policy, logits, _ = setup
    sequences = policy.all_sequences()
    token_log_probs = policy.token_log_probs(logits, sequences)
    assert token_log_probs.shape == (policy.num_sequences, policy.length)
    torch.testing.assert_close(
        token_log_probs.sum(dim=1), policy.log_prob(logits, sequences), rtol=0, atol=1e-14
    )
    # Sequence 0 2 1 again, token by token.
    step = torch.log_softmax(logits, dim=-1)
    expected = torch.stack([step[0, 3, 0], step[1, 0, 2], step[2, 2, 1]])
    torch.testing.assert_close(token_log_probs[0 * 9 + 2 * 3 + 1], expected, rtol=0, atol=1e-14)


def test_exact_prefix_values_are_brute_force_conditional_expectations(setup):
    policy, logits, rewards = setup
    rewards = rewards + torch.arange(policy.num_sequences, dtype=torch.float64) / 100  # not 0/1
    values = exact_prefix_values(policy, logits, rewards)
    assert values.shape == (policy.num_sequences, policy.length + 1)
    sequences, probs = policy.all_sequences(), policy.probs(logits)
    for k in range(policy.num_sequences):
        for t in range(policy.length + 1):
            # E[r | y_<t] by filtering the sequences that share sequence k's first t tokens.
            same = (sequences[:, :t] == sequences[k, :t]).all(dim=1)
            expected = (probs[same] @ rewards[same]) / probs[same].sum()
            torch.testing.assert_close(values[k, t], expected, rtol=0, atol=1e-14)
    torch.testing.assert_close(
        values[:, 0], policy.objective(logits, rewards).expand(policy.num_sequences)
    )
    torch.testing.assert_close(values[:, -1], rewards, rtol=0, atol=1e-14)
    # Hand-checked: under the uniform policy V(y_<2) averages the 3 rewards of the prefix's block.
    uniform = exact_prefix_values(
        policy, torch.zeros(policy.logits_shape, dtype=torch.float64), rewards
    )
    torch.testing.assert_close(uniform[4, 2], rewards[3:6].mean(), rtol=0, atol=1e-14)
