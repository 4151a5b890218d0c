r"""Rollouts: G completions per prompt, and everything GRPO learns from them.

For each of B prompts we sample G = ``num_generations`` completions of at most
``max_completion_length`` tokens at ``temperature`` (TRL's names) and record, per rollout,

    completion_ids   (B * G, T)  sampled tokens, padding after the first EOS
    completion_mask  (B * G, T)  1 on the completion's tokens, its EOS included
    log_probs        (B * G, T)  log pi(o_t | q, o_<t) under softmax(logits / temperature)
    lengths, truncated           (B * G,)
    texts                        B * G decoded completions
    rewards          (B, G)      reward_fn(text, gold), one group per row

T <= max_completion_length is the longest completion of the batch; rollout i answers prompt
i // G. Tokens come from transformers' ``generate`` with the KV cache, prompts left-padded, and
every logits processor that would reshape the distribution switched off (a checkpoint's
``generation_config.json`` or the default ``top_k=50`` would otherwise sample from something
other than softmax(logits / temperature)); `sampler.lean_generate` samples the same tokens, bit
for bit, for a Llama, and a built vLLM engine can sample instead on a GPU. The log-probs come
from a teacher-forced pass, `scoring.sequence_log_probs`, the function the trainer
differentiates, not from ``generate``'s scores, whose KV-cache path rounds differently;
``compute_log_probs=False`` skips that pass where pi_old's log-probs are not needed. With
``top_p < 1`` the sampler renormalises over the nucleus while, like TRL and vLLM, the log-probs
stay those of the untruncated tempered softmax.

Chapter: :doc:`/book/04_testbed` (section 2)
"""

import copy
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache, GenerationConfig

from grpo_companion.lm import gsm8k
from grpo_companion.lm.sampler import lean_generate, supports
from grpo_companion.lm.scoring import sequence_log_probs

# Logits processors of `generate`, each set to its "off" value. Unset (None) fields would
# be filled from the model's generation_config, so every one is set explicitly. The first
# set changes greedy decoding too; the second only reshapes the sampling distribution.
_NEUTRAL_PROCESSING = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": 0}
_NEUTRAL_SAMPLING = {
    "top_k": 0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
}


@dataclass
class Rollouts:
    """A batch of B * G rollouts; see the module docstring for the fields' meaning.

    prompt_ids, prompt_mask: (B, P) left-padded prompts.
    completion_ids, completion_mask: (B * G, T).
    log_probs: (B * G, T), or None if `generate_rollouts` was told not to compute them.
    lengths: (B * G,) int, number of completion tokens, EOS included.
    truncated: (B * G,) bool, no EOS within max_completion_length.
    texts: B * G strings, decoded without special tokens.
    rewards: (B, G) float32.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    log_probs: Tensor | None
    lengths: Tensor
    truncated: Tensor
    texts: list[str]
    rewards: Tensor
    num_generations: int
    temperature: float

    @property
    def num_prompts(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def prompt_index(self) -> Tensor:
        """(B * G,) the prompt each rollout answers: 0, 0, ..., 1, 1, ..."""
        return torch.arange(self.num_prompts, device=self.prompt_ids.device).repeat_interleave(
            self.num_generations
        )

    @property
    def input_ids(self) -> Tensor:
        """(B * G, P + T) prompt then completion, the input of `sequence_log_probs`."""
        return torch.cat([self.prompt_ids[self.prompt_index], self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """(B * G, P + T) 1 on real prompt and completion tokens."""
        return torch.cat([self.prompt_mask[self.prompt_index], self.completion_mask], dim=1)


@torch.no_grad()
def generate_rollouts(
    model,
    tokenizer,
    prompts: list[str],
    golds: list[str],
    *,
    num_generations: int,
    max_completion_length: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int,
    batch_size: int = 64,
    reward_fn: Callable[[str, str], float] = gsm8k.reward,
    vllm_engine=None,
    compute_log_probs: bool = True,
    sampler: str = "auto",
) -> Rollouts:
    """Sample ``num_generations`` completions per prompt and score them.

    Args:
        prompts: B formatted prompts (see ``gsm8k.format_prompt``), special tokens
            included as text: they are tokenized without adding any.
        golds: B gold answers, passed to ``reward_fn(completion_text, gold)``.
        seed: seeds the sampler; the same seed and arguments give the same rollouts on
            CPU. The global torch RNG is left as it was.
        batch_size: completions per ``generate`` call (whole groups: at least one prompt).
        vllm_engine: a ``vllm.LLM`` holding the current policy weights (keeping them in
            sync is the caller's job); if given, it samples the tokens instead of
            ``generate``. Log-probs are recomputed with ``model`` either way.
        compute_log_probs: False skips the teacher-forced log-prob pass; ``log_probs`` is
            then None.
        sampler: "generate" (`generate_groups`), "lean" (`sampler.lean_generate`, a decoding
            loop for Llama models that drops finished rows: about a third less time on this
            CPU, benchmarks/floor.py) or "auto" (lean where `sampler.supports` the model): the
            same tokens under the same seed.

    Returns:
        Rollouts with B * num_generations rows.
    """
    if not prompts or len(prompts) != len(golds):
        raise ValueError(
            f"need as many golds as prompts, at least one: got {len(prompts)} and {len(golds)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    prompt_ids, prompt_mask = _tokenize_prompts(tokenizer, prompts, model.device)
    if vllm_engine is None:
        config = sampling_config(
            model,
            tokenizer,
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            num_return_sequences=num_generations,
            max_new_tokens=max_completion_length,
        )
        with seeded(seed, model.device):
            completion_ids = _generate(
                model,
                prompt_ids,
                prompt_mask,
                config,
                max(1, batch_size // num_generations),
                sampler,
            )
    else:
        completion_ids = _sample_with_vllm(
            vllm_engine,
            prompt_ids,
            prompt_mask,
            tokenizer.pad_token_id,
            n=num_generations,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_completion_length,
            seed=seed,
        ).to(model.device)
    completion_ids, completion_mask, lengths, truncated = cut_at_eos(
        completion_ids, stop_token_ids(model, tokenizer), tokenizer.pad_token_id
    )
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    rewards = [reward_fn(text, golds[i // num_generations]) for i, text in enumerate(texts)]
    rollouts = Rollouts(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        log_probs=None,
        lengths=lengths,
        truncated=truncated,
        texts=texts,
        rewards=torch.tensor(rewards, device=model.device).view(-1, num_generations),
        num_generations=num_generations,
        temperature=temperature,
    )
    if compute_log_probs:
        input_ids, attention_mask = rollouts.input_ids, rollouts.attention_mask
        rollouts.log_probs = torch.zeros(completion_ids.shape, device=model.device)
        group_rows = max(1, batch_size // num_generations) * num_generations
        for rows in torch.arange(len(texts), device=model.device).split(group_rows):
            rollouts.log_probs[rows] = sequence_log_probs(
                model,
                input_ids[rows],
                attention_mask[rows],
                completion_mask[rows],
                temperature,
                num_generations=num_generations,
            )
    return rollouts


@torch.no_grad()
def greedy_completions(
    model,
    tokenizer,
    prompts: list[str],
    golds: list[str],
    *,
    max_completion_length: int,
    batch_size: int = 64,
    reward_fn: Callable[[str, str], float] = gsm8k.reward,
    sampler: str = "auto",
) -> tuple[list[float], list[str]]:
    """The greedy (argmax) completion of each prompt and its reward: (rewards, texts), n each;
    `sampler` as in `generate_rollouts`."""
    prompt_ids, prompt_mask = _tokenize_prompts(tokenizer, prompts, model.device)
    config = sampling_config(
        model,
        tokenizer,
        do_sample=False,
        num_return_sequences=1,
        max_new_tokens=max_completion_length,
    )
    completion_ids = _generate(model, prompt_ids, prompt_mask, config, batch_size, sampler)
    completion_ids, *_ = cut_at_eos(
        completion_ids, stop_token_ids(model, tokenizer), tokenizer.pad_token_id
    )
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return [reward_fn(text, gold) for text, gold in zip(texts, golds)], texts


def greedy_accuracy(model, tokenizer, prompts: list[str], golds: list[str], **settings) -> float:
    """Mean reward of the greedy completion of each prompt (`greedy_completions`' settings):
    held-out accuracy."""
    rewards, _ = greedy_completions(model, tokenizer, prompts, golds, **settings)
    return sum(rewards) / len(prompts)


def _tokenize_prompts(tokenizer, prompts: list[str], device) -> tuple[Tensor, Tensor]:
    """(B, P) ids and mask, left-padded so that generation starts at the same column."""
    batch = tokenizer(
        prompts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt"
    )
    return batch["input_ids"].to(device), batch["attention_mask"].to(device)


def sampling_config(model, tokenizer, *, do_sample: bool, **settings) -> GenerationConfig:
    """`generate`'s settings with every logits processor off unless asked for: samples come
    from the policy's own distribution (at `temperature`), the one its log-probs describe."""
    return GenerationConfig(
        do_sample=do_sample,
        **settings,
        **_NEUTRAL_PROCESSING,
        **(_NEUTRAL_SAMPLING if do_sample else {}),
        eos_token_id=stop_token_ids(model, tokenizer),
        pad_token_id=tokenizer.pad_token_id,
    )


def _generate(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    config: GenerationConfig,
    prompts_per_call: int,
    sampler: str = "auto",
) -> Tensor:
    """(B * num_return_sequences, T) completion tokens, the sampler called on chunks of prompts
    (`generate_groups` or `sampler.lean_generate`, which take the same random numbers)."""
    samplers = {"generate": generate_groups, "lean": lean_generate}
    if sampler == "auto":
        sampler = "lean" if supports(model, config) else "generate"
    if sampler not in samplers:
        raise ValueError(f"sampler must be auto or one of {sorted(samplers)}, got {sampler!r}")
    chunks = [
        samplers[sampler](model, ids, mask, config)
        for ids, mask in zip(
            prompt_ids.split(prompts_per_call), prompt_mask.split(prompts_per_call)
        )
    ]
    # Each call stops when its own rows are done: pad all to the widest.
    width = max(chunk.shape[1] for chunk in chunks)
    return torch.cat(
        [F.pad(chunk, (0, width - chunk.shape[1]), value=config.pad_token_id) for chunk in chunks]
    )


def generate_groups(model, input_ids: Tensor, attention_mask: Tensor, config: GenerationConfig):
    """`generate`'s K = ``config.num_return_sequences`` continuations of each left-padded row of
    `input_ids: (n, width)`, (n * K, new), each row's keys and values computed once.

    `generate` repeats every row K times before its first forward pass, so a prompt (or, in
    chapter 5, a prefix) shared by a group goes through the model K times. Here the rows but
    their last token go through it once, into a cache that is repeated K times; `generate`
    starts from it with the last token. Same positions (from the attention mask, as `generate`
    makes them), same masks, same sampler and seed: the same tokens (tests/lm/test_rollouts.py
    compares them with `generate`'s own), at a fifth to a half less time on this machine (the
    tiny Llama at G = 4 to 8, SmolLM2-135M at 16; benchmarks/rollout_throughput.py).
    """
    width = input_ids.shape[1]
    repeats = config.num_return_sequences or 1
    if repeats == 1 or width < 2:
        return model.generate(input_ids=input_ids, attention_mask=attention_mask,
                              generation_config=config)[:, width:]  # fmt: skip
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
              position_ids=positions[:, :-1], cache=cache, use_cache=True)  # fmt: skip
    cache.batch_repeat_interleave(repeats)
    single = copy.deepcopy(config)
    single.num_return_sequences = 1
    return model.generate(
        input_ids=input_ids.repeat_interleave(repeats, dim=0),
        attention_mask=attention_mask.repeat_interleave(repeats, dim=0),
        cache=cache,
        generation_config=single,
    )[:, width:]


def cut_at_eos(completion_ids: Tensor, eos_token_ids: list[int], pad_token_id: int):
    """Mask each completion after its first EOS, which it keeps (the policy chose to stop).

    Returns completion_ids with padding after the EOS, completion_mask, lengths and
    truncated, trimmed to the longest completion.
    """
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    truncated = ~is_eos.any(dim=1)
    width = completion_ids.shape[1]
    # argmax finds the first True; rows without an EOS use every column.
    lengths = torch.where(truncated, width, is_eos.int().argmax(dim=1) + 1)
    completion_mask = torch.arange(width, device=completion_ids.device) < lengths.unsqueeze(1)
    completion_ids = completion_ids.masked_fill(~completion_mask, pad_token_id)
    longest = int(lengths.max())
    return completion_ids[:, :longest], completion_mask[:, :longest].long(), lengths, truncated


def stop_token_ids(model, tokenizer) -> list[int]:
    """Every token that ends a completion: chat models often have several (end of turn, text)."""
    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    return [eos] if isinstance(eos, int) else list(eos)


@contextmanager
def seeded(seed: int, device: torch.device):
    """Seed torch's RNG for a block, then restore it: `generate` samples from the global
    RNG, and a library call should not change the caller's random stream."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def _sample_with_vllm(
    engine, prompt_ids: Tensor, prompt_mask: Tensor, pad_token_id: int, **sampling
) -> Tensor:
    """(B * n, T) completion tokens sampled by a vLLM engine (GPU only, optional).

    vLLM keeps the EOS that stopped a completion in its token ids, as `generate` does.
    """
    try:
        from vllm import SamplingParams
    except ImportError as error:
        raise ImportError(
            "vllm_engine needs the optional `vllm` package (CUDA only): pip install vllm"
        ) from error
    requests = [
        {"prompt_token_ids": ids[mask.bool()].tolist()}
        for ids, mask in zip(prompt_ids, prompt_mask)
    ]
    outputs = engine.generate(requests, SamplingParams(**sampling), use_tqdm=False)
    completions = [
        torch.tensor(completion.token_ids) for output in outputs for completion in output.outputs
    ]
    return torch.nn.utils.rnn.pad_sequence(
        completions, batch_first=True, padding_value=pad_token_id
    )
