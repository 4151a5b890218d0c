r"""Chapter 7, section 6: what makes the 2, the number of reward levels or zero-sum advantages.

The factorial crosses the reward (binary; ternary: 1 right, 1/2 a near miss, 0) with the
advantage (grpo, zero-sum; sign, A = 2r - 1, not zero-sum) and measures S, diag(A) S and the
level sums C S by three rank measures. Each cell reweights the same Gram matrix K = S S^T:
diag(A) K diag(A) and C K C^T; the null model replaces K by the identity (orthogonal score rows
of equal norm).

Chapter: :doc:`/book/07_rank`
"""

import pandas as pd
import torch
from torch import Tensor

from grpo_companion.chapters.rank.groups import disjoint_groups, reward_levels
from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.policy_gradient import SequencePolicy, sum_mod_reward
from grpo_companion.core.spectra import (
    gram_singular_values,
    mixed_gram,
    rank_measures,
    weighted_gram,
)

FACTORIAL_REWARDS = ("binary", "ternary")
FACTORIAL_ADVANTAGES = ("grpo", "sign")
FACTORIAL_MEASURES = ("entropy", "stable", "energy_90")


def near_miss_reward(policy: SequencePolicy) -> Tensor:
    """The sequence policy's ternary reward, `(num_sequences,)` float64: 1 when the last token
    is the sum of the others mod V (`sum_mod_reward`), 1/2 when it is that sum plus one (a
    near miss, the analogue of a wrong answer with a right first step), 0 otherwise."""
    sequences = policy.all_sequences()
    answer = sequences[:, :-1].sum(dim=1) % policy.vocab_size
    near = sequences[:, -1] == (answer + 1) % policy.vocab_size
    return sum_mod_reward(sequences, policy.vocab_size) + 0.5 * near.double()


def factorial_advantages(rewards: Tensor, advantage: str) -> Tensor:
    """`rewards: (..., G)` -> advantages `(..., G)` float64: "grpo" (zero-sum, Bessel std,
    `advantages.group_advantages`) or "sign", A = 2 r - 1 (not zero-sum; 0 at r = 1/2)."""
    rewards = rewards.double()
    if advantage == "sign":
        return 2 * rewards - 1
    if advantage != "grpo":
        raise ValueError(f"advantage must be one of {FACTORIAL_ADVANTAGES}, got {advantage!r}")
    return group_advantages(rewards.reshape(-1, rewards.shape[-1]), "grpo").view_as(rewards)


def level_mixing(rewards: Tensor, advantages: Tensor) -> Tensor:
    """C `(..., G, G)`: row j holds A_i at the completions with the j-th largest distinct reward
    (`reward_levels`), so row j of C S is the sum of A_i s_i over that level; `rewards,
    advantages: (..., G)`. A level whose advantage is 0 is a zero row."""
    return reward_levels(rewards) * advantages.to(torch.float64)[..., None, :]


def factorial_grams(gram: Tensor, rewards: Tensor, advantages: Tensor) -> dict[str, Tensor]:
    """The Gram matrices `(..., G, G)` of S, diag(A) S and the level sums C S of one factorial
    cell, from the scores' Gram matrix K = S S^T `gram: (..., G, G)`: K, diag(A) K diag(A) and
    C K C^T (`level_mixing`)."""
    return {
        "scores": gram,
        "weighted": weighted_gram(gram, advantages),
        "level_sums": mixed_gram(gram, level_mixing(rewards, advantages)),
    }


def numerical_rank(singular_values: Tensor, relative: float = 1e-6) -> Tensor:
    """Number of singular values above `relative` times the largest, `(..., k)` -> `(...)`.
    Singular values from a float64 Gram matrix are exact to about 1e-8 of the largest."""
    top = singular_values.amax(dim=-1, keepdim=True)
    return ((singular_values > relative * top) & (top > 0)).sum(dim=-1)


def factorial_frame(grams: Tensor, rewards: dict[str, Tensor], group_sizes: list[int]):
    """Every cell of the factorial on every group: a pandas DataFrame, one row per (reward,
    advantage, matrix, group_size, prompt, group), columns k (completions with reward 1),
    levels (distinct rewards), mixed (not all equal), `FACTORIAL_MEASURES`, rank
    (`numerical_rank`) and null_<measure>, the same measure for orthogonal equal-norm scores
    (K = I) with the same rewards.

    `grams: (B, M, M)` score Gram matrices of M samples of each of B prompts, `rewards:
    {name: (B, M)}`; each G splits a prompt's samples into M // G disjoint groups
    (`disjoint_groups`), the same samples at every G.
    """
    num_prompts, num_samples = next(iter(rewards.values())).shape
    frames = []
    for group_size in group_sizes:
        index = disjoint_groups(num_samples, group_size)  # (K, G)
        group_grams = grams[:, index[:, :, None], index[:, None, :]].double()  # (B, K, G, G)
        identity = torch.eye(group_size, dtype=torch.float64).expand_as(group_grams)
        prompt, group = torch.meshgrid(
            torch.arange(num_prompts), torch.arange(index.shape[0]), indexing="ij"
        )
        for reward, values in rewards.items():
            group_rewards = values[:, index].double()  # (B, K, G)
            labels = {
                "group_size": group_size,
                "prompt": prompt.flatten().numpy(),
                "group": group.flatten().numpy(),
                "reward": reward,
                "k": (group_rewards == 1).sum(dim=-1).flatten().numpy(),
                "levels": reward_levels(group_rewards).any(dim=-1).sum(dim=-1).flatten().numpy(),
                "mixed": (group_rewards != group_rewards[..., :1]).any(dim=-1).flatten().numpy(),
            }
            for advantage in FACTORIAL_ADVANTAGES:
                weights = factorial_advantages(group_rewards, advantage)
                measured = factorial_grams(group_grams, group_rewards, weights)
                null = factorial_grams(identity, group_rewards, weights)
                for matrix, gram in measured.items():
                    sigma, null_sigma = (
                        gram_singular_values(gram),
                        gram_singular_values(null[matrix]),
                    )
                    measures, null_measures = rank_measures(sigma), rank_measures(null_sigma)
                    frames.append(
                        pd.DataFrame(
                            {
                                **labels,
                                "advantage": advantage,
                                "matrix": matrix,
                                "rank": numerical_rank(sigma).flatten().numpy(),
                                **{
                                    f"{prefix}{name}": table[name].flatten().double().numpy()
                                    for prefix, table in (("", measures), ("null_", null_measures))
                                    for name in FACTORIAL_MEASURES
                                },
                            }
                        )
                    )
    return pd.concat(frames, ignore_index=True)


def sequence_factorial(
    policy: SequencePolicy,
    logits: Tensor,
    group_sizes: list[int],
    num_prompts: int,
    *,
    seed: int,
) -> pd.DataFrame:
    """`factorial_frame` of the sequence policy at `logits` (column model "sequence policy"):
    `num_prompts` independent batches of max(group_sizes) samples (generator seeded `seed`),
    exact length-normalised scores, binary (`sum_mod_reward`) and ternary (`near_miss_reward`)
    rewards."""
    num_samples = max(group_sizes)
    all_sequences = policy.all_sequences()
    scores = policy.scores(logits, all_sequences) / policy.length
    gram_all = scores @ scores.T
    samples = policy.sample(logits, num_prompts * num_samples, torch.Generator().manual_seed(seed))
    samples = samples.view(num_prompts, num_samples)
    tables = {
        "binary": sum_mod_reward(all_sequences, policy.vocab_size).double(),
        "ternary": near_miss_reward(policy),
    }
    grams = gram_all[samples[:, :, None], samples[:, None, :]]
    rewards = {name: table[samples] for name, table in tables.items()}
    return factorial_frame(grams, rewards, group_sizes).assign(model="sequence policy")
