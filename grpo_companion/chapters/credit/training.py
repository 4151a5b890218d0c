r"""Chapter 5, section 5: step-level against outcome credit, by training the tiny Llama.

`run_credit_comparison` trains arms (``GRPOConfig.credit``) from the same warm start on problems
of k steps (``gsm8k.load_arithmetic_chains``): "outcome", "process" (DeepSeekMath's process
supervision, ``advantages.process_advantages``) and its two controls, "process_placebo" (the
worked steps' labels shuffled within each group) and "process_per_step" (divided by the number
of steps). The arms of a seed share prompts, their order, sampler seeds and held-out problems,
so their differences are paired. `tune_credit_rates` gives each arm its own learning rate on
`validation_chains`; `evaluation.sampled_held_out_accuracy` is the measure.

`credit_gain_summary` reads the histories: per k each arm's final accuracy, the paired gains
over outcome with t-intervals over seeds, their slope against k (the arm x k interaction) read
against `predicted_gain_slope`, and the power of that reading. `warm_start_step_counts` and
`warm_start_worked_lines` say where the warm start can and cannot answer.

Chapter: :doc:`/book/05_credit` (section 5: the process rule and what it adds besides credit).
"""

from collections.abc import Callable, Iterable
from dataclasses import replace

import numpy as np
import pandas as pd

from grpo_companion.core.stats import (
    accuracy_noise,
    choice_records,
    fitted_trend,
    grid_choice,
    interval_words,
    mean_interval,
    seeds_for_power,
)
from grpo_companion.lm import gsm8k
from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.evaluation import held_out_accuracy, sampled_held_out_accuracy
from grpo_companion.lm.gsm8k import build_prompts, load_arithmetic_chains
from grpo_companion.lm.parallel import map_runs, run_store
from grpo_companion.lm.rollouts import greedy_completions
from grpo_companion.lm.steps import worked_lines
from grpo_companion.lm.trainer import train

ARMS = ("outcome", "process", "process_placebo", "process_per_step")  # GRPOConfig.credit
ARM_LABELS = {"outcome": "outcome credit", "process": "step-level credit",
              "process_placebo": "placebo step labels",
              "process_per_step": "step-level credit / steps"}  # fmt: skip


def run_credit_comparison(
    model_loader: Callable[[], object],
    tokenizer,
    step_counts: Iterable[int],
    seeds: Iterable[int],
    config: GRPOConfig,
    num_train_prompts: int,
    num_eval_prompts: int,
    *,
    arms: Iterable[str] = ARMS,
    learning_rates: dict[str, float] | None = None,
    eval_data: dict | None = None,
    eval_samples: int = 0,
    data_seed: int = 0,
    workers: int | None = None,
    progress: bool = False,
    keep: str | None = None,
) -> dict[tuple[str, int, int], list[dict]]:
    """Train every arm (a ``GRPOConfig.credit``) for every number of steps k and seed.

    Args:
        model_loader: returns a fresh copy of the warm-started model, e.g.
            ``lambda: load_tiny_llama(spec, progress=False)[0]``; called once per run.
        tokenizer: the model's tokenizer.
        step_counts: the k of the problems (``load_arithmetic_chains``' num_steps).
        seeds: one run per arm and seed; ``config.seed`` is replaced by it, so the two arms
            of a seed see the same prompts in the same order and sample with the same seeds.
        config: the GRPO settings of every arm; its ``credit`` is replaced by the arm.
        num_train_prompts, num_eval_prompts: problems per k, the same for every seed
            (generated with `data_seed`); the eval problems are the test split's unless
            `eval_data` ({k: problems}, e.g. `validation_chains`) gives others.
        arms: the credits to train; learning_rates: arm -> its learning rate (default config's).
        eval_samples: K > 0 adds each run's sampled accuracy after training
            (`evaluation.sampled_held_out_accuracy`, K completions per problem) to its last record,
            and the warm start's to its first, as "sampled_accuracy".
        workers: one-thread worker processes for the runs (`lm.parallel.map_runs`; None: one
            per core, 1: in this process); the histories do not depend on it.
        keep: a folder under which finished runs are stored and read back on the next call
            (`lm.parallel.run_store`, named by every input here and the starting weights).

    Returns:
        histories: (arm, k, seed) -> `trainer.train` history.
    """
    step_counts, seeds, arms = list(step_counts), list(seeds), list(arms)
    rates = learning_rates or {}
    data = {
        k: (
            load_arithmetic_chains("train", k, num_train_prompts, seed=data_seed),
            (eval_data or {}).get(k)
            or load_arithmetic_chains("test", k, num_eval_prompts, seed=data_seed),
        )
        for k in step_counts
    }
    # Every run at one k starts from the same model: one evaluation each.
    start = model_loader()
    before = {k: held_out_accuracy(start, tokenizer, data[k][1], config) for k in data}
    sampled = {k: sampled_held_out_accuracy(start, tokenizer, data[k][1], config, eval_samples,
                                            data_seed)
               for k in data} if eval_samples else {}  # fmt: skip

    def run(key):
        arm, k, seed = key
        settings = replace(config, credit=arm, seed=seed,
                           learning_rate=rates.get(arm, config.learning_rate))  # fmt: skip
        model = model_loader()
        history = train(model, tokenizer, *data[k], settings, progress=False,
                        initial_accuracy=before[k])  # fmt: skip
        if eval_samples:
            history[0]["sampled_accuracy"] = sampled[k]
            history[-1]["sampled_accuracy"] = sampled_held_out_accuracy(
                model, tokenizer, data[k][1], settings, eval_samples, data_seed)  # fmt: skip
        return history

    runs = [(arm, k, seed) for k in step_counts for seed in seeds for arm in arms]
    store = None
    if keep is not None:
        store = run_store(keep, config, runs, rates, *[d for k in data for d in data[k]],
                          eval_samples, data_seed, start)  # fmt: skip
    return map_runs(run, runs, workers=workers, desc="credit runs", progress=progress,
                    keep=store)  # fmt: skip


def validation_chains(step_counts, num_problems: int, seed: int, exclude: dict) -> dict:
    """{k: `num_problems` test-split chains of k steps drawn with another seed, none of them in
    `exclude[k]` (the comparison's test problems)}: problems neither the warm start (trained on
    the training split) nor any run trains on, and the comparison does not evaluate on."""
    chosen = {}
    for k in step_counts:
        held = set(exclude[k]["question"])
        pool = load_arithmetic_chains("test", k, 2 * num_problems + len(held), seed=seed + 1)
        rows = [i for i, question in enumerate(pool["question"]) if question not in held]
        chosen[k] = pool.select(rows[:num_problems])
    return chosen


def tune_credit_rates(model_loader, tokenizer, arms, grid, step_counts, seeds, config,
                      num_train_prompts: int, validation: dict, *, eval_samples: int,
                      data_seed: int, workers=None, keep=None) -> tuple[dict, dict]:  # fmt: skip
    """Each arm's learning rate: every arm at every rate of `grid` (ascending) on the tuning
    `seeds` and `step_counts`, measured by sampled accuracy on `validation` ({k: problems});
    the rate with the best mean final accuracy (`core.stats.grid_choice`; "learned" when it beats
    the warm start's by more than `core.stats.accuracy_noise` over the validation problems).
    Returns (arm -> {"learning_rate", "index", "inside", "means", "learned"}, the tuning
    histories by (arm, rate, k, seed))."""
    missing = [k for k in step_counts if k not in validation]
    if missing:
        raise ValueError(
            f"no validation problems for k = {missing}: tune at k in {list(validation)}"
        )
    runs = {}
    for rate in grid:
        histories = run_credit_comparison(
            model_loader, tokenizer, step_counts, seeds, config, num_train_prompts, 1,
            arms=arms, learning_rates=dict.fromkeys(arms, rate), eval_data=validation,
            eval_samples=eval_samples, data_seed=data_seed, workers=workers, keep=keep,
        )  # fmt: skip
        runs |= {(arm, rate, k, seed): h for (arm, k, seed), h in histories.items()}
    choice = {}
    for arm in arms:
        means = [float(np.mean([h[-1]["sampled_accuracy"] for (a, r, _, _), h in runs.items()
                                if a == arm and r == rate])) for rate in grid]  # fmt: skip
        start = float(np.mean([h[0]["sampled_accuracy"] for (a, _, _, _), h in runs.items()
                               if a == arm]))  # fmt: skip
        num_problems = sum(len(validation[k]) for k in step_counts)
        choice[arm] = grid_choice(list(grid), means, start=start,
                                  margin=accuracy_noise(start, num_problems))  # fmt: skip
    return choice, runs


def tuning_records(choice: dict) -> dict:
    """`tune_credit_rates`' choice as records: "credit_<arm>_learning_rate",
    "credit_<arm>_lr_inside", "credit_<arm>_tune_learned" (1 when its best rate beat the warm
    start on the validation chains by more than two binomial standard errors over the problems,
    None when unmeasured) and "credit_lr_inside", 1 when every arm's best rate lies
    strictly inside the grid."""
    return choice_records(choice, "credit_", "credit_lr_inside")


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
    histories: dict, target_gain: float, variance_ratio: float, toy_steps: int,
    metric: str = "eval_accuracy",
) -> tuple[dict, pd.DataFrame]:  # fmt: skip
    """What the runs of `run_credit_comparison` say about the prediction.

    Args:
        histories: (arm, k, seed) -> history, both arms for every k and seed, at least two k
            and two seeds.
        target_gain: the target accuracy of a k is the warm start's accuracy there plus this.
        variance_ratio, toy_steps: section 2's exact variance ratio and the number of result
            positions of its toy, for `predicted_gain_slope`.
        metric: the accuracy read from each history's first and last records: "eval_accuracy"
            (greedy) or "sampled_accuracy" (`run_credit_comparison`'s eval_samples).

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
        many did). For every other arm m of the runs (the placebo, per step):
        "credit_<m>_gain" per k and "credit_<m>_gain_slope" with "_low", "_high", the same
        paired reading against the outcome arm; with the placebo, "credit_information_slope"
        (+ "_low", "_high"), the slope of process minus placebo: what the step labels' information
        adds at the same density and scale.
        table: one row per k, the same numbers as columns.
    """
    last = lambda history: history[-1][metric]  # noqa: E731
    arms = [arm for arm in ARMS if any(key[0] == arm for key in histories)]
    step_counts, seeds, outcome = _grid(histories, "outcome", last)
    if len(step_counts) < 2 or len(seeds) < 2:
        raise ValueError(f"need two k and two seeds, got k {step_counts} and seeds {seeds}")
    finals = {arm: _grid(histories, arm, last)[2] for arm in arms}
    process = finals["process"]
    initial = {
        k: histories["outcome", k, seeds[0]][0][metric] for k in step_counts
    }  # step 0: the same warm start and problems for every run of k
    gains = process - outcome  # (num_seeds, num_k), paired by seed
    final = {
        arm: {str(k): mean_interval(values[:, j]) for j, k in enumerate(step_counts)}
        for arm, values in finals.items()
    }
    gain = {str(k): mean_interval(gains[:, j]) for j, k in enumerate(step_counts)}
    learned = outcome - np.array([initial[k] for k in step_counts])  # (num_seeds, num_k)
    outcome_gain = {str(k): mean_interval(learned[:, j]) for j, k in enumerate(step_counts)}
    trend = fitted_trend(step_counts, gains)
    slope = {key: trend[key] for key in ("mean", "low", "high")}
    mean_outcome_gain = float(learned.mean())
    predicted = predicted_gain_slope(variance_ratio, toy_steps, mean_outcome_gain)
    reached = {}
    for arm in arms:
        reached[arm] = {}
        for k in step_counts:
            steps = [steps_to_target(histories[arm, k, s],  # greedy, measured every eval_every
                                     histories[arm, k, s][0]["eval_accuracy"] + target_gain)
                     for s in seeds]  # fmt: skip
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
        "credit_metric": metric,
        **_power(step_counts, gains, predicted),
    }
    for arm in [arm for arm in ARMS if arm not in arms]:  # an arm not run: nothing measured
        records[f"credit_{arm}_gain"] = None
        records |= {f"credit_{arm}_gain_slope{suffix}": None for suffix in ("", "_low", "_high")}
    records |= {f"credit_information_slope{suffix}": None for suffix in ("", "_low", "_high")}
    for arm in [arm for arm in arms if arm not in ("outcome", "process")]:
        paired = finals[arm] - outcome
        records[f"credit_{arm}_gain"] = {
            str(k): mean_interval(paired[:, j]) for j, k in enumerate(step_counts)
        }
        trend = fitted_trend(step_counts, paired)
        for key, suffix in (("mean", ""), ("low", "_low"), ("high", "_high")):
            records[f"credit_{arm}_gain_slope{suffix}"] = trend[key]
    if "process_placebo" in finals:
        trend = fitted_trend(step_counts, process - finals["process_placebo"])
        for key, suffix in (("mean", ""), ("low", "_low"), ("high", "_high")):
            records[f"credit_information_slope{suffix}"] = trend[key]
    table = _table(step_counts, initial, final, outcome_gain, gain, reached, arms)
    return records, table


def _power(step_counts, gains, predicted) -> dict:
    """Power for the slope: each seed's own fitted slope of its paired gains over k, their SD
    ("credit_slope_sd"), the seeds a two-sided 5% test needs for 80% power at the predicted
    slope ("credit_seeds_needed", `core.stats.seeds_for_power`; None when there is no
    prediction or no spread), the seeds run and the sentence ("credit_power_words")."""
    per_seed = np.polyfit(np.asarray(step_counts, dtype=float), gains.T, 1)[0]
    sd = float(np.std(per_seed, ddof=1))
    sizable = predicted is not None and predicted != 0 and np.isfinite(sd) and sd > 1e-12
    needed = seeds_for_power(sd, predicted) if sizable else None
    words = (
        f"{needed} seeds for 80% power at the predicted slope, against the {len(per_seed)} run"
        if needed
        else "no number of seeds: "
        + ("there is no predicted slope" if not predicted else "the slopes have no spread")
    )
    return {"credit_slope_sd": sd, "credit_seeds_needed": needed,
            "credit_seeds_run": len(per_seed), "credit_power_words": words}  # fmt: skip


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


def _table(step_counts, initial, final, outcome_gain, gain, reached, arms) -> pd.DataFrame:
    rows = []
    for k in map(str, step_counts):
        row = {"k (steps)": int(k), "warm start": initial[int(k)]}
        for arm in arms:
            row[f"{arm}: final"] = final[arm][k]["mean"]
        for key in ("mean", "low"):
            row[f"outcome gain: {key}"] = outcome_gain[k][key]
        for key in ("mean", "low", "high"):
            row[f"gain: {key}"] = gain[k][key]
        for arm in arms:
            target = reached[arm][k]
            # NaN: no seed of this arm reached the target within the run.
            steps = target["mean_steps"]
            row[f"{arm}: steps to target"] = np.nan if steps is None else steps
            row[f"{arm}: seeds at target"] = target["reached"]
        rows.append(row)
    return pd.DataFrame(rows).set_index("k (steps)")
