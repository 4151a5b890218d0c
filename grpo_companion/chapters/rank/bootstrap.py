"""Chapter 7: intervals that respect the design, by a bootstrap over prompts.

Every group size G cuts its groups from the same samples of each prompt, so the mean ranks at
different G are dependent, and groups of one prompt are not independent either. Resampling whole
prompts keeps both dependences: `prompt_weights` draws the resamples, `resampled_means` turns a
table of groups into resampled means, `change_over_sizes` fits their change over G and
`bootstrap_interval` reads a percentile interval. `chapters.rank.verdict` builds the ledger's
records with them.

Chapter: :doc:`/book/07_rank`
"""

import numpy as np
import pandas as pd


def prompt_weights(num_prompts: int, num_resamples: int, seed: int) -> np.ndarray:
    """`(1 + num_resamples, num_prompts)` counts: row 0 all ones (the estimate itself), then
    one multinomial resample of the prompts per row (numpy generator seeded `seed`). A mean
    over groups becomes (weights @ sums) / (weights @ counts): the groups of a resampled
    prompt come along with it, at every G."""
    generator = np.random.default_rng(seed)
    draws = generator.integers(num_prompts, size=(num_resamples, num_prompts))
    counts = np.stack([np.bincount(row, minlength=num_prompts) for row in draws])
    return np.vstack([np.ones(num_prompts), counts]).astype(float)


def resampled_means(frame: pd.DataFrame, by: list[str], value: str, weights: np.ndarray):
    """{key of `by`: `(1 + R,)` means of `value` over the mixed groups} under each row of
    `weights` (`prompt_weights`); NaN where a resample holds no mixed group of that key."""
    mixed = frame[frame["mixed"]]
    totals = mixed.groupby([*by, "prompt"])[value].agg(["sum", "count"])
    num_prompts = weights.shape[1]
    result = {}
    for key, part in totals.groupby(level=list(range(len(by)))):
        key = key if isinstance(key, tuple) else (key,)
        prompts = part.index.get_level_values("prompt").to_numpy()
        sums, counts = np.zeros(num_prompts), np.zeros(num_prompts)
        sums[prompts], counts[prompts] = part["sum"].to_numpy(), part["count"].to_numpy()
        with np.errstate(invalid="ignore", divide="ignore"):
            result[key] = (weights @ sums) / (weights @ counts)
    return result


def missing_means(weights: np.ndarray) -> np.ndarray:
    """`(1 + R,)` NaNs: the resampled means of a key that has no mixed group at all."""
    return np.full(weights.shape[0], np.nan)


def change_over_sizes(means: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Least-squares slope of `means: (..., n)` against the group sizes `sizes` (n of them),
    times their span: the change of the fitted line from the smallest G to the largest, `(...)`."""
    x = np.asarray(sizes, dtype=float)
    centred = x - x.mean()
    return (means @ centred) / (centred @ centred) * (x[-1] - x[0])


def bootstrap_interval(values: np.ndarray, confidence: float = 0.95) -> dict:
    """{"mean", "low", "high"} from `(1 + R,)` values: the estimate (row 0) and the percentile
    interval of the resamples. None where the estimate is undefined, and low = high = None
    where more than 1 - `confidence` of the resamples are (too few prompts with mixed groups)."""
    estimate, resampled = values[0], values[1:]
    if not np.isfinite(estimate):
        return {"mean": None, "low": None, "high": None}
    finite = resampled[np.isfinite(resampled)]
    if len(finite) < confidence * len(resampled) or len(finite) < 2:
        return {"mean": float(estimate), "low": None, "high": None}
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(finite, [tail, 100 - tail])
    return {"mean": float(estimate), "low": float(low), "high": float(high)}
