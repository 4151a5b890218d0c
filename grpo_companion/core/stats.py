"""Statistics the chapters share: intervals over seeds and groups, trends over training steps.

Runs with different seeds (or disjoint groups) are the independent units; the steps of one run
are not, so every interval here is a Student-t interval over runs.
"""

import numpy as np
from scipy import stats


def mean_interval(values, confidence: float = 0.95) -> dict:
    """{"n", "mean", "low", "high"}: the mean of `values` and its Student-t interval; low and
    high are None for fewer than two values (no interval from one number)."""
    values = np.asarray(values, dtype=float)
    n, mean = len(values), float(values.mean()) if len(values) else None
    if n < 2:
        return {"n": n, "mean": mean, "low": None, "high": None}
    half = stats.t.ppf((1 + confidence) / 2, n - 1) * values.std(ddof=1) / np.sqrt(n)
    return {"n": n, "mean": mean, "low": float(mean - half), "high": float(mean + half)}


def metric_by_step(histories: list[list[dict]], metric: str) -> tuple[np.ndarray, np.ndarray]:
    """The steps at which every run measured `metric`, and its values (num_runs, num_steps).

    histories: one `trainer.train` history per run (a list of dicts with "step"); the runs
    must have measured the metric at the same steps (the same eval_every and max_steps).
    """
    steps = [[record["step"] for record in history if record[metric] is not None]
             for history in histories]
    if not steps or any(run != steps[0] for run in steps) or not steps[0]:
        raise ValueError(f"the runs measured {metric!r} at different steps (or never): {steps}")
    values = [[record[metric] for record in history if record[metric] is not None]
              for history in histories]
    return np.array(steps[0]), np.array(values, dtype=np.float64)


def seed_band(values, confidence: float = 0.95) -> dict:
    """Mean over runs and its Student-t interval, per column of values (num_runs, num_steps).

    Returns: dict of float arrays (num_steps,): mean, low, high (`mean_interval` on
    each column: the runs are independent seeds, the steps of one run are not).
    """
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2 or values.shape[0] < 2:
        raise ValueError(f"need values (num_runs >= 2, num_steps), got shape {values.shape}")
    columns = [mean_interval(column, confidence) for column in values.T]
    return {key: np.array([column[key] for column in columns]) for key in ("mean", "low", "high")}


def fitted_trend(steps, values, confidence: float = 0.95) -> dict:
    """Least-squares slope of each run's values against steps, and their mean's t-interval.

    values (num_runs, num_steps). The interval treats runs, not steps, as the independent
    units: the steps of one run share a policy, so their residuals are correlated and a
    pooled regression's interval would be too narrow. Returns: slopes (num_runs,) and the
    mean, low, high of the slope (per step), as floats.
    """
    steps, values = np.asarray(steps, dtype=np.float64), np.asarray(values, dtype=np.float64)
    if values.ndim != 2 or values.shape[1] != steps.size or steps.size < 2:
        raise ValueError(f"need values (num_runs, num_steps = {steps.size} >= 2), "
                         f"got shape {values.shape}")
    centred = steps - steps.mean()
    slopes = (values - values.mean(axis=1, keepdims=True)) @ centred / (centred @ centred)
    return {"slopes": slopes, **{key: value for key, value in
                                 mean_interval(slopes, confidence).items() if key != "n"}}
