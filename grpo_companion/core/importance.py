r"""Importance-sampling corrections for rollouts from a sampler that is not the policy.

A fast inference engine (vLLM in bf16, with top-p) samples the completions from a policy
pi_samp that differs from the policy pi the trainer differentiates. Per sampled token the
trainer knows both log-probabilities, and every correction here is a weight u on the token's
term of the loss, computed from the per-token log-ratios log pi - log pi_samp, (B, T), and the
completion mask (B, T). The sequence ratio is the product of the token ratios, in TRL and in
verl alike; verl's "geometric" statistic is the mean log-ratio instead. Weights are constants
of the loss (computed without gradient in both libraries).

TRL 1.16.0's ``GRPOConfig.vllm_importance_sampling_*`` weights are `vllm_importance_weights`.
verl 0.9.1's ``algorithm.rollout_correction`` (``verl/trainer/ppo/rollout_corr_helper.py``)
weights with `rollout_is_weights` (``rollout_is``) and rejects tokens or whole sequences with
`rollout_rejection_mask` (``rollout_rs``), which removes them from the response mask, so they
leave the token-mean normaliser too. The samplers of the book's exact analysis are pure
functions on logits: a temperature (divide the logits), `top_p_log_probs` (vLLM's and
transformers' nucleus, renormalised) and `round_logits` (a bf16-like rounding of the logits).

The ratio of the trainer's own loss, rho = pi / pi_old against the policy that sampled the batch,
per token or GSPO's per sequence, is `log_importance_weights` (chapter 3, section 2); unlike the
weights above it is differentiated.

Chapter: :doc:`/book/13_mismatch`
"""

import math

import torch
from torch import Tensor

# TRL's ``vllm_importance_sampling_mode`` values.
VLLM_IMPORTANCE_SAMPLING_MODES = (
    "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
)  # fmt: skip
# verl's ``rollout_is`` levels and ``rollout_rs`` options (``SUPPORTED_ROLLOUT_RS_OPTIONS``).
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip
# verl clamps log-ratios to +-20 before exponentiating (``SAFETY_BOUND``).
VERL_SAFETY_BOUND = 20.0
# TRL's ``importance_sampling_level`` values (`log_importance_weights`).
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def log_importance_weights(
    log_probs: Tensor, old_log_probs: Tensor, mask: Tensor | None = None, level: str = "token"
) -> Tensor:
    """log rho: (batch, seq_len) per token, or (batch, 1) per sequence.

    "token": log pi - log pi_old at each token (PPO, GRPO). "sequence": GSPO's length-normalised
    sequence ratio, log rho_i = 1/L_i sum_t (log pi_it - log pi_old_it), shared by the tokens of
    sequence i (TRL's ``importance_sampling_level="sequence"``; TRL clamps L_i at 1). pi_old is
    a constant of the objective, so ``old_log_probs`` is detached. ``mask`` (batch, seq_len) is
    needed for "sequence" only.

    Chapter: :doc:`/book/03_grpo_loss`
    """
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"unknown importance_sampling_level {level!r}; expected one of "
            f"{IMPORTANCE_SAMPLING_LEVELS}"
        )
    log_ratio = log_probs - old_log_probs.detach()
    if level == "token":
        return log_ratio
    if mask is None:
        raise ValueError("importance_sampling_level 'sequence' needs the mask")
    mask = mask.to(log_ratio.dtype)
    return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """log rho(y) = sum_t log rho_t over the completion's tokens, (B, 1): the log of the product
    of the token ratios, TRL's and verl's sequence ratio (not a geometric mean). Values off the
    mask are ignored, whatever they are (verl's ``masked_sum``)."""
    return _masked_sum(log_ratio, mask)


def truncated_weights(
    ratio: Tensor, clip_min: float | None = None, clip_max: float | None = None
) -> Tensor:
    """Truncated importance sampling (TIS): clamp(rho, C_min, C_max); None is no bound."""
    return torch.clamp(ratio, min=clip_min, max=clip_max)


def masked_weights(
    ratio: Tensor, clip_min: float | None = None, clip_max: float | None = None
) -> Tensor:
    """Masked importance sampling (MIS): rho where C_min <= rho <= C_max, else 0; None is no
    bound. With both bounds, IcePop."""
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def vllm_importance_weights(
    log_ratio: Tensor,
    mask: Tensor,
    mode: str = "sequence_mask",
    clip_max: float | None = 3.0,
    clip_min: float | None = None,
) -> Tensor:
    """TRL's weight of each token, (B, T) for the token modes and (B, 1) for the sequence ones.

    TRL 1.16.0's ``vllm_importance_sampling_mode``, ``_clip_max`` (default 3.0; the deprecated
    ``vllm_importance_sampling_cap``) and ``_clip_min``; `log_ratio` = log pi - log pi_samp.
    As TRL (``GRPOTrainer._generate_and_score_completions``): the log-ratios are masked, a NaN
    sampling log-prob gives ratio 1, the sequence ratio is the product of the token ratios::

        token_truncate     u_t = clamp(rho_t, C_min, C_max)
        token_mask         u_t = rho_t if C_min <= rho_t <= C_max, else 0
        sequence_truncate  u_t = clamp(rho(y), C_min, C_max) at every token of y
        sequence_mask      u_t = rho(y) if C_min <= rho(y) <= C_max, else 0   (the default)

    where a missing bound is no bound; ``token_mask`` with both bounds is IcePop. The weight
    multiplies the per-token policy loss; the loss's mask, and so its normaliser, is unchanged.
    Derivation: :doc:`/book/13_mismatch`.
    """
    if mode not in VLLM_IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {VLLM_IMPORTANCE_SAMPLING_MODES}")
    if mode.endswith("truncate") and clip_min is None and clip_max is None:
        raise ValueError(f"mode {mode!r} needs clip_min or clip_max (TRL's check)")
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(f"need clip_min < clip_max, got {clip_min} and {clip_max}")
    log_ratio = torch.nan_to_num(log_ratio * mask, nan=0.0)
    if mode.startswith("sequence"):
        log_ratio = sequence_log_ratio(log_ratio, torch.ones_like(mask))
    ratio = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        return truncated_weights(ratio, clip_min, clip_max)
    return masked_weights(ratio, clip_min, clip_max)


def weighted_advantages(advantages: Tensor, weights: Tensor) -> Tensor:
    """The advantages that put the importance weights u >= 0 on the policy loss: u_t A_i.

    `advantages` (B,) or (B, T), `weights` (B, 1) or (B, T); returns (B,) when both are per
    sequence, else (B, T). Every policy loss of `losses.policy_loss` but VESPO's is positively
    homogeneous in A, -min(rho u A, clip(rho) u A) = -u min(rho A, clip(rho) A) for u >= 0, so
    `losses.grpo_loss` with u A is TRL's ``per_token_loss * importance_sampling_ratio``, the KL
    term unweighted as in TRL.
    """
    if weights.shape[-1] == 1 and advantages.dim() == 1:
        return advantages * weights[:, 0]
    return (advantages[:, None] if advantages.dim() == 1 else advantages) * weights


def parse_rollout_is_threshold(threshold: float | str) -> tuple[float | None, float]:
    """verl's ``rollout_is_threshold``: a number is the TIS cap, (None, C); a "lower_upper"
    string gives IcePop's bounds, (lower, upper)."""
    if isinstance(threshold, str) and "_" in threshold:
        lower, upper = (float(part) for part in threshold.split("_", 1))
        if not 0 < lower <= upper:
            raise ValueError(f"need 0 < lower <= upper, got {threshold!r}")
        return lower, upper
    upper = float(threshold)
    if upper <= 0:
        raise ValueError(f"rollout_is_threshold must be positive, got {threshold!r}")
    return None, upper


def rollout_is_weights(
    log_ratio: Tensor,
    mask: Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: float | str = 2.0,
) -> Tensor:
    """verl's IS weights, (B, T), 0 off the mask (``compute_rollout_correction_weights``).

    ``rollout_is``: "token" (rho_t) or "sequence" (rho(y) at every token); the log-ratios are
    clamped to +-20 first. ``rollout_is_threshold``: a number C truncates from above,
    min(rho, C); "lower_upper" zeroes the weights outside [lower, upper] (IcePop).
    """
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout_is {rollout_is!r}; expected one of {ROLLOUT_IS_LEVELS}")
    lower, upper = parse_rollout_is_threshold(rollout_is_threshold)
    if rollout_is == "sequence":
        log_ratio = sequence_log_ratio(log_ratio, mask).expand_as(log_ratio)
    ratio = torch.exp(log_ratio.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)) * mask
    if lower is None:
        return truncated_weights(ratio, clip_max=upper)
    return masked_weights(ratio, lower, upper)


def _rs_thresholds(option: str, spec: str) -> tuple[float | None, float]:
    """verl's ``_parse_rollout_rs_thresholds`` for one option: k1 options take ratio bounds
    "lower_upper" (one number C means [1/C, C]); k2 and k3 options an upper bound only."""
    if option.endswith("k1"):
        lower, upper = spec.split("_", 1) if "_" in spec else (1.0 / float(spec), spec)
        lower, upper = float(lower), float(upper)
        if not 0 < lower <= upper:
            raise ValueError(f"need 0 < lower <= upper for {option!r}, got {spec!r}")
        return lower, upper
    if "_" in spec or float(spec) <= 0:
        raise ValueError(f"{option!r} takes one positive upper bound, got {spec!r}")
    return None, float(spec)


def rollout_rejection_mask(
    log_ratio: Tensor, mask: Tensor, rollout_rs: str, rollout_rs_threshold: float | str
) -> Tensor:
    """verl's rejection sampling: the response mask with the rejected tokens set to 0, (B, T).

    ``compute_rollout_rejection_mask``: with x = log rho clamped to +-20, the per-token
    divergences k1 = -x, k2 = x^2 / 2, k3 = e^x - 1 - x; "token_kN" tests each token,
    "seq_sum_kN", "seq_mean_kN" and "seq_max_kN" the sum, mean or max over the completion and
    reject all of its tokens. k1 options keep log(lower) <= k1 <= log(upper), others kN <= upper.
    ``rollout_rs`` may chain options with commas (all must pass); ``rollout_rs_threshold`` is one
    spec for all or one per option, comma-separated.
    """
    options = list(dict.fromkeys(part.strip() for part in rollout_rs.split(",") if part.strip()))
    unknown = [option for option in options if option not in ROLLOUT_RS_OPTIONS]
    if not options or unknown:
        raise ValueError(f"unknown rollout_rs {rollout_rs!r}; options are {ROLLOUT_RS_OPTIONS}")
    specs = [part.strip() for part in str(rollout_rs_threshold).split(",") if part.strip()]
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ValueError(f"{len(specs)} thresholds for {len(options)} rollout_rs options")
    x = log_ratio.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)
    divergences = {"k1": -x, "k2": 0.5 * x**2, "k3": torch.exp(x) - 1 - x}
    keep = torch.ones_like(mask, dtype=torch.bool)
    lengths = mask.sum(dim=-1, keepdim=True)
    for option, spec in zip(options, specs):
        lower, upper = _rs_thresholds(option, spec)
        level, _, estimator = option.rpartition("_")
        statistic = divergences[estimator]
        if level == "seq_sum":
            statistic = _masked_sum(statistic, mask)
        elif level == "seq_mean":  # verl's masked_mean: sum / (count + 1e-8)
            statistic = _masked_sum(statistic, mask) / (lengths + 1e-8)
        elif level == "seq_max":
            values = statistic.masked_fill(mask == 0, -math.inf).amax(dim=-1, keepdim=True)
            statistic = torch.where(values == -math.inf, 0.0, values)
        if lower is None:
            passed = statistic <= upper
        else:
            passed = (statistic >= math.log(lower)) & (statistic <= math.log(upper))
        keep = keep & passed.expand_as(mask)
    return mask * keep


def top_p_log_probs(logits: Tensor, top_p: float) -> Tensor:
    """Log-probs of nucleus sampling over the last dimension, -inf outside the nucleus.

    The nucleus is the smallest set of most likely tokens whose mass under softmax(logits)
    is >= top_p (transformers' ``TopPLogitsWarper`` and vLLM's top-p: drop the least likely
    tokens while their cumulative mass is <= 1 - top_p, keep at least one); the sampler
    renormalises over it, so a kept token's log-prob is log softmax(logits) - log Z with Z the
    kept mass (`kept_mass`).
    """
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    log_probs = torch.log_softmax(logits, dim=-1)
    if top_p == 1:
        return log_probs
    sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    removed = cumulative <= 1 - top_p
    removed[..., -1] = False  # the most likely token always stays
    removed = removed.scatter(-1, order, removed)
    return torch.log_softmax(logits.masked_fill(removed, -math.inf), dim=-1)


def kept_mass(logits: Tensor, top_p: float) -> Tensor:
    """Z = the mass of the top-p nucleus under softmax(logits), over the last dimension: the
    mean of the ratio pi / pi_samp over the nucleus sampler, sum over kept y of pi(y)."""
    kept = torch.isfinite(top_p_log_probs(logits, top_p))
    return (torch.softmax(logits, dim=-1) * kept).sum(dim=-1)


def round_logits(logits: Tensor, significant_bits: int = 8) -> Tensor:
    """Round each logit to `significant_bits` significant binary digits, to nearest, ties to
    even: 8 is bfloat16's precision (1 implicit + 7 stored bits), fewer is coarser. The grid
    step is 2^(e + 1 - significant_bits) for logits in [2^e, 2^(e + 1)): a relative error of at
    most 2^-significant_bits."""
    if significant_bits < 1:
        raise ValueError(f"need significant_bits >= 1, got {significant_bits}")
    mantissa, exponent = torch.frexp(logits)  # mantissa in [0.5, 1)
    scale = 2.0**significant_bits
    return torch.ldexp(torch.round(mantissa * scale) / scale, exponent)


def _masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    """Sum over the last dimension of the values on the mask, (B, 1); values off the mask are
    ignored even when infinite or NaN (verl's ``masked_sum``)."""
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(dim=-1, keepdim=True)
