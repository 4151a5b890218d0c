r"""Chapter 5, section 5: step-level against outcome credit, by training the tiny Llama.

The paper's claim that credit assignment is the bottleneck for multi-step reasoning predicts an
intervention: give GRPO a signal per step instead of one per completion, and the held-out
accuracy should gain more the more steps a problem takes. `run_credit_comparison` trains two
arms from the same warm start on problems of k = 1, 2, ... steps
(``gsm8k.load_arithmetic_chains``): "outcome", GRPO as in `trainer.train`, and "process",
``GRPOConfig(credit="process")``, DeepSeekMath's process supervision
(``advantages.process_advantages``). Both arms of a seed share everything else (configuration,
prompt order, sampler seeds, held-out problems), so their difference is paired.

`credit_gain_summary` reads the histories: per k each arm's final held-out accuracy, the paired
gain with t-intervals over seeds, the slope of the gain against k (`stats.fitted_trend`) read
against `predicted_gain_slope` (from section 2's exact toy), and the steps each arm took to a
target accuracy. `warm_start_step_counts` and `warm_start_worked_lines` say why the warm start
fails at some k.

Chapter: :doc:`/book/05_credit` (section 5: the process rule and what it adds besides credit).
"""

from collections.abc import Callable, Iterable
from dataclasses import replace

import numpy as np
import pandas as pd

from grpo_companion.core.stats import fitted_trend, interval_words, mean_interval
from grpo_companion.lm import gsm8k
from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.gsm8k import build_prompts, load_arithmetic_chains
from grpo_companion.lm.parallel import map_runs
from grpo_companion.lm.rollouts import greedy_completions
from grpo_companion.lm.steps import worked_lines
from grpo_companion.lm.trainer import held_out_accuracy, train

ARMS = ("outcome", "process")
ARM_LABELS = {"outcome": "outcome credit", "process": "step-level credit"}


def run_credit_comparison(
    model_loader: Callable[[], object],
    tokenizer,
    step_counts: Iterable[int],
    seeds: Iterable[int],
    config: GRPOConfig,
    num_train_prompts: int,
    num_eval_prompts: int,
    *,
    data_seed: int = 0,
    workers: int | None = None,
    progress: bool = False,
) -> dict[tuple[str, int, int], list[dict]]:
    """Train the outcome and the process arm for every number of steps k and seed.

    Args:
        model_loader: returns a fresh copy of the warm-started model, e.g.
            ``lambda: load_tiny_llama(spec, progress=False)[0]``; called once per run.
        tokenizer: the model's tokenizer.
        step_counts: the k of the problems (``load_arithmetic_chains``' num_steps).
        seeds: one run per arm and seed; ``config.seed`` is replaced by it, so the two arms
            of a seed see the same prompts in the same order and sample with the same seeds.
        config: the GRPO settings of both arms; its ``credit`` is replaced by the arm.
        num_train_prompts, num_eval_prompts: problems per k, the same for every seed
            (generated with `data_seed`); the eval problems are the test split's.
        workers: one-thread worker processes for the runs (`lm.parallel.map_runs`; None: one
            per core, 1: in this process); the histories do not depend on it.

    Returns:
        histories: (arm, k, seed) -> `trainer.train` history.
    """
    step_counts, seeds = list(step_counts), list(seeds)
    data = {
        k: (
            load_arithmetic_chains("train", k, num_train_prompts, seed=data_seed),
            load_arithmetic_chains("test", k, num_eval_prompts, seed=data_seed),
        )
        for k in step_counts
    }
    # Every run at one k starts from the same model: one greedy evaluation each.
    before = {k: held_out_accuracy(model_loader(), tokenizer, data[k][1], config) for k in data}

    def run(key):
        arm, k, seed = key
        return train(
            model_loader(), tokenizer, *data[k], replace(config, credit=arm, seed=seed),
            progress=False, initial_accuracy=before[k],
        )  # fmt: skip

    runs = [(arm, k, seed) for k in step_counts for seed in seeds for arm in ARMS]
    return map_runs(run, runs, workers=workers, desc="credit runs", progress=progress)


def warm_start_step_counts() -> list[int]:
    """The numbers of worked lines in the answers of the stories the tiny Llama was warm-started
    on (``gsm8k._TEMPLATES``, the "arithmetic" source): one line per operation of a template."""
    return sorted({len(ops) // 2 for ops in gsm8k._TEMPLATES})


def warm_start_worked_lines(
    model, tokenizer, step_counts: Iterable[int], num_problems: int, config: GRPOConfig, *,
    data_seed: int = 0,
) -> dict[str, float]:  # fmt: skip
    """Per k, the mean number of worked lines in the model's greedy answers to the first
    `num_problems` held-out problems of k steps (those `run_credit_comparison` evaluates on),
    with ``config.max_completion_length`` tokens: does it write k lines?"""
    counts = {}
    for k in step_counts:
        problems = load_arithmetic_chains("test", k, num_problems, seed=data_seed)
        _, texts = greedy_completions(
            model, tokenizer, *build_prompts(tokenizer, problems),
            max_completion_length=config.max_completion_length,
            batch_size=config.rollout_batch_size,
        )  # fmt: skip
        counts[str(k)] = float(np.mean([len(worked_lines(text)) for text in texts]))
    return counts


def predicted_gain_slope(
    variance_ratio: float, toy_steps: int, outcome_gain: float
) -> float | None:
    """Section 5: the slope of the paired gain against k if step credit did what section 2
    prices. Perfect credit makes a rollout worth R(k) outcome rollouts, R(k) = variance_ratio *
    k / toy_steps (the toy's ratio, grown in proportion to the steps as exercise 1's uniform
    case grows with the positions); with gains proportional to rollouts, the paired gain is
    (R(k) - 1) * outcome_gain, whose slope is variance_ratio / toy_steps * outcome_gain. None
    when the outcome arm gained nothing: no scale to predict from."""
    if not outcome_gain > 0:
        return None
    return variance_ratio / toy_steps * outcome_gain


def _grid(histories: dict, arm: str, metric_of: Callable[[list[dict]], float]):
    """(step_counts, seeds, values (num_seeds, num_step_counts)) of one arm."""
    step_counts = sorted({k for _, k, _ in histories})
    seeds = sorted({seed for _, _, seed in histories})
    values = [[metric_of(histories[arm, k, seed]) for k in step_counts] for seed in seeds]
    return step_counts, seeds, np.array(values, dtype=float)


def final_accuracy(history: list[dict]) -> float:
    """The held-out accuracy after the last step of a `trainer.train` history."""
    return history[-1]["eval_accuracy"]


def steps_to_target(history: list[dict], target: float) -> int | None:
    """The first step at which the held-out accuracy was measured at or above `target`; None if
    it never was (accuracy is measured every ``eval_every`` steps only)."""
    for record in history:
        if record["eval_accuracy"] is not None and record["eval_accuracy"] >= target:
            return record["step"]
    return None


def credit_gain_summary(
    histories: dict, target_gain: float, variance_ratio: float, toy_steps: int
) -> tuple[dict, pd.DataFrame]:
    """What the runs of `run_credit_comparison` say about the prediction.

    Args:
        histories: (arm, k, seed) -> history, both arms for every k and seed, at least two k
            and two seeds.
        target_gain: the target accuracy of a k is the warm start's accuracy there plus this.
        variance_ratio, toy_steps: section 2's exact variance ratio and the number of result
            positions of its toy, for `predicted_gain_slope`.

    Returns:
        records: "credit_step_counts", "credit_num_seeds", "credit_initial_accuracy" (per k,
        the warm start's held-out accuracy, shared by every run of k) and its minimum
        "credit_warm_start_min", "credit_final_accuracy" (per arm, per k: mean, low, high over
        seeds), "credit_outcome_gain" (per k: the outcome arm's final minus the warm start's
        accuracy, mean, low, high), "credit_outcome_learned_count" (the k whose outcome gain
        has an interval above 0), "credit_outcome_mean_gain" (over k and seeds),
        "credit_gain" (per k: the paired gain process - outcome, mean, low, high),
        "credit_gain_range" (the gains at the smallest and largest k, in words),
        "credit_gain_slope" with "_low" and "_high" (gain per step of k),
        "predicted_credit_gain_slope" and "_how" (`predicted_gain_slope` and how),
        "credit_prediction" (`stats.interval_words` of the slope's interval against the
        prediction: "supports", "contradicts" or "can neither support nor contradict the
        predicted effect"), "credit_target_gain" and "credit_steps_to_target" (per arm, per
        k: the mean over the seeds that reached the target, None where none did, and how
        many did).
        table: one row per k, the same numbers as columns.
    """
    step_counts, seeds, outcome = _grid(histories, "outcome", final_accuracy)
    _, _, process = _grid(histories, "process", final_accuracy)
    if len(step_counts) < 2 or len(seeds) < 2:
        raise ValueError(f"need two k and two seeds, got k {step_counts} and seeds {seeds}")
    initial = {
        k: histories["outcome", k, seeds[0]][0]["eval_accuracy"] for k in step_counts
    }  # step 0: the same warm start and problems for every run of k
    gains = process - outcome  # (num_seeds, num_k), paired by seed
    final = {
        arm: {str(k): mean_interval(values[:, j]) for j, k in enumerate(step_counts)}
        for arm, values in (("outcome", outcome), ("process", process))
    }
    gain = {str(k): mean_interval(gains[:, j]) for j, k in enumerate(step_counts)}
    learned = outcome - np.array([initial[k] for k in step_counts])  # (num_seeds, num_k)
    outcome_gain = {str(k): mean_interval(learned[:, j]) for j, k in enumerate(step_counts)}
    trend = fitted_trend(step_counts, gains)
    slope = {key: trend[key] for key in ("mean", "low", "high")}
    mean_outcome_gain = float(learned.mean())
    predicted = predicted_gain_slope(variance_ratio, toy_steps, mean_outcome_gain)
    reached = {}
    for arm in ARMS:
        reached[arm] = {}
        for k in step_counts:
            steps = [steps_to_target(histories[arm, k, s], initial[k] + target_gain) for s in seeds]
            hit = [step for step in steps if step is not None]
            reached[arm][str(k)] = {
                "mean_steps": float(np.mean(hit)) if hit else None,
                "reached": len(hit),
            }
    first, last = str(step_counts[0]), str(step_counts[-1])
    records = {
        "credit_step_counts": step_counts,
        "credit_num_seeds": len(seeds),
        "credit_initial_accuracy": {str(k): value for k, value in initial.items()},
        "credit_warm_start_min": min(initial.values()),
        "credit_final_accuracy": final,
        "credit_outcome_gain": outcome_gain,
        "credit_outcome_learned_count": sum(
            interval["low"] is not None and interval["low"] > 0
            for interval in outcome_gain.values()
        ),
        "credit_outcome_mean_gain": mean_outcome_gain,
        "credit_gain": gain,
        "credit_gain_range": f"{_interval_text(gain[first])} at {first} step"
        + ("s" if first != "1" else "")
        + f" and {_interval_text(gain[last])} at {last} steps",
        "credit_gain_slope": slope["mean"],
        "credit_gain_slope_low": slope["low"],
        "credit_gain_slope_high": slope["high"],
        "predicted_credit_gain_slope": predicted,
        "predicted_credit_gain_slope_how": _prediction_words(
            predicted, variance_ratio, toy_steps, mean_outcome_gain
        ),
        "credit_prediction": interval_words(
            slope["low"], slope["high"], predicted, supports="supports", contradicts="contradicts"
        ),
        "credit_target_gain": target_gain,
        "credit_steps_to_target": reached,
    }
    return records, _table(step_counts, initial, final, outcome_gain, gain, reached)


def _prediction_words(predicted, variance_ratio, toy_steps, outcome_gain) -> str:
    """How `predicted_gain_slope` was computed, in one sentence with its numbers."""
    if predicted is None:
        return (
            f"none: the outcome arm's mean held-out gain ({outcome_gain:+.3f}) is not above 0, "
            "so there is no scale to predict from"
        )
    return (
        f"{predicted:+.4f} per step, section 2's exact variance ratio per result position "
        f"({variance_ratio:.2f} / {toy_steps}) times the outcome arm's mean held-out gain "
        f"({outcome_gain:+.3f}): the slope if step credit made each rollout worth R(k) outcome "
        "rollouts, R growing in proportion to k, and gains grew in proportion to rollouts"
    )


def _interval_text(interval: dict) -> str:
    """ "+0.031 [-0.012, +0.074]": a mean and its interval, signed."""
    return f"{interval['mean']:+.3f} [{interval['low']:+.3f}, {interval['high']:+.3f}]"


def _table(step_counts, initial, final, outcome_gain, gain, reached) -> pd.DataFrame:
    rows = []
    for k in map(str, step_counts):
        row = {"k (steps)": int(k), "warm start": initial[int(k)]}
        for arm in ARMS:
            row[f"{arm}: final"] = final[arm][k]["mean"]
        for key in ("mean", "low"):
            row[f"outcome gain: {key}"] = outcome_gain[k][key]
        for key in ("mean", "low", "high"):
            row[f"gain: {key}"] = gain[k][key]
        for arm in ARMS:
            target = reached[arm][k]
            # NaN: no seed of this arm reached the target within the run.
            steps = target["mean_steps"]
            row[f"{arm}: steps to target"] = np.nan if steps is None else steps
            row[f"{arm}: seeds at target"] = target["reached"]
        rows.append(row)
    return pd.DataFrame(rows).set_index("k (steps)")
