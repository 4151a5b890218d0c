r"""The tiny Llama of the testbed (chapter 4): its spec, its digit-level tokenizer, its warm
start on arithmetic word problems, and the cache that keeps it.

`load_tiny_llama(spec)` trains the model the first time (minutes on 2 cores) until its greedy
accuracy on validation problems reaches the spec's target, so that GRPO groups are mixed, and
reads it from ``_build/cache/models/tiny-llama-<hash>/`` afterwards; the hash covers the spec
(architecture, recipe, seed) and a fingerprint of the generated problems. The tokenizer is a
word-level vocabulary of those problems with one token per digit, so that arithmetic is
learnable by a model this small. Loading any model by name is `models.load_policy`.
"""

import contextlib
import hashlib
import json
import math
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from grpo_companion.lm.gsm8k import build_prompts, load_gsm8k
from grpo_companion.lm.rollouts import greedy_accuracy
from grpo_companion.reproducibility import code_path

DEFAULT_CACHE_DIR = Path(__file__).resolve().parents[2] / "_build" / "cache" / "models"

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
        version, the problems the generator produces for this seed, or the kernels' code path
        (`reproducibility.code_path`): a checkpoint trained on another path has other weights."""
        sample = load_gsm8k("train", source="arithmetic", num_examples=16, seed=self.seed)
        fingerprint = {
            "spec": asdict(self),
            "recipe": _RECIPE_VERSION,
            "data": sample.to_dict(),
            "code_path": code_path(),
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
        save_atomically(folder, model, tokenizer, {"spec": asdict(spec), **report})
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


def save_atomically(
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
