r"""verl's advantage estimators that need more than a group's rewards, and GDPO.

`core.advantages.group_advantages` turns the (B, G) rewards into advantages; each estimator
here needs one more input: `opo_advantages` the completions' lengths, `remax_advantages` the
reward of the greedy completion, `reinforce_plus_plus_advantages` token-level rewards,
`optimal_token_baseline_advantages` the policy's token probabilities, and `gdpo_advantages` one
reward per reward function. Each is verl's ``algorithm.adv_estimator`` of that name
(``verl/trainer/ppo/core_algos.py``); GDPO is also TRL's
``multi_objective_aggregation="normalize_then_sum"``. Their docstrings cite the papers and say
where verl computes otherwise; tests/core/test_verl_equivalence.py holds them to verl.

Chapters: :doc:`/book/08_baselines`, :doc:`/book/09_advantage_zoo`, :doc:`/book/variants`
"""

import torch
from torch import Tensor

from grpo_companion.core.advantages import WHITEN_EPS, check_rewards


def opo_advantages(rewards: Tensor, lengths: Tensor) -> Tensor:
    """OPO's length-weighted group baseline: A_i = r_i - sum_j L_j r_j / sum_j L_j (j over the
    group, i included).

    verl ``compute_opo_outcome_advantage``; Hao et al., *On-Policy RL with Optimal Reward
    Baseline* (arXiv 2505.23585, 2025). It is the optimal constant baseline
    b* = E[||s||^2 r] / E[||s||^2] (chapter 8) with ||s||^2 replaced by the length L, its proxy
    when the tokens' scores are of similar size; with equal lengths it is the group mean
    ("dr_grpo").

    Args: rewards, lengths: (num_groups, G), lengths > 0 (tokens per completion).
    Returns: advantages (num_groups, G).
    """
    check_rewards(rewards)
    if lengths.shape != rewards.shape or not (lengths > 0).all():
        raise ValueError(
            f"lengths must be positive with shape {tuple(rewards.shape)}, got "
            f"{tuple(lengths.shape)}"
        )
    lengths = lengths.to(rewards.dtype)
    baseline = (lengths * rewards).sum(dim=1, keepdim=True) / lengths.sum(dim=1, keepdim=True)
    return rewards - baseline


def remax_advantages(rewards: Tensor, greedy_rewards: Tensor) -> Tensor:
    """ReMax: A_i = r_i - r(greedy completion of the same prompt).

    verl ``compute_remax_outcome_advantage``; Li et al., *ReMax: A Simple, Effective, and
    Efficient Reinforcement Learning Method for Aligning Large Language Models* (arXiv
    2310.10505, 2023). The baseline costs one extra greedy rollout per prompt and does not depend
    on the sampled completions, so the estimator is unbiased at every G, G = 1 included.

    Args: rewards (num_groups, G); greedy_rewards (num_groups,).
    Returns: advantages (num_groups, G).
    """
    check_rewards(rewards)
    if greedy_rewards.shape != rewards.shape[:1]:
        raise ValueError(
            f"greedy_rewards must have shape {tuple(rewards.shape[:1])}, got "
            f"{tuple(greedy_rewards.shape)}"
        )
    return rewards - greedy_rewards[:, None].to(rewards.dtype)


def reinforce_plus_plus_advantages(
    token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: the discounted return-to-go of each token, whitened over the batch's tokens.

    verl ``compute_reinforce_plus_plus_outcome_advantage`` (with ``masked_whiten``: mean and
    Bessel-corrected variance over the valid tokens, (x - mean) / sqrt(var + 1e-8)); Hu,
    *REINFORCE++* (arXiv 2501.03262, 2025). There is no group baseline: the batch mean of the
    returns is a baseline shared by every prompt, and the batch std a common scale. verl 0.9.1
    carries the return across masked tokens inside a completion (a multi-turn rollout's tool
    output) as if they were absent; here it stops there, as at padding: the two agree when the
    padding is at the end only.

    Args:
        token_rewards: (..., T), e.g. the outcome reward on each completion's last token.
        response_mask: (..., T), 1 on valid tokens, 0 on padding.
        gamma: discount; the return does not flow back through padding.

    Returns: (advantages, returns), each (..., T), zero on padding.
    """
    mask = response_mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[..., 0])
    for t in reversed(range(token_rewards.shape[-1])):
        running = token_rewards[..., t] + gamma * running
        returns[..., t] = running
        running = running * mask[..., t]
    count = mask.sum()
    if count < 2:
        raise ValueError("whitening over the batch needs at least 2 valid tokens")
    mean = (returns * mask).sum() / (count + WHITEN_EPS)
    variance = ((returns - mean) ** 2 * mask).sum() / (count + WHITEN_EPS) * count / (count - 1)
    return (returns - mean) * (variance + WHITEN_EPS).rsqrt() * mask, returns


def optimal_token_baseline_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    token_probs: Tensor,
    sum_pi_squared: Tensor,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """verl's optimal token baseline (OTB): one baseline per group and position t,

        B_t = sum_i R_it W_it / sum_i W_it,   W_it = sum_{j <= t} (1 - 2 pi_ij + sum_a pi_ij(a)^2),

    A_it = R_it - B_t, with R the return-to-go. 1 - 2 pi(y_j) + sum_a pi(a)^2 is the squared norm
    of a tabular softmax's token score (chapter 8, section 1), so W_it is the squared score norm of
    the first t tokens and, for an outcome reward, B_T at the last position is the group's estimate
    of chapter 8's b* = E[||s||^2 r] / E[||s||^2]. The group includes completion i itself.

    verl ``compute_optimal_token_baseline_advantage`` (no paper cited there), without its
    rollout importance weights and ``handle_zero_tail``; a group of one gets baseline 0. (Past
    the second-longest completion of a group the longest is alone and B_t is its own return, so
    A ~ 0 there, as the formula gives; verl's default ``handle_zero_tail`` sets B_t = 0 instead.)

    Args:
        token_rewards, response_mask: (num_groups, G, T).
        token_probs: (num_groups, G, T), pi of each sampled token (verl: exp(old_log_probs)).
        sum_pi_squared: (num_groups, G, T), sum over the vocabulary of pi(a)^2 at each position.

    Returns: (advantages, returns), each (num_groups, G, T), zero on padding.
    """
    mask = response_mask.to(token_rewards.dtype)
    returns = (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    weights = ((1 - 2 * token_probs + sum_pi_squared) * mask).cumsum(-1) * mask
    baseline = (returns * weights).sum(dim=1, keepdim=True) / (
        weights.sum(dim=1, keepdim=True) + eps
    )
    if token_rewards.shape[1] == 1:
        baseline = torch.zeros_like(baseline)
    return (returns - baseline) * mask, returns


def gdpo_advantages(
    rewards: Tensor, reward_weights: Tensor | None = None, *, eps: float = 1e-4
) -> Tensor:
    """GDPO: each reward function normalised within the group, then summed, then over the batch.

    A_i = whiten_batch(sum_k w_k (r_ik - mean_group r_k) / (std_group r_k + eps)), whiten_batch(s)
    = (s - mean s) / (std s + eps) over every completion (Bessel stds). TRL's
    ``multi_objective_aggregation="normalize_then_sum"`` with ``reward_weights`` (its default,
    "sum_then_normalize", is `group_advantages` of sum_k w_k r_k). verl's ``gdpo`` uses eps
    1e-6 and whitens over the tokens (``masked_whiten``). rewards: (num_groups, G, K);
    reward_weights: (K,), default ones. Returns (num_groups, G).
    Chapter: :doc:`/book/variants`
    """
    if rewards.dim() != 3:
        raise ValueError(
            f"rewards must be (num_groups, group_size, num_rewards), got {tuple(rewards.shape)}"
        )
    check_rewards(rewards.flatten(1))
    if rewards.shape[1] < 2:
        raise ValueError(f"GDPO needs group_size >= 2, got rewards {tuple(rewards.shape)}")
    if reward_weights is None:
        reward_weights = torch.ones(rewards.shape[-1], dtype=rewards.dtype)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    normalised = centred / (rewards.std(dim=1, keepdim=True) + eps)
    summed = (normalised * reward_weights.to(rewards)).sum(dim=-1)
    return (summed - summed.mean()) / (summed.std() + eps)
