r"""Group-relative advantages: each completion's baseline from the other completions of its group.

For one prompt we sample a group of G completions (TRL: ``num_generations``) with rewards
r_1, ..., r_G; `group_advantages` turns them into advantages A_1, ..., A_G without a learned
value function, by one of `METHODS`: GRPO's, Dr. GRPO's, RLOO, sign, softmax, and verl's
``grpo_passk``, ``reinforce_plus_plus_baseline`` and ``gpg`` (the formulas and where each
library differs: its docstring). "grpo" follows TRL's ``GRPOTrainer``: a Bessel-corrected std
plus ``eps = 1e-4`` (verl: 1e-6), which ``scale_rewards`` takes per group ("group"), over the
batch ("batch", the means staying per group) or not at all ("none": "dr_grpo").
`BATCH_METHODS` couple the groups of a batch.

`process_advantages` gives the per-token advantages of DeepSeekMath's process supervision from
step rewards; `zero_std_groups`, `degenerate_fractions` and `zero_advantage_fractions` count
the groups and tokens without a policy gradient. verl's estimators that need more than the
(B, G) rewards, and GDPO, are in `core.verl_estimators`; the KL in the reward (verl's
``use_kl_in_reward``) is `core.kl.kl_in_reward`.

Chapters: :doc:`/book/02_group_baseline` (GRPO's baseline), :doc:`/book/09_advantage_zoo`
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
WHITEN_EPS = 1e-8


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

        grpo     A_i = (r_i - mean(r)) / (std(r) + eps)
        dr_grpo  A_i = r_i - mean(r)
        rloo     A_i = r_i - 1/(G-1) * sum_{j != i} r_j  =  G/(G-1) * (r_i - mean(r))
        sign     A_i = 2 r_i - 1 for r_i in {0, 1}, else +1 if r_i > threshold else -1
        softmax  A_i = G * softmax(r / temperature)_i - 1
        grpo_passk  only the best completion of the group gets r_max - r_second_max (divided by
                 the group's std + eps when scale_rewards="group"), every other one 0
        reinforce_plus_plus_baseline  r_i - mean(r), then whitened over the whole batch
        gpg      alpha * (r_i - mean(r)), alpha = (B G) / (number of nonzero rewards in the batch)

    "grpo", "dr_grpo", "rloo" and "softmax" are zero-sum within each group. The last three are
    verl's (``algorithm.adv_estimator``, ``verl/trainer/ppo/core_algos.py``). grpo_passk (Tang
    et al., arXiv 2503.19595): the baseline of completion i is max_{j != i} r_j, so without the
    std sum_i A_i s_i estimates grad pass@G for binary rewards; ties at the top give 0 to all.
    reinforce_plus_plus_baseline: verl whitens over the batch's *tokens* (``masked_whiten``), so
    completion i weighs L_i; here each completion counts once, as the rewards carry no lengths:
    with N completions all of length L verl's is this times sqrt((N L - 1) / (L (N - 1)))
    (tests/core/test_verl_equivalence.py). gpg: verl's alpha; the paper (Chu et al., arXiv
    2504.02546) writes alpha = B / (B - M), M the samples whose group has zero advantage.

    Args:
        rewards: (num_groups, group_size) floating point, one row per prompt.
        method: one of ``METHODS`` (above).
        scale_rewards: "group", "batch" or "none" (or TRL's True / False for "group" /
            "none"); used by "grpo" and "grpo_passk" ("group" is verl's
            ``norm_adv_by_std_in_grpo=True``; "batch" is not allowed there).
        eps: added to the std before dividing ("grpo", "grpo_passk"). TRL: 1e-4, verl: 1e-6.
        unbiased_std: Bessel-corrected std (TRL, verl) if True, population
            std if False ("grpo" only), which maps a two-completion group with rewards
            {1, 0} to about +-1 instead of +-0.707.
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
        return (centered - centered.mean()) / (centered.var() + WHITEN_EPS).sqrt()
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


def shuffle_step_rewards(step_rewards: Tensor, step_mask: Tensor, generator) -> Tensor:
    """Process credit's placebo: in each group, the rewards of the worked steps (every present
    step but each completion's last, the outcome) permuted at random among those steps.

    The group keeps the same labels (so `process_advantages` normalises them alike) at the same
    positions (the same density), but a label no longer says which step earned it: what process
    credit adds besides information. Shapes as `process_advantages`' (B, G, S); `generator` a
    `torch.Generator` on the rewards' device."""
    last = step_mask.cumsum(-1) == step_mask.sum(-1, keepdim=True)  # each row's final step
    worked = step_mask.bool() & ~(last & step_mask.bool())
    shuffled = step_rewards.clone()
    for group in range(step_rewards.shape[0]):
        values = step_rewards[group][worked[group]]
        order = torch.randperm(len(values), generator=generator, device=values.device)
        shuffled[group][worked[group]] = values[order]
    return shuffled


def per_step_process_advantages(advantages: Tensor, step_ends: Tensor, step_mask: Tensor) -> Tensor:
    """Process advantages `(B * G, T)` divided, token by token, by the number of steps that end
    at or after the token (from `step_ends`, `step_mask` (B, G, S)): the mean of the normalised
    rewards still ahead instead of their sum, so an early token no longer carries k + 1 terms
    against a late token's one. Tokens after the last step keep their 0."""
    num_rollouts, seq_len = advantages.shape
    mask = step_mask.reshape(num_rollouts, -1).to(advantages.dtype)
    at_ends = torch.zeros_like(advantages)
    at_ends.scatter_add_(1, step_ends.reshape(num_rollouts, -1).clamp(0, seq_len - 1), mask)
    ahead = at_ends.flip(1).cumsum(1).flip(1)  # steps that end at or after each token
    return advantages / ahead.clamp(min=1)


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
