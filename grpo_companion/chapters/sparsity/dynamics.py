r"""Chapter 6, section 3: a probed GRPO run, for whether sparsity intensifies over training.

Every `probe_every` steps each training prompt's pass rate is estimated from K = `probe_samples`
extra completions that are never trained on (`probe_outcomes`, which keeps every completion's
outcome for `split_half_change`). From a probe, section 1's theory predicts the degenerate
fraction without looking at the groups: Pr[all correct] = mean_j p_j^G and Pr[all wrong] =
mean_j (1 - p_j)^G, each estimated without bias from k_j correct of K by C(k_j, G) / C(K, G)
(`degenerate_estimates`). `probed_run` trains with the book's trainer in segments between
probes, with a checkpoint after each (an interrupted run resumes where it stopped, probes
included); `easy_start` runs it from prompts the policy mostly solves, the claim's regime.

Units: the runs (seeds) are independent, the steps of one run are not; every interval is over
runs (`core.stats`).

Chapter: :doc:`/book/06_sparsity`
"""

import hashlib
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from grpo_companion.core.exact import degenerate_rate, degenerate_rate_slope
from grpo_companion.core.stats import mean_interval
from grpo_companion.lm import gsm8k
from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.gsm8k import build_prompts
from grpo_companion.lm.rollouts import generate_rollouts
from grpo_companion.lm.trainer import train

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
        "iid_degenerate": float(degenerate_rate([p], group_size)[0]),
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


def _or_nan(value) -> float:
    return np.nan if value is None else float(value)


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


def run_fingerprint(*parts) -> str:
    """A folder name for a long run's checkpoints: changes with anything that changes the run,
    the library's source included, so that a resumed run never continues a stale one."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py")):
        digest.update(source.read_bytes())
    digest.update(json.dumps(parts, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]
