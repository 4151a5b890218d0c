"""The lean sampler samples `generate`'s own tokens, bit for bit, under the same seed, drops
finished rows from the batch, and refuses what it does not do as `generate` does."""

import pytest
import torch
from tiny_llama_batch import tiny_llama_config
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_companion.lm import sampler
from grpo_companion.lm.rollouts import (
    _generate,
    _tokenize_prompts,
    generate_groups,
    generate_rollouts,
    greedy_completions,
    sampling_config,
    seeded,
)
from grpo_companion.lm.sampler import lean_generate

MAX_NEW_TOKENS = 24
# The grouped-query model's stop tokens: 5 of its 40, so that rows stop at different steps and
# the last few run on with finished passengers.
STOP_TOKENS = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def prompts(random_tiny, arithmetic_prompts):
    """(ids, mask) of the 3 `arithmetic_prompts`, left-padded: of different lengths."""
    model, tokenizer = random_tiny
    ids, mask = _tokenize_prompts(tokenizer, arithmetic_prompts[0], model.device)
    assert (mask == 0).any() and mask[:, -1].all()
    return ids, mask


@pytest.fixture(scope="module")
def grouped_query_llama():
    """A random-init Llama with 4 query heads sharing 2 key-value heads, tied embeddings."""
    config = tiny_llama_config(
        tie_word_embeddings=True, eos_token_id=STOP_TOKENS, attn_implementation="sdpa"
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


def _both(model, ids, mask, config, seed):
    """(generate's tokens, the lean sampler's), each drawn from `seed`, each with the state the
    global RNG was left in."""
    with seeded(seed, model.device):
        expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        expected = expected[:, ids.shape[1] :], torch.get_rng_state()
    with seeded(seed, model.device):
        lean = lean_generate(model, ids, mask, config), torch.get_rng_state()
    return expected, lean


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
@pytest.mark.parametrize("num_generations", [4, 1])
def test_lean_tokens_are_generates_own(random_tiny, prompts, temperature, top_p, num_generations):
    """Left-padded prompts of different lengths, rows that stop at their EOS and rows that run
    to the end: the same tokens as `generate` and `generate_groups`, and the same random
    numbers consumed (the global RNG ends in the same state)."""
    model, tokenizer = random_tiny
    ids, mask = prompts
    config = sampling_config(model, tokenizer, do_sample=True, temperature=temperature,
                             top_p=top_p, num_return_sequences=num_generations,
                             max_new_tokens=MAX_NEW_TOKENS)  # fmt: skip
    eos = tokenizer.eos_token_id
    for seed in range(3):
        (expected, expected_rng), (lean, lean_rng) = _both(model, ids, mask, config, seed)
        assert torch.equal(lean, expected)
        assert torch.equal(lean_rng, expected_rng)
        with seeded(seed, model.device):
            assert torch.equal(lean, generate_groups(model, ids, mask, config))
    # The last seed's batch has both kinds of rows.
    stopped = (lean == eos).any(dim=1)
    assert stopped.any() and not stopped.all()


def test_grouped_query_heads_several_stop_tokens_and_passengers(grouped_query_llama, monkeypatch):
    """Grouped-query attention, five stop tokens, 3 prompts x G = 4: rows stop at many steps,
    the rows still running fall to 1, 2 or 3 and finished passengers make up a block of 4, and
    every token is still `generate`'s."""
    model = grouped_query_llama
    sizes = _record_batch_sizes(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(6, 40, (3, 7), generator=generator)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0
    ids[1, :1], mask[1, :1] = 0, 0
    config = sampling_config(model, _Tokenizer(), do_sample=True, temperature=1.0,
                             top_p=1.0, num_return_sequences=4, max_new_tokens=40)  # fmt: skip
    saw_passengers = False
    for seed in range(4):
        sizes.clear()
        (expected, expected_rng), (lean, lean_rng) = _both(model, ids, mask, config, seed)
        assert torch.equal(lean, expected)
        assert torch.equal(lean_rng, expected_rng)
        running = _running_after_each_step(lean, STOP_TOKENS)
        assert sizes == _expected_batch_sizes(running, 12)
        saw_passengers |= bool(((running > 0) & (running < 4)).any())
    assert saw_passengers


def test_greedy_is_generates_argmax(random_tiny, prompts):
    model, tokenizer = random_tiny
    ids, mask = prompts
    config = sampling_config(model, tokenizer, do_sample=False, num_return_sequences=1,
                             max_new_tokens=MAX_NEW_TOKENS)  # fmt: skip
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert torch.equal(lean_generate(model, ids, mask, config), expected[:, ids.shape[1] :])


def test_finished_rows_are_padded_and_leave_the_batch(random_tiny, prompts, monkeypatch):
    """After a row's EOS only padding; each decoding step runs the rows still running, made up
    to a multiple of 4 by finished ones: the row counts `decode_step` sees, read off the tokens."""
    model, tokenizer = random_tiny
    ids, mask = prompts
    sizes = _record_batch_sizes(monkeypatch)
    config = sampling_config(model, tokenizer, do_sample=True, temperature=1.0, top_p=1.0,
                             num_return_sequences=4, max_new_tokens=MAX_NEW_TOKENS)  # fmt: skip
    with seeded(0, model.device):
        tokens = lean_generate(model, ids, mask, config)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    for row in tokens.tolist():
        if eos in row:
            end = row.index(eos) + 1
            assert row[end:] == [pad] * (len(row) - end)
    running = _running_after_each_step(tokens, [eos])
    assert sizes == _expected_batch_sizes(running, 12)
    assert min(sizes) < 12  # rows did leave


def test_multinomial_draws_each_row_from_that_row_alone():
    """What the lean sampler relies on: under one seed, a row's multinomial draw does not change
    when the other rows of the matrix are replaced, and the stream advances by the same."""
    probs = torch.rand(6, 9, generator=torch.Generator().manual_seed(0)) ** 3
    other = probs.clone()
    other[[0, 2, 5]] = 1.0
    draws = []
    for matrix in (probs, other):
        with seeded(3, torch.device("cpu")):
            draws.append((torch.multinomial(matrix, 1)[:, 0], torch.rand(1)))
    (a, after_a), (b, after_b) = draws
    assert torch.equal(a[[1, 3, 4]], b[[1, 3, 4]])
    assert torch.equal(after_a, after_b)


def test_rollouts_are_the_same_with_either_sampler(random_tiny, arithmetic_prompts):
    """`generate_rollouts(sampler="lean")`: the same tokens, log-probs and rewards; greedy too."""
    model, tokenizer = random_tiny
    prompts, golds = arithmetic_prompts
    settings = {"num_generations": 4, "max_completion_length": MAX_NEW_TOKENS, "seed": 0,
                "temperature": 0.7, "top_p": 0.9, "batch_size": 8}  # fmt: skip
    plain = generate_rollouts(model, tokenizer, prompts, golds, **settings)
    lean = generate_rollouts(model, tokenizer, prompts, golds, sampler="lean", **settings)
    for name in ("completion_ids", "completion_mask", "log_probs", "lengths", "rewards"):
        assert torch.equal(getattr(lean, name), getattr(plain, name)), name
    assert lean.texts == plain.texts
    greedy = {"max_completion_length": MAX_NEW_TOKENS, "batch_size": 2}
    assert greedy_completions(model, tokenizer, prompts, golds, sampler="lean", **greedy) == (
        greedy_completions(model, tokenizer, prompts, golds, **greedy)
    )


def test_what_the_lean_sampler_does_not_do_is_refused(random_tiny, prompts):
    model, tokenizer = random_tiny
    ids, mask = prompts
    config = sampling_config(model, tokenizer, do_sample=True, temperature=1.0, top_p=1.0,
                             num_return_sequences=2, max_new_tokens=4)  # fmt: skip
    with pytest.raises(ValueError, match="sampler must be auto or one of"):
        _generate(model, ids, mask, config, 3, sampler="vllm")
    config.repetition_penalty = 1.3
    with pytest.raises(ValueError, match="repetition_penalty"):
        lean_generate(model, ids, mask, config)


def _record_batch_sizes(monkeypatch) -> list[int]:
    """A list that receives the number of rows of each `decode_step` call from now on."""
    sizes, step = [], sampler.decode_step

    def spy(model, tokens, *args):
        sizes.append(len(tokens))
        return step(model, tokens, *args)

    monkeypatch.setattr(sampler, "decode_step", spy)
    return sizes


def _expected_batch_sizes(running, num_rows: int) -> list[int]:
    """Rows of each `decode_step` call: all for each prompt's last token, then after each sampled
    token but the last, the rows still running rounded up to a multiple of 4."""
    return [num_rows] + [min(num_rows, max(4, -(-int(n) // 4) * 4)) for n in running[:-1]]


class _Tokenizer:
    """What `sampling_config` reads off a tokenizer."""

    eos_token_id, pad_token_id = STOP_TOKENS[0], 0


def _running_after_each_step(tokens, stop_tokens: list[int]):
    """(T,) how many rows have not yet sampled a stop token after each step."""
    stopped = torch.isin(tokens, torch.tensor(stop_tokens)).int().cummax(dim=1).values
    return (1 - stopped).sum(dim=0)


def test_auto_picks_the_lean_sampler_for_a_cpu_llama_only():
    from transformers import GenerationConfig

    from grpo_companion.lm.sampler import supports

    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=4)
    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                    num_attention_heads=2, attn_implementation="sdpa")
    )  # fmt: skip
    assert supports(llama, config)
    assert not supports(llama, GenerationConfig(do_sample=True, max_new_tokens=4, top_k=50))
