r"""Tune, then compare: each arm at its own learning rate, then the arms on paired seeds.

The design every training comparison of the book follows (a pilot apart from the confirmation):

    1. tune:     every arm at every rate of an ascending grid on the tuning seeds; each arm
                 takes the rate whose runs score best on average (`core.stats.grid_choice`);
    2. plan:     the tuning runs at the chosen rates are the pilot: the paired difference of an
                 arm and the reference there is the predicted effect, its per-seed SD sets the
                 seeds a paired test needs for 80% power (`plan`), before any confirmatory run;
    3. compare:  every arm at its rate on the confirmation seeds, which tuning never used, seed
                 s of every arm sharing the prompts and the sampler's streams (paired seeds);
                 the effect is the mean paired difference with its t interval over seeds
                 (`paired_effect`).

`run(arm, learning_rate, seed) -> dict` is one training run, a pure function of its arguments
returning numbers (say {"gain": ...}); runs go to one-thread workers on every core
(`lm.parallel.map_runs`), and with `keep` (a `run_store` folder) each finished run is stored as
it ends, so a stopped build loses only the runs not yet finished.

Chapter: :doc:`/book/06_sparsity` (section 6)
"""

from dataclasses import dataclass

import numpy as np
import pandas as pd

from grpo_companion.core.stats import grid_choice, mean_interval, seeds_for_power
from grpo_companion.lm.parallel import map_runs


@dataclass(frozen=True)
class Tuning:
    """The tuning runs and each arm's choice.

    table: one row per run: arm, learning_rate, seed and the run's numbers.
    choice: arm -> `grid_choice` of its rates by the mean of `score` ("learning_rate",
        "inside", "learned", "means").
    """

    table: pd.DataFrame
    choice: dict
    score: str

    @property
    def rates(self) -> dict:
        """arm -> its chosen learning rate."""
        return {arm: chosen["learning_rate"] for arm, chosen in self.choice.items()}

    def at_choice(self) -> pd.DataFrame:
        """The tuning runs at each arm's chosen rate: the pilot."""
        chosen = self.table["learning_rate"] == self.table["arm"].map(self.rates)
        return self.table[chosen]


def tune(run, arms, learning_rates, seeds, *, score: str, start: float | None = None,
         margin: float = 0.0, workers=None, keep=None, progress=False) -> Tuning:  # fmt: skip
    """Every arm of `arms` at every rate of its grid on every tuning seed; each arm's rate is
    the one with the highest mean `score` (a tie goes to the lowest rate). `learning_rates`:
    one ascending grid for every arm, or a dict arm -> its own. "learned" says whether the best
    mean beat `start` (the score before training) by more than `margin`; None without `start`."""
    arms, seeds = list(arms), list(seeds)
    if not arms or not seeds:
        raise ValueError("tune needs at least one arm and one seed")
    grids = {arm: list(learning_rates[arm] if isinstance(learning_rates, dict) else learning_rates)
             for arm in arms}  # fmt: skip
    for arm, grid in grids.items():
        if len(grid) < 3 or sorted(grid) != grid:
            raise ValueError(
                f"{arm}'s learning rates must be ascending with at least 3 rates (an optimum "
                f"inside the grid needs one on each side), got {grid}"
            )
    keys = [(arm, rate, seed) for arm in arms for rate in grids[arm] for seed in seeds]
    table = _runs(run, keys, workers, keep, progress, "tuning")
    if score not in table:
        raise KeyError(f"the runs return no {score!r}; they return {sorted(table.columns[3:])}")
    means = table.groupby(["arm", "learning_rate"])[score].mean()
    choice = {}
    for arm, grid in grids.items():
        arm_means = [means[arm, rate] for rate in grid]
        choice[arm] = grid_choice(grid, arm_means, start=start, margin=margin)
    return Tuning(table, choice, score)


def compare(run, rates: dict, seeds, *, workers=None, keep=None, progress: bool = False):
    """Every arm at its rate (`rates`: arm -> learning rate) on every seed: one row per run."""
    keys = [(arm, rate, seed) for arm, rate in rates.items() for seed in seeds]
    return _runs(run, keys, workers, keep, progress, "comparison")


def paired_differences(table: pd.DataFrame, arm: str, reference: str, column: str) -> pd.Series:
    """Per seed, `column` of `arm` minus that of `reference` (the seeds both ran)."""
    by_arm = table.pivot_table(index="seed", columns="arm", values=column)
    return (by_arm[arm] - by_arm[reference]).dropna()


def paired_effect(table: pd.DataFrame, arm: str, reference: str, column: str) -> dict:
    """The mean paired difference of `arm` over `reference` and its 95% t interval over seeds:
    {"n", "mean", "low", "high", "sd"}."""
    differences = paired_differences(table, arm, reference, column)
    sd = float(differences.std(ddof=1)) if len(differences) > 1 else float("nan")
    return {**mean_interval(differences.to_numpy()), "sd": sd}


def plan(pilot: pd.DataFrame, arm: str, reference: str, column: str, *, max_seeds: int,
         min_seeds: int = 3, power: float = 0.8) -> dict:  # fmt: skip
    """Power before seeds, from the pilot alone: the predicted effect (the pilot's mean paired
    difference), its per-seed SD, the seeds a paired two-sided 5% test needs for `power` at that
    effect (`core.stats.seeds_for_power`), and the seeds to run, that many within [min_seeds,
    max_seeds]. Returns {"predicted", "sd", "needed", "run"}."""
    effect = paired_effect(pilot, arm, reference, column)
    predicted, sd = effect["mean"], effect["sd"]
    needed = seeds_for_power(sd, predicted, power) if np.isfinite(sd) and predicted else max_seeds
    return {"predicted": predicted, "sd": sd, "needed": needed,
            "run": int(min(max(needed, min_seeds), max_seeds))}  # fmt: skip


def _runs(run, keys, workers, keep, progress, desc) -> pd.DataFrame:
    results = map_runs(lambda key: run(*key), keys, workers=workers, keep=keep,
                       progress=progress, desc=desc)  # fmt: skip
    rows = []
    for (arm, rate, seed), numbers in results.items():
        rows.append({"arm": arm, "learning_rate": rate, "seed": seed, **numbers})
    return pd.DataFrame(rows)
