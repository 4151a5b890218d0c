"""Rollout throughput: `rollouts.generate_rollouts` vs plain `model.generate` on the same batch.

Issue "GSM8K testbed": rollout tokens per second against plain `model.generate`, and where
our extra time goes. (The issue sets no target for this ratio.)

The batch is chapter 9's: 16 arithmetic problems (`gsm8k.load_gsm8k("train",
source="arithmetic")`) x num_generations = 8 = 128 completions of at most 48 tokens at
temperature 1 from the tiny Llama (`tiny_llama.load_tiny_llama(TinyLlamaSpec())`, read from
`_build/cache/models/`), all 128 in one `generate` call (batch_size 128).

  generate      the baseline: the left-padded prompts, `model.generate(do_sample=True,
                temperature=1, top_k=0, num_return_sequences=8, max_new_tokens=48)`, tensors
                already built, nothing after it.
  ours          `generate_rollouts`: tokenizes the prompts, samples under the same seed with
                each prompt run through the model once for its group of 8
                (`rollouts.generate_groups`: the very same tokens, checked), cuts each
                completion at its first EOS, decodes, scores with `gsm8k.reward`, and runs the
                teacher-forced log-prob pass (`sequence_log_probs`, each prompt once for
                its group there too).
  ours, no lp   the same with `compute_log_probs=False`, what the trainer's on-policy step
                (num_iterations = 1) calls.

Tokens are completion tokens up to and including each completion's EOS (`Rollouts.lengths`;
the padding `generate` writes after a row's EOS is not counted), the same count for all three.
Each repeat runs the three in turn (A B C A B C ...) so the shared machine's load falls on all
alike; medians of wall and CPU seconds (`time.process_time`) after one warm-up round. The
breakdown times the parts of `generate_rollouts` by wrapping its helpers.

    python benchmarks/rollout_throughput.py [--repeats 5 --threads 1]
"""

import grpo_companion  # noqa: F401  first: pins the kernels before torch and numpy load

# isort: split

import argparse
import os
import statistics
import time
from collections import defaultdict
from contextlib import ExitStack
from unittest import mock

import torch
from transformers.utils import logging as transformers_logging

from grpo_companion.lm import gsm8k, rollouts
from grpo_companion.lm.gsm8k import build_prompts
from grpo_companion.lm.tiny_llama import TinyLlamaSpec, load_tiny_llama

NUM_PROMPTS, NUM_GENERATIONS, MAX_COMPLETION_LENGTH, TEMPERATURE, SEED = 16, 8, 48, 1.0, 0
# The smoke profile's tiny Llama (book/profiles.toml): a quick run of the benchmark itself.
SMOKE_SPEC = {
    "train_steps": 30,
    "warmup_steps": 5,
    "num_train_examples": 500,
    "num_eval_examples": 8,
}


def add_smoke_model_option(parser: argparse.ArgumentParser) -> None:
    """`--smoke-model`, the benchmarks' choice of `model_spec`."""
    parser.add_argument(
        "--smoke-model",
        action="store_true",
        help="the smoke profile's tiny Llama (30 warm-start steps) instead of the default one",
    )


def model_spec(smoke: bool) -> TinyLlamaSpec:
    """The benchmarks' tiny Llama: the book's default one, or the smoke profile's."""
    return TinyLlamaSpec(**(SMOKE_SPEC if smoke else {}))


# The parts of `generate_rollouts` timed in the breakdown: (module attribute, label).
PARTS = [
    ("_tokenize_prompts", "tokenize prompts"),
    ("_generate", "sampling"),
    ("cut_at_eos", "cut at EOS"),
    ("sequence_log_probs", "log-prob pass"),
]


def plain_generate(model, tokenizer, prompts) -> torch.Tensor:
    """(B * G, T) completion tokens from one `model.generate` call, seeded as ours is."""
    batch = tokenizer(
        prompts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt"
    )
    torch.manual_seed(SEED)
    start = time.perf_counter(), time.process_time()
    output = model.generate(
        **batch,
        do_sample=True,
        temperature=TEMPERATURE,
        top_k=0,
        top_p=1.0,
        num_return_sequences=NUM_GENERATIONS,
        max_new_tokens=MAX_COMPLETION_LENGTH,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    seconds = time.perf_counter() - start[0], time.process_time() - start[1]
    return output[:, batch["input_ids"].shape[1] :], seconds


class Stopwatch:
    """Wraps functions, summing (wall, CPU) seconds spent in each, by label."""

    def __init__(self):
        self.seconds = defaultdict(lambda: [0.0, 0.0])

    def wrap(self, label, function):
        def timed(*args, **kwargs):
            start = time.perf_counter(), time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label][0] += time.perf_counter() - start[0]
                self.seconds[label][1] += time.process_time() - start[1]

        return timed


def ours(model, tokenizer, prompts, golds, compute_log_probs: bool):
    """(rollouts, total (wall, CPU) seconds, {part: (wall, CPU) seconds})."""
    stopwatch = Stopwatch()
    with ExitStack() as patches:
        for name, label in PARTS:
            patches.enter_context(
                mock.patch.object(rollouts, name, stopwatch.wrap(label, getattr(rollouts, name)))
            )
        patches.enter_context(
            mock.patch.object(
                tokenizer, "batch_decode", stopwatch.wrap("decode", tokenizer.batch_decode)
            )
        )
        reward = stopwatch.wrap("reward", gsm8k.reward)
        start = time.perf_counter(), time.process_time()
        result = rollouts.generate_rollouts(
            model,
            tokenizer,
            prompts,
            golds,
            num_generations=NUM_GENERATIONS,
            max_completion_length=MAX_COMPLETION_LENGTH,
            temperature=TEMPERATURE,
            seed=SEED,
            batch_size=NUM_PROMPTS * NUM_GENERATIONS,
            reward_fn=reward,
            compute_log_probs=compute_log_probs,
        )
        seconds = time.perf_counter() - start[0], time.process_time() - start[1]
    return result, seconds, dict(stopwatch.seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    add_smoke_model_option(parser)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    transformers_logging.disable_progress_bar()
    spec = model_spec(args.smoke_model)
    model, tokenizer = load_tiny_llama(spec, progress=False)
    data = gsm8k.load_gsm8k("train", source="arithmetic", num_examples=NUM_PROMPTS, seed=0)
    prompts, golds = build_prompts(tokenizer, data)

    sides = ("generate", "ours", "ours, no lp")
    times, parts = defaultdict(list), defaultdict(list)
    load_before = os.getloadavg()
    for _repeat in range(args.repeats + 1):  # round 0 is a warm-up
        plain_ids, seconds = plain_generate(model, tokenizer, prompts)
        times["generate"].append(seconds)
        for side, compute_log_probs in (("ours", True), ("ours, no lp", False)):
            result, seconds, breakdown = ours(model, tokenizer, prompts, golds, compute_log_probs)
            times[side].append(seconds)
            parts[side].append(breakdown)
        # Same seed, same sampler: the same tokens, so the same count for every side.
        width = result.completion_ids.shape[1]
        same = torch.equal(
            plain_ids[:, :width].masked_fill(result.completion_mask == 0, 0),
            result.completion_ids.masked_fill(result.completion_mask == 0, 0),
        )
        if not same:
            raise RuntimeError("generate_rollouts sampled other tokens than plain generate")
    load_after = os.getloadavg()
    tokens = int(result.lengths.sum())

    print(
        f"tiny Llama {spec.num_hidden_layers} x {spec.hidden_size}, at most {spec.train_steps} "
        f"warm-start steps; {NUM_PROMPTS} prompts x G = {NUM_GENERATIONS}, max "
        f"{MAX_COMPLETION_LENGTH} new tokens, {tokens} completion tokens (longest "
        f"{int(result.lengths.max())}), torch threads {args.threads}"
    )
    print(
        f"load average (1, 5, 15 min): before {_load(load_before)}, after {_load(load_after)}; "
        f"medians of {args.repeats} rounds after one warm-up, interleaved"
    )
    print(
        f"{'':12} {'wall s':>8} {'CPU s':>8} {'tokens/s':>9} {'tok/CPU s':>10} "
        f"{'ratio wall':>11} {'ratio CPU':>10}"
    )
    medians = {
        side: [statistics.median(t[i] for t in times[side][1:]) for i in (0, 1)] for side in sides
    }
    for side in sides:
        wall, cpu = medians[side]
        print(
            f"{side:12} {wall:>8.3f} {cpu:>8.3f} {tokens / wall:>9.0f} {tokens / cpu:>10.0f} "
            f"{medians['generate'][0] / wall:>11.3f} {medians['generate'][1] / cpu:>10.3f}"
        )
    print("ratio: tokens/s of the row over those of plain generate (1 = no overhead)")
    labels = [label for _, label in PARTS] + ["decode", "reward"]
    for side in ("ours", "ours, no lp"):
        print(
            f"where the time of {side!r} goes (median CPU s over the rounds, share of its "
            f"median total):"
        )
        for label in labels:
            cpu = statistics.median(b.get(label, (0.0, 0.0))[1] for b in parts[side][1:])
            print(f"  {label:18} {cpu:>8.3f} {cpu / medians[side][1]:>7.1%}")
        rest = statistics.median(
            total[1] - sum(b.get(label, (0.0, 0.0))[1] for label in labels)
            for total, b in zip(times[side][1:], parts[side][1:])
        )
        print(f"  {'the rest':18} {rest:>8.3f} {rest / medians[side][1]:>7.1%}")


def _load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.2f}" for x in load)


if __name__ == "__main__":
    main()
