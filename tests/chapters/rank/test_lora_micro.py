"""chapters/rank/micro.py: the non-inferiority margin from the pilot and the one-sided bounds
of the records, against hand-built runs."""

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from grpo_companion.chapters.rank import micro as rank_micro
from grpo_companion.lm.compare import Tuning


def runs(differences, full_gain=0.4) -> pd.DataFrame:
    rows = []
    for seed, difference in enumerate(differences):
        rows.append(
            {"arm": "full", "learning_rate": 1e-3, "seed": seed, "gain": full_gain + 0.01 * seed}
        )
        rows.append({"arm": "r2", "learning_rate": 3e-3, "seed": seed,
                     "gain": full_gain + 0.01 * seed + difference})  # fmt: skip
    return pd.DataFrame(rows)


def test_the_margin_is_a_share_of_the_pilots_full_gain():
    pilot = runs([-0.01, 0.0])
    margin = rank_micro.non_inferiority_margin(pilot, 0.1)
    assert margin["full_gain"] == pytest.approx(0.405)
    assert margin["margin"] == pytest.approx(0.0405)
    assert rank_micro.non_inferiority_margin(runs([0.0], full_gain=-0.1), 0.1)["margin"] == 0.0


def test_the_records_bounds_are_the_one_sided_95_percent_bounds():
    differences = np.array([-0.02, -0.01, 0.0, -0.03, -0.015])
    table = runs(differences)
    choice = {arm: {"learning_rate": rate, "inside": True, "learned": True}
              for arm, rate in (("full", 1e-3), ("r2", 3e-3))}  # fmt: skip
    tuning = Tuning(runs([-0.01, -0.02, 0.0]), choice, "gain")
    records = rank_micro.lora_records(tuning, {"margin": 0.04, "full_gain": 0.4}, table, [2], 10)
    half = stats.t.ppf(0.95, 4) * differences.std(ddof=1) / np.sqrt(5)
    assert records["micro_lora_r2_minus_full"] == pytest.approx(differences.mean())
    assert records["micro_lora_r2_minus_full_lower"] == pytest.approx(differences.mean() - half)
    assert records["micro_lora_r2_minus_full_upper"] == pytest.approx(differences.mean() + half)
    assert records["micro_lora_seeds_run"] == 5
