from types import SimpleNamespace

import pytest
import torch

from grpo_companion.chapters.testbed import tour as testbed
from grpo_companion.core.advantages import group_advantages
from grpo_companion.lm.gsm8k import load_gsm8k


def test_reward_table_strict_and_flexible():
    table = testbed.reward_table()
    assert table["strict answer"].tolist() == ["42", "42.0", "41", "(none)", "42", "42"]
    assert table["flexible answer"].tolist() == ["42", "42.0", "42", "42", "42", "43"]
    assert table["strict reward"].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert table["flexible reward"].tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    # Exercise 3: one trailing "." is dropped; without "####" only the flexible match answers.
    exercise = testbed.reward_table(["#### 12.", "The answer is 12."], gold="12")
    assert exercise["strict reward"].tolist() == [1.0, 0.0]
    assert exercise["flexible reward"].tolist() == [1.0, 1.0]


def test_source_examples_are_each_sources_first_training_problem():
    table = testbed.source_examples(("arithmetic",), seed=2)
    first = load_gsm8k("train", source="arithmetic", num_examples=1, seed=2)[0]
    assert table.loc["arithmetic"].to_dict() == first
    assert table.loc["arithmetic", "answer"].splitlines()[-1].startswith("#### ")


REPORT = {
    "spec": {"train_steps": 100, "target_accuracy": 0.3, "num_validation_examples": 40},
    "losses": [3.0 / step for step in range(1, 61)],
    "validation": [[20, 0.05], [40, 0.2], [60, 0.325]],
    "steps": 60,
    "held_out_accuracy": 0.31,
    "seconds": 12.5,
}


def test_warm_start_summary_reads_the_report():
    assert testbed.warm_start_summary(REPORT) == {
        "warm_start_steps": 60,
        "warm_start_max_steps": 100,
        "warm_start_seconds": 12.5,
        "warm_start_held_out_accuracy": 0.31,
        "warm_start_target_accuracy": 0.3,
        "warm_start_validation_problems": 40,
    }


def test_plot_warm_start_draws_loss_and_validation_even_without_validations():
    figure = testbed.plot_warm_start(REPORT)
    loss_ax, accuracy_ax = figure.axes
    assert len(loss_ax.lines[0].get_ydata()) == 60
    assert list(accuracy_ax.lines[0].get_xdata()) == [20, 40, 60]
    assert accuracy_ax.lines[1].get_ydata()[0] == 0.3  # the target
    never_validated = testbed.plot_warm_start({**REPORT, "validation": []})
    assert len(never_validated.axes[1].lines[0].get_xdata()) == 0


def test_first_mixed_group():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    assert testbed.first_mixed_group(rewards) == 2
    assert testbed.first_mixed_group(rewards[:2]) == 0  # none mixed: the first group


def test_group_table_shows_one_groups_completions():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    rollouts = SimpleNamespace(
        num_generations=4,
        texts=["a", "b", "c", "d", "#### 5", "#### 6", "x", "#### 7"],
        lengths=torch.tensor([1, 1, 1, 1, 3, 3, 1, 3]),
        rewards=rewards,
    )
    advantages = group_advantages(rewards, "grpo")
    table = testbed.group_table(rollouts, advantages, 1)
    assert table["completion"].tolist() == ["#### 5", "#### 6", "x", "#### 7"]
    assert table["tokens"].tolist() == [3, 3, 1, 3]
    assert table["reward"].tolist() == [1.0, 0.0, 0.0, 0.0]
    # k = 1 of G = 4 right: mean 1/4, Bessel-corrected std 1/2, so +1.5 and -0.5 (eps 1e-4).
    assert table["advantage"].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-3)


def test_exercise_2_advantages_of_two_right_in_eight():
    rewards = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    advantages = group_advantages(rewards, "grpo")[0]
    assert advantages[0].item() == pytest.approx(1.620, abs=5e-4)
    assert advantages[2].item() == pytest.approx(-0.540, abs=5e-4)
