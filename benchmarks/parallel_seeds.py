"""Seeds per minute of a multi-seed experiment: one-thread worker processes, one per core
(`lm.parallel.map_runs`), against the seeds run one after another in one process on every
core's threads (how the chapters ran them before).

Target (issue "testbed at the arithmetic floor"): the workers' seeds per minute at least 1.8x
the sequential run's, with both cores busy. Each seed is a short GRPO run of the tiny Llama
(`tiny_llama.load_tiny_llama(TinyLlamaSpec())`, read from `_build/cache/models/`; `--smoke-model`
uses the smoke profile's quicker one) with the settings of chapter 6's remedies: 16 prompts x
G = 4, 48 new tokens, `--steps` steps. The two sides train the same seeds and must end with
the same histories up to the thread count's rounding (printed: the largest difference of the
last training reward).

    python benchmarks/parallel_seeds.py [--seeds 4 --steps 3]
"""

import argparse
import os
import sys
import time

import torch

from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.gsm8k import load_gsm8k
from grpo_companion.lm.parallel import default_workers, map_runs
from grpo_companion.lm.tiny_llama import TinyLlamaSpec, load_tiny_llama
from grpo_companion.lm.trainer import train

SMOKE = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "train_steps": 50}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--smoke-model", action="store_true")
    args = parser.parse_args(argv)

    spec = TinyLlamaSpec(**SMOKE) if args.smoke_model else TinyLlamaSpec()
    _, tokenizer = load_tiny_llama(spec, progress=True)
    train_data = load_gsm8k("train", source="arithmetic", num_examples=64, seed=0)
    eval_data = load_gsm8k("test", source="arithmetic", num_examples=16, seed=0)
    config = GRPOConfig(
        num_generations=4, per_step_prompts=16, max_completion_length=48,
        max_steps=args.steps, eval_every=args.steps,
    )  # fmt: skip

    def run(seed):
        model, _ = load_tiny_llama(spec, progress=False)
        config_seed = GRPOConfig(**{**vars(config), "seed": seed})
        return train(model, tokenizer, train_data, eval_data, config_seed, progress=False)

    seeds = list(range(args.seeds))
    cores = default_workers()
    print(f"{args.seeds} seeds x {args.steps} steps; {cores} cores; load {os.getloadavg()[0]:.2f}")

    torch.set_num_threads(cores)  # the sequential run on every core's threads
    start = time.perf_counter()
    sequential = {seed: run(seed) for seed in seeds}
    sequential_seconds = time.perf_counter() - start

    start = time.perf_counter()
    parallel = map_runs(run, seeds, workers=cores)
    parallel_seconds = time.perf_counter() - start

    gap = max(abs(parallel[s][-1]["reward"] - sequential[s][-1]["reward"]) for s in seeds)
    speedup = sequential_seconds / parallel_seconds
    print(f"sequential on {cores} threads: {sequential_seconds:.1f} s "
          f"({60 * args.seeds / sequential_seconds:.2f} seeds/min)")  # fmt: skip
    print(f"{cores} one-thread workers:     {parallel_seconds:.1f} s "
          f"({60 * args.seeds / parallel_seconds:.2f} seeds/min)")  # fmt: skip
    print(f"speed-up {speedup:.2f}x (target >= 1.8): {'PASS' if speedup >= 1.8 else 'FAIL'}")
    print(f"largest difference of a seed's last step reward: {gap:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
