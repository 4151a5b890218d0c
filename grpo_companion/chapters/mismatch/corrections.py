r"""The importance-sampling corrections of TRL and verl for rollouts from a sampler pi_samp that
is not the trained policy pi: the settings that give each, and the weight each puts on a token.

`CORRECTIONS` is the chapter's table, one `Correction` per row: what it computes, and the TRL
1.16 (``vllm_importance_sampling_mode``) and verl 0.9.1 (``algorithm.rollout_correction``)
settings that give it (`settings_table`). At the first step on a batch (pi_old = pi) a correction
puts a weight u_t(y) >= 0 on each token's score psi_t = grad log pi(y_t | s_t): `token_weights`
computes u from the log-ratios log pi - log pi_samp with the functions of
`grpo_companion.core.importance` (TRL's modes, verl's ``rollout_is`` and ``rollout_rs``) or, for
verl's bypass mode with PPO-clip, by autograd on chapter 3's
`grpo_companion.core.losses.clipped_surrogate` with pi_old = pi_samp. verl's rejection sampling
also takes the rejected tokens out of the loss's mask. The exact moments of the corrected
estimator are in `grpo_companion.chapters.mismatch.exact`.

Chapter: :doc:`/book/13_mismatch` (section 1: the estimator under a sampler, and what each
correction puts on a token)
"""

import math
from dataclasses import dataclass

import pandas as pd
import torch
from torch import Tensor

from grpo_companion.core.importance import (
    rollout_is_weights,
    rollout_rejection_mask,
    vllm_importance_weights,
)
from grpo_companion.core.losses import clipped_surrogate


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
