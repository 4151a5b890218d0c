r"""Chapter 13: rollouts from a sampler pi_samp that is not the trained policy pi, and the
importance-sampling corrections of TRL and verl, in exact expectation on chapter 1's
enumerable sequence policy. Figures are in `grpo_companion.chapters.mismatch.plots`.

The samplers
------------
`sampler_logits` turns the policy's logit table into the sampler's: a temperature (the logits
divided by it), top-p (`core.importance.top_p_log_probs`: the nucleus, renormalised) or a
rounding of the logits (`core.importance.round_logits`, bf16 at 8 significant bits).

The estimator
-------------
A group of G sequences y_1..y_G is drawn i.i.d. from pi_samp, A_i are the group's advantages
(`core.advantages.group_advantages`) and, at the first step on the batch (pi_old = pi), a
correction puts a weight u_t(y) >= 0 on the score psi_t = grad log pi(y_t | s_t) of each token:

    g = (1/G) sum_i A_i v(y_i),        v(y) = sum_t u_t(y) psi_t(y) / eta.

`token_weights` computes u from the log-ratios log pi - log pi_samp with the functions of
`core.importance` (TRL's ``vllm_importance_sampling_mode``, verl's ``rollout_is`` and
``rollout_rs``) or, for verl's bypass mode with PPO-clip, by autograd on chapter 3's
`core.losses.clipped_surrogate` with pi_old = pi_samp. eta is 1 except under verl's rejection
sampling, whose rejected tokens also leave the token-mean normaliser: eta is then the expected
fraction of kept tokens, the normaliser of a large batch (`corrected_score_table`). Without a
correction v is the score s(y), and g is chapter 2's `group_gradient`.

Exact moments
-------------
u depends on the sequence alone (bypass PPO-clip also on the sign of A, i.e. on r(y)), so v is a
table over the sequences. With a binary reward, every method gives the correct completions of a
group with k correct one advantage a_c(k) and the incorrect ones a_i(k)
(`core.exact.binary_group_advantages`), and given k the group is k independent draws from
pi_samp given r = 1 and G - k given r = 0. With q the sampler's pass rate,
b_k = C(G, k) q^k (1 - q)^(G - k), M_r = E[v | r] and Q_r = E[||v||^2 | r]:

    E[g]     = (1/G) sum_k b_k (k a_c M_1 + (G - k) a_i M_0),
    E||g||^2 = (1/G^2) sum_k b_k (a_c^2 (k Q_1 + k (k - 1) ||M_1||^2)
                                  + a_i^2 ((G - k) Q_0 + (G - k) (G - k - 1) ||M_0||^2)
                                  + 2 a_c a_i k (G - k) <M_1, M_0>),

and Var[g] = E||g||^2 - ||E[g]||^2, the trace of the covariance (`binary_group_moments`).
(Chapter 13 writes v as \tilde s, the weighted score, q as p_samp, a_c and a_i as a_+ and a_-,
and spells b_k out: in the book v is the score noise, b a baseline and Q a value.)
`mismatch_table` measures each correction against the on-policy estimator (u = 1,
pi_samp = pi), whose mean E_pi[g] is what GRPO follows without a mismatch ((1 - 1/G) grad J
with Dr. GRPO's advantages): the bias ||E[g] - E_pi[g]|| / ||E_pi[g]||, the cosine of E[g] with
grad J, and Var[g] over the on-policy variance.
"""

import math
from dataclasses import dataclass

import pandas as pd
import torch
from torch import Tensor

from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.exact import binary_group_advantages
from grpo_companion.core.importance import (
    kept_mass,
    rollout_is_weights,
    rollout_rejection_mask,
    round_logits,
    top_p_log_probs,
    vllm_importance_weights,
)
from grpo_companion.core.kl import exact_kl
from grpo_companion.core.losses import clipped_surrogate
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


@dataclass(frozen=True)
class Correction:
    """One row of the chapter's table: what it computes, and the TRL 1.16 and verl 0.9.1
    settings that give it ("" where a library has none). ``mode``, ``clip_max``, ``clip_min``:
    TRL's `vllm_importance_weights`; ``rollout_is*`` and ``rollout_rs*``: verl's
    `rollout_is_weights` and `rollout_rejection_mask`; ``ppo_clip``: verl's bypass mode with
    PPO-clip, (clip_ratio, clip_ratio_c)."""

    name: str
    trl: str = ""
    verl: str = ""
    mode: str | None = None
    clip_max: float | None = None
    clip_min: float | None = None
    rollout_is: str | None = None
    rollout_is_threshold: float | str = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    ppo_clip: tuple[float, float] | None = None


CORRECTIONS = (
    Correction(
        "none",
        trl="vllm_importance_sampling_correction=False",
        verl="rollout_is=null, rollout_rs=null (RolloutCorrectionConfig.disabled())",
    ),
    Correction(
        "token IS",
        trl='"token_truncate", clip_max=inf',
        verl='rollout_is="token", rollout_is_threshold=inf',
        mode="token_truncate",
        clip_max=math.inf,
    ),
    Correction(
        "sequence IS",
        trl='"sequence_truncate", clip_max=inf',
        verl='rollout_is="sequence", rollout_is_threshold=inf',
        mode="sequence_truncate",
        clip_max=math.inf,
    ),
    Correction(
        "token_truncate 3",
        trl='"token_truncate" (clip_max=3.0)',
        verl='rollout_is="token", rollout_is_threshold=3.0',
        mode="token_truncate",
        clip_max=3.0,
    ),
    Correction("token_mask 3", trl='"token_mask" (clip_max=3.0)', mode="token_mask", clip_max=3.0),
    Correction(
        "sequence_truncate 3",
        trl='"sequence_truncate" (clip_max=3.0)',
        verl='rollout_is="sequence", rollout_is_threshold=3.0',
        mode="sequence_truncate",
        clip_max=3.0,
    ),
    Correction(
        "sequence_mask 3",
        trl='"sequence_mask" (clip_max=3.0): the default',
        mode="sequence_mask",
        clip_max=3.0,
    ),
    Correction(
        "token TIS 2",
        trl='"token_truncate", clip_max=2.0',
        verl='decoupled_token_is(): rollout_is="token", rollout_is_threshold=2.0',
        rollout_is="token",
        rollout_is_threshold=2.0,
    ),
    Correction(
        "sequence TIS 2",
        trl='"sequence_truncate", clip_max=2.0',
        verl='decoupled_seq_is(), bypass_pg_is(): rollout_is="sequence", rollout_is_threshold=2.0 '
        "(the config's defaults)",
        rollout_is="sequence",
        rollout_is_threshold=2.0,
    ),
    Correction(
        "IcePop 0.5-5",
        trl='"token_mask", clip_min=0.5, clip_max=5.0',
        verl='decoupled_token_icepop(): rollout_is="token", rollout_is_threshold="0.5_5.0"',
        rollout_is="token",
        rollout_is_threshold="0.5_5.0",
    ),
    Correction(
        "sequence TIS 2 + RS 0.5-2",
        trl='"sequence_mask", clip_min=0.5, clip_max=2.0 (the same weights; the masked tokens '
        "stay in TRL's normaliser)",
        verl='decoupled_seq_is_rs(): rollout_is="sequence", 2.0; rollout_rs="seq_sum_k1", '
        '"0.5_2.0"',
        rollout_is="sequence",
        rollout_is_threshold=2.0,
        rollout_rs="seq_sum_k1",
        rollout_rs_threshold="0.5_2.0",
    ),
    Correction(
        "geometric RS 0.999-1.001",
        verl='decoupled_geo_rs(): rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"',
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold="0.999_1.001",
    ),
    Correction(
        "K3 RS 0.01",
        verl='decoupled_k3_rs(): rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01',
        rollout_rs="seq_mean_k3",
        rollout_rs_threshold=0.01,
    ),
    Correction(
        "bypass PPO-clip",
        verl="bypass_ppo_clip(): PPO ratio pi / pi_samp, clip_ratio 0.2, clip_ratio_c 3.0",
        ppo_clip=(0.2, 3.0),
    ),
)


def correction(name: str) -> Correction:
    """The row of `CORRECTIONS` called `name`."""
    found = [row for row in CORRECTIONS if row.name == name]
    if not found:
        raise ValueError(f"no correction {name!r}; rows: {[row.name for row in CORRECTIONS]}")
    return found[0]


def settings_table(corrections=CORRECTIONS) -> pd.DataFrame:
    """Which TRL and verl settings give each row: TRL's `vllm_importance_sampling_mode` (with
    ``vllm_importance_sampling_correction=True``) and verl's ``algorithm.rollout_correction``
    (a preset of ``RolloutCorrectionConfig`` where one exists)."""
    return pd.DataFrame(
        {
            "TRL 1.16: vllm_importance_sampling_*": [row.trl or "-" for row in corrections],
            "verl 0.9.1: algorithm.rollout_correction": [row.verl or "-" for row in corrections],
        },
        index=pd.Index([row.name for row in corrections], name="row"),
    )


def token_weights(
    row: Correction, log_ratio: Tensor, mask: Tensor, rewards: Tensor
) -> tuple[Tensor, Tensor]:
    """(u, kept), both (N, T): the weight of each token's score under correction `row`, and the
    tokens that stay in the loss's mask (verl's rejection sampling removes some).

    `log_ratio` = log pi - log pi_samp of each token, `mask` the completion mask, `rewards`
    (N,) binary: the sign of a completion's advantage, which verl's bypass PPO-clip needs.
    """
    kept = mask
    if row.ppo_clip is not None:
        clip_ratio, clip_ratio_c = row.ppo_clip
        log_probs = log_ratio.detach().clone().requires_grad_(True)  # pi_old = pi_samp: log 1
        sign = torch.where(rewards > 0, 1.0, -1.0).to(log_ratio.dtype)
        loss, _ = clipped_surrogate(
            log_probs, torch.zeros_like(log_probs), sign, epsilon=clip_ratio, delta=clip_ratio_c
        )
        (gradient,) = torch.autograd.grad((loss * mask).sum(), log_probs)
        return -gradient * sign[:, None], kept  # the loss's gradient is -u A grad log pi
    if row.mode is not None:
        weights = vllm_importance_weights(log_ratio, mask, row.mode, row.clip_max, row.clip_min)
    elif row.rollout_is is not None:
        weights = rollout_is_weights(log_ratio, mask, row.rollout_is, row.rollout_is_threshold)
    else:
        weights = torch.ones_like(log_ratio)
    if row.rollout_rs is not None:
        kept = rollout_rejection_mask(log_ratio, mask, row.rollout_rs, row.rollout_rs_threshold)
    return weights.expand_as(log_ratio) * kept, kept


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
    of G i.i.d. draws from `probs` (N,), for binary `rewards` (N,) and `table` (N, P) = v(y)
    (module docstring). `method` and `options` go to `group_advantages`."""
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
