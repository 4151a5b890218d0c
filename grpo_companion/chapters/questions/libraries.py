r"""Chapter 14: two answers read from the libraries themselves, TRL's batch arithmetic and peft's
first LoRA step.

`trl_batch_layout` builds TRL 1.16's `GRPOConfig` and reads what a batch counts:
generation_batch_size = per_device_train_batch_size * num_processes * steps_per_generation
completions (``steps_per_generation`` = ``gradient_accumulation_steps`` by default), which
``num_generations`` must divide, so one generation batch holds generation_batch_size / G
prompts; or it returns TRL's error message. `trl_defaults` reads the defaults the chapter quotes.

peft's LoRA adapter trains W' = W + (alpha / r) B A with B = 0 and A drawn by Kaiming's uniform
rule (entries of variance 1 / (3 d_in)). At B = 0 only B has a gradient, (alpha / r) G A^T for
the full gradient G, and AdamW's first step moves each entry by the learning rate eta times its
sign, so

    full fine-tuning:  ||Delta W||_F = eta sqrt(d_out d_in);
    LoRA:              ||Delta W||_F ~ eta (alpha / r) sqrt(d_out r / 3),

a ratio of about alpha / sqrt(3 r d_in) (`lora_first_step_ratio`) at the same learning rate.
`first_adam_step_norm` measures it with peft and torch's AdamW on one linear layer.

Chapter: :doc:`/book/14_questions` (section 4: what a TRL batch counts; section 10: LoRA's first
step)
"""

import math

import torch
from torch import nn

# The GRPOConfig defaults the chapter quotes.
TRL_DEFAULTS = (
    "per_device_train_batch_size", "num_generations", "num_iterations", "beta", "epsilon",
    "loss_type", "scale_rewards", "use_bias_correction_kl", "max_completion_length",
    "learning_rate", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
)  # fmt: skip


def trl_defaults() -> dict:
    """{name: TRL's default} of the `TRL_DEFAULTS` fields of TRL's `GRPOConfig`, read from its
    dataclass fields (nothing is instantiated)."""
    from trl import GRPOConfig

    fields = GRPOConfig.__dataclass_fields__
    return {name: fields[name].default for name in TRL_DEFAULTS}


def trl_batch_layout(
    per_device_train_batch_size: int,
    num_generations: int,
    gradient_accumulation_steps: int = 1,
    **fields,
) -> dict:
    """TRL's `GRPOConfig` with these settings on one process (CPU, no checkpointing, no
    logging): "generation_batch_size", "steps_per_generation" and "prompts_per_generation"
    (generation_batch_size / num_generations), or {"error": TRL's message}. `fields`: more
    `GRPOConfig` settings."""
    from trl import GRPOConfig

    try:
        config = GRPOConfig(
            per_device_train_batch_size=per_device_train_batch_size,
            num_generations=num_generations,
            gradient_accumulation_steps=gradient_accumulation_steps,
            use_cpu=True,
            bf16=False,
            activation_checkpointing=False,
            report_to=[],
            **fields,
        )
    except ValueError as error:
        return {"error": str(error)}
    return {
        "generation_batch_size": config.generation_batch_size,
        "steps_per_generation": config.steps_per_generation,
        "prompts_per_generation": config.generation_batch_size // config.num_generations,
    }


def first_adam_step_norm(
    in_features: int,
    out_features: int,
    learning_rate: float,
    seed: int,
    lora_rank: int | None = None,
    lora_alpha: float = 32.0,
) -> float:
    """||Delta W||_F after one AdamW step (weight decay 0) on a mean-squared loss of a random
    batch through one bias-free linear layer, seeded: the full weight, or a peft LoRA adapter
    of rank `lora_rank` (merged to read Delta W)."""
    from peft import LoraConfig, get_peft_model

    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the layer's and the adapter's initialisation
    model = nn.Sequential(nn.Linear(in_features, out_features, bias=False))
    inputs = torch.randn(64, in_features, generator=generator)
    targets = torch.randn(64, out_features, generator=generator)
    before = model[0].weight.detach().clone()
    if lora_rank is not None:
        model = get_peft_model(
            model,
            LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules=["0"], lora_dropout=0.0),
        )
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=learning_rate, weight_decay=0.0)
    (model(inputs) - targets).square().mean().backward()
    optimizer.step()
    if lora_rank is not None:
        model = model.merge_and_unload()
    return float((model[0].weight.detach() - before).norm())


def lora_first_step_ratio(in_features: int, lora_rank: int, lora_alpha: float) -> float:
    """alpha / sqrt(3 r d_in): LoRA's first AdamW step over full fine-tuning's, in Frobenius norm,
    at the same learning rate (module docstring; exact in expectation over A for large d)."""
    return lora_alpha / math.sqrt(3 * lora_rank * in_features)
