"""One GRPO step: `trainer.grpo_step` vs TRL's `GRPOTrainer`, same model, data, reward, settings.

Target (issue "GSM8K testbed"): our step is no slower than TRL's: median CPU seconds of a
step, ours / TRL <= 1 (CPU time: see Timing).

Both sides train their own copy of the tiny Llama (`tiny_llama.load_tiny_llama(TinyLlamaSpec())`,
read from `_build/cache/models/`) on the generated arithmetic problems
(`gsm8k.load_gsm8k("train", source="arithmetic")`) with the binary reward `gsm8k.reward`, and
the settings of chapter 9: 16 prompts x num_generations = 8 = 128 completions a step,
max_completion_length 48, temperature 1, beta 0.04, epsilon 0.2, loss_type "grpo", learning
rate 1e-5, num_iterations 1 (one AdamW update per batch of rollouts), max_grad_norm 1, float32,
use_bias_correction_kl True (TRL's default; one multiplication more per token).
Step k of each side answers the same 16 prompts (TRL's dataset is not shuffled; ours is
handed those 16), with its own random completions.

What one step does on each side:

  ours  `grpo_step`: `generate_rollouts` (left-padded prompts, each prompt's KV cache computed
        once for its 8 completions by `rollouts.generate_groups`, then `model.generate` for
        all 128 in one call, decoding and rewards; with num_iterations
        1 no log-prob pass for pi_old, whose log-probs are the update's own, detached);
        group advantages; the reference model's log-probs (no-grad forward pass, beta > 0);
        one forward and backward pass over the 128 completions (micro_batch_size 128) with
        the entropy read off the same logits; gradient clipping; one AdamW step. Both
        teacher-forced passes run each prompt once for its 8 completions
        (`scoring.completion_logits`), where TRL runs it 8 times.
  TRL   one step of `GRPOTrainer.train()` (per_device_train_batch_size 128 = 16 x 8,
        gradient_accumulation_steps 1): the dataloader's batch; prompts tokenized,
        `model.generate` (KV cache, all 128 in one call), decoding and rewards; group
        advantages; the reference model's log-probs (beta > 0). With num_iterations 1 TRL
        skips the old-policy log-prob pass (the ratio is 1 by construction). Then the forward
        and backward pass with entropies, gradient clipping, one AdamW step, the LR
        scheduler, and its metric logging (logging_steps 1).

TRL's CPU pitfalls, set here: `bf16=False`, and `gradient_checkpointing=False` (TRL's default
is True, which recomputes the forward pass in the backward: 15-20% slower here, and ours does
not checkpoint). Also matched to ours: a constant learning rate (TRL decays it linearly by
default) and `optim="adamw_torch"`, the same `torch.optim.AdamW` (TRL's default is the fused
variant; on 3.4M parameters either takes milliseconds). Dropout: the tiny Llama has none, so
TRL's train mode and our eval mode compute the same thing.

Timing: A B A B... in one process, so that the load of the shared machine falls on both
alike. TRL's training loop drives; a callback runs one of our steps after each TRL step, so
a TRL step is timed from the end of our previous step to TRL's `on_step_end` (everything TRL
does in between counts). The first step of each side is a warm-up, not timed. Both run on
`--threads` threads (1 by default), so CPU seconds of the process (`time.process_time`) are
wall seconds without the time other jobs of the shared machine took: the verdict uses them.
Wall seconds are printed too, and completion lengths, since the sampling time follows the
longest completion of the batch.

    pip install -r benchmarks/requirements.txt   # TRL, for this benchmark only
    python benchmarks/grpo_step_vs_trl.py [--repeats 7 --threads 1]
"""

import grpo_companion  # noqa: F401  first: pins the kernels before torch and numpy load

# isort: split

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import replace

try:
    import trl
except ImportError:
    print(
        "grpo_step_vs_trl: TRL is not installed. It is a benchmark-only dependency:\n"
        "    pip install -r benchmarks/requirements.txt",
        file=sys.stderr,
    )
    sys.exit(2)
import torch
from datasets import Dataset
from rollout_throughput import add_smoke_model_option, model_spec
from transformers import PrinterCallback, TrainerCallback
from transformers.utils import logging as transformers_logging

from grpo_companion.lm import gsm8k
from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.gsm8k import build_prompts
from grpo_companion.lm.tiny_llama import load_tiny_llama
from grpo_companion.lm.trainer import grpo_step, reference_and_optimizer
from grpo_companion.lm.trl_engine import trl_config

TARGET_RATIO = 1.0  # ours / TRL, median CPU seconds of a step
CONFIG = GRPOConfig(
    num_generations=8,
    per_step_prompts=16,
    max_completion_length=48,
    temperature=1.0,
    beta=0.04,
    use_bias_correction_kl=True,  # TRL 1.16's default (the book's trainer defaults to False)
    epsilon=0.2,
    loss_type="grpo",
    learning_rate=1e-5,
    num_iterations=1,
    micro_batch_size=128,
    rollout_batch_size=128,
)


def trl_reward(completions, gold, **kwargs) -> list[float]:
    """`gsm8k.reward` in TRL's signature: the dataset's "gold" column arrives as a keyword."""
    return [gsm8k.reward(completion, answer) for completion, answer in zip(completions, gold)]


class Interleave(TrainerCallback):
    """After each TRL step, time it and run (and time) one of our steps: A B A B ..."""

    def __init__(self, ours):
        self.ours, self.times, self.logs = ours, {"TRL": [], "ours": []}, {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.mark = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kwargs):
        self.times["TRL"].append(self._lap())
        self.logs.setdefault("ours", {})[state.global_step] = self.ours(state.global_step)
        self.times["ours"].append(self._lap())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "grad_norm" in logs:  # a step's metrics, not the summary at the end of training
            self.logs.setdefault("TRL", {})[state.global_step] = logs

    def _lap(self) -> tuple[float, float]:
        """(wall, CPU) seconds since the last lap."""
        now = (time.perf_counter(), time.process_time())
        lap = (now[0] - self.mark[0], now[1] - self.mark[1])
        self.mark = now
        return lap


def interleaved_trl(spec, config, prompts, golds, tokenizer, ours, steps: int) -> "Interleave":
    """TRL's `GRPOTrainer` on its own copy of `spec`'s policy for `steps` steps, `ours(step)`
    run after each of its steps; returns the `Interleave` holding both sides' times."""
    trl_model, _ = load_tiny_llama(spec, progress=False)
    interleave = Interleave(ours)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = trl.GRPOTrainer(
            model=trl_model,
            reward_funcs=trl_reward,
            # The book's TRL engine's settings (`trl_engine.trl_config`), plus what the timing
            # needs: step k answers the prompts of our step k (no shuffling), and
            # torch.optim.AdamW as ours (TRL's default is its fused variant).
            args=trl_config(
                replace(config, max_steps=steps),
                output_dir,
                shuffle_dataset=False,
                optim="adamw_torch",
                top_p=1.0,
                top_k=0,
            ),  # fmt: skip
            train_dataset=Dataset.from_dict({"prompt": prompts, "gold": golds}),
            processing_class=tokenizer,
            callbacks=[interleave],
        )
        trainer.remove_callback(PrinterCallback)  # it prints every step's metrics
        trainer.train()
    return interleave


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed steps of each side")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--beta", type=float, default=CONFIG.beta)
    add_smoke_model_option(parser)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    # transformers deprecates the `gradient_checkpointing` argument that TRL passes on.
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*gradient_checkpointing")
    config = replace(CONFIG, beta=args.beta)
    spec = model_spec(args.smoke_model)
    steps = args.repeats + 1  # the first step of each side is a warm-up
    data = gsm8k.load_gsm8k(
        "train", source="arithmetic", num_examples=steps * config.per_step_prompts, seed=0
    )

    # Ours: its own copy of the policy, and the reference and optimizer `trainer.train` makes.
    model, tokenizer = load_tiny_llama(spec, progress=False)
    reference, optimizer = reference_and_optimizer(model, config)
    prompts, golds = build_prompts(tokenizer, data)

    def ours(step: int) -> dict:
        """Our step `step` on the 16 prompts TRL's step `step` answered."""
        rows = slice((step - 1) * config.per_step_prompts, step * config.per_step_prompts)
        return grpo_step(
            model,
            tokenizer,
            reference,
            optimizer,
            prompts[rows],
            golds[rows],
            config,
            step,
            gsm8k.reward,
        )

    load_before = os.getloadavg()
    interleave = interleaved_trl(spec, config, prompts, golds, tokenizer, ours, steps)
    load_after = os.getloadavg()

    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"tiny Llama {spec.num_hidden_layers} x {spec.hidden_size} ({parameters / 1e6:.1f}M "
        f"parameters, at most {spec.train_steps} warm-start steps), "
        f"{config.per_step_prompts} prompts x "
        f"G = {config.num_generations}, max_completion_length {config.max_completion_length}, "
        f"beta {config.beta}, torch threads {args.threads}, TRL {trl.__version__}"
    )
    print(
        f"load average (1, 5, 15 min): before {_load(load_before)}, after {_load(load_after)}; "
        f"{args.repeats} timed steps per side after one warm-up, interleaved A B A B"
    )
    print(f"{'':6} {'wall s':>8} {'CPU s':>8} {'len mean':>9} {'len max':>8} {'grad_norm':>10}")
    medians = {}
    for side in ("ours", "TRL"):
        timed = interleave.times[side][1:]
        logs = [interleave.logs[side][step] for step in range(2, steps + 1)]
        medians[side] = [statistics.median(lap[i] for lap in timed) for i in (0, 1)]
        lengths = [_length_stats(side, log) for log in logs]
        print(
            f"{side:6} {medians[side][0]:>8.3f} {medians[side][1]:>8.3f} "
            f"{statistics.mean(m for m, _ in lengths):>9.1f} "
            f"{statistics.mean(x for _, x in lengths):>8.1f} "
            f"{statistics.median(log['grad_norm'] for log in logs):>10.3g}"
        )
    wall, cpu = (medians["ours"][i] / medians["TRL"][i] for i in (0, 1))
    verdict = "PASS" if cpu <= TARGET_RATIO else "FAIL"
    print(
        f"ours / TRL: CPU {cpu:.3f}, wall {wall:.3f} (medians; target CPU <= "
        f"{TARGET_RATIO:g}): {verdict}"
    )
    print(
        "each step, CPU s (ours, TRL): "
        + ", ".join(
            f"({a[1]:.2f}, {b[1]:.2f})"
            for a, b in zip(interleave.times["ours"][1:], interleave.times["TRL"][1:])
        )
    )


def _length_stats(side: str, log: dict) -> tuple[float, float]:
    """(mean, max) completion length of a step's log (our records use TRL's names)."""
    return log["completions/mean_length"], log["completions/max_length"]


def _load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.2f}" for x in load)


if __name__ == "__main__":
    main()
