"""Chapter 3, section 4: the KL estimators k1, k2 and k3 as estimates of the sequence KL.

`sequence_kl` is KL(pi || pi_ref) over whole sequences, exactly; `kl_estimator_moments` gives the
exact mean, bias and variance of each per-token estimator of `grpo_companion.core.kl.kl_penalty`
summed over a sequence y ~ pi, and `kl_estimator_table` adds a Monte Carlo check at several
distances from the reference. What the estimators do as a loss (their mean gradients) is
`grpo_companion.chapters.grpo_loss.kl_gradient`.

Chapter: :doc:`/book/03_grpo_loss` (section 4: k1 and k3 are unbiased for the value, k2 is not).
"""

import math

import pandas as pd
import torch
from torch import Tensor

from grpo_companion.core.kl import KL_ESTIMATORS, exact_kl, kl_penalty
from grpo_companion.core.policy_gradient import SequencePolicy


def sequence_kl(policy: SequencePolicy, logits: Tensor, ref_logits: Tensor) -> Tensor:
    """KL(pi || pi_ref) = sum_y pi(y) log(pi(y) / pi_ref(y)) over whole sequences, exactly: a
    0-dim tensor, differentiable in both logits (swap them for KL(pi_ref || pi)): `exact_kl`
    over the policy's sequences."""
    sequences = policy.all_sequences()
    return exact_kl(policy.log_prob(logits, sequences), policy.log_prob(ref_logits, sequences))


def kl_divergence(policy: SequencePolicy, logits: Tensor, ref_logits: Tensor) -> float:
    """`sequence_kl` as a number."""
    return float(sequence_kl(policy, logits.detach(), ref_logits.detach()))


def sequence_kl_estimates(
    policy: SequencePolicy,
    logits: Tensor,
    ref_logits: Tensor,
    sequences: Tensor,
    estimator: str,
) -> Tensor:
    """sum_t k(x_t) for each of `sequences: (n, length)`, k = `kl_penalty`'s `estimator`: `(n,)`."""
    token_log_probs = policy.token_log_probs(logits, sequences).detach()
    ref_token_log_probs = policy.token_log_probs(ref_logits, sequences).detach()
    return kl_penalty(token_log_probs, ref_token_log_probs, estimator).sum(dim=1)


def kl_estimator_moments(
    policy: SequencePolicy, logits: Tensor, ref_logits: Tensor
) -> dict[str, dict[str, float]]:
    """Exact mean, bias and variance of one sequence's k1, k2 and k3 estimate, y ~ pi.

    Returns {estimator: {"mean", "bias", "variance"}}, the bias against `kl_divergence`.
    """
    sequences = policy.all_sequences()
    probs = policy.probs(logits).detach()
    kl = kl_divergence(policy, logits, ref_logits)
    moments = {}
    for estimator in KL_ESTIMATORS:
        estimates = sequence_kl_estimates(policy, logits, ref_logits, sequences, estimator)
        mean = float(probs @ estimates)
        moments[estimator] = {
            "mean": mean,
            "bias": mean - kl,
            "variance": float(probs @ (estimates - mean) ** 2),
        }
    return moments


def kl_estimator_table(
    policy: SequencePolicy,
    ref_logits: Tensor,
    direction: Tensor,
    kl_scales: list[float],
    num_samples: int,
    generator: torch.Generator,
) -> pd.DataFrame:
    """Each KL estimator's exact relative bias and spread, and a Monte Carlo check of its mean,
    for the policies pi = ref_logits + scale * direction, one row per (scale, estimator).

    The Monte Carlo mean averages one sequence's estimate over `num_samples` draws from pi, one
    set of draws per scale shared by the three estimators; its gap to the exact mean is given in
    standard errors, sqrt(variance / num_samples).
    """
    sequences, rows = policy.all_sequences(), []
    for scale in kl_scales:
        logits = ref_logits + scale * direction
        kl = kl_divergence(policy, logits, ref_logits)
        moments = kl_estimator_moments(policy, logits, ref_logits)
        samples = sequences[policy.sample(logits, num_samples, generator)]
        for estimator in KL_ESTIMATORS:
            monte_carlo = sequence_kl_estimates(policy, logits, ref_logits, samples, estimator)
            std = math.sqrt(moments[estimator]["variance"])
            rows.append(
                {
                    "kl_scale": scale,
                    "exact KL": kl,
                    "estimator": estimator,
                    "relative bias": moments[estimator]["bias"] / kl,
                    "relative std": std / kl,
                    "Monte Carlo mean": float(monte_carlo.mean()),
                    "MC - exact mean, in standard errors": (
                        float(monte_carlo.mean()) - moments[estimator]["mean"]
                    )
                    / (std / math.sqrt(num_samples)),
                }
            )
    return pd.DataFrame(rows)


def kl_records(kl_table: pd.DataFrame) -> dict[str, float]:
    """The recorded values of `kl_estimator_table`, at its smallest and largest KL scale."""
    by_estimator = {
        estimator: kl_table[kl_table["estimator"] == estimator].reset_index(drop=True)
        for estimator in KL_ESTIMATORS
    }
    records = {
        "kl_smallest": float(by_estimator["k1"]["exact KL"].iloc[0]),
        "kl_largest": float(by_estimator["k1"]["exact KL"].iloc[-1]),
    }
    for estimator in KL_ESTIMATORS:
        relative_std = by_estimator[estimator]["relative std"]
        records[f"{estimator}_relative_std_smallest"] = float(relative_std.iloc[0])
        records[f"{estimator}_relative_std_largest"] = float(relative_std.iloc[-1])
    records["k2_relative_bias_smallest"] = float(by_estimator["k2"]["relative bias"].iloc[0])
    records["k2_relative_bias_largest"] = float(by_estimator["k2"]["relative bias"].iloc[-1])
    records["max_unbiased_relative_bias"] = float(
        max(by_estimator[e]["relative bias"].abs().max() for e in ("k1", "k3"))
    )
    records["kl_max_monte_carlo_z"] = float(
        kl_table["MC - exact mean, in standard errors"].abs().max()
    )
    return records
