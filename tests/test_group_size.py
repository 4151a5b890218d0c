"""Chapter 8: the U-statistic form, exact moments on the sequence policy, the budget trade-off.

Two independent exact routes are checked against each other (Hoeffding's variance from pair
enumeration, and the conditional-on-k sums of `grpo_companion.core.exact` on the policy's reward
geometry), both against brute-force enumeration of every ordered group where that is small, and
against Monte Carlo. Monte Carlo tolerances are 5 standard errors of a sample mean, seeds fixed.
"""

import itertools
import math

import numpy as np
import pytest
import torch

from grpo_companion.core.exact import beta_quadrature, estimator_moments
from grpo_companion.chapters.group_size import (
    best_group_size,
    budget_moments,
    group_gradient,
    kernel_variances,
    reward_geometry,
    rloo_best_group_size,
    sample_batch_errors,
    sample_group_gradients,
    sequence_policy_moments,
    u_statistic,
    u_statistic_variance,
)
from grpo_companion.core.policy_gradient import SequencePolicy, estimator_variance, sum_mod_reward


@pytest.fixture(scope="module")
def setup():
    policy = SequencePolicy(vocab_size=3, length=3)
    logits = policy.init_logits(seed=2, scale=1.5)
    rewards = sum_mod_reward(policy.all_sequences(), policy.vocab_size)
    return policy, logits, rewards


def test_u_statistic_is_rloo_and_group_mean_is_shrunk_u():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 7, 11, generator=generator, dtype=torch.float64)
    rewards = torch.randn(5, 7, generator=generator, dtype=torch.float64)  # any rewards
    u = u_statistic(scores, rewards)
    tight = {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(group_gradient(scores, rewards, "rloo"), u, **tight)
    torch.testing.assert_close(group_gradient(scores, rewards, "dr_grpo"), (1 - 1 / 7) * u, **tight)


def test_kernel_first_projection_is_the_oracle(setup):
    policy, logits, rewards = setup
    kernel = kernel_variances(policy, logits, rewards)
    oracle_variance = float(estimator_variance(policy, logits, rewards, kernel["value"]))
    assert 4 * kernel["zeta_1"] == pytest.approx(oracle_variance, rel=1e-10)
    gradient = policy.exact_gradient(logits, rewards)
    assert kernel["gradient_sq_norm"] == pytest.approx(float(gradient.square().sum()))


@pytest.mark.parametrize("group_size", [2, 3, 5, 16, 64])
def test_two_exact_routes_agree(setup, group_size):
    policy, logits, rewards = setup
    kernel = kernel_variances(policy, logits, rewards)
    variance_u = u_statistic_variance(kernel["zeta_1"], kernel["zeta_2"], group_size)
    rloo = sequence_policy_moments(policy, logits, rewards, group_size, "rloo")
    assert rloo["weight"] == pytest.approx(1.0, rel=1e-10)
    assert rloo["variance"] == pytest.approx(variance_u, rel=1e-9)
    mean_self = sequence_policy_moments(policy, logits, rewards, group_size, "dr_grpo")
    expected = (1 - 1 / group_size) ** 2 * variance_u + kernel["gradient_sq_norm"] / group_size**2
    assert mean_self["mse"] == pytest.approx(expected, rel=1e-9)
    # The group-free estimators are chapter 1's V(b) / G.
    for method, baseline in (("no_baseline", 0.0), ("oracle", kernel["value"])):
        moments = sequence_policy_moments(policy, logits, rewards, group_size, method)
        single = float(estimator_variance(policy, logits, rewards, baseline))
        assert moments["mse"] == pytest.approx(single / group_size, rel=1e-9)


def brute_force_moments(policy, logits, rewards, group_size, method, **options):
    """Mean and trace variance of g over every ordered group of `group_size` sequences."""
    probs = policy.probs(logits).detach()
    scores = policy.scores(logits, policy.all_sequences())
    groups = torch.tensor(list(itertools.product(range(policy.num_sequences), repeat=group_size)))
    weights = probs[groups].prod(dim=1)
    estimates = group_gradient(scores[groups], rewards[groups], method, **options)
    mean = weights @ estimates
    return mean, float(weights @ (estimates - mean).square().sum(dim=1))


@pytest.mark.parametrize(
    "method, options",
    [
        ("grpo", {}),
        ("grpo", {"unbiased_std": False}),
        ("sign", {}),
        ("softmax", {"temperature": 0.5}),
    ],
)
@pytest.mark.parametrize("group_size", [2, 3])
def test_moments_match_enumeration_of_every_group(method, options, group_size):
    policy = SequencePolicy(vocab_size=3, length=2)
    logits = policy.init_logits(seed=5, scale=1.0)
    rewards = sum_mod_reward(policy.all_sequences(), policy.vocab_size)
    mean, variance = brute_force_moments(policy, logits, rewards, group_size, method, **options)
    exact = sequence_policy_moments(policy, logits, rewards, group_size, method, **options)
    gradient = policy.exact_gradient(logits, rewards)
    torch.testing.assert_close(mean, exact["weight"] * gradient, rtol=1e-10, atol=1e-12)
    assert exact["variance"] == pytest.approx(variance, rel=1e-9)


def test_reward_geometry_reduces_the_bernoulli_policy_to_itself():
    # One token, two actions, reward on action 1: the Bernoulli-logit model up to the softmax's
    # two logits, u = (-1, 1) / 2 * ... : kappa = 2 ||grad p||^2 / (p(1-p))^2 / 2, no noise.
    policy = SequencePolicy(vocab_size=2, length=1)
    logits = policy.init_logits(seed=0)
    rewards = torch.tensor([0.0, 1.0], dtype=torch.float64)
    geometry = reward_geometry(policy, logits, rewards)
    assert geometry["kappa"] == pytest.approx(2.0, rel=1e-12)  # d p / d(z_1, z_0) = p(1-p) (1, -1)
    assert geometry["noise_correct"] == pytest.approx(0.0, abs=1e-12)
    assert geometry["noise_incorrect"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("method", ["no_baseline", "oracle", "dr_grpo", "grpo"])
def test_sampled_groups_match_exact_moments(setup, method):
    policy, logits, rewards = setup
    generator = torch.Generator().manual_seed(3)
    num_groups, group_size = 40_000, 6
    estimates = sample_group_gradients(
        policy, logits, rewards, group_size, num_groups, generator, method
    )
    exact = sequence_policy_moments(policy, logits, rewards, group_size, method)
    errors = (estimates - policy.exact_gradient(logits, rewards)).square().sum(dim=1)
    standard_error = errors.std().item() / math.sqrt(num_groups)
    assert abs(errors.mean().item() - exact["mse"]) < 5 * standard_error


BETA = beta_quadrature(1.0, 2.0)


@pytest.mark.parametrize("score_noise", [0.0, 4.0])
def test_rloo_budget_curve_is_budget_free(score_noise):
    pass_rates, weights = BETA
    best, _ = best_group_size(
        pass_rates,
        weights,
        [256, 4096, 65536],
        list(range(2, 100)),
        "rloo",
        score_noise=score_noise,
    )
    assert len(set(best.tolist())) == 1
    # ... and sits next to the closed-form optimum of N MSE = c_0 + c_1 / (G - 1) + G Var_x t.
    closed_form = rloo_best_group_size(pass_rates, weights, score_noise=score_noise)
    assert best[0] in (math.floor(closed_form), math.ceil(closed_form))


def test_rloo_budget_curve_closed_form():
    pass_rates, weights = BETA
    four_zeta_1 = weights @ estimator_moments(pass_rates, 1, "oracle")["variance"]
    zeta_2 = weights @ estimator_moments(pass_rates, 2, "rloo")["variance"]
    true_gradients = pass_rates * (1 - pass_rates)
    between = weights @ (true_gradients - weights @ true_gradients) ** 2
    for group_size in (2, 3, 7, 40):
        G = group_size
        expected = four_zeta_1 + (2 * zeta_2 - four_zeta_1) / (G - 1) + G * between
        mse = budget_moments(pass_rates, weights, G, 1000, "rloo")["mse"]
        assert 1000 * mse == pytest.approx(expected, rel=1e-9)


def test_group_mean_bias_does_not_shrink_with_the_budget():
    pass_rates, weights = BETA
    true_gradient = weights @ (pass_rates * (1 - pass_rates))
    for group_size in (2, 8):
        moments = budget_moments(pass_rates, weights, group_size, 10**6, "dr_grpo")
        assert moments["bias_sq"] == pytest.approx((true_gradient / group_size) ** 2, rel=1e-10)
    budgets, group_sizes = [64, 1024, 16384], list(range(2, 150))
    best, _ = best_group_size(pass_rates, weights, budgets, group_sizes, "dr_grpo")
    assert best[0] < best[1] < best[2] < 149


@pytest.mark.parametrize("method", ["no_baseline", "oracle"])
def test_group_free_estimators_want_groups_of_one(method):
    pass_rates, weights = BETA
    best, mse = best_group_size(
        pass_rates, weights, [256, 4096], [1, 2, 4, 8], method, score_noise=1.0
    )
    assert (best == 1).all() and (np.diff(mse, axis=1) > 0).all()


@pytest.mark.parametrize(
    "method, group_size",
    [
        ("no_baseline", 4),
        ("oracle", 2),
        ("dr_grpo", 8),
        ("rloo", 2),
        ("grpo", 16),
    ],
)
def test_sampled_batches_match_budget_moments(method, group_size):
    a, b = 1.0, 2.0
    pass_rates, weights = beta_quadrature(a, b)
    true_gradient = float(weights @ (pass_rates * (1 - pass_rates)))
    rng = np.random.default_rng(4)
    errors = sample_batch_errors(
        lambda rng, size: rng.beta(a, b, size),
        group_size,
        64,
        20_000,
        rng,
        method,
        score_noise=2.0,
        true_gradient=true_gradient,
    )
    exact = budget_moments(pass_rates, weights, group_size, 64, method, score_noise=2.0)["mse"]
    assert abs(errors.mean() - exact) < 5 * errors.std() / math.sqrt(len(errors))


def test_errors(setup):
    policy, logits, rewards = setup
    with pytest.raises(ValueError, match="value"):
        group_gradient(torch.zeros(1, 2, 3), torch.zeros(1, 2), "oracle")
    with pytest.raises(ValueError, match="binary"):
        reward_geometry(policy, logits, rewards * 0.5)
    with pytest.raises(ValueError, match="pass rate"):
        reward_geometry(policy, logits, torch.zeros_like(rewards))
