"""The micro model's GRPO step against its arithmetic floor (target: within 1.5x).

A step of `lm.trainer` on the micro model (`lm.micro`: 2 layers, 64 wide, 83k parameters) on
4-digit running sums: 16 fresh prompts x G = 8, completions of at most 8 tokens, beta = 0
(sampling, then the update's forward and backward pass). Its floor is `floor.forward_flops` of
the batch's real positions, F for sampling and 3 F for the update, at this machine's rate for a
2048 x 2048 product on one thread (the best of the run). CPU seconds per step are the best of
three runs of `--steps` steps (set-up included) after a warm-up, the model's weights random
(completions run to their longest, as a trained model's correct ones do). Also printed: the
same runs in one-thread workers on every core (`lm.parallel.map_runs`), as seeds per minute
against one process.

    python benchmarks/micro_step.py [--steps 20]
"""

import grpo_companion  # noqa: F401  first: pins the kernels before torch and numpy load

# isort: split

import argparse
import copy
import functools
import time

import torch
from floor import forward_flops, matmul_rate

from grpo_companion.lm import micro
from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.parallel import default_workers, map_runs
from grpo_companion.lm.trainer import train

STEPS = 4  # k
CONFIG = GRPOConfig(
    num_generations=8,
    per_step_prompts=16,
    learning_rate=1e-3,
    beta=0.0,
    max_completion_length=micro.max_completion_length(STEPS),
    eval_every=10**6,
)


def seconds_per_step(model, tokenizer, data, steps: int, seed: int = 0) -> float:
    """CPU seconds per step of a `steps`-step run of `lm.trainer.train` from `model`'s weights
    (a copy: `model` is left as it is), its set-up included."""
    config = GRPOConfig(**{**vars(CONFIG), "max_steps": steps, "seed": seed})
    policy = copy.deepcopy(model)
    start = time.process_time()
    train(
        policy,
        tokenizer,
        data,
        data.select(range(2)),
        config,
        reward_fn=micro.reward,
        progress=False,
    )
    return (time.process_time() - start) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = micro.build_tokenizer()
    model = micro.build_model(micro.MicroSpec(), tokenizer)
    data = micro.problems("train", STEPS, 4096)
    rate = matmul_rate()
    seconds_per_step(model, tokenizer, data, 2)  # warm-up
    times = []
    for repeat in range(3):
        times.append(seconds_per_step(model, tokenizer, data, args.steps, seed=repeat))
        rate = max(rate, matmul_rate())
    prompt_lengths = torch.full((CONFIG.per_step_prompts,), 2 * STEPS + 1)
    completion_lengths = torch.full(
        (CONFIG.per_step_prompts * CONFIG.num_generations,), CONFIG.max_completion_length
    )
    floor = 4 * forward_flops(model, prompt_lengths, completion_lengths) / rate
    step = min(times)
    print(f"{micro.num_parameters(model)} parameters; 2048 x 2048 at {rate / 1e9:.1f} GFLOP/s")
    verdict = "PASS" if step / floor <= 1.5 else "FAIL"
    print(
        f"step {1e3 * step:.1f} ms (best of 3 runs of {args.steps} steps), floor "
        f"{1e3 * floor:.2f} ms: step / floor {step / floor:.1f} (target <= 1.5: {verdict})"
    )

    workers = default_workers()
    run = functools.partial(_seed_run, model, tokenizer, data, args.steps)
    start = time.perf_counter()
    map_runs(run, range(workers), workers=1)
    one = time.perf_counter() - start
    start = time.perf_counter()
    map_runs(run, range(workers), workers=workers)
    parallel = time.perf_counter() - start
    print(
        f"{workers} seeds of {args.steps} steps: one process {one:.1f} s, {workers} one-thread "
        f"workers {parallel:.1f} s: {one / parallel:.2f}x the seeds per minute"
    )


def _seed_run(model, tokenizer, data, steps: int, seed: int) -> float:
    return seconds_per_step(model, tokenizer, data, steps, seed)


if __name__ == "__main__":
    main()
