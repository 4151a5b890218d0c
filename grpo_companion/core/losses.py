r"""Per-token GRPO loss, and the policy-loss variants of TRL and verl.

For completion i with tokens t = 1..L_i, sampled from pi_old, the ratio is
rho_it = pi(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t) and the per-token loss is::

    l_it = -min(rho_it A_i, clip(rho_it, 1 - epsilon, 1 + epsilon_high) A_i)
           + beta * KL_it(pi || pi_ref)

where A_i is the sequence's advantage (see ``advantages.py``) and KL_it is a per-token sample
estimate of the KL divergence (see ``kl.py``). Every loss also takes per-token advantages A_it,
shape (batch, seq_len) instead of (batch,), as process supervision gives them
(``advantages.process_advantages``); A_i broadcast over the tokens gives the same loss and
gradient as A_i itself. (TRL's trainer has per-sequence advantages only.) `aggregate` then
reduces the (batch, seq_len) tensor to a scalar; its ``loss_type`` picks the normaliser, which
decides how much each token weighs (its docstring, with verl's ``loss_agg_mode`` for each).

Names follow TRL's ``GRPOConfig`` (``beta``, ``epsilon``, ``epsilon_high``, ``delta``,
``loss_type``, ``max_completion_length``, ``importance_sampling_level``, ``sapo_temperature_*``,
``vespo_*``, ``off_policy_mask_threshold``, ``use_bias_correction_kl``); TRL 1.16.0's
``GRPOTrainer._compute_loss`` is the source of each variant's formula (see ``policy_loss``).

Chapter: :doc:`/book/03_grpo_loss`
"""

import math

import torch
from torch import Tensor

from grpo_companion.core.importance import log_importance_weights
from grpo_companion.core.kl import bias_corrected_kl, kl_penalty

LOSS_TYPES = (
    "grpo", "dr_grpo", "bnpo", "dapo", "length_alpha", "luspo", "cispo", "sapo", "vespo"
)  # fmt: skip
# The loss types whose policy term is the PPO clipped surrogate (the others: `policy_loss`).
CLIPPED_LOSS_TYPES = ("grpo", "dr_grpo", "bnpo", "dapo", "length_alpha", "luspo")


def clipped_surrogate(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    mask: Tensor | None = None,
    importance_sampling_level: str = "token",
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate, negated so that it is a loss.

    Chapter: :doc:`/book/03_grpo_loss`

    Args:
        log_probs, old_log_probs: (batch, seq_len) log pi and log pi_old of the
            sampled tokens. pi_old is a constant of the objective, so
            ``old_log_probs`` is detached: passing ``log_probs`` itself (TRL with
            ``num_iterations=1``) still gives the policy gradient.
        advantages: (batch,), broadcast over the tokens of each sequence, or (batch, seq_len),
            one per token (not with importance_sampling_level "sequence", see
            `check_policy_inputs`).
        epsilon, epsilon_high: clip the ratio to [1 - epsilon, 1 + epsilon_high];
            epsilon_high defaults to epsilon (TRL), DAPO's "clip-higher" raises it.
        delta: TRL's two-sided clipping: the unclipped ratio is capped at ``delta``, so that
            -min(min(rho, delta) A, clip(rho) A) bounds the loss of a negative advantage at
            -delta A (TRL recommends delta > 1 + epsilon_high, which leaves A > 0 as PPO's).
            With delta > 1 + epsilon_high this is verl's dual-clip PPO with
            ``clip_ratio_c = delta`` (Ye et al. 2019; verl's default is 3 and always on).
        mask, importance_sampling_level: see `importance.log_importance_weights`; "sequence"
            is GSPO.

    Returns:
        per_token_loss: (batch, seq_len).
        is_clipped: (batch, seq_len) bool, True where the clipped term is the
            minimum: rho > 1 + epsilon_high with A > 0, or rho < 1 - epsilon with
            A < 0 (TRL's ``clip_ratio/region_mean``). These tokens get no gradient.
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if epsilon < 0 or epsilon_high < 0:
        raise ValueError(f"epsilon and epsilon_high must be >= 0, got {epsilon} and {epsilon_high}")
    if delta is not None and delta <= 1:
        raise ValueError(f"delta must be > 1, got {delta}")
    check_policy_inputs(log_probs, old_log_probs, advantages, importance_sampling_level)
    ratio = torch.exp(
        log_importance_weights(log_probs, old_log_probs, mask, importance_sampling_level)
    )
    column = as_columns(advantages)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * column
    capped = ratio if delta is None else torch.clamp(ratio, max=delta)
    per_token_loss = -torch.minimum(capped * column, clipped)
    low, high = clip_regions(ratio, advantages, epsilon, epsilon_high)
    return per_token_loss.expand_as(log_probs), (low | high).expand_as(log_probs)


def clip_regions(
    ratio: Tensor, advantages: Tensor, epsilon: float, epsilon_high: float
) -> tuple[Tensor, Tensor]:
    """TRL's clipped tokens, low (rho < 1 - epsilon, A < 0) and high (rho > 1 + epsilon_high,
    A > 0): ratio (batch, seq_len) or (batch, 1), advantages (batch,) or (batch, seq_len)."""
    advantages = as_columns(advantages)
    return (ratio < 1 - epsilon) & (advantages < 0), (ratio > 1 + epsilon_high) & (advantages > 0)


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    loss_type: str = "grpo",
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
) -> Tensor:
    """The per-token policy term of ``loss_type``, before the KL and the aggregation:
    (batch, seq_len). Inputs as `clipped_surrogate`; rho from `importance.log_importance_weights`.

    - the PPO clipped surrogate (`CLIPPED_LOSS_TYPES`, `clipped_surrogate`);
    - "cispo" (MiniMax-M1): -sg(min(rho, epsilon_high)) A log pi, a REINFORCE term weighted by
      the ratio capped at ``epsilon_high`` itself (TRL's convention: the cap is epsilon_high,
      not 1 + epsilon_high), so clipped tokens keep their gradient; verl's ``cispo`` also clips
      rho below, at 1 - clip_ratio_low, and TRL, followed here, does not;
    - "sapo" (Soft Adaptive Policy Optimization): -sigma(tau (rho - 1)) 4 / tau A, a smooth gate
      in place of the clip, tau = ``sapo_temperature_pos`` where A > 0, else ``_neg``;
    - "vespo": -sg(phi(w_i)) A log pi with w_i = exp(sum_t log rho_it) the sequence's ratio and
      phi(w) = exp(lambda) w^k exp(-lambda w) (phi(1) = 1), (k, lambda) = ``vespo_k_pos``,
      ``vespo_lambda_pos`` where A >= 0, else ``_neg``; TRL clamps the token log-ratios to
      [-20, 20] and log w to [log 1e-8, 20], and sets non-finite phi to 0.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
    if loss_type in CLIPPED_LOSS_TYPES:
        per_token_loss, _ = clipped_surrogate(
            log_probs, old_log_probs, advantages, epsilon=epsilon, epsilon_high=epsilon_high,
            delta=delta, mask=mask, importance_sampling_level=importance_sampling_level,
        )  # fmt: skip
        return per_token_loss
    check_policy_inputs(log_probs, old_log_probs, advantages, importance_sampling_level)
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    log_ratio = log_importance_weights(log_probs, old_log_probs, mask, importance_sampling_level)
    ratio = torch.exp(log_ratio)
    column = as_columns(advantages)  # with per-token advantages, each token's sign decides
    if loss_type == "cispo":
        per_token_loss = -torch.clamp(ratio, max=epsilon_high).detach() * column * log_probs
    elif loss_type == "sapo":
        tau = torch.where(
            column > 0, *column.new_tensor([sapo_temperature_pos, sapo_temperature_neg])
        )
        per_token_loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * column
    else:  # vespo: phi is a weight, not differentiated
        with torch.no_grad():
            token_log_ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0)
            log_w = (token_log_ratio * mask.to(log_probs.dtype)).sum(-1, keepdim=True)
            log_w = log_w.clamp(math.log(1e-8), 20.0)
            positive = column >= 0
            k = torch.where(positive, *column.new_tensor([vespo_k_pos, vespo_k_neg]))
            lam = torch.where(
                positive, *column.new_tensor([vespo_lambda_pos, vespo_lambda_neg])
            ).clamp(min=1e-4)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
            phi = phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        per_token_loss = -phi * column * log_probs
    return per_token_loss.expand_as(log_probs)


def off_policy_sequence_mask(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, threshold: float
) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's ``off_policy_mask_threshold``): (batch, 1),
    0 for a sequence with A_i < 0 whose mean token log(pi_old / pi) exceeds ``threshold``
    (a negative sample the policy has already moved away from), else 1. With per-token
    advantages (batch, seq_len) the mask is per token: the negative tokens of such a sequence."""
    mask = mask.to(log_probs.dtype)
    drift = (old_log_probs - log_probs.detach()).nan_to_num(nan=0.0)
    mean_drift = (drift * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
    keep = (as_columns(advantages) >= 0) | (mean_drift <= threshold)
    return keep.to(log_probs.dtype)


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
    allow_empty: bool = False,
) -> Tensor:
    """Reduce a (batch, seq_len) per-token loss to a scalar.

    Chapter: :doc:`/book/03_grpo_loss`

    With L_i the number of unmasked tokens of sequence i and B the batch size:

    - "grpo", "sapo": 1/B sum_i (1/L_i) sum_t l_it (verl's "seq-mean-token-mean"). TRL
      clamps L_i at 1; we raise on an empty sequence instead, as it is almost always a bug in
      the mask, unless ``allow_empty`` (TRL's ``mask_truncated_completions`` empties the
      truncated ones). An empty row counts in B, as in TRL; verl's "seq-mean" modes leave it
      out of B.
    - "dr_grpo": sum_it l_it / (B * max_completion_length), with
      max_completion_length defaulting to seq_len: verl 0.9.1's "seq-mean-token-sum-norm",
      whose L_max is the response width (``loss_mask.shape[-1]``, or ``loss_scale_factor``)
      (tests/core/test_verl_equivalence.py); earlier verl divided by L_max only, B times this.
    - "bnpo", "dapo", "cispo", "vespo": sum_it l_it / sum_i L_i (verl's "token-mean"). On one
      batch they agree; the trainer's micro-batches tell them apart: TRL's "bnpo" divides each
      micro-batch by its own token count and averages the micro-batches, as verl's
      "token-mean" does on its legacy worker (``loss / gradient_accumulation``, without
      ``use_dynamic_bsz``); "dapo" (and "cispo", "vespo") divides by the token count of the
      whole batch of rollouts, as verl's "token-mean" does given the global batch's count.
    - "luspo": sum_it l_it / B (verl's "seq-mean-token-sum").
    - "length_alpha": 1/B sum_i L_i^(alpha - 1) sum_t l_it. alpha = 0 gives
      "grpo"; alpha = 1 gives "luspo", which is "dr_grpo" times max_completion_length.

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

    if loss_type in ("grpo", "sapo", "length_alpha") and not (lengths > 0).all():
        if not allow_empty:
            raise ValueError(
                f"loss_type {loss_type!r} divides by sequence lengths, but rows "
                f"{(lengths == 0).nonzero().flatten().tolist()} of the mask are all zero"
            )
        lengths = lengths.clamp(min=1.0)  # an empty row's sum is 0: it counts in B only
    if loss_type in ("grpo", "sapo"):
        return (sequence_sums / lengths).mean()
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            max_completion_length = per_token_loss.shape[1]
        if max_completion_length <= 0:
            raise ValueError(f"max_completion_length must be > 0, got {max_completion_length}")
        return sequence_sums.sum() / (num_sequences * max_completion_length)
    if loss_type == "luspo":
        return sequence_sums.sum() / num_sequences
    if loss_type == "length_alpha":
        if alpha is None:
            raise ValueError("loss_type 'length_alpha' needs alpha")
        return (length_weights(lengths, alpha) * sequence_sums).sum() / num_sequences
    if lengths.sum() == 0:
        if allow_empty:
            return sequence_sums.sum()  # TRL: the token count is clamped at 1
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
    kl_clamp: bool = False,
    use_bias_correction_kl: bool = False,
    off_policy_mask_threshold: float | None = None,
    allow_empty: bool = False,
    **variant,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO loss: the policy term of ``loss_type`` plus beta * KL, reduced by ``loss_type``.

    log_probs, old_log_probs, mask: (batch, seq_len); advantages: (batch,) or (batch, seq_len)
    (per token, e.g. process supervision's).
    ref_log_probs: (batch, seq_len), or None when beta == 0 (TRL's default since
    DAPO and Dr. GRPO dropped the KL term). ``alpha`` is for "length_alpha"
    only; this argument is not in TRL, which has no such loss_type.
    ``use_bias_correction_kl`` multiplies the per-token KL by the (differentiable) ratio rho
    (TRL's option, True by default in TRL 1.16): the KL is estimated from tokens sampled from
    pi_old, and rho reweights them to pi (`bias_corrected_kl`). ``kl_clamp``: verl's bounds on
    k3 (`kl_penalty`). Both are in `grpo_companion.core.kl`, as is every other KL quantity.
    ``off_policy_mask_threshold``: `off_policy_sequence_mask` multiplies the policy term.
    ``variant``: the keyword options of `policy_loss` (``delta``, ``importance_sampling_level``,
    ``sapo_temperature_pos``, ...).

    Returns the scalar loss and stats: "kl", the masked mean of the KL estimate (bias-corrected
    as in the loss; 0.0 without a reference), "clip_ratio", the fraction of unmasked tokens that
    are clipped (TRL's "clip_ratio/region_mean"), and its "clip_ratio/low_mean" and
    "clip_ratio/high_mean" parts (0 for the loss types without a clip).
    """
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_log_probs is None:
        raise ValueError(f"beta = {beta} > 0 needs ref_log_probs")
    per_token_loss = policy_loss(
        log_probs, old_log_probs, advantages, mask, loss_type,
        epsilon=epsilon, epsilon_high=epsilon_high, **variant,
    )  # fmt: skip
    _check_same_shape("log_probs", log_probs, "mask", mask)
    mask = mask.to(log_probs.dtype)
    level = variant.get("importance_sampling_level", "token")
    ratio = torch.exp(log_importance_weights(log_probs, old_log_probs, mask, level))
    if off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_sequence_mask(
            log_probs, old_log_probs, advantages, mask, off_policy_mask_threshold
        )
    # Stats are logged for monitoring, so an all-masked batch reports 0, not NaN.
    num_tokens = mask.sum().clamp(min=1)
    kl_mean = 0.0
    if ref_log_probs is not None:
        kl = kl_penalty(log_probs, ref_log_probs, kl_estimator, clamp=kl_clamp)
        if use_bias_correction_kl:
            kl = bias_corrected_kl(kl, log_probs, old_log_probs, mask, level)
        per_token_loss = per_token_loss + beta * kl
        kl_mean = ((kl * mask).sum() / num_tokens).item()
    loss = aggregate(
        per_token_loss, mask, loss_type, max_completion_length=max_completion_length,
        alpha=alpha, allow_empty=allow_empty,
    )  # fmt: skip
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    low, high = clip_regions(ratio, advantages, epsilon, epsilon_high)
    if loss_type not in CLIPPED_LOSS_TYPES:
        low, high = torch.zeros_like(low), torch.zeros_like(high)

    def token_mean(flags: Tensor) -> float:
        if flags.shape[1] == 1:  # a sequence-level ratio: TRL averages over the sequences
            return flags.to(mask.dtype).mean().item()
        return ((flags * mask).sum() / num_tokens).item()

    stats = {
        "kl": kl_mean,
        "clip_ratio": token_mean(low | high),
        "clip_ratio/low_mean": token_mean(low),
        "clip_ratio/high_mean": token_mean(high),
    }
    return loss, stats


def check_policy_inputs(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, level: str = "token"
) -> None:
    if log_probs.dim() != 2:
        raise ValueError(
            f"log_probs must be 2-D (batch, seq_len), got shape {tuple(log_probs.shape)}"
        )
    _check_same_shape("log_probs", log_probs, "old_log_probs", old_log_probs)
    if advantages.shape not in (log_probs.shape[:1], log_probs.shape):
        raise ValueError(
            f"advantages must have shape (batch,) = {tuple(log_probs.shape[:1])} or (batch, "
            f"seq_len) = {tuple(log_probs.shape)}, got {tuple(advantages.shape)}"
        )
    if advantages.dim() == 2 and level == "sequence":
        # GSPO's ratio belongs to the whole sequence: with A_it its clipped term
        # min(s_i A_it, clip(s_i) A_it) would weight one ratio's gradient by the mean advantage,
        # which is neither GSPO nor a per-token policy gradient.
        raise ValueError(
            "importance_sampling_level 'sequence' (GSPO) has one ratio per sequence and needs "
            "one advantage per sequence, (batch,); got per-token advantages "
            f"{tuple(advantages.shape)}"
        )


def as_columns(advantages: Tensor) -> Tensor:
    """(batch, 1) from per-sequence advantages (batch,); per-token ones (batch, seq_len) as they
    are: either broadcasts against (batch, seq_len)."""
    return advantages.unsqueeze(1) if advantages.dim() == 1 else advantages


def _check_same_shape(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"{name_a} and {name_b} must have the same shape, got "
            f"{tuple(a.shape)} and {tuple(b.shape)}"
        )
