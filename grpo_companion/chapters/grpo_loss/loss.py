r"""Chapter 3: GRPO's loss machinery on the enumerable sequence policy: the loss at ratio 1, ratio
clipping over several steps on one batch, the other policy losses, and token aggregation.

The loss itself is `grpo_companion.core.losses`; this module holds the chapter's experiments on
it. The KL estimators are in `grpo_companion.chapters.grpo_loss.kl` (their values) and
`grpo_companion.chapters.grpo_loss.kl_gradient` (their gradients), the figures in
`grpo_companion.chapters.grpo_loss.plots`.

`batch_loss` and `first_step_loss` give the loss of a batch of complete sequences at ratio 1,
which is 0 while its gradient is -g / L. `optimize_on_batch` takes several plain gradient steps
on one batch (TRL's ``num_iterations``), where the ratio leaves 1 and clipping starts to act;
`clipping_histories` runs it for every batch, learning rate and clip setting, and
`clipping_summary` averages over batches. `policy_gradient_weights` is the factor w(rho) that
TRL's and verl's policy losses (`POLICY_VARIANTS`) put on a token's REINFORCE term A grad log pi.
`token_weights` is d loss / d l_it for `grpo_companion.core.losses.aggregate`, and
`length_bias_group` applies it to one group of short and long, right and wrong completions.

Chapter: :doc:`/book/03_grpo_loss` (section 1: the loss at ratio 1; section 3: clipping and the
other policy losses; section 5: token aggregation).
"""

import math

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from grpo_companion.chapters.grpo_loss.kl import kl_divergence
from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.losses import aggregate, clipped_surrogate, grpo_loss, policy_loss
from grpo_companion.core.policy_gradient import SequencePolicy

# The three aggregations the chapter compares; `losses.LOSS_TYPES` has two more.
COMPARED_LOSS_TYPES = ("grpo", "dr_grpo", "dapo")


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


def first_step_loss(
    policy: SequencePolicy, logits: Tensor, sequences: Tensor, advantages: Tensor
) -> tuple[float, Tensor]:
    """`batch_loss` at pi = pi_old and its gradient in the logits, flattened to `(num_params,)`.

    `sequences: (batch, length)`, `advantages: (batch,)`."""
    leaf = logits.clone().requires_grad_(True)
    loss, _ = batch_loss(policy, leaf, logits, sequences, advantages)
    (gradient,) = torch.autograd.grad(loss, leaf)
    return loss.item(), gradient.flatten()


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


def clipped_objective(ratios: Tensor, advantage: float, epsilon: float) -> tuple[Tensor, Tensor]:
    """The per-token objective min(rho A, clip(rho, 1 - epsilon, 1 + epsilon) A) of a token with
    advantage A at each of `ratios: (n,)`, and where the clipped term is the minimum (so the
    token gets no gradient); both `(n,)`."""
    per_token_loss, is_clipped = clipped_surrogate(
        ratios.log()[None],
        torch.zeros(1, len(ratios), dtype=torch.float64),
        torch.tensor([advantage], dtype=torch.float64),
        epsilon=epsilon,
    )
    return -per_token_loss[0], is_clipped[0]


def sample_batches(
    policy: SequencePolicy,
    logits: Tensor,
    rewards: Tensor,
    num_batches: int,
    num_groups: int,
    group_size: int,
    generator: torch.Generator,
) -> list[tuple[Tensor, Tensor]]:
    """`num_batches` independent batches of `num_groups` groups of `group_size` draws from pi.

    Each batch is `(sequences: (num_groups * group_size, length), advantages: (same,))`, the
    advantages `group_advantages(..., "grpo")` within each group; `rewards: (num_sequences,)`.
    """
    sequences, batches = policy.all_sequences(), []
    for _ in range(num_batches):
        draws = policy.sample(logits, num_groups * group_size, generator)
        advantages = group_advantages(rewards[draws].view(num_groups, group_size)).flatten()
        batches.append((sequences[draws], advantages))
    return batches


def clip_settings(epsilons: list[float]) -> dict[str, float]:
    """Name -> clip epsilon for each epsilon, and "no clipping" (epsilon = inf)."""
    return {f"epsilon = {epsilon}": epsilon for epsilon in epsilons} | {"no clipping": math.inf}


def clipping_histories(
    policy: SequencePolicy,
    old_logits: Tensor,
    rewards: Tensor,
    batches: list[tuple[Tensor, Tensor]],
    num_iterations: int,
    learning_rates: list[float],
    settings: dict[str, float],
) -> dict[tuple[float, str], list[dict[str, list[float]]]]:
    """`optimize_on_batch` on every batch, for every learning rate and clip setting (name ->
    epsilon): {(learning rate, setting name): one history per batch}."""
    return {
        (rate, name): [
            optimize_on_batch(
                policy,
                old_logits,
                rewards,
                sequences,
                advantages,
                num_iterations,
                rate,
                epsilon=epsilon,
            )
            for sequences, advantages in batches
        ]
        for rate in learning_rates
        for name, epsilon in settings.items()
    }


def clipping_summary(histories: dict, initial_objective: float) -> pd.DataFrame:
    """Per (learning rate, setting), averages over batches of where the runs end and peak."""
    return pd.DataFrame(
        [
            {
                "learning rate": rate,
                "setting": name,
                "mean final KL": np.mean([history["kl"][-1] for history in runs]),
                "mean final J": np.mean([history["objective"][-1] for history in runs]),
                "lowest final J": np.min([history["objective"][-1] for history in runs]),
                "mean highest J on the way": np.mean(
                    [max(history["objective"]) for history in runs]
                ),
                "batches ending below the start": np.mean(
                    [history["objective"][-1] < initial_objective for history in runs]
                ),
                "clipped tokens at the last step": np.mean(
                    [history["clip_ratio"][-1] for history in runs]
                ),
            }
            for (rate, name), runs in histories.items()
        ]
    ).set_index(["learning rate", "setting"])


def clipping_records(
    summary: pd.DataFrame, learning_rates: list[float], epsilon: float
) -> dict[str, float]:
    """The recorded values of `clipping_summary`: clipped at `epsilon` against unclipped, at
    each learning rate (suffix lr0, lr1, ... by position), and the unclipped peak at the last."""
    records = {}
    for rate_index, rate in enumerate(learning_rates):
        for name, key in [(f"epsilon = {epsilon}", "clipped"), ("no clipping", "unclipped")]:
            row = summary.loc[(rate, name)]
            records[f"final_kl_{key}_lr{rate_index}"] = float(row["mean final KL"])
            records[f"final_objective_{key}_lr{rate_index}"] = float(row["mean final J"])
            records[f"below_start_{key}_lr{rate_index}"] = float(
                row["batches ending below the start"]
            )
    records["peak_objective_unclipped_lr1"] = float(
        summary.loc[(learning_rates[-1], "no clipping"), "mean highest J on the way"]
    )
    return records


def clipping_batch_records(
    histories: dict, learning_rates: list[float], epsilon: float
) -> dict[str, float]:
    """Batch by batch at the first learning rate (suffix lr0): the fraction of batches whose
    unclipped run ends at a higher J than the run clipped at `epsilon`, and the clipped runs'
    mean change of KL(pi || pi_old) from the middle step to the last."""
    clipped = histories[(learning_rates[0], f"epsilon = {epsilon}")]
    unclipped = histories[(learning_rates[0], "no clipping")]
    return {
        "unclipped_above_clipped_lr0": float(
            np.mean([u["objective"][-1] > c["objective"][-1] for u, c in zip(unclipped, clipped)])
        ),
        "clipped_kl_change_second_half_lr0": float(
            np.mean([c["kl"][-1] - c["kl"][len(c["kl"]) // 2] for c in clipped])
        ),
    }


def completion_mask(lengths: Tensor, max_completion_length: int) -> Tensor:
    """`(len(lengths), max_completion_length)` float64 mask, 1 on the first L_i tokens of row i."""
    return (torch.arange(max_completion_length) < lengths[:, None]).double()


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


def length_bias_group(
    short_length: int, long_length: int, max_completion_length: int
) -> tuple[pd.DataFrame, dict[str, float]]:
    """One group of five completions: a short and a long right one, a short and two long wrong.

    Returns the group's table (length, reward, `grpo` advantage, and per loss type of
    `COMPARED_LOSS_TYPES` the push A_i x token weight on each token and on the whole
    completion) and the loss of the group at ratio 1 (-A_i at every token) per loss type.
    """
    group = pd.DataFrame(
        {
            "completion": [
                "short, right",
                "long, right",
                "short, wrong",
                "long, wrong",
                "long, wrong (2)",
            ],
            "length": [short_length, long_length, short_length, long_length, long_length],
            "reward": [1.0, 1.0, 0.0, 0.0, 0.0],
        }
    ).set_index("completion")
    group["advantage"] = group_advantages(torch.tensor(group["reward"].to_numpy())[None])[0].numpy()
    mask = completion_mask(torch.tensor(group["length"].to_numpy()), max_completion_length)
    advantages = torch.tensor(group["advantage"].to_numpy())
    first_step_losses = {}
    for loss_type in COMPARED_LOSS_TYPES:
        options = {"max_completion_length": max_completion_length}
        token_weight = token_weights(mask, loss_type, **options)[:, 0].numpy()
        group[f"push per token, {loss_type}"] = group["advantage"] * token_weight
        group[f"push per completion, {loss_type}"] = (
            group["advantage"] * token_weight * group["length"]
        )
        first_step_losses[loss_type] = float(
            aggregate(-advantages[:, None] * mask, mask, loss_type, **options)
        )
    return group, first_step_losses


# TRL's and verl's other policy losses, as `policy_gradient_weights` compares them: name ->
# keyword options of `losses.policy_loss`. The values are settings chosen for the comparison,
# not the libraries' defaults (TRL: epsilon_high defaults to epsilon, delta to None).
POLICY_VARIANTS = {
    "clip, ε = 0.2 (grpo)": {"loss_type": "grpo"},
    "clip-higher, ε_high = 0.28 (DAPO)": {"loss_type": "grpo", "epsilon_high": 0.28},
    "two-sided clip, ρ_max = 3 (delta; verl dual-clip)": {"loss_type": "grpo", "delta": 3.0},
    "cispo, ε_high = 5": {"loss_type": "cispo", "epsilon_high": 5.0},
    "sapo (γ+ = 1, γ- = 1.05)": {"loss_type": "sapo"},
    "vespo (TRL's k, λ)": {"loss_type": "vespo"},
}


def policy_gradient_weights(
    ratios: Tensor, variants: dict = POLICY_VARIANTS, advantages=(1.0, -1.0)
) -> pd.DataFrame:
    """How much of a token's policy gradient each policy loss lets through at ratio rho.

    For one token with advantage A and log pi - log pi_old = log rho, the per-token loss l of
    `losses.policy_loss` has d l / d log pi = -w(rho) A, so w(rho) is the factor on the REINFORCE
    term A grad log pi: rho inside PPO's clip region and 0 outside it, min(rho, epsilon_high)
    for "cispo", a smooth bump for "sapo" and "vespo". (On one token GSPO's sequence ratio is
    the token's own, so "sequence" importance sampling gives the clip's weights.)

    ratios: (R,) float64, positive. Returns a DataFrame indexed by ratio with columns
    (A, variant name), by autograd on `policy_loss`.
    """
    log_ratio = torch.log(ratios).reshape(-1, 1)
    columns = {}
    for advantage in advantages:
        for name, options in variants.items():
            log_probs = log_ratio.clone().requires_grad_(True)
            loss = policy_loss(
                log_probs,
                torch.zeros_like(log_ratio),
                torch.full((len(ratios),), advantage, dtype=ratios.dtype),
                torch.ones_like(log_ratio),
                **options,
            )
            (gradient,) = torch.autograd.grad(loss.sum(), log_probs)
            weight = -gradient / advantage + 0.0  # + 0.0: no "-0.0" where the gradient is zero
            columns[(f"A = {advantage:+g}", name)] = weight.squeeze(1).numpy()
    return pd.DataFrame(columns, index=pd.Index(ratios.numpy(), name="ratio ρ"))
