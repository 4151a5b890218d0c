r"""Per-token GRPO loss.

For completion i with tokens t = 1..L_i, sampled from pi_old, the ratio is
rho_it = pi(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t) and the per-token loss is

    l_it = -min(rho_it A_i, clip(rho_it, 1 - epsilon, 1 + epsilon_high) A_i)
           + beta * KL_it(pi || pi_ref)

where A_i is the sequence's advantage (see ``advantages.py``) and KL_it is a
per-token sample estimate of the KL divergence. ``aggregate`` then reduces the
(batch, seq_len) tensor to a scalar; the choice of normaliser (``loss_type``)
decides how much each token weighs:

    grpo          1/B sum_i 1/L_i sum_t l_it
    dr_grpo       1/(B * max_completion_length) sum_i sum_t l_it
    bnpo, dapo    1/(sum_i L_i) sum_i sum_t l_it
    length_alpha  1/B sum_i f_alpha(L_i) sum_t l_it,   f_alpha(L) = L^(alpha - 1)

Names follow TRL's ``GRPOConfig`` (``beta``, ``epsilon``, ``epsilon_high``,
``loss_type``, ``max_completion_length``). verl calls these reductions
``loss_agg_mode``: "seq-mean-token-mean" (grpo), "seq-mean-token-sum-norm"
(dr_grpo) and "token-mean" (bnpo/dapo).
"""

import torch
from torch import Tensor

LOSS_TYPES = ("grpo", "dr_grpo", "bnpo", "dapo", "length_alpha")
KL_ESTIMATORS = ("k1", "k2", "k3")


def clipped_surrogate(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate, negated so that it is a loss.

    Args:
        log_probs, old_log_probs: (batch, seq_len) log pi and log pi_old of the
            sampled tokens. pi_old is a constant of the objective, so
            ``old_log_probs`` is detached: passing ``log_probs`` itself (TRL with
            ``num_iterations=1``) still gives the policy gradient.
        advantages: (batch,), broadcast over the tokens of each sequence.
        epsilon, epsilon_high: clip the ratio to [1 - epsilon, 1 + epsilon_high];
            epsilon_high defaults to epsilon (TRL), DAPO's "clip-higher" raises it.

    Returns:
        per_token_loss: (batch, seq_len).
        is_clipped: (batch, seq_len) bool, True where the clipped term is the
            minimum: rho > 1 + epsilon_high with A > 0, or rho < 1 - epsilon with
            A < 0 (TRL's ``clip_ratio``). These tokens get no gradient.
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if epsilon < 0 or epsilon_high < 0:
        raise ValueError(
            f"epsilon and epsilon_high must be >= 0, got {epsilon} and {epsilon_high}"
        )
    if log_probs.dim() != 2:
        raise ValueError(
            f"log_probs must be 2-D (batch, seq_len), got shape {tuple(log_probs.shape)}"
        )
    _check_same_shape("log_probs", log_probs, "old_log_probs", old_log_probs)
    if advantages.shape != log_probs.shape[:1]:
        raise ValueError(
            f"advantages must have shape (batch,) = {tuple(log_probs.shape[:1])}, "
            f"got {tuple(advantages.shape)}"
        )

    ratio = torch.exp(log_probs - old_log_probs.detach())
    advantages = advantages.unsqueeze(1)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * advantages
    is_clipped = clipped < unclipped
    return -torch.minimum(unclipped, clipped), is_clipped


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.

    With x = log(pi / pi_ref) at the sampled token (Schulman, "Approximating
    KL divergence", 2020):

        k1 = x                      unbiased, high variance, can be negative
        k2 = x^2 / 2                biased, low variance, >= 0
        k3 = exp(-x) - 1 + x        unbiased, low variance, >= 0 (TRL, GRPO paper)

    k3 is unbiased because E_pi[pi_ref / pi] = 1, so it is k1 plus a zero-mean
    control variate.

    log_probs, ref_log_probs: (batch, seq_len); the frozen reference is detached.
    Returns kl: (batch, seq_len).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
    _check_same_shape("log_probs", log_probs, "ref_log_probs", ref_log_probs)
    log_ratio = log_probs - ref_log_probs.detach()
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return torch.exp(-log_ratio) - 1 + log_ratio


def length_weights(lengths: Tensor, alpha: float) -> Tensor:
    """f_alpha(L) = L^(alpha - 1) for lengths: (batch,) > 0. alpha = 0 gives 1/L (grpo)."""
    if not (lengths > 0).all():
        raise ValueError(f"lengths must be positive, got {lengths.tolist()}")
    lengths = lengths if lengths.is_floating_point() else lengths.to(torch.get_default_dtype())
    return lengths ** (alpha - 1)


def aggregate(
    per_token_loss: Tensor,
    mask: Tensor,
    loss_type: str = "grpo",
    *,
    max_completion_length: int | None = None,
    alpha: float | None = None,
) -> Tensor:
    """Reduce a (batch, seq_len) per-token loss to a scalar.

    With L_i the number of unmasked tokens of sequence i and B the batch size:

    - "grpo": 1/B sum_i (1/L_i) sum_t l_it. TRL clamps L_i at 1; we raise on
      an empty sequence instead, as it is almost always a bug in the mask.
    - "dr_grpo": sum_it l_it / (B * max_completion_length), with
      max_completion_length defaulting to seq_len.
    - "bnpo", "dapo": sum_it l_it / sum_i L_i. TRL's "dapo" divides by the
      token count over all processes, which is the same on one process.
    - "length_alpha": 1/B sum_i L_i^(alpha - 1) sum_t l_it. alpha = 0 gives
      "grpo"; alpha = 1 gives sum_it l_it / B, which is "dr_grpo" times
      max_completion_length.

    per_token_loss: (batch, seq_len); mask: (batch, seq_len) of 0/1, 1 for
    completion tokens. ``max_completion_length`` is used by "dr_grpo" only,
    ``alpha`` by "length_alpha" only.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
    _check_same_shape("per_token_loss", per_token_loss, "mask", mask)
    mask = mask.to(per_token_loss.dtype)
    sequence_sums = (per_token_loss * mask).sum(dim=1)
    lengths = mask.sum(dim=1)
    num_sequences = per_token_loss.shape[0]

    if loss_type in ("grpo", "length_alpha") and not (lengths > 0).all():
        raise ValueError(
            f"loss_type {loss_type!r} divides by sequence lengths, but rows "
            f"{(lengths == 0).nonzero().flatten().tolist()} of the mask are all zero"
        )
    if loss_type == "grpo":
        return (sequence_sums / lengths).mean()
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            max_completion_length = per_token_loss.shape[1]
        if max_completion_length <= 0:
            raise ValueError(f"max_completion_length must be > 0, got {max_completion_length}")
        return sequence_sums.sum() / (num_sequences * max_completion_length)
    if loss_type == "length_alpha":
        if alpha is None:
            raise ValueError("loss_type 'length_alpha' needs alpha")
        return (length_weights(lengths, alpha) * sequence_sums).sum() / num_sequences
    if lengths.sum() == 0:
        raise ValueError(f"loss_type {loss_type!r} needs at least one unmasked token")
    return sequence_sums.sum() / lengths.sum()


def grpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    ref_log_probs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "grpo",
    max_completion_length: int | None = None,
    alpha: float | None = None,
    kl_estimator: str = "k3",
) -> tuple[Tensor, dict[str, float]]:
    """GRPO loss: clipped surrogate plus beta * KL, reduced by ``loss_type``.

    log_probs, old_log_probs, mask: (batch, seq_len); advantages: (batch,).
    ref_log_probs: (batch, seq_len), or None when beta == 0 (TRL's default since
    DAPO and Dr. GRPO dropped the KL term). ``alpha`` is for "length_alpha"
    only; this argument is not in TRL, which has no such loss_type.

    Returns the scalar loss and stats: "kl", the masked mean of the KL estimate
    (0.0 without a reference), and "clip_ratio", the fraction of unmasked
    tokens that are clipped.
    """
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_log_probs is None:
        raise ValueError(f"beta = {beta} > 0 needs ref_log_probs")
    per_token_loss, is_clipped = clipped_surrogate(
        log_probs, old_log_probs, advantages, epsilon=epsilon, epsilon_high=epsilon_high
    )
    _check_same_shape("log_probs", log_probs, "mask", mask)
    mask = mask.to(log_probs.dtype)
    # Stats are logged for monitoring, so an all-masked batch reports 0, not NaN.
    num_tokens = mask.sum().clamp(min=1)
    kl_mean = 0.0
    if ref_log_probs is not None:
        kl = kl_penalty(log_probs, ref_log_probs, kl_estimator)
        per_token_loss = per_token_loss + beta * kl
        kl_mean = ((kl * mask).sum() / num_tokens).item()
    loss = aggregate(
        per_token_loss, mask, loss_type, max_completion_length=max_completion_length, alpha=alpha
    )
    stats = {"kl": kl_mean, "clip_ratio": ((is_clipped * mask).sum() / num_tokens).item()}
    return loss, stats


def _check_same_shape(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"{name_a} and {name_b} must have the same shape, got "
            f"{tuple(a.shape)} and {tuple(b.shape)}"
        )
