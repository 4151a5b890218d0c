r"""Chapter 5, section 7: credit as the multi-step bottleneck, decided on the micro model.

At each step count k, a warm start of the micro model (`lm.micro.held_out_start`) to the same
mean pass rate J0; four arms train from it with the same rollout budget on fresh prompts
(`lm.micro.arm_runner`): outcome GRPO, process credit (each worked line checked, DeepSeekMath's
rule), its placebo (the step labels shuffled within each group: the same density and scale, no
information) and a critic learned from outcomes only (`lm.critic.Critic`: credit without step
labels). Each (k, arm) gets its own rate, tuned on pilot seeds (`lm.compare`).

The estimand is the arm x k interaction: per confirmation seed s, the least-squares slope over k
of the paired difference d_s(k) = gain_arm(k, s) - gain_outcome(k, s) in exact test J
(`seed_slopes`), with a t interval over seeds. "Credit is the bottleneck" predicts that giving
each step its own credit helps more the more steps a problem takes: a positive slope.
"""

import numpy as np
import pandas as pd

from grpo_companion.core.stats import mean_interval, seeds_for_power

REFERENCE = "outcome"


def gains_by_k(tables: dict) -> pd.DataFrame:
    """One row per run, with its k: `tables` is k -> `lm.compare` table."""
    return pd.concat([table.assign(k=k) for k, table in tables.items()], ignore_index=True)


def seed_slopes(gains: pd.DataFrame, arm: str, reference: str = REFERENCE) -> pd.Series:
    """Per seed, the least-squares slope over k of `arm`'s gain minus `reference`'s (paired at
    each k): the arm x k interaction of that seed. Seeds missing a k are left out."""
    by = gains.pivot_table(index=["seed", "k"], columns="arm", values="gain")
    differences = (by[arm] - by[reference]).unstack("k").dropna()
    ks = differences.columns.to_numpy(dtype=float)
    centred = ks - ks.mean()
    return differences @ (centred / (centred**2).sum())


def slope_interval(gains: pd.DataFrame, arm: str, reference: str = REFERENCE) -> dict:
    """The mean over seeds of `seed_slopes` and its 95% t interval, and the per-seed SD."""
    slopes = seed_slopes(gains, arm, reference)
    sd = float(slopes.std(ddof=1)) if len(slopes) > 1 else float("nan")
    return {**mean_interval(slopes.to_numpy()), "sd": sd}


def plan(pilot: pd.DataFrame, arm: str, max_seeds: int, min_seeds: int = 3) -> dict:
    """Power before seeds, from the pilot alone (the tuning seeds at each (k, arm)'s chosen
    rate): the predicted slope (the pilot's mean slope), its per-seed SD and the seeds for 80%
    power (`seeds_for_power`), run within [min_seeds, max_seeds]. The SD pools the paired
    differences' variance over the k (one degree of freedom per seed and k, less one per k)
    and carries it through the slope's weights: sd_slope = sd_d sqrt(sum_k w_k^2), w_k =
    (k - mean k) / sum (k - mean k)^2, for a few pilot seeds a steadier SD than the slopes'
    own."""
    by = pilot.pivot_table(index=["seed", "k"], columns="arm", values="gain")
    differences = (by[arm] - by[REFERENCE]).unstack("k").dropna()
    ks = differences.columns.to_numpy(dtype=float)
    weights = (ks - ks.mean()) / ((ks - ks.mean()) ** 2).sum()
    degrees = len(differences) - 1
    pooled = float(np.sqrt(differences.var(ddof=1).mean())) if degrees > 0 else float("nan")
    sd = pooled * float(np.sqrt((weights**2).sum()))
    slopes = differences.to_numpy() @ weights
    predicted = float(slopes.mean()) if len(slopes) else float("nan")
    known = np.isfinite(sd) and np.isfinite(predicted) and predicted != 0
    needed = seeds_for_power(sd, predicted) if known else max_seeds + 1
    return {"predicted": predicted, "sd": sd, "needed": needed,
            "run": int(min(max(needed, min_seeds), max_seeds))}  # fmt: skip


def credit_records(tunings: dict, gains: pd.DataFrame, planned: dict, starts: dict) -> dict:
    """The section's records: the start per k (exact mean J), the reference arm's gain per k
    (t interval), each arm's slope against outcome GRPO (t interval over seeds), the plan from
    the pilot, and whether every tuned rate lies strictly inside its grid."""
    records = {}
    for k, start in starts.items():
        records[f"micro_credit_start_k{k}"] = float(start.pass_rates.mean())
        reference = gains.query("k == @k and arm == @REFERENCE")["gain"].to_numpy()
        gain = mean_interval(reference)
        records[f"micro_credit_outcome_gain_k{k}"] = gain["mean"]
        records[f"micro_credit_outcome_gain_low_k{k}"] = gain["low"]
    records["micro_credit_start_min"] = min(float(s.pass_rates.mean()) for s in starts.values())
    records["micro_credit_start_max"] = max(float(s.pass_rates.mean()) for s in starts.values())
    lows = [records[f"micro_credit_outcome_gain_low_k{k}"] for k in starts]
    records["micro_credit_outcome_learned_count"] = sum(low is not None and low > 0 for low in lows)
    for arm in ("process", "process_placebo", "value"):
        slope = slope_interval(gains, arm)
        name = {"process_placebo": "placebo"}.get(arm, arm)
        records[f"micro_credit_{name}_slope"] = slope["mean"]
        records[f"micro_credit_{name}_slope_low"] = slope["low"]
        records[f"micro_credit_{name}_slope_high"] = slope["high"]
    information = slope_interval(gains, "process", "process_placebo")
    records["micro_credit_information_slope"] = information["mean"]
    records["micro_credit_information_slope_low"] = information["low"]
    records["micro_credit_information_slope_high"] = information["high"]
    records["micro_credit_predicted_slope"] = planned["predicted"]
    records["micro_credit_pilot_sd"] = planned["sd"]
    records["micro_credit_seeds_needed"] = planned["needed"]
    records["micro_credit_seeds_run"] = int(gains["seed"].nunique())
    records["micro_credit_lr_inside"] = int(all(
        chosen["inside"] for tuning in tunings.values() for chosen in tuning.choice.values()
    ))  # fmt: skip
    records["micro_credit_outcome_tune_learned"] = int(all(
        bool(tuning.choice[REFERENCE]["learned"]) for tuning in tunings.values()
    ))  # fmt: skip
    return records
