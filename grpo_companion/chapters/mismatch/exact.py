r"""Rollouts from a sampler pi_samp that is not the trained policy pi: the exact bias and
variance of GRPO's estimator under each correction, on chapter 1's enumerable sequence policy.

`sampler_logits` turns the policy's logit table into the sampler's: a temperature, top-p
(`grpo_companion.core.importance.top_p_log_probs`) or a rounding of the logits
(`grpo_companion.core.importance.round_logits`; 8 significant bits is bf16's). Under a correction
of `grpo_companion.chapters.mismatch.corrections` a group's estimate is
g = (1/G) sum_i A_i v(y_i), y_i ~ pi_samp, with v(y) = sum_t u_t(y) psi_t(y) / eta and eta the
expected fraction of kept tokens (1 without rejection sampling): v is a table over the sequences
(`corrected_score_table`), and with a binary reward the moments of g are sums over the number of
correct completions in a group (`binary_group_moments`). `mismatch_table` measures each
correction against the on-policy estimator (`on_policy_moments`), `mismatch_sizes` how far each
sampler is from the policy, `monte_carlo_check` the exact moments against sampled groups
(`sample_corrected_groups`), and `top_p_ratio_means` the mean token ratio under top-p. Figures
are in `grpo_companion.chapters.mismatch.plots`.

Chapter: :doc:`/book/13_mismatch` (section 1: the estimator and its exact moments; sections 2 to
4: the samplers, every correction's bias and variance, and the Monte Carlo check)
"""

import math

import pandas as pd
import torch
from torch import Tensor

from grpo_companion.chapters.mismatch.corrections import CORRECTIONS, Correction, token_weights
from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.exact import binary_group_advantages
from grpo_companion.core.importance import kept_mass, round_logits, top_p_log_probs
from grpo_companion.core.kl import exact_kl
from grpo_companion.core.policy_gradient import SequencePolicy

MISMATCHES = ("temperature", "top_p", "rounding")
# Where each mismatch has none: the size at which the sampler is the policy (53 significant
# bits are float64's own: rounding to them changes nothing).
NO_MISMATCH = {"temperature": 1.0, "top_p": 1.0, "rounding": 53}


def sampler_logits(logits: Tensor, mismatch: str, size) -> Tensor:
    """The sampler's logit table (a log-prob table for top-p, -inf outside the nucleus), same
    shape as the policy's `logits`: "temperature" divides by `size`, "top_p" keeps the nucleus
    of mass `size`, "rounding" rounds to `size` significant bits."""
    if mismatch == "temperature":
        return logits / size
    if mismatch == "top_p":
        return top_p_log_probs(logits, size)
    if mismatch == "rounding":
        return round_logits(logits, int(size))
    raise ValueError(f"unknown mismatch {mismatch!r}; expected one of {MISMATCHES}")


def mismatch_log_ratios(
    policy: SequencePolicy, logits: Tensor, sampler: Tensor, sequences: Tensor
) -> Tensor:
    """log pi(y_t | s_t) - log pi_samp(y_t | s_t) of each token, (n, length); +inf where the
    sampler cannot produce the token (outside top-p's nucleus)."""
    return policy.token_log_probs(logits, sequences) - policy.token_log_probs(sampler, sequences)


def corrected_score_table(
    policy: SequencePolicy, logits: Tensor, sampler: Tensor, rewards: Tensor, row: Correction
) -> dict[str, Tensor | float]:
    """v(y) for every sequence, and what it is made of.

    Returns "table" (N, P) = sum_t u_t(y) psi_t(y) / eta, 0 on the sequences pi_samp never
    draws; "probs" (N,) = pi_samp(y); "kept", eta, the expected fraction of kept tokens (1 without
    rejection sampling); "zeroed", the expected fraction of tokens with u_t = 0.
    """
    sequences = policy.all_sequences()
    probs = policy.probs(sampler).detach()
    support = probs > 0
    log_ratio = mismatch_log_ratios(policy, logits, sampler, sequences).detach()
    log_ratio = torch.where(support[:, None], log_ratio, 0.0)  # never drawn: any finite value
    mask = torch.ones_like(log_ratio)
    weights, kept = token_weights(row, log_ratio, mask, rewards)
    weights, kept = weights * support[:, None], kept * support[:, None]
    kept_fraction = float(probs @ kept.mean(dim=1))
    token_scores = policy.scores(logits, sequences).view(len(sequences), policy.length, -1)
    table = (weights[:, :, None] * token_scores).flatten(start_dim=1)
    table = table / kept_fraction if kept_fraction > 0 else torch.zeros_like(table)
    zeroed = float(probs @ (weights == 0).to(probs.dtype).mean(dim=1))
    return {"table": table, "probs": probs, "kept": kept_fraction, "zeroed": zeroed}


def binary_group_moments(
    probs: Tensor, rewards: Tensor, table: Tensor, group_size: int, method="dr_grpo", **options
) -> dict[str, Tensor]:
    """Exact E[g] (P,) and Var[g] (a scalar tensor) of g = (1/G) sum_i A_i v(y_i) over groups
    of G i.i.d. draws from `probs` (N,), for binary `rewards` (N,) and `table` (N, P) = v(y).
    `method` and `options` go to `group_advantages`.

    A group with k correct completions gives them one advantage a_c(k) and the others a_i(k)
    (`grpo_companion.core.exact.binary_group_advantages`), and given k it is k independent draws
    given r = 1 and G - k given r = 0. With q the pass rate under `probs`,
    b_k = C(G, k) q^k (1 - q)^(G - k), M_r = E[v | r] and Q_r = E[||v||^2 | r]:

        E[g]     = (1/G) sum_k b_k (k a_c M_1 + (G - k) a_i M_0),
        E||g||^2 = (1/G^2) sum_k b_k (a_c^2 (k Q_1 + k (k - 1) ||M_1||^2)
                                      + a_i^2 ((G - k) Q_0 + (G - k) (G - k - 1) ||M_0||^2)
                                      + 2 a_c a_i k (G - k) <M_1, M_0>),

    and Var[g] = E||g||^2 - ||E[g]||^2, the trace of the covariance. (Chapter 13 writes v as
    s-tilde, the weighted score, q as p_samp, and a_c, a_i as a_+, a_-.)
    """
    if not ((rewards == 0) | (rewards == 1)).all():
        raise ValueError("binary_group_moments needs binary rewards in {0, 1}")
    a_correct, a_incorrect = (
        torch.from_numpy(a).nan_to_num(0.0)
        for a in binary_group_advantages(group_size, method, **options)
    )
    k = torch.arange(group_size + 1, dtype=torch.float64)
    q = float(probs @ rewards)
    log_binomial = (
        math.lgamma(group_size + 1) - torch.lgamma(k + 1) - torch.lgamma(group_size - k + 1)
    )
    if 0 < q < 1:
        b = (log_binomial + k * math.log(q) + (group_size - k) * math.log(1 - q)).exp()
    else:  # every group has k = 0, or every group k = G
        b = (k == round(q) * group_size).to(k.dtype)
    squared_norms = table.square().sum(dim=1)
    moments = {}
    for r, mass in ((1, probs * rewards), (0, probs * (1 - rewards))):
        total = float(mass.sum())
        moments[r] = (
            (mass @ table / total, float(mass @ squared_norms) / total)
            if total > 0
            else (torch.zeros(table.shape[1], dtype=table.dtype), 0.0)
        )
    (m1, q1), (m0, q0) = moments[1], moments[0]
    j = group_size - k
    mean = ((b * k * a_correct).sum() * m1 + (b * j * a_incorrect).sum() * m0) / group_size
    second = (
        b
        * (
            a_correct**2 * (k * q1 + k * (k - 1) * m1.square().sum())
            + a_incorrect**2 * (j * q0 + j * (j - 1) * m0.square().sum())
            + 2 * a_correct * a_incorrect * k * j * (m1 @ m0)
        )
    ).sum() / group_size**2
    return {"mean": mean, "variance": second - mean.square().sum()}


def on_policy_moments(
    policy: SequencePolicy, logits: Tensor, rewards: Tensor, group_size: int, method, **options
) -> dict[str, Tensor]:
    """`binary_group_moments` without a mismatch: groups from pi itself, u = 1, v = s(y)."""
    table = policy.scores(logits, policy.all_sequences())
    return binary_group_moments(
        policy.probs(logits).detach(), rewards, table, group_size, method, **options
    )


def mismatch_table(
    policy: SequencePolicy,
    logits: Tensor,
    rewards: Tensor,
    group_size: int,
    mismatches: dict[str, list],
    corrections=CORRECTIONS,
    method: str = "dr_grpo",
    **options,
) -> pd.DataFrame:
    """One row per (mismatch, size, correction): exact "bias" (||E[g] - E_pi[g]|| over
    ||E_pi[g]||), "cosine" (of E[g] with grad J; 0 where E[g] = 0), "scale"
    (<E[g], E_pi[g]> / ||E_pi[g]||^2, the step along the on-policy direction), "variance"
    (Var[g] over the on-policy Var[g]),
    "kept" and "zeroed" (`corrected_score_table`). `mismatches`: {mismatch: [sizes]}."""
    reference = on_policy_moments(policy, logits, rewards, group_size, method, **options)
    target, reference_variance = reference["mean"], float(reference["variance"])
    true_gradient = policy.exact_gradient(logits, rewards)
    rows = []
    for mismatch, sizes in mismatches.items():
        for size in sizes:
            sampler = sampler_logits(logits, mismatch, size)
            for row in corrections:
                parts = corrected_score_table(policy, logits, sampler, rewards, row)
                moments = binary_group_moments(
                    parts["probs"], rewards, parts["table"], group_size, method, **options
                )
                mean = moments["mean"]
                norm = float(mean.norm())
                rows.append(
                    {
                        "mismatch": mismatch,
                        "size": size,
                        "correction": row.name,
                        "bias": float((mean - target).norm() / target.norm()),
                        "cosine": float(mean @ true_gradient) / (norm * float(true_gradient.norm()))
                        if norm > 0
                        else 0.0,
                        "scale": float(mean @ target / target.square().sum()),
                        "variance": float(moments["variance"]) / reference_variance,
                        "kept": parts["kept"],
                        "zeroed": parts["zeroed"],
                    }
                )
    return pd.DataFrame(rows)


def mismatch_sizes(
    policy: SequencePolicy, logits: Tensor, mismatches: dict[str, list], cap: float = 3.0
) -> pd.DataFrame:
    """How far each sampler is from the policy, exactly: "kl" = KL(pi_samp || pi) of whole
    sequences (`exact_kl`), "mean_abs_log_ratio" = E_samp of the mean |log pi - log pi_samp| over a
    sequence's tokens (TRL logs its batch mean as ``sampling/sampling_logp_difference/mean``),
    "above_cap" = P_samp(rho(y) > cap), "lost_mass" = the mass pi puts on sequences pi_samp
    never draws."""
    sequences = policy.all_sequences()
    log_pi = policy.log_prob(logits, sequences).detach()
    pi = log_pi.exp()
    rows = []
    for mismatch, sizes in mismatches.items():
        for size in sizes:
            sampler = sampler_logits(logits, mismatch, size)
            log_samp = policy.log_prob(sampler, sequences).detach()
            probs = log_samp.exp()
            support = probs > 0
            log_ratio = mismatch_log_ratios(policy, logits, sampler, sequences).detach()
            log_ratio = torch.where(support[:, None], log_ratio, 0.0)
            rows.append(
                {
                    "mismatch": mismatch,
                    "size": size,
                    "kl": float(exact_kl(log_samp, log_pi)),
                    "mean_abs_log_ratio": float(probs @ log_ratio.abs().mean(dim=1)),
                    "above_cap": float(probs @ (log_ratio.sum(dim=1) > math.log(cap)).double()),
                    "lost_mass": float(pi[~support].sum()),
                }
            )
    return pd.DataFrame(rows)


def sample_corrected_groups(
    policy: SequencePolicy,
    logits: Tensor,
    sampler: Tensor,
    rewards: Tensor,
    row: Correction,
    group_size: int,
    num_groups: int,
    generator: torch.Generator,
    method: str = "dr_grpo",
    chunk: int = 2048,
    **options,
) -> Tensor:
    """`num_groups` sampled estimates g, (num_groups, P), the way a trainer computes them: G
    sequences drawn from pi_samp per group, their advantages by `group_advantages`, the weights
    by `token_weights` on the drawn sequences' log-ratios, the scores by `policy.scores`; eta
    is the exact one (`corrected_score_table`), a large batch's. `chunk` groups at a time."""
    draws = policy.sample(sampler, num_groups * group_size, generator).view(num_groups, -1)
    eta = corrected_score_table(policy, logits, sampler, rewards, row)["kept"]
    estimates = []
    for group_draws in draws.split(chunk):
        sequences = policy.all_sequences()[group_draws.flatten()]
        advantages = group_advantages(rewards[group_draws], method, **options).flatten()
        log_ratio = mismatch_log_ratios(policy, logits, sampler, sequences).detach()
        weights, _ = token_weights(
            row, log_ratio, torch.ones_like(log_ratio), rewards[group_draws.flatten()]
        )
        token_scores = policy.scores(logits, sequences).view(len(sequences), policy.length, -1)
        corrected = (weights[:, :, None] * token_scores).flatten(start_dim=1)
        corrected = corrected / eta if eta > 0 else torch.zeros_like(corrected)
        estimates.append(
            (advantages[:, None] * corrected).view(len(group_draws), group_size, -1).mean(dim=1)
        )
    return torch.cat(estimates)


def monte_carlo_check(
    policy: SequencePolicy,
    logits: Tensor,
    rewards: Tensor,
    group_size: int,
    mismatch: str,
    size,
    num_groups: int,
    seed: int,
    corrections=CORRECTIONS,
    method: str = "dr_grpo",
    **options,
) -> pd.DataFrame:
    """Exact moments against `num_groups` sampled groups, per correction: "mean_error" =
    ||mean of g - E[g]||^2 / (Var[g] / num_groups), whose expectation is 1, and
    "variance_error" = sample Var over exact Var, minus 1; both NaN where Var[g] = 0 (every
    token rejected: g = 0, "max_abs_estimate" says so)."""
    sampler = sampler_logits(logits, mismatch, size)
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for row in corrections:
        parts = corrected_score_table(policy, logits, sampler, rewards, row)
        exact = binary_group_moments(
            parts["probs"], rewards, parts["table"], group_size, method, **options
        )
        estimates = sample_corrected_groups(
            policy, logits, sampler, rewards, row, group_size, num_groups, generator, method,
            **options,
        )  # fmt: skip
        variance = float(exact["variance"])
        squared_error = float((estimates.mean(dim=0) - exact["mean"]).square().sum())
        sample_variance = float(estimates.var(dim=0).sum())
        rows.append(
            {
                "correction": row.name,
                "mean_error": squared_error / (variance / num_groups) if variance > 0 else math.nan,
                "variance_error": sample_variance / variance - 1 if variance > 0 else math.nan,
                "max_abs_estimate": float(estimates.abs().max()),
            }
        )
    return pd.DataFrame(rows)


def top_p_ratio_means(
    policy: SequencePolicy, logits: Tensor, top_p: float, num_samples: int, seed: int
) -> dict[str, float]:
    """The mean of the token ratio pi / pi_samp under top-p sampling, against the kept mass Z.

    Per context s_t, E_samp[pi / pi_samp | s_t] = sum over the nucleus of pi = Z(s_t). Returns
    "max_context_error" (the largest |E_samp[ratio | s_t] - Z(s_t)| over all contexts, exact),
    "exact_mean_ratio" (E_samp of a sequence's mean token ratio, what TRL's logged
    ``sampling/importance_sampling_ratio/mean`` estimates when no ratio exceeds the cap),
    "sampled_mean_ratio" (its mean over `num_samples` sampled sequences),
    "sampled_mean_kept_mass" (the mean of Z over the same tokens' contexts), "min_kept_mass".
    """
    sampler = sampler_logits(logits, "top_p", top_p)
    mass = kept_mass(logits, top_p)  # (length, contexts)
    ratio_table = torch.softmax(logits, dim=-1) / sampler.exp()  # inf outside the nucleus
    context_means = (sampler.exp() * ratio_table.nan_to_num(posinf=0.0)).sum(dim=-1)
    sequences = policy.all_sequences()
    probs = policy.probs(sampler).detach()
    support = probs > 0
    token_ratios = torch.where(
        support[:, None],
        mismatch_log_ratios(policy, logits, sampler, sequences).detach(),
        0.0,
    ).exp()
    draws = policy.sample(sampler, num_samples, torch.Generator().manual_seed(seed))
    steps = torch.arange(policy.length)
    contexts = torch.cat(
        [torch.full_like(sequences[:, :1], policy.vocab_size), sequences[:, :-1]], dim=1
    )
    return {
        "max_context_error": float((context_means - mass).abs().max()),
        "exact_mean_ratio": float(probs @ token_ratios.mean(dim=1)),
        "sampled_mean_ratio": float(token_ratios[draws].mean()),
        "sampled_mean_kept_mass": float(mass[steps, contexts[draws]].mean()),
        "min_kept_mass": float(mass.min()),
    }
