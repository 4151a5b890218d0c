r"""The micro language model: a decoder of under 100k parameters on a k-step task whose correct
completion is unique, so that a prompt's pass rate is exact.

The task, a running sum: a prompt is k digits d_1 .. d_k in 0..m-1 (m, the modulus, is the
difficulty knob), written "3 5 1 8", and the one correct completion is the k running sums
s_t = (d_1 + ... + d_t) mod m, one worked line each: "3\n8\n9\n7" (m = 10), then the end of
sequence. The reward is 1 for that completion and 0 for anything else (`reward`), so a prompt's
pass rate under sampling at temperature tau is exactly

    J(x) = prod_{t=1}^{T} pi_tau(y*_t | x, y*_{<t}),       y* = the correct tokens and <eos>,

one teacher-forced pass (`exact_pass_rates`), with no sampling noise; the degenerate fraction of
groups of G is exact too, E_x[J(x)^G + (1 - J(x))^G] (`exact_degenerate_fraction`). Only the
training rollouts are sampled.

The problems have GSM8K's schema (`question`, `answer` = the worked lines then "#### <code>",
the code a number that spells the running sums), so the book's trainer (`lm.trainer`, the same
GRPOConfig and losses) trains the model unchanged with `reward` as its reward function. Prompts
split into train and test by a hash of the digits (`split_of`): a held-out prompt is never
trained on, whatever the seed; `problems` draws fresh ones from a split, as many as asked.

The model is a transformers `LlamaForCausalLM` (`MicroSpec`: 2 layers, 64 wide, about 85k
parameters) over a character-level vocabulary; `warm_start` trains it supervised on fresh
training prompts until the mean exact J of validation prompts reaches a target, which sets the
starting pass rate.
"""

import copy
import functools
import hashlib
import itertools
import random
from dataclasses import dataclass

import datasets
import torch
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.critic import Critic
from grpo_companion.lm.gsm8k import build_prompts
from grpo_companion.lm.scoring import sequence_log_probs
from grpo_companion.lm.trainer import grpo_step, reference_and_optimizer

SPLITS = ("train", "test")
TEST_SHARE = 0.2  # of all prompts, by hash
# One token per character. <eos> is the only special token (it pads too): every other token the
# model can sample shows in the decoded text, "?" (unknown) included, so the decoded completion
# equals the correct one exactly when the sampled tokens are the correct ones and then <eos>.
_EOS = "<eos>"
_VOCAB = [_EOS, *"0123456789", " ", "\n", "=", "?"]
_TEMPLATE = "{{ messages[-1]['content'] }}={{ '\n' }}"


@dataclass(frozen=True)
class MicroSpec:
    """The micro model (transformers ``LlamaConfig`` names) and its warm start.

    The warm start's learning is a phase change. In one run each (seed 0, 4-digit sums mod 10):
    at 1e-3 and 64 prompts a step, the validation J stayed at 0 for 400 steps, then passed 0.13
    at 450 and 0.5 by 500 (17 CPU seconds); at 3e-3 with 128 prompts it was 0.07 after 1500
    steps; at 1e-2 it never left 0. Evaluate often (``eval_every``) to stop near the target."""

    num_hidden_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_attention_heads: int = 4
    max_position_embeddings: int = 64
    warm_start_target: float = 0.3  # mean exact J of the validation prompts to stop at
    warm_start_max_steps: int = 2000
    warm_start_batch: int = 64
    warm_start_learning_rate: float = 1e-3
    eval_every: int = 10
    num_validation: int = 256
    seed: int = 0


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character: digits, space, newline, '=' and '?' (anything else);
    decode(encode(s)) == s for text made of those."""
    tokenizer = Tokenizer(WordLevel({t: i for i, t in enumerate(_VOCAB)}, unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        chat_template=_TEMPLATE,
        clean_up_tokenization_spaces=False,
        eos_token=_EOS,
        pad_token=_EOS,
    )


def build_model(spec: MicroSpec, tokenizer) -> LlamaForCausalLM:
    """A randomly initialised micro model, seeded by ``spec.seed``."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(spec.seed)
    return LlamaForCausalLM(config).eval()


# --- the task ------------------------------------------------------------------------------


def running_sums(digits: list[int], modulus: int) -> list[int]:
    """s_t = (d_1 + ... + d_t) mod m, t = 1..k."""
    sums, total = [], 0
    for digit in digits:
        total = (total + digit) % modulus
        sums.append(total)
    return sums


def question(digits: list[int]) -> str:
    return " ".join(map(str, digits))


def solution(digits: list[int], modulus: int) -> str:
    """The one correct completion: the running sums, one worked line each."""
    return "\n".join(map(str, running_sums(digits, modulus)))


def _code(digits: list[int], modulus: int) -> str:
    """The gold number that spells the solution: a leading 1, then each sum in its width."""
    width = len(str(modulus - 1))
    return "1" + "".join(f"{s:0{width}d}" for s in running_sums(digits, modulus))


def decode_gold(gold: str, modulus: int) -> str:
    """The correct completion from the gold number `_code` wrote."""
    width = len(str(modulus - 1))
    body = gold[1:]
    return "\n".join(str(int(body[i : i + width])) for i in range(0, len(body), width))


def reward(completion: str, gold: str, modulus: int = 10) -> float:
    """1.0 if `completion` (decoded, <eos> dropped) is exactly the correct completion, else 0.0:
    with `max_completion_length(k)` tokens or more to sample in, that is the event whose
    probability `exact_pass_rates` computes. The completion is untrusted text: compared, never
    evaluated."""
    return float(completion == decode_gold(gold, modulus))


def written_steps(completion: str, answer_field: str) -> tuple[list[float], list[int], int]:
    """The task's steps for process credit (`steps.rollout_step_rewards`' ``steps_of``): step j
    is right when the completion's j-th line is the j-th running sum. Returns (rewards: the k
    steps' then the outcome's, `reward`; ends: the character offset after each step's line,
    ``len(completion)`` for a step never written and for the outcome; written: lines written,
    at most k). The completion is untrusted text: split and compared, never evaluated."""
    body = answer_field.rpartition("\n#### ")[0]
    reference = body.split("\n")
    lines = completion.split("\n") if completion else []
    rewards, ends, offset = [], [], 0
    for j, step in enumerate(reference):
        if j < len(lines):
            rewards.append(float(lines[j] == step))
            ends.append(offset + len(lines[j]))
            offset += len(lines[j]) + 1
        else:
            rewards.append(0.0)
            ends.append(len(completion))
    rewards.append(float(completion == body))
    ends.append(len(completion))
    return rewards, ends, min(len(lines), len(reference))


def max_completion_length(num_steps: int, modulus: int = 10) -> int:
    """Tokens of the correct completion and its <eos>: the least room to sample in for which a
    correct text means correct tokens then <eos> (with less, a run cut short would pass)."""
    return num_steps * (len(str(modulus - 1)) + 1)


def split_of(digits: list[int]) -> str:
    """'test' for TEST_SHARE of all digit strings (by SHA-256), else 'train': a held-out prompt
    is never a training prompt, for any seed."""
    value = int(hashlib.sha256(question(digits).encode()).hexdigest()[:8], 16) / 16**8
    return "test" if value < TEST_SHARE else "train"


def problems(
    split: str,
    num_steps: int,
    num_examples: int,
    *,
    modulus: int = 10,
    seed: int = 0,
    distinct: bool = False,
) -> datasets.Dataset:
    """`num_examples` prompts of `num_steps` digits from `split`, drawn uniformly (with
    repeats, as fresh draws from the task; `distinct`: without, and all of them if the split
    holds fewer), GSM8K's schema."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if num_steps < 1 or modulus < 2 or num_examples < 1:
        raise ValueError(
            f"need num_steps >= 1, modulus >= 2, num_examples >= 1, got "
            f"{num_steps}, {modulus}, {num_examples}"
        )
    rng = random.Random(f"micro/{split}/{num_steps}/{modulus}/{seed}")
    if distinct:
        every = itertools.product(range(modulus), repeat=num_steps)
        pool = [list(digits) for digits in every if split_of(list(digits)) == split]
        rng.shuffle(pool)
        drawn = pool[:num_examples]
    else:
        drawn, attempts = [], 0
        while len(drawn) < num_examples and attempts < 1000 * num_examples:
            attempts += 1
            digits = [rng.randrange(modulus) for _ in range(num_steps)]
            if split_of(digits) == split:
                drawn.append(digits)
    if not drawn or (not distinct and len(drawn) < num_examples):
        raise ValueError(
            f"the {split} split of {num_steps}-digit prompts mod {modulus} is (nearly) empty: "
            f"use more steps or a larger modulus"
        )
    return datasets.Dataset.from_dict(
        {
            "question": [question(d) for d in drawn],
            "answer": [f"{solution(d, modulus)}\n#### {_code(d, modulus)}" for d in drawn],
        }
    )


# --- exact measurement ---------------------------------------------------------------------


def teacher_forced_batch(tokenizer, data, modulus: int = 10):
    """(input_ids, attention_mask, completion_mask) of each prompt followed by its correct
    completion and <eos>: (N, P + T), (N, P + T), (N, T), prompts left-padded."""
    prompts, golds = build_prompts(tokenizer, data)
    completions = [decode_gold(gold, modulus) for gold in golds]
    prompt = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    target = [
        tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for c in completions
    ]
    width_p, width_t = max(map(len, prompt)), max(map(len, target))
    pad = tokenizer.pad_token_id
    ids, mask, completion_mask = [], [], []
    for p, t in zip(prompt, target):
        ids.append([pad] * (width_p - len(p)) + p + t + [pad] * (width_t - len(t)))
        mask.append([0] * (width_p - len(p)) + [1] * (len(p) + len(t)) + [0] * (width_t - len(t)))
        completion_mask.append([1] * len(t) + [0] * (width_t - len(t)))
    return torch.tensor(ids), torch.tensor(mask), torch.tensor(completion_mask)


@torch.no_grad()
def exact_pass_rates(
    model, tokenizer, data, *, temperature: float = 1.0, modulus: int = 10, batch_size: int = 512
) -> torch.Tensor:
    """(N,) J(x) of each problem: the probability that sampling at `temperature` writes the
    correct completion and stops, prod_t pi(y*_t | x, y*_<t), float64."""
    rates = []
    for start in range(0, len(data), batch_size):
        rows = data.select(range(start, min(start + batch_size, len(data))))
        ids, mask, completion_mask = teacher_forced_batch(tokenizer, rows, modulus)
        log_probs = sequence_log_probs(model, ids, mask, completion_mask, temperature)
        rates.append(log_probs.double().sum(dim=1).exp())
    return torch.cat(rates)


def exact_degenerate_fraction(pass_rates: torch.Tensor, group_size: int) -> float:
    """E_x[J^G + (1 - J)^G]: the share of groups of G whose rewards are all equal."""
    return float((pass_rates**group_size + (1 - pass_rates) ** group_size).mean())


# --- the warm start ------------------------------------------------------------------------


def warm_start(spec: MicroSpec, num_steps: int, *, modulus: int = 10, progress: bool = False):
    """(model, tokenizer, report): supervised next-token training on the correct completions
    of fresh training prompts of `num_steps` digits (AdamW), stopped at the first evaluation
    (every ``spec.eval_every`` steps) at which the validation prompts' mean exact J reaches
    ``spec.warm_start_target``. Validation prompts are training-split prompts never trained on
    (another seed's draws); report: steps, mean J at each evaluation."""
    from tqdm.auto import tqdm

    tokenizer = build_tokenizer()
    model = build_model(spec, tokenizer)
    validation = problems(
        "train", num_steps, spec.num_validation, modulus=modulus, seed=10_000 + spec.seed
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.warm_start_learning_rate)
    curve = [(0, float(exact_pass_rates(model, tokenizer, validation, modulus=modulus).mean()))]
    step = 0
    bar = tqdm(total=spec.warm_start_max_steps, desc="micro warm start", disable=not progress)
    while curve[-1][1] < spec.warm_start_target and step < spec.warm_start_max_steps:
        step += 1
        batch = problems(
            "train",
            num_steps,
            spec.warm_start_batch,
            modulus=modulus,
            seed=spec.seed * 1_000_003 + step,
        )
        ids, mask, completion_mask = teacher_forced_batch(tokenizer, batch, modulus)
        model.train()
        loss = -sequence_log_probs(model, ids, mask, completion_mask).sum() / completion_mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.eval()
        bar.update()
        if step % spec.eval_every == 0:
            rates = exact_pass_rates(model, tokenizer, validation, modulus=modulus)
            curve.append((step, float(rates.mean())))
    bar.close()
    return model, tokenizer, {"steps": step, "validation_pass_rate": curve}


def num_parameters(model) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


# --- GRPO on fresh prompts -----------------------------------------------------------------


def grpo_run(model, tokenizer, config, num_steps: int, test_data, *, modulus: int = 10,
             eval_every: int | None = None, critic_learning_rate: float = 1e-3,
             critic_lambda: float = 0.95) -> dict:  # fmt: skip
    """Train `model` in place with the book's trainer (`trainer.grpo_step`, `config` a
    GRPOConfig) on fresh training prompts of `num_steps` digits, ``per_step_prompts`` new ones
    a step, drawn with ``config.seed`` (runs of one seed see the same prompts and sampler
    streams, so arms are paired); measure the exact J of `test_data` (never trained on) at step
    0, every `eval_every` steps and at the end. Process credit reads the lines as steps
    (`written_steps`); ``credit="value"`` learns a critic from the outcomes (`critic.Critic`,
    its own Adam at `critic_learning_rate`, GAE's `critic_lambda`).

    Returns {"steps": [s, ...], "pass_rate": mean J at each, "degenerate": the exact degenerate
    fraction of groups of ``num_generations`` at each, "final": (N,) J after the last step}."""
    fresh = problems("train", num_steps, config.max_steps * config.per_step_prompts,
                     modulus=modulus, seed=1_000_003 * (config.seed + 1))  # fmt: skip
    prompts, golds = build_prompts(tokenizer, fresh)
    answers = list(fresh["answer"])
    reward_fn = functools.partial(reward, modulus=modulus)
    reference, optimizer = reference_and_optimizer(model, config)
    critic = None
    if config.credit == "value":
        critic = Critic(model, learning_rate=critic_learning_rate, lam=critic_lambda)
    every = eval_every or config.max_steps
    curve = {"steps": [], "pass_rate": [], "degenerate": []}

    def measure(step):
        rates = exact_pass_rates(model, tokenizer, test_data, modulus=modulus)
        curve["steps"].append(step)
        curve["pass_rate"].append(float(rates.mean()))
        curve["degenerate"].append(exact_degenerate_fraction(rates, config.num_generations))
        return rates

    rates = measure(0)
    for step in range(1, config.max_steps + 1):
        grpo_step(model, tokenizer, reference, optimizer, prompts, golds, config, step,
                  reward_fn, answers=answers, steps_of=written_steps, critic=critic)  # fmt: skip
        if step % every == 0 or step == config.max_steps:
            rates = measure(step)
    return {**curve, "final": rates}


# --- a warm start with its held-out prompts, and arms trained from it ----------------------


@dataclass(frozen=True)
class Start:
    """A warm start and its held-out prompts: `validation` for tuning, `test` for comparing,
    both test-split prompts no run trains on; pass_rates: (N,) exact J of the test prompts."""

    spec: MicroSpec
    num_steps: int
    modulus: int
    state: dict
    validation: datasets.Dataset
    test: datasets.Dataset
    pass_rates: torch.Tensor
    warm_start_steps: int


def held_out_start(spec: MicroSpec, num_steps: int, num_held_out: int, *,
                   modulus: int = 10) -> Start:  # fmt: skip
    """`warm_start` to ``spec.warm_start_target``, and 2 x `num_held_out` distinct test-split
    prompts: the first half validates, the second half tests."""
    model, tokenizer, report = warm_start(spec, num_steps, modulus=modulus)
    held_out = problems("test", num_steps, 2 * num_held_out, modulus=modulus, seed=spec.seed,
                        distinct=True)  # fmt: skip
    if len(held_out) < 2 * num_held_out:
        raise ValueError(
            f"the test split of {num_steps}-digit prompts mod {modulus} holds {len(held_out)} "
            f"prompts, fewer than 2 x {num_held_out}: use more steps or fewer held-out prompts"
        )
    validation = held_out.select(range(num_held_out))
    test = held_out.select(range(num_held_out, 2 * num_held_out))
    rates = exact_pass_rates(model, tokenizer, test, modulus=modulus)
    state = copy.deepcopy(model.state_dict())
    return Start(spec, num_steps, modulus, state, validation, test, rates, report["steps"])


def arm_runner(start: Start, grpo: dict, arms: dict, measure: str, **options):
    """run(arm, learning_rate, seed) for `lm.compare`: one `grpo_run` of the arm (`arms`: name ->
    GRPOConfig overrides over `grpo`) from the start's weights, measured exactly on its
    `measure` prompts ("validation" or "test"); `options`: `grpo_run`'s. Returns {"start",
    "final", "gain"} in mean J and {"degenerate_start", "degenerate_final",
    "degenerate_change"}."""
    data = {"validation": start.validation, "test": start.test}[measure]
    tokenizer = build_tokenizer()

    def run(arm: str, learning_rate: float, seed: int) -> dict:
        model = build_model(start.spec, tokenizer)
        model.load_state_dict(start.state)
        config = GRPOConfig(**{**grpo, **arms[arm], "learning_rate": learning_rate, "seed": seed})
        curve = grpo_run(model, tokenizer, config, start.num_steps, data, modulus=start.modulus,
                         **options)  # fmt: skip
        (first, last), (d_first, d_last) = curve["pass_rate"], curve["degenerate"]
        return {"start": first, "final": last, "gain": last - first, "degenerate_start": d_first,
                "degenerate_final": d_last, "degenerate_change": d_last - d_first}  # fmt: skip

    return run
