r"""Teacher-forced scoring: the log-probs of given completions under the policy, the function
the trainer differentiates (chapter 4).

`sequence_log_probs` runs prompt and completion through the model in one forward pass and reads
log pi(o_t | q, o_<t) under softmax(logits / temperature). With ``num_generations`` each
group's prompt runs once and its G completions continue from a repeated KV cache
(`completion_logits`), the same log-probs to float32 rounding. Sampling is `rollouts`.
"""

import torch
from torch import Tensor
from transformers import DynamicCache


def sequence_log_probs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_mask: Tensor,
    temperature: float = 1.0,
    *,
    num_generations: int = 1,
    causal_mask: Tensor | None = None,
    params: dict[str, Tensor] | None = None,
    inputs_embeds: Tensor | None = None,
    bucket_size: int | None = None,
) -> Tensor:
    """Teacher-forced log-probs of the last T tokens of each row.

    Args:
        input_ids, attention_mask: (N, P + T), left-padded prompt then completion.
        completion_mask: (N, T), 1 on the completion tokens whose log-prob is wanted.
        temperature: the logits are divided by it, as when sampling.
        num_generations, causal_mask, params, inputs_embeds, bucket_size: see
            `completion_logits`.

    Returns:
        log_probs: (N, T), log softmax(logits / temperature) at the given tokens, 0 where
            ``completion_mask`` is 0; float32, or float64 for a float64 model. Differentiable
            when grad is enabled; ``.sum(dim=1)`` is log pi(y | x) of each row.
            Memory peaks at N * (T + 1) * vocab float32 logits (N * T with num_generations):
            micro-batch large vocabularies.
    """
    logits = completion_logits(
        model,
        input_ids,
        attention_mask,
        completion_mask.shape[1],
        num_generations=num_generations,
        causal_mask=causal_mask,
        params=params,
        inputs_embeds=inputs_embeds,
        bucket_size=bucket_size,
    )
    return token_log_probs(logits, input_ids, completion_mask, temperature)


def token_log_probs(
    logits: Tensor, input_ids: Tensor, completion_mask: Tensor, temperature: float = 1.0
) -> Tensor:
    """(N, T) log softmax(logits / temperature) at the last T tokens of `input_ids`, 0 off
    `completion_mask`; logits: (N, T, V) from `completion_logits`."""
    if temperature != 1:  # else skip a copy of the largest activation
        logits = logits / temperature
    targets = input_ids[:, -completion_mask.shape[1] :]
    log_probs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    return torch.where(completion_mask.bool(), log_probs, 0.0)


def completion_logits(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_length: int,
    *,
    num_generations: int = 1,
    causal_mask: Tensor | None = None,
    params: dict[str, Tensor] | None = None,
    inputs_embeds: Tensor | None = None,
    bucket_size: int | None = None,
) -> Tensor:
    """(N, T, V) logits that predict the last T = `completion_length` tokens of each row.

    Args:
        input_ids, attention_mask: (N, P + T), left-padded prompt then completion.
        num_generations: G > 1 says the rows come in groups of G consecutive rows with the same
            prompt (the first P columns, ids and mask), as rollouts do: each prompt then goes
            through the model once, into a KV cache repeated for its G completions, and the
            gradient reaches it summed over them. The same numbers as G = 1 up to rounding
            (float32: about 1e-6 relative; tests/lm/test_rollouts.py), at B * (P - 1) + N * T token
            positions instead of N * (P + T): a third less work for the trainer's update on
            chapter 6's batches, half on chapter 11's (G = 8). A one-token prompt takes the
            plain pass. Not with the arguments below.
        bucket_size: with num_generations > 1, the completions run sorted by length,
            `bucket_size` rows at a time, each bucket padded to its own longest completion
            rather than all to the batch's (`length_buckets`): the positions the batch needs
            plus a little, where padding to the longest ran 1.3-1.4x as many on chapter 11's
            batches; the same numbers up to rounding (tests/lm/test_scoring.py). A row's logits
            past its last completion token (attention mask 0) are then 0. None: one pass, every
            row padded to T.
        causal_mask: (N, 1, P + T, P + T) additive mask given to the model instead of
            ``attention_mask`` (which still sets the positions), e.g.
            ``gradients.causal_attention_mask``: what `torch.func.vmap` and float64 models need.
        params: replace the model's own parameters (`torch.func.functional_call`).
        inputs_embeds: (N, P + T, hidden) replace the embedding lookup of ``input_ids`` (to
            differentiate with respect to them).

    Returns:
        logits: (N, T, V), at least float32 (a bfloat16 model's logits are upcast; float64
        stays float64); position t predicts completion token t. Differentiable when grad is
        enabled.
    """
    # The positions `generate` gives left-padded rows: real tokens counted from 0. (RoPE sees
    # only relative positions, so this matters to rounding alone for Llama; not in general.)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if num_generations > 1 and input_ids.shape[1] - completion_length < 2:
        num_generations = 1  # a one-token prompt: nothing to share before its last token
    if num_generations > 1:
        if causal_mask is not None or params is not None or inputs_embeds is not None:
            raise ValueError("num_generations > 1 takes no causal_mask, params or inputs_embeds")
        logits = _shared_prompt_logits(model, input_ids, attention_mask, position_ids,
                                       completion_length, num_generations, bucket_size)  # fmt: skip
    else:
        inputs = {
            "input_ids": input_ids if inputs_embeds is None else None,
            "attention_mask": attention_mask if causal_mask is None else causal_mask,
            "position_ids": position_ids,
            "logits_to_keep": completion_length + 1,  # the lm head only runs where needed
        }
        if inputs_embeds is not None:
            inputs["inputs_embeds"] = inputs_embeds
        if params:
            logits = torch.func.functional_call(model, params, (), inputs).logits
        else:
            logits = model(**inputs).logits
        # Logits at position t predict token t + 1; the last position predicts nothing here.
        logits = logits[:, :-1]
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _shared_prompt_logits(
    model, input_ids, attention_mask, position_ids, completion_length: int, group_size: int,
    bucket_size: int | None = None,
) -> Tensor:  # fmt: skip
    """`completion_logits` with each group's prompt run once (its ``num_generations``)."""
    num_rows, width = input_ids.shape
    prompt_length = width - completion_length
    if num_rows % group_size:
        raise ValueError(f"num_generations = {group_size} needs whole groups: got {num_rows} rows")
    groups = num_rows // group_size
    prompt = (slice(None, None, group_size), slice(None, prompt_length))
    for tensor in (input_ids, attention_mask):
        shape = (groups, group_size, prompt_length)
        if not (tensor[:, :prompt_length].view(shape) == tensor[prompt].unsqueeze(1)).all():
            raise ValueError(f"the rows of each group of {group_size} must share their prompt")
    # The prompts but their last token once, into a cache repeated for the G rows of each group
    # (differentiable: the gradient reaching a prompt is summed over its G completions). The
    # last prompt token, which predicts the first completion token, goes with the completions:
    # the lm head then runs once, on (N, T) positions, as in the plain pass. (An lm-head call of
    # its own on B rows rounded differently in a frozen copy of SmolLM2-135M, the KL reference,
    # which gave the KL term a gradient at pi = pi_ref.)
    cache = DynamicCache(config=model.config)
    before_last = (slice(None, None, group_size), slice(None, prompt_length - 1))
    model(input_ids=input_ids[before_last], attention_mask=attention_mask[before_last],
          position_ids=position_ids[before_last], cache=cache, use_cache=True,
          logits_to_keep=1)  # fmt: skip
    if cache.get_seq_length() != prompt_length - 1:
        # e.g. gradient checkpointing in train mode: transformers then drops the cache, and
        # the completions would run without their prompt.
        raise RuntimeError(
            "the model did not fill the KV cache (gradient checkpointing in train mode?): "
            "use num_generations=1"
        )
    if bucket_size is None:
        cache.batch_repeat_interleave(group_size)
        return model(input_ids=input_ids[:, prompt_length - 1 : -1],
                     attention_mask=attention_mask[:, :-1],
                     position_ids=position_ids[:, prompt_length - 1 : -1], cache=cache,
                     use_cache=True).logits  # fmt: skip
    logits = None
    for rows, length in length_buckets(attention_mask[:, prompt_length:], bucket_size):
        columns = slice(prompt_length - 1, prompt_length - 1 + length)
        bucket_cache = DynamicCache(config=model.config)
        for index, layer in enumerate(cache.layers):
            bucket_cache.update(layer.keys[rows // group_size],
                                layer.values[rows // group_size], index)  # fmt: skip
        bucket = model(input_ids=input_ids[rows, columns],
                       attention_mask=attention_mask[rows, : columns.stop],
                       position_ids=position_ids[rows, columns], cache=bucket_cache,
                       use_cache=True).logits  # fmt: skip
        if logits is None:
            logits = bucket.new_zeros(num_rows, completion_length, bucket.shape[-1])
        logits = logits.index_put((rows[:, None], torch.arange(length)), bucket)
    return logits


def length_buckets(completion_mask: Tensor, size: int) -> list[tuple[Tensor, int]]:
    """[(rows, T_b)]: the rows of `completion_mask: (N, T)` sorted by length (the last column
    with a 1, plus one), longest first, cut into runs of `size` rows, each to be run at its own
    longest length T_b >= 1."""
    filled = completion_mask.bool()
    columns = torch.arange(1, filled.shape[1] + 1, device=filled.device)
    lengths = (filled * columns).amax(dim=1).clamp(min=1)
    order = lengths.argsort(descending=True, stable=True)
    return [(rows, int(lengths[rows[0]])) for rows in order.split(size)]
