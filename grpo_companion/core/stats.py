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
    steps = [
        [record["step"] for record in history if record[metric] is not None]
        for history in histories
    ]
    if not steps or any(run != steps[0] for run in steps) or not steps[0]:
        raise ValueError(f"the runs measured {metric!r} at different steps (or never): {steps}")
    values = [
        [record[metric] for record in history if record[metric] is not None]
        for history in histories
    ]
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
        raise ValueError(
            f"need values (num_runs, num_steps = {steps.size} >= 2), got shape {values.shape}"
        )
    centred = steps - steps.mean()
    slopes = (values - values.mean(axis=1, keepdims=True)) @ centred / (centred @ centred)
    return {
        "slopes": slopes,
        **{key: value for key, value in mean_interval(slopes, confidence).items() if key != "n"},
    }


def expected_normal_range(n: int) -> float:
    """E[max - min] of n independent standard normals, by quadrature of
    E[R_n] = ∫ 1 - Φ(x)^n - (1 - Φ(x))^n dx (0 for n <= 1; 2/√π for n = 2, 3/√π for n = 3).

    The range that pure noise of unit standard error spreads over along n estimates: credit that
    varies along a completion by no more than this times its standard error is noise.
    """
    if n <= 1:
        return 0.0
    from scipy import integrate

    def integrand(x):
        return -np.expm1(n * stats.norm.logcdf(x)) - np.exp(n * stats.norm.logsf(x))

    return float(integrate.quad(integrand, -np.inf, np.inf, limit=200)[0])


def slope_of_means(x, means, standard_errors, confidence: float = 0.95) -> dict:
    """Least-squares slope of independent means against x, and its normal interval.

    x, means, standard_errors: (k,) with k >= 2 distinct x; each mean from its own sample (the
    groups at one G are not the groups at another), so the slope Σ c_i m_i / Σ c_i² (c = x -
    mean x) has variance Σ c_i² se_i² / (Σ c_i²)². Returns {"mean", "low", "high"}; low and high
    are None when a standard error is unknown (None or NaN: a mean of one group).
    """
    x, means = np.asarray(x, dtype=float), np.asarray(means, dtype=float)
    errors = np.array([np.nan if e is None else e for e in standard_errors], dtype=float)
    centred = x - x.mean()
    scale = centred @ centred
    if x.size < 2 or scale == 0:
        raise ValueError(f"need at least two distinct x, got {x.tolist()}")
    slope = float(centred @ means / scale)
    if not np.all(np.isfinite(errors)):
        return {"mean": slope, "low": None, "high": None}
    half = stats.norm.ppf((1 + confidence) / 2) * np.sqrt(centred**2 @ errors**2) / scale
    return {"mean": slope, "low": float(slope - half), "high": float(slope + half)}


SUPPORTS, UNDECIDED, CONTRADICTS = 1, 0, -1


def seeds_for_power(sd: float, effect: float, power: float = 0.8) -> int:
    """Seeds a paired two-sided 5% test needs to detect `effect` with per-seed SD `sd` (normal
    approximation, ((z_0.975 + z_power) sd / effect)^2 rounded up; at least 2)."""
    from scipy.stats import norm

    if not effect:
        return 0
    return max(2, int(np.ceil(((norm.ppf(0.975) + norm.ppf(power)) * sd / effect) ** 2)))


def grid_choice(grid, means, start: float | None = None, margin: float = 0.0) -> dict:
    """The learning rate of `grid` (ascending) with the highest of `means` (one per rate, e.g.
    the mean validation accuracy over tuning seeds; the first, lowest, rate wins a tie):
    "learning_rate", "index", "inside" (whether it lies strictly inside the grid: an optimum at
    an end may lie beyond it), "means" and, given the measure before training `start`,
    "learned": whether the best rate raised it by more than `margin` (the measure's noise, e.g.
    `accuracy_noise`; None without `start`). A grid on which nothing learns returns the argmax
    of noise, often its lowest rate (ties), so "inside" alone would call it a choice."""
    means = [float(mean) for mean in means]
    best = int(np.argmax(means))
    learned = None if start is None else bool(means[best] - start > margin)
    return {"learning_rate": grid[best], "index": best, "inside": 0 < best < len(grid) - 1,
            "means": means, "learned": learned}  # fmt: skip


def choice_records(choice: dict, prefix: str, inside_key: str) -> dict:
    """The records of one `grid_choice` per arm (`choice`: {arm: its result}):
    "<prefix><arm>_learning_rate", "<prefix><arm>_lr_inside" (1 or 0) and
    "<prefix><arm>_tune_learned" (1 or 0; None when unmeasured); and `inside_key`, 1 when every
    arm's best rate lies strictly inside its grid."""
    records = {}
    for arm, chosen in choice.items():
        records[f"{prefix}{arm}_learning_rate"] = chosen["learning_rate"]
        records[f"{prefix}{arm}_lr_inside"] = int(chosen["inside"])
        learned = chosen["learned"]
        records[f"{prefix}{arm}_tune_learned"] = None if learned is None else int(learned)
    records[inside_key] = int(all(chosen["inside"] for chosen in choice.values()))
    return records


def accuracy_noise(accuracy: float, num_problems: int) -> float:
    """Two binomial standard errors of an accuracy measured on `num_problems` problems,
    2 sqrt(p (1 - p) / n): a gain smaller than this on one tuning run is not told from noise."""
    p = min(max(float(accuracy), 0.0), 1.0)
    return 2.0 * float(np.sqrt(p * (1.0 - p) / num_problems))


def interval_reading(low, high, predicted) -> int:
    """How a 95% interval [low, high] of an effect reads against the effect `predicted` for this
    setting (non-zero; its sign is the direction the claim predicts). SUPPORTS (1): the interval
    lies beyond 0 on the predicted side. CONTRADICTS (-1): it does not, and it excludes the
    predicted effect (it lies short of it, or on the other side of 0). UNDECIDED (0): it holds
    both 0 and the predicted effect, or there is no interval (None or NaN: one seed).

    The ledger's rules (`reading(...)` in a check) and the chapters' sentences (`interval_words`)
    both come from this one comparison.
    """
    values = (low, high, predicted)
    if any(v is None or not np.isfinite(v) for v in values) or predicted == 0:
        return UNDECIDED
    if predicted < 0:  # read a predicted fall as a rise of the negated effect
        low, high, predicted = -high, -low, -predicted
    if low > 0:
        return SUPPORTS
    if high < predicted:
        return CONTRADICTS
    return UNDECIDED


def interval_words(low, high, predicted, supports: str, contradicts: str) -> str:
    """`interval_reading` in words: `supports` or `contradicts` (the chapter's phrasing), or
    "can neither support nor contradict the predicted effect" (no interval, or one holding both
    0 and the prediction)."""
    reading = interval_reading(low, high, predicted)
    if reading == SUPPORTS:
        return supports
    if reading == CONTRADICTS:
        return contradicts
    return "can neither support nor contradict the predicted effect"


def moving_block_bootstrap(values, block_length: int, num_resamples: int, seed: int) -> np.ndarray:
    """Means of `num_resamples` moving-block bootstrap resamples of a series (n,), e.g. one
    metric over the consecutive steps of one run (chapter 11, section 4).

    Each resample joins blocks of `block_length` consecutive values, their starts drawn with
    replacement among the n - block_length + 1 possible ones, and is cut to n values. Neighbouring
    steps share a policy, so their values are correlated; blocks keep that correlation, which the
    i.i.d. bootstrap (block_length 1) drops, understating the spread of the mean. Returns
    (num_resamples,) float64; seeded by `seed` alone.
    """
    values = np.asarray(values, dtype=np.float64)
    n = values.size
    if not 1 <= block_length <= n:
        raise ValueError(f"need 1 <= block_length <= {n} values, got {block_length}")
    num_blocks = -(-n // block_length)
    starts = np.random.default_rng(seed).integers(
        0, n - block_length + 1, size=(num_resamples, num_blocks)
    )
    index = (starts[:, :, None] + np.arange(block_length)).reshape(num_resamples, -1)[:, :n]
    return values[index].mean(axis=1)
