r"""Step-level (process) rewards of worked arithmetic answers, and where each step ends.

A worked answer is a few lines ``a+b=c`` (or ``-``, ``*``, ``/``), one per step, then
``#### N``. Process supervision (DeepSeekMath, Shao et al. 2024, sec. 4.1.3) rewards each step
where it ends; here a step is right when the completion writes the reference solution's line
for that step exactly:

    step j  (j = 1..k, one per worked line of the reference)   1.0 iff the completion's j-th
            worked line is the reference's j-th, at the end of that line; 0.0 at the end of the
            completion if it wrote fewer than j worked lines;
    final   the outcome reward (`gsm8k.reward`), at the end of the completion's "#### N" line
            (or at the end of the text if there is none).

A worked line is a line that is nothing but ``a op b = c`` (integers, spaces allowed), before
the answer line; other lines are skipped, so prose between the steps neither helps nor hurts.
Model output is untrusted: nothing is evaluated, and only the first `MAX_CHARS` characters and
`MAX_LINES` lines are read for worked lines (the answer itself is found by the linear-time
search of `gsm8k.reward`), so a megabyte of junk costs no more than a normal answer.

`step_token_ends` maps character offsets to token positions, and `rollout_step_rewards` gives a
batch of rollouts' step rewards as the tensors `advantages.process_advantages` takes.
"""

import functools
import re
from bisect import bisect_right
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_companion.lm import gsm8k

MAX_CHARS = 4096  # of a completion, searched for worked lines
MAX_LINES = 64  # worked lines read at most; a reference has a handful
# Numbers of at most 9 digits: a longer one is no step of these problems, and int() of a
# bounded string is cheap.
_NUMBER, _BLANK = "([0-9]{1,9})", "[ \t]*"
_WORKED = re.compile(
    _BLANK + _NUMBER + _BLANK + "([-+*/])" + _BLANK + _NUMBER + _BLANK + "=" + _BLANK
    + "(-?[0-9]{1,9})" + _BLANK
)  # fmt: skip


@dataclass(frozen=True)
class WorkedLine:
    """One parsed step: ``a op b = c``, and the character offset just after its last character."""

    a: int
    op: str
    b: int
    c: int
    end: int


def worked_lines(text: str) -> list[WorkedLine]:
    """The worked lines of `text` before its answer line, in order (see the module docstring).

    Reads at most the first `MAX_CHARS` characters and returns at most `MAX_LINES` lines.
    """
    answer = gsm8k.answer_span(text[:MAX_CHARS])
    head = text[: MAX_CHARS if answer is None else answer[0]]
    found, start = [], 0
    for line in head.split("\n"):
        match = _WORKED.fullmatch(line)
        if match:
            a, op, b, c = match.groups()
            found.append(WorkedLine(int(a), op, int(b), int(c), start + len(line.rstrip(" \t"))))
            if len(found) == MAX_LINES:
                break
        start += len(line) + 1
    return found


def step_rewards(
    completion: str, answer_field: str, mode: str = "strict"
) -> tuple[list[float], list[int]]:
    """Rewards of the k worked steps of the reference `answer_field` and of the outcome.

    Args:
        completion: the model's text (untrusted).
        answer_field: a GSM8K-schema answer, worked lines then ``#### N`` (trusted). One
            without worked lines (the real GSM8K's, whose lines are prose) has only the outcome.
        mode: of the outcome reward, as `gsm8k.reward`.

    Returns:
        rewards, ends: k + 1 each; ends[j] is the character offset just after the last
        character of step j in `completion` (``len(completion)`` for a step it never wrote).
    """
    reference = [(line.a, line.op, line.b, line.c) for line in worked_lines(answer_field)]
    written = worked_lines(completion)
    rewards, ends = [], []
    for j, step in enumerate(reference):
        if j < len(written):
            line = written[j]
            rewards.append(float((line.a, line.op, line.b, line.c) == step))
            ends.append(line.end)
        else:
            rewards.append(0.0)
            ends.append(len(completion))
    answer = gsm8k.answer_span(completion)
    rewards.append(gsm8k.reward(completion, gsm8k.gold_answer(answer_field), mode))
    ends.append(len(completion) if answer is None else answer[1])
    return rewards, ends


def ternary_reward(completion: str, answer_field: str, mode: str = "strict") -> float:
    """1 for a right answer (`gsm8k.reward` in `mode`), 1/2 for a wrong one whose first worked
    line is the reference's (`step_rewards`: partial progress), 0 otherwise.
    `answer_field`: the problem's GSM8K-schema answer, worked lines then "#### N"; one without
    worked lines (the real GSM8K's prose) gives no middle level."""
    rewards, _ = step_rewards(completion, answer_field, mode)
    if rewards[-1] == 1:
        return 1.0
    return 0.5 if len(rewards) > 1 and rewards[0] == 1 else 0.0


def step_token_ends(tokenizer, completion_ids: list[int], char_ends: list[int]) -> list[int]:
    """The index of the token that holds the last character before each of `char_ends`.

    completion_ids: one completion's tokens (special tokens are decoded to nothing, as in
    ``Rollouts.texts``); char_ends: offsets into its decoded text. Works with any tokenizer:
    token t holds the characters between the lengths of the decoded prefixes of t and t + 1
    tokens (exact where decoding a prefix gives a prefix of the text, as for the tiny Llama's
    tokenizer; byte-level BPE may differ inside a multi-byte character). An offset of 0 (an
    empty step) gives token 0; one past the end of the text counts as the end of the text.
    """
    if not completion_ids:
        raise ValueError("a completion has at least one token")
    prefixes = [completion_ids[: t + 1] for t in range(len(completion_ids))]
    decoded = tokenizer.batch_decode(prefixes, skip_special_tokens=True)
    lengths, longest = [], 0
    for text in decoded:  # made non-decreasing: a prefix may decode shorter mid-character
        longest = max(longest, len(text))
        lengths.append(longest)
    return [bisect_right(lengths, min(end, lengths[-1]) - 1) if end > 0 else 0 for end in char_ends]


def written_steps(completion: str, answer_field: str, mode: str = "strict"):
    """`step_rewards` of a completion, and how many of its steps it wrote (worked lines, at most
    the reference's): the function of `rollout_step_rewards`' ``steps_of``."""
    rewards, ends = step_rewards(completion, answer_field, mode)
    return rewards, ends, min(len(worked_lines(completion)), len(rewards) - 1)


def rollout_step_rewards(
    tokenizer, rollouts, answers: list[str], mode: str = "strict", steps_of=None
) -> tuple[Tensor, Tensor, Tensor]:
    """Step rewards of a batch of rollouts, for `advantages.process_advantages`.

    rollouts: `rollouts.Rollouts` of B prompts and G completions each; answers: B reference
    answer fields, one per prompt. steps_of: ``steps_of(completion, answer) -> (rewards, ends,
    written)`` as `written_steps` (the default, the arithmetic problems' worked lines), for a
    task whose steps are written otherwise (`micro.written_steps`). A written step sits on the
    token of its line's last character (`step_token_ends`); a step never written on the
    completion's last token (its EOS, if any): the end of the completion. The final step's
    reward is the rollout's own reward (``rollouts.rewards``, the trainer's reward_fn), and it
    too sits on the last token rather than on the end of the answer line: the end of the
    episode is where an outcome reward is given, so the tokens after the answer (the EOS) get
    the outcome's credit as under outcome GRPO, and with no worked steps process credit is
    outcome credit exactly.

    Returns:
        step_rewards (B, G, S) float, step_ends (B, G, S) long token index, step_mask
        (B, G, S) bool: S = 1 + the most worked lines of a reference; a prompt whose reference
        has fewer lines leaves the rest of its steps masked.
    """
    num_prompts, group_size = rollouts.rewards.shape
    if len(answers) != num_prompts:
        raise ValueError(f"need one answer per prompt: {num_prompts}, got {len(answers)}")
    if steps_of is None:
        steps_of = functools.partial(written_steps, mode=mode)
    per_rollout = [
        steps_of(text, answers[i // group_size]) for i, text in enumerate(rollouts.texts)
    ]
    num_steps = max(len(rewards) for rewards, _, _ in per_rollout)
    shape = (num_prompts * group_size, num_steps)
    device = rollouts.rewards.device
    rewards = torch.zeros(shape, dtype=rollouts.rewards.dtype, device=device)
    ends = torch.zeros(shape, dtype=torch.long, device=device)
    mask = torch.zeros(shape, dtype=torch.bool, device=device)
    outcomes = rollouts.rewards.flatten()
    for i, (step_values, char_ends, written) in enumerate(per_rollout):
        length = int(rollouts.lengths[i])
        ids = rollouts.completion_ids[i, :length].tolist()
        n = len(step_values)
        positions = step_token_ends(tokenizer, ids, char_ends[:written])
        positions += [length - 1] * (n - written)  # the steps never written, then the outcome
        rewards[i, :n] = torch.tensor(step_values[:-1] + [0.0], dtype=rewards.dtype)
        rewards[i, n - 1] = outcomes[i]
        ends[i, :n] = torch.tensor(positions)
        mask[i, :n] = True
    view = (num_prompts, group_size, num_steps)
    return rewards.view(view), ends.view(view), mask.view(view)
