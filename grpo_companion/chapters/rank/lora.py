r"""Chapter 7, section 10: LoRA adapters of rank r against full fine-tuning under GRPO.

A LoRA adapter (`peft`) freezes a weight W (out, in) and trains W' = W + s B A, A (r, in)
random, B (out, r) = 0 at the start, s = alpha / r, so the adapted model starts as the base
model. Every attention and MLP projection gets one (`accumulated.LAYER_TYPES`, as in "LoRA
Without Regret" and TRL's `peft_config` examples); embeddings, norms and the head stay frozen.

The same GRPO step: `trainer.grpo_step` steps every parameter with a gradient, and a LoRA
model's loss is that of its merged weights W', so dL/dB = s (dL/dW') A^T and
dL/dA = s B^T (dL/dW') (`lora_chain_rule`, checked on a step of the trainer).

The comparison: every arm (full fine-tuning; each rank) trains from the same warm start with
the same settings, steps and paired seeds (the same rollout budget), at its own learning rate
chosen on validation problems over tuning seeds (`tuning_choice`); then the held-out gain and
each adapter's paired difference from full fine-tuning, with a Student-t interval over seeds
(`comparison_records`). The section's text gives the prediction and the related results.

Chapter: :doc:`/book/07_rank`
"""

import warnings

import numpy as np
import pandas as pd
import torch
from peft import LoraConfig, get_peft_model
from scipy import stats
from torch import Tensor, nn

from grpo_companion.chapters.rank.accumulated import (
    LAYER_TYPES,
    changed_fraction,
    matrix_spectra,
    projection_names,
    top_share,
    truncated_weights,
)
from grpo_companion.core.stats import accuracy_noise, grid_choice, mean_interval
from grpo_companion.lm import gsm8k
from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.evaluation import held_out_accuracy
from grpo_companion.lm.gsm8k import build_prompts
from grpo_companion.lm.parallel import map_runs, run_store
from grpo_companion.lm.trainer import grpo_step, reference_and_optimizer

FULL = "full"
CLAIM_RANK = (
    2  # the adapter the ledger reads: "r <= 2" at its largest, which holds rank 1's updates
)


def arm_name(rank: int) -> str:
    """An arm's name: "full" for rank 0 (full fine-tuning), "r<r>" for an adapter of rank r."""
    return FULL if rank == 0 else f"r{rank}"


def lora_config(rank: int, alpha: float) -> LoraConfig:
    """peft's LoraConfig: rank `rank`, scale alpha / rank, on every projection of
    `LAYER_TYPES`, no dropout (the trainer keeps the model in eval mode), no biases."""
    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(LAYER_TYPES),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )


def add_adapters(model: nn.Module, rank: int, alpha: float, seed: int) -> nn.Module:
    """`model` with LoRA adapters (`lora_config`), A drawn under torch seed `seed` without
    touching the caller's RNG; peft's PeftModel, the base weights frozen."""
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft reads transformers' deprecated alias `is_gradient_checkpointing`.
        warnings.filterwarnings(
            "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
        )
        torch.manual_seed(seed)
        return get_peft_model(model, lora_config(rank, alpha))


def lora_chain_rule(weight_gradient: Tensor, lora_a: Tensor, lora_b: Tensor,
                    scaling: float) -> dict[str, Tensor]:  # fmt: skip
    """{"A": s B^T G, "B": s G A^T}: the gradients of W' = W + s B A with respect to A `(r, in)`
    and B `(out, r)`, from G = dL/dW' `(out, in)`."""
    return {"A": scaling * lora_b.T @ weight_gradient, "B": scaling * weight_gradient @ lora_a.T}


def grpo_run(
    model, tokenizer, train_data, eval_data, config: GRPOConfig, *, reward_fn=gsm8k.reward,
    track_every: int = 0, truncation_ranks=(),
) -> dict:  # fmt: skip
    """Train `model` (in place) for ``config.max_steps`` steps of `trainer.grpo_step`, then
    measure its held-out greedy accuracy on `eval_data` (`evaluation.held_out_accuracy`).

    Returns "accuracy", "parameters" (how many it trains) and "history" (per step: reward,
    frac_reward_zero_std, grad_norm). With `track_every` > 0 also "spectra" (`matrix_spectra` of
    every projection every `track_every` steps and at the last), "changed" (`changed_fraction`
    of all parameters, "float32" and "bfloat16") and "truncated_accuracy" ({r: held-out accuracy
    with each projection at `truncated_weights`(r), every other parameter trained}).
    """
    prompts, golds = build_prompts(tokenizer, train_data)
    reference, optimizer = reference_and_optimizer(model, config)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()} if track_every else {}
    names = projection_names(model) if track_every else []
    history, spectra = [], []
    for step in range(1, config.max_steps + 1):
        record = grpo_step(
            model, tokenizer, reference, optimizer, prompts, golds, config, step, reward_fn
        )
        history.append({key: record[key] for key in ("step", "reward", "frac_reward_zero_std",
                                                      "grad_norm")})  # fmt: skip
        if track_every and (step % track_every == 0 or step == config.max_steps):
            spectra += matrix_spectra(model, {name: initial[name] for name in names}, step)
    result = {
        "accuracy": held_out_accuracy(model, tokenizer, eval_data, config, reward_fn),
        "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "history": history,
    }
    if track_every:
        parameters = dict(model.named_parameters())
        final = {name: p.detach().clone() for name, p in parameters.items()}
        result["spectra"] = spectra
        result["changed"] = {
            "float32": changed_fraction(initial, final),
            "bfloat16": changed_fraction(initial, final, torch.bfloat16),
        }
        result["truncated_accuracy"] = {}
        for rank in truncation_ranks:
            truncated = truncated_weights({name: initial[name] for name in names}, final, rank)
            with torch.no_grad():
                for name in names:
                    parameters[name].copy_(truncated[name])
            result["truncated_accuracy"][rank] = held_out_accuracy(
                model, tokenizer, eval_data, config, reward_fn
            )
            with torch.no_grad():
                for name in names:
                    parameters[name].copy_(final[name])
    return result


def practice_runs(load_model, tokenizer, train_data, eval_data, grpo: dict, runs: dict, *,
                  lora_alpha: float, track_every: int = 0, truncation_ranks=(),
                  reward_fn=gsm8k.reward, workers: int | None = None,
                  keep: str | None = None) -> dict:  # fmt: skip
    """{key: `grpo_run` result} of `runs` ({key: (rank, learning_rate, seed)}): each run takes a
    fresh `load_model()`, adds adapters of `rank` seeded by its seed (none for rank 0, full
    fine-tuning) and trains with ``GRPOConfig(**grpo, learning_rate, seed)``, in one-thread
    workers (`lm.parallel.map_runs`: the same results as one run after another). Only the
    full-fine-tuning runs are tracked (`track_every`, `truncation_ranks`). `keep`: a folder under
    which finished runs are stored and read back on the next call (`lm.parallel.run_store`,
    named by every input here and the starting weights)."""

    def run(key):
        rank, learning_rate, seed = runs[key]
        model = load_model()
        if rank:
            model = add_adapters(model, rank, lora_alpha, seed)
        config = GRPOConfig(**grpo, learning_rate=learning_rate, seed=seed)
        tracked = {"track_every": track_every, "truncation_ranks": truncation_ranks}
        return grpo_run(model, tokenizer, train_data, eval_data, config, reward_fn=reward_fn,
                        **(tracked if rank == 0 else {}))  # fmt: skip

    store = None
    if keep is not None:
        store = run_store(keep, grpo, runs, lora_alpha, track_every, tuple(truncation_ranks),
                          reward_fn, train_data, eval_data, load_model())  # fmt: skip
    return map_runs(run, list(runs), workers=workers, keep=store)


def step_gradient_spectra(model, tokenizer, train_data, config: GRPOConfig, steps, *,
                          reward_fn=gsm8k.reward) -> list[dict]:  # fmt: skip
    """The gradient rows of `accumulated.matrix_spectra` for one `trainer.grpo_step` of `model`
    itself at each of `steps` (the batches a run with ``config.seed`` sees at those steps), the
    model left unchanged (a zero learning rate). ``config.beta`` must be 0."""
    if config.beta:
        raise ValueError("the pilot keeps no KL reference: beta must be 0")
    prompts, golds = build_prompts(tokenizer, train_data)
    parameters = dict(model.named_parameters())
    initial = {name: parameters[name].detach() for name in projection_names(model)}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model.eval()
    rows = []
    for step in steps:
        grpo_step(model, tokenizer, None, optimizer, prompts, golds, config, step, reward_fn)
        rows += [row for row in matrix_spectra(model, initial, step) if row["kind"] == "gradient"]
    model.zero_grad(set_to_none=True)
    return rows


def mean_top_shares(rows: list[dict], ranks) -> dict[int, float]:
    """{r: mean over the rows (matrices and steps) of `top_share`(singular values, r)}: the share
    of a step's gradient energy that the best rank-r subspace of each matrix holds."""
    return {
        rank: float(
            np.mean(
                [
                    top_share(torch.as_tensor(row["singular_values"]), rank).item()
                    for row in rows
                    if row["singular_values"] is not None
                ]
            )
        )
        for rank in ranks
    }


def predicted_difference(top_share_r: float, reference_gain: float) -> float:
    """-(1 - c_r) g: the held-out gain an adapter of rank r loses against full fine-tuning if
    its progress is the share c_r of each step's gradient energy that r directions per matrix
    hold (`mean_top_shares`), g > 0 full fine-tuning's gain; 0 when g <= 0 (no gain to lose)."""
    return 0.0 if reference_gain <= 0 else -(1 - top_share_r) * reference_gain


def seeds_for_margin(sd: float, margin: float, power: float = 0.8, confidence: float = 0.95,
                     max_seeds: int = 100_000) -> int | None:  # fmt: skip
    """Fewest paired seeds n >= 2 whose `confidence` t interval of a mean difference that is
    truly 0 lies above -`margin` with probability `power`: (t_{(1+c)/2, n-1} + t_{power, n-1})
    sd / sqrt(n) <= margin. None when `max_seeds` do not suffice or sd, margin are not finite
    and positive (0 when sd is 0)."""
    if not (np.isfinite(sd) and np.isfinite(margin)) or margin <= 0 or sd < 0:
        return None
    if sd == 0:
        return 0
    quantile = (1 + confidence) / 2
    for n in range(2, max_seeds + 1):
        if (stats.t.ppf(quantile, n - 1) + stats.t.ppf(power, n - 1)) * sd / np.sqrt(n) <= margin:
            return n
    return None


def tuning_choice(results: dict, grids: dict[str, list[float]], start: float | None = None,
                  num_problems: int = 1) -> dict:  # fmt: skip
    """Per arm of `grids` ({arm: learning rates}): the mean validation accuracy at each rate over
    the tuning seeds ("means"), the rate with the highest mean ("learning_rate", "index"; the
    lowest rate wins a tie), whether it lies strictly inside the grid ("inside") and, given the
    warm start's validation accuracy `start` on `num_problems` problems, whether that rate beat
    it by more than two binomial standard errors ("learned", `core.stats.grid_choice`; None
    without `start`). `results`: {(arm, learning_rate, seed): `grpo_run` result}."""
    margin = 0.0 if start is None else accuracy_noise(start, num_problems)
    choice = {}
    for arm, grid in grids.items():
        means = [
            float(
                np.mean(
                    [
                        r["accuracy"]
                        for (a, rate, _), r in results.items()
                        if a == arm and rate == value
                    ]
                )
            )
            for value in grid
        ]
        choice[arm] = grid_choice(grid, means, start, margin)
    return choice


def paired_accuracies(results: dict, arm: str) -> dict[int, float]:
    """{seed: held-out accuracy} of one arm's runs; `results`: {(arm, rate, seed): result}."""
    return {seed: r["accuracy"] for (a, _, seed), r in results.items() if a == arm}


def comparison_records(results: dict, arms: list[str], initial_accuracy: float,
                       top_shares: dict[str, float],
                       confidence: float = 0.95) -> tuple[dict, pd.DataFrame]:  # fmt: skip
    """The comparison's numbers, keys "lora_<arm>_..." (`arm_name`: full, r1, ...), and a table
    by arm.

    Per arm: "_gain" (held-out accuracy after training minus `initial_accuracy`, mean over the
    evaluation seeds) with "_gain_low", "_gain_high" (its t interval). Per adapter (every arm but
    full), paired by seed: "_minus_full" (+ "_low", "_high", "_sd"); the rank model's predicted
    difference "predicted_lora_<arm>_minus_full", `predicted_difference` from the adapter's
    energy share `top_shares[arm]` (recorded before the runs) and full fine-tuning's measured
    gain; its margin (minus that) and decision point (half way to 0), "lora_<arm>_margin" and
    "lora_<arm>_decision_point"; "_minus_full_words", the interval read against the decision
    point (`margin_words`, without the gates); "lora_seeds_needed_<arm>" (`seeds_for_margin`
    at the measured sd and half the margin). "lora_seeds_run".
    """
    records, rows = {}, []
    reference = paired_accuracies(results, FULL)
    seeds = sorted(reference)
    records["lora_seeds_run"] = len(seeds)
    full_gain = float(np.mean([reference[s] - initial_accuracy for s in seeds]))
    for arm in arms:
        accuracy = paired_accuracies(results, arm)
        gain = mean_interval([accuracy[s] - initial_accuracy for s in seeds], confidence)
        records |= {f"lora_{arm}_gain": gain["mean"], f"lora_{arm}_gain_low": gain["low"],
                    f"lora_{arm}_gain_high": gain["high"]}  # fmt: skip
        row = {"arm": arm, "held-out gain": gain["mean"], "gain low": gain["low"],
               "gain high": gain["high"]}  # fmt: skip
        if arm != FULL:
            values = [accuracy[s] - reference[s] for s in seeds]
            difference = mean_interval(values, confidence)
            sd = float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")
            predicted = predicted_difference(top_shares[arm], full_gain)
            key = f"lora_{arm}_minus_full"
            records |= {key: difference["mean"], f"{key}_low": difference["low"],
                        f"{key}_high": difference["high"], f"{key}_sd": sd,
                        f"predicted_{key}": predicted, f"lora_{arm}_margin": -predicted,
                        f"lora_{arm}_decision_point": predicted / 2}  # fmt: skip
            records[f"{key}_words"] = reading_words(
                difference["low"], difference["high"], -predicted
            )
            needed = seeds_for_margin(sd, -predicted / 2, confidence=confidence)
            records[f"lora_seeds_needed_{arm}"] = needed
            row |= {"minus full": difference["mean"], "difference low": difference["low"],
                    "difference high": difference["high"], "predicted": predicted}  # fmt: skip
        rows.append(row)
    return records, pd.DataFrame(rows).set_index("arm")


MARGIN_WORDS = {
    "edge": "cannot decide: a chosen learning rate lies at an edge of its grid, so the arms' best "
    "rates were not found",
    "no learning": "cannot decide: full fine-tuning, the reference, did not learn (its gain's "
    "interval does not lie above 0)",
    "no margin": "cannot decide: the prediction gives no margin (no gain for full fine-tuning "
    "to lose)",
    "none": "has no interval (fewer than two seeds), so it cannot decide",
    "below": "lies below the decision point, nearer the rank model's loss than the claim's 0: the "
    "adapter falls short of full fine-tuning",
    "reaches": "lies above the decision point and holds 0 (or lies above it): the adapter reaches "
    "full fine-tuning's gain",
    "short": "lies above the decision point but below 0: measurably short of full fine-tuning, by "
    "less than half the rank model's loss, so the claim is neither reproduced nor contradicted",
    "wide": "reaches across the decision point: too wide to tell the claim's 0 from the rank "
    "model's loss",
}


def reading_words(low, high, margin: float) -> str:
    """The paired interval [low, high] of adapter minus full fine-tuning read against the
    decision point -`margin` / 2, half way between the claim's difference (0) and the rank
    model's (-`margin`), in words (`MARGIN_WORDS`)."""
    if not margin > 0:
        return MARGIN_WORDS["no margin"]
    if low is None or high is None or not (np.isfinite(low) and np.isfinite(high)):
        return MARGIN_WORDS["none"]
    if high < -margin / 2:
        return MARGIN_WORDS["below"]
    if low > -margin / 2:
        return MARGIN_WORDS["reaches" if high >= 0 else "short"]
    return MARGIN_WORDS["wide"]


def margin_words(low, high, margin: float, reference_gain_low, rates_inside: bool) -> str:
    """The ledger's rule in words: its gates first (both arms' chosen rates strictly inside
    their grids, `rates_inside`; full fine-tuning learned, `reference_gain_low`, its gain's
    lower end, above 0), then `reading_words`."""
    if not rates_inside:
        return MARGIN_WORDS["edge"]
    if reference_gain_low is None or not reference_gain_low > 0:
        return MARGIN_WORDS["no learning"]
    return reading_words(low, high, margin)
