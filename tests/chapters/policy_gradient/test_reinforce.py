"""Chapter 1's measurements (`chapters.policy_gradient.reinforce`) against hand-computed values and
the exact variance of `core.policy_gradient`."""

import math

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from conftest import sum_mod_setup

from grpo_companion.chapters.policy_gradient.reinforce import (
    error_slope,
    monte_carlo_variances,
    plot_error_vs_samples,
    plot_variance_vs_baseline,
    rms_errors,
)
from grpo_companion.core.policy_gradient import estimator_variance


@pytest.fixture(scope="module")
def setup():
    return sum_mod_setup(vocab_size=3, length=2, seed=2)


def test_rms_errors_and_slope_by_hand():
    errors = torch.tensor([[3.0, 4.0], [1.0, 1.0]], dtype=torch.float64)
    np.testing.assert_allclose(rms_errors(errors), [math.sqrt(12.5), 1.0])
    # errors exactly c / sqrt(n): the slope is -1/2; c / n gives -1
    sizes = [10, 100, 1000]
    root = torch.tensor([[2 / math.sqrt(n)] * 3 for n in sizes], dtype=torch.float64)
    assert error_slope(sizes, root) == pytest.approx(-0.5, abs=1e-12)
    assert error_slope(sizes, root.square() / 4) == pytest.approx(-1.0, abs=1e-12)


def test_monte_carlo_variances_are_sample_variances_of_one_draw_set(setup):
    policy, logits, rewards = setup
    baselines = [0.0, 0.5]
    variances = monte_carlo_variances(
        policy, logits, rewards, baselines, 50, torch.Generator().manual_seed(1)
    )
    draws = policy.sample(logits, 50, torch.Generator().manual_seed(1))
    scores = policy.scores(logits, policy.all_sequences())[draws]
    for b, variance in zip(baselines, variances):
        estimates = (rewards[draws] - b)[:, None] * scores  # (50, num_params)
        by_hand = ((estimates - estimates.mean(dim=0)) ** 2).sum().item() / 49
        assert variance == pytest.approx(by_hand, rel=1e-12)


def test_monte_carlo_variances_approach_the_exact_curve(setup):
    policy, logits, rewards = setup
    baselines = [0.0, 0.3, 1.0]
    variances = monte_carlo_variances(
        policy, logits, rewards, baselines, 200_000, torch.Generator().manual_seed(0)
    )
    exact = estimator_variance(policy, logits, rewards, torch.tensor(baselines))
    # 200k draws: a sample variance's relative error is ~0.5% here
    np.testing.assert_allclose(variances, exact.numpy(), rtol=0.03)


def test_figures_draw_the_data_they_are_given():
    sizes = [10, 100]
    errors = {
        "no baseline": torch.tensor([[1.0, 3.0], [0.5, 0.5]], dtype=torch.float64),
        "b*": torch.tensor([[1.0, 1.0], [0.2, 0.2]], dtype=torch.float64),
    }
    fig = plot_error_vs_samples(sizes, errors, {"no baseline": 4.0, "b*": 1.0})
    lines = fig.axes[0].lines
    np.testing.assert_allclose(lines[0].get_ydata(), [math.sqrt(5.0), 0.5])
    np.testing.assert_allclose(lines[1].get_ydata(), [math.sqrt(4 / 10), math.sqrt(4 / 100)])
    np.testing.assert_allclose(lines[3].get_ydata(), [math.sqrt(1 / 10), math.sqrt(1 / 100)])
    plt.close(fig)

    baselines = torch.linspace(0, 1, 5, dtype=torch.float64)
    fig = plot_variance_vs_baseline(baselines, baselines**2 + 1, [0.0, 1.0], [1.1, 1.9], 0.4, 0.3)
    lines = fig.axes[0].lines
    np.testing.assert_allclose(lines[0].get_ydata(), (baselines**2 + 1).numpy())
    np.testing.assert_allclose(lines[1].get_ydata(), [1.1, 1.9])
    assert lines[2].get_xdata()[0] == 0.4 and lines[3].get_xdata()[0] == 0.3
    plt.close(fig)
