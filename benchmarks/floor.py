"""The testbed against the arithmetic floor: sampling, the update and a whole GRPO step.

Targets: sampling (the lean sampler, `lm.sampler`) within 2x its floor; a whole GRPO step
(`trainer.grpo_step` sampling with it) within 1.3x its floor and at or below 0.5 of TRL's step.

The floor of a piece of work is its arithmetic at this machine's rate for a large matrix
product: a 2048 x 2048 product on `--threads` threads (1 by default), best CPU time of three,
measured at the start and again after each round (warm-up rounds too); each section's floor
takes the highest rate measured by the time it prints. The host's rate drifts (by 10-20% within
an hour, and more for seconds at a time), so a rate measured once could be a slow moment's and
flatter the ratios; the best one never does.
FLOPs (two per multiply-add) of the model's forward pass per token position (`forward_flops`):
    2 * (the decoder layers' matrix parameters)            the projections and the MLP
  + 4 * layers * context * heads * head_dim                 QK^T and attention x V
  + 2 * (the lm head's parameters)                          at positions whose logits are used
(norms, rotary, softmax, residuals and the embedding lookup are not counted). The positions are
what the batch needs at least: each prompt's real tokens once (no padding; its last token's
logits serve its whole group), then each completion's tokens but its last, a position of
context prompt + t + 1 for completion token t. Sampling costs one forward pass of those
positions (F); the update, forward and backward of the loss, 3 F (the backward pass computes
the gradients of the activations and of the weights, two products for each of the forward's);
a step, sampling + the reference model's forward (beta > 0) + the update = 5 F. AdamW's
elementwise update (about 10 operations per parameter) is left out.

The batch is chapter 11's (`grpo_step_vs_trl.CONFIG`): 16 arithmetic problems x G = 8, at most
48 new tokens, temperature 1, beta 0.04, on the tiny Llama. Sampling times `rollouts._generate`
on all 128 rows in one call, with `sampler="lean"` and `"generate"` (`generate_groups`), beside
`rollout_throughput.plain_generate` (one `model.generate` call, the same seed: the same tokens,
checked); the floor counts the lean sampler's tokens. The step section runs TRL's `GRPOTrainer`
as `grpo_step_vs_trl.py` does, and after each TRL step one of our steps as the book runs it
(the lean sampler; the update in length buckets, `GRPOConfig.length_bucket_size`) and one as it
ran before both (`generate_groups`; every completion padded to the longest), each side on its
own copy of the model (A B C A B C ...; the first round is a warm-up); the update
is the time inside our step's forward pass (`completion_logits`), `token_log_probs`,
`grpo_loss` and `backward`. Times are CPU seconds of the process (`time.process_time`), medians
over the rounds; the load average is printed, since the machine may be shared.

`--profile` (one thread only) then runs the lean sampling and one more lean step under
`torch.profiler` and splits their time by kernel (`time_by_kind`): the matrix products,
attention (sdpa's kernels) and the rest, each over the same floor. It prints the rate the
products ran at, and their FLOPs over the floor's products' (the floor without its attention
term, which sdpa computes): how fast this CPU multiplies the step's own matrices (from a few
rows to several hundred against a 256-wide model) beside a 2048 x 2048 product, and how much
work the products do that the floor does not count (prompt padding, the last prompt token run
once per completion, padding within a length bucket, finished rows kept as passengers). An
operator's time is the profiler's, by the wall clock on its thread: the split is read against
the process's CPU time, and a warning is printed when the two differ by more than 5% (other
work shared the core). The profiler's overhead lands in the rest and, for the many tiny
products of decoding, partly in the products' own time.

    pip install -r benchmarks/requirements.txt   # TRL, as for grpo_step_vs_trl.py
    python benchmarks/floor.py [--repeats 3 --threads 1 --no-trl --profile]
    python benchmarks/floor.py --quick       # smoke run: the smoke model, one round, no TRL
"""

import grpo_companion  # noqa: F401  first: pins the kernels before torch and numpy load

# isort: split

import argparse
import dataclasses
import os
import statistics
import sys
import time
import warnings
from contextlib import ExitStack
from unittest import mock

import torch
from transformers.utils import logging as transformers_logging

from grpo_companion.lm import gsm8k, rollouts, trainer
from grpo_companion.lm.gsm8k import build_prompts
from grpo_companion.lm.tiny_llama import TinyLlamaSpec, load_tiny_llama

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Exits with code 2, saying so, if TRL is not installed.
from grpo_step_vs_trl import CONFIG, interleaved_trl  # noqa: E402
from rollout_throughput import SMOKE_SPEC, Stopwatch, plain_generate  # noqa: E402

TARGETS = {"sampling": 2.0, "step": 1.3, "step / TRL": 0.5}
MATMUL_SIZE = 2048


def matmul_rate(size: int = MATMUL_SIZE, repeats: int = 3) -> float:
    """FLOP/s of a (size x size) @ (size x size) float32 product, best CPU time of `repeats`."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        a @ b
        best = min(best, time.process_time() - start)
    return 2 * size**3 / best


# The matrix products' kernels; the attention's are the operators named "...attention..."
PRODUCTS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")
KINDS = ("products", "attention", "the rest")


def time_by_kind(work) -> tuple[dict[str, float], float, float]:
    """Seconds of `work()` by what spent them: the matrix products' and attention's operators
    (the profiler's self time of each), and the rest of the process's CPU time (other
    operators, Python, the profiler's own overhead); the FLOPs the products ran (the
    profiler's count, 2 M K N a product, padding and finished rows included); and the
    process's CPU time over the wall time (about 1 on an idle core and one thread)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, with_flops=True) as profile:
        start = _now()
        work()
        wall, total = _lap(start)
    seconds, flops = dict.fromkeys(KINDS[:2], 0.0), 0.0
    for event in profile.key_averages():
        if event.key in PRODUCTS:
            seconds[KINDS[0]] += event.self_cpu_time_total / 1e6
            flops += event.flops
        elif "attention" in event.key:
            seconds[KINDS[1]] += event.self_cpu_time_total / 1e6
    return {**seconds, KINDS[2]: total - sum(seconds.values())}, flops, total / wall


def print_by_kind(profiled: tuple, floor_flops: float, floor_product_flops: float,
                  rate: float) -> None:  # fmt: skip
    """Each kind's seconds over the floor (`floor_flops` at `rate`); the products' own rate,
    and their FLOPs over the floor's products' (`floor_product_flops`). `profiled`:
    `time_by_kind`'s result."""
    seconds, product_flops, busy = profiled
    floor = floor_flops / rate
    parts = ", ".join(f"{kind} {cpu:.3f} s ({cpu / floor:.2f})" for kind, cpu in seconds.items())
    print(f"  by kernel, over the floor (profiled): {parts}")
    products = product_flops / seconds[KINDS[0]]
    print(f"  the products ran at {products / 1e9:.1f} GFLOP/s ({products / rate:.2f} of the "
          f"floor's rate), {product_flops / floor_product_flops:.2f}x the FLOPs of the floor's "
          "products")  # fmt: skip
    if abs(busy - 1) > 0.05:
        print(f"  warning: the process had the CPU for {busy:.2f} of the wall time, so the "
              "operators' times (wall clock) and the rest (CPU time) do not add up")  # fmt: skip


def forward_flops(model, prompt_lengths: torch.Tensor, completion_lengths: torch.Tensor,
                  attention: bool = True) -> float:  # fmt: skip
    """FLOPs of one forward pass over the positions the batch needs (module docstring):
    `prompt_lengths: (B,)` real prompt tokens, `completion_lengths: (B * G,)` tokens, EOS
    included, rollouts of prompt i at rows i * G ... (i + 1) * G - 1. `attention=False`: the
    matrix products' alone, without QK^T and attention x V."""
    config = model.config
    layer_params = sum(p.numel() for p in model.model.layers.parameters() if p.dim() == 2)
    head_params = model.lm_head.weight.numel()
    per_key = 4 * config.num_hidden_layers * config.num_attention_heads * _head_dim(config)
    per_key = per_key if attention else 0  # QK^T and attention x V, per query and key
    group = len(completion_lengths) // len(prompt_lengths)
    flops = 0.0
    for prompt in prompt_lengths.tolist():
        contexts = sum(range(1, prompt + 1))  # position j attends to j keys
        flops += prompt * 2 * layer_params + per_key * contexts + 2 * head_params
    for row, length in enumerate(completion_lengths.tolist()):
        prompt = int(prompt_lengths[row // group])
        positions = max(length - 1, 0)  # completion tokens 0 .. length - 2 are fed back
        contexts = sum(prompt + t + 1 for t in range(positions))
        flops += positions * (2 * layer_params + 2 * head_params) + per_key * contexts
    return flops


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _lap(start: tuple[float, float]) -> tuple[float, float]:
    """(wall, CPU) seconds since `start`."""
    return time.perf_counter() - start[0], time.process_time() - start[1]


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def sampling_round(model, tokenizer, prompts, prompt_ids, prompt_mask, config, seed: int):
    """{side: ((wall, CPU) s, tokens)} for the two samplers and plain generate, in turn."""
    results = {}
    for sampler in ("lean", "generate"):
        with rollouts.seeded(seed, model.device):
            start = _now()
            ids = rollouts._generate(
                model, prompt_ids, prompt_mask, config, len(prompt_ids), sampler
            )
            results[sampler] = (_lap(start), ids)
    ids, seconds = plain_generate(model, tokenizer, prompts)
    results["plain generate"] = (seconds, ids)
    return results


def sampling_section(
    model, tokenizer, prompts, settings, rounds: int, rates: list, profile: bool = False
) -> dict:
    """Median CPU seconds of each sampler, the floor (at the best of `rates`, to which each
    round adds one) and the checks; prints its table."""
    prompt_ids, prompt_mask = rollouts._tokenize_prompts(tokenizer, prompts, model.device)
    config = rollouts.sampling_config(
        model,
        tokenizer,
        do_sample=True,
        temperature=settings.temperature,
        top_p=1.0,
        num_return_sequences=settings.num_generations,
        max_new_tokens=settings.max_completion_length,
    )
    seconds = {}
    for _ in range(rounds + 1):  # round 0 is a warm-up
        results = sampling_round(model, tokenizer, prompts, prompt_ids, prompt_mask, config, 0)
        rates.append(matmul_rate())
        for side, (lap, _) in results.items():
            seconds.setdefault(side, []).append(lap)
    stop, pad = rollouts.stop_token_ids(model, tokenizer), tokenizer.pad_token_id
    cut = {side: rollouts.cut_at_eos(ids, stop, pad) for side, (_, ids) in results.items()}
    lean, _, lengths, _ = cut["lean"]
    same = {side: _equal(lean, cut[side][0]) for side in ("generate", "plain generate")}
    rate = max(rates)
    floor = forward_flops(model, prompt_mask.sum(1), lengths) / rate
    medians = {
        side: statistics.median(cpu for _, cpu in laps[1:]) for side, laps in seconds.items()
    }
    print(
        f"\nsampling: {len(prompts)} prompts x G = {settings.num_generations}, "
        f"{int(lengths.sum())} completion tokens (longest {int(lengths.max())}); floor "
        f"{floor:.3f} s at {rate / 1e9:.1f} GFLOP/s; the lean sampler's tokens are "
        f"generate_groups' {same['generate']}, plain generate's {same['plain generate']}"
    )
    print(f"  {'':16} {'CPU s':>7} {'/ floor':>8} {'/ plain generate':>17}")
    for side, cpu in medians.items():
        print(
            f"  {side:16} {cpu:>7.3f} {cpu / floor:>8.2f} {cpu / medians['plain generate']:>17.2f}"
        )
    ratio = medians["lean"] / floor
    verdict = "PASS" if ratio <= TARGETS["sampling"] else "FAIL"
    print(f"  lean sampling / floor {ratio:.2f} (target <= {TARGETS['sampling']:g}): {verdict}")
    if profile:
        with rollouts.seeded(0, model.device):
            profiled = time_by_kind(lambda: rollouts._generate(
                model, prompt_ids, prompt_mask, config, len(prompt_ids), "lean"))  # fmt: skip
        product_flops = forward_flops(model, prompt_mask.sum(1), lengths, attention=False)
        print_by_kind(profiled, floor * rate, product_flops, rate)
    return {"sampling / floor": ratio, "same tokens": same}


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


class StepSide:
    """Our GRPO step on its own copy of the model, sampling with `sampler`; each call times the
    step, its sampling and its update, and computes its floor."""

    def __init__(self, spec, config, prompts, golds, sampler: str):
        self.model, self.tokenizer = load_tiny_llama(spec, progress=False)
        self.reference, self.optimizer = trainer.reference_and_optimizer(self.model, config)
        self.config, self.prompts, self.golds = config, prompts, golds
        self.sampler = sampler
        # per step: (step CPU s, sampling CPU s, update CPU s, F FLOPs, F's products' FLOPs)
        self.records = []

    def __call__(self, step: int) -> dict:
        """Our step `step` on the prompts TRL's step `step` answered."""
        rows = slice((step - 1) * self.config.per_step_prompts, step * self.config.per_step_prompts)
        watch, seen = Stopwatch(), []

        def sample(*args, **kwargs):
            seen.append(rollouts.generate_rollouts(*args, sampler=self.sampler, **kwargs))
            return seen[-1]

        update = ("completion_logits", "token_log_probs", "grpo_loss")
        with ExitStack() as patches:
            patches.enter_context(
                mock.patch.object(trainer, "generate_rollouts", watch.wrap("sampling", sample))
            )
            for name in update:
                timed = watch.wrap("update", getattr(trainer, name))
                patches.enter_context(mock.patch.object(trainer, name, timed))
            backward = watch.wrap("update", torch.Tensor.backward)
            patches.enter_context(mock.patch.object(torch.Tensor, "backward", backward))
            start = _now()
            record = trainer.grpo_step(self.model, self.tokenizer, self.reference,
                                       self.optimizer, self.prompts[rows], self.golds[rows],
                                       self.config, step, gsm8k.reward)  # fmt: skip
            total = _lap(start)
        (rollout,) = seen
        lengths = rollout.prompt_mask.sum(1), rollout.lengths
        flops = (
            forward_flops(self.model, *lengths),
            forward_flops(self.model, *lengths, attention=False),
        )
        self.records.append(
            (total[1], watch.seconds["sampling"][1], watch.seconds["update"][1], *flops)
        )
        return record


def step_section(
    spec, config, prompts, golds, rounds: int, rates: list, with_trl: bool, profile: bool = False
):
    """Our step with each sampler, interleaved with TRL's when `with_trl`, a rate measured
    before each round (added to `rates`, the floor at their best); prints its table."""
    # "before": the step as it ran before the lean sampler and the length buckets.
    padded = dataclasses.replace(config, length_bucket_size=None)
    sides = {
        "lean": StepSide(spec, config, prompts, golds, "lean"),
        "before": StepSide(spec, padded, prompts, golds, "generate"),
    }

    def ours(step: int) -> dict:
        records = [side(step) for side in sides.values()]
        rates.append(matmul_rate())
        return records[0]

    trl_seconds = None
    if with_trl:
        trl_seconds = _interleave_with_trl(spec, config, prompts, golds, ours, rounds + 1)
    else:
        for step in range(1, rounds + 2):
            ours(step)
    forward_passes = 5 if config.beta > 0 else 4  # sampling, reference, forward + backward
    rate = max(rates)
    print(
        f"\nGRPO step ({config.per_step_prompts} prompts x G = {config.num_generations}, "
        f"beta {config.beta}); update = forward + backward of the loss; floor of the step = "
        f"{forward_passes} forward passes, of the update 3, at {rate / 1e9:.1f} GFLOP/s"
    )
    header = f"  {'':22} {'CPU s':>7} {'/ floor':>8}"
    print(header + ("  / TRL's step" if trl_seconds else ""))
    ratios, updates = {}, {}
    for name, side in sides.items():
        timed = side.records[1:]  # the first step is a warm-up
        rows = {
            f"step, {name}": _median_over_floor(timed, 0, forward_passes, rate),
            f"  sampling ({name})": _median_over_floor(timed, 1, 1, rate),
            f"  update ({name})": _median_over_floor(timed, 2, 3, rate),
        }
        for label, (cpu, over_floor) in rows.items():
            line = f"  {label:22} {cpu:>7.3f} {over_floor:>8.2f}"
            if trl_seconds and label.startswith("step"):
                line += f"  {cpu / trl_seconds:>12.3f}"
            print(line)
        cpu, over_floor = rows[f"step, {name}"]
        ratios[name] = (over_floor, cpu)
        updates[name] = rows[f"  update ({name})"][0]
    if trl_seconds:
        print(f"  {'TRL step':22} {trl_seconds:>7.3f}")
    print(f"  update, length buckets / padded: {updates['lean'] / updates['before']:.2f}; "
          f"step, lean / before: {ratios['lean'][1] / ratios['before'][1]:.2f}")  # fmt: skip
    ratio, cpu = ratios["lean"]
    verdict = "PASS" if ratio <= TARGETS["step"] else "FAIL"
    print(f"  step (lean) / floor {ratio:.2f} (target <= {TARGETS['step']:g}): {verdict}")
    if trl_seconds:
        versus = cpu / trl_seconds
        verdict = "PASS" if versus <= TARGETS["step / TRL"] else "FAIL"
        print(f"  step (lean) / TRL {versus:.3f} (target <= {TARGETS['step / TRL']:g}): {verdict}")
    if profile:  # one more step, on prompts no timed step used
        lean = sides["lean"]
        profiled = time_by_kind(lambda: lean(rounds + 2))
        *_, flops, product_flops = lean.records.pop()
        print_by_kind(profiled, forward_passes * flops, forward_passes * product_flops, rate)
    return ratios


def _median_over_floor(records, column: int, passes: int, rate: float) -> tuple[float, float]:
    """(median CPU s, median of time / floor) of one column of `StepSide.records`; the floor is
    `passes` forward passes of each step's own batch."""
    cpu = statistics.median(record[column] for record in records)
    over = statistics.median(record[column] / (passes * record[3] / rate) for record in records)
    return cpu, over


def _interleave_with_trl(spec, config, prompts, golds, ours, steps: int) -> float:
    """Median CPU seconds of TRL's step, timed as `grpo_step_vs_trl.py` times it, `ours(step)`
    run after each of its steps."""
    _, tokenizer = load_tiny_llama(spec, progress=False)
    interleave = interleaved_trl(spec, config, prompts, golds, tokenizer, ours, steps)
    return statistics.median(cpu for _, cpu in interleave.times["TRL"][1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after a warm-up")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-trl", action="store_true", help="skip TRL's step")
    parser.add_argument("--quick", action="store_true", help="smoke model, one round, no TRL")
    parser.add_argument("--profile", action="store_true", help="split the time by kernel")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.no_trl = 1, True
    if args.profile and args.threads != 1:  # the operators' times are their own thread's
        parser.error("--profile splits one thread's time: use --threads 1")

    torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*gradient_checkpointing")
    spec = TinyLlamaSpec(**(SMOKE_SPEC if args.quick else {}))
    load_before = os.getloadavg()
    rates = [matmul_rate()]
    model, tokenizer = load_tiny_llama(spec, progress=False)
    steps = args.repeats + 1 + args.profile
    data = gsm8k.load_gsm8k(
        "train", source="arithmetic", num_examples=steps * CONFIG.per_step_prompts, seed=0
    )
    prompts, golds = build_prompts(tokenizer, data)
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"tiny Llama {spec.num_hidden_layers} x {spec.hidden_size} ({parameters / 1e6:.2f}M "
        f"parameters), torch threads {args.threads}; {MATMUL_SIZE} x {MATMUL_SIZE} matrix "
        f"product: {rates[0] / 1e9:.1f} GFLOP/s at the start; load average before "
        f"{_load(load_before)}"
    )
    sampling_section(model, tokenizer, prompts[: CONFIG.per_step_prompts], CONFIG,
                     args.repeats, rates, args.profile)  # fmt: skip
    step_section(spec, CONFIG, prompts, golds, args.repeats, rates, not args.no_trl, args.profile)
    print(f"the rates measured: {min(rates) / 1e9:.1f} to {max(rates) / 1e9:.1f} GFLOP/s")
    print(f"load average after: {_load(os.getloadavg())}")


def _load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.2f}" for x in load)


if __name__ == "__main__":
    main()
