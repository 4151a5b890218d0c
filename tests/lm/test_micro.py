"""lm/micro.py: the task's checker on hand cases, held-out prompts never trained on, the exact
pass rate against Monte Carlo with the book's own sampler, and the book's trainer on the model."""

import functools

import pytest
import torch

from grpo_companion.lm import micro
from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.gsm8k import build_prompts
from grpo_companion.lm.rollouts import generate_rollouts
from grpo_companion.lm.trainer import train

QUICK = micro.MicroSpec(warm_start_target=0.35, warm_start_max_steps=400, eval_every=5,
                        num_validation=64, warm_start_learning_rate=1e-2)  # fmt: skip


def test_running_sums_and_the_correct_completion_by_hand():
    assert micro.running_sums([3, 5, 1, 8], 10) == [3, 8, 9, 7]
    assert micro.solution([3, 5, 1, 8], 10) == "3\n8\n9\n7"
    assert micro.running_sums([7, 9, 11], 12) == [7, 4, 3]
    row = micro.problems("train", 4, 1, seed=3)[0]
    digits = [int(d) for d in row["question"].split()]
    gold = row["answer"].rpartition("#### ")[2]
    assert micro.decode_gold(gold, 10) == micro.solution(digits, 10)
    assert micro.decode_gold("1070403", 12) == "7\n4\n3"


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("3\n8\n9\n7", 1.0),
        ("3\n8\n9\n7\n", 0.0),  # one more token instead of <eos>
        ("3\n8\n9\n6", 0.0),
        ("3\n8\n9", 0.0),
        ("3 8 9 7", 0.0),
        ("3\n8\n9\n7?", 0.0),
        ("", 0.0),
    ],
)
def test_the_checker_on_hand_cases(completion, expected):
    assert micro.reward(completion, "13897") == expected


def test_every_token_but_eos_shows_in_the_text():
    tokenizer = micro.build_tokenizer()
    assert tokenizer.all_special_ids == [tokenizer.eos_token_id]
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id], skip_special_tokens=True)
        assert (text == "") == (token_id == tokenizer.eos_token_id)
    text = "3\n8 =?"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text
    assert micro.max_completion_length(4) == 8


def test_held_out_prompts_are_never_training_prompts():
    for steps in (2, 3):
        test = set(micro.problems("test", steps, 10_000, distinct=True)["question"])
        train_draws = set(micro.problems("train", steps, 3000, seed=1)["question"])
        assert test and not test & train_draws
        assert abs(len(test) / 10**steps - micro.TEST_SHARE) < 0.1


def test_exact_degenerate_fraction():
    rates = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    assert micro.exact_degenerate_fraction(rates, 2) == pytest.approx((1 + 0.5 + 1) / 3)
    assert micro.exact_degenerate_fraction(rates, 4) == pytest.approx((1 + 0.125 + 1) / 3)


@pytest.fixture(scope="module")
def warm(one_thread):
    """A model warm-started on 1-step prompts mod 3: pass rates in the middle."""
    return micro.warm_start(QUICK, 1, modulus=3)


def test_the_warm_start_stops_at_its_target(warm):
    _, _, report = warm
    steps, rate = report["validation_pass_rate"][-1]
    assert rate >= QUICK.warm_start_target and steps == report["steps"] < 400


def test_exact_pass_rates_match_the_samplers_frequency(warm):
    """Within 4 binomial standard errors per prompt, 3000 samples each, the book's sampler."""
    model, tokenizer, _ = warm
    data = micro.problems("train", 1, 3, modulus=3, distinct=True)
    exact = micro.exact_pass_rates(model, tokenizer, data, modulus=3)
    prompts, golds = build_prompts(tokenizer, data)
    rollouts = generate_rollouts(
        model, tokenizer, prompts, golds, num_generations=3000,
        max_completion_length=micro.max_completion_length(1, 3) + 2, seed=0, batch_size=3000,
        reward_fn=functools.partial(micro.reward, modulus=3), compute_log_probs=False,
    )  # fmt: skip
    frequency = rollouts.rewards.double().mean(dim=1)
    standard_error = (exact * (1 - exact) / 3000).sqrt()
    assert ((frequency - exact).abs() <= 4 * standard_error).all(), (frequency, exact)
    assert (exact > 0.05).all() and (exact < 0.95).all()  # a test that could fail


def test_the_books_trainer_trains_it_unchanged(warm):
    model, tokenizer, _ = warm
    policy = micro.build_model(QUICK, tokenizer)
    policy.load_state_dict(model.state_dict())
    data = micro.problems("train", 1, 64, modulus=3)
    config = GRPOConfig(
        num_generations=8,
        per_step_prompts=8,
        learning_rate=1e-3,
        max_steps=3,
        max_completion_length=micro.max_completion_length(1, 3),
        eval_every=100,
    )
    history = train(policy, tokenizer, data, data.select(range(4)), config, progress=False,
                    reward_fn=functools.partial(micro.reward, modulus=3))  # fmt: skip
    assert len(history) >= 3
    assert any(not torch.equal(a, b) for a, b in zip(policy.parameters(), model.parameters()))


@pytest.mark.parametrize(
    ("completion", "rewards", "ends", "written"),
    [
        ("3\n8\n9\n7", [1, 1, 1, 1, 1], [1, 3, 5, 7, 7], 4),
        ("3\n8\n0\n7", [1, 1, 0, 1, 0], [1, 3, 5, 7, 7], 4),
        ("3\n8", [1, 1, 0, 0, 0], [1, 3, 3, 3, 3], 2),
        ("", [0, 0, 0, 0, 0], [0, 0, 0, 0, 0], 0),
        ("3\n8\n9\n7\n1", [1, 1, 1, 1, 0], [1, 3, 5, 7, 9], 4),
    ],
)
def test_the_steps_of_process_credit_by_hand(completion, rewards, ends, written):
    answer = "3\n8\n9\n7\n#### 13897"
    assert micro.written_steps(completion, answer) == (rewards, ends, written)


def test_process_credit_puts_each_step_on_its_lines_last_token():
    tokenizer = micro.build_tokenizer()
    model = micro.build_model(micro.MicroSpec(), tokenizer)
    data = micro.problems("train", 3, 2, seed=1)
    prompts, golds = build_prompts(tokenizer, data)
    rollouts = generate_rollouts(model, tokenizer, prompts, golds, num_generations=4,
                                 max_completion_length=6, seed=0, compute_log_probs=False,
                                 reward_fn=micro.reward)  # fmt: skip
    from grpo_companion.lm.steps import rollout_step_rewards

    answers = list(data["answer"])
    steps, ends, mask = rollout_step_rewards(tokenizer, rollouts, answers,
                                             steps_of=micro.written_steps)  # fmt: skip
    for i, text in enumerate(rollouts.texts):
        rewards, char_ends, written = micro.written_steps(text, answers[i // 4])
        row = steps.view(-1, steps.shape[-1])[i]
        assert row[:-1].tolist() == rewards[:-1]
        positions = ends.view(-1, ends.shape[-1])[i][:written]
        # One token a character: a line's last character is token end - 1.
        assert positions.tolist() == [max(end - 1, 0) for end in char_ends[:written]]
