"""Seeds per minute of a multi-seed experiment: one-thread worker processes, one per core
(`lm.parallel.map_runs`), each sampling with the lean sampler (`lm.sampler`) and updating in
length buckets (`GRPOConfig.length_bucket_size`), against two baselines that keep both cores
busy in one process on every core's threads:

- the testbed as the chapters ran it before these three changes, the named baseline of the
  target: seeds one after another, sampling with `generate` (`rollouts.generate_groups`), every
  completion of the update padded to the longest (``length_bucket_size=None``);
- the same sequential run with the lean sampler and length buckets: what the workers alone add.

Target (issue "testbed at the arithmetic floor"): the workers' seeds per minute at least 1.8x
the first baseline's. Each seed is a short GRPO run of the tiny Llama
(`tiny_llama.load_tiny_llama(TinyLlamaSpec())`, read from `_build/cache/models/`; `--smoke-model`
uses the smoke profile's quicker one) with the settings of chapter 6's remedies: 16 prompts x
G = 4, 48 new tokens, `--steps` steps. The sides train the same seeds and end with the same
histories up to rounding (the thread count's, the buckets'), which a few steps can grow into a
different token: printed, the largest difference of a seed's last training reward (the
`generate` baseline draws the lean sampler's tokens from the same weights).

    python benchmarks/parallel_seeds.py [--seeds 4 --steps 5]
"""

import grpo_companion  # noqa: F401  first: pins the kernels before torch and numpy load

# isort: split

import argparse
import functools
import os
import sys
import time
from unittest import mock

import torch
from transformers.utils import logging as transformers_logging

from grpo_companion.lm import trainer
from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.gsm8k import load_gsm8k
from grpo_companion.lm.parallel import default_workers, map_runs
from grpo_companion.lm.tiny_llama import TinyLlamaSpec, load_tiny_llama
from grpo_companion.lm.trainer import train

SMOKE = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "train_steps": 50}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--smoke-model", action="store_true")
    args = parser.parse_args(argv)
    transformers_logging.disable_progress_bar()  # each run's "Loading weights" bar, workers too

    spec = TinyLlamaSpec(**SMOKE) if args.smoke_model else TinyLlamaSpec()
    _, tokenizer = load_tiny_llama(spec, progress=True)
    train_data = load_gsm8k("train", source="arithmetic", num_examples=64, seed=0)
    eval_data = load_gsm8k("test", source="arithmetic", num_examples=16, seed=0)
    config = GRPOConfig(
        num_generations=4, per_step_prompts=16, max_completion_length=48,
        max_steps=args.steps, eval_every=args.steps,
    )  # fmt: skip

    def run(seed, length_bucket_size=config.length_bucket_size):
        model, _ = load_tiny_llama(spec, progress=False)
        settings = {"seed": seed, "length_bucket_size": length_bucket_size}
        config_seed = GRPOConfig(**{**vars(config), **settings})
        return train(model, tokenizer, train_data, eval_data, config_seed, progress=False)

    seeds = list(range(args.seeds))
    cores = default_workers()
    print(f"{args.seeds} seeds x {args.steps} steps; {cores} cores; load {os.getloadavg()[0]:.2f}")

    def timed(runner) -> tuple[dict, float]:
        start = time.perf_counter()
        results = runner()
        return results, time.perf_counter() - start

    torch.set_num_threads(cores)  # the sequential runs on every core's threads
    with mock.patch.object(
        trainer,
        "generate_rollouts",
        functools.partial(trainer.generate_rollouts, sampler="generate"),
    ):
        before, before_seconds = timed(lambda: {seed: run(seed, None) for seed in seeds})
    sequential, sequential_seconds = timed(lambda: {seed: run(seed) for seed in seeds})
    parallel, parallel_seconds = timed(lambda: map_runs(run, seeds, workers=cores))

    def rate(seconds: float) -> str:
        return f"{seconds:.1f} s ({60 * args.seeds / seconds:.2f} seeds/min)"

    print(f"before: sequential on {cores} threads, generate, padded: {rate(before_seconds)}")
    print(f"sequential on {cores} threads, lean sampler, buckets:  {rate(sequential_seconds)}")
    print(f"{cores} one-thread workers, lean sampler, buckets:    {rate(parallel_seconds)}")
    speedup = before_seconds / parallel_seconds
    print(
        f"workers / before: {speedup:.2f}x (target >= 1.8): {'PASS' if speedup >= 1.8 else 'FAIL'}"
    )
    print(f"workers / sequential: {sequential_seconds / parallel_seconds:.2f}x; "
          f"sequential / before: {before_seconds / sequential_seconds:.2f}x")  # fmt: skip
    for name, other in (("sequential", sequential), ("before", before)):
        gap = max(abs(parallel[s][-1]["reward"] - other[s][-1]["reward"]) for s in seeds)
        print(f"largest difference of a seed's last step reward, workers - {name}: {gap:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
