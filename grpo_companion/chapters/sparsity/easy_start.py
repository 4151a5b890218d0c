r"""Chapter 6, section 3: does sparsity intensify from an easy start, where the claim applies?

D = mean_j f(p_j) rises with the pass rates only where the moving prompts sit above 1/2. Here
the training prompts are chosen there: a selection probe (its own seed stream,
`selection_seed`) samples K completions of each candidate problem, and the first
`num_prompts` whose pass rate lies in a range are kept (`select_in_range`). Each run's step-0
probe re-measures them with fresh samples (`dynamics.probe_seed`), so selection does not bias
it. The estimand (`run_changes`, `easy_summary`): D and the pass rate from each run's first
and last probes (unbiased C(k, G) / C(K, G) estimates), last minus first per seed, t
intervals over seeds.
"""

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from grpo_companion.chapters.sparsity.dynamics import probe_outcomes, probed_run, run_fingerprint
from grpo_companion.chapters.sparsity.flow import fitted_prediction
from grpo_companion.core.stats import mean_interval, seeds_for_power
from grpo_companion.lm import gsm8k
from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.gsm8k import build_prompts
from grpo_companion.lm.parallel import map_runs


def selection_seed(seed: int) -> int:
    """Seed of the selection probe: a stream apart from the trainer's ([seed, 1, step]) and
    the run probes' ([seed, 2, step], `dynamics.probe_seed`)."""
    return int(np.random.SeedSequence([seed, 3]).generate_state(1)[0])


def select_in_range(correct, num_samples: int, low: float, high: float, num_prompts: int):
    """Indices (num_prompts,) of the first candidates whose pass rate k / K lies in [low, high],
    in candidate order (no further choice among them)."""
    rates = np.asarray(correct) / num_samples
    inside = np.flatnonzero((rates >= low) & (rates <= high))
    if len(inside) < num_prompts:
        raise ValueError(
            f"only {len(inside)} candidates with pass rate in [{low}, {high}]; "
            f"ask for fewer prompts or more candidates"
        )
    return inside[:num_prompts]


def easy_problems(
    model, tokenizer, config: GRPOConfig, *, num_candidates: int, num_samples: int,
    pass_range, num_prompts: int, seed: int, reward_fn=gsm8k.reward,
) -> tuple:  # fmt: skip
    """The training problems of an easy start, and what the selection probe saw.

    Samples `num_samples` completions of each of the first `num_candidates` generated
    arithmetic training problems (as the trainer samples, seeded by `selection_seed(seed)`)
    and keeps `select_in_range`'s. Returns (problems, records): records "candidates",
    "in_range" (candidates in `pass_range`), "candidate_pass_rate" (mean over all) and
    "selected_pass_rate" (mean over the kept ones, on the selection samples).
    """
    candidates = gsm8k.load_gsm8k(
        "train", source="arithmetic", num_examples=num_candidates, seed=seed
    )
    prompts, golds = build_prompts(tokenizer, candidates)
    outcomes = probe_outcomes(
        model, tokenizer, prompts, golds, config, num_samples, selection_seed(seed), reward_fn
    )
    correct = np.array([sum(row) for row in outcomes])
    low, high = pass_range
    chosen = select_in_range(correct, num_samples, low, high, num_prompts)
    rates = correct / num_samples
    records = {
        "candidates": num_candidates,
        "in_range": int(((rates >= low) & (rates <= high)).sum()),
        "candidate_pass_rate": float(rates.mean()),
        "selected_pass_rate": float(rates[chosen].mean()),
    }
    return candidates.select(chosen.tolist()), records


def validation_problems(train_data, *, skip: int, num_prompts: int, seed: int):
    """`num_prompts` generated arithmetic training-split problems after the first `skip`: with
    `skip` past both the selection's candidates and the warm start's training problems
    (`TinyLlamaSpec.num_train_split_problems`), problems no run has trained on. Refuses any that
    `train_data` holds."""
    problems = gsm8k.load_gsm8k(
        "train", source="arithmetic", num_examples=num_prompts, skip=skip, seed=seed
    )
    if set(problems["question"]) & set(train_data["question"]):
        raise ValueError("validation problems overlap the training problems: raise `skip`")
    return problems


def easy_runs(
    load_model, tokenizer, problems, eval_data, config: GRPOConfig, seeds, *,
    probe_every: int, probe_samples: int, run_dir: str | Path, model_key: str,
    initial_accuracy: float, workers: int | None = None,
) -> dict:  # fmt: skip
    """{seed: (history, probes)} of `dynamics.probed_run` on `problems`, one run per seed.

    load_model() returns a fresh copy of the initial policy, which `model_key` names. Each run
    checkpoints under run_dir/easy_seed<seed>_<fingerprint> (an interrupted build resumes it);
    the runs go to `workers` one-thread processes (`lm.parallel.map_runs`).
    """

    def run(seed):
        run_config = replace(config, seed=seed)
        fingerprint = run_fingerprint(
            vars(run_config), problems["question"], eval_data["question"],
            probe_every, probe_samples, model_key,
        )  # fmt: skip
        return probed_run(
            load_model(), tokenizer, problems, eval_data, run_config,
            probe_every=probe_every, probe_samples=probe_samples, progress=False,
            checkpoint_dir=Path(run_dir) / f"easy_seed{seed}_{fingerprint}",
            initial_accuracy=initial_accuracy,
        )  # fmt: skip

    return map_runs(run, list(seeds), workers=workers, desc="easy start", progress=False)


KINDS = ("pass_rate", "degenerate", "all_correct", "all_wrong", "eval_accuracy")


def run_changes(runs: dict) -> pd.DataFrame:
    """One row per seed: each of `KINDS` first and last ("<kind>_first", "<kind>_last") and
    "<kind>_change" (last minus first). The pass rate and D's terms come from the first and
    last probes (`dynamics.predicted_degenerate`: D's terms are the unbiased C(k, G) / C(K, G)
    estimates), the held-out greedy accuracy from the history (before training, after the
    last step).

    runs: seed -> (history, probes) of `probed_run`."""
    rows = []
    for seed, (history, probes) in runs.items():
        row = {"seed": seed}
        ends = {kind: (probes[0][kind], probes[-1][kind]) for kind in KINDS[:-1]}
        ends["eval_accuracy"] = (history[0]["eval_accuracy"], history[-1]["eval_accuracy"])
        for kind, (first, last) in ends.items():
            row[f"{kind}_first"], row[f"{kind}_last"] = first, last
            row[f"{kind}_change"] = last - first
        rows.append(row)
    return pd.DataFrame(rows)


def easy_summary(table: pd.DataFrame, prefix: str) -> dict:
    """The changes of `run_changes` with t intervals over seeds.

    Records "<prefix>_<kind>_{first,last}" (means over seeds), "<prefix>_<kind>_change{,_low,
    _high}" for every kind, "<prefix>_degenerate_change_sd" (the per-seed SD, ddof 1),
    "<prefix>_seeds" and "<prefix>_df" (seeds - 1)."""
    records = {f"{prefix}_seeds": len(table), f"{prefix}_df": len(table) - 1}
    for kind in KINDS:
        records[f"{prefix}_{kind}_first"] = float(table[f"{kind}_first"].mean())
        records[f"{prefix}_{kind}_last"] = float(table[f"{kind}_last"].mean())
        interval = mean_interval(table[f"{kind}_change"])
        records[f"{prefix}_{kind}_change"] = interval["mean"]
        records[f"{prefix}_{kind}_change_low"] = interval["low"]
        records[f"{prefix}_{kind}_change_high"] = interval["high"]
    records[f"{prefix}_degenerate_change_sd"] = per_seed_sd(table["degenerate_change"])
    return records


def per_seed_sd(values) -> float:
    """The SD of per-seed values (ddof 1); NaN from fewer than two."""
    values = np.asarray(values, dtype=np.float64)
    return float(values.std(ddof=1)) if len(values) > 1 else math.nan


def step_zero_counts(probes: dict) -> tuple[np.ndarray, int]:
    """Every prompt's correct step-0 probe completions summed over seeds, (J,), and their
    number, K x seeds: every run starts from the same model, so its step-0 probes are fresh
    samples of the same pass rates."""
    runs = list(probes.values())
    counts = np.sum([run[0]["correct"] for run in runs], axis=0)
    return counts, len(runs) * len(runs[0][0]["outcomes"][0])


def easy_prediction(probes: dict, group_size: int, sharings, **flow) -> dict:
    """The exact flow's predicted change of D, fitted to the step-0 probes and run to the last
    probes' mean pass rate (`flow.fitted_prediction`), at every sharing.

    Returns {"by_sharing": sharing -> `fitted_prediction`'s dict, "degenerate": the change
    closest to 0 over the sharings (the least any of them predicts), "target": the pass rate}.
    flow: `fitted_prediction`'s num_prompts, step_size and max_steps."""
    counts, samples = step_zero_counts(probes)
    target = float(np.mean([runs[-1]["pass_rate"] for runs in probes.values()]))
    by_sharing = {
        sharing: fitted_prediction(counts, samples, group_size, target, sharing, **flow)
        for sharing in sharings
    }
    least = min((fit["degenerate"] for fit in by_sharing.values()), key=abs)
    return {"by_sharing": by_sharing, "degenerate": least, "target": target}


def power_plan(pilot_changes, predicted: float, seeds_run: int, power: float = 0.8) -> dict:
    """Power before seeds: the per-seed SD of the pilot's changes of D, the seeds
    `core.stats.seeds_for_power` needs to tell the `predicted` change from 0, and how many of them
    the `seeds_run` leave out. Returns {"sd", "needed", "run", "cut"}."""
    sd = per_seed_sd(pilot_changes)
    known = np.isfinite(sd) and np.isfinite(predicted)
    needed = seeds_for_power(sd, predicted, power) if known else 0
    return {"sd": sd, "needed": needed, "run": seeds_run, "cut": max(0, needed - seeds_run)}
