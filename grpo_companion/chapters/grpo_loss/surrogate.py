r"""Chapter 3, section 2: importance sampling and the PPO surrogate, exactly.

A batch sampled from pi_old is reused for several gradient steps (TRL's ``num_iterations``).
For any f, E_pi_old[rho f] = E_pi[f] with rho = pi / pi_old, so the gradient of the surrogate
E_pi_old[rho A], which is E_pi_old[rho A grad log pi], equals E_pi[A grad log pi]: the policy
gradient at the current parameters, from samples of the old ones (`surrogate_gradient` against
`policy_gradient`). Without the ratio the reused batch gives `reused_gradient`, the wrong one as
soon as pi moves. GRPO puts a ratio on each token instead of the sequence (`surrogate` with
level "token"): it reweights each token's choice but not the rest of the completion, which still
comes from pi_old, so its gradient is the policy gradient at pi = pi_old only.

The price of the ratio is its variance: E_pi_old[rho] = 1 and Var_pi_old[rho] (`ratio_variance`)
is the chi-square divergence of pi from pi_old (`chi_square`), which grows as pi moves away.
`importance_table` measures all of it on a `SequencePolicy` moved uphill from pi_old.
`clip_cases` takes PPO's clipped objective min(rho A, clip(rho, 1 - epsilon, 1 + epsilon) A) one
token at a time on a softmax over a few tokens: the tokens it leaves without a gradient, by
autograd, against the case analysis.

Chapter: :doc:`/book/03_grpo_loss` (section 2).
"""

import math

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from grpo_companion.chapters.grpo_loss.kl import kl_divergence
from grpo_companion.core.losses import clip_regions, clipped_surrogate
from grpo_companion.core.policy_gradient import SequencePolicy

# Where the ratio is taken: the whole sequence's, or GRPO's, one per token.
LEVELS = ("sequence", "token")


def surrogate(
    policy: SequencePolicy,
    logits: Tensor,
    old_logits: Tensor,
    advantages: Tensor,
    level: str = "sequence",
) -> Tensor:
    """The surrogate E_pi_old[rho A] = sum_y pi_old(y) rho(y) A(y) over every sequence y, a 0-dim
    tensor, differentiable in `logits`; pi_old (`old_logits`) is a constant.

    level "sequence": rho(y) = pi(y) / pi_old(y). level "token": GRPO's ratio of each token,
    rho_t(y) = pi(y_t | y_<t) / pi_old(y_t | y_<t), summed over the tokens (not averaged, so
    that both levels have the same gradient at pi = pi_old). `advantages: (num_sequences,)`, one
    fixed A(y) per sequence.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; expected one of {LEVELS}")
    sequences = policy.all_sequences()
    old_log_probs = policy.token_log_probs(old_logits, sequences).detach()
    log_ratios = policy.token_log_probs(logits, sequences) - old_log_probs
    ratios = log_ratios.sum(dim=1).exp() if level == "sequence" else log_ratios.exp().sum(dim=1)
    return old_log_probs.sum(dim=1).exp() @ (ratios * advantages)


def surrogate_gradient(
    policy: SequencePolicy,
    logits: Tensor,
    old_logits: Tensor,
    advantages: Tensor,
    level: str = "sequence",
) -> Tensor:
    """The gradient of `surrogate` in the logits by autograd, `(num_params,)`: at level
    "sequence", E_pi_old[rho A grad log pi], since grad rho = rho grad log pi."""
    leaf = logits.detach().clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(surrogate(policy, leaf, old_logits, advantages, level), leaf)
    return gradient.flatten()


def policy_gradient(policy: SequencePolicy, logits: Tensor, advantages: Tensor) -> Tensor:
    """E_pi[A grad log pi] = sum_y pi(y) A(y) s(y), `(num_params,)`, directly from the closed-form
    scores s(y) of `SequencePolicy.scores`: the right side of the importance-sampling identity.
    With A(y) = r(y) - b, b a constant, it is grad J (`SequencePolicy.exact_gradient`)."""
    scores = policy.scores(logits, policy.all_sequences())
    return policy.probs(logits) @ (advantages[:, None] * scores)


def reused_gradient(
    policy: SequencePolicy, logits: Tensor, old_logits: Tensor, advantages: Tensor
) -> Tensor:
    """E_pi_old[A grad log pi], `(num_params,)`: the batch of pi_old reused without the ratio,
    REINFORCE at the current logits on the old samples."""
    scores = policy.scores(logits, policy.all_sequences())
    return policy.probs(old_logits) @ (advantages[:, None] * scores)


def chi_square(probs: Tensor, old_probs: Tensor) -> float:
    """chi^2(pi || pi_old) = sum_y (pi(y) - pi_old(y))^2 / pi_old(y); `probs, old_probs: (n,)`."""
    return float(((probs - old_probs).square() / old_probs).sum())


def ratio_variance(probs: Tensor, old_probs: Tensor) -> float:
    """Var_pi_old[rho] = E_pi_old[rho^2] - E_pi_old[rho]^2 with rho = pi / pi_old, from the
    definition of a variance; `probs, old_probs: (n,)`. It equals `chi_square`."""
    ratios = probs / old_probs
    return float(old_probs @ ratios.square() - (old_probs @ ratios) ** 2)


def estimate_variance(
    probs: Tensor, sampler_probs: Tensor, advantages: Tensor, scores: Tensor
) -> float:
    """Var of the one-sample estimate w(y) A(y) s(y), y drawn from the sampler, w = pi /
    pi_sampler (the trace of its covariance, as every variance of the book): E_sampler[w^2 A^2
    ||s||^2] - ||E_pi[A s]||^2. `probs, sampler_probs, advantages: (n,)`, `scores: (n, P)`;
    with the sampler pi itself it is the on-policy estimate's variance."""
    samples = (probs / sampler_probs * advantages)[:, None] * scores
    mean = sampler_probs @ samples
    return float(sampler_probs @ samples.square().sum(dim=1) - mean.square().sum())


def importance_table(
    policy: SequencePolicy, old_logits: Tensor, rewards: Tensor, distances: list[float]
) -> pd.DataFrame:
    """The importance-sampling identity and its price along a path uphill from pi_old.

    At each distance d the policy is old_logits + d u, u the unit vector along grad J at pi_old,
    and every sequence's advantage is A(y) = r(y) - J(pi_old), fixed by pi_old as a batch's
    advantages are, so that E_pi[A s] = grad J at every d. Columns: the exact KL(pi || pi_old);
    Var_pi_old[rho], which is chi^2(pi || pi_old); the relative error against grad J of the
    sequence-ratio surrogate's gradient (the identity: rounding only), of the batch reused
    without the ratio, and of GRPO's token-ratio surrogate; and the variance of one reused
    sample's estimate over that of one fresh sample from pi (`estimate_variance`).
    """
    old_logits = old_logits.detach()
    old_probs = policy.probs(old_logits)
    advantages = rewards - float(old_probs @ rewards)
    uphill = policy.exact_gradient(old_logits, rewards)
    uphill = (uphill / uphill.norm()).view(policy.logits_shape)
    rows = []
    for distance in distances:
        logits = old_logits + distance * uphill
        probs = policy.probs(logits)
        target = policy.exact_gradient(logits, rewards)
        scores = policy.scores(logits, policy.all_sequences())
        gradients = {
            "sequence ratio": surrogate_gradient(policy, logits, old_logits, advantages),
            "no ratio": reused_gradient(policy, logits, old_logits, advantages),
            "token ratios": surrogate_gradient(policy, logits, old_logits, advantages, "token"),
        }
        rows.append(
            {
                "distance": distance,
                "KL(π_θ ‖ π_old)": kl_divergence(policy, logits, old_logits),
                "Var_old[ρ] = χ²": ratio_variance(probs, old_probs),
            }
            | {
                f"error, {name}": float((gradient - target).norm() / target.norm())
                for name, gradient in gradients.items()
            }
            | {
                "variance / on-policy": estimate_variance(probs, old_probs, advantages, scores)
                / estimate_variance(probs, probs, advantages, scores)
            }
        )
    return pd.DataFrame(rows).set_index("distance")


def importance_records(table: pd.DataFrame) -> dict[str, float]:
    """The recorded values of `importance_table`: the identity's largest error over the rows, and
    at the largest distance the KL, the ratio's variance, the two other errors and the
    variance factor."""
    last = table.iloc[-1]
    return {
        "is_identity_error": float(table["error, sequence ratio"].max()),
        "is_distance_largest": float(table.index[-1]),
        "is_kl_largest": float(last["KL(π_θ ‖ π_old)"]),
        "is_ratio_variance_largest": float(last["Var_old[ρ] = χ²"]),
        "is_no_ratio_error_largest": float(last["error, no ratio"]),
        "is_token_ratio_error_largest": float(last["error, token ratios"]),
        "is_variance_factor_largest": float(last["variance / on-policy"]),
    }


def clip_cases(ratios: list[float], advantages: list[float], epsilon: float) -> pd.DataFrame:
    """PPO's clipped objective token by token on a softmax over len(ratios) tokens, exactly.

    pi_old is uniform and pi = pi_old * ratio, so the ratios must average to 1 (E_pi_old[rho] =
    1 for every pi). Per token, with its advantage A: rho A, clip(rho, 1 - epsilon, 1 + epsilon)
    A, their minimum (the objective, from `losses.clipped_surrogate`), whether the clip leaves
    it flat (`losses.clip_regions`: A > 0 above 1 + epsilon, A < 0 below 1 - epsilon), its
    derivative in log pi of the token by autograd, and the case analysis's derivative: rho A
    where the objective is rho A, 0 where it is flat.
    """
    ratio = torch.tensor(ratios, dtype=torch.float64)
    if abs(float(ratio.mean()) - 1) > 1e-12:
        raise ValueError(f"ratios over a uniform pi_old average to 1, got {float(ratio.mean())}")
    advantage = torch.tensor(advantages, dtype=torch.float64)
    old_log_probs = torch.full((1, len(ratios)), -math.log(len(ratios)), dtype=torch.float64)
    log_probs = (old_log_probs + ratio.log()).requires_grad_(True)
    loss, _ = clipped_surrogate(log_probs, old_log_probs, advantage[None], epsilon=epsilon)
    (gradient,) = torch.autograd.grad(-loss.sum(), log_probs)
    low, high = clip_regions(ratio[None], advantage[None], epsilon, epsilon)
    flat = (low | high)[0]
    return pd.DataFrame(
        {
            "ratio ρ": ratio.numpy(),
            "A": advantage.numpy(),
            "ρ A": (ratio * advantage).numpy(),
            "clip(ρ) A": (ratio.clamp(1 - epsilon, 1 + epsilon) * advantage).numpy(),
            "objective": -loss.detach()[0].numpy(),
            "flat": flat.numpy(),
            "d objective / d log π": gradient[0].numpy() + 0.0,  # + 0.0: no "-0.0"
            "case analysis": torch.where(flat, 0.0, ratio * advantage).numpy() + 0.0,
        },
        index=pd.RangeIndex(1, len(ratios) + 1, name="token"),
    )


def clip_case_records(cases: pd.DataFrame, epsilon: float) -> dict[str, float]:
    """The recorded values of `clip_cases`: how many tokens the clip leaves flat, the largest gap
    between autograd's derivative and the case analysis's, and the largest gap between the
    objective and the case analysis's closed form, A min(rho, 1 + epsilon) for A > 0 and
    A max(rho, 1 - epsilon) for A < 0."""
    ratio, advantage = cases["ratio ρ"], cases["A"]
    closed_form = advantage * np.where(
        advantage > 0, np.minimum(ratio, 1 + epsilon), np.maximum(ratio, 1 - epsilon)
    )
    return {
        "clip_case_flat_tokens": int(cases["flat"].sum()),
        "clip_case_gradient_error": float(
            (cases["d objective / d log π"] - cases["case analysis"]).abs().max()
        ),
        "clip_case_objective_error": float((cases["objective"] - closed_form).abs().max()),
    }
