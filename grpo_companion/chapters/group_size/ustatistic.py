r"""GRPO's gradient as a U-statistic, and its exact mean squared error against the group size.

With the mean-including-self baseline (Dr. GRPO's A_i = r_i - mean(r), GRPO with
``scale_rewards="none"``) the group's estimate is g_mean = (1 - 1/G) U, where
U = C(G, 2)^{-1} sum_{i < j} h(y_i, y_j) with the kernel h(y, y') = (r - r') (s - s') / 2 is a
U-statistic of order 2 and exactly RLOO's estimator (`u_statistic`,
`u_statistic_identity_error`). Hoeffding's decomposition gives
Var(U) = C(G, 2)^{-1} [2 (G - 2) zeta_1 + zeta_2] (`u_statistic_variance`), with zeta_1 and
zeta_2 from every pair of sequences (`kernel_variances`), and from it the closed-form MSE of no
baseline, the oracle b = J, the group mean and RLOO (`closed_form_mse`), which `exact_mse`
(`sequence_policy_moments`: O(G) sums on the policy's reward geometry) and `sampled_mse` (Monte
Carlo) check. Everything is on chapter 1's enumerable sequence policy. The fixed-budget analysis
is in `grpo_companion.chapters.group_size.budget`, the figures in
`grpo_companion.chapters.group_size.plots`.

Chapter: :doc:`/book/10_group_size` (section 1: the U-statistic and Hoeffding's decomposition;
section 2: the mean squared error against G, one prompt)
"""

import math

import numpy as np
import torch
from torch import Tensor

from grpo_companion.core.exact import estimator_moments, reward_geometry
from grpo_companion.core.group_estimators import (
    estimator_advantages,
    group_gradient,
    sample_group_estimates,
)
from grpo_companion.core.policy_gradient import SequencePolicy

# The estimators of the chapter: label -> method of `estimator_advantages` / `estimator_moments`.
ESTIMATORS = {
    "no baseline": "no_baseline",
    "oracle, b = J": "oracle",
    "group mean": "dr_grpo",
    "RLOO = U": "rloo",
    "GRPO (std)": "grpo",
}

# -- the U-statistic on a sampled group -------------------------------------------------------


def u_statistic(scores: Tensor, rewards: Tensor) -> Tensor:
    """U = C(G, 2)^{-1} sum_{i < j} (r_i - r_j)(s_i - s_j) / 2, pair by pair.

    Chapter: :doc:`/book/10_group_size`

    `scores: (..., G, num_params)`, `rewards: (..., G)`; returns `(..., num_params)`. Built from
    the pairs on purpose (O(G^2)): it is the definition, against which the O(G) forms are tested.
    """
    group_size = rewards.shape[-1]
    reward_gaps = rewards[..., :, None] - rewards[..., None, :]  # (..., G, G)
    score_gaps = scores[..., :, None, :] - scores[..., None, :, :]  # (..., G, G, P)
    # Summing over ordered pairs i != j counts each pair twice: / 4 = / 2 (kernel) / 2 (twice).
    pair_sum = (reward_gaps[..., None] * score_gaps).sum(dim=(-3, -2)) / 4
    return pair_sum / math.comb(group_size, 2)


def u_statistic_identity_error(
    policy: SequencePolicy,
    logits: Tensor,
    rewards: Tensor,
    group_sizes,
    num_groups: int,
    generator: torch.Generator,
) -> float:
    """Largest |entry| of g_mean - (1 - 1/G) U and g_rloo - U over `num_groups` sampled groups
    at each G in `group_sizes` (drawn in that order): zero up to rounding.

    `rewards: (num_sequences,)` is the reward table; g is `group_gradient` of the group's
    advantages, U the pairwise `u_statistic`.
    """
    score_table = policy.scores(logits, policy.all_sequences())
    largest_gap = 0.0
    for G in group_sizes:
        draws = policy.sample(logits, num_groups * G, generator).view(num_groups, G)
        scores, group_rewards = score_table[draws], rewards[draws]
        u = u_statistic(scores, group_rewards)
        mean_self = group_gradient(scores, estimator_advantages(group_rewards, "dr_grpo"))
        rloo = group_gradient(scores, estimator_advantages(group_rewards, "rloo"))
        gaps = [mean_self - (1 - 1 / G) * u, rloo - u]
        largest_gap = max(largest_gap, *(float(gap.abs().max()) for gap in gaps))
    return largest_gap


# -- exact moments on the enumerable sequence policy ------------------------------------------


def kernel_variances(policy: SequencePolicy, logits: Tensor, rewards: Tensor) -> dict[str, float]:
    """Hoeffding's zeta_1 and zeta_2 of the kernel h, by enumerating every pair of sequences.

    Returns "zeta_1", "zeta_2", "value" (J) and "gradient_sq_norm" (||grad J||^2). Cost: one
    `(num_sequences, num_sequences, num_params)` tensor.
    """
    probs = policy.probs(logits).detach()
    scores = policy.scores(logits, policy.all_sequences())
    gradient = policy.exact_gradient(logits, rewards)
    reward_gaps = rewards[:, None, None] - rewards[None, :, None]
    centred = reward_gaps * (scores[:, None] - scores[None, :]) / 2 - gradient  # h - grad J
    zeta_2 = torch.einsum("i,j,ijp->", probs, probs, centred.square())
    first_projection = torch.einsum("j,ijp->ip", probs, centred)  # h_1(y) for every y
    zeta_1 = probs @ first_projection.square().sum(dim=1)
    return {
        "zeta_1": float(zeta_1),
        "zeta_2": float(zeta_2),
        "value": float(probs @ rewards),
        "gradient_sq_norm": float(gradient.square().sum()),
    }


def kernel_table(kernel: dict, variance_oracle: float, variance_no_baseline: float):
    """`kernel_variances` next to chapter 1's one-sample variances Var[g_J] (oracle) and
    Var[g_0] (no baseline): a one-column DataFrame, 4 zeta_1 = Var[g_J] to rounding."""
    import pandas as pd

    return pd.Series(
        {
            "J (pass rate)": kernel["value"],
            "zeta_1": kernel["zeta_1"],
            "zeta_2": kernel["zeta_2"],
            "4 zeta_1": 4 * kernel["zeta_1"],
            "Var[g_J], chapter 1": variance_oracle,
            "Var[g_0], chapter 1": variance_no_baseline,
            "||grad J||^2": kernel["gradient_sq_norm"],
        },
        name="value",
    ).to_frame()


def u_statistic_variance(zeta_1, zeta_2, group_size):
    """Var(U) = C(G, 2)^{-1} [2 (G - 2) zeta_1 + zeta_2]; broadcasts over numpy arrays."""
    group_size = np.asarray(group_size, dtype=np.float64)
    return (2 * (group_size - 2) * zeta_1 + zeta_2) / (group_size * (group_size - 1) / 2)


def closed_form_mse(kernel: dict, variance_no_baseline: float, group_sizes) -> dict:
    """The MSE column of the chapter's table (section 2), for each G: label ->
    `(len(group_sizes),)`.

    `kernel` is `kernel_variances`'s dict, `variance_no_baseline` chapter 1's Var[g_0] = Var(r s)
    of one sample. GRPO with its std has no such closed form and is left out.
    """
    G = np.asarray(group_sizes, dtype=np.float64)
    variance_u = u_statistic_variance(kernel["zeta_1"], kernel["zeta_2"], G)
    return {
        "no baseline": variance_no_baseline / G,
        "oracle, b = J": 4 * kernel["zeta_1"] / G,
        "group mean": (1 - 1 / G) ** 2 * variance_u + kernel["gradient_sq_norm"] / G**2,
        "RLOO = U": variance_u,
    }


def sequence_policy_moments(
    policy: SequencePolicy,
    logits: Tensor,
    rewards: Tensor,
    group_size: int,
    method: str = "dr_grpo",
    **options,
) -> dict[str, float]:
    """Exact moments of one group's estimate on the sequence policy, in O(G) (no enumeration of
    groups): `estimator_moments` on the policy's `reward_geometry`, rescaled by kappa.

    Returns "weight" (E[g] = weight * grad J), "variance" (trace), "bias_sq"
    (||E[g] - grad J||^2) and "mse". `method`: `grpo_companion.core.advantages.METHODS` or
    `grpo_companion.core.exact.GROUP_FREE`.
    """
    geometry = reward_geometry(policy, logits, rewards)
    noise = (geometry["noise_correct"], geometry["noise_incorrect"])
    moments = estimator_moments(
        geometry["pass_rate"], group_size, method, score_noise=noise, **options
    )
    kappa = geometry["kappa"]
    return {
        "weight": float(moments["weight"][0]),
        "variance": kappa * float(moments["variance"][0]),
        "bias_sq": kappa * float(moments["bias"][0] ** 2),
        "mse": kappa * float(moments["mse"][0]),
    }


def exact_mse(policy, logits, rewards, group_sizes, estimators=ESTIMATORS) -> dict:
    """`sequence_policy_moments`'s MSE for each G: label -> `(len(group_sizes),)`."""
    return {
        label: np.array(
            [
                sequence_policy_moments(policy, logits, rewards, G, method)["mse"]
                for G in group_sizes
            ]
        )
        for label, method in estimators.items()
    }


def sampled_mse(
    policy, logits, rewards, group_sizes, num_groups, generator, estimators=ESTIMATORS
) -> dict:
    """Monte Carlo MSE E||g - grad J||^2 from `num_groups` groups at each G (label by label,
    then G by G, from one `generator`): label -> (mean, standard error), each
    `(len(group_sizes),)`."""
    gradient = policy.exact_gradient(logits, rewards)
    sampled = {}
    for label, method in estimators.items():
        estimates = [
            sample_group_estimates(policy, logits, rewards, G, num_groups, generator, method)
            for G in group_sizes
        ]
        errors = [(estimate - gradient).square().sum(dim=1) for estimate in estimates]
        sampled[label] = (
            np.array([float(e.mean()) for e in errors]),
            np.array([float(e.std()) for e in errors]) / np.sqrt(num_groups),
        )
    return sampled


def max_relative_gap(curves: dict, references: dict) -> float:
    """max over labels and points of |curves[label] / references[label] - 1|."""
    return float(max(np.max(np.abs(curves[label] / ref - 1)) for label, ref in references.items()))


def z_scores(sampled: dict, exact: dict) -> np.ndarray:
    """(Monte Carlo mean - exact) / standard error, every label's points concatenated."""
    return np.concatenate(
        [
            (mean - exact[label]) / standard_error
            for label, (mean, standard_error) in sampled.items()
        ]
    )


def oracle_property_summary(exact: dict, group_sizes) -> dict[str, float]:
    """How far RLOO and the group mean sit from the oracle, from `exact_mse`'s curves: RLOO's
    relative excess MSE at the smallest and largest G, that excess times the largest G, and the
    group mean's MSE over the oracle's at the smallest G."""
    rloo_excess = exact["RLOO = U"] / exact["oracle, b = J"] - 1
    group_mean_over_oracle = exact["group mean"] / exact["oracle, b = J"]
    return {
        "rloo_excess_smallest": float(rloo_excess[0]),
        "rloo_excess_largest": float(rloo_excess[-1]),
        "rloo_excess_times_g_largest": float(rloo_excess[-1] * group_sizes[-1]),
        "group_mean_over_oracle_smallest": float(group_mean_over_oracle[0]),
    }
