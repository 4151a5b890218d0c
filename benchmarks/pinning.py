"""The pinned code path: the same bits on every machine, and what the pinning costs.

`grpo_companion.reproducibility` pins torch's, MKL's, oneDNN's, numpy's and OpenBLAS's CPU code
path to AVX2 and every computation's thread count. This script

- prints a digest of a small workload that touches each of them (a two-layer Llama trained for a
  few GRPO steps on one thread: sampling, softmax, sdpa, matrix products, AdamW; numpy's
  transcendental loops and matrix product; scipy's t quantile), with the capability in force. Two
  machines on the pinned path print the same digest; run it on each (or, to emulate an AVX2-only
  machine on an AVX-512 one, under `qemu-x86_64 -cpu Haswell`, Debian's qemu-user);
- with `--cost`, runs itself again unpinned (`GRPO_COMPANION_UNPINNED=1`, the machine's own
  paths) and prints both digests and the times the pinning may change, each pinned over
  unpinned (target: <= 1.05): a 2048 x 2048 product's rate on one thread (the floor benchmark's
  rate, `floor.matmul_rate`) and a GRPO step of the book's tiny Llama size (4 layers, 256 wide;
  16 prompts x G = 8, 48 tokens, as chapter 11), best of `--repeats`.

    python benchmarks/pinning.py                  # the digest on this machine
    python benchmarks/pinning.py --cost           # pinned against unpinned, and the cost
    qemu-x86_64 -cpu Haswell .venv/bin/python benchmarks/pinning.py --quick   # AVX2-only machine
"""

import grpo_companion  # noqa: F401  first: pins the kernels before torch and numpy load

# isort: split

import argparse
import copy
import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import scipy.stats
import torch
from floor import matmul_rate

from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.gsm8k import load_gsm8k
from grpo_companion.lm.tiny_llama import TinyLlamaSpec, warm_start
from grpo_companion.lm.trainer import train
from grpo_companion.reproducibility import ENVIRONMENT, OPT_OUT, settings

SMALL = TinyLlamaSpec(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    train_steps=0,
    num_train_examples=200,
    num_eval_examples=2,
    max_completion_length=4,
    num_threads=1,
)
BOOK_SIZE = TinyLlamaSpec(
    train_steps=0,
    num_train_examples=200,
    num_eval_examples=2,
    max_completion_length=4,
    num_threads=1,
)
STEP = GRPOConfig(
    num_generations=8,
    per_step_prompts=16,
    max_completion_length=48,
    learning_rate=1e-3,
    max_steps=1,
    eval_every=1000,
    beta=0.04,
)


def has_digit(completion: str, gold: str) -> float:
    return float(any(character.isdigit() for character in completion))


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def workload_digest(steps: int) -> str:
    """SHA-256 (16 hex) of everything a small run computes, to the bit."""
    digest = hashlib.sha256()
    model, tokenizer, _ = warm_start(SMALL, progress=False)
    data = load_gsm8k("train", source="arithmetic", num_examples=16, seed=0)
    config = GRPOConfig(
        num_generations=4,
        per_step_prompts=4,
        max_completion_length=8,
        learning_rate=1e-2,
        max_steps=steps,
        eval_every=1000,
    )
    history = train(
        model, tokenizer, data, data.select(range(2)), config, reward_fn=has_digit, progress=False
    )
    digest.update(json.dumps(history, sort_keys=True, default=str).encode())
    for parameter in model.parameters():
        digest.update(_bytes(parameter))
    x = torch.linspace(-4, 4, 4097, dtype=torch.float32)
    for values in (x.exp(), x.tanh(), torch.log1p(x.abs()), torch.erf(x), x.sigmoid()):
        digest.update(_bytes(values))
    grid = np.linspace(-4.0, 4.0, 4097)
    for values in (np.exp(grid), np.tanh(grid), np.log1p(np.abs(grid)), np.sin(grid)):
        digest.update(values.tobytes())
    matrix = np.random.default_rng(0).standard_normal((300, 300))
    digest.update((matrix @ matrix).tobytes())
    digest.update(scipy.stats.t.ppf(np.linspace(0.01, 0.99, 99), df=3).tobytes())
    return digest.hexdigest()[:16]


def step_seconds(repeats: int) -> float:
    """Best CPU seconds of one GRPO step of the book-sized tiny Llama (random weights)."""
    model, tokenizer, _ = warm_start(BOOK_SIZE, progress=False)
    data = load_gsm8k("train", source="arithmetic", num_examples=STEP.per_step_prompts, seed=0)
    best = float("inf")
    for repeat in range(repeats + 1):  # the first is a warm-up
        policy = copy.deepcopy(model)
        start = time.process_time()
        train(
            policy,
            tokenizer,
            data,
            data.select(range(2)),
            STEP,
            reward_fn=has_digit,
            progress=False,
        )
        if repeat:
            best = min(best, time.process_time() - start)
    return best


def measure(args) -> dict:
    torch.set_num_threads(1)
    found = {**settings(), "digest": workload_digest(args.steps)}
    if args.timings:
        found["matmul_gflops"] = matmul_rate() / 1e9
        found["step_seconds"] = step_seconds(args.repeats)
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="GRPO steps of the digest's run")
    parser.add_argument("--repeats", type=int, default=3, help="timed GRPO steps (--cost)")
    parser.add_argument("--quick", action="store_true", help="2 steps (for an emulator)")
    parser.add_argument("--cost", action="store_true", help="pinned against unpinned")
    parser.add_argument("--timings", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.steps = 2 if args.quick else args.steps
    if args.json:
        print(json.dumps(measure(args)))
        return
    if not args.cost:
        found = measure(args)
        print(f"{found['cpu_capability']} (pinned: {found['pinned']}): digest {found['digest']}")
        return
    runs = {}
    for name, extra in (("pinned", {}), ("unpinned", {OPT_OUT: "1"}), ("pinned again", {})):
        command = [
            sys.executable,
            __file__,
            "--json",
            "--timings",
            "--steps",
            str(args.steps),
            "--repeats",
            str(args.repeats),
        ]
        # this process pinned its own environment: the unpinned run starts without it
        base = {k: v for k, v in os.environ.items() if not (extra and k in ENVIRONMENT)}
        output = subprocess.run(
            command, env={**base, **extra}, check=True, capture_output=True, text=True
        ).stdout
        runs[name] = json.loads(output.strip().splitlines()[-1])
        run = runs[name]
        print(
            f"{name:>12}: {run['cpu_capability']:<7} digest {run['digest']}  "
            f"2048 x 2048 {run['matmul_gflops']:5.1f} GFLOP/s  GRPO step "
            f"{run['step_seconds']:.3f} s"
        )
    both = (runs["pinned"], runs["pinned again"])
    rate = max(run["matmul_gflops"] for run in both) / runs["unpinned"]["matmul_gflops"]
    step = min(run["step_seconds"] for run in both) / runs["unpinned"]["step_seconds"]
    print(
        f"pinned / unpinned (the better of the two pinned runs, around the unpinned one): "
        f"rate {rate:.3f}, GRPO step time {step:.3f}"
    )


if __name__ == "__main__":
    main()
