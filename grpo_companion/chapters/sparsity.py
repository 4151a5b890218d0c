r"""Gradient sparsity: how often a group of G completions carries no learning signal.

A group is *degenerate* when all its rewards are equal: every group-relative advantage of it
is zero (GRPO, Dr. GRPO, RLOO), so it costs G rollouts and moves nothing. With binary
rewards and G i.i.d. completions at pass rate p this happens with probability

    f(p) = p^G + (1 - p)^G          (all correct + all wrong).

Prompts differ: if the pass rate p of a random prompt has some distribution, the rate is
E[f(p)], never below the i.i.d. prediction f(E[p]) at the mean pass rate. Proof: f''(p) =
G (G - 1) (p^(G-2) + (1 - p)^(G-2)) >= 0 on [0, 1], so f is convex and Jensen's inequality
gives E[f(p)] >= f(E[p]); the gap is 0 for G = 1 (f = 1) or a constant p, and > 0 otherwise.

For p ~ Beta(m kappa, (1 - m) kappa) (mean m, concentration kappa) the moments are exact,
E[p^G] = B(a + G, b) / B(a, b) = prod_{j<G} (m kappa + j) / (kappa + j), and each factor
decreases in kappa (its derivative is j (m - 1) / (kappa + j)^2 <= 0). So the rate falls
monotonically from 1 (kappa -> 0: every prompt always or never solved) to f(m) (kappa -> inf:
every prompt at pass rate m), and a target rate in between fixes kappa: `beta_concentration_for`.

Estimators take plain tensors from any rollout batch: rewards (num_prompts, G), advantages
(num_prompts, G) or flattened, and completion_mask (num_prompts * G, max_completion_length).
`per_group_gradients` splits a batch's policy gradient into one term per group, so the share
carried by the mixed groups (`gradient_share`) can be measured on a real model. Across training
runs, `metric_by_step`, `seed_band` and `fitted_trend` aggregate `trainer.train` histories over
seeds, treating runs (not steps) as the independent units.
"""

import numpy as np
import torch
from scipy.optimize import brentq
from torch import Tensor

from grpo_companion.core.advantages import zero_std_groups
from grpo_companion.core.exact import check_group_size, check_pass_rates
from grpo_companion.core.losses import grpo_loss
from grpo_companion.lm.rollouts import sequence_log_probs


def iid_degenerate_rate(pass_rates, group_size):
    """P(all G correct) = p^G and P(all G wrong) = (1 - p)^G for each pass rate p.

    Returns: dict of float64 arrays of shape (P,): all_correct, all_wrong and their sum,
    degenerate (= `exact.estimator_moments(...)["degenerate_rate"]`).
    """
    p = check_pass_rates(pass_rates)
    group_size = check_group_size(group_size, minimum=1)
    return _split(p**group_size, (1 - p) ** group_size)


def mixture_degenerate_rate(pass_rates, weights, group_size):
    """E of `iid_degenerate_rate` for p = pass_rates[j] with probability weights[j] (P,).

    Use `exact.beta_quadrature(a, b)` as (pass_rates, weights) for p ~ Beta(a, b).
    Returns: dict of floats with the keys of `iid_degenerate_rate`.
    """
    rates = iid_degenerate_rate(pass_rates, group_size)
    weights = np.asarray(weights, dtype=np.float64)
    shape = rates["degenerate"].shape
    if weights.shape != shape or not np.all(weights >= 0) or weights.sum() <= 0:
        raise ValueError(f"weights must be non-negative, not all zero, with the shape of "
                         f"pass_rates {shape}; got shape {weights.shape}")
    return {key: float(weights @ value / weights.sum()) for key, value in rates.items()}


def beta_degenerate_rate(a, b, group_size):
    """Exact `mixture_degenerate_rate` for p ~ Beta(a, b), from the product formula.

    Unlike quadrature it stays exact for any a, b > 0 (Gauss-Jacobi nodes break down for
    a + b >~ 1e4, which `beta_concentration_for` needs). Returns: dict of floats.
    """
    if not (a > 0 and b > 0):
        raise ValueError(f"Beta parameters must be > 0, got a={a}, b={b}")
    j = np.arange(check_group_size(group_size, minimum=1))
    return _split(float(np.prod((a + j) / (a + b + j))), float(np.prod((b + j) / (a + b + j))))


def jensen_gap(pass_rates, weights, group_size):
    """E[f(p)] - f(E[p]) >= 0 with f(p) = p^G + (1 - p)^G (module docstring); a float."""
    mixture = mixture_degenerate_rate(pass_rates, weights, group_size)["degenerate"]
    mean = np.average(np.asarray(pass_rates, dtype=np.float64), weights=weights)
    return mixture - float(iid_degenerate_rate(mean, group_size)["degenerate"][0])


def iid_pass_rates_for(degenerate_rate, group_size):
    """The pass rates (p, 1 - p), p <= 1/2, at which i.i.d. groups are degenerate at this rate.

    f is symmetric about 1/2 and decreases on [0, 1/2] from 1 to its minimum 2^(1 - G), so a
    rate in [2^(1 - G), 1] has exactly one root there. Below that minimum no pass rate works,
    and heterogeneity only raises the rate (Jensen).
    """
    group_size = check_group_size(group_size)
    floor = 2.0 ** (1 - group_size)
    if not floor <= degenerate_rate <= 1:
        raise ValueError(f"at G = {group_size} an i.i.d. degenerate rate lies in "
                         f"[2^(1-G), 1] = [{floor:.4g}, 1], got {degenerate_rate}")
    p = brentq(lambda p: p**group_size + (1 - p) ** group_size - degenerate_rate, 0.0, 0.5,
               xtol=1e-14)
    return p, 1 - p


def beta_concentration_for(degenerate_rate, mean, group_size):
    """Concentration kappa = a + b of the Beta(mean kappa, (1 - mean) kappa) with this rate.

    Smaller kappa = more heterogeneous prompts (std of p: sqrt(m (1 - m) / (kappa + 1))).
    The rate falls monotonically in kappa from 1 to f(mean) (module docstring), so a rate
    strictly between has one root, found in log kappa over [1e-12, 1e12].
    """
    group_size = check_group_size(group_size)
    if not 0 < mean < 1:
        raise ValueError(f"mean pass rate must lie in (0, 1), got {mean}")
    iid = float(iid_degenerate_rate(mean, group_size)["degenerate"][0])
    if not iid < degenerate_rate < 1:
        raise ValueError(f"at G = {group_size} and mean pass rate {mean} a Beta gives a rate in "
                         f"(f(mean), 1) = ({iid:.4g}, 1), got {degenerate_rate}")

    def excess(log_kappa):
        a, b = mean * np.exp(log_kappa), (1 - mean) * np.exp(log_kappa)
        return beta_degenerate_rate(a, b, group_size)["degenerate"] - degenerate_rate

    bound = np.log(1e12)
    if excess(-bound) < 0 or excess(bound) > 0:
        raise ValueError(f"rate {degenerate_rate} is too close to the limits ({iid:.4g}, 1) "
                         f"to solve for kappa in [1e-12, 1e12]")
    return float(np.exp(brentq(excess, -bound, bound, xtol=1e-12)))


def zero_advantage_fractions(advantages: Tensor, completion_mask: Tensor,
                             atol: float = 1e-8) -> dict:
    """Fractions of rollouts and of completion tokens whose advantage is |A| <= atol.

    Args: advantages (num_prompts, G) or (num_prompts * G,); completion_mask
    (num_prompts * G, max_completion_length), 1 on real tokens. The token fraction weights each
    rollout by its length: what a token-level loss (DAPO) sees.
    """
    advantages = advantages.reshape(-1)
    if completion_mask.dim() != 2 or completion_mask.shape[0] != advantages.numel():
        raise ValueError(f"completion_mask must be (num_rollouts = {advantages.numel()}, T), "
                         f"got shape {tuple(completion_mask.shape)}")
    # A tolerance, not == 0: the mean of G equal floats need not round back to their value, so
    # a constant group's centred rewards can be ~1e-17 (~1e-13 after GRPO's division by eps).
    zero = (advantages.abs() <= atol).double()
    lengths = completion_mask.double().sum(dim=1)
    return {"rollouts": zero.mean().item(), "tokens": ((zero @ lengths) / lengths.sum()).item()}


def group_gradients(advantages: Tensor, scores: Tensor) -> Tensor:
    """Per-group estimates (1/G) sum_i A_i s_i, (num_prompts, P).

    Args: advantages (num_prompts, G); scores (num_prompts * G, P), one row s_i = grad log
    pi(o_i) per rollout, in prompt-major order.
    """
    if advantages.dim() != 2 or scores.dim() != 2 or scores.shape[0] != advantages.numel():
        raise ValueError(f"need advantages (num_prompts, G) and scores (num_prompts * G, P), got "
                         f"shapes {tuple(advantages.shape)} and {tuple(scores.shape)}")
    num_prompts, group_size = advantages.shape
    return (advantages[..., None] * scores.view(num_prompts, group_size, -1)).mean(dim=1)


def gradient_share(group_gradients: Tensor, mask: Tensor) -> float:
    """||sum of the masked groups' gradients|| / ||sum of all||, group_gradients (num_groups, P).

    With mask = ~zero_std_groups(rewards) and a method whose advantages vanish on a constant
    group (GRPO, Dr. GRPO, RLOO, softmax) this is exactly 1: degenerate groups cost rollouts,
    not direction. It differs from 1 for methods that move degenerate groups ("sign": A = -1
    on all-wrong groups). It can exceed 1 when groups cancel; inf or nan if the total is zero.
    """
    shape = tuple(group_gradients.shape)
    if len(shape) != 2 or tuple(mask.shape) != shape[:1] or mask.dtype != torch.bool:
        raise ValueError(f"need group_gradients (num_groups, P) and a bool mask (num_groups,), "
                         f"got shapes {shape} and {tuple(mask.shape)} ({mask.dtype})")
    return (group_gradients[mask].sum(dim=0).norm() / group_gradients.sum(dim=0).norm()).item()


def kept_groups(rewards: Tensor, atol: float = 1e-8) -> Tensor:
    """Indices (num_kept,) of the non-degenerate groups: the filter of Reinforce-Rej / DAPO."""
    return torch.nonzero(~zero_std_groups(rewards, atol)).flatten()


def dynamic_sampling(rewards: Tensor, num_groups: int, seed: int, atol: float = 1e-8) -> Tensor:
    """DAPO dynamic sampling on an oversampled batch of groups, rewards (num_drawn, G).

    Keeps a seeded random choice of `num_groups` non-degenerate groups, or all of them if fewer
    (the caller then draws more). Returns: sorted indices (<= num_groups,).
    """
    if int(num_groups) != num_groups or num_groups < 1:
        raise ValueError(f"num_groups must be an integer >= 1, got {num_groups}")
    kept = kept_groups(rewards, atol)
    order = torch.randperm(kept.numel(), generator=torch.Generator().manual_seed(seed))
    return kept[order[:num_groups]].sort().values


def _split(all_correct, all_wrong):
    total = all_correct + all_wrong
    return {"all_correct": all_correct, "all_wrong": all_wrong, "degenerate": total}


def per_group_gradients(model, input_ids: Tensor, attention_mask: Tensor,
                        completion_mask: Tensor, advantages: Tensor,
                        temperature: float = 1.0) -> Tensor:
    """Each group's share of the on-policy policy gradient of a batch, (num_prompts, P).

    Row b is -grad of group b's terms of the loss_type "grpo" loss with beta = 0 on the
    whole batch, (1 / (B G)) sum_{i in b} A_i (1/|o_i|) sum_t log pi(o_it): the rows sum to
    the batch's ascent direction, and a group of zero advantages has a zero row exactly.
    P counts the parameters that require grad, flattened in `model.parameters()` order.

    Args: input_ids, attention_mask (B * G, P + T) and completion_mask (B * G, T) as in
    `rollouts.Rollouts`, prompt-major; advantages (B, G).
    """
    num_prompts, group_size = advantages.shape
    num_rollouts = advantages.numel()
    if input_ids.shape[0] != num_rollouts or completion_mask.shape[0] != num_rollouts:
        raise ValueError(f"need B * G = {num_rollouts} rows of input_ids and completion_mask, "
                         f"got {input_ids.shape[0]} and {completion_mask.shape[0]}")
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    rows = []
    for group in range(num_prompts):
        members = slice(group * group_size, (group + 1) * group_size)
        log_probs = sequence_log_probs(model, input_ids[members], attention_mask[members],
                                       completion_mask[members], temperature)
        # On-policy (old = current) the clipped surrogate's gradient is the policy gradient.
        loss, _ = grpo_loss(log_probs, log_probs.detach(), None, advantages[group],
                            completion_mask[members])
        gradients = torch.autograd.grad(-loss / num_prompts, parameters, allow_unused=True)
        rows.append(torch.cat([torch.zeros(parameter.numel(), dtype=parameter.dtype)
                               if gradient is None else gradient.flatten()
                               for parameter, gradient in zip(parameters, gradients)]))
    return torch.stack(rows)


