r"""A lean sampler for the book's Llama models: `generate`'s own tokens for less work a step
(chapter 4; benchmarks/floor.py measures it against the arithmetic floor).

`lean_generate(model, input_ids, attention_mask, config)` is a drop-in for
`rollouts.generate_groups`: the same arguments, the same (B * G, T) tokens under the same seed.
Around each decoding step's small matrix products `generate` runs a general loop (logits
processors, stopping criteria, mask building, a KV cache grown by concatenation), and it keeps
every finished row in the batch to the end. Here a step is one forward pass written out for a
Llama (`decode_step`: transformers' own norm, rotary, MLP and projection modules, keys and
values written into a preallocated buffer, `scaled_dot_product_attention` over its filled
columns with the padding mask, as transformers' sdpa path does) over the rows still running: a
row leaves the batch at its EOS, a row from the bottom taking its place in the buffers.

The tokens are `generate`'s, bit for bit, on CPU (tests/lm/test_sampler.py): the prompt goes
through transformers' forward as `generate_groups` sends it (`lean_generate`); a row's logits
do not depend on the other rows of the batch (`_ROW_BLOCK`); and the same warpers and
multinomial draw as `generate` pick the tokens (`next_tokens`). The configuration is one
`rollouts.sampling_config` builds: no processor but these three (temperature, top-k, top-p) on.

Chapter: :doc:`/book/04_testbed`
"""

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache, GenerationConfig
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

# The other processors `generate` would apply, and their "off" values (min_p = 0 removes nothing).
_OFF = {
    "repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "min_new_tokens": (None, 0),
    "min_p": (None, 0.0),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "top_h": (None,),
    "num_beams": (None, 1),
    "bad_words_ids": (None,),
    "suppress_tokens": (None,),
}
# A step runs a multiple of this many rows (or all of them): products over one to three rows
# round differently from those over blocks of four on this CPU (other kernels; on two threads
# the rows are split between them in blocks of four), and `generate` runs every row. Finished
# rows ride along as passengers to make up the count (`_rows_to_keep`).
_ROW_BLOCK = 4


@torch.no_grad()
def lean_generate(
    model, input_ids: Tensor, attention_mask: Tensor, config: GenerationConfig
) -> Tensor:
    """(n * K, T) continuations of the left-padded rows of `input_ids: (n, P)`, K =
    ``config.num_return_sequences``: `generate_groups`' tokens, padding after each row's EOS,
    T the steps until every row stopped or ``config.max_new_tokens``.

    The prompt goes through transformers' forward as `generate_groups` sends it: all but its
    last token once per prompt when K > 1, the whole prompt on every row when K = 1."""
    _check_supported(model, config)
    repeats, new = config.num_return_sequences or 1, config.max_new_tokens
    num_rows, width = input_ids.shape[0] * repeats, input_ids.shape[1]
    device = input_ids.device
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    rows = torch.arange(num_rows, device=device)  # the batch's rows, by number
    shared = repeats > 1 and width > 1  # as generate_groups: the prompt once for its group
    if shared:
        prompts = (slice(None), slice(None, -1))
        keys, values, _ = _prefill(model, input_ids[prompts], attention_mask[prompts],
                                   positions[prompts], repeats, width + new)  # fmt: skip
    else:
        of_row = rows // repeats
        keys, values, logits = _prefill(model, input_ids[of_row], attention_mask[of_row],
                                        positions[of_row], 1, width + new)  # fmt: skip
    mask = F.pad(attention_mask.bool(), (0, new), value=True)
    mask = mask.repeat_interleave(repeats, dim=0)[:, None, None]  # (rows, 1, 1, P + T)
    positions = positions[:, -1].repeat_interleave(repeats)
    if shared:
        last = input_ids[:, -1].repeat_interleave(repeats)
        logits = decode_step(model, last, positions, keys, values, mask, width - 1)
    warpers = _warpers(config)
    eos = torch.tensor(_as_list(config.eos_token_id), dtype=torch.long, device=device)
    tokens = torch.full((num_rows, new), config.pad_token_id, device=device)
    running = torch.ones(num_rows, dtype=torch.bool, device=device)
    for step in range(new):
        chosen = next_tokens(logits, warpers, config.do_sample, rows, num_rows)
        tokens[rows[running], step] = chosen[running]
        running &= ~torch.isin(chosen, eos)
        if step == new - 1 or not running.any():
            break
        keep = _rows_to_keep(running)
        if not keep.all():
            order = _compact(keep, keys, values, mask, columns=width + step)
            rows, running, chosen = rows[order], running[order], chosen[order]
            positions = positions[order]
        positions = positions + 1
        logits = decode_step(model, chosen, positions, keys, values, mask, width + step)
    return tokens[:, : step + 1]


def decode_step(
    model, tokens: Tensor, positions: Tensor, keys: list, values: list, mask: Tensor, column: int
) -> Tensor:
    """(n, V) float32 logits after one token per row, `tokens, positions: (n,)`: a Llama's
    forward pass at one position, its keys and values written into `column` of the buffers
    (per layer (rows, kv heads, P + T, head dim)), attending to columns 0..column."""
    llama = model.model
    hidden = llama.embed_tokens(tokens)[:, None]  # (n, 1, hidden), transformers' shapes
    cos, sin = llama.rotary_emb(hidden, positions[:, None])
    for layer, layer_keys, layer_values in zip(llama.layers, keys, values):
        normed = layer.input_layernorm(hidden)
        hidden = hidden + _attention(
            layer.self_attn, normed, cos, sin, layer_keys, layer_values, mask, column
        )
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(llama.norm(hidden))[:, 0].float()


def _attention(attn, x, cos, sin, keys: Tensor, values: Tensor, mask: Tensor, column: int):
    """transformers' LlamaAttention on its sdpa path for one query position; the cache is a
    buffer whose `column` receives this position's key and value."""
    n, head_dim = x.shape[0], attn.head_dim
    q, k, v = (
        proj(x).view(n, 1, -1, head_dim).transpose(1, 2)
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
    )
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    keys[:n, :, column], values[:n, :, column] = k[:, :, 0], v[:, :, 0]
    if attn.num_key_value_groups > 1:  # one query: its heads side by side per key-value head
        q = q.reshape(n, -1, attn.num_key_value_groups, head_dim)
    filled = slice(None, column + 1)
    out = F.scaled_dot_product_attention(
        q,
        keys[:n, :, filled],
        values[:n, :, filled],
        attn_mask=mask[:n, :, :, filled],
        scale=attn.scaling,
    )
    return attn.o_proj(out.reshape(n, -1, 1, head_dim).transpose(1, 2).reshape(n, 1, -1))


def next_tokens(logits: Tensor, warpers: list, do_sample: bool, rows: Tensor, num_rows: int):
    """(n,) next tokens of the batch's rows: the argmax, or one multinomial draw from the warped
    softmax placed in a (num_rows, V) matrix at `rows`, ones elsewhere.

    The warpers are `generate`'s (temperature, top-k, top-p, in its order), then softmax and one
    `torch.multinomial` call a step on the (all rows x vocabulary) matrix, whose finished rows
    hold a placeholder. On CPU multinomial draws one Exp(1) per entry and takes each row's argmax
    of p / Exp: the random numbers it consumes and each row's token depend on the matrix's shape
    and that row alone, as in `generate`, which draws for every row every step."""
    scores = logits
    for warper in warpers:
        scores = warper(None, scores)
    if not do_sample:
        return scores.argmax(dim=-1)
    probs = scores.new_ones(num_rows, scores.shape[-1])
    probs[rows] = scores.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1)[rows, 0]


def _prefill(model, input_ids, attention_mask, positions, repeats: int, columns: int):
    """Keys and values of the prompts (transformers' forward), each row's `repeats` times in
    preallocated buffers (rows, kv heads, `columns`, head dim), one pair of lists of a buffer per
    layer; and the (rows, V) float32 logits after each prompt."""
    cache = DynamicCache(config=model.config)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits
    buffers = ([], [])
    for layer in cache.layers:
        for buffer, filled in zip(buffers, (layer.keys, layer.values)):
            rows, heads, width, head_dim = filled.shape
            buffer.append(filled.new_empty(rows * repeats, heads, columns, head_dim))
            buffer[-1][:, :, :width] = filled.repeat_interleave(repeats, dim=0)
    return *buffers, logits[:, -1].float()


def _rows_to_keep(running: Tensor) -> Tensor:
    """The running rows, and finished ones as passengers up to a multiple of `_ROW_BLOCK` (or
    every row of the batch)."""
    keep = running.clone()
    blocks = max(1, -(-int(running.sum()) // _ROW_BLOCK))
    missing = min(blocks * _ROW_BLOCK, len(keep)) - int(running.sum())
    keep[(~running).nonzero()[:missing, 0]] = True
    return keep


def _compact(keep: Tensor, keys: list, values: list, mask: Tensor, columns: int) -> Tensor:
    """Shrink the batch to its `keep` rows: kept rows from the bottom move into the places that
    dropped rows leave above (the buffers' first `columns` columns), as many copies as rows
    dropped. Returns the old place of the row at each new place."""
    size = int(keep.sum())
    holes = (~keep[:size]).nonzero()[:, 0]
    movers = keep[size:].nonzero()[:, 0] + size
    for buffer in (*keys, *values):
        buffer[holes, :, :columns] = buffer[movers, :, :columns]
    mask[holes] = mask[movers]
    order = torch.arange(size, device=keep.device)
    order[holes] = movers
    return order


def _warpers(config: GenerationConfig) -> list:
    """`generate`'s sampling warpers for `config`, in its order; none when greedy."""
    if not config.do_sample:
        return []
    warpers = []
    if config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=config.top_k))
    if config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=config.top_p))
    return warpers


def supports(model, config: GenerationConfig) -> bool:
    """Whether `lean_generate` samples `generate`'s tokens for this model and config: a Llama
    with sdpa attention on the CPU, where the tests hold it bit for bit."""
    try:
        _check_supported(model, config)
    except ValueError:
        return False
    return next(model.parameters()).device.type == "cpu"


def _check_supported(model, config: GenerationConfig) -> None:
    """Refuse what this sampler would not do as `generate` does."""
    if type(model).__name__ != "LlamaForCausalLM":
        raise ValueError(f"the lean sampler runs Llama models only, not {type(model).__name__}")
    if model.config._attn_implementation != "sdpa":
        raise ValueError("the lean sampler mirrors transformers' sdpa attention: load with it")
    if model.config.rope_parameters.get("rope_type", "default") == "dynamic":
        raise ValueError("the lean sampler does not rescale a dynamic RoPE")
    active = [name for name, off in _OFF.items() if getattr(config, name, None) not in off]
    if active:
        raise ValueError(f"the lean sampler does not apply {active}: use sampler='generate'")
    if config.max_new_tokens is None or config.max_new_tokens < 1:
        raise ValueError("the lean sampler needs max_new_tokens >= 1")
    if config.do_sample and None in (config.temperature, config.top_k, config.top_p):
        raise ValueError("set temperature, top_k and top_p explicitly (as sampling_config does)")


def _as_list(token_ids) -> list[int]:
    """EOS ids as a list: None, one id or several."""
    if token_ids is None:
        return []
    return [token_ids] if isinstance(token_ids, int) else list(token_ids)
