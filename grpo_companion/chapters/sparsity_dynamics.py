r"""Chapter 6, section 3: does sparsity intensify over training? A run long enough to find out.

The paper's third claim has a premise and a consequence. The premise: training moves the pass
rates p_j of the training prompts toward 1. The consequence: then more groups are all-correct,
so more are degenerate, and the gradient gets sparser. A 20-step run on a large training set
never tests either. Here GRPO trains on a small fixed set of prompts for many epochs (it
memorises them: a test of how the degenerate fraction follows the training prompts' pass rates,
not of a run that learns the task), and every `probe_every` steps each training prompt's pass
rate is estimated from K = `probe_samples` extra completions that are never trained on
(`probe_outcomes`, which keeps every completion's outcome for `split_half_change`). From the
probe, section 1's theory predicts the degenerate fraction of the next steps' groups without
looking at them:

    Pr[all correct] = mean_j p_j^G,  Pr[all wrong] = mean_j (1 - p_j)^G,

estimated without bias from k_j correct of K by C(k_j, G) / C(K, G) (the chance that G draws
without replacement from the K probe completions are all correct: its expectation is p_j^G),
and the i.i.d. prediction f(mean_j p_j) made from the mean pass rate alone. `probed_run` trains
with the book's trainer, in segments between probes, with a checkpoint after each (an
interrupted run resumes where it stopped, probes included).

Units: the runs (seeds) are independent, the steps of one run are not; every interval is over
runs (`core.stats`).
"""

import hashlib
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from grpo_companion.core.exact import degenerate_rate_slope
from grpo_companion.core.stats import fitted_trend, mean_interval, seed_band
from grpo_companion.lm import gsm8k
from grpo_companion.lm.models import build_prompts
from grpo_companion.lm.parallel import map_runs
from grpo_companion.lm.rollouts import generate_rollouts
from grpo_companion.lm.trainer import GRPOConfig, held_out_accuracy, train

PROBES = "probes.json"


def probe_seed(seed: int, step: int) -> int:
    """Seed of the probe after `step`: a stream apart from the trainer's (`rollout_seed` uses
    [seed, 1, step])."""
    return int(np.random.SeedSequence([seed, 2, step]).generate_state(1)[0])


@torch.no_grad()
def probe_outcomes(
    model,
    tokenizer,
    prompts,
    golds,
    config: GRPOConfig,
    num_samples: int,
    seed: int,
    reward_fn=gsm8k.reward,
) -> list[list[int]]:
    """Whether each of `num_samples` fresh completions of each prompt is correct (1) or not (0):
    (num_prompts, num_samples), in the order sampled.

    Sampled like the trainer's rollouts (temperature, max_completion_length), with their own
    seed, and never trained on. The per-sample outcomes let a later analysis classify a prompt
    on some of its samples and measure it on the others (`split_half_change`).
    """
    probe = generate_rollouts(
        model, tokenizer, prompts, golds,
        num_generations=num_samples, max_completion_length=config.max_completion_length,
        temperature=config.temperature, seed=seed, batch_size=config.rollout_batch_size,
        compute_log_probs=False, reward_fn=reward_fn,
    )  # fmt: skip
    return probe.rewards.int().tolist()


def degenerate_estimates(correct, num_samples: int, group_size: int) -> dict:
    """Unbiased per-prompt estimates of p_j^G and (1 - p_j)^G from k_j correct of K:
    C(k_j, G) / C(K, G) and C(K - k_j, G) / C(K, G) (the chance that G draws without
    replacement from the K samples are all correct, or all wrong). correct: (J,) counts.
    Returns {"all_correct", "all_wrong", "degenerate"}, float arrays (J,); needs K >= G."""
    if num_samples < group_size:
        raise ValueError(f"need probe_samples >= G = {group_size} for the unbiased estimate")
    correct = np.asarray(correct)
    if correct.ndim != 1 or correct.min(initial=0) < 0 or correct.max(initial=0) > num_samples:
        raise ValueError(f"correct must be counts in [0, {num_samples}], got {correct}")
    total = math.comb(num_samples, group_size)
    all_correct = np.array([math.comb(int(k), group_size) / total for k in correct])
    all_wrong = np.array([math.comb(num_samples - int(k), group_size) / total for k in correct])
    return {
        "all_correct": all_correct,
        "all_wrong": all_wrong,
        "degenerate": all_correct + all_wrong,
    }


def predicted_degenerate(correct, num_samples: int, group_size: int) -> dict:
    """Degenerate fractions predicted from probe counts, without looking at training groups.

    correct: (num_prompts,) correct completions of `num_samples` per prompt (K >= G). Returns
    "pass_rate" (mean_j k_j / K), "all_correct" and "all_wrong" (unbiased estimates of
    mean_j p_j^G and mean_j (1 - p_j)^G: C(k, G) / C(K, G)), "degenerate" (their sum),
    "iid_degenerate" (f at the mean pass rate, the prediction that ignores the spread) and
    "share_near_one" (fraction of prompts with k_j / K >= 0.9).
    """
    estimates = degenerate_estimates(correct, num_samples, group_size)
    all_correct, all_wrong = estimates["all_correct"].mean(), estimates["all_wrong"].mean()
    p = np.mean(correct) / num_samples
    return {
        "pass_rate": float(p),
        "all_correct": float(all_correct),
        "all_wrong": float(all_wrong),
        "degenerate": float(all_correct + all_wrong),
        "iid_degenerate": float(p**group_size + (1 - p) ** group_size),
        "share_near_one": float(np.mean(np.asarray(correct) / num_samples >= 0.9)),
    }


def probed_run(
    model,
    tokenizer,
    train_data,
    eval_data,
    config: GRPOConfig,
    *,
    probe_every: int,
    probe_samples: int,
    checkpoint_dir: str | Path,
    reward_fn=gsm8k.reward,
    progress: bool = False,
    initial_accuracy: float | None = None,
) -> tuple[list[dict], list[dict]]:
    """Train `model` with GRPO, probing every training prompt's pass rate every `probe_every`
    steps (and before the first); returns (history, probes).

    history: `trainer.train`'s, held-out accuracy measured as in one unbroken run (before the
    first step, or `initial_accuracy` if given; every ``config.eval_every`` steps; at the last).
    probes: one dict per probe, {"step", "correct": per-prompt counts, "outcomes": per-prompt
    per-sample rewards (num_prompts, probe_samples), **predicted_degenerate(...)}, the probe at
    step s made after s updates. Each segment
    ends with a checkpoint in `checkpoint_dir` (with the probes so far in probes.json): calling
    again with the same arguments resumes after the last completed segment. With beta > 0 pass
    the initial model, as `train`'s resume requires.
    """
    checkpoint_dir = Path(checkpoint_dir)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    probes_file = checkpoint_dir / PROBES
    probes = json.loads(probes_file.read_text()) if probes_file.exists() else []
    prompts, golds = build_prompts(tokenizer, train_data)
    stops = list(range(0, config.max_steps, probe_every)) + [config.max_steps]
    # Every segment saves at its end (`train`'s until): multiples of probe_every, and max_steps.
    config = replace(config, save_steps=probe_every)
    history = None
    for stop in stops:
        if stop > 0:
            history = train(
                model, tokenizer, train_data, eval_data, config, until=stop,
                checkpoint_dir=checkpoint_dir, resume=True, reward_fn=reward_fn, progress=progress,
                initial_accuracy=initial_accuracy,
            )  # fmt: skip
        if any(probe["step"] == stop for probe in probes):
            continue  # made before an interruption; the checkpoint holds the weights after it
        seed = probe_seed(config.seed, stop)
        outcomes = probe_outcomes(
            model, tokenizer, prompts, golds, config, probe_samples, seed, reward_fn
        )
        correct = [sum(row) for row in outcomes]
        prediction = predicted_degenerate(correct, probe_samples, config.num_generations)
        probes.append({"step": stop, "correct": correct, "outcomes": outcomes, **prediction})
        tmp = probes_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(probes))
        tmp.replace(probes_file)
    return history, probes


def observed_vs_predicted(history: list[dict], probes: list[dict]) -> pd.DataFrame:
    """For each probe but the last: the prediction it makes, and the fractions the training
    groups of the following steps (up to the next probe) actually had.

    Columns: step (of the probe), pass_rate, share_near_one, predicted_{all_correct, all_wrong,
    degenerate}, iid_degenerate, observed_{all_correct, all_wrong, degenerate,
    zero_advantage_tokens} (the last: the share of completion tokens with advantage 0), and
    eval_accuracy, eval_accuracy_next: the held-out greedy accuracy after the probe's step and
    after the next probe's (NaN where the history has none: `probed_run` measures it before
    the first step, every ``eval_every`` steps and at the last).
    """
    accuracy = {r["step"]: r["eval_accuracy"] for r in history}
    rows = []
    for probe, following in zip(probes[:-1], probes[1:]):
        steps = [r for r in history if probe["step"] < r["step"] <= following["step"]]
        rows.append({
            "step": probe["step"], "pass_rate": probe["pass_rate"],
            "share_near_one": probe["share_near_one"],
            **{f"predicted_{k}": probe[k] for k in ("all_correct", "all_wrong", "degenerate")},
            "iid_degenerate": probe["iid_degenerate"],
            "observed_all_correct": np.mean([r["all_correct"] for r in steps]),
            "observed_all_wrong": np.mean([r["all_wrong"] for r in steps]),
            "observed_degenerate": np.mean([r["frac_reward_zero_std"] for r in steps]),
            "observed_zero_advantage_tokens": np.mean(
                [r["zero_advantage_token_share"] for r in steps]
            ),
            "eval_accuracy": _or_nan(accuracy.get(probe["step"])),
            "eval_accuracy_next": _or_nan(accuracy.get(following["step"])),
        })  # fmt: skip
    return pd.DataFrame(rows)


def _or_nan(value) -> float:
    return np.nan if value is None else float(value)


def dynamics_summary(tables: dict, prefix: str) -> dict:
    """What the probed runs of one starting point show, with intervals over seeds.

    tables: seed -> `observed_vs_predicted` table (same probe steps in every run). Records
    "<prefix>_pass_rate_{first,last}" (mean over seeds of the first and last probes),
    "<prefix>_pass_rate_gain{,_low,_high}" (last minus first, per seed), the same four for
    "share_near_one" (training prompts with pass rate >= 0.9); for each kind of group
    (all_correct, all_wrong, degenerate) "<prefix>_<kind>_{first,last}" (observed fractions of
    the first and last rows) and "<prefix>_<kind>_slope{,_low,_high}" (least-squares slope per
    step of the observed fraction, `fitted_trend`); the same for
    "<prefix>_degenerate_change" (last minus first row), and "<prefix>_prediction_error" (mean
    absolute observed - predicted degenerate fraction over rows and seeds) with
    "<prefix>_iid_error" (the same for the i.i.d. prediction), and
    "<prefix>_zero_advantage_tokens_{first,last}" (the share of zero-advantage completion tokens
    of the first and last rows), and "<prefix>_eval_accuracy_{first,last}" (held-out greedy
    accuracy before training and after the last step, mean over seeds) with
    "<prefix>_eval_accuracy_change{,_low,_high}" (last minus first, interval over seeds).
    """
    runs = list(tables.values())
    steps = runs[0]["step"].to_numpy()
    records = {}

    def column(name):
        return np.stack([table[name].to_numpy() for table in runs])  # (num_seeds, num_rows)

    for name in ("pass_rate", "share_near_one"):
        values = column(name)
        records[f"{prefix}_{name}_first"] = values[:, 0].mean()
        records[f"{prefix}_{name}_last"] = values[:, -1].mean()
        gain = seed_band(values[:, -1:] - values[:, :1])
        for key, suffix in (("mean", ""), ("low", "_low"), ("high", "_high")):
            records[f"{prefix}_{name}_gain{suffix}"] = gain[key][0]
    for kind in ("all_correct", "all_wrong", "degenerate"):
        observed = column(f"observed_{kind}")
        trend = fitted_trend(steps, observed)
        records[f"{prefix}_{kind}_slope"] = trend["mean"]
        records[f"{prefix}_{kind}_slope_low"] = trend["low"]
        records[f"{prefix}_{kind}_slope_high"] = trend["high"]
        records[f"{prefix}_{kind}_first"] = observed[:, 0].mean()
        records[f"{prefix}_{kind}_last"] = observed[:, -1].mean()
    change = seed_band(column("observed_degenerate")[:, -1:] - column("observed_degenerate")[:, :1])
    records[f"{prefix}_degenerate_change"] = change["mean"][0]
    records[f"{prefix}_degenerate_change_low"] = change["low"][0]
    records[f"{prefix}_degenerate_change_high"] = change["high"][0]
    observed = column("observed_degenerate")
    records[f"{prefix}_prediction_error"] = np.abs(observed - column("predicted_degenerate")).mean()
    records[f"{prefix}_iid_error"] = np.abs(observed - column("iid_degenerate")).mean()
    zero_tokens = column("observed_zero_advantage_tokens")
    records[f"{prefix}_zero_advantage_tokens_first"] = zero_tokens[:, 0].mean()
    records[f"{prefix}_zero_advantage_tokens_last"] = zero_tokens[:, -1].mean()
    before, after = column("eval_accuracy")[:, :1], column("eval_accuracy_next")[:, -1:]
    records[f"{prefix}_eval_accuracy_first"] = before.mean()
    records[f"{prefix}_eval_accuracy_last"] = after.mean()
    eval_change = seed_band(after - before)
    for key, suffix in (("mean", ""), ("low", "_low"), ("high", "_high")):
        records[f"{prefix}_eval_accuracy_change{suffix}"] = eval_change[key][0]
    return records


def split_half_change(first, last, group_size: int) -> dict:
    """The change of D = mean_j f(p_j) between two probes, for the prompts below and above 1/2.

    first: (J, K) outcomes of the first probe, last: (J, K') of the last (`probe_outcomes`).
    Each prompt is classified on the first half of its first-probe samples (p_A < 1/2: "low",
    p_A > 1/2: "high", p_A = 1/2 left out) and measured on the other half (p_B, and the unbiased
    `degenerate_estimates`) and on the last probe: classifying and measuring on the same samples
    would fake a rise of the low prompts by regression to the mean. Returns floats
    "<side>_change" (mean over the side of f_last - f_B; nan for an empty side or
    "<side>_pass_rate_change", "<side>_prompts", and "criterion", mean_j f'(p_A,j)
    (p_last,j - p_B,j): the first-order change of D (`exact.degenerate_rate_slope`). D is
    estimated at "group_size", G, or at the half's size when it holds fewer than G samples (an
    unbiased estimate of p^G needs G samples).
    """
    first, last = np.asarray(first), np.asarray(last)
    half = first.shape[1] // 2
    classify, measure = first[:, :half].mean(axis=1), first[:, half:]
    p_before, p_after = measure.mean(axis=1), last.mean(axis=1)
    records = {"criterion": float(np.mean(
        degenerate_rate_slope(classify, group_size) * (p_after - p_before)
    ))}  # fmt: skip
    size = min(group_size, measure.shape[1], last.shape[1])
    records["group_size"] = size
    before = degenerate_estimates(measure.sum(axis=1), measure.shape[1], size)
    after = degenerate_estimates(last.sum(axis=1), last.shape[1], size)
    change = after["degenerate"] - before["degenerate"]
    for side, members in (("low", classify < 0.5), ("high", classify > 0.5)):
        records[f"{side}_prompts"] = int(members.sum())
        records[f"{side}_pass_rate_change"] = (
            float((p_after - p_before)[members].mean()) if members.any() else np.nan
        )
        records[f"{side}_change"] = float(change[members].mean()) if members.any() else np.nan
    return records


def split_summary(probes: dict, group_size: int, prefix: str) -> dict:
    """`split_half_change` from each seed's first to last probe, with intervals over seeds.

    probes: seed -> `probed_run` probes (with "outcomes"). Records
    "<prefix>_split_{low,high}_change{,_low,_high}" and
    "<prefix>_split_{low,high}_pass_rate_change{,_low,_high}" (None unless every seed has prompts
    on that side), "<prefix>_split_{low,high}_prompts" (mean over seeds),
    "<prefix>_flow_criterion{,_low,_high}", "<prefix>_split_group_size" (the G of the estimates)
    and "<prefix>_split_df" (seeds - 1, the t interval's degrees of freedom).
    """
    runs = [split_half_change(p[0]["outcomes"], p[-1]["outcomes"], group_size)
            for p in probes.values()]  # fmt: skip
    records = {
        f"{prefix}_split_df": len(runs) - 1,
        f"{prefix}_split_group_size": min(run["group_size"] for run in runs),
    }

    def band(name, key):
        values = [run[name] for run in runs]
        interval = {"mean": None, "low": None, "high": None}
        if np.all(np.isfinite(values)):  # else a side empty in some seed: nothing measured
            interval = mean_interval(values)
        records[key] = interval["mean"]
        records[f"{key}_low"], records[f"{key}_high"] = interval["low"], interval["high"]

    band("criterion", f"{prefix}_flow_criterion")
    for side in ("low", "high"):
        band(f"{side}_change", f"{prefix}_split_{side}_change")
        band(f"{side}_pass_rate_change", f"{prefix}_split_{side}_pass_rate_change")
        records[f"{prefix}_split_{side}_prompts"] = float(
            np.mean([run[f"{side}_prompts"] for run in runs])
        )
    return records


def interval_text(records: dict, key: str) -> str:
    """ "+0.012 [-0.050, +0.074]" for records[key] and its interval, or the words for what is
    missing: the chapter glues this where a side of the split may be empty."""
    if records.get(key) is None:
        return "not measured (a seed had no prompt on this side)"
    if records.get(f"{key}_low") is None:
        return f"{records[key]:+.3f} (no interval from one seed)"
    return f"{records[key]:+.3f} [{records[f'{key}_low']:+.3f}, {records[f'{key}_high']:+.3f}]"


def first_probe_counts(probes: dict) -> tuple[np.ndarray, int]:
    """Every seed's first-probe counts, pooled: (seeds * J,), and K."""
    runs = list(probes.values())
    return np.concatenate([run[0]["correct"] for run in runs]), len(runs[0][0]["outcomes"][0])


def long_run_problems(num_prompts: int, min_steps: int, seed: int):
    """The fixed training set of a long run: the first `num_prompts` generated arithmetic
    training problems whose worked answer has at least `min_steps` lines (0: any problem)."""
    candidates = gsm8k.load_gsm8k(
        "train", source="arithmetic", num_examples=20 * num_prompts, seed=seed
    )
    # A list, not Dataset.filter: that one draws a progress bar on stderr.
    rows = [i for i, answer in enumerate(candidates["answer"]) if answer.count("\n") >= min_steps]
    if len(rows) < num_prompts:
        raise ValueError(f"only {len(rows)} problems with {min_steps}+ steps; ask for fewer")
    return candidates.select(rows[:num_prompts])


def run_fingerprint(*parts) -> str:
    """A folder name for a long run's checkpoints: changes with anything that changes the run,
    the library's source included, so that a resumed run never continues a stale one."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py")):
        digest.update(source.read_bytes())
    digest.update(json.dumps(parts, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def probed_runs(
    load_model, tokenizer, starts: dict, eval_data, config: GRPOConfig, seeds, *,
    num_prompts: int, probe_every: int, probe_samples: int, run_dir: str | Path, model_key: str,
    progress: bool = True, workers: int | None = None,
) -> tuple[dict, dict]:  # fmt: skip
    """Every starting point's probed runs: (tables, probes), start -> {seed: its
    `observed_vs_predicted` table} and start -> {seed: its `probed_run` probes}.

    starts: name -> the minimum number of worked steps of its training problems
    (`long_run_problems`); load_model() returns a fresh copy of the initial policy, which
    `model_key` names (e.g. `TinyLlamaSpec.cache_key()`). Each run
    checkpoints under run_dir/<start>_seed<seed>_<fingerprint>: an interrupted build resumes
    it, and a finished one is read back. The runs go to `workers` one-thread processes
    (`lm.parallel.map_runs`; None: one per core).
    """
    # Every run starts from the same model: one greedy evaluation for all (as in one run).
    initial_accuracy = held_out_accuracy(load_model(), tokenizer, eval_data, config)
    problems = {
        start: long_run_problems(num_prompts, min_steps, config.seed)
        for start, min_steps in starts.items()
    }

    def run(key):
        start, seed = key
        run_config = replace(config, seed=seed)
        fingerprint = run_fingerprint(
            vars(run_config), problems[start]["question"], eval_data["question"],
            probe_every, probe_samples, model_key,
        )  # fmt: skip
        return probed_run(
            load_model(), tokenizer, problems[start], eval_data, run_config,
            probe_every=probe_every, probe_samples=probe_samples, progress=False,
            checkpoint_dir=Path(run_dir) / f"{start}_seed{seed}_{fingerprint}",
            initial_accuracy=initial_accuracy,
        )  # fmt: skip

    keys = [(start, seed) for start in starts for seed in seeds]
    runs = map_runs(run, keys, workers=workers, desc="long runs", progress=progress)
    tables = {start: {} for start in starts}
    all_probes = {start: {} for start in starts}
    for (start, seed), (history, probes) in runs.items():
        tables[start][seed] = observed_vs_predicted(history, probes)
        all_probes[start][seed] = probes
    return tables, all_probes
