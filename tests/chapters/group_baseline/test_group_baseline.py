"""Chapter 2's measurements (`chapters.group_baseline.exact`) against the closed forms
they are meant to reproduce: w = 1 - 1/G for the mean including self, w = 1 for leave-one-out, and
`core.exact`'s w(p) for every method on every policy."""

import math

import matplotlib.pyplot as plt
import numpy as np
import pytest
from conftest import sum_mod_setup

from grpo_companion.chapters.group_baseline.exact import (
    METHODS,
    plot_gradient_weight_vs_group_size,
    plot_prompt_weight_vs_pass_rate,
    prompt_weights,
    weights_by_group_size,
)
from grpo_companion.core import exact


@pytest.fixture(scope="module")
def setup():
    return sum_mod_setup(vocab_size=2, length=3, seed=0)


def test_weights_by_group_size_are_the_closed_forms(setup):
    policy, logits, rewards = setup
    scaling = weights_by_group_size(policy, logits, rewards, [2, 3, 5])
    assert scaling.index.tolist() == [2, 3, 5]
    assert scaling["multisets"].tolist() == [math.comb(8 + g - 1, g) for g in (2, 3, 5)]
    assert scaling["ordered groups"].tolist() == [8**2, 8**3, 8**5]
    np.testing.assert_allclose(scaling["w dr_grpo"], [1 / 2, 2 / 3, 4 / 5], rtol=0, atol=1e-12)
    np.testing.assert_allclose(scaling["w rloo"], 1.0, rtol=0, atol=1e-12)
    assert scaling["max residual"].max() < 1e-12
    # grpo's weight is the binary-reward law w(p) at the policy's pass rate.
    pass_rate = float(policy.objective(logits, rewards))
    expected = [exact.estimator_moments(pass_rate, g, "grpo")["weight"][0] for g in (2, 3, 5)]
    np.testing.assert_allclose(scaling["w grpo"], expected, rtol=0, atol=1e-12)


def test_prompt_weights_are_w_of_each_prompts_pass_rate(setup):
    policy, _, rewards = setup
    prompts = prompt_weights(policy, rewards, 4, 3, seed=5, logit_scale=2.0)
    pass_rates = [
        float(policy.objective(policy.init_logits(5 + 100 + j, scale=2.0), rewards))
        for j in range(3)
    ]
    assert sorted(prompts.index.tolist()) == [0, 1, 2]
    assert prompts["pass rate p"].is_monotonic_increasing
    assert prompts["pass rate p"].tolist() == [pass_rates[j] for j in prompts.index]
    np.testing.assert_allclose(prompts["w dr_grpo"], 3 / 4, rtol=0, atol=1e-12)
    np.testing.assert_allclose(prompts["w rloo"], 1.0, rtol=0, atol=1e-12)
    for method in METHODS:
        np.testing.assert_allclose(
            prompts[f"w {method}"], prompts[f"w {method}, exact.py"], rtol=0, atol=1e-12
        )
        assert prompts[f"residual {method}"].max() < 1e-12
    # the prompts differ in difficulty, and grpo weighs them differently
    assert prompts["w grpo"].max() - prompts["w grpo"].min() > 1e-3


def test_figures_draw_the_data_they_are_given(setup):
    policy, logits, rewards = setup
    scaling = weights_by_group_size(policy, logits, rewards, [2, 4])
    fig = plot_gradient_weight_vs_group_size(scaling, 0.4)
    lines = fig.axes[0].lines
    np.testing.assert_allclose(lines[0].get_ydata(), 1 - 1 / lines[0].get_xdata())
    np.testing.assert_allclose(lines[1].get_ydata(), scaling["w dr_grpo"])
    np.testing.assert_allclose(lines[3].get_ydata(), scaling["w grpo"])
    plt.close(fig)

    prompts = prompt_weights(policy, rewards, 4, 2, seed=0, logit_scale=2.0)
    fig = plot_prompt_weight_vs_pass_rate(prompts, 4)
    curve, points = fig.axes[0].lines[0], fig.axes[0].lines[1]  # grpo: w(p), then the prompts
    np.testing.assert_allclose(
        curve.get_ydata(), exact.estimator_moments(curve.get_xdata(), 4, "grpo")["weight"]
    )
    np.testing.assert_allclose(points.get_ydata(), prompts["w grpo"])
    plt.close(fig)
