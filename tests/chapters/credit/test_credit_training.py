"""Chapter 5, section 5: the credit comparison's runs at tiny size, its summary on synthetic
histories that support, contradict or cannot decide the prediction, and its figure."""

import copy

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pytest
from scipy import stats

from grpo_companion.chapters.credit.plots import plot_credit_gain
from grpo_companion.chapters.credit.training import (
    credit_gain_summary,
    predicted_gain_slope,
    run_credit_comparison,
    steps_to_target,
    warm_start_step_counts,
    warm_start_worked_lines,
)
from grpo_companion.lm.config import GRPOConfig

STEP_COUNTS, SEEDS, INITIAL = [1, 2, 3, 4], [0, 1, 2], 0.2
# The outcome arm gains 0.3 - 0.2 = 0.1 at every k: a predicted slope of 0.2 / 2 * 0.1 = 0.01.
TOY = {"variance_ratio": 0.2, "toy_steps": 2}


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
    records, table = credit_gain_summary(synthetic(lambda k: 0.05 * k), 0.05, **TOY)
    assert records["credit_prediction"] == "supports"
    assert records["predicted_credit_gain_slope"] == pytest.approx(0.01)
    assert records["predicted_credit_gain_slope_how"].startswith("+0.0100 per step")
    assert "(0.20 / 2)" in records["predicted_credit_gain_slope_how"]
    assert records["credit_outcome_gain"]["3"]["mean"] == pytest.approx(0.1)
    assert records["credit_outcome_learned_count"] == 4
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
    records, _ = credit_gain_summary(synthetic(lambda k: 0.25 - 0.05 * k), 0.05, **TOY)
    assert records["credit_prediction"] == "contradicts"
    assert records["credit_gain_slope_high"] < 0


def test_noise_without_a_trend_cannot_decide():
    records, _ = credit_gain_summary(synthetic(lambda k: 0.05, noise=0.1), 0.05, **TOY)
    assert records["credit_prediction"] == "can neither support nor contradict the predicted effect"
    assert records["credit_gain_slope_low"] < 0 < 0.01 < records["credit_gain_slope_high"]


def test_a_flat_gain_with_a_narrow_interval_contradicts_the_predicted_slope():
    records, _ = credit_gain_summary(synthetic(lambda k: 0.05, noise=0.001), 0.05, **TOY)
    assert records["credit_gain_slope_high"] < records["predicted_credit_gain_slope"]
    assert records["credit_prediction"] == "contradicts"


def test_the_floor_and_learning_checks():
    histories = synthetic(lambda k: 0.0)
    for seed in SEEDS:  # k = 1: a warm start at the floor, and no learning
        for arm in ("outcome", "process"):
            histories[arm, 1, seed] = [{"step": 0, "eval_accuracy": 0.02},
                                       {"step": 4, "eval_accuracy": 0.02}]  # fmt: skip
    histories["outcome", 2, 0] = history(0.1)  # k = 2: one seed lost what the others gained
    records, _ = credit_gain_summary(histories, 0.05, **TOY)
    assert records["credit_warm_start_min"] == pytest.approx(0.02)
    assert records["credit_initial_accuracy"]["2"] == INITIAL
    assert records["credit_outcome_learned_count"] == 2  # k = 3 and 4
    assert records["credit_outcome_gain"]["1"] == {"n": 3, "mean": 0.0, "low": 0.0, "high": 0.0}
    assert (
        records["credit_outcome_gain"]["2"]["low"] < 0 < records["credit_outcome_gain"]["2"]["mean"]
    )
    histories = {key: h for key, h in histories.items() if key[1] == 1 or key[1] == 2}
    histories.update(
        {
            (arm, 2, seed): histories[arm, 1, seed]
            for arm in ("outcome", "process")
            for seed in SEEDS
        }
    )
    records, _ = credit_gain_summary(histories, 0.05, **TOY)  # nobody learned anything
    assert records["predicted_credit_gain_slope"] is None
    assert records["predicted_credit_gain_slope_how"].startswith("none: ")
    assert records["credit_prediction"] == "can neither support nor contradict the predicted effect"


def test_the_predicted_slope():
    assert predicted_gain_slope(3.0, 2, 0.02) == pytest.approx(0.03)
    assert predicted_gain_slope(3.0, 2, 0.0) is None  # no learning: nothing to scale
    assert predicted_gain_slope(3.0, 2, -0.01) is None


def test_the_warm_start_saw_two_and_three_step_stories_only():
    assert warm_start_step_counts() == [2, 3]


def test_steps_to_target_says_when_a_target_is_never_reached():
    assert steps_to_target(history(0.3, middle=0.26), 0.25) == 2
    assert steps_to_target(history(0.3), 0.25) == 4
    assert steps_to_target(history(0.22), 0.25) is None
    assert steps_to_target(history(0.1), 0.2) == 0  # the warm start is already there
    histories = synthetic(lambda k: 0.05 * k)
    for seed in SEEDS:  # the process arm reaches 0.25 at step 2 for k = 1, never at k = 2
        histories["process", 1, seed] = history(0.3, middle=0.26)
        histories["process", 2, seed] = history(0.22)
    records, table = credit_gain_summary(histories, 0.05, **TOY)
    reached = records["credit_steps_to_target"]
    assert reached["process"]["1"] == {"mean_steps": 2.0, "reached": 3}
    assert reached["process"]["2"] == {"mean_steps": None, "reached": 0}
    assert reached["outcome"]["2"] == {"mean_steps": 4.0, "reached": 3}
    assert np.isnan(table.loc[2, "process: steps to target"])
    assert table.loc[2, "process: seeds at target"] == 0


def test_the_summary_needs_two_k_and_two_seeds():
    histories = {key: value for key, value in synthetic(lambda k: 0.0).items() if key[2] == 0}
    with pytest.raises(ValueError, match="two k and two seeds"):
        credit_gain_summary(histories, 0.05, **TOY)


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
    # one process, so that the loads are counted here (workers fork their own copies)
    arms = ("outcome", "process")
    histories = run_credit_comparison(fresh, tokenizer, [1, 2], [0, 1], config, 4, 2, workers=1,
                                      arms=arms)  # fmt: skip
    assert sorted(histories) == sorted(
        (arm, k, seed) for arm in arms for k in (1, 2) for seed in (0, 1)
    )
    assert len(loads) == 8 + 1  # a fresh copy for every run, and one for the evaluations
    for k in (1, 2):
        for seed in (0, 1):
            pair = [histories[arm, k, seed] for arm in arms]
            assert [len(h) for h in pair] == [3, 3]
            # Same warm start and held-out problems; same prompts and rollouts at step 1.
            assert pair[0][0] == pair[1][0]
            assert pair[0][1]["num_tokens"] == pair[1][1]["num_tokens"]
    records, table = credit_gain_summary(histories, 0.05, **TOY)
    assert records["credit_step_counts"] == [1, 2] and len(table) == 2
    lines = warm_start_worked_lines(model, tokenizer, [1, 2], 2, config)
    assert sorted(lines) == ["1", "2"] and all(v >= 0 for v in lines.values())
    fig = plot_credit_gain(records, num_eval_prompts=2)
    assert len(fig.axes) == 2
    plt.close(fig)


def test_the_figure_draws_the_summary():
    records, _ = credit_gain_summary(synthetic(lambda k: 0.05 * k), 0.05, **TOY)
    fig = plot_credit_gain(records, num_eval_prompts=50)
    left, right = fig.axes
    np.testing.assert_allclose(right.lines[0].get_ydata(), [0.05, 0.1, 0.15, 0.2])  # the gains
    (fit,) = [line for line in right.lines if line.get_label().startswith("fitted slope")]
    np.testing.assert_allclose(fit.get_ydata(), [0.05, 0.1, 0.15, 0.2])
    np.testing.assert_allclose(left.lines[0].get_ydata(), [INITIAL] * 4)  # the warm start
    (predicted,) = [line for line in right.lines if line.get_label().startswith("predicted")]
    np.testing.assert_allclose(
        predicted.get_ydata(), 0.125 + 0.01 * np.array([-1.5, -0.5, 0.5, 1.5])
    )
    plt.close(fig)


def test_the_placebo_and_per_step_arms_are_read_against_outcome_and_process():
    histories = synthetic(lambda k: 0.05 * k)
    for (arm, k, seed), h in list(histories.items()):
        if arm == "process":  # the placebo gains half of process; per-step all of it
            histories["process_placebo", k, seed] = history(0.3 + 0.025 * k)
            histories["process_per_step", k, seed] = h
    records, table = credit_gain_summary(histories, 0.05, **TOY)
    assert records["credit_process_placebo_gain_slope"] == pytest.approx(0.025)
    assert records["credit_process_per_step_gain_slope"] == pytest.approx(0.05)
    assert records["credit_information_slope"] == pytest.approx(0.025)  # process - placebo
    assert "process_placebo: final" in table.columns
    fig = plot_credit_gain(records, num_eval_prompts=50)
    assert len(fig.axes[1].lines) >= 5
    plt.close(fig)


def test_runs_take_each_arms_rate_and_add_sampled_accuracy(random_tiny):
    model, tokenizer = random_tiny
    config = GRPOConfig(
        num_generations=2, per_step_prompts=2, max_completion_length=6, learning_rate=1e-2,
        max_steps=1, eval_every=1, micro_batch_size=8, rollout_batch_size=8,
    )  # fmt: skip
    arms = ("outcome", "process_placebo")
    histories = run_credit_comparison(
        lambda: copy.deepcopy(model), tokenizer, [2], [0], config, 4, 2, arms=arms,
        learning_rates={"outcome": 1e-2, "process_placebo": 0.0 + 1e-9}, eval_samples=2,
        workers=1,
    )  # fmt: skip
    for arm in arms:
        first, last = histories[arm, 2, 0][0], histories[arm, 2, 0][-1]
        assert 0 <= first["sampled_accuracy"] <= 1 and 0 <= last["sampled_accuracy"] <= 1
    assert histories["outcome", 2, 0][0] == histories["process_placebo", 2, 0][0]


def test_validation_chains_avoid_the_comparisons_test_problems():
    from grpo_companion.chapters.credit.training import validation_chains
    from grpo_companion.lm.gsm8k import load_arithmetic_chains

    test = {k: load_arithmetic_chains("test", k, 20, seed=0) for k in (2, 3)}
    validation = validation_chains([2, 3], 10, 0, test)
    for k in (2, 3):
        assert len(validation[k]) == 10
        assert not set(validation[k]["question"]) & set(test[k]["question"])


def test_tuning_takes_each_arms_best_rate(monkeypatch):
    from grpo_companion.chapters.credit import training

    best = {"outcome": 3e-5, "process": 1e-4}

    def fake(loader, tokenizer, step_counts, seeds, config, num_train, num_eval, *, arms,
             learning_rates, eval_data, eval_samples, data_seed, workers, keep):  # fmt: skip
        return {
            (arm, k, seed): [{"sampled_accuracy": 0.1},
                             {"sampled_accuracy": 0.5 - abs(np.log10(learning_rates[arm])
                                                            - np.log10(best[arm]))}]
            for arm in arms for k in step_counts for seed in seeds
        }  # fmt: skip

    monkeypatch.setattr(training, "run_credit_comparison", fake)
    choice, runs = training.tune_credit_rates(
        None, None, ["outcome", "process"], [1e-5, 3e-5, 1e-4], [3], [1000], None, 4,
        {3: ["problem"] * 100}, eval_samples=2, data_seed=0,
    )  # fmt: skip
    assert len(runs) == 2 * 3
    with pytest.raises(ValueError, match=r"no validation problems for k = \[2\]"):
        training.tune_credit_rates(None, None, ["outcome"], [1e-5], [2], [1000], None, 4, {3: "v"},
                                   eval_samples=2, data_seed=0)  # fmt: skip
    assert choice["outcome"]["learning_rate"] == 3e-5 and choice["outcome"]["inside"]
    assert choice["process"]["learning_rate"] == 1e-4 and not choice["process"]["inside"]
    # 0.5 against 0.1, beyond two standard errors of 0.1 on 100 problems (0.06)
    assert choice["outcome"]["learned"] and choice["process"]["learned"]
    records = training.tuning_records(choice)
    assert records["credit_outcome_tune_learned"] == records["credit_process_tune_learned"] == 1
    flat = {arm: {**chosen, "learned": False} for arm, chosen in choice.items()}
    assert training.tuning_records(flat)["credit_outcome_tune_learned"] == 0
    unmeasured = {arm: {**chosen, "learned": None} for arm, chosen in choice.items()}
    assert training.tuning_records(unmeasured)["credit_outcome_tune_learned"] is None
