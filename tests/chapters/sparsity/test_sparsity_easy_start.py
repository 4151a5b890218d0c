"""Chapter 6's easy start: the selection keeps only prompts in range and samples apart from the
runs' probes, the estimand and its interval on hand-built probes, the seeds for power."""

import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pytest
from scipy import stats

from grpo_companion.chapters.sparsity import easy_start as es
from grpo_companion.chapters.sparsity.dynamics import (
    predicted_degenerate,
    probe_outcomes,
    probe_seed,
)
from grpo_companion.chapters.sparsity.plots import plot_easy_start
from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.gsm8k import build_prompts, load_gsm8k
from grpo_companion.lm.trainer import rollout_seed


def test_selection_keeps_the_first_candidates_in_range_and_only_them():
    correct = np.array([16, 8, 3, 15, 12, 16, 9, 0, 11])  # of K = 16
    chosen = es.select_in_range(correct, 16, 0.5, 0.95, 4)
    assert chosen.tolist() == [1, 3, 4, 6]  # 8/16 = 0.5 and 15/16 = 0.9375 in; 16/16 out
    rates = correct[chosen] / 16
    assert rates.min() >= 0.5 and rates.max() <= 0.95
    with pytest.raises(ValueError, match="only 5 candidates"):
        es.select_in_range(correct, 16, 0.5, 0.95, 6)


def test_the_selection_probe_samples_apart_from_every_run_probe_and_rollout():
    selection = {es.selection_seed(seed) for seed in range(20)}
    assert len(selection) == 20
    runs = {probe_seed(seed, step) for seed in range(20) for step in range(0, 81)}
    runs |= {rollout_seed(seed, step) for seed in range(20) for step in range(0, 81)}
    assert selection.isdisjoint(runs)


def has_digit(completion: str, gold: str) -> float:
    return float(any(character.isdigit() for character in completion))


def test_easy_problems_are_the_candidates_whose_selection_rate_is_in_range(random_tiny):
    model, tokenizer = random_tiny
    config = GRPOConfig(num_generations=2, max_completion_length=4, rollout_batch_size=32)
    kwargs = {"num_candidates": 12, "num_samples": 8, "seed": 3, "reward_fn": has_digit}
    candidates = load_gsm8k("train", source="arithmetic", num_examples=12, seed=3)
    prompts, golds = build_prompts(tokenizer, candidates)
    outcomes = probe_outcomes(model, tokenizer, prompts, golds, config, 8, es.selection_seed(3),
                              has_digit)  # fmt: skip
    rates = np.array([sum(row) for row in outcomes]) / 8
    low, high = np.quantile(rates, [0.25, 0.75])  # a range that some candidates miss
    inside = np.flatnonzero((rates >= low) & (rates <= high))
    assert 2 <= len(inside) < 12
    problems, records = es.easy_problems(
        model, tokenizer, config, pass_range=(low, high), num_prompts=2, **kwargs
    )
    assert list(problems["question"]) == [candidates["question"][i] for i in inside[:2]]
    assert records["in_range"] == len(inside)
    assert records["selected_pass_rate"] == pytest.approx(rates[inside[:2]].mean())
    assert records["candidate_pass_rate"] == pytest.approx(rates.mean())
    # The runs' step-0 probe of the same prompts draws other samples.
    step_zero = probe_outcomes(model, tokenizer, prompts, golds, config, 8, probe_seed(3, 0),
                               has_digit)  # fmt: skip
    assert step_zero != outcomes


def _probe(counts, num_samples=8, group_size=4, step=0):
    outcomes = [[1] * k + [0] * (num_samples - k) for k in counts]
    return {"step": step, "correct": list(counts), "outcomes": outcomes,
            **predicted_degenerate(counts, num_samples, group_size)}  # fmt: skip


def _history(first, last):
    return [{"step": 0, "eval_accuracy": first}, {"step": 40, "eval_accuracy": last}]


# K = 8, G = 4, C(8, 4) = 70: a prompt with k correct is all-correct in C(k, 4) / 70 of the
# 4-subsets of its samples and all-wrong in C(8 - k, 4) / 70.
RUNS = {
    0: ([4, 8, 6], [8, 8, 7]),  # D: (2 + 70 + 15) / 210 -> (70 + 70 + 35) / 210
    1: ([5, 7, 6], [7, 8, 8]),  # D: (5 + 35 + 15) / 210 -> (35 + 70 + 70) / 210
    2: ([6, 6, 6], [6, 7, 8]),  # D: (15 + 15 + 15) / 210 -> (15 + 35 + 70) / 210
}
CHANGES = [88 / 210, 120 / 210, 75 / 210]


def _runs():
    return {seed: (_history(0.4, 0.4 + seed / 100), [_probe(first), _probe(last, step=40)])
            for seed, (first, last) in RUNS.items()}  # fmt: skip


def test_the_change_of_d_is_the_unbiased_estimate_per_seed_with_a_t_interval():
    table = es.run_changes(_runs())
    np.testing.assert_allclose(table["degenerate_change"], CHANGES)
    np.testing.assert_allclose(table["pass_rate_change"], [5 / 24, 5 / 24, 3 / 24])
    np.testing.assert_allclose(table["eval_accuracy_change"], [0.0, 0.01, 0.02])
    records = es.easy_summary(table, "easy")
    mean, sd = np.mean(CHANGES), np.std(CHANGES, ddof=1)
    half = stats.t.ppf(0.975, 2) * sd / math.sqrt(3)
    assert records["easy_degenerate_change"] == pytest.approx(mean)
    assert records["easy_degenerate_change_low"] == pytest.approx(mean - half)
    assert records["easy_degenerate_change_high"] == pytest.approx(mean + half)
    assert records["easy_degenerate_change_sd"] == pytest.approx(sd)
    assert records["easy_degenerate_first"] == pytest.approx((87 + 55 + 45) / 630)
    assert records["easy_all_wrong_first"] == pytest.approx((1 / 70) / 3 / 3)  # prompt k = 4
    assert (records["easy_seeds"], records["easy_df"]) == (3, 2)
    assert records["easy_pass_rate_change"] == pytest.approx(13 / 72)


def test_the_prediction_pools_the_step_zero_probes_and_aims_at_the_last_pass_rate():
    probes = {seed: runs[1] for seed, runs in _runs().items()}
    counts, samples = es.step_zero_counts(probes)
    assert counts.tolist() == [15, 21, 18] and samples == 24
    prediction = es.easy_prediction(probes, 4, [0.0, 0.5, 1.0], num_prompts=200,
                                    step_size=0.05, max_steps=10_000)  # fmt: skip
    assert prediction["target"] == pytest.approx(np.mean([23 / 24, 23 / 24, 21 / 24]))
    values = [fit["degenerate"] for fit in prediction["by_sharing"].values()]
    assert prediction["degenerate"] == min(values, key=abs) > 0  # started above 1/2: D rises


def test_seeds_for_power_against_a_hand_computation():
    # SD of (0.1, 0.2, 0.3) is 0.1; ((1.959964 + 0.841621) * 0.1 / 0.15)^2 = 3.488: 4 seeds.
    plan = es.power_plan([0.1, 0.2, 0.3], 0.15, 3)
    assert plan["sd"] == pytest.approx(0.1)
    assert plan["needed"] == 4 and plan["run"] == 3 and plan["cut"] == 1
    assert es.power_plan([0.1, 0.2, 0.3], 0.6, 8) == {"sd": pytest.approx(0.1), "needed": 2,
                                                        "run": 8, "cut": 0}  # fmt: skip
    assert es.power_plan([0.1], 0.15, 8)["needed"] == 0  # no SD from one seed


def test_the_figure_draws_every_seed_and_the_prediction():
    table = es.run_changes(_runs())
    fig = plot_easy_start(table, 0.3, 40)
    rates, degenerate = fig.axes
    assert len(rates.lines) == 3 + 1 and len(degenerate.lines) == 3 + 1 + 1
    np.testing.assert_allclose(degenerate.lines[0].get_ydata(), [87 / 210, 175 / 210])
    start = table["degenerate_first"].mean()
    np.testing.assert_allclose(degenerate.lines[-1].get_ydata(), [start, start + 0.3])
    plt.close(fig)


def test_validation_problems_are_training_split_problems_the_training_set_does_not_hold():
    from grpo_companion.chapters.sparsity.easy_start import validation_problems
    from grpo_companion.lm.gsm8k import load_gsm8k

    candidates = load_gsm8k("train", source="arithmetic", num_examples=10, seed=3)
    train = candidates.select([1, 4, 7])
    validation = validation_problems(train, skip=10, num_prompts=5, seed=3)
    assert len(validation) == 5
    assert not set(validation["question"]) & set(candidates["question"])
    with pytest.raises(ValueError, match="overlap"):
        validation_problems(train, skip=0, num_prompts=5, seed=3)
