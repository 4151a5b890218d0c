r"""The variants of TRL 1.16.0 and verl 0.9.1 that ``losses`` and ``advantages`` do not cover.

Each function is one equation of one variant, on tensors; its card in the book
(``book/variants.md``) gives the TRL and verl setting, the chapter that analyses it, the test
that holds it and the weight it gives a token. Shapes: ``log_probs``, ``old_log_probs`` and
``mask`` are (batch, seq_len); ``advantages`` is (batch,), broadcast over the tokens, or
(batch, seq_len), one per token. pi_old is a constant of every objective, so ``old_log_probs``
is detached. With rho = pi / pi_old, a policy loss's gradient at a token is
-omega(rho) A grad log pi, and omega is what tells the variants apart:

    weighted REINFORCE  -sg(w) A log pi                       omega = w (verl gpg, cispo)
    GMPO                -exp(mean_t clip(log rho_t)) A_i      geometric mean / L, per sequence
    DPPO                -sg(min(rho, c) m) A log pi           min(rho, c) inside the region
    DRO                 -(A log pi - beta/2 log(rho)^2)       A - beta log rho (not a weight)
    Clip-Cov, KL-Cov    PPO's clip, plus a covariance-picked subset of tokens

TRL's ``top_entropy_quantile`` mask and the entropy bonus with its adaptive coefficient follow.
Elsewhere: GDPO's per-reward normalisation is `grpo_companion.core.verl_estimators.gdpo_advantages`;
every KL quantity, TRL's bias-corrected KL and verl's KL modes and KL controller among them, is in
`grpo_companion.core.kl`; and the importance weights of a sampler that is not the policy (TRL's
``vllm_importance_sampling_*``, verl's rollout correction) are in
`grpo_companion.core.importance`.
"""

import torch
from torch import Tensor

from grpo_companion.core.losses import as_columns, check_policy_inputs, clipped_surrogate

DIVERGENCES = ("tv", "kl")


# --- policy losses --------------------------------------------------------------------------


def weighted_reinforce_surrogate(
    log_probs: Tensor, advantages: Tensor, weights: Tensor | None = None
) -> Tensor:
    """-sg(w) A log pi per token, (batch, seq_len): REINFORCE with a detached weight w.

    w = 1 is verl's ``gpg`` loss; w = clip(rho, 1 - epsilon, 1 + epsilon_high) is verl's
    ``cispo`` (TRL's "cispo" caps rho at epsilon_high instead); w = the rollout importance weight
    is verl's ``bypass_mode`` with ``loss_type: reinforce``. ``weights``: broadcastable to
    (batch, seq_len), detached here.
    Chapter: :doc:`/book/variants`
    """
    column = as_columns(advantages)
    loss = -column * log_probs if weights is None else -weights.detach() * column * log_probs
    return loss.expand_as(log_probs)


def geometric_mean_surrogate(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon: float = 0.4,
    epsilon_high: float | None = None,
) -> Tensor:
    """GMPO: -exp(1/L_i sum_t clip(log rho_t)) A_i, one loss per sequence, (batch,).

    The clip acts on each token's log-ratio, in log space: log rho_t is capped at epsilon_high
    where A_i > 0 and floored at -epsilon where A_i <= 0 (PPO's min, per token), so a clipped
    token gets no gradient. The batch's loss is the mean over sequences (TRL's
    ``experimental.gmpo``, default epsilon 0.4; verl's ``geo_mean``, whose ``clip_ratio_low``
    and ``clip_ratio_high`` default to 0.2). ``advantages``: (batch,).
    Chapter: :doc:`/book/variants`
    """
    check_policy_inputs(log_probs, old_log_probs, advantages)
    if advantages.dim() != 1:
        raise ValueError("GMPO has one ratio per sequence and needs advantages of shape (batch,)")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    log_ratio = log_probs - old_log_probs.detach()
    clamped = torch.clamp(log_ratio, min=-epsilon, max=epsilon_high)
    column = advantages.unsqueeze(1)
    clipped = torch.where(
        column > 0, torch.minimum(log_ratio, clamped), torch.maximum(log_ratio, clamped)
    )
    mask = mask.to(log_probs.dtype)
    mean_log_ratio = (clipped * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return -torch.exp(mean_log_ratio) * advantages


def dppo_mask(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    *,
    divergence: str = "tv",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
) -> Tensor:
    """DPPO's trust region, a detached 0/1 (batch, seq_len): 1 where the token may still move.

    With p = pi(o_t), q = pi_old(o_t): "tv" keeps p - q <= epsilon_high where A > 0 and
    p - q >= -epsilon elsewhere; "kl" keeps the binary KL q log(q/p) + (1-q) log((1-q)/(1-p))
    <= epsilon_high (A > 0) or <= epsilon, and every token moving against its advantage
    (p <= q where A > 0). verl's ``dppo_tv`` and ``dppo_kl`` (``clip_ratio_low``/``_high``).
    Chapter: :doc:`/book/variants`
    """
    if divergence not in DIVERGENCES:
        raise ValueError(f"unknown divergence {divergence!r}; expected one of {DIVERGENCES}")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    with torch.no_grad():
        old_log_probs = old_log_probs.detach()
        prob, old_prob = log_probs.exp(), old_log_probs.exp()
        if divergence == "tv":
            positive, negative = prob - old_prob <= epsilon_high, prob - old_prob >= -epsilon
        else:
            binary_kl = old_prob * (old_log_probs - log_probs) + (1 - old_prob) * torch.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
            )  # verl's 1e-8 keeps p = 1 finite
            positive = (binary_kl <= epsilon_high) | (prob <= old_prob)
            negative = (binary_kl <= epsilon) | (prob >= old_prob)
        keep = torch.where(as_columns(advantages) > 0, positive, negative)
    return keep.to(log_probs.dtype)


def dppo_surrogate(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    *,
    divergence: str = "tv",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    clip_ratio_c: float = 3.0,
) -> Tensor:
    """DPPO: -sg(min(rho, c) m) A log pi per token, (batch, seq_len), m = `dppo_mask`.

    A truncated-IS REINFORCE term inside the trust region and nothing outside it: omega =
    min(rho, c) m. c is verl's ``clip_ratio_c`` (3 by default in ``ActorConfig``; the paper
    recommends a large value, 20, verl's fallback). verl clamps log rho to [-20, 20] first.
    Chapter: :doc:`/book/variants`
    """
    check_policy_inputs(log_probs, old_log_probs, advantages)
    log_ratio = (log_probs - old_log_probs.detach()).clamp(-20.0, 20.0)
    keep = dppo_mask(
        log_probs, old_log_probs, advantages, divergence=divergence, epsilon=epsilon,
        epsilon_high=epsilon_high,
    )  # fmt: skip
    return weighted_reinforce_surrogate(
        log_probs, advantages, torch.clamp(log_ratio.exp(), max=clip_ratio_c) * keep
    )


def dro_surrogate(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, dro_beta: float
) -> Tensor:
    """DRO as verl's ``dro``: -(A log pi - dro_beta / 2 (log rho)^2) per token, (batch, seq_len).

    Its gradient is -(A - dro_beta log rho) grad log pi: REINFORCE with the advantage shrunk
    towards 0 by how far the token has moved, a pull back to pi_old that acts on every token,
    those with A = 0 (degenerate groups) included. At rho = 1 it is REINFORCE.
    Chapter: :doc:`/book/variants`
    """
    if dro_beta <= 0:
        raise ValueError(f"dro_beta must be > 0, got {dro_beta}")
    check_policy_inputs(log_probs, old_log_probs, advantages)
    log_ratio = log_probs - old_log_probs.detach()
    return -(as_columns(advantages) * log_probs - 0.5 * dro_beta * log_ratio.square())


def token_covariance(log_probs: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """(A_t - mean A)(log pi_t - mean log pi) per token, (batch, seq_len), detached: the means
    over the batch's unmasked tokens. The covariance of the entropy mechanism (Cui et al.),
    whose largest entries Clip-Cov and KL-Cov pick (0 on masked tokens).
    Chapter: :doc:`/book/variants`
    """
    mask = mask.to(log_probs.dtype)
    count = mask.sum().clamp(min=1.0)
    column = as_columns(advantages).expand_as(log_probs).detach()
    log_probs = log_probs.detach()
    centred_advantages = column - (column * mask).sum() / count
    centred_log_probs = log_probs - (log_probs * mask).sum() / count
    return centred_advantages * centred_log_probs * mask


def clip_cov_surrogate(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Clip-Cov (verl ``clip_cov``): PPO's clipped loss, (batch, seq_len), set to 0 (value and
    gradient) on max(1, int(clip_cov_ratio N)) tokens drawn at random, N the unmasked tokens,
    among those the clip leaves alone whose `token_covariance` lies in (clip_cov_lb, clip_cov_ub).
    ``generator`` draws them (verl: torch's global generator, ``torch.randperm``).
    Chapter: :doc:`/book/variants`
    """
    loss, _ = clipped_surrogate(
        log_probs, old_log_probs, advantages, epsilon=epsilon, epsilon_high=epsilon_high
    )
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    with torch.no_grad():
        ratio = torch.exp(log_probs - old_log_probs)
        column = as_columns(advantages)
        clipped = -column * torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) > -column * ratio
        covariance = token_covariance(log_probs, advantages, mask)
        candidates = (covariance > clip_cov_lb) & (covariance < clip_cov_ub) & (mask > 0)
        candidates = torch.nonzero(candidates & ~clipped)
        num_clipped = max(int(clip_cov_ratio * mask.sum().item()), 1)
        chosen = candidates[torch.randperm(len(candidates), generator=generator)[:num_clipped]]
        keep = torch.ones_like(loss)
        keep[chosen[:, 0], chosen[:, 1]] = 0.0
    return loss * keep


def kl_cov_surrogate(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
) -> Tensor:
    """KL-Cov (verl ``kl_cov``): -rho A per token, unclipped, (batch, seq_len), plus
    ppo_kl_coef |log rho| on the max(1, int(kl_cov_ratio N)) unmasked tokens of largest
    `token_covariance`. |log rho| has value and gradient 0 at rho = 1: KL-Cov acts off-policy
    only. (verl's default ``ppo_kl_coef`` is 0.1 in ``PolicyLossConfig``.)
    Chapter: :doc:`/book/variants`
    """
    check_policy_inputs(log_probs, old_log_probs, advantages)
    log_ratio = log_probs - old_log_probs.detach()
    loss = -as_columns(advantages) * torch.exp(log_ratio)
    with torch.no_grad():
        valid = mask > 0
        covariance = token_covariance(log_probs, advantages, mask)[valid]
        num_penalised = max(1, int(len(covariance) * kl_cov_ratio))
        chosen = torch.zeros(len(covariance), dtype=torch.bool, device=log_probs.device)
        if len(covariance):
            chosen[torch.topk(covariance, min(num_penalised, len(covariance))).indices] = True
        penalised = torch.zeros_like(valid)
        penalised[valid] = chosen
    return torch.where(penalised, loss + ppo_kl_coef * log_ratio.abs(), loss)


# --- the token mask of top_entropy_quantile ---------------------------------------------------


def high_entropy_mask(entropies: Tensor, mask: Tensor, top_entropy_quantile: float) -> Tensor:
    """TRL's ``top_entropy_quantile`` (rho of "Beyond the 80/20 Rule"): bool (batch, seq_len),
    True on the unmasked tokens whose entropy is at least the (1 - rho)-quantile of the batch's
    unmasked entropies (``torch.quantile``, linear interpolation). The policy loss (and TRL's
    entropy bonus) keeps only these tokens; rho = 1 keeps all, rho = 0 the highest only.
    Chapter: :doc:`/book/variants`
    """
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile}")
    valid = entropies[mask.bool()].float()
    if valid.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    threshold = torch.quantile(valid, 1.0 - top_entropy_quantile)
    return (entropies * mask.float() >= threshold) & mask.bool()


# --- the entropy bonus ----------------------------------------------------------------------


def entropy_bonus(entropies: Tensor, mask: Tensor, entropy_coef: float) -> Tensor:
    """-entropy_coef * (mean entropy over the unmasked tokens), a scalar added to the loss.

    TRL's ``entropy_coef``: the mean over the tokens whatever ``loss_type`` (with
    ``top_entropy_quantile``, over the kept tokens: pass mask * `high_entropy_mask`). verl's
    ``entropy_coeff`` aggregates by ``loss_agg_mode``; its "token-mean" is this.
    Chapter: :doc:`/book/variants`
    """
    mask = mask.to(entropies.dtype)
    return -entropy_coef * (entropies * mask).sum() / mask.sum().clamp(min=1.0)


def adaptive_entropy_coef(
    entropy_coef: float,
    entropy: float,
    *,
    entropy_target: float = 0.2,
    entropy_coef_delta: float = 0.005,
    entropy_coef_min: float = 0.0,
    entropy_coef_max: float = 1.0,
) -> tuple[float, float]:
    """TRL's ``use_adaptive_entropy`` (Skywork-OR1) after a step of mean entropy ``entropy``:
    (the next coefficient, the coefficient the next step applies). The coefficient rises by
    entropy_coef_delta while the entropy is at or below entropy_target and falls otherwise,
    within [entropy_coef_min, entropy_coef_max]; it is applied only while entropy <= target
    (TRL's first step, with no entropy measured yet, applies none).
    Chapter: :doc:`/book/variants`
    """
    if entropy <= entropy_target:
        coefficient = min(entropy_coef + entropy_coef_delta, entropy_coef_max)
        return coefficient, coefficient
    return max(entropy_coef - entropy_coef_delta, entropy_coef_min), 0.0
