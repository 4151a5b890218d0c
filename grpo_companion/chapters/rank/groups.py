r"""Chapter 7, sections 1-2 and 5: which matrix of one group's gradients has rank 2.

Completion i of a group of G has the score row s_i (`lm.gradients`); stacked, S (G, P), the
weighted rows diag(A) S (G, P), and the level sums C S, row j of C the advantages at the j-th
reward level (the class sums [1_c^T S; 1_w^T S] for binary rewards). The group's gradient
S^T A lies in the row space of the level sums; section 1 derives why, and why diag(A) S is
not of rank 2. Each candidate is measured through its Gram matrix, built from that of the score
rows (`core.spectra`), so one Gram matrix of a batch serves every candidate, reward and method.

Chapter: :doc:`/book/07_rank`
"""

import pandas as pd
import torch
from torch import Tensor

from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.group_estimators import group_gradient
from grpo_companion.core.policy_gradient import SequencePolicy, sum_mod_reward
from grpo_companion.core.spectra import (
    gram_singular_values,
    mixed_gram,
    rank_measures,
    weighted_gram,
)

GROUP_CANDIDATES = ("scores", "weighted", "level_sums")

# ---------------------------------------------------------------------------------------------
# The mechanism (section 1), on one group of explicit score rows


def class_sums(scores: Tensor, rewards: Tensor) -> Tensor:
    """C = [sum of the correct scores; sum of the incorrect scores], `(2, P)`, for binary
    `rewards: (G,)`. rank(C) <= 2 and the group gradient lies in its row space."""
    correct = _correct(rewards)
    return torch.stack([scores[correct].sum(dim=0), scores[~correct].sum(dim=0)])


def centroid_difference(scores: Tensor, rewards: Tensor) -> Tensor:
    """m_c - m_w, mean correct score minus mean incorrect score, `(P,)`, of a mixed group."""
    correct = _correct(rewards, mixed=True)
    return scores[correct].mean(dim=0) - scores[~correct].mean(dim=0)


def centroid_coefficient(rewards: Tensor, advantages: Tensor) -> float:
    """c = k a_1 with S^T A = c (m_c - m_w), for a mixed group's binary `rewards: (G,)` and zero-sum
    `advantages` equal within each reward class: k (G - k) / G for dr_grpo."""
    correct = _correct(rewards, mixed=True)
    tolerance = 100 * torch.finfo(advantages.dtype).eps * advantages.abs().max().item()
    for same_class in (advantages[correct], advantages[~correct]):
        if (same_class - same_class[0]).abs().max() > tolerance:
            raise ValueError("advantages differ within a reward class")
    if abs(advantages.sum().item()) > len(advantages) * tolerance:
        raise ValueError(f"advantages are not zero-sum (sum {advantages.sum().item():.3g})")
    return correct.sum().item() * advantages[correct][0].item()


def _correct(rewards: Tensor, mixed: bool = False) -> Tensor:
    if rewards.dim() != 1 or not ((rewards == 0) | (rewards == 1)).all():
        raise ValueError("rewards must be one group's binary rewards, shape (G,), values {0, 1}")
    correct = rewards == 1
    if mixed and (correct.all() or not correct.any()):
        raise ValueError("a group with one reward value has no centroid difference")
    return correct


def candidate_matrices(scores: Tensor, rewards: Tensor, advantages: Tensor) -> dict[str, Tensor]:
    """The three per-group candidates as explicit matrices, for one group's binary
    `rewards, advantages: (G,)` and `scores: (G, P)`: scores S `(G, P)`, weighted diag(A) S
    `(G, P)` and level_sums, the class sums C `(2, P)` (`class_sums`)."""
    return {
        "scores": scores,
        "weighted": advantages[:, None] * scores,
        "level_sums": class_sums(scores, rewards),
    }


def sequence_reward_tables(policy: SequencePolicy, seed: int) -> dict[str, Tensor]:
    """Two rewards of every sequence of `policy`, `(num_sequences,)` float64 each: "binary",
    `sum_mod_reward`, and "uniform", one U(0, 1) draw per sequence (generator seeded `seed`), a
    continuous reward that says nothing about the sequence."""
    binary = sum_mod_reward(policy.all_sequences(), policy.vocab_size).double()
    generator = torch.Generator().manual_seed(seed)
    uniform = torch.rand(policy.num_sequences, generator=generator, dtype=torch.float64)
    return {"binary": binary, "uniform": uniform}


def mechanism(
    policy: SequencePolicy, logits: Tensor, rewards: Tensor, group_size: int, method="grpo", *, seed
) -> tuple[dict, dict[str, Tensor]]:
    """Items 1-2 of the module docstring on the first group of `group_size` sequences sampled
    from pi (generator seeded `seed`) with mixed binary `rewards` (the table, `(num_sequences,)`),
    its score rows divided by the length (the loss-normalised rows), exactly.

    Returns ({record key: value}, {candidate: singular values}): the group size, its number k of
    correct completions, the relative deviation max |S^T A - c (m_c - m_w)| / max |S^T A|
    (rounding), the rank of the scores of all sequences, and the rank and entropy effective
    rank of each of `candidate_matrices`.
    """
    generator = torch.Generator().manual_seed(seed)
    while True:
        group = policy.sample(logits, group_size, generator)
        if 0 < rewards[group].sum() < group_size:
            break
    all_sequences = policy.all_sequences()
    scores = policy.scores(logits, all_sequences[group]) / policy.length
    rewards = rewards[group]
    advantages = group_advantages(rewards[None], method)[0]
    # S^T A = sum_i A_i s_i is G times the group's gradient g.
    weighted_sum = group_size * group_gradient(scores, advantages)
    centroids = centroid_coefficient(rewards, advantages) * centroid_difference(scores, rewards)
    deviation = (weighted_sum - centroids).abs().max() / weighted_sum.abs().max()
    records = {
        "mechanism_group_size": group_size,
        "mechanism_num_correct": int(rewards.sum()),
        "mechanism_relative_deviation": deviation.item(),
        "sequence_score_rank": int(torch.linalg.matrix_rank(policy.scores(logits, all_sequences))),
    }
    spectra = {}
    for name, matrix in candidate_matrices(scores, rewards, advantages).items():
        spectra[name] = torch.linalg.svdvals(matrix)
        records[f"mechanism_rank_{name}"] = int(torch.linalg.matrix_rank(matrix))
        records[f"mechanism_erank_{name}"] = rank_measures(spectra[name])["entropy"].item()
    return records, spectra


def reward_levels(rewards: Tensor) -> Tensor:
    """Indicators of the distinct reward values of each group, `rewards: (..., G)` ->
    `(..., G, G)` bool: row j marks the completions with the j-th largest distinct reward;
    rows past the number of distinct values are zero.

    E S sums the score rows within each reward level. With binary rewards it is the class-sum
    matrix C (2 rows, 1 for a degenerate group); with continuous ones up to G rows. Any
    advantage that is a function of the reward puts the group gradient in its row space. The
    zero rows add zero singular values, which no rank measure counts.
    """
    ordered = rewards.sort(dim=-1, descending=True).values
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    # A repeated value becomes -inf, which sorts last and equals no reward: a zero row.
    levels = ordered.masked_fill(~first, -torch.inf).sort(dim=-1, descending=True).values
    return levels[..., :, None] == rewards[..., None, :]


def group_candidate_grams(gram: Tensor, rewards: Tensor, advantages: Tensor) -> dict[str, Tensor]:
    """The `(..., G, G)` Gram matrices of the three per-group candidates, from the Gram matrix of
    one group's score rows `gram: (..., G, G)`, `rewards, advantages: (..., G)`:

        scores      S          one score row per completion
        weighted    diag(A) S  one GRPO gradient row per completion: the rows whose sum is g
        level_sums  E S        the score rows summed within each reward level
                               (`reward_levels`; the class sums for binary rewards)
    """
    return {
        "scores": gram,
        "weighted": weighted_gram(gram, advantages),
        "level_sums": mixed_gram(gram, reward_levels(rewards)),
    }


def disjoint_groups(num_samples: int, group_size: int) -> Tensor:
    """`(num_samples // group_size, group_size)` indices: consecutive disjoint groups.

    M i.i.d. completions of one prompt split into M // G groups give M // G independent
    groups of G, so one batch of M samples per prompt serves every G dividing M."""
    if not 2 <= group_size <= num_samples:
        raise ValueError(f"need 2 <= group_size <= {num_samples}, got {group_size}")
    return torch.arange(num_samples - num_samples % group_size).view(-1, group_size)


def group_rank_frame(grams: Tensor, rewards: Tensor, group_sizes: list[int], method: str = "grpo"):
    """Rank measures of every candidate of every group, a pandas DataFrame with one row per
    (group_size, prompt, group, candidate) and columns `mixed` (rewards not all equal) and
    `RANK_MEASURES`.

    `grams: (B, M, M)` Gram matrices of the (loss-normalised) score rows of M samples of each of
    B prompts, `rewards: (B, M)`. For each G in `group_sizes` the samples of a prompt are split
    into M // G disjoint groups (`disjoint_groups`) and `advantages.group_advantages(method)`
    computed per group.
    """
    num_prompts, num_samples = rewards.shape
    frames = []
    for group_size in group_sizes:
        index = disjoint_groups(num_samples, group_size)  # (K, G)
        group_rewards = rewards[:, index]  # (B, K, G)
        group_grams = grams[:, index[:, :, None], index[:, None, :]]  # (B, K, G, G)
        advantages = group_advantages(group_rewards.flatten(0, 1), method).view_as(group_rewards)
        mixed = (group_rewards != group_rewards[..., :1]).any(dim=-1)
        candidates = group_candidate_grams(group_grams, group_rewards, advantages)
        for candidate, gram in candidates.items():
            measures = rank_measures(gram_singular_values(gram))
            prompt, group = torch.meshgrid(
                torch.arange(num_prompts), torch.arange(index.shape[0]), indexing="ij"
            )
            frames.append(
                pd.DataFrame(
                    {
                        "group_size": group_size,
                        "prompt": prompt.flatten().numpy(),
                        "group": group.flatten().numpy(),
                        "candidate": candidate,
                        "mixed": mixed.flatten().numpy(),
                        **{
                            name: value.flatten().double().numpy()
                            for name, value in measures.items()
                        },
                    }
                )
            )
    return pd.concat(frames, ignore_index=True)


def group_gradient_gram(gram: Tensor, advantages: Tensor, groups: Tensor) -> Tensor:
    """Gram matrix of the group gradients, rows sum_{i in group b} A_i s_i (G times
    `group_estimators.group_gradient`; no rank measure sees the factor), `(K, K)`, from that of
    all rollouts' score rows `gram: (N, N)`, `advantages: (N,)` and `groups: (K, G)` indices.

    The fifth candidate: the matrix whose rows are the gradients of many groups (of a batch,
    or of successive steps). Its rank is at most K, the number of groups, and not 2."""
    mixing = torch.zeros(groups.shape[0], gram.shape[0], dtype=gram.dtype, device=gram.device)
    mixing.scatter_(1, groups, advantages[groups].to(gram.dtype))
    return mixed_gram(gram, mixing)


def group_gradient_ranks(
    gram: Tensor, rewards: Tensor, group_sizes: list[int], method: str = "grpo"
) -> list[dict]:
    """Rank measures of the fifth candidate, the `(K, P)` matrix of the gradients of all K
    groups of a batch, for each G: `gram: (N, N)` over all rollouts (prompt-major, M per
    prompt), `rewards: (B, M)`. Each prompt's samples are split as in `group_rank_frame`;
    `num_groups` counts the groups with a nonzero gradient (mixed rewards)."""
    num_prompts, num_samples = rewards.shape
    rows = []
    for group_size in group_sizes:
        local = disjoint_groups(num_samples, group_size)  # (K, G) within a prompt
        groups = (torch.arange(num_prompts)[:, None, None] * num_samples + local).flatten(0, 1)
        group_rewards = rewards.flatten()[groups]
        advantages = torch.zeros(rewards.numel(), dtype=torch.float64)
        advantages[groups] = group_advantages(group_rewards.double(), method)
        sigma = gram_singular_values(group_gradient_gram(gram, advantages, groups))
        mixed = (group_rewards != group_rewards[:, :1]).any(dim=1)
        measures = {name: value.item() for name, value in rank_measures(sigma).items()}
        rows.append({"group_size": group_size, "num_groups": int(mixed.sum()), **measures})
    return rows


def sequence_policy_ranks(
    policy: SequencePolicy,
    stage_logits: dict[str, Tensor],
    tables: dict[str, Tensor],
    group_sizes: list[int],
    num_prompts: int,
    num_cross_prompts: int,
    method: str = "grpo",
    *,
    seed: int,
) -> tuple[pd.DataFrame, list[dict]]:
    """(`group_rank_frame` rows, `group_gradient_ranks` rows) of the sequence policy, each with
    columns model ("sequence policy"), stage (a key of `stage_logits`) and reward (a key of
    `tables`, reward tables `(num_sequences,)`).

    At every stage, `num_prompts` independent batches of max(group_sizes) samples (one
    generator seeded `seed`, drawn stage after stage) are measured with the exact scores of
    the sequences divided by the length, the loss-normalised rows; the group gradients of
    section 5 stack the groups of the first `num_cross_prompts` batches.
    """
    num_samples = max(group_sizes)
    all_sequences = policy.all_sequences()
    frames, cross_rows = [], []
    sampler = torch.Generator().manual_seed(seed)
    for stage, logits in stage_logits.items():
        scores = policy.scores(logits, all_sequences) / policy.length
        gram_all = scores @ scores.T  # every sequence against every other, exact
        samples = policy.sample(logits, num_prompts * num_samples, sampler)
        samples = samples.view(num_prompts, num_samples)
        grams = gram_all[samples[:, :, None], samples[:, None, :]]  # (prompts, M, M)
        cross = samples[:num_cross_prompts].flatten()
        for reward, table in tables.items():
            frame = group_rank_frame(grams, table[samples], group_sizes, method)
            frames.append(frame.assign(model="sequence policy", stage=stage, reward=reward))
            rows = group_gradient_ranks(
                gram_all[cross[:, None], cross[None, :]],
                table[samples[:num_cross_prompts]],
                group_sizes,
                method,
            )
            cross_rows += [
                {"model": "sequence policy", "stage": stage, "reward": reward, **row}
                for row in rows
            ]
    return pd.concat(frames), cross_rows
