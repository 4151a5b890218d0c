r"""Chapter 4, the language-model testbed: what the chapter shows of `grpo_companion.lm`.

The testbed itself is `lm/`: problems and the binary reward (`gsm8k`), the policy (`models`),
rollouts (`rollouts`) and the GRPO trainer (`trainer`). This module only turns what they
return into the chapter's tables and figures:

    source_examples        one problem of each offline data source
    reward_table           lm-evaluation-harness's strict and flexible answers of some texts
    warm_start_summary     the tiny Llama's warm start, from its cached report
    plot_warm_start        its training loss and validation accuracy
    first_mixed_group      which group of a batch to show: the first with mixed rewards
    group_table            one group's completions, rewards and advantages
"""

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from torch import Tensor

from grpo_companion.core.advantages import zero_std_groups
from grpo_companion.lm.gsm8k import extract_answer, load_gsm8k, reward
from grpo_companion.lm.rollouts import Rollouts

# Completions that show where the two answer extractions agree and differ (gold 42).
EXAMPLE_COMPLETIONS = (
    "6*7=42\n#### 42",
    "6*7=42\n#### 42.0",
    "6*7=42\n#### 41\n#### 42",
    "6*7 is 42",
    "6*7=42\n#### 4,2",
    "#### 42 apples, or 43",
)


def source_examples(sources=("arithmetic", "gsm_symbolic"), *, seed: int) -> pd.DataFrame:
    """The first training problem of each source (`gsm8k.load_gsm8k`), one row per source:
    question and worked answer."""
    rows = [load_gsm8k("train", source=source, num_examples=1, seed=seed)[0] for source in sources]
    return pd.DataFrame(rows, index=pd.Index(sources, name="source"))


def reward_table(completions=EXAMPLE_COMPLETIONS, gold: str = "42") -> pd.DataFrame:
    """For each completion: the strict and flexible answers (`gsm8k.extract_answer`; "(none)"
    when there is none) and the reward each match gives against `gold`."""
    return pd.DataFrame(
        {
            "completion": list(completions),
            **{
                f"{mode} answer": [extract_answer(text, mode) or "(none)" for text in completions]
                for mode in ("strict", "flexible")
            },
            **{
                f"{mode} reward": [reward(text, gold, mode=mode) for text in completions]
                for mode in ("strict", "flexible")
            },
        }
    )


def warm_start_summary(report: dict) -> dict:
    """The numbers of a warm start's report (`tiny_llama.warm_start_report`) that the chapter
    quotes: steps taken, seconds, held-out accuracy and the target it stopped at."""
    return {
        "warm_start_steps": report["steps"],
        "warm_start_max_steps": report["spec"]["train_steps"],
        "warm_start_seconds": report["seconds"],
        "warm_start_held_out_accuracy": report["held_out_accuracy"],
        "warm_start_target_accuracy": report["spec"]["target_accuracy"],
        "warm_start_validation_problems": report["spec"]["num_validation_examples"],
    }


def plot_warm_start(report: dict) -> plt.Figure:
    """Training loss per step, and the greedy validation accuracy against the target."""
    fig, (loss_ax, accuracy_ax) = plt.subplots(1, 2, figsize=(10, 3.6))
    losses = np.asarray(report["losses"])
    steps = np.arange(1, len(losses) + 1)
    loss_ax.plot(steps, losses, color="C0", alpha=0.3)
    window = max(1, len(losses) // 30)
    smooth = pd.Series(losses).rolling(window, min_periods=1).mean()
    loss_ax.plot(steps, smooth, color="C0", label=f"mean over {window} steps")
    loss_ax.set(title="warm start: cross-entropy of the answers", xlabel="step", yscale="log")
    loss_ax.legend(fontsize="x-small")
    validation = np.asarray(report["validation"], dtype=float).reshape(-1, 2)
    accuracy_ax.plot(validation[:, 0], validation[:, 1], "o-", color="C3", label="validation")
    accuracy_ax.axhline(report["spec"]["target_accuracy"], color="gray", ls="--", label="target")
    accuracy_ax.set(
        title="greedy accuracy", xlabel="step", ylim=(0, 1), xlim=(0, max(1, len(losses)))
    )
    accuracy_ax.legend(fontsize="x-small")
    fig.tight_layout()
    return fig


def first_mixed_group(rewards: Tensor) -> int:
    """Index of the first group whose rewards are not all equal, or 0 if there is none.

    rewards: (num_groups, group_size).
    """
    return int((~zero_std_groups(rewards)).int().argmax())


def group_table(rollouts: Rollouts, advantages: Tensor, group: int) -> pd.DataFrame:
    """The completions of one group with their lengths (tokens), rewards and advantages.

    advantages: (num_groups, group_size), as `advantages.group_advantages` returns them.
    """
    size = rollouts.num_generations
    members = slice(group * size, (group + 1) * size)
    return pd.DataFrame(
        {
            "completion": rollouts.texts[members],
            "tokens": rollouts.lengths[members].tolist(),
            "reward": rollouts.rewards[group].tolist(),
            "advantage": advantages[group].tolist(),
        }
    ).round(3)
