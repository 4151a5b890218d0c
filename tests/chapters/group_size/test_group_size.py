"""Chapter 10: the U-statistic form, exact moments on the sequence policy, the budget trade-off.

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
from conftest import sum_mod_setup

from grpo_companion.chapters.group_size.budget import (
    BUDGET_ESTIMATORS,
    best_group_size,
    best_group_sizes,
    beta_with_mean,
    budget_moments,
    budget_monte_carlo,
    budget_mse_curves,
    budget_optima,
    rloo_best_group_size,
    rloo_best_group_size_table,
    sample_batch_errors,
    smallest_group_size,
)
from grpo_companion.chapters.group_size.ustatistic import (
    ESTIMATORS,
    closed_form_mse,
    exact_mse,
    kernel_table,
    kernel_variances,
    max_relative_gap,
    oracle_property_summary,
    sampled_mse,
    sequence_policy_moments,
    u_statistic,
    u_statistic_identity_error,
    u_statistic_variance,
    z_scores,
)
from grpo_companion.core.exact import beta_quadrature, estimator_moments
from grpo_companion.core.group_estimators import (
    estimator_advantages,
    group_gradient,
    sample_group_estimates,
)
from grpo_companion.core.policy_gradient import SequencePolicy, estimator_variance, sum_mod_reward


@pytest.fixture(scope="module")
def setup():
    return sum_mod_setup(vocab_size=3, length=3, seed=2)


def test_u_statistic_is_rloo_and_group_mean_is_shrunk_u():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 7, 11, generator=generator, dtype=torch.float64)
    rewards = torch.randn(5, 7, generator=generator, dtype=torch.float64)  # any rewards
    u = u_statistic(scores, rewards)
    tight = {"rtol": 1e-12, "atol": 1e-12}
    rloo = group_gradient(scores, estimator_advantages(rewards, "rloo"))
    mean_self = group_gradient(scores, estimator_advantages(rewards, "dr_grpo"))
    torch.testing.assert_close(rloo, u, **tight)
    torch.testing.assert_close(mean_self, (1 - 1 / 7) * u, **tight)


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
    # The group-free estimators are chapter 1's Var[g_b] / G.
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
    advantages = estimator_advantages(rewards[groups], method, **options)
    estimates = group_gradient(scores[groups], advantages)
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


@pytest.mark.parametrize("method", ["no_baseline", "oracle", "dr_grpo", "grpo"])
def test_sampled_groups_match_exact_moments(setup, method):
    policy, logits, rewards = setup
    generator = torch.Generator().manual_seed(3)
    num_groups, group_size = 40_000, 6
    estimates = sample_group_estimates(
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


def test_errors():
    with pytest.raises(ValueError, match="value"):
        estimator_advantages(torch.zeros(1, 2), "oracle")


# -- the chapter's aggregates: each against the function it aggregates, or numbers by hand -----


def test_u_statistic_identity_error_is_rounding_and_draws_in_order(setup):
    policy, logits, rewards = setup
    generator = torch.Generator().manual_seed(7)
    error = u_statistic_identity_error(policy, logits, rewards, [2, 3, 5], 50, generator)
    assert 0 <= error < 1e-14
    replay = torch.Generator().manual_seed(7)
    for G in (2, 3, 5):
        policy.sample(logits, 50 * G, replay)
    assert torch.equal(generator.get_state(), replay.get_state())


def test_closed_form_mse_matches_the_exact_curves(setup):
    policy, logits, rewards = setup
    kernel = kernel_variances(policy, logits, rewards)
    no_baseline = float(estimator_variance(policy, logits, rewards, 0.0))
    sizes = [2, 3, 8, 32]
    formulas = closed_form_mse(kernel, no_baseline, sizes)
    exact = exact_mse(policy, logits, rewards, sizes)
    assert set(formulas) == set(ESTIMATORS) - {"GRPO (std)"}
    assert max_relative_gap(exact, formulas) < 1e-9
    assert (
        exact["GRPO (std)"][1] == sequence_policy_moments(policy, logits, rewards, 3, "grpo")["mse"]
    )


def test_max_relative_gap_and_z_scores_by_hand():
    curves = {"a": np.array([1.0, 2.2]), "b": np.array([3.0])}
    assert max_relative_gap(curves, {"a": np.array([1.0, 2.0])}) == pytest.approx(0.1)
    sampled = {"a": (np.array([1.0, 3.0]), np.array([0.5, 1.0])), "b": (np.array([4.0]), [2.0])}
    z = z_scores(sampled, {"a": np.array([2.0, 2.0]), "b": np.array([3.0])})
    np.testing.assert_allclose(z, [-2.0, 1.0, 0.5])


def test_sampled_mse_replays_the_sampler(setup):
    policy, logits, rewards = setup
    methods = {"RLOO = U": "rloo", "oracle, b = J": "oracle"}
    sampled = sampled_mse(
        policy, logits, rewards, [2, 4], 300, torch.Generator().manual_seed(1), methods
    )
    generator = torch.Generator().manual_seed(1)
    gradient = policy.exact_gradient(logits, rewards)
    for label, method in methods.items():
        for index, G in enumerate([2, 4]):
            estimates = sample_group_estimates(policy, logits, rewards, G, 300, generator, method)
            errors = (estimates - gradient).square().sum(dim=1)
            assert sampled[label][0][index] == float(errors.mean())
            assert sampled[label][1][index] == pytest.approx(float(errors.std()) / math.sqrt(300))


def test_oracle_property_summary_by_hand():
    exact = {
        "RLOO = U": np.array([3.0, 1.1]),
        "oracle, b = J": np.array([2.0, 1.0]),
        "group mean": np.array([1.0, 0.9]),
    }
    summary = oracle_property_summary(exact, [2, 64])
    assert summary == pytest.approx(
        {
            "rloo_excess_smallest": 0.5,
            "rloo_excess_largest": 0.1,
            "rloo_excess_times_g_largest": 6.4,
            "group_mean_over_oracle_smallest": 0.5,
        }
    )


def test_budget_curves_optima_and_search():
    pass_rates, weights = BETA
    assert smallest_group_size("oracle") == 1 and smallest_group_size("rloo") == 2
    assert "GRPO (std)" not in BUDGET_ESTIMATORS and "RLOO = U" in BUDGET_ESTIMATORS
    curves = budget_mse_curves(pass_rates, weights, [1, 2, 8], 256, BUDGET_ESTIMATORS)
    assert np.isnan(curves["RLOO = U"][0]) and not np.isnan(curves["oracle, b = J"][0])
    assert curves["RLOO = U"][2] == budget_moments(pass_rates, weights, 8, 256, "rloo")["mse"]
    best = best_group_sizes(pass_rates, weights, [64, 256], 40, BUDGET_ESTIMATORS)
    direct, _ = best_group_size(pass_rates, weights, [64, 256], list(range(2, 41)), "dr_grpo")
    assert [best["group mean"][N] for N in (64, 256)] == direct.tolist()
    assert best["no baseline"] == {64: 1, 256: 1}
    optima = budget_optima(pass_rates, weights, best, 256, {"group mean": "dr_grpo"})
    G = best["group mean"][256]
    assert optima == {"group mean": (G, budget_moments(pass_rates, weights, G, 256)["mse"])}


def test_budget_monte_carlo_replays_sample_batch_errors():
    pass_rates, weights = beta_quadrature(1.0, 2.0)
    methods = {"RLOO = U": "rloo", "group mean": "dr_grpo"}
    checks, z = budget_monte_carlo(
        pass_rates, weights, (1.0, 2.0), [2, 8], 64, 4000, np.random.default_rng(3), methods,
        score_noise=1.0,
    )  # fmt: skip
    rng = np.random.default_rng(3)
    true_gradient = float(weights @ (pass_rates * (1 - pass_rates)))
    for label, method in methods.items():
        for errors, G in zip(checks[label], [2, 8], strict=True):
            replay = sample_batch_errors(
                lambda r, size: r.beta(1.0, 2.0, size), G, 64, 4000, rng, method,
                score_noise=1.0, true_gradient=true_gradient,
            )  # fmt: skip
            np.testing.assert_array_equal(errors, replay)
    assert len(z) == 4 and max(abs(value) for value in z) < 5


def test_beta_with_mean_and_the_best_group_size_table():
    nodes, weights = beta_with_mean(0.3, 4.0)
    assert weights @ nodes == pytest.approx(0.3, rel=1e-12)
    # Var of Beta(1.2, 2.8) = m (1 - m) / (a + b + 1)
    assert weights @ (nodes - 0.3) ** 2 == pytest.approx(0.21 / 5, rel=1e-12)
    table = rloo_best_group_size_table([0.3, 0.5], [1.0, 4.0], score_noise=2.0)
    assert table.shape == (2, 2)
    assert table[1, 0] == rloo_best_group_size(nodes, weights, score_noise=2.0)


def test_kernel_table_puts_the_oracle_next_to_four_zeta_1(setup):
    policy, logits, rewards = setup
    kernel = kernel_variances(policy, logits, rewards)
    oracle = float(estimator_variance(policy, logits, rewards, kernel["value"]))
    column = kernel_table(kernel, oracle, 1.0)["value"]
    assert column["4 zeta_1"] == pytest.approx(column["Var[g_J], chapter 1"], rel=1e-10)
    assert column["Var[g_0], chapter 1"] == 1.0


@pytest.mark.parametrize("score_noise", [0.0, 4.0, 100.0])
def test_section_3s_pair_noise_per_prompt_is_t_times_t_plus_v_plus_t_squared(score_noise):
    """2 zeta_2 - 4 zeta_1 of one shared-skill prompt, from the exact moments (zeta_2 is RLOO's
    variance at G = 2, 4 zeta_1 the oracle's one-sample variance), against section 3's
    t (t + v) + t^2: chapter 8's Var(r) E||s||^2 + ||grad J||^2 with Var r = t, E||s||^2 = t + v."""
    p = np.linspace(0.02, 0.98, 49)
    t = p * (1 - p)
    zeta_2 = estimator_moments(p, 2, "rloo", score_noise=score_noise)["variance"]
    four_zeta_1 = estimator_moments(p, 1, "oracle", score_noise=score_noise)["variance"]
    np.testing.assert_allclose(2 * zeta_2 - four_zeta_1, t * (t + score_noise) + t**2, rtol=1e-10)


@pytest.mark.parametrize("score_noise", [0.0, 1.0, 4.0, 100.0])
@pytest.mark.parametrize("a, b", [(1.0, 1.0), (2.0, 5.0), (8.0, 8.0), (0.5, 0.7)])
def test_the_closed_form_g_star_is_the_exact_moments_g_star(a, b, score_noise):
    from grpo_companion.chapters.group_size.budget import bernoulli_g_star

    nodes, weights = beta_quadrature(a, b)
    closed = bernoulli_g_star(nodes, weights, score_noise=score_noise)
    assert closed == pytest.approx(
        rloo_best_group_size(nodes, weights, score_noise=score_noise), rel=1e-10
    )
    if (a, b) == (1.0, 1.0):  # uniform pass rates: 1 + sqrt(12 + 30 v) (problem 2)
        assert closed == pytest.approx(1 + math.sqrt(12 + 30 * score_noise), rel=1e-10)


def test_g_star_grows_like_the_square_root_of_the_score_noise():
    from grpo_companion.chapters.group_size.budget import bernoulli_g_star

    nodes, weights = beta_quadrature(1.0, 1.0)
    g_star = [bernoulli_g_star(nodes, weights, score_noise=v) for v in (0.0, 1.0, 4.0, 16.0)]
    assert all(np.diff(g_star) > 0)
    large = [bernoulli_g_star(nodes, weights, score_noise=v) - 1 for v in (1e4, 4e4)]
    assert large[1] / large[0] == pytest.approx(2.0, rel=1e-3)  # four times v, twice G* - 1


def test_problem_1_a_group_of_three_is_two_thirds_of_its_u_statistic():
    scores = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    rewards = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    advantages = estimator_advantages(rewards[None], "dr_grpo")[0]
    g = group_gradient(scores, advantages)
    by_hand = (2 * scores[0] - scores[1] - scores[2]) / 9
    torch.testing.assert_close(g, by_hand, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(u_statistic(scores, rewards), 1.5 * by_hand, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("budget", [1e6, 1e7])
def test_problem_3_the_group_means_best_g_grows_like_the_cube_root_of_the_budget(budget):
    nodes, weights = beta_quadrature(1.0, 1.0)
    best, _ = best_group_size(nodes, weights, [budget], list(range(2, 700)), "dr_grpo",
                              score_noise=4.0)  # fmt: skip
    assert abs(best[0] - (10 * budget) ** (1 / 3)) <= 1
