import numpy as np
import pytest
from scipy import stats

from grpo_companion.chapters.sparsity import flow as sf
from grpo_companion.core.exact import (
    binary_group_advantages,
    degenerate_rate_slope,
    estimator_moments,
)


def test_the_mean_polynomial_is_the_binomial_sum_of_k_times_a_correct():
    p = np.linspace(0, 1, 41)
    a_correct, _ = binary_group_advantages(4, "grpo")
    k = np.arange(5)
    direct = (stats.binom.pmf(k, 4, p[:, None]) * np.where(k > 0, k * a_correct, 0)).sum(1) / 4
    np.testing.assert_allclose(sf.grpo_mean_polynomial(4)(p), direct, atol=1e-14)
    np.testing.assert_allclose(
        sf.grpo_mean_polynomial(6)(p), estimator_moments(p, 6, "grpo")["mean"], atol=1e-14
    )


def test_degenerate_rate_slope_is_the_derivative_and_changes_sign_at_one_half():
    p, h = np.linspace(0.01, 0.99, 50), 1e-6
    f = lambda q: q**4 + (1 - q) ** 4  # noqa: E731
    np.testing.assert_allclose(
        degenerate_rate_slope(p, 4), (f(p + h) - f(p - h)) / 2 / h, atol=1e-6
    )
    assert degenerate_rate_slope(0.5, 4)[0] == 0
    assert (degenerate_rate_slope(p[p < 0.5], 4) < 0).all()
    assert (degenerate_rate_slope(p[p > 0.5], 4) > 0).all()


def test_sharing_one_shifts_every_logit_alike_and_zero_keeps_each_its_own():
    p = np.array([[0.1, 0.5, 0.9], [0.1, 0.5, 0.9]])
    step = sf.expected_grpo_step(p, 4, [0.0, 1.0])
    np.testing.assert_allclose(step[0], estimator_moments(p[0], 4, "grpo")["mean"], atol=1e-14)
    np.testing.assert_allclose(step[1], step[0].mean())


@pytest.fixture(scope="module")
def small_grid():
    return sf.flow_grid([0.3, 0.7], [2.0, 20.0], [0.0, 1.0], num_prompts=200, group_size=4,
                        step_size=0.1, num_steps=150)  # fmt: skip


def test_the_flow_falls_from_a_low_start_and_never_from_above_one_half(small_grid):
    starts, flow = small_grid
    summary = sf.flow_summary(starts, flow)
    assert summary["p3_flow_min_step_change"] < 0
    assert summary["p3_half_start_min_step_change"] >= -sf.ROUNDING
    assert summary["p3_sign_agreement"] >= 0.99
    counter = sf.counterexample(starts, flow, 0.3, 20.0, 0.0)
    assert counter["p3_counter_degenerate_fall"] < 0 < counter["p3_counter_pass_rate_change"]
    assert np.all(np.diff(flow["pass_rate"], axis=1) > 0)  # GRPO raises every mean pass rate


def test_flow_to_pass_rate_lands_on_the_target_and_the_fit_recovers_a_beta():
    start = sf.beta_prompts(0.3, 5.0, 500)
    assert start.mean() == pytest.approx(0.3, abs=1e-3)
    end = sf.flow_to_pass_rate(start, 4, 0.5, 0.6, step_size=0.1, max_steps=10_000)
    assert end.mean() == pytest.approx(0.6, abs=1e-9)
    assert np.all(end >= start)
    unchanged = sf.flow_to_pass_rate(start, 4, 0.5, 0.1, step_size=0.1, max_steps=10)
    assert sf.predicted_change(start, unchanged, 4)["degenerate"] == 0
    counts = stats.betabinom.rvs(8, 0.3 * 5, 0.7 * 5, size=4000, random_state=0)
    mean, concentration = sf.fit_beta_binomial(counts, 8)
    assert mean == pytest.approx(0.3, abs=0.02) and concentration == pytest.approx(5, rel=0.3)
