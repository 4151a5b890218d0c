import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from scipy.special import betaln
from tiny_llama_batch import one_layer_llama

from grpo_companion.chapters.sparsity.lm_runs import per_group_gradients
from grpo_companion.chapters.sparsity.rate import (
    beta_concentration_for,
    beta_degenerate_rate,
    beta_rate_curves,
    dynamic_sampling,
    explain_reported_rate,
    gradient_share,
    group_gradients,
    iid_degenerate_rate,
    iid_pass_rates_for,
    iid_rate_curve,
    jensen_gap,
    jensen_gap_summary,
    kept_groups,
    mixture_degenerate_rate,
    monte_carlo_check,
    random_jensen_gaps,
    simulated_beta_rates,
)
from grpo_companion.core.advantages import (
    degenerate_fractions,
    empirical_pass_rates,
    group_advantages,
    zero_advantage_fractions,
    zero_std_groups,
)
from grpo_companion.core.exact import average_over_pass_rates, beta_quadrature, estimator_moments
from grpo_companion.core.losses import grpo_loss
from grpo_companion.core.stats import fitted_trend, metric_by_step, seed_band
from grpo_companion.lm.scoring import sequence_log_probs

NUM_GROUPS = 40_000  # Monte Carlo groups per check


def assert_within_5_sigma(estimate, probability, n=NUM_GROUPS):
    # Binomial standard error of a frequency; the floor keeps p in {0, 1} testable.
    sigma = max(math.sqrt(probability * (1 - probability) / n), 1 / n)
    assert abs(estimate - probability) <= 5 * sigma, (estimate, probability, sigma)


@pytest.mark.parametrize("group_size", [1, 4, 16])
@pytest.mark.parametrize("pass_rate", [0.0, 0.05, 0.5, 0.9])
def test_iid_rate_matches_monte_carlo_rollouts(pass_rate, group_size):
    rng = np.random.default_rng(0)
    correct = rng.random((NUM_GROUPS, group_size)) < pass_rate
    rewards = torch.from_numpy(correct.astype(np.float64))
    theory = iid_degenerate_rate(pass_rate, group_size)
    measured = {
        "all_correct": (rewards == 1).all(1).double().mean().item(),
        "all_wrong": (rewards == 0).all(1).double().mean().item(),
    }
    if group_size >= 2:  # the estimator needs a within-group std
        measured = degenerate_fractions(rewards)
        assert_within_5_sigma(measured["degenerate"], theory["degenerate"][0])
    for key in ("all_correct", "all_wrong"):
        assert_within_5_sigma(measured[key], theory[key][0])


@pytest.mark.parametrize("a, b, group_size", [(0.3, 0.7, 4), (2.0, 5.0, 8), (1.0, 1.0, 2)])
def test_beta_rate_matches_monte_carlo(a, b, group_size):
    rng = np.random.default_rng(1)
    successes = rng.binomial(group_size, rng.beta(a, b, size=NUM_GROUPS))
    theory = beta_degenerate_rate(a, b, group_size)
    assert_within_5_sigma(np.mean(successes == group_size), theory["all_correct"])
    assert_within_5_sigma(np.mean(successes == 0), theory["all_wrong"])


@pytest.mark.parametrize("a, b", [(0.2, 0.5), (1.0, 1.0), (3.0, 7.0), (50.0, 20.0)])
@pytest.mark.parametrize("group_size", [1, 4, 64])
def test_beta_closed_form_and_quadrature(a, b, group_size):
    rates = beta_degenerate_rate(a, b, group_size)
    # E[p^G] = B(a + G, b) / B(a, b), and E[(1 - p)^G] = B(a, b + G) / B(a, b).
    all_correct = np.exp(betaln(a + group_size, b) - betaln(a, b))
    all_wrong = np.exp(betaln(a, b + group_size) - betaln(a, b))
    assert rates["all_correct"] == pytest.approx(all_correct, rel=1e-12)
    assert rates["all_wrong"] == pytest.approx(all_wrong, rel=1e-12)
    quadrature = mixture_degenerate_rate(*beta_quadrature(a, b), group_size)
    for key, value in rates.items():
        assert quadrature[key] == pytest.approx(value, rel=1e-8, abs=1e-12)


def test_agrees_with_exact_module():
    pass_rates, weights = np.array([0.0, 0.2, 0.7, 1.0]), np.array([1.0, 2.0, 3.0, 4.0])
    np.testing.assert_allclose(
        iid_degenerate_rate(pass_rates, 4)["degenerate"],
        estimator_moments(pass_rates, 4)["degenerate_rate"],
        rtol=1e-12,
    )
    assert mixture_degenerate_rate(pass_rates, weights, 4)["degenerate"] == pytest.approx(
        average_over_pass_rates(pass_rates, weights, 4)["degenerate_rate"], rel=1e-12
    )


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 1), st.floats(1e-3, 1)), min_size=1, max_size=20),
    st.integers(1, 64),
)
def test_jensen_gap_is_non_negative(distribution, group_size):
    pass_rates, weights = map(np.array, zip(*distribution))
    gap = jensen_gap(pass_rates, weights, group_size)
    assert gap >= -1e-12
    if group_size == 1 or np.ptp(pass_rates) == 0:
        assert gap == pytest.approx(0.0, abs=1e-12)


def test_jensen_gap_is_positive_for_spread_out_prompts():
    # Half the prompts always solved, half never: every group is degenerate, i.i.d. predicts 1/8.
    assert jensen_gap([0.0, 1.0], [1.0, 1.0], 4) == pytest.approx(1 - 2 * 0.5**4)
    assert beta_degenerate_rate(1.0, 1.0, 4)["degenerate"] == pytest.approx(2 / 5)  # E[p^4] = 1/5


@pytest.mark.parametrize("group_size", [2, 4, 16])
@pytest.mark.parametrize("rate_fraction", [0.0, 0.3, 0.69, 1.0])
def test_iid_pass_rates_for_inverts_the_rate(group_size, rate_fraction):
    floor = 2.0 ** (1 - group_size)
    target = floor + rate_fraction * (1 - floor)
    low, high = iid_pass_rates_for(target, group_size)
    assert low <= 0.5 <= high and low + high == pytest.approx(1.0)
    for p in (low, high):
        rate = iid_degenerate_rate(p, group_size)["degenerate"][0]
        assert rate == pytest.approx(target, abs=1e-12)


def test_iid_pass_rates_for_the_reported_rate():
    low, high = iid_pass_rates_for(0.69, 4)
    assert low == pytest.approx(0.0886135, abs=1e-6) and high == pytest.approx(0.9113865, abs=1e-6)


@pytest.mark.parametrize("mean", [0.1, 0.3, 0.5, 0.8])
@pytest.mark.parametrize("target", [0.69, 0.95])
def test_beta_concentration_for_inverts_the_rate(mean, target):
    kappa = beta_concentration_for(target, mean, 4)
    # More heterogeneity (smaller kappa) gives more degenerate groups.
    rates = [
        beta_degenerate_rate(mean * k, (1 - mean) * k, 4)["degenerate"]
        for k in (kappa / 2, kappa, 2 * kappa)
    ]
    assert rates[1] == pytest.approx(target, abs=1e-10)
    assert rates[0] > rates[1] > rates[2]


def test_beta_concentration_for_the_reported_rate():
    assert beta_concentration_for(0.69, 0.5, 4) == pytest.approx(0.516194, rel=1e-5)


REWARDS = torch.tensor(
    [
        [1.0, 1.0, 1.0, 1.0],  # all correct
        [0.0, 0.0, 0.0, 0.0],  # all wrong
        [1.0, 0.0, 0.0, 0.0],  # mixed
        [0.5, 0.5, 0.5, 0.5],
    ],  # constant, neither all correct nor all wrong
    dtype=torch.float64,
)
# Completion lengths, one row per rollout in prompt-major order (group 0 first).
LENGTHS = torch.tensor([1, 2, 3, 4, 2, 2, 2, 2, 5, 5, 5, 5, 1, 1, 1, 1])


def completion_mask(lengths=LENGTHS, max_length=6):
    return (torch.arange(max_length) < lengths[:, None]).long()


def test_estimators_on_a_hand_built_batch():
    assert empirical_pass_rates(REWARDS).tolist() == [1.0, 0.0, 0.25, 0.5]
    assert zero_std_groups(REWARDS).tolist() == [True, True, False, True]
    expected = {"all_correct": 0.25, "all_wrong": 0.25, "degenerate": 0.75}
    assert degenerate_fractions(REWARDS) == expected
    assert kept_groups(REWARDS).tolist() == [2]
    fractions = zero_advantage_fractions(group_advantages(REWARDS), completion_mask())
    assert fractions["rollouts"] == 0.75
    assert fractions["tokens"] == pytest.approx((10 + 8 + 4) / (10 + 8 + 20 + 4))


def test_zero_std_tolerance():
    nearly_constant = torch.tensor([[0.3, 0.3 + 1e-12], [0.3, 0.4]], dtype=torch.float64)
    assert zero_std_groups(nearly_constant).tolist() == [True, False]
    assert zero_std_groups(nearly_constant, atol=0.0).tolist() == [False, False]
    assert zero_std_groups(nearly_constant, atol=0.1).tolist() == [True, True]


def test_gradient_share():
    gradients = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 4.0]])
    first = torch.tensor([True, False, False])
    assert gradient_share(gradients, first) == pytest.approx(1 / math.sqrt(41))  # |(1,0)|/|(4,5)|
    assert gradient_share(gradients, torch.ones(3, dtype=torch.bool)) == pytest.approx(1.0)


def test_degenerate_groups_carry_no_grpo_gradient_but_do_carry_sign_gradient():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(REWARDS.numel(), 5, generator=generator, dtype=torch.float64)
    mixed = ~zero_std_groups(REWARDS)
    grpo = group_gradients(group_advantages(REWARDS), scores)
    assert gradient_share(grpo, mixed) == pytest.approx(1.0, abs=1e-12)
    # Sign gives A = -1 to the all-wrong group: it adds -mean(score) of that group.
    sign = group_gradients(group_advantages(REWARDS[:3], "sign"), scores[:12])
    assert torch.allclose(sign[1], -scores[4:8].mean(dim=0))
    assert gradient_share(sign, mixed[:3]) != pytest.approx(1.0)


def test_dynamic_sampling():
    rng = np.random.default_rng(2)
    rewards = torch.from_numpy((rng.random((64, 4)) < 0.3).astype(np.float64))
    mixed = set(kept_groups(rewards).tolist())
    chosen = dynamic_sampling(rewards, 10, seed=0)
    assert len(chosen) == 10 and set(chosen.tolist()) <= mixed
    assert chosen.tolist() == sorted(chosen.tolist())
    assert torch.equal(chosen, dynamic_sampling(rewards, 10, seed=0))
    assert not torch.equal(chosen, dynamic_sampling(rewards, 10, seed=1))
    assert set(dynamic_sampling(rewards, 1000, seed=0).tolist()) == mixed  # too few: keep all


def test_per_group_gradients_sum_to_the_batch_gradient():
    model = one_layer_llama()
    prompt_length, completion_length = 3, 6
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(
        1, 20, (REWARDS.numel(), prompt_length + completion_length), generator=generator
    )
    mask = completion_mask(max_length=completion_length)
    attention_mask = torch.cat(
        [torch.ones(REWARDS.numel(), prompt_length, dtype=torch.long), mask], dim=1
    )
    parameters = list(model.parameters())
    rewards = REWARDS.clone()
    rewards[3] = torch.tensor([0.0, 1.0, 1.0, 0.0])  # binary, for Sign: groups 2, 3 mixed
    degenerate = zero_std_groups(rewards)
    for method in ("grpo", "sign"):
        advantages = group_advantages(rewards, method)
        rows = per_group_gradients(model, input_ids, attention_mask, mask, advantages)
        assert rows.shape == (4, sum(parameter.numel() for parameter in parameters))
        log_probs = sequence_log_probs(model, input_ids, attention_mask, mask)
        loss, _ = grpo_loss(log_probs, log_probs.detach(), None, advantages.flatten(), mask)
        batch = torch.cat([g.flatten() for g in torch.autograd.grad(-loss, parameters)])
        torch.testing.assert_close(rows.sum(dim=0), batch, rtol=1e-10, atol=1e-12)
        if method == "grpo":  # zero advantages: exactly no gradient
            assert rows[degenerate].abs().max().item() < 1e-12
            assert gradient_share(rows, ~degenerate) == pytest.approx(1.0, abs=1e-10)
        else:  # A = +1 on the all-correct group, -1 on the all-wrong one: both move
            assert (rows[degenerate].norm(dim=1) > 1e-6).all()
            assert gradient_share(rows, ~degenerate) != pytest.approx(1.0, abs=1e-3)


HISTORIES = [
    [
        {"step": 0, "all_correct": None, "eval_accuracy": 0.1},
        {"step": 1, "all_correct": 0.0, "eval_accuracy": None},
        {"step": 2, "all_correct": 0.5, "eval_accuracy": 0.3},
    ],
    [
        {"step": 0, "all_correct": None, "eval_accuracy": 0.2},
        {"step": 1, "all_correct": 0.25, "eval_accuracy": None},
        {"step": 2, "all_correct": 0.25, "eval_accuracy": 0.5},
    ],
]


def test_metric_by_step():
    steps, values = metric_by_step(HISTORIES, "all_correct")
    assert steps.tolist() == [1, 2] and values.tolist() == [[0.0, 0.5], [0.25, 0.25]]
    steps, values = metric_by_step(HISTORIES, "eval_accuracy")
    assert steps.tolist() == [0, 2] and values.tolist() == [[0.1, 0.3], [0.2, 0.5]]
    uneven = [HISTORIES[0], HISTORIES[1][:2]]
    with pytest.raises(ValueError, match="different steps"):
        metric_by_step(uneven, "eval_accuracy")


def test_seed_band():
    values = np.array([[0.0, 1.0], [2.0, 1.0], [4.0, 1.0]])
    band = seed_band(values, confidence=0.9)
    half = stats.t.ppf(0.95, 2) * 2.0 / math.sqrt(3)  # column 0: mean 2, sample std 2
    np.testing.assert_allclose(band["mean"], [2.0, 1.0])
    np.testing.assert_allclose(band["low"], [2 - half, 1.0])
    np.testing.assert_allclose(band["high"], [2 + half, 1.0])


def test_fitted_trend():
    steps = np.arange(1, 11)
    rng = np.random.default_rng(4)
    values = np.stack([0.02 * steps + 0.1, -0.01 * steps + 0.5, rng.random(10)])
    trend = fitted_trend(steps, values)
    expected = [stats.linregress(steps, row).slope for row in values]
    np.testing.assert_allclose(trend["slopes"], expected, rtol=1e-12)
    assert trend["slopes"][:2] == pytest.approx([0.02, -0.01])
    assert trend["mean"] == pytest.approx(np.mean(expected))
    low, high = stats.t.interval(0.95, 2, loc=np.mean(expected), scale=stats.sem(expected))
    assert (trend["low"], trend["high"]) == pytest.approx((low, high))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: iid_degenerate_rate([0.5, 1.2], 4), "pass_rates must lie in"),
        (lambda: iid_degenerate_rate(float("nan"), 4), "pass_rates must lie in"),
        (lambda: iid_degenerate_rate(0.5, 0), "group_size must be an integer >= 1"),
        (lambda: iid_degenerate_rate(0.5, 2.5), "group_size must be an integer"),
        (
            lambda: mixture_degenerate_rate([0.1, 0.2], [1.0, -1.0], 4),
            "weights must be non-negative",
        ),
        (lambda: mixture_degenerate_rate([0.1, 0.2], [1.0], 4), "weights must be"),
        (lambda: beta_degenerate_rate(0.0, 1.0, 4), "Beta parameters must be > 0"),
        (lambda: iid_pass_rates_for(0.1, 4), r"\[2\^\(1-G\), 1\]"),
        (lambda: iid_pass_rates_for(1.5, 4), "lies in"),
        (lambda: iid_pass_rates_for(0.9, 1), "group_size must be an integer >= 2"),
        (lambda: beta_concentration_for(0.6, 0.1, 4), r"\(f\(mean\), 1\)"),  # f(0.1) = 0.656
        (lambda: beta_concentration_for(0.69, 1.0, 4), "mean pass rate must lie in"),
        (lambda: empirical_pass_rates(torch.zeros(4)), "rewards must be 2-D"),
        (lambda: zero_std_groups(torch.zeros(3, 1)), "group_size >= 2"),
        (lambda: zero_advantage_fractions(torch.zeros(4, 2), torch.ones(7, 3)), "completion_mask"),
        (lambda: group_gradients(torch.zeros(2, 2), torch.zeros(5, 3)), "need advantages"),
        (
            lambda: gradient_share(torch.zeros(3), torch.ones(3, dtype=torch.bool)),
            "group_gradients",
        ),
        (lambda: gradient_share(torch.zeros(3, 2), torch.ones(3)), "bool mask"),
        (lambda: dynamic_sampling(REWARDS, 0, seed=0), "num_groups must be"),
        (
            lambda: per_group_gradients(
                None, torch.zeros(15, 4), torch.zeros(15, 4), torch.zeros(16, 2), REWARDS
            ),
            "need B \\* G = 16",
        ),
        (lambda: seed_band(np.zeros((1, 3))), "num_runs >= 2"),
        (lambda: fitted_trend([1, 2, 3], np.zeros((2, 4))), "num_steps = 3"),
    ],
)
def test_informative_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_iid_rate_curve_and_beta_rate_curves():
    group_sizes = np.arange(1, 7)
    np.testing.assert_allclose(
        iid_rate_curve(0.3, group_sizes), 0.3**group_sizes + 0.7**group_sizes, rtol=1e-14
    )
    curves = beta_rate_curves(0.3, [0.5, 8.0], group_sizes)
    assert list(curves) == [0.5, 8.0]
    for kappa, curve in curves.items():
        a, b = 0.3 * kappa, 0.7 * kappa
        expected = [
            np.exp(betaln(a + g, b) - betaln(a, b)) + np.exp(betaln(a, b + g) - betaln(a, b))
            for g in group_sizes
        ]
        np.testing.assert_allclose(curve, expected, rtol=1e-10)
    # Spread-out prompts are degenerate more often, at every G >= 2 (Jensen).
    assert (curves[0.5][1:] > curves[8.0][1:]).all()
    assert (curves[8.0][1:] > iid_rate_curve(0.3, group_sizes)[1:]).all()


def test_simulated_beta_rates_are_the_documented_draws():
    group_sizes = np.arange(1, 9)
    simulated = simulated_beta_rates(np.random.default_rng(5), 0.3, [0.5, 2.0], group_sizes, 4000)
    rng = np.random.default_rng(5)  # the same draws, in the documented order
    for kappa in (0.5, 2.0):
        p = rng.beta(0.3 * kappa, 0.7 * kappa, size=4000)
        correct = rng.binomial(group_sizes[:, None], p[None, :])
        expected = ((correct == 0) | (correct == group_sizes[:, None])).mean(axis=1)
        np.testing.assert_array_equal(simulated[kappa], expected)
    exact = beta_rate_curves(0.3, [0.5, 2.0], group_sizes)
    check = monte_carlo_check(simulated, exact, 4000)
    assert check["monte_carlo_checks"] == 2 * 7 and check["monte_carlo_max_z"] < 4.5


def test_monte_carlo_check_hand_built():
    exact = {1.0: np.array([1.0, 0.5, 0.2])}
    simulated = {1.0: np.array([1.0, 0.55, 0.2])}  # G = 2: 0.05 / sqrt(0.25 / 100) = 1
    assert monte_carlo_check(simulated, exact, 100) == {
        "monte_carlo_prompts": 100,
        "monte_carlo_max_z": pytest.approx(1.0),
        "monte_carlo_checks": 2,
    }


def test_random_jensen_gaps_are_the_documented_draws_and_never_negative():
    gaps = random_jensen_gaps(np.random.default_rng(7), 50)
    rng = np.random.default_rng(7)
    expected = []
    for _ in range(50):
        support = rng.integers(2, 21)
        pass_rates = rng.random(support)
        weights = rng.dirichlet(np.ones(support))
        expected.append(jensen_gap(pass_rates, weights, int(rng.integers(1, 65))))
    np.testing.assert_array_equal(gaps, expected)
    assert gaps.min() >= -1e-12 and np.median(gaps) > 0


def test_jensen_gap_summary_hand_built():
    summary = jensen_gap_summary(np.array([0.3, -1e-16, 0.1, -1e-9]))
    assert summary == {
        "num_random_distributions": 4,
        "jensen_gap_min": -1e-9,
        "jensen_gaps_below_rounding": 1,
        "jensen_gap_median": pytest.approx(0.05),
    }


def test_explain_reported_rate():
    records, table = explain_reported_rate(0.69, 4, [0.5, 0.8])
    assert records["reported_iid_low"] == pytest.approx(0.0886135, abs=1e-6)
    assert records["reported_iid_high"] == pytest.approx(0.9113865, abs=1e-6)
    assert table.index.tolist() == [0.5, 0.8]
    assert table.loc[0.5, "kappa giving the reported rate"] == pytest.approx(0.516194, rel=1e-5)
    assert table.loc[0.5, "i.i.d. rate f(m)"] == pytest.approx(2 * 0.5**4)
    kappa = table.loc[0.8, "kappa giving the reported rate"]
    assert beta_degenerate_rate(0.8 * kappa, 0.2 * kappa, 4)["degenerate"] == pytest.approx(0.69)
    assert table.loc[0.8, "std of p"] == pytest.approx(math.sqrt(0.8 * 0.2 / (kappa + 1)))
    assert records["reported_example_mean"] == 0.8
    assert records["reported_example_kappa"] == kappa
    assert records["reported_degenerate_rate"] == 0.69 and records["reported_group_size"] == 4
