"""Does `torch.compile` pay on this CPU? The lean sampler's decoding step and the update's
forward and backward pass, eager against compiled (inductor, dynamic shapes), on chapter 11's
batch (16 arithmetic problems x G = 8, 48 new tokens, the tiny Llama, 1 thread).

Issue "testbed at the arithmetic floor": use what torch offers (`torch.compile` where it pays on
this CPU, measured) before a hand-written loop. Printed for each piece: the compile time (the
first call, which a fresh process, such as each worker of `lm.parallel.map_runs`, pays again
unless inductor's cache on disk serves it), the steady-state CPU seconds of eager and compiled
(medians after a warm-up), their ratio, and whether the compiled piece gives the same tokens
(sampling) or log-probs and gradient to float32 rounding (the update). No target: the verdict
says whether compiling would shorten a chapter's run of a few hundred steps, compile included.

    python benchmarks/torch_compile.py [--repeats 3 --steps 100]
"""

import grpo_companion  # noqa: F401  first: pins the kernels before torch and numpy load

# isort: split

import argparse
import statistics
import sys
import time
import warnings

import torch
from transformers.utils import logging as transformers_logging

from grpo_companion.lm import gsm8k, rollouts, sampler, scoring
from grpo_companion.lm.gsm8k import build_prompts
from grpo_companion.lm.tiny_llama import TinyLlamaSpec, load_tiny_llama

NUM_PROMPTS, GROUP_SIZE, MAX_NEW_TOKENS = 16, 8, 48


def cpu_seconds(function, repeats: int) -> tuple[float, float, object]:
    """(first call's CPU s, median CPU s of `repeats` more, last result)."""
    start = time.process_time()
    result = function()
    first = time.process_time() - start
    laps = []
    for _ in range(repeats):
        start = time.process_time()
        result = function()
        laps.append(time.process_time() - start)
    return first, statistics.median(laps), result


def sampling(model, prompt_ids, prompt_mask, config):
    with rollouts.seeded(0, model.device):
        return sampler.lean_generate(model, prompt_ids, prompt_mask, config)


def update(model, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Log-probs and gradient of their sum, as the trainer's update computes them."""
    model.zero_grad(set_to_none=True)
    input_ids, attention_mask, completion_mask = batch
    log_probs = scoring.sequence_log_probs(
        model, input_ids, attention_mask, completion_mask,
        num_generations=GROUP_SIZE, bucket_size=16,
    )  # fmt: skip
    log_probs.sum().backward()
    return log_probs.detach(), [p.grad.clone() for p in model.parameters()]


def report(name: str, eager: tuple, compiled: tuple, same: str, steps: int) -> None:
    (_, eager_s, _), (compile_s, compiled_s, _) = eager, compiled
    ratio = compiled_s / eager_s
    saved = steps * (eager_s - compiled_s) - (compile_s - compiled_s)
    print(f"{name}: eager {eager_s:.3f} s, compiled {compiled_s:.3f} s ({ratio:.2f}x), first "
          f"compiled call {compile_s:.1f} s; {same}; over {steps} steps compiling "
          f"{'saves' if saved > 0 else 'costs'} {abs(saved):.0f} s")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help="a chapter's run, for the verdict")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    transformers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    model, tokenizer = load_tiny_llama(TinyLlamaSpec(), progress=False)
    data = gsm8k.load_gsm8k("train", source="arithmetic", num_examples=NUM_PROMPTS, seed=0)
    prompts, golds = build_prompts(tokenizer, data)
    prompt_ids, prompt_mask = rollouts._tokenize_prompts(tokenizer, prompts, model.device)
    config = rollouts.sampling_config(
        model, tokenizer, do_sample=True, temperature=1.0, top_p=1.0,
        num_return_sequences=GROUP_SIZE, max_new_tokens=MAX_NEW_TOKENS,
    )  # fmt: skip

    eager = cpu_seconds(lambda: sampling(model, prompt_ids, prompt_mask, config), args.repeats)
    eager_step = sampler.decode_step
    sampler.decode_step = torch.compile(eager_step, dynamic=True)
    try:
        compiled = cpu_seconds(
            lambda: sampling(model, prompt_ids, prompt_mask, config), args.repeats
        )
    finally:
        sampler.decode_step = eager_step
    same = torch.equal(eager[2], compiled[2]) if eager[2].shape == compiled[2].shape else False
    report("sampling (decode step compiled)", eager, compiled,
           f"the same tokens: {same}", args.steps)  # fmt: skip

    result = rollouts.generate_rollouts(
        model, tokenizer, prompts, golds, num_generations=GROUP_SIZE,
        max_completion_length=MAX_NEW_TOKENS, seed=0, compute_log_probs=False,
    )  # fmt: skip
    batch = (result.input_ids, result.attention_mask, result.completion_mask)
    model.train()
    eager = cpu_seconds(lambda: update(model, batch), args.repeats)
    compiled_model = torch.compile(model, dynamic=True)
    compiled = cpu_seconds(lambda: update(compiled_model, batch), args.repeats)
    (log_probs, grads), (compiled_log_probs, compiled_grads) = eager[2], compiled[2]
    gap = (compiled_log_probs - log_probs).abs().max().item()
    grad_gap = max(((a - b).norm() / b.norm()).item() for a, b in zip(compiled_grads, grads))
    report("update (model compiled)", eager, compiled,
           f"log-probs within {gap:.1e}, gradient within {grad_gap:.1e} relative",
           args.steps)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
