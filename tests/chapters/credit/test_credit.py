import math

import pandas as pd
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_companion.chapters.credit.tokens import (
    SHARE_COLUMNS,
    TOKEN_CLASSES,
    PrefixValues,
    choose_groups,
    class_share_records,
    class_share_table,
    class_shares,
    intermediate_results,
    prefix_value_summary,
    prefix_values,
    rewarded_wrong_steps,
    row_spread,
    select_groups,
    token_advantages,
    token_classes,
)
from grpo_companion.lm.gsm8k import format_prompt
from grpo_companion.lm.rollouts import Rollouts, generate_rollouts
from grpo_companion.lm.tiny_llama import build_tokenizer


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


def _digit_rollouts(random_llama, questions, golds, num_generations, max_completion_length):
    """(prompts, rollouts): the prompts of `questions` and their rollouts (seed 0) scored by
    `_digit_reward`."""
    model, tokenizer = random_llama
    prompts = [format_prompt(tokenizer, question) for question in questions]
    rollouts = generate_rollouts(
        model,
        tokenizer,
        prompts,
        golds,
        num_generations=num_generations,
        max_completion_length=max_completion_length,
        seed=0,
        reward_fn=_digit_reward,
    )
    return prompts, rollouts


def test_prefix_values_match_enumeration(random_llama):
    """Horizon 2: every completion is enumerable, so V(prompt) and V(prompt, o_1) are exact."""
    model, tokenizer = random_llama
    [prompt], rollouts = _digit_rollouts(random_llama, ["1 apples"], ["0"], 3, 2)
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
    _, rollouts = _digit_rollouts(random_llama, ["2 apples"], ["0"], 2, 4)
    kwargs = {"num_resamples": 8, "max_completion_length": 4, "reward_fn": _digit_reward}
    first = prefix_values(model, tokenizer, rollouts, ["0"], seed=3, **kwargs)
    again = prefix_values(model, tokenizer, rollouts, ["0"], seed=3, **kwargs)
    other = prefix_values(model, tokenizer, rollouts, ["0"], seed=4, **kwargs)
    assert torch.equal(first.values, again.values)
    assert not torch.equal(first.values, other.values)
    assert ((first.values >= 0) & (first.values <= 1)).all()


def test_select_groups_keeps_the_rows_of_the_groups(random_llama):
    _, rollouts = _digit_rollouts(random_llama, ["1 apples", "2 apples 3"], ["0", "1"], 3, 5)
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


def _hand_built_rollouts(rewards, texts, lengths, width=4):
    """Rollouts of len(rewards) groups of G, with only the fields the summaries read."""
    rewards = torch.tensor(rewards)
    lengths = torch.tensor(lengths)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    num_prompts, group_size = rewards.shape
    return Rollouts(
        prompt_ids=torch.zeros(num_prompts, 1, dtype=torch.long),
        prompt_mask=torch.ones(num_prompts, 1, dtype=torch.long),
        completion_ids=torch.zeros(len(texts), width, dtype=torch.long),
        completion_mask=mask,
        log_probs=None,
        lengths=lengths,
        truncated=torch.zeros(len(texts), dtype=torch.bool),
        texts=texts,
        rewards=rewards,
        num_generations=group_size,
        temperature=1.0,
    )


def test_choose_groups_puts_mixed_groups_first_in_order():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    chosen, seen = choose_groups(rewards, num_groups=3)
    assert chosen == [1, 3, 0]
    assert seen == {
        "mixed_groups": 2,
        "sampled_groups": 4,
        "pass_rate": 0.5,
        "num_chosen_groups": 3,
        "chosen_mixed_groups": 2,
    }
    assert choose_groups(rewards, num_groups=1)[0] == [1]


def test_prefix_value_summary_hand_built():
    # Two groups of two; V(s_1) estimates 0.5, 0.5 for group 0 (pass rate 0.5: no gap) and
    # 0.2, 0.2 for group 1 (pass rate 1: gap 0.8 / sqrt(0.2 * 0.8 / 2) = 0.8 / 0.2828).
    rollouts = _hand_built_rollouts([[1.0, 0.0], [1.0, 1.0]], ["a", "b", "c", "d"], [2, 1, 3, 1])
    values = torch.tensor(
        [
            [0.5, 0.9, 1.0, 1.0, 1.0],
            [0.5, 0.0, 0.0, 0.0, 0.0],
            [0.2, 0.3, 0.6, 1.0, 1.0],
            [0.2, 1.0, 1.0, 1.0, 1.0],
        ]
    )
    errors = torch.full((4, 5), 0.1)
    summary = prefix_value_summary(PrefixValues(values, errors, num_resamples=4), rollouts)
    assert summary["num_resamples"] == 4
    assert summary["num_continuations"] == (2 + 1 + 3 + 1) * 4
    assert summary["mean_credit_standard_error"] == pytest.approx(math.sqrt(0.02), rel=1e-6)
    # Spreads along the masked credit: [0.4, 0.1] -> 0.3, [-0.5] -> 0, [0.1, 0.3, 0.4] -> 0.3,
    # [0.8] -> 0.
    assert summary["credit_mean_row_spread"] == pytest.approx(0.15, rel=1e-6)
    # Noise of standard error sqrt(0.02) on every credit: rows of 2, 1, 3, 1 tokens spread over
    # (2/sqrt(pi) + 0 + 3/sqrt(pi) + 0) / 4 standard errors on average.
    noise = (5 / math.sqrt(math.pi)) / 4 * math.sqrt(0.02)
    assert summary["credit_noise_row_range"] == pytest.approx(noise, rel=1e-6)
    assert torch.allclose(summary["prompt_values"], torch.tensor([0.5, 0.2]))
    assert torch.equal(summary["group_pass_rates"], torch.tensor([0.5, 1.0]))
    expected_gap = 0.8 / math.sqrt(0.2 * 0.8 / 2)
    assert summary["prompt_value_max_gap_in_errors"] == pytest.approx(expected_gap, rel=1e-6)


def test_rewarded_wrong_steps_hand_built():
    references = ["2+3=5\n5*2=10\n#### 10", "7-1=6\n#### 6"]
    texts = [
        "2+3=5\n5*2=10\n#### 10",  # rewarded, right steps
        "2+3=6\n6*2=10\n#### 10",  # rewarded, wrong steps
        "2+3=5\n5*2=11\n#### 11",  # not rewarded, wrong steps
        "7-1=6\n#### 6",  # rewarded, right steps
        "#### 6",  # rewarded, no steps at all: they differ from the reference's
        "7-1=5\n#### 5",  # not rewarded
    ]
    rollouts = _hand_built_rollouts([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], texts, [4, 4, 4, 4, 4, 4])
    assert rewarded_wrong_steps(rollouts, references) == {
        "rewarded_rollouts": 4,
        "rewarded_with_wrong_steps": 2,
    }


def test_class_share_table_and_records_hand_built():
    classes = torch.tensor([[0, 1, 3, 4], [2, 3, 4, -1]])
    mask = (classes >= 0).long()
    outcome = token_advantages(torch.tensor([1.0, -2.0]), mask)  # A^2: 1 on row 0, 4 on row 1
    squared_credit = torch.tensor([[0.0, 0.5, 1.0, 0.0], [0.25, 0.25, 0.0, 0.0]])
    shares = class_share_table(mask, outcome, squared_credit, classes)
    assert list(shares.index) == list(TOKEN_CLASSES)
    assert list(shares.columns) == list(SHARE_COLUMNS.values())
    expected = pd.DataFrame(
        {
            "tokens": [1 / 7, 1 / 7, 1 / 7, 2 / 7, 2 / 7],
            "outcome A^2": [1 / 16, 1 / 16, 4 / 16, 5 / 16, 5 / 16],
            "credit delta^2": [0.0, 0.25, 0.125, 0.625, 0.0],
        },
        index=pd.Index(TOKEN_CLASSES, name="token class"),
    )
    pd.testing.assert_frame_equal(shares, expected)
    records = class_share_records(shares)
    assert len(records) == 3 * (len(TOKEN_CLASSES) + 1)
    assert records["credit_share_last_result"] == pytest.approx(0.125)
    assert records["outcome_share_format"] == pytest.approx(5 / 16)
    # result + last_result + answer
    assert records["token_share_result_and_answer"] == pytest.approx(4 / 7)
    assert records["credit_share_result_and_answer"] == pytest.approx(1.0)
    assert records["outcome_share_result_and_answer"] == pytest.approx(10 / 16)
