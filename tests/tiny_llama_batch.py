"""The small random Llamas of the tests, and the padded rollout batch that `test_gradients.py`
and `test_rank.py` share: per-example gradients are checked on exactly this model and batch in
both. `test_sampler.py` samples from the same shape in float32, the sparsity tests take a
one-layer float64 one (`one_layer_llama`)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, PROMPT, COMPLETION, ROLLOUTS = 40, 5, 6, 5


def tiny_llama_config(**settings) -> LlamaConfig:
    """2 layers, hidden 32, 4 query heads on 2 key-value heads, VOCAB tokens, padding id 0;
    `settings` add to these or replace them."""
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    return LlamaConfig(**{**shape, **settings})


def tiny_llama(tie: bool, seed: int = 0) -> LlamaForCausalLM:
    """`tiny_llama_config` in float64; the untied one has biases in attention and MLP."""
    torch.manual_seed(seed)
    config = tiny_llama_config(
        tie_word_embeddings=tie,
        attention_bias=not tie,
        mlp_bias=not tie,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config).double().eval()


def one_layer_llama(seed: int = 0, vocab_size: int = 20) -> LlamaForCausalLM:
    """1 layer, hidden 16, 2 heads, padding id 0, in float64."""
    torch.manual_seed(seed)
    config = tiny_llama_config(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    return LlamaForCausalLM(config).double().eval()


def padded_batch():
    """A group with left padding (rollout 0's prompt is 2 tokens shorter), a completion that
    ended early (rollout 1: its last 2 tokens are padding, masked out) and a real token equal
    to the padding id (rollout 3, as SmolLM2's EOS is also its pad token): nn.Embedding gives
    the padding row no gradient even there."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, VOCAB, (ROLLOUTS, PROMPT + COMPLETION), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    completion_mask = torch.ones(ROLLOUTS, COMPLETION, dtype=torch.float64)
    input_ids[0, :2], attention_mask[0, :2] = 0, 0
    input_ids[1, -2:], attention_mask[1, -2:], completion_mask[1, -2:] = 0, 0, 0
    input_ids[3, PROMPT + 2] = 0
    return input_ids, attention_mask, completion_mask
