r"""Chapter 7, sections 3-6: everything the chapter measures on one language model at one stage.

`measure` samples M completions per problem, builds the Gram matrix of their length-normalised
score rows in one streaming pass (`lm.streaming_gram`), and reads from it each group candidate
(`groups`), the factorial (`factorial`) and the weight gradients of a few mixed groups
(`lm.gradients.weight_gradient_spectra`). Summaries and the verdict are in `verdict`, the
figures in `plots`.

Chapter: :doc:`/book/07_rank`
"""

import numpy as np
import torch
from torch import Tensor, nn

from grpo_companion.chapters.rank.factorial import factorial_frame
from grpo_companion.chapters.rank.groups import group_gradient_ranks, group_rank_frame
from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.spectra import diagonal_blocks, rank_measures
from grpo_companion.lm import gsm8k
from grpo_companion.lm.gradients import (
    causal_attention_mask,
    representative_matrices,
    weight_gradient_spectra,
)
from grpo_companion.lm.gsm8k import build_prompts, graded_reward
from grpo_companion.lm.rollouts import generate_rollouts
from grpo_companion.lm.scoring import sequence_log_probs
from grpo_companion.lm.steps import ternary_reward
from grpo_companion.lm.streaming_gram import rollout_gram


def group_loss(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
) -> Tensor:
    """One group's on-policy GRPO loss (loss_type "grpo", beta 0) as far as its gradient goes:
    -(1/G) sum_i (A_i / L_i) log pi(y_i | x), L_i the completion's length. At ratio 1 the
    clipped surrogate has exactly this gradient. Inputs as in `scoring.sequence_log_probs`
    (run with `gradients.causal_attention_mask`, as the score rows are)."""
    log_probs = sequence_log_probs(
        model,
        input_ids,
        attention_mask,
        completion_mask,
        causal_mask=causal_attention_mask(attention_mask, model.dtype),
    ).sum(dim=1)
    lengths = completion_mask.sum(dim=1).clamp(min=1)
    return -(advantages.to(log_probs.dtype) / lengths * log_probs).mean()


def measure(
    model: nn.Module,
    tokenizer,
    spec: dict,
    stage: str,
    problems,
    *,
    group_sizes: list[int],
    temperature: float = 1.0,
    method: str = "grpo",
    seed: int,
) -> dict:
    """Everything chapter 7 measures on one language model at one stage.

    `spec` is one of the chapter's `language_models` (name, max_completion_length,
    reward_mode, weight_gradient_groups); `problems` rows with "question" and "answer". Each
    problem gets max(group_sizes) = M completions (`rollouts.generate_rollouts`, seeded
    `seed`); `rollout_gram` gives the Gram matrix of their length-normalised score rows. Three
    rewards `(B, M)`: "binary" (`gsm8k.reward` in `spec["reward_mode"]`), "graded"
    (`graded_reward`) and "uniform" (U(0, 1) draws seeded `seed`). Returns a dict:

        frames       `group_rank_frame`s of each reward (columns model, stage, reward added)
        cross        `group_gradient_ranks` rows of each reward
        weights      rank measures of the weight gradients (`weight_gradient_spectra`) of
                     `representative_matrices`, for the first `weight_gradient_groups` groups
                     with mixed binary rewards at each G (graded where no binary group is mixed)
        spectra      {(G, matrix name): singular values} of those weight gradients
        matrices     the names of `representative_matrices`
        factorial    `factorial_frame` of the binary and the ternary reward (`ternary_reward`),
                     columns model and stage added: a reweighting of the same Gram matrix
    and the fraction of problems with mixed binary rewards (mixed_binary), the mean binary
    reward (mean_binary) and the mean number of completion tokens (tokens).
    """
    num_samples = max(group_sizes)
    prompts, golds = build_prompts(tokenizer, problems)
    rollouts = generate_rollouts(
        model,
        tokenizer,
        prompts,
        golds,
        num_generations=num_samples,
        max_completion_length=spec["max_completion_length"],
        temperature=temperature,
        seed=seed,
        batch_size=num_samples * 4,
        reward_fn=lambda text, gold: gsm8k.reward(text, gold, mode=spec["reward_mode"]),
        compute_log_probs=False,  # rollout_gram and group_loss take their own, with gradients
    )
    gram = rollout_gram(model, rollouts)
    answers = np.repeat(golds, num_samples)
    rewards = {
        "binary": rollouts.rewards.double().cpu(),
        "graded": torch.tensor(
            [graded_reward(t, g) for t, g in zip(rollouts.texts, answers)], dtype=torch.float64
        ).view(-1, num_samples),
        "uniform": torch.rand(
            rollouts.rewards.shape,
            dtype=torch.float64,
            generator=torch.Generator().manual_seed(seed),
        ),
    }
    gram = gram.cpu()
    labels = {"model": spec["name"], "stage": stage}
    frames, cross = [], []
    for reward, values in rewards.items():
        frame = group_rank_frame(diagonal_blocks(gram, num_samples), values, group_sizes, method)
        frames.append(frame.assign(**labels, reward=reward))
        cross += [
            {**labels, "reward": reward, **row}
            for row in group_gradient_ranks(gram, values, group_sizes, method)
        ]
    ternary = torch.tensor(
        [
            ternary_reward(t, a, spec["reward_mode"])
            for t, a in zip(rollouts.texts, np.repeat(problems["answer"], num_samples))
        ],
        dtype=torch.float64,
    ).view(-1, num_samples)
    factorial = factorial_frame(
        diagonal_blocks(gram, num_samples),
        {"binary": rewards["binary"], "ternary": ternary},
        group_sizes,
    ).assign(**labels)
    used = "binary" if (rewards["binary"].std(dim=1) > 0).any() else "graded"
    names = representative_matrices(model)
    weight_rows, spectra = [], {}
    for size, rows in _weight_gradient_groups(
        rewards[used], group_sizes, spec["weight_gradient_groups"]
    ):
        advantages = group_advantages(rewards[used].flatten()[rows][None], method)[0]
        loss = group_loss(
            model,
            rollouts.input_ids[rows],
            rollouts.attention_mask[rows],
            rollouts.completion_mask[rows],
            advantages.to(model.device),
        )
        for name, sigma in weight_gradient_spectra(model, loss, names).items():
            spectra[(size, name)] = sigma.cpu()
            weight_rows.append(
                {
                    **labels,
                    "reward": used,
                    "matrix": name,
                    "group_size": size,
                    "mixed": True,
                    "tokens": int(rollouts.attention_mask[rows].sum()),
                    **{k: v.item() for k, v in rank_measures(sigma.cpu()).items()},
                }
            )
    return {
        "frames": frames,
        "cross": cross,
        "weights": weight_rows,
        "spectra": spectra,
        "matrices": names,
        "factorial": factorial,
        "mixed_binary": (rewards["binary"].std(dim=1) > 0).double().mean().item(),
        "mean_binary": rewards["binary"].mean().item(),
        "tokens": rollouts.completion_mask.sum(dim=1).double().mean().item(),
    }


def _weight_gradient_groups(rewards: Tensor, group_sizes: list[int], per_size: int):
    """(G, rows) of the first `per_size` groups of each G with mixed rewards, `rewards: (B, M)`
    prompt-major, groups consecutive within a prompt; rows a slice of the flattened rollouts."""
    num_samples = rewards.shape[1]
    for size in group_sizes:
        taken = 0
        for start in range(0, rewards.numel(), size):
            prompt, offset = divmod(start, num_samples)
            if offset + size > num_samples or taken == per_size:
                continue
            if rewards[prompt, offset : offset + size].std() == 0:
                continue
            taken += 1
            yield size, slice(start, start + size)
