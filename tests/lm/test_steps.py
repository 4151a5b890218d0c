import pytest
import torch

from grpo_companion.lm.rollouts import Rollouts, cut_at_eos
from grpo_companion.lm.steps import (
    MAX_CHARS,
    MAX_LINES,
    WorkedLine,
    rollout_step_rewards,
    step_rewards,
    step_token_ends,
    worked_lines,
)

GOLD = "16+4=20\n20-20=0\n#### 0"


@pytest.mark.parametrize(
    ("completion", "rewards", "ends"),
    [
        (GOLD, [1.0, 1.0, 1.0], [7, 15, 22]),
        ("16+4=21\n21-20=1\n#### 1", [0.0, 0.0, 0.0], [7, 15, 22]),
        # The right answer through a wrong first step: only that step is wrong.
        ("16+4=21\n20-20=0\n#### 0", [0.0, 1.0, 1.0], [7, 15, 22]),
        # A step never written: 0 at the end of the completion.
        ("16+4=20\n#### 0", [1.0, 0.0, 1.0], [7, 14, 14]),
        # No answer line: the outcome at the end of the text.
        ("16+4=20\n20-20=0", [1.0, 1.0, 0.0], [7, 15, 15]),
        # Prose lines are not worked lines; spaces around the terms are allowed.
        ("So:\n 16 + 4 = 20 \nthen\n20-20=0\n#### 0\n", [1.0, 1.0, 1.0], [16, 30, 37]),
        # Worked lines after the answer line do not count.
        ("#### 0\n16+4=20\n20-20=0", [0.0, 0.0, 1.0], [22, 22, 6]),
        # The same numbers in another order are another step.
        ("4+16=20\n20-20=0\n#### 0", [0.0, 1.0, 1.0], [7, 15, 22]),
        ("", [0.0, 0.0, 0.0], [0, 0, 0]),
    ],
)
def test_step_rewards_golden_cases(completion, rewards, ends):
    assert step_rewards(completion, GOLD) == (rewards, ends)


def test_a_reference_without_worked_lines_has_only_the_outcome():
    # GSM8K's own answers are prose with <<...>> annotations, not worked lines.
    gsm8k_answer = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    assert step_rewards("#### 72", gsm8k_answer) == ([1.0], [7])
    assert step_rewards("I think 71", gsm8k_answer) == ([0.0], [10])


def test_worked_lines_parse_each_step_and_its_end():
    assert worked_lines("12*3=36\n36/4=9\n#### 9") == [
        WorkedLine(12, "*", 3, 36, 7),
        WorkedLine(36, "/", 4, 9, 14),
    ]
    assert worked_lines("5-9=-4") == [WorkedLine(5, "-", 9, -4, 6)]
    assert worked_lines("1+1=2=2\n1++1=2\n+1=2\n1+1=\n12345678901+1=2") == []


def test_only_a_capped_prefix_is_read():
    """A megabyte of junk after the answer changes nothing; without an answer, only the first
    MAX_CHARS characters and MAX_LINES worked lines are read."""
    for junk in ("x" * 2**20, "\n1+1=2" * 2**18, "\n" + "9" * 2**20 + "+1=2", "#### 5\n" * 2**17):
        for text in (GOLD, "16+4=21\n20-20=0\n#### 0", "16+4=21\n20-20=0\n#### 5"):
            assert step_rewards(text + "\n" + junk, GOLD) == step_rewards(text, GOLD)
        # A step never written sits at the end of the completion, junk included.
        rewards, ends = step_rewards("16+4=20\n#### 0\n" + junk, GOLD)
        assert (rewards, ends[0], ends[2]) == ([1.0, 0.0, 1.0], 7, 14)
    junk = "1+1=2\n" * 2**18
    assert worked_lines(junk) == worked_lines(junk[:MAX_CHARS])
    assert len(worked_lines(junk)) == MAX_LINES
    long_line = "1" * 2**20 + "+1=2\n16+4=20\n#### 0"
    assert worked_lines(long_line) == []
    assert step_rewards(long_line, GOLD) == ([0.0, 0.0, 1.0], [len(long_line)] * 3)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def test_step_token_ends_name_the_token_of_each_steps_last_character(random_tiny):
    _, tokenizer = random_tiny
    text = "16+4=20\n20-20=0\n#### 0"
    ids = _ids(tokenizer, text)
    _, char_ends = step_rewards(text, GOLD)
    positions = step_token_ends(tokenizer, ids, [*char_ends, 1, 0, 10**6])
    for end, position in zip([*char_ends, 1], positions):
        before, through = (len(tokenizer.decode(ids[:t])) for t in (position, position + 1))
        assert before < end <= through
    assert positions[-2] == 0  # an empty step
    assert positions[2] == positions[-1] == len(ids) - 2  # past the text: its last token


def _rollouts_of(tokenizer, texts: list[str], rewards: list[list[float]]) -> Rollouts:
    """Rollouts holding the given completions (each ended by EOS), without a model."""
    rows = [_ids(tokenizer, text) for text in texts]
    width = max(map(len, rows))
    padded = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])
    completion_ids, completion_mask, lengths, truncated = cut_at_eos(
        padded, [tokenizer.eos_token_id], tokenizer.pad_token_id
    )
    num_prompts, group_size = len(rewards), len(rewards[0])
    return Rollouts(
        prompt_ids=torch.zeros(num_prompts, 1, dtype=torch.long),
        prompt_mask=torch.ones(num_prompts, 1, dtype=torch.long),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        log_probs=None,
        lengths=lengths,
        truncated=truncated,
        texts=tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
        rewards=torch.tensor(rewards),
        num_generations=group_size,
        temperature=1.0,
    )


def test_rollout_step_rewards_stack_the_steps_of_a_batch(random_tiny):
    _, tokenizer = random_tiny
    texts = ["16+4=20\n20-20=0\n#### 0", "16+4=21\n#### 0", "#### 7", "7+1=8"]
    answers = [GOLD, "7+1=8\n#### 8"]  # two worked lines, then one
    # The rollouts' own rewards are the outcome: here a reward_fn that differs from gsm8k.reward.
    rollouts = _rollouts_of(tokenizer, texts, [[0.5, 1.0], [0.0, 0.25]])
    rewards, ends, mask = rollout_step_rewards(tokenizer, rollouts, answers)
    assert rewards.shape == ends.shape == mask.shape == (2, 2, 3)
    assert rewards.tolist() == [[[1, 1, 0.5], [0, 0, 1]], [[0, 0, 0], [1, 0.25, 0]]]
    assert mask.tolist() == [[[True] * 3] * 2, [[True, True, False]] * 2]
    for i, text in enumerate(texts):
        row = ends.view(4, 3)[i]
        n = int(mask.view(4, 3)[i].sum())
        assert row[n - 1] == rollouts.lengths[i] - 1  # the outcome: the completion's last token
        ids = rollouts.completion_ids[i, : rollouts.lengths[i]].tolist()
        char_ends = step_rewards(text, answers[i // 2])[1][: len(worked_lines(text))]
        assert row[: len(char_ends)].tolist() == step_token_ends(tokenizer, ids, char_ends)
    # The step never written is at the completion's end; a last worked line on its own token.
    assert ends[0, 1, 1] == rollouts.lengths[1] - 1
    assert ends[1, 1, 0] == rollouts.lengths[3] - 2 == len(_ids(tokenizer, "7+1=8")) - 2
    with pytest.raises(ValueError, match="one answer per prompt"):
        rollout_step_rewards(tokenizer, rollouts, answers[:1])
