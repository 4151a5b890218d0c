r"""KL(pi || pi_ref): the exact divergence, its estimators, and where TRL and verl put it.

The one home of every KL quantity of the book. With x = log pi(y_t | .) - log pi_ref(y_t | .)
at a token sampled from pi::

    exact_kl               KL(pi || pi_ref) = sum pi (log pi - log pi_ref), every outcome enumerated
    kl_penalty             Schulman's per-token estimates k1 = x, k2 = x^2 / 2, k3 = e^-x - 1 + x
    bias_corrected_kl      rho k, TRL's use_bias_correction_kl
    verl_kl_penalty        verl's kl_loss_type / kl_penalty names
    kl_estimate_gradients  grad sum_t k(x_t) of every sequence of a SequencePolicy
    kl_in_reward           r - beta k1(y) before the group baseline, verl's use_kl_in_reward
    adaptive_kl_coef       verl's kl_ctrl.type: adaptive

In the loss (TRL, GRPO) the estimate is differentiated through log pi and added after the
baseline; in the reward (verl's ``use_kl_in_reward``, RLOO) it is detached and enters through
the score function. Two KL-shaped statistics stay with the variants that use them: verl's
rollout-rejection divergences of a sampler's log-ratio
(`grpo_companion.core.importance.rollout_rejection_mask`) and DPPO's binary KL of one token
(`grpo_companion.core.variants.dppo_mask`).

Chapter: :doc:`/book/03_grpo_loss` (section 4), :doc:`/book/08_baselines` (section 6)
"""

import torch
from torch import Tensor

from grpo_companion.core.advantages import check_rewards
from grpo_companion.core.importance import log_importance_weights
from grpo_companion.core.policy_gradient import SequencePolicy

KL_ESTIMATORS = ("k1", "k2", "k3")
# verl's bounds on k3 ("low_var_kl"): the log-ratio, then the estimate (``core_algos.kl_penalty``).
VERL_KL_CLAMP = (20.0, 10.0)
VERL_KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# verl's names -> `kl_penalty` estimator (k3 with verl's clamp); "abs" is |log pi - log pi_ref|.
_VERL_KL = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


def exact_kl(log_probs: Tensor, ref_log_probs: Tensor, dim: int = -1) -> Tensor:
    """KL(pi || pi_ref) = sum over ``dim`` of pi (log pi - log pi_ref), exactly, from the log-probs
    of every outcome: a vocabulary at one position, or every sequence of an enumerable policy
    (swap the arguments for KL(pi_ref || pi)). Outcomes with pi = 0 add 0. The quantity
    `kl_penalty`'s estimators estimate from one sampled token; differentiable in both.

    Chapter: :doc:`/book/03_grpo_loss` (section 4)
    """
    _check_same_shape("log_probs", log_probs, "ref_log_probs", ref_log_probs)
    probs = log_probs.exp()
    terms = torch.where(probs > 0, probs * (log_probs - ref_log_probs), 0.0)
    return terms.sum(dim)


def kl_penalty(
    log_probs: Tensor, ref_log_probs: Tensor, estimator: str = "k3", *, clamp: bool = False
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi: the KL term of TRL's
    loss (coefficient ``beta``) and of verl's (``use_kl_loss``, ``kl_loss_type``).

    Chapter: :doc:`/book/03_grpo_loss` (section 4)

    With x = log(pi / pi_ref) at the sampled token (Schulman, "Approximating
    KL divergence", 2020):

        k1 = x                      unbiased, high variance, can be negative
        k2 = x^2 / 2                biased, low variance, >= 0
        k3 = exp(-x) - 1 + x        unbiased, low variance, >= 0 (TRL, GRPO paper)

    k3 is unbiased because E_pi[pi_ref / pi] = 1, so it is k1 plus a zero-mean
    control variate.

    ``clamp`` (k3 only) is verl's "low_var_kl": x clamped to [-20, 20] before the exponential,
    the estimate to [-10, 10] after (``VERL_KL_CLAMP``). It changes the value only where k3
    would exceed 10, x < -2.61 or x > 11.0 (pi/pi_ref below 0.073 or above 6e4), and there the
    clamped tokens get no gradient. TRL does not clamp.

    log_probs, ref_log_probs: (batch, seq_len); the frozen reference is detached.
    Returns kl: (batch, seq_len).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
    if clamp and estimator != "k3":
        raise ValueError(f"clamp is verl's bound on k3 ('low_var_kl'), not on {estimator!r}")
    _check_same_shape("log_probs", log_probs, "ref_log_probs", ref_log_probs)
    log_ratio = log_probs - ref_log_probs.detach()
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if not clamp:
        return torch.exp(-log_ratio) - 1 + log_ratio
    log_bound, kl_bound = VERL_KL_CLAMP
    log_ratio = log_ratio.clamp(-log_bound, log_bound)
    return (torch.exp(-log_ratio) - 1 + log_ratio).clamp(-kl_bound, kl_bound)


def bias_corrected_kl(
    kl: Tensor,
    log_probs: Tensor,
    old_log_probs: Tensor,
    mask: Tensor | None = None,
    level: str = "token",
) -> Tensor:
    """rho * kl: TRL's ``use_bias_correction_kl`` (DeepSeek-V3.2), (batch, seq_len).

    ``kl`` is `kl_penalty`'s estimate on tokens drawn from pi_old; the differentiable ratio rho
    (`grpo_companion.core.importance.log_importance_weights`, per sequence at ``level``
    "sequence") reweights them to pi. At rho = 1 its gradient is kl grad log pi + grad kl: for
    k3, log(pi / pi_ref) grad log pi, k2's.

    Chapter: :doc:`/book/03_grpo_loss` (section 4)
    """
    return kl * torch.exp(log_importance_weights(log_probs, old_log_probs, mask, level))


def verl_kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, mode: str = "low_var_kl") -> Tensor:
    """verl's ``kl_loss_type`` / ``kl_penalty`` by name, (batch, seq_len): "kl"/"k1", "mse"/"k2"
    and "low_var_kl"/"k3" (clamped) are `kl_penalty`'s estimators,
    "abs" is |log pi - log pi_ref|. A "+" suffix ("k3+") keeps the value and takes k2's
    gradient, (log pi - log pi_ref) grad log pi, the reverse KL's: a straight-through estimator.
    verl's "full" (the whole vocabulary) is not implemented there either.

    Chapter: :doc:`/book/variants`, :doc:`/book/03_grpo_loss` (section 4)
    """
    base = mode.removesuffix("+")
    if base not in VERL_KL_PENALTIES:
        raise NotImplementedError(f"verl's kl_penalty {mode!r} is not implemented")
    if base == "abs":
        value = (log_probs - ref_log_probs.detach()).abs()
    else:
        value = kl_penalty(log_probs, ref_log_probs, _VERL_KL[base], clamp=_VERL_KL[base] == "k3")
    if not mode.endswith("+") or _VERL_KL.get(base) == "k2":
        return value
    k2 = kl_penalty(log_probs, ref_log_probs, "k2")
    return k2 - k2.detach() + value.detach()


def kl_estimate_gradients(
    policy: SequencePolicy,
    logits: Tensor,
    ref_logits: Tensor,
    estimator: str,
    use_bias_correction_kl: bool = False,
) -> Tensor:
    """grad_theta k(y) of every sequence y of ``policy``, `(num_sequences, num_params)`, at
    pi_old = pi: the per-token estimate `kl_penalty(..., estimator)` summed over y's tokens
    (times the ratio pi / pi_old, `bias_corrected_kl`, with TRL's ``use_bias_correction_kl``),
    differentiated through log pi as the loss does. pi(y) @ it is the penalty's mean gradient.

    Chapter: :doc:`/book/08_baselines` (section 6), :doc:`/book/14_questions` (section 5)
    """
    sequences = policy.all_sequences()
    log_probs = policy.token_log_probs(logits, sequences).detach().requires_grad_(True)
    ref_log_probs = policy.token_log_probs(ref_logits, sequences).detach()
    penalty = kl_penalty(log_probs, ref_log_probs, estimator)
    if use_bias_correction_kl:
        penalty = bias_corrected_kl(penalty, log_probs, log_probs.detach())
    (slopes,) = torch.autograd.grad(penalty.sum(), log_probs)  # d k / d x_t, (num_seq, length)
    scores = policy.scores(logits, sequences).view(policy.num_sequences, policy.length, -1)
    return (slopes[..., None] * scores).flatten(start_dim=1)


def kl_in_reward(rewards: Tensor, kl: Tensor, beta: float) -> Tensor:
    """verl's ``algorithm.use_kl_in_reward``: r_i - beta * KL_i, before any group baseline.

    `kl` is the completion's summed per-token estimate, verl's default k1 = sum_t log pi_old(y_t)
    - log pi_ref(y_t) (``apply_kl_penalty`` in ``verl/trainer/ppo/ray_trainer.py``; the RLOO
    paper, Ahmadian et al. 2024, also puts the KL in the reward). Detached, it enters through the
    score function: E[k1 s] = grad KL(pi || pi_ref), and the group baseline then treats it like
    the reward (RLOO keeps it unbiased, the group mean shrinks it by 1 - 1/G). In the loss
    (TRL, GRPO) the KL is differentiated through log pi instead, and is added after the baseline.

    Args: rewards, kl: (num_groups, G). Returns: (num_groups, G).

    Chapter: :doc:`/book/08_baselines` (section 6)
    """
    check_rewards(rewards)
    if kl.shape != rewards.shape:
        raise ValueError(
            f"kl must have the shape of rewards {tuple(rewards.shape)}, got {tuple(kl.shape)}"
        )
    return rewards - beta * kl.detach().to(rewards.dtype)


def adaptive_kl_coef(
    kl_coef: float, current_kl: float, *, target_kl: float, horizon: float, n_steps: int
) -> float:
    """verl's ``algorithm.kl_ctrl.type: adaptive`` (Ziegler et al.; ``kl_ctrl.target_kl``,
    ``kl_ctrl.horizon``): the next KL coefficient,
    beta (1 + clip(KL / target_kl - 1, -0.2, 0.2) n_steps / horizon). It acts on the KL in the
    reward (``use_kl_in_reward``, `kl_in_reward`); verl passes the batch size as n_steps.

    Chapter: :doc:`/book/variants`, :doc:`/book/08_baselines` (section 6)
    """
    error = min(max(current_kl / target_kl - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * n_steps / horizon)


def _check_same_shape(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"{name_a} and {name_b} must have the same shape, got "
            f"{tuple(a.shape)} and {tuple(b.shape)}"
        )
