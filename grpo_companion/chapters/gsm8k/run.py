r"""Chapter 11, GRPO on GSM8K-style problems: what the chapter computes.

The policy, data, reward and trainer are the testbed's (`grpo_companion.lm`, chapter 4). This
module holds what chapter 11 measures with them:

    held_out_problems     the evaluation problems: the test split, or training-split problems
                          that neither GRPO nor the tiny Llama's warm start has seen
    batch_gradients       the gradients of independent batches at one policy, and
    gradient_signal       how much of a batch gradient is signal (the signal fraction phi of
                          section 2, estimated from the batches' mean and mean square)
    held_out_outcomes     greedy and sampled accuracy per held-out problem
    paired_sampled_gain   before vs after on the same problems: paired t-test
    paired_greedy_gain    the same for greedy answers: McNemar's exact test
    training_summary      training metrics averaged over the first and last steps

Whether sparsity intensifies over the run is `grpo_companion.chapters.gsm8k.sparsity`.
Figures: plot_gradient_cosines, plot_learning_curves, plot_before_after.

Chapter: :doc:`/book/11_gsm8k`
"""

from dataclasses import replace

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from scipy import stats

from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.gsm8k import build_prompts, extract_answer, gold_answer, load_gsm8k, reward
from grpo_companion.lm.rollouts import generate_rollouts, greedy_completions
from grpo_companion.lm.tiny_llama import TinyLlamaSpec
from grpo_companion.lm.trainer import grpo_step


def num_seen_problems(model_name: str, spec: TinyLlamaSpec, num_train_prompts: int) -> int:
    """How many of the training split's first problems some training of the chapter has seen:
    GRPO's `num_train_prompts`, and for the tiny Llama those its warm start trains or stops on."""
    warm_start = spec.num_train_split_problems if model_name == "tiny-llama" else 0
    return max(num_train_prompts, warm_start)


def held_out_problems(
    eval_split: str,
    *,
    source: str,
    num_examples: int,
    seed: int,
    validation_start: int,
    num_seen: int,
):
    """The test split, or training-split problems that no training in the chapter has seen.

    eval_split: "test" (the test split's first `num_examples` problems), or "validation"
    (`num_examples` training-split problems from index `validation_start` on, for choosing
    hyperparameters without looking at the test split; refused if they would overlap the
    first `num_seen` problems, see `num_seen_problems`).
    """
    if eval_split == "test":
        return load_gsm8k("test", source=source, num_examples=num_examples, seed=seed)
    if eval_split != "validation":
        raise ValueError(f"eval_split must be 'test' or 'validation', got {eval_split!r}")
    if validation_start < num_seen:
        raise ValueError(
            f"validation_start={validation_start} overlaps the {num_seen} training-split "
            "problems that GRPO or the warm start trains or stops on"
        )
    return load_gsm8k(
        "train", source=source, num_examples=num_examples, skip=validation_start, seed=seed
    )


def batch_gradients(
    model, tokenizer, prompts, golds, config: GRPOConfig, num_batches: int, reward_fn=reward
):
    """(num_batches, num_parameters) float64: the gradient of `trainer.grpo_step` on the
    batches of steps 1..num_batches, all at the current policy.

    Each step runs through an AdamW whose learning rate is 0, so it changes no weight and the
    gradient (clipped to ``config.max_grad_norm``, as the step clips it) stays in ``.grad``.
    beta is set to 0: the KL term's gradient is 0 at the reference itself, so the gradient is
    the same without a reference copy. The gradients are cleared afterwards.
    """
    frozen = torch.optim.AdamW(model.parameters(), lr=0.0)
    gradients = []
    for step in range(1, num_batches + 1):
        grpo_step(
            model,
            tokenizer,
            None,
            frozen,
            prompts,
            golds,
            replace(config, beta=0.0),
            step,
            reward_fn,
        )
        gradients.append(torch.cat([parameter.grad.flatten() for parameter in model.parameters()]))
    gradients = torch.stack(gradients).double()
    model.zero_grad(set_to_none=True)
    return gradients


def gradient_signal(gradients) -> dict:
    """How much independent batch gradients agree.

    gradients: (K, num_parameters) float64, K >= 2 (`batch_gradients`). Returns cosines (K, K)
    between them; mean_gradient_cosine, the mean over the K (K - 1) / 2 pairs; and
    signal_fraction, the estimate (Gamma - 1/K) / (1 - 1/K) with
    Gamma = ||mean g||^2 / mean ||g_k||^2 (chapter 11, section 2), clipped at 0 (numerator and
    denominator of Gamma are unbiased, Gamma itself is not).
    """
    num_batches = gradients.shape[0]
    if num_batches < 2:
        raise ValueError(f"comparing batch gradients needs at least 2, got {num_batches}")
    # A batch whose groups are all degenerate has a zero gradient: give it cosine 0, not 0 / 0.
    directions = gradients / gradients.norm(dim=1, keepdim=True).clamp(min=1e-30)
    cosines = (directions @ directions.T).numpy()
    mean_square = gradients.norm(dim=1).pow(2).mean().clamp(min=1e-30)
    ratio = (gradients.mean(0).norm() ** 2 / mean_square).item()
    return {
        "cosines": cosines,
        "signal_fraction": max(0.0, (ratio - 1 / num_batches) / (1 - 1 / num_batches)),
        "mean_gradient_cosine": cosines[np.triu_indices(num_batches, 1)].mean(),
    }


def greedy_outcomes(model, tokenizer, problems, *, max_completion_length: int, batch_size: int):
    """Per-problem greedy reward (n,) and completion: what the trainer's accuracy averages."""
    rewards, completions = greedy_completions(
        model,
        tokenizer,
        *build_prompts(tokenizer, problems),
        max_completion_length=max_completion_length,
        batch_size=batch_size,
    )
    return np.array(rewards), completions


def sampled_pass_rates(
    model,
    tokenizer,
    problems,
    *,
    num_samples: int,
    max_completion_length: int,
    temperature: float,
    seed: int,
    batch_size: int,
):
    """Per-problem fraction (n,) of `num_samples` completions sampled at `temperature` that
    are right: the expected reward that GRPO maximises, on problems it did not train on."""
    rollouts = generate_rollouts(
        model,
        tokenizer,
        *build_prompts(tokenizer, problems),
        num_generations=num_samples,
        max_completion_length=max_completion_length,
        temperature=temperature,
        seed=seed,
        batch_size=batch_size,
        compute_log_probs=False,  # only the rewards are read
    )
    return rollouts.rewards.double().mean(dim=1).numpy()


def held_out_outcomes(model, tokenizer, problems, config: GRPOConfig, num_samples: int) -> dict:
    """greedy (n,) rewards and their completions, and sampled (n,) pass rates of
    `num_samples` completions, with the completion length, temperature and batch size of
    `config`. The sampler's seed is ``config.seed + 1`` whenever this is called: before and
    after training the same random numbers (common random numbers make the paired
    difference less noisy)."""
    greedy, completions = greedy_outcomes(
        model,
        tokenizer,
        problems,
        max_completion_length=config.max_completion_length,
        batch_size=config.rollout_batch_size,
    )
    sampled = sampled_pass_rates(
        model,
        tokenizer,
        problems,
        num_samples=num_samples,
        max_completion_length=config.max_completion_length,
        temperature=config.temperature,
        seed=config.seed + 1,
        batch_size=config.rollout_batch_size,
    )
    return {"greedy": greedy, "completions": completions, "sampled": sampled}


def paired_sampled_gain(before, after) -> dict:
    """Sampled accuracy before and after, (n,) each on the same problems: their means, the
    mean paired difference, its standard error, and the paired t-test's two-sided p-value
    (1 when nothing changed, where the test is undefined)."""
    before, after = np.asarray(before), np.asarray(after)
    differences = after - before
    p_value = stats.ttest_rel(after, before).pvalue if differences.any() else 1.0
    return {
        "sampled_accuracy_before": before.mean(),
        "sampled_accuracy_after": after.mean(),
        "sampled_accuracy_gain": differences.mean(),
        "sampled_accuracy_gain_standard_error": differences.std(ddof=1) / np.sqrt(len(differences)),
        "sampled_accuracy_gain_p_value": p_value,
    }


def paired_greedy_gain(before, after) -> dict:
    """Greedy rewards (n,) of 0 and 1 before and after, on the same problems.

    Counts the problems fixed (0 -> 1) and broken (1 -> 0). If training changed nothing, a
    changed problem is as likely to go one way as the other: McNemar's exact test is the
    two-sided binomial test of `fixed` out of `fixed + broken` at 1/2 (p = 1 when none
    changed). The gain (fixed - broken) / n has the standard error of a difference of two
    proportions measured on the same problems, sqrt(f + b - (f - b)^2 / n) / n.
    """
    before, after = np.asarray(before), np.asarray(after)
    fixed = int(((before == 0) & (after == 1)).sum())
    broken = int(((before == 1) & (after == 0)).sum())
    n = len(before)
    return {
        "accuracy_before": before.mean(),
        "accuracy_after": after.mean(),
        "accuracy_gain": (fixed - broken) / n,
        "accuracy_gain_standard_error": np.sqrt(fixed + broken - (fixed - broken) ** 2 / n) / n,
        "problems_fixed": fixed,
        "problems_broken": broken,
        "mcnemar_p_value": stats.binomtest(fixed, fixed + broken).pvalue if fixed + broken else 1.0,
    }


def history_frame(history: list[dict]) -> pd.DataFrame:
    """A `trainer.train` history as a float table indexed by step (None becomes NaN)."""
    return pd.DataFrame(history).set_index("step").astype(float)


def reward_window(max_steps: int) -> int:
    """Steps averaged at the start and the end of training: a tenth of them, at least one."""
    return max(1, max_steps // 10)


def training_summary(frame: pd.DataFrame, window: int, beta: float) -> dict:
    """Training reward and group fractions averaged over the first `window` steps (after the
    row of step 0, which holds only the initial accuracy) and the last `window`; the final KL
    to the initial policy (0 when beta = 0, where it is not measured).

    frame: `history_frame` of a run.
    """
    first, last = frame.iloc[1 : 1 + window], frame.iloc[-window:]
    summary = {"reward_window": window}
    for name, column in (
        ("train_reward", "reward"),
        ("zero_std", "frac_reward_zero_std"),
        ("all_correct", "all_correct"),
    ):
        summary[f"{name}_first"] = first[column].mean()
        summary[f"{name}_last"] = last[column].mean()
    summary["kl_last"] = frame["kl"].iloc[-1] if beta > 0 else 0.0
    return summary


def changed_problems(problems, before, after, limit: int = 6) -> pd.DataFrame:
    """The first `limit` problems whose greedy reward changed, with the gold answer and the
    completions before and after; before and after are `held_out_outcomes` dicts."""
    changed = np.flatnonzero(before["greedy"] != after["greedy"])[:limit]
    return pd.DataFrame(
        {
            "gold": [gold_answer(problems[int(i)]["answer"]) for i in changed],
            "before": [before["completions"][i] for i in changed],
            "after": [after["completions"][i] for i in changed],
        },
        index=changed,
    )


def flexible_accuracy(texts: list[str], golds) -> float:
    """Mean reward of `texts` under lm-evaluation-harness's flexible match (the last number)."""
    return float(np.mean([reward(text, gold, mode="flexible") for text, gold in zip(texts, golds)]))


def sample_summary(rollouts, golds: list[str]) -> dict:
    """Strict and flexible mean reward, truncated fraction and count of a batch of rollouts
    whose prompts have the gold answers `golds` (one per prompt)."""
    per_completion = np.repeat(golds, rollouts.num_generations)
    return {
        "strict_reward": rollouts.rewards.mean().item(),
        "flexible_reward": flexible_accuracy(rollouts.texts, per_completion),
        "truncated_fraction": rollouts.truncated.double().mean().item(),
        "num_completions": len(rollouts.texts),
    }


def answer_table(rollouts, golds: list[str]) -> pd.DataFrame:
    """Per completion: the gold, the strict and flexible answers, tokens, truncated."""
    return pd.DataFrame(
        {
            "gold": np.repeat(golds, rollouts.num_generations),
            "strict answer": [extract_answer(text) for text in rollouts.texts],
            "flexible answer": [extract_answer(text, "flexible") for text in rollouts.texts],
            "tokens": rollouts.lengths.tolist(),
            "truncated": rollouts.truncated.tolist(),
        }
    )


# --- figures ---------------------------------------------------------------------------


def plot_gradient_cosines(cosines) -> plt.Figure:
    """Heatmap of the cosines (K, K) between the gradients of the batches of steps 1..K."""
    num_batches = len(cosines)
    fig, ax = plt.subplots(figsize=(4.4, 3.6))
    image = ax.imshow(cosines, vmin=-1, vmax=1, cmap="RdBu_r")
    ticks = range(num_batches)
    labels = range(1, num_batches + 1)
    ax.set(
        title="cosine between batch gradients",
        xlabel="step of the batch",
        ylabel="step of the batch",
        xticks=ticks,
        yticks=ticks,
        xticklabels=labels,
        yticklabels=labels,
    )
    ax.grid(False)
    fig.colorbar(image)
    return fig


def plot_learning_curves(frame: pd.DataFrame, window: int, config) -> plt.Figure:
    """Six panels of a `history_frame`: reward and held-out accuracy, group kinds,
    entropy, KL and clipping, gradient norm, completion lengths and truncation.

    window: steps of the reward's moving average; config: the run's `config.GRPOConfig`
    (its beta, num_iterations and max_completion_length label the panels).
    """
    fig, axes = plt.subplots(2, 3, figsize=(13, 7), sharex=True)
    steps = frame.index
    ax = axes[0, 0]
    ax.plot(steps, frame["reward"], color="C0", alpha=0.35, label="training reward (sampled)")
    ax.plot(
        steps,
        frame["reward"].rolling(window, min_periods=1).mean(),
        color="C0",
        label=f"its mean over {window} steps",
    )
    evaluated = frame["eval_accuracy"].dropna()
    ax.plot(evaluated.index, evaluated, "o-", color="C3", label="held-out accuracy (greedy)")
    ax.set(title="reward and accuracy", ylim=(0, 1))
    ax.legend(fontsize="x-small")
    ax = axes[0, 1]
    ax.stackplot(
        steps,
        frame["all_correct"],
        1 - frame["frac_reward_zero_std"],
        frame["all_wrong"],
        labels=["all correct", "mixed", "all wrong"],
        colors=["C2", "C7", "C3"],
        alpha=0.7,
    )
    ax.set(title="groups (zero std = all correct + all wrong)", ylim=(0, 1))
    ax.legend(fontsize="x-small", loc="lower left")
    axes[0, 2].plot(steps, frame["entropy"], color="C4")
    axes[0, 2].set(title="entropy (nats per completion token)")
    axes[1, 0].plot(steps, frame["kl"], color="C5", label=r"KL to the initial policy ($k_3$)")
    axes[1, 0].plot(steps, frame["clip_ratio/region_mean"], color="C0", ls="--", label="clip ratio")
    axes[1, 0].set(
        title=f"KL and clipping (beta = {config.beta}, num_iterations = {config.num_iterations})"
    )
    axes[1, 0].legend(fontsize="x-small")
    axes[1, 1].plot(steps, frame["grad_norm"], color="C1")
    axes[1, 1].set(title="gradient norm (before clipping)")
    ax = axes[1, 2]
    ax.plot(steps, frame["completions/mean_length"], color="C0", label="mean")
    ax.plot(steps, frame["completions/max_length"], color="C0", ls=":", label="max")
    ax.axhline(config.max_completion_length, color="gray", lw=0.8)
    ax.set(title="completion length (tokens) and truncation")
    ax.legend(fontsize="x-small", loc="lower left")
    truncated = ax.twinx()
    truncated.plot(steps, frame["completions/clipped_ratio"], color="C3", alpha=0.6)
    truncated.set(ylabel="truncated fraction", ylim=(0, 1))
    truncated.grid(False)
    for ax in axes[1]:
        ax.set(xlabel="step")
    fig.tight_layout()
    return fig


def plot_before_after(sampled_before, sampled_after, num_samples: int, seed: int) -> plt.Figure:
    """Each held-out problem's sampled accuracy after training against before, (n,) each,
    jittered (seeded) so that problems at the same values stay visible."""
    n = len(sampled_before)
    fig, ax = plt.subplots(figsize=(5, 4.2))
    jitter = np.random.default_rng(seed).uniform(-0.015, 0.015, size=(2, n))
    ax.scatter(sampled_before + jitter[0], sampled_after + jitter[1], s=12, alpha=0.5)
    ax.plot([0, 1], [0, 1], color="gray", lw=0.8)
    ax.set(
        xlabel="sampled accuracy before training",
        ylabel="after training",
        title=f"{n} held-out problems, {num_samples} samples each",
        xlim=(-0.05, 1.05),
        ylim=(-0.05, 1.05),
    )
    return fig
