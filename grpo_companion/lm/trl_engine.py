r"""TRL's `GRPOTrainer` as the engine for runs past one process; `trainer.train` stays the
readable reference and the CPU default.

    trl_config          the companion's `GRPOConfig` as TRL's, setting by setting
    train_with_trl      `trainer.train`'s signature and history, trained by TRL (accelerate for
                        several GPUs, vLLM for generation when asked, bf16 autocast on CUDA)
    engine_train        "companion" -> `trainer.train`, "trl" -> `train_with_trl`
    check_run_settings  one clear line, before any work, for settings that cannot run here
    main                ``python -m grpo_companion.lm.trl_engine``, for ``accelerate launch``

How the settings map (same name in both unless listed): per_step_prompts B is
``per_device_train_batch_size * gradient_accumulation_steps * num_processes / G``, with
``per_device_train_batch_size = micro_batch_size`` (clipped to B * G) and TRL's default
``steps_per_generation = gradient_accumulation_steps`` (one generation batch per update);
``max_steps`` counts TRL optimizer steps, so it is the companion's ``max_steps *
num_iterations``; ``save_steps`` likewise; the learning rate is constant
(``lr_scheduler_type="constant"``, the companion's choice; TRL's default decays it). Not in
TRL, refused: method other than "grpo", filter_degenerate, kl_clamp, loss_type "length_alpha".
Without a TRL counterpart and ignored: rollout_batch_size (TRL generates the whole per-device
batch at once) and eval_every (the held-out accuracy is measured by the callback, `trl_callback`).
What differs in the run though the settings agree: TRL walks the prompts in its own seeded
order (not `trainer.batch_indices`), samples with its own random stream, shuffles completions
across micro-batches, and puts the model in train mode (dropout, where the model has any).
"""

import argparse
import copy
import importlib.util
import json
import os
import tempfile
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
from transformers import PrinterCallback
from transformers.utils import logging as transformers_logging

from grpo_companion.lm import gsm8k
from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.evaluation import held_out_accuracy
from grpo_companion.lm.gsm8k import SYSTEM_PROMPT, build_prompts
from grpo_companion.lm.models import ModelUnavailableError, check_model_available, load_policy
from grpo_companion.lm.trainer import CLIP_METRICS, METRICS, train

ENGINES = ("companion", "trl")
# Settings TRL's GRPOConfig has under the same name and meaning.
SAME_NAME = (
    "num_generations", "max_completion_length", "temperature", "scale_rewards",
    "mask_truncated_completions", "loss_type", "beta", "use_bias_correction_kl", "epsilon",
    "epsilon_high", "delta", "importance_sampling_level", "off_policy_mask_threshold",
    "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos",
    "vespo_k_neg", "vespo_lambda_neg", "learning_rate", "weight_decay", "max_grad_norm",
    "num_iterations", "seed", "top_p", "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
)  # fmt: skip
# Per-update metrics: averaged over a batch's num_iterations TRL steps, as `trainer.grpo_step`.
UPDATE_METRICS = ("loss", "kl", *CLIP_METRICS, "entropy", "grad_norm")


class RunSettingsError(ValueError):
    """Settings that cannot run here; the message is one line saying what to change."""


def trl_config(config: GRPOConfig, output_dir, device: str = "cpu", *, use_vllm: bool = False,
               progress: bool = False, **fields):  # fmt: skip
    """TRL's `GRPOConfig` for the companion's `config` (module docstring for the mapping).

    fields: further TRL settings that have no counterpart in `config`, or replace the mapping's
    (benchmarks/grpo_step_vs_trl.py: ``shuffle_dataset=False``, ``optim="adamw_torch"``).
    """
    from trl import GRPOConfig as TRLConfig

    refused = {
        "method": config.method != "grpo",
        "filter_degenerate": config.filter_degenerate,
        "kl_clamp": config.kl_clamp,
        "loss_type": config.loss_type == "length_alpha",
    }
    if any(refused.values()):
        names = ", ".join(f"{n}={getattr(config, n)!r}" for n, bad in refused.items() if bad)
        raise RunSettingsError(f"TRL has no counterpart of {names}; use engine='companion'")
    processes = int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch / torchrun
    micro, accumulation = batch_layout(config, processes)
    mu = config.num_iterations
    cuda = torch.device(device).type == "cuda"
    settings = (
        dict(
            output_dir=str(output_dir),
            **{name: getattr(config, name) for name in SAME_NAME},
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=accumulation,
            max_steps=config.max_steps * mu,
            lr_scheduler_type="constant",
            save_strategy="steps" if config.save_steps else "no",
            save_steps=config.save_steps * mu if config.save_steps else 500,
            use_cpu=not cuda,
            bf16=cuda,
            use_vllm=use_vllm,
            vllm_mode="colocate",
            logging_steps=1,
            report_to=[],
            disable_tqdm=not progress,
            gradient_checkpointing=False,
            dataloader_num_workers=0,
        )
        | fields
    )
    return TRLConfig(**settings)


def batch_layout(config: GRPOConfig, processes: int = 1) -> tuple[int, int]:
    """(per_device_train_batch_size, gradient_accumulation_steps) that make one optimizer step
    of B * G completions over `processes` processes, micro_batch_size at most per pass."""
    completions = config.per_step_prompts * config.num_generations  # B * G per step
    micro = min(config.micro_batch_size, completions // processes)
    if completions % (micro * processes):
        raise RunSettingsError(
            f"micro_batch_size={micro} x {processes} processes must divide B * G = {completions}"
        )
    return micro, completions // (micro * processes)


def train_with_trl(
    model,
    tokenizer,
    train_data,
    eval_data,
    config: GRPOConfig,
    *,
    reward_fn=gsm8k.reward,
    checkpoint_dir=None,
    resume: bool = False,
    progress: bool = True,
    use_vllm: bool = False,
    rank_every: int = 0,
) -> list[dict]:
    """`trainer.train`, run by TRL's `GRPOTrainer`; the same arguments and history.

    History: record 0 holds the accuracy before training, record s TRL's logs of batch s
    (per-update metrics averaged over its num_iterations steps) under `trainer.METRICS`'s
    names, all_correct / all_wrong and the book's extra measurements (`trl_callback`,
    ``rank/*`` every `rank_every` batches), and eval_accuracy where `trainer.train` has it.
    checkpoint_dir: TRL's output_dir (its checkpoint-* folders; a temporary folder if None);
    resume: continue from its last checkpoint (the book's extra measurements then start at
    the resumed batch). With beta > 0 TRL loads its reference from the model's
    ``config._name_or_path``: unless that is a saved folder, the initial weights are saved
    under checkpoint_dir/initial_policy first.
    """
    import datasets

    from grpo_companion.lm.trl_callback import BookMeasurements, MeasuredGRPOTrainer

    output_dir = Path(checkpoint_dir or tempfile.mkdtemp(prefix="trl_engine_"))
    device = next(model.parameters()).device.type
    prompts, golds = build_prompts(tokenizer, train_data)

    def evaluate(policy) -> float:
        return held_out_accuracy(policy, tokenizer, eval_data, config, reward_fn)

    def reward(prompts, completions, gold, **kwargs):  # TRL's reward-function signature
        return [reward_fn(completion[-1]["content"], g) for completion, g in zip(completions, gold)]

    args = trl_config(config, output_dir, device, use_vllm=use_vllm, progress=progress)
    policy, model = model, _unflagged(model)  # `model` is what TRL trains; `policy` gets it back
    bars = transformers_logging.is_progress_bar_enabled()
    if not progress:  # no bars saving or loading the reference model
        transformers_logging.disable_progress_bar()
    measurements = BookMeasurements(
        config.num_generations, rank_every=rank_every, evaluate=evaluate,
        eval_every=config.eval_every, num_iterations=config.num_iterations,
    )  # fmt: skip
    # Conversational prompts: TRL applies the chat template, as `gsm8k.format_prompt` does.
    questions = list(train_data["question"])
    dataset = datasets.Dataset.from_dict({
        "prompt": [[{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": question}] for question in questions],
        "gold": golds,
    })  # fmt: skip
    assert len(prompts) == len(dataset)
    before = evaluate(model)
    try:
        if config.beta > 0 and not (Path(model.config._name_or_path) / "config.json").exists():
            initial = output_dir / "initial_policy"
            with args.main_process_first(local=False):  # one process saves, the others wait
                if args.process_index == 0:
                    model.save_pretrained(initial)
            model.config._name_or_path = str(initial)
        trainer = MeasuredGRPOTrainer(
            model=model,
            reward_funcs=measurements.recording(reward),
            args=args,
            processing_class=tokenizer,
            train_dataset=dataset,
            measurements=measurements,
        )
    finally:
        if bars:
            transformers_logging.enable_progress_bar()
    if not progress:  # without tqdm bars, transformers prints every log instead
        trainer.remove_callback(PrinterCallback)
    has_checkpoint = any(output_dir.glob("checkpoint-*"))
    trainer.train(resume_from_checkpoint=bool(resume and has_checkpoint))
    if model is not policy:
        policy.load_state_dict(model.state_dict())
    policy.eval()
    return trl_history(trainer.state.log_history, measurements.records, config, before)


def _unflagged(model):
    """`model`, or where it was loaded from a GGUF file (SmolLM2), the same weights in a model
    not flagged as quantized: its weights are plain floats, but transformers' Trainer refuses to
    train, and `save_pretrained` to save, a model so flagged."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None or quantizer.quantization_config.quant_method != "gguf":
        return model
    from transformers import AutoModelForCausalLM

    model_config = copy.deepcopy(model.config)
    del model_config.quantization_config
    plain = AutoModelForCausalLM.from_config(model_config).to(model.device, model.dtype)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    return plain.eval()


def trl_history(log_history: list[dict], records: dict, config: GRPOConfig, before) -> list[dict]:
    """`trainer.train`'s history from TRL's `log_history` (one log per optimizer step) and the
    callback's per-batch records."""
    logs = [log for log in log_history if "loss" in log and "step" in log]
    mu = config.num_iterations
    history = [{**dict.fromkeys(METRICS), "step": 0, "eval_accuracy": before}]
    for step in range(1, len(logs) // mu + 1):
        batch_logs = [log for log in logs if (step - 1) * mu < log["step"] <= step * mu]
        record = {**dict.fromkeys(METRICS), "step": step}
        for name in METRICS[1:]:
            values = [log[name] for log in batch_logs if log.get(name) is not None]
            if values:  # rollout metrics are logged by the batch's first update only
                record[name] = values[-1] if name == "num_tokens" else sum(values) / len(values)
        if config.beta == 0:
            record["kl"] = None
        record.update(records.get(step, {}))
        history.append(record)
    return history


def engine_train(engine: str, *, use_vllm: bool = False):
    """The training function of `engine`: `trainer.train`, or `train_with_trl` (with vLLM
    generation if `use_vllm`); both take `trainer.train`'s arguments."""
    check_run_settings(engine=engine, device="cuda" if use_vllm else "cpu", use_vllm=use_vllm)
    return train if engine == "companion" else partial(train_with_trl, use_vllm=use_vllm)


def check_run_settings(
    *,
    engine: str = "companion",
    device: str = "cpu",
    use_vllm: bool = False,
    model_name: str | None = None,
    data_source: str | None = None,
    beta: float = 0.0,
    num_parameters: int | None = None,
) -> None:
    """Raise `RunSettingsError` with one line if these settings cannot run here; do nothing else.

    Checks: a known engine; TRL importable for engine "trl"; CUDA present when the device asks
    for it; vLLM only with engine "trl", on CUDA, installed; that `model_name` and, for
    ``data_source="hub"``, GSM8K can load here (a reachable hub or a cached copy, one quick
    probe each: `models.check_model_available`, `gsm8k.check_hub_available`); and on CUDA,
    that float32 training of the model fits the GPU: 16 bytes a parameter (weights, gradients,
    AdamW's two moments) plus 4 for the KL reference when beta > 0, activations not counted.
    The parameter count is `num_parameters`, or read from `model_name`'s config when it is a
    local folder or cached.
    """
    if engine not in ENGINES:
        raise RunSettingsError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine == "trl" and not _importable("trl"):
        raise RunSettingsError("engine='trl' needs TRL (pip install trl); or engine='companion'")
    cuda = torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RunSettingsError(
            f"device={device!r} but this machine has no CUDA GPU: run the cpu profile "
            "(--profile cpu) or set device='cpu'"
        )
    if use_vllm and (engine != "trl" or not cuda or not _importable("vllm")):
        raise RunSettingsError(
            "use_vllm needs engine='trl', device='cuda' and vLLM installed (pip install vllm)"
        )
    if model_name is not None:
        try:
            check_model_available(model_name)
        except ModelUnavailableError as error:
            raise RunSettingsError(str(error)) from None
    if data_source == "hub":
        try:
            gsm8k.check_hub_available()
        except gsm8k.GSM8KUnavailableError:
            raise RunSettingsError(
                "data_source='hub' cannot load openai/gsm8k here: the hub is unreachable and no "
                "copy is cached; offline sources: 'arithmetic', 'gsm_symbolic', or 'jsonl' with "
                "a path to GSM8K's own files"
            ) from None
    if cuda:
        count = num_parameters or (model_name and _parameter_count(model_name))
        need = count * (16 + (4 if beta > 0 else 0)) if count else 0
        have = torch.cuda.get_device_properties(torch.device(device)).total_memory
        if need > have:
            raise RunSettingsError(
                f"{model_name or 'the model'} ({count / 1e9:.1f}B parameters) needs about "
                f"{need / 2**30:.0f} GiB to train in float32, the GPU has {have / 2**30:.0f} GiB"
            )


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _parameter_count(model_name: str) -> int | None:
    """Parameters of `model_name` from its config alone (no weights), where the config is
    local (a folder, or the Hugging Face cache); None otherwise."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        model_config = AutoConfig.from_pretrained(model_name, local_files_only=True)
    except (OSError, ValueError):
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return sum(parameter.numel() for parameter in model.parameters())


def main(argv=None) -> list[dict]:
    """Train through TRL from the command line; the main process writes history.json (the
    config and `train_with_trl`'s history) to --output-dir.

    one GPU:  python -m grpo_companion.lm.trl_engine --model <hub id or folder> --device cuda
    N GPUs:   accelerate launch --num_processes N -m grpo_companion.lm.trl_engine ...
    """
    parser = argparse.ArgumentParser(
        prog="python -m grpo_companion.lm.trl_engine",
        description=main.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="tiny-llama", help="models.load_policy name, hub id "
                        "or local Hugging Face folder")  # fmt: skip
    parser.add_argument("--data-source", default="arithmetic", choices=gsm8k.SOURCES)
    parser.add_argument("--data-path", default=None, help="for --data-source jsonl")
    parser.add_argument("--num-train-prompts", type=int, default=2000)
    parser.add_argument("--num-eval-prompts", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--grpo", default="{}", help="GRPOConfig fields as JSON: '{\"beta\": 0}'")
    parser.add_argument("--use-vllm", action="store_true", help="vLLM colocate generation")
    parser.add_argument("--rank-every", type=int, default=0)
    parser.add_argument("--output-dir", default="_build/trl_engine")
    args = parser.parse_args(argv)
    config = GRPOConfig(**json.loads(args.grpo))
    check_run_settings(engine="trl", device=args.device, use_vllm=args.use_vllm,
                       model_name=args.model, data_source=args.data_source,
                       beta=config.beta)  # fmt: skip
    device = args.device  # under accelerate launch, each process on its own GPU
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        device = f"cuda:{os.environ['LOCAL_RANK']}"
    model, tokenizer = load_policy(args.model, device=device, dtype="float32")
    data = {
        split: gsm8k.load_gsm8k(split, source=args.data_source, path=args.data_path,
                                num_examples=n, seed=config.seed)
        for split, n in [("train", args.num_train_prompts), ("test", args.num_eval_prompts)]
    }  # fmt: skip
    history = train_with_trl(model, tokenizer, data["train"], data["test"], config,
                             checkpoint_dir=args.output_dir, use_vllm=args.use_vllm,
                             rank_every=args.rank_every)  # fmt: skip
    if int(os.environ.get("RANK", "0")) == 0:  # set by accelerate launch / torchrun
        output = Path(args.output_dir) / "history.json"
        output.write_text(json.dumps({"config": asdict(config), "history": history}))
    return history


if __name__ == "__main__":
    main()
