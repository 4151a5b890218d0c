import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_companion.chapters.credit import (
    TOKEN_CLASSES,
    PrefixValues,
    answer_reward,
    class_shares,
    exact_moments,
    exact_prefix_values,
    intermediate_results,
    per_sequence_estimates,
    prefix_values,
    row_spread,
    sampled_errors,
    select_groups,
    token_advantages,
    token_classes,
    token_scores,
)
from grpo_companion.lm.models import build_tokenizer, format_prompt
from grpo_companion.core.policy_gradient import SequencePolicy
from grpo_companion.lm.rollouts import generate_rollouts


def test_token_advantages_hand_built_and_constant_per_row():
    advantages = torch.tensor([1.5, -0.5, 0.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    matrix = token_advantages(advantages, mask)
    assert torch.equal(matrix, torch.tensor([[1.5, 1.5, 1.5], [-0.5, -0.5, 0.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(row_spread(matrix, mask), torch.zeros(3))


def test_row_spread_hand_built():
    matrix = torch.tensor([[1.0, 3.0, 2.0], [5.0, -9.0, 7.0], [4.0, 4.0, 4.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert torch.equal(row_spread(matrix, mask), torch.tensor([2.0, 0.0, 0.0]))


def test_prefix_values_properties_hand_built():
    values = torch.tensor([[0.5, 0.75, 1.0, 1.0], [0.25, 0.0, 0.0, 0.0]])
    errors = torch.tensor([[0.1, 0.2, 0.0, 0.0], [0.3, 0.0, 0.0, 0.0]])
    result = PrefixValues(values, errors, num_resamples=8)
    assert torch.allclose(result.credit, torch.tensor([[0.25, 0.25, 0.0], [-0.25, 0.0, 0.0]]))
    # Telescoping: credit sums to the final value (the reward) minus V(prompt).
    assert torch.allclose(result.credit.sum(dim=1), values[:, -1] - values[:, 0])
    assert torch.allclose(result.credit_standard_errors[0, 0], torch.tensor(math.sqrt(0.05)))
    assert torch.allclose(result.squared_credit[0], torch.tensor([0.0625 - 0.05, 0.0625 - 0.04, 0]))


def _small_policy(vocab_size=3, length=4, seed=0):
    policy = SequencePolicy(vocab_size, length)
    return policy, policy.init_logits(seed)


def test_exact_prefix_values_hand_built():
    policy, logits = _small_policy(vocab_size=2, length=2)
    sequences = policy.all_sequences()
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0])  # r = y0 xor y1
    values = exact_prefix_values(policy, logits, rewards)
    first = torch.softmax(logits[0, 2], dim=-1)  # context BOS
    second = torch.softmax(logits[1, :2], dim=-1)  # (y0, y1)
    after_first = torch.stack([second[0, 1], second[1, 0]])  # P(y1 != y0 | y0)
    assert torch.allclose(values[:, 0], (first @ after_first).expand(4))
    assert torch.allclose(values[:, 1], after_first[sequences[:, 0]])
    assert torch.equal(values[:, 2], rewards)


def test_both_estimators_unbiased_and_variances_by_enumeration():
    policy, logits = _small_policy()
    sequences = policy.all_sequences()
    rewards = answer_reward(sequences, policy.vocab_size, positions=[1])
    probs, exact = policy.probs(logits), policy.exact_gradient(logits, rewards)
    values = exact_prefix_values(policy, logits, rewards)
    scores = token_scores(policy, logits, sequences)
    mask = torch.ones(sequences.shape, dtype=torch.float64)
    outcome = per_sequence_estimates(token_advantages(rewards - values[:, 0], mask), scores)
    token = per_sequence_estimates(values.diff(dim=1), scores)
    for estimates in (outcome, token):
        mean, _ = exact_moments(probs, estimates)
        assert torch.allclose(mean, exact, atol=1e-12)
    # The outcome estimator with b = J is chapter 1's estimator_variance at that baseline.
    _, outcome_variance = exact_moments(probs, outcome)
    reference = policy.scores(logits, sequences)
    assert torch.allclose(outcome, (rewards - values[0, 0])[:, None] * reference, atol=1e-12)
    # The token-level estimator is not the outcome one: its coefficients vary along a row.
    _, token_variance = exact_moments(probs, token)
    assert not torch.isclose(outcome_variance, token_variance)


def test_sampled_errors_match_exact_variance():
    policy, logits = _small_policy()
    sequences = policy.all_sequences()
    rewards = answer_reward(sequences, policy.vocab_size, positions=[0, 2])
    probs = policy.probs(logits)
    values = exact_prefix_values(policy, logits, rewards)
    estimates = per_sequence_estimates(values.diff(dim=1), token_scores(policy, logits, sequences))
    mean, variance = exact_moments(probs, estimates)
    errors = sampled_errors(probs, estimates, mean, [10, 40], num_repeats=4000, seed=0)
    # E||mean of n - mean||^2 = variance / n; 4000 repeats: a few % of noise, 10% tolerance.
    for n, row in zip([10, 40], errors):
        assert row.mean().item() == pytest.approx(variance.item() / n, rel=0.1)


def test_answer_reward_hand_built():
    sequences = torch.tensor([[1, 2, 0, 3], [1, 2, 0, 0], [3, 3, 3, 2]])
    assert torch.equal(answer_reward(sequences, 4, [0, 1]), torch.tensor([1.0, 0.0, 1.0]).double())


def test_token_classes_of_a_worked_answer():
    text = "12+5=17\n17-3=14\n#### 14"
    tokenizer = build_tokenizer([text])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    completion_ids = torch.tensor([ids + [tokenizer.pad_token_id]])
    mask = torch.tensor([[1] * len(ids) + [0]])
    names = [
        TOKEN_CLASSES[k] if k >= 0 else None
        for k in token_classes(tokenizer, completion_ids, mask)[0]
    ]
    o, r, last, a, f = "operand", "result", "last_result", "answer", "format"
    expected = [o, o, f, o, f, r, r, f, o, o, f, o, f, last, last, f, f, f, f, f, f, a, a, f, None]
    assert names == expected


def test_class_shares_hand_built():
    weights = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 9.0]])
    classes = torch.tensor([[0, 1, 1], [4, 2, -1]])
    assert torch.allclose(
        class_shares(weights, classes), torch.tensor([0.1, 0.5, 0.0, 0.0, 0.4]).double()
    )
    assert torch.equal(class_shares(torch.zeros(2, 3), classes), torch.zeros(5).double())


def _digit_reward(text: str, gold: str) -> float:
    """1 if the text holds one of four digits: about one token in five does."""
    return float(any(character in "0123" for character in text))


@pytest.fixture(scope="module")
def random_llama():
    tokenizer = build_tokenizer(["0123456789 apples"])
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        initializer_range=0.5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), tokenizer


def _next_token_probs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].double(), dim=-1)


def test_prefix_values_match_enumeration(random_llama):
    """Horizon 2: every completion is enumerable, so V(prompt) and V(prompt, o_1) are exact."""
    model, tokenizer = random_llama
    prompt = format_prompt(tokenizer, "1 apples")
    rollouts = generate_rollouts(
        model,
        tokenizer,
        [prompt],
        ["0"],
        num_generations=3,
        max_completion_length=2,
        seed=0,
        reward_fn=_digit_reward,
    )
    num_resamples = 1500
    result = prefix_values(
        model,
        tokenizer,
        rollouts,
        ["0"],
        num_resamples=num_resamples,
        max_completion_length=2,
        seed=1,
        reward_fn=_digit_reward,
    )
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id

    def value(prefix: list[int]) -> float:
        """Exact P(reward 1 | prompt, prefix) over the rest of a horizon-2 completion."""
        probs = _next_token_probs(model, prompt_ids + prefix)
        total = 0.0
        for token, p in enumerate(probs.tolist()):
            completion = prefix + [token]
            if token == eos or len(completion) == 2:
                total += p * _digit_reward(
                    tokenizer.decode(completion, skip_special_tokens=True), ""
                )
            else:
                total += p * value(completion)
        return total

    compared = 0
    for row in range(3):
        length = int(rollouts.lengths[row])
        assert result.values[row, length:].eq(rollouts.rewards.view(-1)[row]).all()
        for t in range(length):
            exact = value(rollouts.completion_ids[row, :t].tolist())
            # 4.5 standard errors of the exact binomial: fails by chance with p < 1e-4 per check.
            tolerance = 4.5 * math.sqrt(exact * (1 - exact) / num_resamples)
            assert abs(result.values[row, t].item() - exact) <= tolerance + 1e-9
            compared += 1
    assert compared >= 4


def test_prefix_values_reproducible(random_llama):
    model, tokenizer = random_llama
    prompt = format_prompt(tokenizer, "2 apples")
    rollouts = generate_rollouts(
        model,
        tokenizer,
        [prompt],
        ["0"],
        num_generations=2,
        max_completion_length=4,
        seed=0,
        reward_fn=_digit_reward,
    )
    kwargs = {"num_resamples": 8, "max_completion_length": 4, "reward_fn": _digit_reward}
    first = prefix_values(model, tokenizer, rollouts, ["0"], seed=3, **kwargs)
    again = prefix_values(model, tokenizer, rollouts, ["0"], seed=3, **kwargs)
    other = prefix_values(model, tokenizer, rollouts, ["0"], seed=4, **kwargs)
    assert torch.equal(first.values, again.values)
    assert not torch.equal(first.values, other.values)
    assert ((first.values >= 0) & (first.values <= 1)).all()


def test_select_groups_keeps_the_rows_of_the_groups(random_llama):
    model, tokenizer = random_llama
    prompts = [format_prompt(tokenizer, question) for question in ("1 apples", "2 apples 3")]
    rollouts = generate_rollouts(
        model,
        tokenizer,
        prompts,
        ["0", "1"],
        num_generations=3,
        max_completion_length=5,
        seed=0,
        reward_fn=_digit_reward,
    )
    selected = select_groups(rollouts, [1])
    assert selected.texts == rollouts.texts[3:]
    assert torch.equal(selected.rewards, rollouts.rewards[1:])
    width = selected.completion_ids.shape[1]
    assert width == int(rollouts.lengths[3:].max())
    assert torch.equal(
        selected.input_ids,
        rollouts.input_ids[
            3:, : rollouts.input_ids.shape[1] - (rollouts.completion_ids.shape[1] - width)
        ],
    )


def test_intermediate_results_hand_built():
    assert intermediate_results("12+5=17\n17-3=14\n#### 14") == ["17", "14"]
    assert intermediate_results("4*7=28\n28=\n2=-3 and 9\n#### 5") == ["28", "-3"]
    assert intermediate_results("#### 14") == []
