r"""Group-relative advantages.

For one prompt we sample a group of G completions (TRL: ``num_generations``)
and score them with rewards r_1, ..., r_G. Every method below turns the rewards
of a group into advantages A_1, ..., A_G without a learned value function: the
baseline comes from the other completions of the same group.

    grpo     A_i = (r_i - mean(r)) / (std(r) + eps)
    dr_grpo  A_i = r_i - mean(r)
    rloo     A_i = r_i - 1/(G-1) * sum_{j != i} r_j  =  G/(G-1) * (r_i - mean(r))
    sign     A_i = 2 r_i - 1 for r_i in {0, 1}, else +1 if r_i > threshold else -1
    softmax  A_i = G * softmax(r / temperature)_i - 1
    grpo_passk  only the best completion of the group gets r_max - r_second_max (divided by the
             group's std + eps when scale_rewards="group"), every other one 0
    reinforce_plus_plus_baseline  r_i - mean(r), then whitened over the whole batch
    gpg      alpha * (r_i - mean(r)), alpha = (B G) / (number of nonzero rewards in the batch)

Conventions for "grpo" follow TRL's ``GRPOTrainer``: ``std`` is Bessel-corrected
(``torch.std``), ``eps = 1e-4`` is added to the std (outside the square root),
and ``scale_rewards`` picks the std: "group" (one per group), "batch" (one over
all rewards of the batch, while the means stay per group) or "none" (no
division, i.e. "dr_grpo"). The book also uses the population std
(``unbiased_std=False``), which maps a two-completion group with rewards {1, 0}
to about +-1 instead of +-0.707. verl also uses ``torch.std`` but its epsilon is
1e-6.

"grpo", "dr_grpo", "rloo" and "softmax" are zero-sum within each group.

verl's estimators (``algorithm.adv_estimator``; volcengine/verl,
``verl/trainer/ppo/core_algos.py``, read at commit b178a3c, January 2026)
--------------------------------------------------------------------------------------
grpo_passk: ``compute_grpo_passk_outcome_advantage``; Tang et al., *Optimizing Language Models
    for Inference Time Objectives using Reinforcement Learning* (arXiv 2503.19595, 2025). The
    baseline of completion i is the best reward of the *others*, max_{j != i} r_j, so
    sum_i A_i s_i is an unbiased estimate of grad E[max_i r_i] = grad pass@G for binary rewards
    (without the std). Ties at the top give 0 to everyone.
reinforce_plus_plus_baseline: ``compute_reinforce_plus_plus_baseline_outcome_advantage``; Hu,
    *REINFORCE++* (arXiv 2501.03262, 2025). verl whitens over the batch's *tokens*
    (``masked_whiten``: mean and Bessel-corrected variance, then (x - mean) / sqrt(var + 1e-8)),
    so completion i weighs L_i and Bessel's count is the number of tokens. This function whitens
    the (B, G) rewards, each completion once, as they carry no lengths; with N completions all of
    length L verl's is this times sqrt((N L - 1) / (L (N - 1)))
    (tests/core/test_verl_equivalence.py).
gpg: ``compute_gpg_outcome_advantage``; Chu et al., *GPG: A Simple and Strong Reinforcement
    Learning Baseline for Model Reasoning* (arXiv 2504.02546, 2025). verl's alpha is
    B G / count_nonzero(rewards) over the batch (for binary rewards: over the number of correct
    completions); the paper writes alpha = B / (B - M) with M the samples whose group has zero
    advantage. This function follows verl; its f_norm is 1 (verl computes the std, unused).
Both "reinforce_plus_plus_baseline" and "gpg" couple the groups of a batch (`BATCH_METHODS`).

Sibling functions cover the estimators that need more than the (B, G) rewards:
`process_advantages` (step rewards: process supervision), `opo_advantages` (lengths),
`remax_advantages` (the greedy completion's reward), `reinforce_plus_plus_advantages`
(token-level rewards), `optimal_token_baseline_advantages` (token probabilities) and
`gdpo_advantages` (one reward per reward function). The KL in the reward (verl's
``use_kl_in_reward``) is `grpo_companion.core.kl.kl_in_reward`.
"""

import torch
from torch import Tensor

METHODS = (
    "grpo", "dr_grpo", "rloo", "sign", "softmax", "grpo_passk", "reinforce_plus_plus_baseline",
    "gpg",
)  # fmt: skip
SCALE_REWARDS = ("group", "batch", "none")
# TRL also accepts a bool (``GRPOConfig.__post_init__``): True is "group", False is "none".
SCALE_REWARDS_ALIASES = {True: "group", False: "none"}
# Methods whose baseline is built from the other completions of the group.
_NEEDS_GROUP = (
    "grpo", "dr_grpo", "rloo", "softmax", "grpo_passk", "reinforce_plus_plus_baseline", "gpg",
)  # fmt: skip
# Methods whose advantages depend on the other groups of the batch too.
BATCH_METHODS = ("reinforce_plus_plus_baseline", "gpg")
# verl's masked_whiten adds this to the variance.
_WHITEN_EPS = 1e-8


def group_advantages(
    rewards: Tensor,
    method: str = "grpo",
    *,
    scale_rewards: str = "group",
    eps: float = 1e-4,
    unbiased_std: bool = True,
    threshold: float | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """Advantages of each completion relative to its group.

    Chapter: :doc:`/book/02_group_baseline`

    Args:
        rewards: (num_groups, group_size) floating point, one row per prompt.
        method: one of ``METHODS`` (see the module docstring).
        scale_rewards: "group", "batch" or "none" (or TRL's True / False for "group" /
            "none"); used by "grpo" and "grpo_passk" ("group" is verl's
            ``norm_adv_by_std_in_grpo=True``; "batch" is not allowed there).
        eps: added to the std before dividing ("grpo", "grpo_passk"). TRL: 1e-4, verl: 1e-6.
        unbiased_std: Bessel-corrected std (TRL, verl) if True, population
            std if False ("grpo" only).
        threshold: for "sign" with non-binary rewards, A = +1 where
            r > threshold and -1 elsewhere.
        temperature: for "softmax", must be > 0. As temperature -> inf the
            weights become uniform and A -> 0; as temperature -> 0 the
            weights concentrate on the best reward(s), A -> G/k - 1 for the k
            tied maxima and -1 for the rest. Shifting rewards leaves A
            unchanged, scaling them acts like 1/temperature. A is bounded in
            [-1, G - 1].

    Returns:
        advantages: (num_groups, group_size), same dtype as ``rewards``.
    """
    check_rewards(rewards)
    if isinstance(scale_rewards, bool):
        scale_rewards = SCALE_REWARDS_ALIASES[scale_rewards]
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(
            f"unknown scale_rewards {scale_rewards!r}; expected one of {SCALE_REWARDS}"
        )
    group_size = rewards.shape[1]
    if method in _NEEDS_GROUP and group_size < 2:
        raise ValueError(
            f"method {method!r} needs group_size >= 2 to build a baseline from "
            f"the group, got rewards of shape {tuple(rewards.shape)}"
        )

    if method == "sign":
        return _sign_advantages(rewards, threshold)

    if method == "softmax":
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        weights = torch.softmax(rewards / temperature, dim=1)
        return group_size * weights - 1

    if method == "grpo_passk":
        return _passk_advantages(rewards, scale_rewards, eps)

    if method == "rloo":
        leave_one_out_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (group_size - 1)
        return rewards - leave_one_out_mean

    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if method == "reinforce_plus_plus_baseline":
        if centered.numel() < 2:
            raise ValueError("whitening over the batch needs at least 2 rewards")
        return (centered - centered.mean()) / (centered.var() + _WHITEN_EPS).sqrt()
    if method == "gpg":
        return rewards.numel() / max(int(torch.count_nonzero(rewards)), 1) * centered
    if method == "dr_grpo" or scale_rewards == "none":
        return centered

    correction = 1 if unbiased_std else 0
    if scale_rewards == "group":
        std = rewards.std(dim=1, keepdim=True, correction=correction)
    else:
        std = rewards.std(correction=correction)
    return centered / (std + eps)


def process_advantages(
    step_rewards: Tensor, step_ends: Tensor, step_mask: Tensor, seq_len: int, eps: float = 1e-4
) -> Tensor:
    """Token advantages of process supervision (DeepSeekMath's GRPO, Shao et al. 2024, 4.1.3).

    Each completion i of a group has steps j with rewards r_ij, step j ending at token
    end_ij. Every step reward of the group is normalised with the mean and std of all the
    group's step rewards, r~_ij = (r_ij - mean) / (std + eps) (Bessel std plus eps, as
    `group_advantages`' "grpo"), and a token's advantage is the sum of the normalised rewards
    of the steps that end at or after it: A_it = sum over j with end_ij >= t of r~_ij. With one
    step per completion ending at its last token this is `group_advantages(rewards)` on every
    token; tokens after a completion's last step get 0.

    Args:
        step_rewards: (num_groups, group_size, num_steps) floating point.
        step_ends: (num_groups, group_size, num_steps) int, token index in [0, seq_len).
        step_mask: (num_groups, group_size, num_steps) bool, True on the steps present; a group
            needs at least two.
        seq_len: T, the completions' width.

    Returns:
        advantages: (num_groups * group_size, seq_len), rollouts prompt-major as in
        `group_advantages(...).flatten()`.
    """
    if step_rewards.dim() != 3 or not step_rewards.is_floating_point():
        raise ValueError(
            "step_rewards must be floating point (num_groups, group_size, num_steps), got "
            f"{step_rewards.dtype} of shape {tuple(step_rewards.shape)}"
        )
    if step_ends.shape != step_rewards.shape or step_mask.shape != step_rewards.shape:
        raise ValueError(
            f"step_ends and step_mask must have the shape of step_rewards "
            f"{tuple(step_rewards.shape)}, got {tuple(step_ends.shape)} and "
            f"{tuple(step_mask.shape)}"
        )
    step_mask = step_mask.bool()
    if not torch.isfinite(step_rewards[step_mask]).all():
        raise ValueError("step rewards must be finite, got NaN or infinite values")
    ends = step_ends[step_mask]
    if ends.numel() and (ends.min() < 0 or ends.max() >= seq_len):
        raise ValueError(f"step_ends must lie in [0, seq_len = {seq_len}), got {ends.tolist()}")
    counts = step_mask.flatten(1).sum(1).tolist()
    if min(counts) < 2:
        raise ValueError(f"a group needs two steps for a std; steps per group: {counts}")
    normalised = torch.zeros_like(step_rewards)
    # Rows of the groups' present rewards, normalised as group_advantages normalises its rows
    # (same operations on the same shape: one step per completion rounds exactly alike).
    if len(set(counts)) == 1:
        rows = [step_rewards[step_mask].view(len(counts), counts[0])]
    else:
        rows = [rewards[mask].unsqueeze(0) for rewards, mask in zip(step_rewards, step_mask)]
    normalised_rows = [
        (row - row.mean(dim=1, keepdim=True)) / (row.std(dim=1, keepdim=True) + eps) for row in rows
    ]
    normalised[step_mask] = torch.cat([row.flatten() for row in normalised_rows])
    num_rollouts = step_rewards.shape[0] * step_rewards.shape[1]
    at_ends = torch.zeros(
        num_rollouts, seq_len, dtype=step_rewards.dtype, device=step_rewards.device
    )
    at_ends.scatter_add_(
        1,
        step_ends.reshape(num_rollouts, -1).clamp(0, seq_len - 1),
        normalised.reshape(num_rollouts, -1),  # 0 on masked steps
    )
    # Sum over the steps that end at or after t: a cumulative sum from the right.
    return at_ends.flip(1).cumsum(1).flip(1)


def _passk_advantages(rewards: Tensor, scale_rewards: str, eps: float) -> Tensor:
    if scale_rewards == "batch":
        raise ValueError("grpo_passk supports scale_rewards='group' or 'none', not 'batch'")
    top_two = rewards.topk(2, dim=1)
    gap = top_two.values[:, :1] - top_two.values[:, 1:]  # (num_groups, 1)
    if scale_rewards == "group":
        gap = gap / (rewards.std(dim=1, keepdim=True) + eps)
    return torch.zeros_like(rewards).scatter(1, top_two.indices[:, :1], gap)


def _sign_advantages(rewards: Tensor, threshold: float | None) -> Tensor:
    if threshold is not None:
        return torch.where(rewards > threshold, 1.0, -1.0).to(rewards.dtype)
    if not ((rewards == 0) | (rewards == 1)).all():
        raise ValueError(
            "method 'sign' without a threshold needs binary rewards in {0, 1}; "
            "pass threshold=... for other rewards"
        )
    return 2 * rewards - 1


def check_rewards(rewards: Tensor) -> None:
    """Raise unless ``rewards`` is a finite floating-point (num_groups, group_size) tensor."""
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must be 2-D (num_groups, group_size), got shape {tuple(rewards.shape)}"
        )
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be floating point, got dtype {rewards.dtype}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite, got NaN or infinite values")


def empirical_pass_rates(rewards: Tensor) -> Tensor:
    """Per-prompt mean reward (num_prompts,): the pass rate estimate for binary rewards."""
    check_rewards(rewards)
    return rewards.mean(dim=1)


def zero_std_groups(rewards: Tensor, atol: float = 1e-8) -> Tensor:
    """Bool (num_prompts,): within-group std <= atol, i.e. all advantages vanish.

    TRL's definition: Bessel-corrected std and torch.isclose(std, 0) (atol = 1e-8); the mean
    of this mask is its `frac_reward_zero_std`. Needs group_size >= 2.
    """
    check_rewards(rewards)
    if rewards.shape[1] < 2:
        raise ValueError(
            f"a within-group std needs group_size >= 2, got rewards of shape {tuple(rewards.shape)}"
        )
    return rewards.std(dim=1) <= atol


def degenerate_fractions(rewards: Tensor, atol: float = 1e-8) -> dict:
    """Fractions of groups all correct (all rewards 1), all wrong (all 0), and degenerate.

    degenerate is the zero-std fraction (`zero_std_groups`), which also counts constant
    groups at other reward values; for binary rewards it is all_correct + all_wrong.
    """
    degenerate = zero_std_groups(rewards, atol)
    return {
        "all_correct": (rewards == 1).all(dim=1).double().mean().item(),
        "all_wrong": (rewards == 0).all(dim=1).double().mean().item(),
        "degenerate": degenerate.double().mean().item(),
    }


def zero_advantage_fractions(
    advantages: Tensor, completion_mask: Tensor, atol: float = 1e-8
) -> dict:
    """Fractions of rollouts and of completion tokens whose advantage is |A| <= atol.

    Args: advantages (num_prompts, G) or (num_prompts * G,), one per completion, or
    (num_prompts * G, T) per token (process credit); completion_mask (num_prompts * G, T), 1 on
    real tokens. The token fraction weights each rollout by its length: what a token-level loss
    (DAPO) sees. With per-token advantages a rollout counts as zero when all its real tokens are.
    """
    mask = completion_mask.double()
    # A tolerance, not == 0: the mean of G equal floats need not round back to their value, so a
    # constant group's centred rewards can be ~1e-17 (~1e-13 after GRPO's division by eps).
    zero = advantages.abs() <= atol
    if zero.dim() == 2 and zero.shape == completion_mask.shape:  # per token
        zero_rollouts = (zero | (completion_mask == 0)).all(dim=1).double()
        zero_tokens = (zero.double() * mask).sum()
    else:
        zero_rollouts = zero.reshape(-1).double()
        if completion_mask.dim() != 2 or completion_mask.shape[0] != zero_rollouts.numel():
            raise ValueError(
                f"completion_mask must be (num_rollouts = {zero_rollouts.numel()}, T), "
                f"got shape {tuple(completion_mask.shape)}"
            )
        zero_tokens = zero_rollouts @ mask.sum(dim=1)
    return {
        "rollouts": zero_rollouts.mean().item(),
        "tokens": (zero_tokens / mask.sum().clamp(min=1)).item(),
    }


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
    mean = (returns * mask).sum() / (count + _WHITEN_EPS)
    variance = ((returns - mean) ** 2 * mask).sum() / (count + _WHITEN_EPS) * count / (count - 1)
    return (returns - mean) * (variance + _WHITEN_EPS).rsqrt() * mask, returns


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
