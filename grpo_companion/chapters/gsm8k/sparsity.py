"""Chapter 11, section 4: does gradient sparsity intensify over a GRPO run?

`sparsity_change` reads a run's `run.history_frame`: the change of the degenerate fraction
(all-correct plus all-wrong groups) and of the training reward from the first window of steps
to the last, each with a moving-block bootstrap interval over steps (`window_change`), against
`degenerate_prediction`, the change that i.i.d. groups at the windows' mean pass rates predict
(`grpo_companion.core.exact.degenerate_rate`, whose slope chapter 6 derives).

Chapter: :doc:`/book/11_gsm8k` (section 4), :doc:`/book/06_sparsity`.
"""

import numpy as np
import pandas as pd

from grpo_companion.core.exact import degenerate_rate
from grpo_companion.core.stats import interval_words, moving_block_bootstrap


def block_length(num_steps: int) -> int:
    """The moving-block bootstrap's block for a window of `num_steps` steps: n^(1/3), rounded,
    at least 1 (the usual order for the bootstrap of a mean)."""
    return max(1, round(num_steps ** (1 / 3)))


def window_change(
    values, window: int, num_resamples: int, seed: int, confidence: float = 0.95
) -> dict:
    """Mean of the last `window` values of a per-step series minus the mean of the first, and a
    percentile interval from `stats.moving_block_bootstrap` of each window (seeds `seed` and
    `seed` + 1: far-apart windows resampled independently). low and high are None for a window
    of one step (no spread to resample)."""
    values = np.asarray(values, dtype=np.float64)
    first, last = values[:window], values[-window:]
    change = {"mean": float(last.mean() - first.mean()), "low": None, "high": None}
    if window < 2:
        return change
    block = block_length(window)
    draws = moving_block_bootstrap(last, block, num_resamples, seed + 1)
    draws = draws - moving_block_bootstrap(first, block, num_resamples, seed)
    tail = 100 * (1 - confidence) / 2
    change["low"], change["high"] = (float(v) for v in np.percentile(draws, [tail, 100 - tail]))
    return change


def degenerate_prediction(pass_rate_first: float, pass_rate_last: float, group_size: int) -> float:
    """f(p_last) - f(p_first), f(p) = p^G + (1 - p)^G (`exact.degenerate_rate`): the change of
    the degenerate fraction if every group's G completions were i.i.d. at the window's mean pass
    rate. Its sign is that of the integral of f'(p) dp along the pass rate's path: positive when
    the pass rate moves away from 1/2, negative towards it."""
    rates = degenerate_rate(np.array([pass_rate_first, pass_rate_last]), group_size)
    return float(rates[1] - rates[0])


def sparsity_change(
    frame: pd.DataFrame, window: int, group_size: int, num_resamples: int, seed: int
) -> dict:
    """Does sparsity intensify in this run (chapter 11, section 4)?

    frame: `run.history_frame` of a run (its row of step 0 is skipped, as in
    `run.training_summary`).
    Returns "degenerate_change" (all-correct plus all-wrong fraction, last window minus first)
    and "train_reward_change", each with "_low", "_high" (`window_change`) and "_text" (in
    words, for the prose), the bootstrap's
    "degenerate_block_length", "predicted_degenerate_change" (`degenerate_prediction` at the
    windows' mean training reward) with "_how", and "degenerate_change_words"
    (`stats.interval_words` of the change against the prediction: the ledger's comparison).
    """
    steps = frame.iloc[1:]
    records = {"degenerate_block_length": block_length(window)}
    degenerate = steps["all_correct"] + steps["all_wrong"]
    for name, series, offset in (
        ("degenerate_change", degenerate, 0),
        ("train_reward_change", steps["reward"], 2),
    ):
        change = window_change(series, window, num_resamples, seed + offset)
        records[name] = change["mean"]
        records[f"{name}_low"], records[f"{name}_high"] = change["low"], change["high"]
        records[f"{name}_text"] = _change_text(change)
    first, last = steps["reward"].iloc[:window].mean(), steps["reward"].iloc[-window:].mean()
    predicted = degenerate_prediction(first, last, group_size)
    records["predicted_degenerate_change"] = predicted
    records["predicted_degenerate_change_how"] = (
        f"{predicted:+.4f}, the change of p^G + (1 - p)^G at G = {group_size} from the first "
        f"window's mean training pass rate p = {first:.3f} to the last window's {last:.3f}: "
        "i.i.d. completions at the window means, no spread of pass rates across prompts"
    )
    records["degenerate_change_words"] = interval_words(
        records["degenerate_change_low"],
        records["degenerate_change_high"],
        predicted,
        supports="supports",
        contradicts="contradicts",
    )
    return records


def _change_text(change: dict) -> str:
    """ "+0.031, 95% interval [-0.012, +0.074]", or the mean alone when there is no interval."""
    if change["low"] is None:
        return f"{change['mean']:+.3f} (no interval: a window of one step)"
    return f"{change['mean']:+.3f}, 95% interval [{change['low']:+.3f}, {change['high']:+.3f}]"
