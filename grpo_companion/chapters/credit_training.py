r"""Chapter 5, section 5: step-level against outcome credit, by training the tiny Llama.

The paper's claim that credit assignment is the bottleneck for multi-step reasoning predicts an
intervention: give GRPO a signal per step instead of one per completion, and the held-out
accuracy should gain more the more steps a problem takes. `run_credit_comparison` trains both
arms from the same warm start on problems of k = 1, 2, ... steps
(``gsm8k.load_arithmetic_chains``):

    outcome   GRPO as in `trainer.train`: one advantage per completion;
    process   ``GRPOConfig(credit="process")``: DeepSeekMath's process supervision, each
              worked step of the reference rewarded where the completion writes it, the
              group's step rewards normalised together, a token's advantage the sum over the
              steps that end at or after it (``steps``, ``advantages.process_advantages``).

Both arms of a seed share everything else: the configuration (so the same number of rollouts),
the training prompts in the same order, the sampler's seeds and the held-out problems, so their
difference is paired. `credit_gain_summary` reads the histories: per k the final held-out
accuracy of each arm and the paired gain with 95% t-intervals over seeds, the slope of the gain
against k (per seed, then a t-interval over seeds: `stats.fitted_trend`), the words that say
what the interval shows, and the training steps each arm took to reach a target accuracy.
"""

from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from grpo_companion.core.stats import fitted_trend, mean_interval
from grpo_companion.lm.gsm8k import load_arithmetic_chains
from grpo_companion.lm.trainer import GRPOConfig, held_out_accuracy, train

ARMS = ("outcome", "process")
ARM_LABELS = {"outcome": "outcome credit", "process": "step-level credit"}


@contextmanager
def _torch_threads(num_threads: int | None):
    """torch's intra-op threads set for a block, then restored; None leaves them alone."""
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


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
    num_threads: int | None = None,
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
        num_threads: torch threads while training (None: as set). On the idle two-core
            machine two threads are 1.7 times faster than one for the tiny Llama (0.76 against
            1.27 s a step, measured 2026-12-04); one was faster only beside other jobs.

    Returns:
        histories: (arm, k, seed) -> `trainer.train` history.
    """
    step_counts, seeds = list(step_counts), list(seeds)
    runs = [(k, seed, arm) for k in step_counts for seed in seeds for arm in ARMS]
    histories, data, before = {}, {}, {}
    with _torch_threads(num_threads):
        for k, seed, arm in tqdm(runs, desc="credit runs", disable=not progress):
            if k not in data:
                data[k] = (
                    load_arithmetic_chains("train", k, num_train_prompts, seed=data_seed),
                    load_arithmetic_chains("test", k, num_eval_prompts, seed=data_seed),
                )
                # Every run at this k starts from the same model: one greedy evaluation.
                before[k] = held_out_accuracy(model_loader(), tokenizer, data[k][1], config)
            run_config = replace(config, credit=arm, seed=seed)
            histories[arm, k, seed] = train(
                model_loader(), tokenizer, *data[k], run_config, progress=False,
                initial_accuracy=before[k],
            )  # fmt: skip
    return histories


def side_of_zero(interval: dict, above: str, below: str, neither: str) -> str:
    """The words for where an interval lies: wholly above zero, wholly below, or across it (or
    no interval at all: fewer than two seeds)."""
    if interval["low"] is None:
        return neither
    return above if interval["low"] > 0 else below if interval["high"] < 0 else neither


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


def credit_gain_summary(histories: dict, target_gain: float = 0.05) -> tuple[dict, pd.DataFrame]:
    """What the runs of `run_credit_comparison` say about the prediction.

    Args:
        histories: (arm, k, seed) -> history, both arms for every k and seed, at least two k
            and two seeds.
        target_gain: the target accuracy of a k is the warm start's accuracy there plus this.

    Returns:
        records: "credit_step_counts", "credit_num_seeds", "credit_initial_accuracy" (per k,
        the warm start's held-out accuracy, shared by every run of k), "credit_final_accuracy"
        (per arm, per k: mean, low, high over seeds), "credit_gain" (per k: the paired gain
        process - outcome, mean, low, high), "credit_gain_range" (the gains at the smallest
        and largest k, in words), "credit_gain_slope" with "_low" and "_high" (gain per step of
        k), "credit_gain_trend" ("grows", "shrinks" or "cannot be told apart from a constant",
        from the slope's interval), "credit_prediction" ("supports", "contradicts" or "can
        neither support nor contradict"), "credit_target_gain" and "credit_steps_to_target"
        (per arm, per k: the mean over the seeds that reached the target, None where none
        did, and how many did).
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
    trend = fitted_trend(step_counts, gains)
    slope = {key: trend[key] for key in ("mean", "low", "high")}
    words = side_of_zero(slope, "grows", "shrinks", "cannot be told apart from a constant")
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
        "credit_final_accuracy": final,
        "credit_gain": gain,
        "credit_gain_range": f"{_interval_text(gain[first])} at {first} step"
        + ("s" if first != "1" else "")
        + f" and {_interval_text(gain[last])} at {last} steps",
        "credit_gain_slope": slope["mean"],
        "credit_gain_slope_low": slope["low"],
        "credit_gain_slope_high": slope["high"],
        "credit_gain_trend": words,
        "credit_prediction": {
            "grows": "supports",
            "shrinks": "contradicts",
        }.get(words, "can neither support nor contradict"),
        "credit_target_gain": target_gain,
        "credit_steps_to_target": reached,
    }
    return records, _table(step_counts, initial, final, gain, reached)


def _interval_text(interval: dict) -> str:
    """ "+0.031 [-0.012, +0.074]": a mean and its interval, signed."""
    return f"{interval['mean']:+.3f} [{interval['low']:+.3f}, {interval['high']:+.3f}]"


def _table(step_counts, initial, final, gain, reached) -> pd.DataFrame:
    rows = []
    for k in map(str, step_counts):
        row = {"k (steps)": int(k), "warm start": initial[int(k)]}
        for arm in ARMS:
            row[f"{arm}: final"] = final[arm][k]["mean"]
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
