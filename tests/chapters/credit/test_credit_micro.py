"""chapters/credit/micro.py: the per-seed interaction slope against hand-built gains, and the
plan's pooled SD against its formula."""

import numpy as np
import pandas as pd
import pytest

from grpo_companion.chapters.credit import micro as credit_micro


def gains(slopes: dict, ks=(4, 5, 6), seeds=(0, 1, 2), noise: float = 0.0) -> pd.DataFrame:
    """Gains where arm a's paired difference from outcome at seed s is slopes[a] * (k - 5) +
    a seed-specific offset (which a slope must ignore) + noise(s, k)."""
    rng = np.random.default_rng(0)
    rows = []
    for seed in seeds:
        base = {k: 0.3 + 0.01 * seed - 0.02 * k for k in ks}
        for k in ks:
            rows.append({"arm": "outcome", "k": k, "seed": seed, "gain": base[k]})
            for arm, slope in slopes.items():
                shift = slope * (k - 5) + 0.05 * seed + noise * rng.standard_normal()
                rows.append({"arm": arm, "k": k, "seed": seed, "gain": base[k] + shift})
    return pd.DataFrame(rows)


def test_the_slope_per_seed_is_the_least_squares_slope_of_the_difference():
    table = gains({"process": 0.03, "value": -0.01})
    assert credit_micro.seed_slopes(table, "process").to_numpy() == pytest.approx([0.03] * 3)
    assert credit_micro.seed_slopes(table, "value").to_numpy() == pytest.approx([-0.01] * 3)
    interval = credit_micro.slope_interval(table, "process")
    assert interval["mean"] == pytest.approx(0.03) and interval["n"] == 3


def test_the_slope_matches_numpy_polyfit_with_noise():
    table = gains({"process": 0.02}, ks=(4, 5, 7), seeds=range(5), noise=0.01)
    slopes = credit_micro.seed_slopes(table, "process")
    by = table.pivot_table(index=["seed", "k"], columns="arm", values="gain")
    for seed in range(5):
        d = (by["process"] - by["outcome"]).loc[seed]
        assert slopes[seed] == pytest.approx(
            np.polyfit(d.index.to_numpy(float), d.to_numpy(), 1)[0]
        )


def test_the_plan_pools_the_differences_variance_through_the_slopes_weights():
    table = gains({"process": 0.02}, seeds=range(4), noise=0.01)
    planned = credit_micro.plan(table, "process", max_seeds=50)
    by = table.pivot_table(index=["seed", "k"], columns="arm", values="gain")
    d = (by["process"] - by["outcome"]).unstack("k")
    weights = np.array([-0.5, 0.0, 0.5])  # (k - 5) / sum (k - 5)^2 for k = 4, 5, 6
    expected_sd = np.sqrt(d.var(ddof=1).mean()) * np.sqrt((weights**2).sum())
    assert planned["sd"] == pytest.approx(expected_sd)
    assert planned["predicted"] == pytest.approx(float((d.to_numpy() @ weights).mean()))
    assert 3 <= planned["run"] <= 50
    assert credit_micro.plan(table, "process", max_seeds=2, min_seeds=2)["run"] == 2
