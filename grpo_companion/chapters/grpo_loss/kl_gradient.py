r"""Chapter 3: what the KL estimators do as a loss. The penalty is differentiated, so what it does
to the policy is its mean gradient, not its mean value.

Per token, with the prefix drawn from pi but not differentiated, the mean gradient of k1 is 0,
of k2 (and of TRL's ratio-weighted k3, `use_bias_correction_kl`) that of the reverse KL
KL(pi || pi_ref) of the next-token distributions, and of k3 that of the forward KL
KL(pi_ref || pi). A whole sequence's KL gradient has more: it also credits each token with the
KL of the tokens after it. `kl_gradient_table` checks all of it by enumeration on a
`SequencePolicy`; the estimators' values are `grpo_companion.chapters.grpo_loss.kl`.

Chapter: :doc:`/book/03_grpo_loss` (section 4, where the mean gradients are derived).
"""

import pandas as pd
import torch
from torch import Tensor

from grpo_companion.chapters.grpo_loss.kl import sequence_kl
from grpo_companion.core.kl import exact_kl
from grpo_companion.core.losses import grpo_loss
from grpo_companion.core.policy_gradient import SequencePolicy

REVERSE, FORWARD = "KL(pi || ref)", "KL(ref || pi)"

# Per-token KL losses as TRL builds them -> (`kl_penalty` estimator, multiplied by the ratio
# pi / pi_old (TRL's `use_bias_correction_kl`), the KL whose per-token gradient is its mean one).
KL_GRADIENT_LOSSES = {
    "k1": ("k1", False, None),
    "k2": ("k2", False, REVERSE),
    "k3": ("k3", False, FORWARD),
    "ratio x k3": ("k3", True, REVERSE),
}


def token_kls(
    policy: SequencePolicy, logits: Tensor, ref_logits: Tensor, sequences: Tensor
) -> Tensor:
    """KL(pi(. | y_<t) || pi_ref(. | y_<t)) at each step t of `sequences: (n, length)`, `(n,
    length)`, differentiable in both logits: token t is replaced by every token a in turn, and
    `token_log_probs` at step t is then log pi(a | y_<t)."""
    n, length = sequences.shape
    steps = torch.arange(length)
    variants = sequences[:, None, None, :].repeat(1, length, policy.vocab_size, 1)
    variants[:, steps, :, steps] = torch.arange(policy.vocab_size)
    log_p, log_ref = (
        policy.token_log_probs(table, variants.view(-1, length))
        .view(n, length, policy.vocab_size, length)
        .diagonal(dim1=1, dim2=3)
        for table in (logits, ref_logits)
    )  # (n, vocab_size, length): log pi(a | y_<t)
    return exact_kl(log_p, log_ref, dim=1)


def expected_kl_gradient(
    policy: SequencePolicy, logits: Tensor, ref_logits: Tensor, loss: str
) -> Tensor:
    """sum_y pi_old(y) grad loss(y), `(num_params,)`, pi_old = pi detached: the mean gradient of
    a per-token KL loss of `KL_GRADIENT_LOSSES` summed over y's tokens, as autograd sees it.

    loss(y) is `grpo_loss` on y alone with zero advantage and beta = 1, times y's length: the KL
    term exactly as the loss builds it, ratio included."""
    estimator, use_bias_correction_kl, _ = KL_GRADIENT_LOSSES[loss]
    leaf = logits.detach().clone().requires_grad_(True)
    sequences = policy.all_sequences()
    log_probs = policy.token_log_probs(leaf, sequences)
    ref_log_probs = policy.token_log_probs(ref_logits, sequences).detach()
    pi_old = policy.probs(logits).detach()
    total = 0.0
    for y in range(len(sequences)):
        row = slice(y, y + 1)
        loss_y, _ = grpo_loss(
            log_probs[row], log_probs[row].detach(), ref_log_probs[row],
            torch.zeros(1, dtype=log_probs.dtype), torch.ones_like(log_probs[row]),
            beta=1.0, kl_estimator=estimator, use_bias_correction_kl=use_bias_correction_kl,
        )  # fmt: skip
        total = total + pi_old[y] * policy.length * loss_y
    (gradient,) = torch.autograd.grad(total, leaf)
    return gradient.flatten()


def kl_gradients(policy: SequencePolicy, logits: Tensor, ref_logits: Tensor) -> dict:
    """{(KL, "sequence" or "per token"): its gradient in `logits`, `(num_params,)`} for KL =
    `REVERSE` or `FORWARD`: the sequence KL (`sequence_kl`), or sum_y pi_old(y) sum_t
    `token_kls`(y)_t with pi_old = pi detached."""
    leaf = logits.detach().clone().requires_grad_(True)
    sequences, pi_old = policy.all_sequences(), policy.probs(logits).detach()
    kls = {
        (REVERSE, "sequence"): sequence_kl(policy, leaf, ref_logits),
        (FORWARD, "sequence"): sequence_kl(policy, ref_logits, leaf),
        (REVERSE, "per token"): pi_old @ token_kls(policy, leaf, ref_logits, sequences).sum(1),
        (FORWARD, "per token"): pi_old @ token_kls(policy, ref_logits, leaf, sequences).sum(1),
    }
    return {key: torch.autograd.grad(kl, leaf)[0].flatten() for key, kl in kls.items()}


def kl_gradient_table(
    policy: SequencePolicy, ref_logits: Tensor, direction: Tensor, kl_scales: list[float]
) -> tuple[pd.DataFrame, list[float]]:
    """Per loss of `KL_GRADIENT_LOSSES`, over the policies ref_logits + scale * direction: the
    largest error of its mean gradient against its per-token KL's gradient (against 0 for k1),
    and its smallest and largest gap to the same sequence KL's gradient, relative to that
    gradient's norm (k1, whose mean gradient is 0: to grad KL(pi || ref), the KL the objective is
    written with, so its gap is 1).

    Also returns, per scale, ||grad KL(ref || pi) - grad KL(pi || ref)|| / ||grad KL(pi || ref)||
    for the sequence KLs: how much the direction of the KL matters there."""
    errors, gaps = dict.fromkeys(KL_GRADIENT_LOSSES, 0.0), {loss: [] for loss in KL_GRADIENT_LOSSES}
    forward_reverse = []
    for scale in kl_scales:
        logits = ref_logits + scale * direction
        targets = kl_gradients(policy, logits, ref_logits)
        reverse = targets[(REVERSE, "sequence")]
        forward_reverse.append(
            float((targets[(FORWARD, "sequence")] - reverse).norm() / reverse.norm())
        )
        for loss, (*_, kl) in KL_GRADIENT_LOSSES.items():
            gradient = expected_kl_gradient(policy, logits, ref_logits, loss)
            token = targets[(kl, "per token")] if kl else torch.zeros_like(gradient)
            sequence = targets[(kl or REVERSE, "sequence")]
            errors[loss] = max(errors[loss], float((gradient - token).abs().max()))
            gaps[loss].append(float((gradient - sequence).norm() / sequence.norm()))
    table = pd.DataFrame(
        {
            "mean gradient: per token, that of": [
                kl or "0" for *_, kl in KL_GRADIENT_LOSSES.values()
            ],
            "max error": list(errors.values()),
            "relative gap to the sequence KL's, min": [min(gap) for gap in gaps.values()],
            "max": [max(gap) for gap in gaps.values()],
        },
        index=pd.Index(list(KL_GRADIENT_LOSSES), name="per-token loss"),
    )
    return table, forward_reverse


def kl_gradient_records(table: pd.DataFrame, forward_reverse: list[float]) -> dict[str, float]:
    """The recorded values of `kl_gradient_table`: its largest error, k2's and k3's gaps to the
    sequence KL's gradient, and the forward-reverse gap at the smallest and the largest scale."""
    records = {"kl_gradient_max_error": float(table["max error"].max())}
    for loss in ("k2", "k3"):
        records[f"kl_gradient_gap_{loss}_min"] = float(
            table.loc[loss, "relative gap to the sequence KL's, min"]
        )
        records[f"kl_gradient_gap_{loss}_max"] = float(table.loc[loss, "max"])
    records["kl_gradient_forward_reverse_smallest"] = forward_reverse[0]
    records["kl_gradient_forward_reverse_largest"] = forward_reverse[-1]
    return records
