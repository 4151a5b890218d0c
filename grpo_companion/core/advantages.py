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

Conventions for "grpo" follow TRL's ``GRPOTrainer``: ``std`` is Bessel-corrected
(``torch.std``), ``eps = 1e-4`` is added to the std (outside the square root),
and ``scale_rewards`` picks the std: "group" (one per group), "batch" (one over
all rewards of the batch, while the means stay per group) or "none" (no
division, i.e. "dr_grpo"). The book also uses the population std
(``unbiased_std=False``), which maps a two-completion group with rewards {1, 0}
to about +-1 instead of +-0.707. verl also uses ``torch.std`` but its epsilon is
1e-6.

"grpo", "dr_grpo", "rloo" and "softmax" are zero-sum within each group.
"""

import torch
from torch import Tensor

METHODS = ("grpo", "dr_grpo", "rloo", "sign", "softmax")
SCALE_REWARDS = ("group", "batch", "none")
# Methods whose baseline is built from the other completions of the group.
_NEEDS_GROUP = ("grpo", "dr_grpo", "rloo", "softmax")


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

    Args:
        rewards: (num_groups, group_size) floating point, one row per prompt.
        method: one of ``METHODS`` (see the module docstring).
        scale_rewards: "group", "batch" or "none"; only used by "grpo".
        eps: added to the std before dividing ("grpo" only). TRL: 1e-4.
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
    _check_rewards(rewards)
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

    if method == "rloo":
        leave_one_out_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (group_size - 1)
        return rewards - leave_one_out_mean

    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if method == "dr_grpo" or scale_rewards == "none":
        return centered

    correction = 1 if unbiased_std else 0
    if scale_rewards == "group":
        std = rewards.std(dim=1, keepdim=True, correction=correction)
    else:
        std = rewards.std(correction=correction)
    return centered / (std + eps)


def _sign_advantages(rewards: Tensor, threshold: float | None) -> Tensor:
    if threshold is not None:
        return torch.where(rewards > threshold, 1.0, -1.0).to(rewards.dtype)
    if not ((rewards == 0) | (rewards == 1)).all():
        raise ValueError(
            "method 'sign' without a threshold needs binary rewards in {0, 1}; "
            "pass threshold=... for other rewards"
        )
    return 2 * rewards - 1


def _check_rewards(rewards: Tensor) -> None:
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
    _check_rewards(rewards)
    return rewards.mean(dim=1)


def zero_std_groups(rewards: Tensor, atol: float = 1e-8) -> Tensor:
    """Bool (num_prompts,): within-group std <= atol, i.e. all advantages vanish.

    TRL's definition: Bessel-corrected std and torch.isclose(std, 0) (atol = 1e-8); the mean
    of this mask is its `frac_reward_zero_std`. Needs group_size >= 2.
    """
    _check_rewards(rewards)
    if rewards.shape[1] < 2:
        raise ValueError(f"a within-group std needs group_size >= 2, got rewards of shape "
                         f"{tuple(rewards.shape)}")
    return rewards.std(dim=1) <= atol


def degenerate_fractions(rewards: Tensor, atol: float = 1e-8) -> dict:
    """Fractions of groups all correct (all rewards 1), all wrong (all 0), and degenerate.

    degenerate is the zero-std fraction (`zero_std_groups`), which also counts constant
    groups at other reward values; for binary rewards it is all_correct + all_wrong.
    """
    degenerate = zero_std_groups(rewards, atol)
    return {"all_correct": (rewards == 1).all(dim=1).double().mean().item(),
            "all_wrong": (rewards == 0).all(dim=1).double().mean().item(),
            "degenerate": degenerate.double().mean().item()}
