r"""Chapter 2: GRPO's estimator piece by piece, in exact expectation on the sequence policy.

Group estimators
----------------
For one prompt GRPO samples a group of G completions y_1..y_G i.i.d. from pi (TRL:
``num_generations``), turns their rewards into advantages A_1..A_G
(`grpo_companion.core.advantages.group_advantages`) and, at the first step on a batch (ratio 1, no
KL term), follows

    g = (1/G) sum_i A_i s(y_i),        s = grad log pi.

With the mean-including-self baseline ("dr_grpo", A_i = r_i - mean(r)) the group is symmetric,
so E[g] = E[A_1 s_1], and

    E[A_1 s_1] = E[r_1 s_1] - (1/G) E[r_1 s_1] - (1/G) sum_{j > 1} E[r_j] E[s_1]
               = (1 - 1/G) grad J,

since s_1 is independent of r_j for j != 1 and E[s] = 0: only the completion's own reward in the
mean correlates with its score. Leave-one-out ("rloo") leaves that term out: E[g] = grad J.

`group_estimator_moments` checks such statements without sampling. The methods are
permutation-equivariant, so g depends on a group only through the multiset of sequences it
holds; a multiset with counts c (sum_y c_y = G) is drawn with the multinomial probability
G! / prod_y c_y! * prod_y pi(y)^{c_y}. Summing over the C(N + G - 1, G) multisets of N
sequences gives exact moments, up to float64 rounding: 6,435 terms for N = 8 and G = 8, against
N^G = 16.8 million ordered groups.

KL estimators
-------------
With x_t = log pi(y_t | y_<t) - log pi_ref(y_t | y_<t) on a sequence y ~ pi, the per-token
estimators of `grpo_companion.core.losses.kl_penalty` summed over the tokens estimate the sequence
KL(pi || pi_ref) = E_pi[sum_t x_t]. k1 and k3 are unbiased for it (k3 adds pi_ref/pi - 1 at each
token, whose mean given the prefix is sum_a pi_ref(a | prefix) - 1 = 0); k2 = x^2 / 2 is not.
`kl_estimator_moments` gives the exact mean and variance of each by enumeration.

Token weights and inner iterations
----------------------------------
`token_weights` is d loss / d l_it for `grpo_companion.core.losses.aggregate`: how much each token's
loss counts under a ``loss_type``. `optimize_on_batch` takes several gradient steps on one batch
(TRL's ``num_iterations``), where the ratio pi / pi_old leaves 1 and clipping starts to act.
"""

import itertools
import math

import torch
from torch import Tensor

from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.losses import KL_ESTIMATORS, aggregate, grpo_loss, kl_penalty
from grpo_companion.core.policy_gradient import SequencePolicy


def multisets(
    num_outcomes: int, group_size: int, max_groups: int = 2_000_000
) -> tuple[Tensor, Tensor]:
    """Every multiset of `group_size` outcomes out of `num_outcomes`, once.

    Returns `members: (M, group_size)` outcome ids, each row sorted, and
    `log_multiplicity: (M,)` = log(G! / prod_y c_y!), the number of ordered groups that are
    that multiset; M = C(num_outcomes + group_size - 1, group_size). Refuses M > `max_groups`.
    """
    if num_outcomes < 1 or group_size < 1:
        raise ValueError(
            f"need num_outcomes >= 1 and group_size >= 1, got {num_outcomes}, {group_size}"
        )
    count = math.comb(num_outcomes + group_size - 1, group_size)
    if count > max_groups:
        raise ValueError(
            f"{count:,} multisets of {group_size} out of {num_outcomes} outcomes exceed max_groups = "
            f"{max_groups:,}; use a smaller policy or group size"
        )
    members = torch.tensor(
        list(itertools.combinations_with_replacement(range(num_outcomes), group_size))
    )
    counts = torch.nn.functional.one_hot(members, num_outcomes).sum(dim=1).to(torch.float64)
    log_multiplicity = math.lgamma(group_size + 1) - torch.lgamma(counts + 1).sum(dim=1)
    return members, log_multiplicity


def group_estimator_moments(
    policy: SequencePolicy,
    logits: Tensor,
    rewards: Tensor,
    group_size: int,
    method: str = "dr_grpo",
    **options,
) -> dict[str, Tensor]:
    """Exact mean and variance of g = (1/G) sum_i A_i s(y_i) over groups of G i.i.d. draws.

    `rewards: (num_sequences,)`; `method` and `options` go to `group_advantages`. Returns
    "mean": `(num_params,)`, E[g], and "variance": a scalar tensor, E||g - E[g]||^2 (the trace
    of the covariance, as in chapter 1's `estimator_variance`).
    """
    members, log_multiplicity = multisets(policy.num_sequences, group_size)
    log_probs = policy.log_prob(logits, policy.all_sequences()).detach()
    group_probs = (log_multiplicity + log_probs[members].sum(dim=1)).exp()  # (M,)
    advantages = group_advantages(rewards[members], method, **options)  # (M, G)
    score_table = policy.scores(logits, policy.all_sequences())  # (N, P)
    estimates = torch.einsum("mg,mgp->mp", advantages, score_table[members]) / group_size
    mean = group_probs @ estimates
    variance = group_probs @ (estimates - mean).square().sum(dim=1)
    return {"mean": mean, "variance": variance}


def sample_group_estimates(
    policy: SequencePolicy,
    logits: Tensor,
    rewards: Tensor,
    group_size: int,
    num_groups: int,
    generator: torch.Generator,
    method: str = "dr_grpo",
    **options,
) -> Tensor:
    """`num_groups` independent draws of g, each from a fresh group: `(num_groups, num_params)`.

    Each group's advantages are spread onto the sequences it holds, `(num_groups, N)`, then one
    matmul with the score table gives every g; no `(num_groups, G, num_params)` tensor is built.
    """
    members = policy.sample(logits, num_groups * group_size, generator).view(num_groups, group_size)
    advantages = group_advantages(rewards[members], method, **options)
    per_sequence = torch.zeros(num_groups, policy.num_sequences, dtype=advantages.dtype)
    per_sequence.scatter_add_(1, members, advantages / group_size)
    return per_sequence @ policy.scores(logits, policy.all_sequences())


def gradient_weight(expected: Tensor, true_gradient: Tensor) -> tuple[float, float]:
    """Write `expected = w * true_gradient + residual`, both `(num_params,)`.

    Returns w = <expected, grad J> / ||grad J||^2 and ||residual|| / ||grad J||: w = 1 and a zero
    residual is an unbiased estimator, w != 1 with a zero residual a rescaled one.
    """
    squared_norm = true_gradient.square().sum()
    weight = expected @ true_gradient / squared_norm
    residual = (expected - weight * true_gradient).norm() / squared_norm.sqrt()
    return float(weight), float(residual)


def kl_divergence(policy: SequencePolicy, logits: Tensor, ref_logits: Tensor) -> float:
    """KL(pi || pi_ref) = sum_y pi(y) log(pi(y) / pi_ref(y)) over whole sequences, exactly."""
    sequences = policy.all_sequences()
    log_probs = policy.log_prob(logits, sequences).detach()
    ref_log_probs = policy.log_prob(ref_logits, sequences).detach()
    return float(log_probs.exp() @ (log_probs - ref_log_probs))


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


def token_weights(mask: Tensor, loss_type: str, **options) -> Tensor:
    """How much each token's loss counts: d aggregate / d l_it, `(batch, seq_len)` like `mask`.

    `aggregate` is linear in the per-token loss, so this is the same at every loss value; the
    gradient reaching log pi of token t of completion i is this weight times -A_i at ratio 1.
    `options` go to `aggregate` (max_completion_length, alpha).
    """
    per_token_loss = torch.zeros(mask.shape, dtype=torch.float64, requires_grad=True)
    (weights,) = torch.autograd.grad(
        aggregate(per_token_loss, mask, loss_type, **options), per_token_loss
    )
    return weights


def batch_loss(
    policy: SequencePolicy,
    logits: Tensor,
    old_logits: Tensor,
    sequences: Tensor,
    advantages: Tensor,
    **loss_options,
) -> tuple[Tensor, dict[str, float]]:
    """`grpo_loss` on a batch of complete sequences, `sequences: (batch, length)` sampled from
    pi_old = `old_logits`, `advantages: (batch,)`; no KL term (beta = 0, TRL's default)."""
    log_probs = policy.token_log_probs(logits, sequences)
    old_log_probs = policy.token_log_probs(old_logits, sequences)
    mask = torch.ones_like(log_probs)
    return grpo_loss(log_probs, old_log_probs, None, advantages, mask, **loss_options)


def optimize_on_batch(
    policy: SequencePolicy,
    old_logits: Tensor,
    rewards: Tensor,
    sequences: Tensor,
    advantages: Tensor,
    num_iterations: int,
    learning_rate: float,
    **loss_options,
) -> dict[str, list[float]]:
    """`num_iterations` plain gradient steps on `batch_loss` of one batch, from pi_old.

    Returns, for the policy before each step: "kl", the exact KL(pi || pi_old); "objective", the
    exact J = E_pi[r] (`rewards: (num_sequences,)`); "clip_ratio", the fraction of the batch's
    tokens clipped (`grpo_loss`'s statistic).
    """
    logits = old_logits.detach().clone().requires_grad_(True)
    history = {"kl": [], "objective": [], "clip_ratio": []}
    for _ in range(num_iterations):
        loss, stats = batch_loss(policy, logits, old_logits, sequences, advantages, **loss_options)
        (gradient,) = torch.autograd.grad(loss, logits)
        history["kl"].append(kl_divergence(policy, logits, old_logits))
        history["objective"].append(float(policy.objective(logits.detach(), rewards)))
        history["clip_ratio"].append(stats["clip_ratio"])
        with torch.no_grad():
            logits -= learning_rate * gradient
    return history
