"""lm/compare.py: the tuning picks the best rate of a known response, the pilot sets the seeds
as the normal approximation says, the comparison pairs seeds, and finished runs are kept."""

import math

import numpy as np
import pytest

from grpo_companion.lm import compare
from grpo_companion.lm.parallel import run_store

OPTIMA = {"a": 1e-3, "b": 3e-3}  # each arm's best rate
RATES = [3e-4, 1e-3, 3e-3, 1e-2]


def response(arm, learning_rate, seed):
    """A gain peaked at the arm's optimum in log rate, arm b 0.05 ahead at its best, plus a
    seed effect shared by the arms (paired) and a small arm-specific one."""
    peak = 0.3 + (0.05 if arm == "b" else 0.0)
    shared = 0.1 * math.sin(seed)
    own = 0.01 * math.cos(seed * (2 if arm == "b" else 3))
    return {"gain": peak - 0.1 * math.log10(learning_rate / OPTIMA[arm]) ** 2 + shared + own}


def test_each_arm_gets_its_own_best_rate_and_the_pilot_is_its_runs():
    tuning = compare.tune(response, ["a", "b"], RATES, [100, 101], score="gain", start=0.0,
                          workers=1)  # fmt: skip
    assert tuning.rates == OPTIMA
    assert tuning.choice["a"]["inside"] and tuning.choice["b"]["inside"]
    assert tuning.choice["a"]["learned"] is True
    assert len(tuning.table) == 2 * 4 * 2
    pilot = tuning.at_choice()
    assert set(zip(pilot["arm"], pilot["learning_rate"])) == set(OPTIMA.items())
    assert len(pilot) == 4


def test_the_plan_is_the_normal_approximation_on_the_pilots_paired_sd():
    tuning = compare.tune(response, ["a", "b"], RATES, range(100, 106), score="gain", workers=1)
    differences = [response("b", 3e-3, s)["gain"] - response("a", 1e-3, s)["gain"]
                   for s in range(100, 106)]  # fmt: skip
    sd, effect = np.std(differences, ddof=1), np.mean(differences)
    planned = compare.plan(tuning.at_choice(), "b", "a", "gain", max_seeds=50)
    assert planned["predicted"] == pytest.approx(effect)
    assert planned["sd"] == pytest.approx(sd)
    assert planned["needed"] == max(2, math.ceil((2.8016 * sd / effect) ** 2))  # z's to 4 digits
    assert planned["run"] == min(max(planned["needed"], 3), 50)
    assert compare.plan(tuning.at_choice(), "b", "a", "gain", max_seeds=2)["run"] == 2


def test_the_comparison_pairs_seeds_and_its_interval_holds_the_true_difference():
    table = compare.compare(response, OPTIMA, range(20), workers=1)
    differences = compare.paired_differences(table, "b", "a", "gain")
    assert list(differences.index) == list(range(20))
    effect = compare.paired_effect(table, "b", "a", "gain")
    assert effect["n"] == 20 and effect["low"] < 0.05 < effect["high"]
    # Pairing removes the shared seed effect: the interval is far narrower than unpaired.
    unpaired = table[table.arm == "b"].gain.std() + table[table.arm == "a"].gain.std()
    assert effect["high"] - effect["low"] < 0.2 * unpaired


def test_each_arm_may_have_its_own_grid():
    grids = {"a": RATES, "b": [1e-3, 3e-3, 1e-2]}
    tuning = compare.tune(response, ["a", "b"], grids, [100], score="gain", workers=1)
    assert tuning.rates == OPTIMA
    assert sorted(tuning.table.query("arm == 'b'").learning_rate.unique()) == grids["b"]


def test_bad_grids_are_refused():
    with pytest.raises(ValueError, match="ascending"):
        compare.tune(response, ["a"], [1e-3, 3e-4, 1e-2], [0], score="gain", workers=1)
    with pytest.raises(ValueError, match="3 rates"):
        compare.tune(response, ["a"], [1e-3, 3e-3], [0], score="gain", workers=1)
    with pytest.raises(KeyError, match="no 'accuracy'"):
        compare.tune(response, ["a"], RATES, [0], score="accuracy", workers=1)


def test_finished_runs_are_kept_and_not_run_again(tmp_path):
    calls = []

    def counted(arm, learning_rate, seed):
        calls.append((arm, learning_rate, seed))
        return response(arm, learning_rate, seed)

    keep = run_store(tmp_path, "test")
    first = compare.compare(counted, OPTIMA, range(3), workers=1, keep=keep)
    again = compare.compare(counted, OPTIMA, range(4), workers=1, keep=keep)
    assert len(calls) == 6 + 2
    assert again.iloc[:3].equals(first.iloc[:3])
