import numpy as np
import pytest
import torch
from scipy.special import betaln

from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.exact import (
    average_over_pass_rates,
    best_step_error,
    beta_quadrature,
    binary_group_advantages,
    degenerate_contributions,
    degenerate_rate,
    degenerate_rate_slope,
    estimator_moments,
    grad_pass_at_g,
    pass_at_g,
    reward_geometry,
)
from grpo_companion.core.policy_gradient import SequencePolicy, sum_mod_reward

GRID = np.linspace(0.01, 0.99, 99)

# (method, options, filter_degenerate)
ESTIMATORS = [
    ("grpo", {}, False),
    ("dr_grpo", {}, False),
    ("rloo", {}, False),
    ("sign", {}, False),
    ("softmax", {"temperature": 0.5}, False),
    ("softmax", {"temperature": 2.0}, False),
    ("grpo", {}, True),
    ("grpo_passk", {}, False),
    ("grpo_passk", {"scale_rewards": "none"}, False),
]


def monte_carlo_estimates(
    pass_rate, group_size, method, num_groups, seed, filter_degenerate, **options
):
    """g = (1/G) sum_i A_i s_i on independently sampled reward tensors, one value per group."""
    rng = np.random.default_rng(seed)
    rewards = (rng.random((num_groups, group_size)) < pass_rate).astype(np.float64)
    if filter_degenerate:
        successes = rewards.sum(axis=1)
        rewards = rewards[(successes > 0) & (successes < group_size)]
    advantages = group_advantages(torch.from_numpy(rewards), method, **options).numpy()
    scores = np.where(rewards == 1, 1 - pass_rate, -pass_rate)
    return (advantages * scores).mean(axis=1)


@pytest.mark.parametrize("method, options, filter_degenerate", ESTIMATORS)
@pytest.mark.parametrize("pass_rate, group_size", [(0.3, 4), (0.85, 8), (0.1, 16)])
def test_moments_match_monte_carlo(method, options, filter_degenerate, pass_rate, group_size):
    # Rewards are sampled per completion (not as k), so this also checks that every method
    # gives all correct (incorrect) completions of a group the same advantage.
    estimates = monte_carlo_estimates(
        pass_rate, group_size, method, 40_000, 0, filter_degenerate, **options
    )
    exact = estimator_moments(
        pass_rate, group_size, method, filter_degenerate=filter_degenerate, **options
    )
    n = len(estimates)
    # 5-sigma tolerances: the standard error of the sample mean is sqrt(Var / n); that of
    # the sample variance is sqrt((mu_4 - Var^2) / n), mu_4 the (sampled) 4th central moment.
    mean_tol = 5 * np.sqrt(exact["variance"][0] / n)
    assert abs(estimates.mean() - exact["mean"][0]) < mean_tol
    fourth_moment = np.mean((estimates - estimates.mean()) ** 4)
    variance_tol = 5 * np.sqrt((fourth_moment - estimates.var() ** 2) / n)
    assert abs(estimates.var() - exact["variance"][0]) < variance_tol


@pytest.mark.parametrize("group_size", [2, 3, 8, 64])
def test_rloo_is_unbiased(group_size):
    moments = estimator_moments(GRID, group_size, "rloo")
    np.testing.assert_allclose(moments["weight"], 1.0, rtol=1e-10)
    np.testing.assert_allclose(moments["bias"], 0.0, atol=1e-12)


@pytest.mark.parametrize("group_size", [2, 3, 8, 64])
def test_dr_grpo_weight_is_one_minus_one_over_g(group_size):
    weight = estimator_moments(GRID, group_size, "dr_grpo")["weight"]
    np.testing.assert_allclose(weight, 1 - 1 / group_size, rtol=1e-10)


@pytest.mark.parametrize("group_size", [2, 8, 64])
def test_degenerate_rate(group_size):
    p = np.concatenate([[0.0, 1e-6], GRID, [1.0]])
    rate = estimator_moments(p, group_size, "grpo")["degenerate_rate"]
    np.testing.assert_allclose(rate, p**group_size + (1 - p) ** group_size, rtol=1e-12)


def test_filtering_grpo_only_renormalises():
    # GRPO already gives degenerate groups zero advantage, so g(0) = g(G) = 0.
    plain = estimator_moments(GRID, 8, "grpo")
    kept = estimator_moments(GRID, 8, "grpo", filter_degenerate=True)
    np.testing.assert_allclose(
        kept["mean"] * (1 - plain["degenerate_rate"]), plain["mean"], rtol=1e-10
    )


def test_endpoints():
    plain = estimator_moments([0.0, 1.0], 8, "sign")
    np.testing.assert_array_equal(plain["mean"], [0.0, 0.0])
    np.testing.assert_array_equal(plain["variance"], [0.0, 0.0])
    np.testing.assert_array_equal(plain["degenerate_rate"], [1.0, 1.0])
    assert np.isnan(plain["weight"]).all()
    kept = estimator_moments([0.0, 1.0], 8, "sign", filter_degenerate=True)
    assert np.isnan(kept["mean"]).all() and np.isnan(kept["variance"]).all()


def test_binary_group_advantages():
    a_correct, a_incorrect = binary_group_advantages(2, "grpo")
    assert np.isnan(a_correct[0]) and np.isnan(a_incorrect[2])
    # k = 1 of 2: rewards (1, 0), Bessel std sqrt(1/2), centred rewards +-1/2.
    np.testing.assert_allclose(
        [a_correct[1], a_incorrect[1]], np.array([0.5, -0.5]) / (np.sqrt(0.5) + 1e-4), rtol=1e-12
    )
    np.testing.assert_array_equal([a_correct[2], a_incorrect[0]], [0.0, 0.0])


# a + b = 1 is where scipy's roots_jacobi divides by zero in a discarded branch.
@pytest.mark.parametrize("a, b", [(0.5, 0.5), (2.0, 5.0), (30.0, 10.0), (0.3, 0.7)])
@pytest.mark.parametrize("group_size", [1, 8, 64])
def test_beta_quadrature_moments(a, b, group_size):
    pass_rates, weights = beta_quadrature(a, b)
    expected = np.exp(betaln(a + group_size, b) - betaln(a, b))
    np.testing.assert_allclose(weights @ pass_rates**group_size, expected, rtol=1e-8)


def test_beta_average_of_moments():
    a, b, group_size = 0.7, 3.0, 16
    averaged = average_over_pass_rates(*beta_quadrature(a, b), group_size, "rloo")
    expected = np.exp(betaln(a + group_size, b) - betaln(a, b)) + np.exp(
        betaln(a, b + group_size) - betaln(a, b)
    )
    np.testing.assert_allclose(averaged["degenerate_rate"], expected, rtol=1e-8)
    np.testing.assert_allclose(averaged["weight"], 1.0, rtol=1e-10)


def test_discrete_average():
    averaged = average_over_pass_rates([0.2, 0.7], [1.0, 3.0], 4, "grpo", filter_degenerate=True)
    moments = estimator_moments([0.2, 0.7], 4, "grpo", filter_degenerate=True)
    for key, values in moments.items():
        np.testing.assert_allclose(averaged[key], (values[0] + 3 * values[1]) / 4, rtol=1e-12)


def test_grad_pass_at_g_is_derivative_in_log_odds():
    theta, h, group_size = np.linspace(-4, 4, 17), 1e-4, 8
    sigmoid = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    finite_difference = (
        pass_at_g(sigmoid(theta + h), group_size) - pass_at_g(sigmoid(theta - h), group_size)
    ) / (2 * h)
    np.testing.assert_allclose(
        grad_pass_at_g(sigmoid(theta), group_size), finite_difference, rtol=1e-6, atol=1e-11
    )


@pytest.mark.parametrize("group_size", [2, 4, 16, 64])
def test_sign_and_pass_at_g(group_size):
    p, G = GRID, group_size
    plain = estimator_moments(p, G, "sign")
    # Sign is twice the pass@1 gradient at every p, not the pass@G gradient.
    np.testing.assert_allclose(plain["mean"], 2 * p * (1 - p), rtol=1e-12)
    # The all-wrong groups alone carry exactly grad pass@G / G: g(0) = -a_i(0) p, P(k=0) = (1-p)^G.
    a_incorrect = binary_group_advantages(G, "sign")[1]
    np.testing.assert_allclose(
        (1 - p) ** G * -a_incorrect[0] * p, grad_pass_at_g(p, G) / G, rtol=1e-12
    )
    # Hence dropping degenerate groups subtracts (grad pass@G + grad p^G) / G.
    kept = estimator_moments(p, G, "sign", filter_degenerate=True)
    grad_all_correct = G * p**G * (1 - p)
    np.testing.assert_allclose(
        kept["mean"] * (1 - kept["degenerate_rate"]),
        2 * p * (1 - p) - (grad_pass_at_g(p, G) + grad_all_correct) / G,
        rtol=1e-10,
        atol=1e-15,
    )


@pytest.mark.parametrize("group_size", [1, 2, 8])
@pytest.mark.parametrize("score_noise", [0.0, 3.0])
def test_group_free_baselines_closed_forms(group_size, score_noise):
    # g = (1/G) sum_i (r_i - b) s_i over i.i.d. completions, s = (r - p, noise).
    p, G = GRID, group_size
    plain = estimator_moments(p, G, "no_baseline", score_noise=score_noise)
    oracle = estimator_moments(p, G, "oracle", score_noise=score_noise)
    for moments in (plain, oracle):
        np.testing.assert_allclose(moments["weight"], 1.0, rtol=1e-12)
    # r s = r (1 - p); (r - p) s = (r - p)^2; the noise adds E[A^2] score_noise.
    np.testing.assert_allclose(
        plain["variance"], ((1 - p) ** 2 * p * (1 - p) + score_noise * p) / G, rtol=1e-10
    )
    np.testing.assert_allclose(
        oracle["variance"],
        (p * (1 - p) * (1 - 2 * p) ** 2 + score_noise * p * (1 - p)) / G,
        rtol=1e-10,
        atol=1e-15,
    )


def monte_carlo_with_noise(pass_rate, group_size, method, num_groups, seed, score_noise):
    """(num_groups, 2): g with scores (r - p, eps), eps ~ N(0, v_r) depending on the reward."""
    rng = np.random.default_rng(seed)
    rewards = (rng.random((num_groups, group_size)) < pass_rate).astype(np.float64)
    advantages = group_advantages(torch.from_numpy(rewards), method).numpy()
    noise = rng.normal(size=rewards.shape) * np.sqrt(np.where(rewards == 1, *score_noise))
    return np.stack(
        [(advantages * (rewards - pass_rate)).mean(axis=1), (advantages * noise).mean(axis=1)],
        axis=1,
    )


@pytest.mark.parametrize("method", ["grpo", "rloo", "sign"])
def test_score_noise_matches_monte_carlo(method):
    pass_rate, group_size, score_noise, n = 0.3, 6, (2.0, 0.5), 100_000
    estimates = monte_carlo_with_noise(pass_rate, group_size, method, n, 1, score_noise)
    exact = estimator_moments(pass_rate, group_size, method, score_noise=score_noise)
    # The trace of the covariance: the noise coordinate has mean zero.
    squared = ((estimates - [exact["mean"][0], 0.0]) ** 2).sum(axis=1)
    assert abs(squared.mean() - exact["variance"][0]) < 5 * squared.std() / np.sqrt(n)


def test_score_noise_adds_to_variance_only():
    plain = estimator_moments(GRID, 8, "grpo")
    noisy = estimator_moments(GRID, 8, "grpo", score_noise=(1.0, 2.0))
    for key in ("mean", "bias", "weight"):
        np.testing.assert_array_equal(plain[key], noisy[key])
    assert np.all(noisy["variance"] > plain["variance"])


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "softmax"])
def test_filtering_per_drawn_group_is_a_no_op_for_zero_sum_methods(method):
    # Degenerate groups already get zero advantage: dropping them changes nothing per draw.
    plain = estimator_moments(GRID, 8, method, score_noise=1.0)
    drawn = estimator_moments(
        GRID, 8, method, filter_degenerate=True, per_drawn_group=True, score_noise=1.0
    )
    for key in ("mean", "variance", "mse"):
        np.testing.assert_allclose(drawn[key], plain[key], rtol=1e-10, atol=1e-15)


def test_per_drawn_group_scales_the_kept_mean():
    kept = estimator_moments(GRID, 4, "sign", filter_degenerate=True)
    drawn = estimator_moments(GRID, 4, "sign", filter_degenerate=True, per_drawn_group=True)
    keep = 1 - kept["degenerate_rate"]
    np.testing.assert_allclose(drawn["mean"], keep * kept["mean"], rtol=1e-12)
    np.testing.assert_allclose(
        drawn["variance"] + drawn["mean"] ** 2,
        keep * (kept["variance"] + kept["mean"] ** 2),
        rtol=1e-12,
    )


@pytest.mark.parametrize("group_size", [2, 5, 16])
def test_degenerate_contributions(group_size):
    p, G = GRID, group_size
    parts = degenerate_contributions(p, G, "sign")
    np.testing.assert_allclose(parts["all_incorrect"], grad_pass_at_g(p, G) / G, rtol=1e-12)
    np.testing.assert_allclose(parts["all_correct"], p**G * (1 - p), rtol=1e-12)
    total = parts["all_incorrect"] + parts["all_correct"] + parts["mixed"]
    np.testing.assert_allclose(total, estimator_moments(p, G, "sign")["mean"], rtol=1e-12)
    # GRPO's degenerate groups carry nothing.
    grpo = degenerate_contributions(p, G, "grpo")
    np.testing.assert_array_equal(grpo["all_incorrect"], 0.0)
    np.testing.assert_array_equal(grpo["all_correct"], 0.0)


def test_best_step_error():
    pass_rates, weights = beta_quadrature(2.0, 3.0, 64)
    for method in ("rloo", "dr_grpo", "sign"):  # w(p) constant: E[g] points along the gradient
        alignment = best_step_error(pass_rates, weights, 8, method)["alignment"]
        assert alignment == pytest.approx(1, abs=1e-12)
    result = best_step_error(pass_rates, weights, 8, "grpo", score_noise=2.0)
    assert result["alignment"] < 1 - 1e-4  # std scaling reweights prompts
    # Direct minimisation over the step size of the prompt-averaged squared error.
    moments = estimator_moments(pass_rates, 8, "grpo", score_noise=2.0)
    target = pass_rates * (1 - pass_rates)
    steps = np.linspace(0, 2 * result["best_step"], 20_001)
    errors = [
        weights
        @ (
            c**2 * (moments["mean"] ** 2 + moments["variance"])
            - 2 * c * moments["mean"] * target
            + target**2
        )
        for c in steps
    ]
    assert steps[np.argmin(errors)] == pytest.approx(result["best_step"], rel=1e-3)
    assert min(errors) / (weights @ target**2) == pytest.approx(result["relative_error"], rel=1e-6)
    # A rescaled method is as good as the original: RLOO = G/(G-1) * Dr. GRPO.
    assert best_step_error(pass_rates, weights, 8, "rloo")["relative_error"] == pytest.approx(
        best_step_error(pass_rates, weights, 8, "dr_grpo")["relative_error"], rel=1e-12
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: estimator_moments([0.5, 1.2], 4), r"\[0, 1\]"),
        (lambda: estimator_moments(-0.1, 4), r"\[0, 1\]"),
        (lambda: estimator_moments(np.nan, 4), r"\[0, 1\]"),
        (lambda: estimator_moments(np.full((2, 2), 0.5), 4), "1-D"),
        (lambda: estimator_moments(0.5, 1), "group_size"),
        (lambda: estimator_moments(0.5, 2.5), "group_size"),
        (lambda: estimator_moments(0.5, 4, "ppo"), "grpo.*dr_grpo.*rloo.*sign.*softmax"),
        (lambda: estimator_moments(0.5, 4, scale_rewards="batch"), "per-group"),
        (lambda: beta_quadrature(0.0, 1.0), "> 0"),
        (lambda: beta_quadrature(1.0, -2.0), "> 0"),
        (lambda: average_over_pass_rates([0.2, 0.5], [1.0, -1.0], 4), "non-negative"),
        (lambda: average_over_pass_rates([0.2, 0.5], [1.0], 4), "shape"),
        (lambda: pass_at_g(1.5, 4), r"\[0, 1\]"),
        (lambda: grad_pass_at_g(0.5, 0), "group_size"),
        (lambda: estimator_moments(0.5, 0, "oracle"), "group_size"),
        (lambda: estimator_moments(0.5, 4, score_noise=-1.0), "score_noise"),
        (lambda: estimator_moments(0.5, 4, per_drawn_group=True), "filter_degenerate"),
        (lambda: best_step_error([0.2, 0.5], [1.0], 4), "shape"),
    ],
)
def test_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_reward_geometry_reduces_the_bernoulli_policy_to_itself():
    """One token, two actions, reward on action 1: p = sigmoid(z_1 - z_0), grad p = p (1 - p)
    (1, -1) over the two logits, so kappa = ||u||^2 = 2, and s is a function of r: no noise."""
    policy = SequencePolicy(vocab_size=2, length=1)
    logits = policy.init_logits(seed=0)
    rewards = torch.tensor([0.0, 1.0], dtype=torch.float64)
    geometry = reward_geometry(policy, logits, rewards)
    assert geometry["pass_rate"] == pytest.approx(float(policy.probs(logits)[1]), rel=1e-12)
    assert geometry["kappa"] == pytest.approx(2.0, rel=1e-12)
    assert geometry["noise_correct"] == pytest.approx(0.0, abs=1e-12)
    assert geometry["noise_incorrect"] == pytest.approx(0.0, abs=1e-12)


def test_reward_geometry_noise_is_the_within_class_score_covariance():
    """tr Cov(s | r) by brute force over the sequences of each reward class, over kappa."""
    policy = SequencePolicy(vocab_size=3, length=2)
    logits = policy.init_logits(seed=4, scale=1.5)
    rewards = sum_mod_reward(policy.all_sequences(), policy.vocab_size)
    probs, scores = policy.probs(logits).detach(), policy.scores(logits, policy.all_sequences())
    geometry = reward_geometry(policy, logits, rewards)
    p = float(probs @ rewards)
    gradient = policy.exact_gradient(logits, rewards)
    assert geometry["kappa"] == pytest.approx(float(gradient.square().sum()) / (p * (1 - p)) ** 2)
    for key, in_class in (("noise_correct", rewards == 1), ("noise_incorrect", rewards == 0)):
        weights = probs[in_class] / probs[in_class].sum()
        centred = scores[in_class] - weights @ scores[in_class]
        covariance_trace = float(weights @ centred.square().sum(dim=1))
        assert geometry[key] * geometry["kappa"] == pytest.approx(covariance_trace, rel=1e-10)


def test_reward_geometry_errors():
    policy = SequencePolicy(vocab_size=2, length=2)
    logits = policy.init_logits(seed=0)
    rewards = sum_mod_reward(policy.all_sequences(), 2)
    with pytest.raises(ValueError, match="binary"):
        reward_geometry(policy, logits, rewards * 0.5)
    with pytest.raises(ValueError, match="pass rate"):
        reward_geometry(policy, logits, torch.zeros_like(rewards))


# --- verl's estimators ------------------------------------------------------------


@pytest.mark.parametrize("group_size", [2, 4, 8, 16])
def test_passk_is_the_pass_at_g_gradient_over_g(group_size):
    moments = estimator_moments(GRID, group_size, "grpo_passk", scale_rewards="none")
    np.testing.assert_allclose(
        moments["mean"], grad_pass_at_g(GRID, group_size) / group_size, rtol=1e-12
    )
    np.testing.assert_allclose(moments["weight"], (1 - GRID) ** (group_size - 1), rtol=1e-10)


def test_batch_methods_need_the_batch_prior():
    with pytest.raises(ValueError, match="couples the groups"):
        binary_group_advantages(4, "gpg")
    with pytest.raises(ValueError, match="batch_pass_rates"):
        estimator_moments(GRID, 4, "reinforce_plus_plus_baseline")


@pytest.mark.parametrize("method", ["gpg", "reinforce_plus_plus_baseline"])
def test_batch_limit_scale_matches_a_large_sampled_batch(method):
    from grpo_companion.core.exact import batch_limit_scale

    nodes, weights = beta_quadrature(2.0, 3.0, 32)
    rng = np.random.default_rng(0)
    pass_rates = rng.choice(nodes, size=20_000, p=weights)
    rewards = (rng.random((20_000, 4)) < pass_rates[:, None]).astype(np.float64)
    rewards = torch.from_numpy(rewards)
    centred = group_advantages(rewards, "dr_grpo")
    sampled = group_advantages(rewards, method)[centred != 0] / centred[centred != 0]
    # one constant over the whole batch, close to the many-prompt limit (1 / E_p[p] = 2.5 for GPG)
    assert sampled.std() < 1e-9
    assert abs(sampled.mean().item() / batch_limit_scale(method, 4, nodes, weights) - 1) < 0.02
    if method == "gpg":
        assert batch_limit_scale(method, 4, nodes, weights) == pytest.approx(2.5, rel=1e-12)


@pytest.mark.parametrize("method", ["gpg", "reinforce_plus_plus_baseline"])
def test_batch_methods_are_rescaled_dr_grpo(method):
    nodes, weights = beta_quadrature(1.0, 1.0, 32)
    kwargs = {"batch_pass_rates": (nodes, weights), "score_noise": 4.0}
    batch = best_step_error(nodes, weights, 8, method, **kwargs)
    plain = best_step_error(nodes, weights, 8, "dr_grpo", score_noise=4.0)
    assert batch["relative_error"] == pytest.approx(plain["relative_error"], rel=1e-12)
    assert batch["alignment"] == pytest.approx(1.0, rel=1e-12)
    # GPG's alpha is 1 / E[p] = 2 under the uniform prior, so the weight is 2 (1 - 1/8)
    if method == "gpg":
        weight = estimator_moments(GRID, 8, method, batch_pass_rates=(nodes, weights))["weight"]
        np.testing.assert_allclose(weight, 2 * (1 - 1 / 8), rtol=1e-10)


def test_the_degenerate_rate_is_all_correct_plus_all_wrong_and_its_slope_is_its_derivative():
    p = np.linspace(0.01, 0.99, 99)
    rate = degenerate_rate(p, 8)
    np.testing.assert_allclose(rate, estimator_moments(p, 8)["degenerate_rate"], rtol=1e-12)
    h = 1e-6
    numeric = (degenerate_rate(p + h, 8) - degenerate_rate(p - h, 8)) / (2 * h)
    np.testing.assert_allclose(degenerate_rate_slope(p, 8), numeric, rtol=1e-6, atol=1e-8)
