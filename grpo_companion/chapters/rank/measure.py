r"""Chapter 7: which matrix of GRPO's gradients has rank 2.

For one prompt x we sample a group of G completions y_1..y_G (the paper calls G "R").
Completion i has the score row s_i = grad_theta log pi(y_i | x) (`lm.gradients`) and the
advantage-weighted row A_i s_i; stacked, they are

    scores    S = [s_1; ...; s_G]         (G, P)
    weighted  W = diag(A) S = [A_i s_i]   (G, P)
    gradient  S^T A = W^T 1               (P,)   G times the group's gradient g of
                                                 `core.group_estimators.group_gradient`

Which matrix has rank <= 2. Take binary rewards r in {0, 1}^G, k correct with 0 < k < G, and
write 1_c, 1_w for the indicators of the correct and the incorrect completions. Every method of
`advantages.METHODS` gives equal rewards of a group equal advantages: A = a_1 1_c + a_0 1_w.

  1. g lies in span{S^T 1_c, S^T 1_w}, the row space of the class-sum matrix
     C = [1_c^T S; 1_w^T S] (2, P), whatever G:  S^T A = a_1 S^T 1_c + a_0 S^T 1_w.
     So the matrix of rank <= 2 is C (equivalently W with its rows summed within each reward
     class), not W.
  2. If the advantages are zero-sum (grpo, dr_grpo, rloo, softmax), k a_1 + (G - k) a_0 = 0 and
         S^T A = a_1 k m_c + a_0 (G - k) m_w = k a_1 (m_c - m_w),
     m_c, m_w the mean scores of the correct and the incorrect completions: g is a multiple of
     the difference of the two centroids, c = k a_1 = k (G - k) / G for dr_grpo, divided by
     (std + eps) for grpo, k (G - k) / (G - 1) for rloo.
  3. W itself is NOT rank 2: rank(W) = rank(S_nz), S_nz the rows of S with A_i != 0. Proof:
     the zero rows of W add nothing to its row space, and the others are diag(A_nz) S_nz with
     diag(A_nz) invertible, which preserves rank. In a mixed binary group no advantage is 0
     (for the methods above), so rank(W) = rank(S), generically min(G, dim span{all scores}):
     it grows with G. Its Gram matrix is W W^T = diag(A) S S^T diag(A) (`weighted_gram`).
  4. Across groups nothing stays at 2: the (B, P) matrix of B groups' gradients has rows
     c_b (m_c,b - m_w,b), one direction per group, rank <= B. Rank 2 (item 1), or 1 (item 2),
     is a statement about one group's gradient, and it holds for any G.

Each candidate is measured through its Gram matrix, built from that of the score rows
(`core.spectra`): one Gram matrix of a batch serves every candidate, reward and advantage
method. Summaries and the verdict are in `rank_verdict`, the figures in `rank_plots`.

The factorial (chapter 7, section 6) asks which of two things makes the 2: the zero-sum
advantages or the number of reward levels. It crosses the reward (binary; ternary: 1 right,
1/2 a wrong answer with a right first step, 0) with the advantage (grpo, zero-sum; sign,
A = 2r - 1, not zero-sum) and measures S, diag(A) S and the level sums L = C S, row j of C
the advantages of the completions at the j-th reward level (`level_mixing`), by three rank
measures. Each cell is a reweighting of the same Gram matrix K = S S^T: diag(A) K diag(A) and
C K C^T. The null model replaces K by the identity (orthogonal score rows of equal norm).
"""

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn

from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.group_estimators import group_gradient
from grpo_companion.core.policy_gradient import SequencePolicy, sum_mod_reward
from grpo_companion.core.spectra import (
    diagonal_blocks,
    gram_singular_values,
    mixed_gram,
    rank_measures,
    weighted_gram,
)
from grpo_companion.lm import gsm8k
from grpo_companion.lm.gradients import (
    causal_attention_mask,
    representative_matrices,
    weight_gradient_spectra,
)
from grpo_companion.lm.gsm8k import build_prompts
from grpo_companion.lm.rollouts import generate_rollouts
from grpo_companion.lm.scoring import sequence_log_probs
from grpo_companion.lm.steps import step_rewards
from grpo_companion.lm.streaming_gram import rollout_gram

GROUP_CANDIDATES = ("scores", "weighted", "level_sums")
FACTORIAL_REWARDS = ("binary", "ternary")
FACTORIAL_ADVANTAGES = ("grpo", "sign")
FACTORIAL_MEASURES = ("entropy", "stable", "energy_90")

# ---------------------------------------------------------------------------------------------
# The mechanism (items 1-2 of the module docstring), on one group of explicit score rows


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


# ---------------------------------------------------------------------------------------------
# Which matrix? The candidates, measured on many groups


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


# ---------------------------------------------------------------------------------------------
# The factorial: reward levels x zero-sum x rank measure (module docstring, last paragraph)


def near_miss_reward(policy: SequencePolicy) -> Tensor:
    """The sequence policy's ternary reward, `(num_sequences,)` float64: 1 when the last token
    is the sum of the others mod V (`sum_mod_reward`), 1/2 when it is that sum plus one (a
    near miss, the analogue of a wrong answer with a right first step), 0 otherwise."""
    sequences = policy.all_sequences()
    answer = sequences[:, :-1].sum(dim=1) % policy.vocab_size
    near = sequences[:, -1] == (answer + 1) % policy.vocab_size
    return sum_mod_reward(sequences, policy.vocab_size) + 0.5 * near.double()


def ternary_reward(completion: str, answer_field: str, mode: str = "strict") -> float:
    """1 for a right answer (`gsm8k.reward` in `mode`), 1/2 for a wrong one whose first worked
    line is the reference's (`steps.step_rewards`: partial progress), 0 otherwise.
    `answer_field`: the problem's GSM8K-schema answer, worked lines then "#### N"; one without
    worked lines (the real GSM8K's prose) gives no middle level."""
    rewards, _ = step_rewards(completion, answer_field, mode)
    if rewards[-1] == 1:
        return 1.0
    return 0.5 if len(rewards) > 1 and rewards[0] == 1 else 0.0


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


# ---------------------------------------------------------------------------------------------
# Language models


def graded_reward(completion: str, gold: str) -> float:
    """A continuous reward in [0, 1]: 1 / (1 + |x - gold| / max(1, |gold|)) for the last number
    x of the completion (`gsm8k.extract_answer(..., "flexible")`), 0 if it has none. Exact
    answers get 1, and being close is worth more than being far."""
    answer = gsm8k.extract_answer(completion, "flexible")
    if answer is None:
        return 0.0
    target = float(gold)
    return 1 / (1 + abs(float(answer) - target) / max(1.0, abs(target)))


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
