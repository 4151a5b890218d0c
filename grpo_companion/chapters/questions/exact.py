r"""The exact answers of chapter 14, one function per question, on chapter 1's sequence policy.

`surrogate_at_ratio_one`: TRL's loss at pi = pi_old, whose value is 0 while its gradient is
minus the group estimator over the length (section 1). `truncated_degenerate_rate` and
`simulated_zero_std_fraction`: how often a group's rewards are all equal (TRL's
``frac_reward_zero_std``) when ``max_completion_length`` cuts completions before their answer
(section 2). `kl_placement_gradients` and `kl_placement_table`: the mean gradient of each way TRL
and verl put KL(pi || pi_ref) into GRPO (k1, k2, k3 or (pi / pi_old) k3 in the loss; k1 in the
reward with no baseline, the group mean or leave-one-out) against the gradient of the sequence
KL (section 5). `token_weights`: d loss / d l_it for each ``loss_type``, TRL's "bnpo" taken per
micro-batch (section 7). `entropy_change`: the entropy's rate of change along an update,
-Cov_pi(log pi(y), s(y) . d), three ways (section 8). `sequence_ratio_cap_length`: the length at
which a sequence's importance weight reaches TRL's cap (section 9).

Chapter: :doc:`/book/14_questions`
"""

import math

import pandas as pd
import torch
from torch import Tensor

from grpo_companion.chapters.questions.runs import sequence_entropy
from grpo_companion.core.group_estimators import gradient_weight, group_estimator_moments
from grpo_companion.core.kl import exact_kl, kl_estimate_gradients, kl_in_reward, kl_penalty
from grpo_companion.core.losses import aggregate, grpo_loss
from grpo_companion.core.policy_gradient import SequencePolicy

# KL placements: key -> (label, where, `kl_penalty` estimator, times pi / pi_old, baseline).
KL_PLACEMENTS = {
    "k1_loss": ("k1 in the loss", "loss", "k1", False, None),
    "k2_loss": ("k2 in the loss", "loss", "k2", False, None),
    "k3_loss": ("k3 in the loss (use_bias_correction_kl=False)", "loss", "k3", False, None),
    "ratio_k3_loss": ("ratio x k3 in the loss (TRL 1.16's default)", "loss", "k3", True, None),
    "k1_reward": ("k1 in the reward, no baseline", "reward", "k1", False, None),
    "k1_reward_group_mean": ("k1 in the reward, group mean", "reward", "k1", False, "dr_grpo"),
    "k1_reward_rloo": ("k1 in the reward, leave-one-out", "reward", "k1", False, "rloo"),
}


def surrogate_at_ratio_one(
    policy: SequencePolicy,
    logits: Tensor,
    sequences: Tensor,
    advantages: Tensor,
    loss_type: str = "dapo",
) -> tuple[float, Tensor]:
    """`grpo_loss` at pi = pi_old (TRL's ``num_iterations=1``: ``old_per_token_logps =
    per_token_logps.detach()``), beta = 0: its value and its gradient in the logits,
    `(num_params,)`. `sequences: (n, length)`, `advantages: (n,)`."""
    leaf = logits.detach().clone().requires_grad_(True)
    log_probs = policy.token_log_probs(leaf, sequences)
    loss, _ = grpo_loss(
        log_probs, log_probs.detach(), None, advantages, torch.ones_like(log_probs),
        loss_type=loss_type,
    )  # fmt: skip
    (gradient,) = torch.autograd.grad(loss, leaf)
    return loss.item(), gradient.flatten()


def truncated_degenerate_rate(
    pass_rate: float, truncated_fraction: float, group_size: int
) -> float:
    """P(a group of G has equal rewards) when a fraction c of completions is cut before its
    answer and scores 0, independently of its correctness: p' ^ G + (1 - p') ^ G, p' = p (1 - c)."""
    if not (0 <= pass_rate <= 1 and 0 <= truncated_fraction <= 1) or group_size < 2:
        raise ValueError(
            f"need p, c in [0, 1] and G >= 2, got {pass_rate}, {truncated_fraction}, {group_size}"
        )
    seen = pass_rate * (1 - truncated_fraction)
    return seen**group_size + (1 - seen) ** group_size


def simulated_zero_std_fraction(
    policy: SequencePolicy,
    logits: Tensor,
    reward_table: Tensor,
    group_size: int,
    num_groups: int,
    truncated_fraction: float,
    generator: torch.Generator,
) -> float:
    """`num_groups` groups of G sequences drawn from pi, each completion cut (reward 0) with
    probability `truncated_fraction`: the fraction of groups whose rewards are all equal."""
    draws = policy.sample(logits, num_groups * group_size, generator)
    cut = torch.rand(num_groups * group_size, generator=generator, dtype=torch.float64)
    rewards = torch.where(cut < truncated_fraction, 0.0, reward_table[draws])
    rewards = rewards.view(num_groups, group_size)
    return float((rewards == rewards[:, :1]).all(dim=1).double().mean())


def expected_in_loss_gradient(
    policy: SequencePolicy,
    logits: Tensor,
    ref_logits: Tensor,
    estimator: str,
    use_bias_correction_kl: bool,
) -> Tensor:
    """sum_y pi_old(y) grad sum_t KL_t(y), pi_old = pi detached: the mean gradient of a per-token
    KL estimate (`kl_penalty`, times the differentiable pi / pi_old if `use_bias_correction_kl`)
    summed over each sequence's tokens, `(num_params,)`: pi_old @ `kl_estimate_gradients`."""
    pi_old = policy.probs(logits).detach()
    return pi_old @ kl_estimate_gradients(
        policy, logits, ref_logits, estimator, use_bias_correction_kl
    )


def expected_in_reward_gradient(
    policy: SequencePolicy,
    logits: Tensor,
    ref_logits: Tensor,
    group_size: int,
    baseline: str | None,
) -> Tensor:
    """The mean update that KL(pi || pi_ref) in the reward (`kl_in_reward`, beta = 1, on zero
    task rewards) adds to a descent step, as a gradient of the penalty, `(num_params,)`: minus
    the exact mean of the group estimator (`group_estimator_moments`) of the reward -k1(y), or
    E[k1(y) s(y)] without a baseline. k1(y) = log pi(y) / pi_ref(y), detached."""
    sequences = policy.all_sequences()
    token_log_probs = policy.token_log_probs(logits, sequences)
    ref_token_log_probs = policy.token_log_probs(ref_logits, sequences)
    k1 = kl_penalty(token_log_probs, ref_token_log_probs, "k1").sum(dim=1).detach()
    rewards = kl_in_reward(torch.zeros(1, len(k1), dtype=k1.dtype), k1[None], 1.0)[0]
    if baseline is None:
        return -(policy.probs(logits).detach() * rewards) @ policy.scores(logits, sequences)
    return -group_estimator_moments(policy, logits, rewards, group_size, baseline)["mean"]


def kl_placement_gradients(
    policy: SequencePolicy, logits: Tensor, ref_logits: Tensor, group_size: int
) -> dict[str, Tensor]:
    """{key of `KL_PLACEMENTS`: its mean gradient, `(num_params,)`}, and "grad KL(pi || ref)":
    the exact gradient of the sequence KL."""
    gradients = {}
    for name, (_, where, estimator, corrected, baseline) in KL_PLACEMENTS.items():
        if where == "loss":
            gradients[name] = expected_in_loss_gradient(
                policy, logits, ref_logits, estimator, corrected
            )
        else:
            gradients[name] = expected_in_reward_gradient(
                policy, logits, ref_logits, group_size, baseline
            )
    leaf = logits.detach().clone().requires_grad_(True)
    sequences = policy.all_sequences()
    kl = exact_kl(policy.log_prob(leaf, sequences), policy.log_prob(ref_logits.detach(), sequences))
    gradients["grad KL(pi || ref)"] = torch.autograd.grad(kl, leaf)[0].flatten()
    return gradients


def kl_placement_table(gradients: dict[str, Tensor]) -> pd.DataFrame:
    """Each placement's mean gradient against grad KL(pi || ref): w, its component along it in
    units of it, and the rest, relative to its norm (`gradient_weight`; w = 1 and 0 is the
    exact gradient, w != 1 and 0 a rescaled one)."""
    target = gradients["grad KL(pi || ref)"]
    rows = []
    for key, (label, *_) in KL_PLACEMENTS.items():
        weight, residual = gradient_weight(gradients[key], target)
        rows.append({"key": key, "placement": label, "w": weight, "off-direction part": residual})
    return pd.DataFrame(rows).set_index("key")


def token_weights(
    lengths: Tensor, loss_type: str, max_completion_length: int, micro_batch_size: int
) -> Tensor:
    """d loss / d l_it at one token of each completion, `(n,)`, for completions of `lengths:
    (n,)`: `aggregate` under `loss_type` on the whole batch, or, for "bnpo", on consecutive
    micro-batches of `micro_batch_size` completions whose losses are averaged (TRL: each
    micro-batch's loss is divided by gradient_accumulation_steps)."""
    mask = (torch.arange(max_completion_length) < lengths[:, None]).to(torch.float64)
    per_token = torch.zeros_like(mask, requires_grad=True)
    if loss_type == "bnpo":
        parts = torch.split(torch.arange(len(lengths)), micro_batch_size)
        loss = sum(aggregate(per_token[rows], mask[rows], "bnpo") for rows in parts) / len(parts)
    else:
        loss = aggregate(per_token, mask, loss_type, max_completion_length=max_completion_length)
    (gradient,) = torch.autograd.grad(loss, per_token)
    return gradient[:, 0]


def sequence_entropy_gradient(policy: SequencePolicy, logits: Tensor) -> Tensor:
    """grad H(pi) in the logits, `(num_params,)`, by autograd on -sum_y pi(y) log pi(y)."""
    leaf = logits.detach().clone().requires_grad_(True)
    log_probs = policy.log_prob(leaf, policy.all_sequences())
    (gradient,) = torch.autograd.grad(-(log_probs.exp() * log_probs).sum(), leaf)
    return gradient.flatten()


def entropy_change(
    policy: SequencePolicy, logits: Tensor, direction: Tensor, step: float = 1e-5
) -> dict[str, float]:
    """The rate of change of H(pi) along `direction: (num_params,)` of the logits, three ways:
    "covariance", -Cov_pi(log pi(y), s(y) . d), since grad H = -E[s log pi] when E[s] = 0;
    "gradient", grad H . d;
    "finite difference", (H(theta + h d) - H(theta - h d)) / 2h with h = `step`."""
    sequences = policy.all_sequences()
    probs = policy.probs(logits).detach()
    log_probs = probs.log()
    change = policy.scores(logits, sequences) @ direction  # s(y) . d
    covariance = probs @ (log_probs * change) - (probs @ log_probs) * (probs @ change)
    shaped = direction.view(policy.logits_shape)
    forward = sequence_entropy(policy, logits + step * shaped)
    backward = sequence_entropy(policy, logits - step * shaped)
    return {
        "covariance": float(-covariance),
        "gradient": float(sequence_entropy_gradient(policy, logits) @ direction),
        "finite difference": (forward - backward) / (2 * step),
    }


def sequence_ratio_cap_length(token_log_difference: float, clip_max: float) -> float:
    """The length at which a sequence's importance weight exp(L * delta), with the same
    per-token log-probability difference delta at each token, reaches TRL's
    ``vllm_importance_sampling_clip_max``: L = log(clip_max) / delta."""
    if token_log_difference <= 0 or clip_max <= 1:
        raise ValueError(f"need delta > 0 and clip_max > 1, got {token_log_difference}, {clip_max}")
    return math.log(clip_max) / token_log_difference
