"""Chapter 5, section 5: the credit comparison's runs at tiny size, its summary on synthetic
histories that support, contradict or cannot decide the prediction, and its figure."""

import copy

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pytest
from scipy import stats

from grpo_companion.chapters.credit_plots import plot_credit_gain
from grpo_companion.chapters.credit_training import (
    ARMS,
    credit_gain_summary,
    run_credit_comparison,
    side_of_zero,
    steps_to_target,
)
from grpo_companion.lm.trainer import GRPOConfig

STEP_COUNTS, SEEDS, INITIAL = [1, 2, 3, 4], [0, 1, 2], 0.2


def history(final: float, middle: float | None = None) -> list[dict]:
    """A `trainer.train` history, reduced to what the summary reads: accuracy at steps 0, 2, 4."""
    return [
        {"step": 0, "eval_accuracy": INITIAL},
        {"step": 1, "eval_accuracy": None},
        {"step": 2, "eval_accuracy": INITIAL if middle is None else middle},
        {"step": 3, "eval_accuracy": None},
        {"step": 4, "eval_accuracy": final},
    ]


def synthetic(gain_of_k, noise: float = 0.01) -> dict:
    """Histories whose outcome arm ends at 0.3 and whose process arm gains gain_of_k(k), plus a
    small seed-dependent wobble."""
    histories = {}
    for k in STEP_COUNTS:
        for seed in SEEDS:
            wobble = noise * (seed - 1) * (-1) ** k
            histories["outcome", k, seed] = history(0.3)
            histories["process", k, seed] = history(0.3 + gain_of_k(k) + wobble)
    return histories


def test_a_gain_that_grows_with_k_supports_the_prediction():
    records, table = credit_gain_summary(synthetic(lambda k: 0.05 * k))
    assert records["credit_gain_trend"] == "grows"
    assert records["credit_prediction"] == "supports"
    assert records["credit_gain_slope"] == pytest.approx(0.05)
    assert records["credit_gain_slope_low"] > 0
    # The paired gain at k = 2: 0.1 + 0.01 * (-1, 0, 1), a t-interval with 2 degrees of freedom.
    gains = 0.1 + 0.01 * np.array([-1, 0, 1])
    half = stats.t.ppf(0.975, 2) * gains.std(ddof=1) / np.sqrt(3)
    assert records["credit_gain"]["2"]["mean"] == pytest.approx(0.1)
    assert records["credit_gain"]["2"]["high"] == pytest.approx(0.1 + half)
    assert records["credit_final_accuracy"]["outcome"]["3"]["mean"] == pytest.approx(0.3)
    assert records["credit_initial_accuracy"] == dict.fromkeys(["1", "2", "3", "4"], INITIAL)
    assert (
        records["credit_gain_range"].startswith("+0.050 [")
        and " at 4 steps" in records["credit_gain_range"]
    )
    assert list(table.index) == STEP_COUNTS
    assert table.loc[4, "gain: mean"] == pytest.approx(0.2)


def test_a_gain_that_shrinks_with_k_contradicts_it():
    records, _ = credit_gain_summary(synthetic(lambda k: 0.25 - 0.05 * k))
    assert (records["credit_gain_trend"], records["credit_prediction"]) == (
        "shrinks",
        "contradicts",
    )
    assert records["credit_gain_slope_high"] < 0


def test_noise_without_a_trend_cannot_decide():
    records, _ = credit_gain_summary(synthetic(lambda k: 0.05, noise=0.1))
    assert records["credit_gain_trend"] == "cannot be told apart from a constant"
    assert records["credit_prediction"] == "can neither support nor contradict"
    assert records["credit_gain_slope_low"] < 0 < records["credit_gain_slope_high"]


def test_steps_to_target_says_when_a_target_is_never_reached():
    assert steps_to_target(history(0.3, middle=0.26), 0.25) == 2
    assert steps_to_target(history(0.3), 0.25) == 4
    assert steps_to_target(history(0.22), 0.25) is None
    assert steps_to_target(history(0.1), 0.2) == 0  # the warm start is already there
    histories = synthetic(lambda k: 0.05 * k)
    for seed in SEEDS:  # the process arm reaches 0.25 at step 2 for k = 1, never at k = 2
        histories["process", 1, seed] = history(0.3, middle=0.26)
        histories["process", 2, seed] = history(0.22)
    records, table = credit_gain_summary(histories, target_gain=0.05)
    reached = records["credit_steps_to_target"]
    assert reached["process"]["1"] == {"mean_steps": 2.0, "reached": 3}
    assert reached["process"]["2"] == {"mean_steps": None, "reached": 0}
    assert reached["outcome"]["2"] == {"mean_steps": 4.0, "reached": 3}
    assert np.isnan(table.loc[2, "process: steps to target"])
    assert table.loc[2, "process: seeds at target"] == 0


def test_the_summary_needs_two_k_and_two_seeds():
    histories = {key: value for key, value in synthetic(lambda k: 0.0).items() if key[2] == 0}
    with pytest.raises(ValueError, match="two k and two seeds"):
        credit_gain_summary(histories)


def test_side_of_zero():
    words = ("up", "down", "neither")
    assert side_of_zero({"low": 0.1, "high": 0.2}, *words) == "up"
    assert side_of_zero({"low": -0.2, "high": -0.1}, *words) == "down"
    assert side_of_zero({"low": -0.1, "high": 0.1}, *words) == "neither"
    assert side_of_zero({"low": None, "high": None}, *words) == "neither"


def test_runs_pair_the_arms_at_tiny_size(random_tiny):
    model, tokenizer = random_tiny
    loads = []

    def fresh():
        loads.append(1)
        return copy.deepcopy(model)

    config = GRPOConfig(
        num_generations=2, per_step_prompts=2, max_completion_length=6, learning_rate=1e-2,
        max_steps=2, eval_every=2, micro_batch_size=8, rollout_batch_size=8,
    )  # fmt: skip
    histories = run_credit_comparison(fresh, tokenizer, [1, 2], [0, 1], config, 4, 2)
    assert sorted(histories) == sorted(
        (arm, k, seed) for arm in ARMS for k in (1, 2) for seed in (0, 1)
    )
    assert len(loads) == 8 + 2  # a fresh copy for every run, and one per k for its evaluation
    for k in (1, 2):
        for seed in (0, 1):
            pair = [histories[arm, k, seed] for arm in ARMS]
            assert [len(h) for h in pair] == [3, 3]
            # Same warm start and held-out problems; same prompts and rollouts at step 1.
            assert pair[0][0] == pair[1][0]
            assert pair[0][1]["num_tokens"] == pair[1][1]["num_tokens"]
    records, table = credit_gain_summary(histories)
    assert records["credit_step_counts"] == [1, 2] and len(table) == 2
    fig = plot_credit_gain(records, num_eval_prompts=2)
    assert len(fig.axes) == 2
    plt.close(fig)


def test_the_figure_draws_the_summary():
    records, _ = credit_gain_summary(synthetic(lambda k: 0.05 * k))
    fig = plot_credit_gain(records, num_eval_prompts=50)
    left, right = fig.axes
    np.testing.assert_allclose(right.lines[0].get_ydata(), [0.05, 0.1, 0.15, 0.2])  # the gains
    (fit,) = [line for line in right.lines if line.get_label().startswith("fitted slope")]
    np.testing.assert_allclose(fit.get_ydata(), [0.05, 0.1, 0.15, 0.2])
    np.testing.assert_allclose(left.lines[0].get_ydata(), [INITIAL] * 4)  # the warm start
    assert "grows" in right.get_title()
    plt.close(fig)
