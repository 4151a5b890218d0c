"""Chapter 6's figure helpers draw exactly the data they are given."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pytest

from grpo_companion.chapters.sparsity import flow as sparsity_flow
from grpo_companion.chapters.sparsity import plots as sparsity_plots
from grpo_companion.chapters.sparsity.plots import (
    plot_degenerate_rate_theory,
    plot_remedies,
)
from grpo_companion.chapters.sparsity.rate import beta_rate_curves, iid_rate_curve

pytestmark = pytest.mark.usefixtures("close_figures")


def test_theory_figure_draws_the_curves_and_every_third_simulated_rate():
    group_sizes = np.arange(1, 9)
    iid = iid_rate_curve(0.3, group_sizes)
    exact = beta_rate_curves(0.3, [0.5, 2.0], group_sizes)
    simulated = {kappa: rates + 0.01 for kappa, rates in exact.items()}
    fig = plot_degenerate_rate_theory(group_sizes, iid, exact, simulated, 0.3)
    convexity, rates = fig.axes
    # The chord's midpoint is the mean of f at 0.1 and 0.7, above f at 0.4.
    midpoint, prediction = convexity.lines[2], convexity.lines[3]
    f = lambda p: p**4 + (1 - p) ** 4  # noqa: E731
    assert midpoint.get_ydata()[0] == pytest.approx((f(0.1) + f(0.7)) / 2)
    assert prediction.get_ydata()[0] == pytest.approx(f(0.4))
    assert midpoint.get_ydata()[0] > prediction.get_ydata()[0]
    iid_line, beta_line, dots = rates.lines[:3]
    np.testing.assert_array_equal(iid_line.get_ydata(), iid)
    np.testing.assert_array_equal(beta_line.get_ydata(), exact[0.5])
    np.testing.assert_array_equal(dots.get_xdata(), [2, 5, 8])
    np.testing.assert_array_equal(dots.get_ydata(), simulated[0.5][[1, 4, 7]])
    assert len(rates.lines) == 1 + 2 * 2


def history(accuracy, zero_std):
    return [
        {"step": 0, "eval_accuracy": accuracy[0], "frac_reward_zero_std": None},
        {"step": 1, "eval_accuracy": None, "frac_reward_zero_std": zero_std[0]},
        {"step": 2, "eval_accuracy": accuracy[1], "frac_reward_zero_std": zero_std[1]},
    ]


def test_remedies_draw_each_methods_mean_over_seeds():
    histories = {
        ("grpo", 0): history([0.2, 0.4], [0.5, 0.0]),
        ("grpo", 1): history([0.2, 0.6], [0.5, 1.0]),
        ("sign", 0): history([0.2, 0.8], [1.0, 1.0]),
        ("sign", 1): history([0.2, 0.6], [0.0, 1.0]),
    }
    fig = plot_remedies(histories, ["grpo", "sign"], window=2, num_eval_prompts=10)
    accuracy, degenerate = fig.axes
    np.testing.assert_allclose(accuracy.lines[0].get_ydata(), [0.2, 0.5])
    np.testing.assert_allclose(accuracy.lines[1].get_ydata(), [0.2, 0.7])
    # 2-step moving average of each run, then the mean over seeds.
    np.testing.assert_allclose(degenerate.lines[0].get_ydata(), [0.5, 0.5])
    np.testing.assert_allclose(degenerate.lines[1].get_ydata(), [0.5, 0.75])
    labels = [text.get_text() for text in accuracy.get_legend().get_texts()]
    assert labels == ["GRPO", "Sign (A = 2r - 1)"]
    assert "2 seeds" in fig.texts[0].get_text()


def test_plot_exact_flow_draws_own_and_common_lines_on_both_panels():
    starts, flow = sparsity_flow.flow_grid(
        [0.3, 0.7], [2.0], [0.0, 0.5, 1.0], num_prompts=50, group_size=4, step_size=0.1,
        num_steps=20,
    )  # fmt: skip
    fig = sparsity_plots.plot_exact_flow(starts, flow, 2.0)
    # two means x (own, common) per panel; sharing 1/2 is left out of the figure
    assert [len(axis.get_lines()) for axis in fig.axes] == [5, 5]  # 4 flows + the line at 1/2
    plt.close(fig)
