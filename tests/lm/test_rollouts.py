import copy

import pytest
import torch

from grpo_companion.lm.rollouts import (
    cut_at_eos,
    generate_rollouts,
    greedy_accuracy,
    greedy_completions,
)
from grpo_companion.lm.scoring import length_buckets, sequence_log_probs

NUM_GENERATIONS = 4
MAX_COMPLETION_LENGTH = 24


def _rollouts(policy, problems, **overrides):
    model, tokenizer = policy
    prompts, golds = problems
    settings = {
        "num_generations": NUM_GENERATIONS,
        "max_completion_length": MAX_COMPLETION_LENGTH,
        "seed": 0,
    }
    return generate_rollouts(model, tokenizer, prompts, golds, **(settings | overrides))


def test_shapes_and_group_structure(random_tiny, arithmetic_prompts):
    rollouts = _rollouts(random_tiny, arithmetic_prompts)
    prompts, _ = arithmetic_prompts
    num_rollouts = len(prompts) * NUM_GENERATIONS
    width = rollouts.completion_ids.shape[1]
    assert width <= MAX_COMPLETION_LENGTH
    for name in ("completion_ids", "completion_mask", "log_probs"):
        assert getattr(rollouts, name).shape == (num_rollouts, width), name
    assert rollouts.lengths.shape == rollouts.truncated.shape == (num_rollouts,)
    assert len(rollouts.texts) == num_rollouts
    assert rollouts.rewards.shape == (len(prompts), NUM_GENERATIONS)
    assert rollouts.prompt_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert (
        rollouts.input_ids.shape
        == rollouts.attention_mask.shape
        == (num_rollouts, rollouts.prompt_ids.shape[1] + width)
    )
    # Left padding: every prompt ends in the last column, the shorter ones start later.
    assert rollouts.prompt_mask[:, -1].all()
    assert not rollouts.prompt_mask[:, 0].all()


def test_masks_lengths_and_truncation_agree(random_tiny, arithmetic_prompts):
    _, tokenizer = random_tiny
    rollouts = _rollouts(random_tiny, arithmetic_prompts)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    # The random model both stops and runs out of tokens: both cases are exercised.
    assert rollouts.truncated.any() and not rollouts.truncated.all()
    for ids, mask, length, truncated in zip(
        rollouts.completion_ids, rollouts.completion_mask, rollouts.lengths, rollouts.truncated
    ):
        assert mask.tolist() == [1] * length + [0] * (len(mask) - length)
        assert (ids[length:] == pad).all()
        if truncated:
            assert length == MAX_COMPLETION_LENGTH and eos not in ids.tolist()
        else:
            assert ids[length - 1] == eos and eos not in ids[: length - 1].tolist()
    assert (rollouts.log_probs[rollouts.completion_mask == 0] == 0).all()
    assert (rollouts.log_probs[rollouts.completion_mask == 1] < 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_equal_an_unpadded_teacher_forced_pass(
    random_tiny, arithmetic_prompts, temperature
):
    """Each rollout alone, no padding, plain positions: the same log-probs to 1e-5."""
    model, _ = random_tiny
    rollouts = _rollouts(random_tiny, arithmetic_prompts, temperature=temperature)
    for i in range(len(rollouts.texts)):
        prompt = rollouts.prompt_ids[rollouts.prompt_index[i]][
            rollouts.prompt_mask[rollouts.prompt_index[i]].bool()
        ]
        completion = rollouts.completion_ids[i, : rollouts.lengths[i]]
        ids = torch.cat([prompt, completion]).unsqueeze(0)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / temperature
        expected = (
            torch.log_softmax(logits, dim=-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        )
        torch.testing.assert_close(
            rollouts.log_probs[i, : rollouts.lengths[i]], expected, rtol=0, atol=1e-5
        )


def test_tokens_are_sampled_from_the_reported_distribution(
    random_tiny, arithmetic_prompts, monkeypatch
):
    """Even when the checkpoint's generation_config asks for top-k and a repetition
    penalty, generate samples from softmax(logits / temperature), and the recomputed
    log-probs match the ones generate saw (KV cache) to 1e-5."""
    model, tokenizer = random_tiny
    model = copy.deepcopy(model)
    model.generation_config.top_k = 5
    model.generation_config.repetition_penalty = 1.3
    temperature = 0.8
    seen = []
    generate = model.generate

    def spy(**kwargs):
        out = generate(
            **kwargs, output_scores=True, output_logits=True, return_dict_in_generate=True
        )
        seen.append(out)
        return out.sequences

    monkeypatch.setattr(model, "generate", spy)
    rollouts = _rollouts(
        (model, tokenizer),
        arithmetic_prompts,
        temperature=temperature,
        batch_size=64,
        sampler="generate",
    )
    (out,) = seen  # one call: every rollout fits in one batch
    scores = torch.stack(out.scores, dim=1)  # (rollouts, steps, vocab) after the logits processors
    tempered = torch.stack(out.logits, dim=1) / temperature
    torch.testing.assert_close(
        torch.log_softmax(scores, -1), torch.log_softmax(tempered, -1), rtol=0, atol=1e-6
    )
    width = rollouts.completion_ids.shape[1]
    at_tokens = (
        torch.log_softmax(tempered[:, :width], -1)
        .gather(-1, rollouts.completion_ids.unsqueeze(-1))
        .squeeze(-1)
    )
    mask = rollouts.completion_mask.bool()
    torch.testing.assert_close(rollouts.log_probs[mask], at_tokens[mask], rtol=0, atol=1e-5)


def test_same_seed_same_rollouts_and_global_rng_untouched(random_tiny, arithmetic_prompts):
    state = torch.random.get_rng_state()
    first, second = (
        _rollouts(random_tiny, arithmetic_prompts, seed=3),
        _rollouts(random_tiny, arithmetic_prompts, seed=3),
    )
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(first.completion_ids, second.completion_ids)
    assert torch.equal(first.log_probs, second.log_probs)
    assert first.texts == second.texts
    assert not torch.equal(
        first.completion_ids, _rollouts(random_tiny, arithmetic_prompts, seed=4).completion_ids
    )


def test_skipping_log_probs_changes_nothing_else(random_tiny, arithmetic_prompts):
    full = _rollouts(random_tiny, arithmetic_prompts)
    lean = _rollouts(random_tiny, arithmetic_prompts, compute_log_probs=False)
    assert lean.log_probs is None
    assert torch.equal(lean.completion_ids, full.completion_ids)
    assert torch.equal(lean.rewards, full.rewards)
    assert lean.texts == full.texts


def test_batch_size_splits_generation_without_changing_the_layout(random_tiny, arithmetic_prompts):
    rollouts = _rollouts(
        random_tiny, arithmetic_prompts, batch_size=NUM_GENERATIONS
    )  # one prompt per generate call
    assert rollouts.completion_ids.shape[0] == 3 * NUM_GENERATIONS
    assert rollouts.completion_ids.shape[1] == int(rollouts.lengths.max())
    assert (rollouts.log_probs[rollouts.completion_mask == 1] < 0).all()


def test_rewards_score_each_completion_against_its_own_prompt(random_tiny, arithmetic_prompts):
    prompts, _ = arithmetic_prompts
    calls = []

    def reward_fn(text, gold):
        calls.append(text)
        return float(gold)

    rollouts = _rollouts(random_tiny, (prompts, ["0", "1", "2"]), reward_fn=reward_fn)
    assert calls == rollouts.texts
    assert rollouts.rewards.tolist() == [[0.0] * 4, [1.0] * 4, [2.0] * 4]


def test_texts_are_the_decoded_completions_without_special_tokens(random_tiny, arithmetic_prompts):
    _, tokenizer = random_tiny
    rollouts = _rollouts(random_tiny, arithmetic_prompts)
    for text, ids, length in zip(rollouts.texts, rollouts.completion_ids, rollouts.lengths):
        assert text == tokenizer.decode(ids[:length], skip_special_tokens=True)
        assert "<eos>" not in text and "<pad>" not in text


def test_sequence_log_probs_is_differentiable(random_tiny, arithmetic_prompts):
    model, _ = random_tiny
    rollouts = _rollouts(random_tiny, arithmetic_prompts)
    log_probs = sequence_log_probs(
        model,
        rollouts.input_ids,
        rollouts.attention_mask,
        rollouts.completion_mask,
        rollouts.temperature,
    )
    torch.testing.assert_close(log_probs.detach(), rollouts.log_probs, rtol=0, atol=1e-6)
    (log_probs.sum()).backward()
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.dim() >= 2
    )
    model.zero_grad(set_to_none=True)


def test_greedy_accuracy_scores_the_argmax_completion(random_tiny, arithmetic_prompts):
    """Batched, left-padded, KV-cached greedy decoding = a plain argmax loop per prompt."""
    model, tokenizer = random_tiny
    prompts, _ = arithmetic_prompts
    expected = []
    for prompt in prompts:
        prompt_ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        ids = prompt_ids
        for _ in range(8):
            with torch.no_grad():
                next_id = model(input_ids=ids).logits[0, -1].argmax().view(1, 1)
            ids = torch.cat([ids, next_id], dim=1)
            if next_id == tokenizer.eos_token_id:
                break
        expected.append(tokenizer.decode(ids[0, prompt_ids.shape[1] :], skip_special_tokens=True))
    # The "golds" are the expected texts: the reward says whether greedy decoding found them.
    greedy = {"max_completion_length": 8, "reward_fn": lambda text, gold: float(text == gold)}
    assert greedy_accuracy(model, tokenizer, prompts, expected, **greedy) == 1.0
    rewards, texts = greedy_completions(model, tokenizer, prompts, expected, **greedy)
    assert texts == expected and rewards == [1.0] * len(prompts)


def test_cut_at_eos_with_pad_equal_to_eos_and_several_eos_tokens():
    ids = torch.tensor([[5, 2, 2, 2], [5, 6, 7, 8], [9, 0, 0, 0], [3, 4, 9, 1]])
    completion_ids, mask, lengths, truncated = cut_at_eos(ids, eos_token_ids=[2, 9], pad_token_id=2)
    assert lengths.tolist() == [2, 4, 1, 3]
    assert truncated.tolist() == [False, True, False, False]
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]]
    assert completion_ids.tolist() == [[5, 2, 2, 2], [5, 6, 7, 8], [9, 2, 2, 2], [3, 4, 9, 2]]


def test_bad_arguments_are_refused(random_tiny, arithmetic_prompts):
    with pytest.raises(ValueError, match="temperature"):
        _rollouts(random_tiny, arithmetic_prompts, temperature=0.0)
    prompts, golds = arithmetic_prompts
    for bad in [(prompts, golds[:1]), ([], [])]:
        with pytest.raises(ValueError, match="golds"):
            _rollouts(random_tiny, bad)


@pytest.mark.parametrize("num_generations, do_sample", [(4, True), (3, True), (1, False)])
def test_prompts_computed_once_per_group_give_generates_own_tokens(
    random_tiny, arithmetic_prompts, num_generations, do_sample
):
    """`generate_groups` (through `_generate`) runs each prompt through the model once for its
    whole group (a cache repeated G times) where `generate` would run it G times: on
    left-padded prompts of different lengths, under the same seed, the tokens are
    `generate`'s own."""
    from grpo_companion.lm.rollouts import _generate, _tokenize_prompts, sampling_config, seeded

    model, tokenizer = random_tiny
    prompts, _ = arithmetic_prompts
    ids, mask = _tokenize_prompts(tokenizer, prompts, model.device)
    assert (mask == 0).any()  # some prompts are padded
    config = sampling_config(model, tokenizer, do_sample=do_sample, max_new_tokens=12,
                             num_return_sequences=num_generations)  # fmt: skip
    for seed in range(3):
        with seeded(seed, model.device):
            expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        with seeded(seed, model.device):
            shared = _generate(model, ids, mask, config, prompts_per_call=len(prompts))
        assert torch.equal(shared, expected[:, ids.shape[1] :])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_group_shared_prompts_give_the_same_log_probs_and_gradient(
    random_tiny, arithmetic_prompts, temperature
):
    """`num_generations=G` runs each prompt once into a cache repeated for its G completions:
    on left-padded prompts of different lengths, the log-probs and the gradient of a weighted
    sum of them equal those of the plain pass over (B * G, P + T) tokens up to float32
    rounding (measured about 2e-6 and 1.5e-6 relative on the warm-started model)."""
    model, _ = random_tiny
    rollouts = _rollouts(
        random_tiny, arithmetic_prompts, temperature=temperature, compute_log_probs=False
    )
    args = (rollouts.input_ids, rollouts.attention_mask, rollouts.completion_mask, temperature)
    assert (rollouts.prompt_mask == 0).any()  # some prompts are padded
    weights = torch.randn(
        rollouts.completion_mask.shape, generator=torch.Generator().manual_seed(0)
    )
    results = []
    for group_size in (1, NUM_GENERATIONS):
        model.zero_grad(set_to_none=True)
        log_probs = sequence_log_probs(model, *args, num_generations=group_size)
        (weights * log_probs).sum().backward()
        results.append((log_probs.detach(), [p.grad.clone() for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    (plain, plain_grads), (shared, shared_grads) = results
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)
    assert (shared[rollouts.completion_mask == 0] == 0).all()
    for grad, expected in zip(shared_grads, plain_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)
    # A frozen copy (the trainer's KL reference) gives the policy's very numbers.
    reference = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        frozen = sequence_log_probs(reference, *args, num_generations=NUM_GENERATIONS)
    assert torch.equal(frozen, shared)
    # The rollouts' own log-prob pass shares prompts too, in batches of whole groups.
    for batch_size in (5, 64):
        again = _rollouts(
            random_tiny, arithmetic_prompts, temperature=temperature, batch_size=batch_size
        )
        with torch.no_grad():
            expected = sequence_log_probs(
                model, again.input_ids, again.attention_mask, again.completion_mask, temperature
            )
        torch.testing.assert_close(again.log_probs, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bucket_size", [1, 3, 8, 1000])
def test_length_buckets_give_the_same_log_probs_and_gradient(
    random_tiny, arithmetic_prompts, bucket_size
):
    """Completions run sorted by length, `bucket_size` rows at a time, each bucket padded to its
    own longest (`completion_logits(bucket_size=...)`): the log-probs and the gradient of the
    plain padded pass up to float32 rounding, for bucket sizes that do and do not divide the
    batch; a frozen copy gives the policy's very numbers."""
    model, _ = random_tiny
    rollouts = _rollouts(random_tiny, arithmetic_prompts, compute_log_probs=False)
    args = (rollouts.input_ids, rollouts.attention_mask, rollouts.completion_mask)
    assert len(set(rollouts.lengths.tolist())) > 1  # the buckets have different lengths
    weights = torch.randn(
        rollouts.completion_mask.shape, generator=torch.Generator().manual_seed(0)
    )
    results = []
    for options in ({}, {"num_generations": NUM_GENERATIONS, "bucket_size": bucket_size}):
        model.zero_grad(set_to_none=True)
        log_probs = sequence_log_probs(model, *args, **options)
        (weights * log_probs).sum().backward()
        results.append((log_probs.detach(), [p.grad.clone() for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    (plain, plain_grads), (bucketed, bucketed_grads) = results
    torch.testing.assert_close(bucketed, plain, rtol=0, atol=1e-5)
    assert (bucketed[rollouts.completion_mask == 0] == 0).all()
    for grad, expected in zip(bucketed_grads, plain_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)
    reference = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        frozen = sequence_log_probs(
            reference, *args, num_generations=NUM_GENERATIONS, bucket_size=bucket_size
        )
    assert torch.equal(frozen, bucketed)


def test_length_buckets_cover_each_row_once_at_its_length():
    """Golden case: rows of lengths 3, 1, 4, 0 (a row with no completion token still predicts
    one), 2 in buckets of two, longest first."""
    lengths = torch.tensor([3, 1, 4, 0, 2])
    mask = (torch.arange(5) < lengths[:, None]).long()
    buckets = length_buckets(mask, 2)
    assert [(rows.tolist(), length) for rows, length in buckets] == [
        ([2, 0], 4),
        ([4, 1], 2),
        ([3], 1),
    ]


def test_group_shared_prompts_refuse_rows_that_are_not_groups(random_tiny, arithmetic_prompts):
    model, _ = random_tiny
    rollouts = _rollouts(random_tiny, arithmetic_prompts, compute_log_probs=False)
    ids, mask, completion_mask = (
        rollouts.input_ids, rollouts.attention_mask, rollouts.completion_mask,
    )  # fmt: skip
    with pytest.raises(ValueError, match="whole groups"):
        sequence_log_probs(model, ids[:-1], mask[:-1], completion_mask[:-1], num_generations=4)
    mixed = torch.arange(len(ids)).roll(1)  # each group's first row from another prompt
    with pytest.raises(ValueError, match="share their prompt"):
        sequence_log_probs(
            model, ids[mixed], mask[mixed], completion_mask[mixed], num_generations=4
        )
    with pytest.raises(ValueError, match="causal_mask"):
        sequence_log_probs(model, ids, mask, completion_mask, num_generations=4,
                           inputs_embeds=torch.zeros(1))  # fmt: skip


def test_group_shared_prompts_refuse_a_model_that_drops_the_cache(random_tiny, arithmetic_prompts):
    """Activation (gradient) checkpointing in train mode makes transformers drop the KV cache:
    the completions would run without their prompt, so it is refused."""
    model, _ = random_tiny
    rollouts = _rollouts(random_tiny, arithmetic_prompts, compute_log_probs=False)
    args = (rollouts.input_ids, rollouts.attention_mask, rollouts.completion_mask)
    checkpointed = copy.deepcopy(model)
    checkpointed.activation_checkpointing_enable()
    checkpointed.train()
    with pytest.raises(RuntimeError, match="did not fill the KV cache"):
        sequence_log_probs(checkpointed, *args, num_generations=NUM_GENERATIONS)
    # The plain pass is right there; a one-token prompt has nothing to share and takes it too.
    plain = sequence_log_probs(checkpointed, *args)
    with torch.no_grad():
        torch.testing.assert_close(
            plain.detach(), sequence_log_probs(model, *args), atol=1e-5, rtol=0
        )
    one_token = (rollouts.input_ids[:, -9:], rollouts.attention_mask[:, -9:].clone(),
                 rollouts.completion_mask[:, -8:])  # fmt: skip
    one_token[1][:, 0] = 1
    with torch.no_grad():
        torch.testing.assert_close(
            sequence_log_probs(model, *one_token, num_generations=NUM_GENERATIONS),
            sequence_log_probs(model, *one_token),
            rtol=0,
            atol=0,
        )
