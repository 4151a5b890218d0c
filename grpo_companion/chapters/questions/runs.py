r"""Chapter 14: GRPO on chapter 1's sequence policy, logging what TRL logs, next to the exact
quantities a language model hides.

One step of `grpo_update`, for logits theta and B = ``per_step_prompts`` groups of
G = ``num_generations`` completions of the policy's one prompt:

    1. pi_old <- pi_theta; draw the B G sequences, look up their rewards;
    2. A from `grpo_companion.core.advantages.group_advantages` (``scale_rewards``);
    3. ``num_iterations`` plain gradient steps of size ``learning_rate`` on
       `grpo_companion.core.losses.grpo_loss` (the clipped surrogate, plus beta times the KL
       estimate to pi_ref, aggregated by ``loss_type``).

Each optimizer step is a row of TRL's log under TRL's names: "loss" (the value of the loss, a
number TRL users read), "grad_norm" (before any clipping), "kl" (the mean per-token estimate),
"clip_ratio" (TRL's "clip_ratio/region_mean"), "entropy" (the mean over the batch's tokens of the
next-token entropy), "reward", "reward_std" (over the whole batch, as TRL), and
"frac_reward_zero_std". Next to them, what only an enumerable policy gives: "objective" (the exact
J = E[r]), "exact_kl" (KL(pi || pi_ref) over whole sequences), "exact_entropy" (H(pi) over whole
sequences) and "max_ratio_deviation" (max |rho - 1| over the batch's tokens), all before the step.

The steps are plain gradient descent on the logits (TRL's default is AdamW): every number is a
function of the seed and the settings alone. pi_ref is the policy at the start of the run.
"""

from dataclasses import asdict, dataclass

import pandas as pd
import torch
from torch import Tensor

from grpo_companion.core.advantages import group_advantages, zero_std_groups
from grpo_companion.core.kl import exact_kl
from grpo_companion.core.losses import grpo_loss
from grpo_companion.core.policy_gradient import SequencePolicy


@dataclass(frozen=True)
class SequenceGRPOConfig:
    """The settings of a run, under TRL's `GRPOConfig` names (TRL's defaults where it has one,
    but ``learning_rate``, a step size for plain gradient descent on the logits)."""

    num_generations: int = 8
    per_step_prompts: int = 4
    learning_rate: float = 1.0
    beta: float = 0.0
    num_iterations: int = 1
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    kl_estimator: str = "k3"
    use_bias_correction_kl: bool = False
    max_steps: int = 20


def sequence_entropy(policy: SequencePolicy, logits: Tensor) -> float:
    """H(pi) = -sum_y pi(y) log pi(y) over whole sequences, exactly (nats)."""
    log_probs = policy.log_prob(logits.detach(), policy.all_sequences())
    return float(-(log_probs.exp() * log_probs).sum())


def sequence_kl(policy: SequencePolicy, logits: Tensor, ref_logits: Tensor) -> float:
    """KL(pi || pi_ref) = sum_y pi(y) log(pi(y) / pi_ref(y)) over whole sequences, exactly
    (`exact_kl`)."""
    sequences = policy.all_sequences()
    log_probs = policy.log_prob(logits.detach(), sequences)
    return float(exact_kl(log_probs, policy.log_prob(ref_logits.detach(), sequences)))


def token_entropies(policy: SequencePolicy, logits: Tensor, sequences: Tensor) -> Tensor:
    """The entropy of pi(. | y_<t) at each step of `sequences: (n, length)`, `(n, length)`:
    what TRL's "entropy" averages over the completion tokens."""
    log_softmax = torch.log_softmax(logits.detach(), dim=-1)
    bos = torch.full_like(sequences[:, :1], policy.vocab_size)
    contexts = torch.cat([bos, sequences[:, :-1]], dim=1)
    rows = log_softmax[torch.arange(policy.length), contexts]  # (n, length, vocab)
    return -(rows.exp() * rows).sum(dim=-1)


def grpo_update(
    policy: SequencePolicy,
    logits: Tensor,
    ref_logits: Tensor,
    reward_table: Tensor,
    config: SequenceGRPOConfig,
    generator: torch.Generator,
) -> tuple[Tensor, list[dict]]:
    """One GRPO step (module docstring): the new logits and one row per optimizer step.

    `reward_table: (num_sequences,)` indexed like `policy.all_sequences()`; the batch is drawn
    from pi_old with `generator`."""
    old_logits = logits.detach()
    groups, size = config.per_step_prompts, config.num_generations
    draws = policy.sample(old_logits, groups * size, generator)
    sequences = policy.all_sequences()[draws]
    rewards = reward_table[draws].view(groups, size)
    advantages = group_advantages(rewards, scale_rewards=config.scale_rewards).flatten()
    old_log_probs = policy.token_log_probs(old_logits, sequences)
    ref_log_probs = policy.token_log_probs(ref_logits.detach(), sequences)
    mask = torch.ones_like(old_log_probs)
    batch = {
        "reward": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "frac_reward_zero_std": float(zero_std_groups(rewards).double().mean()),
    }
    rows = []
    current = old_logits.clone()
    for iteration in range(config.num_iterations):
        leaf = current.clone().requires_grad_(True)
        log_probs = policy.token_log_probs(leaf, sequences)
        loss, stats = grpo_loss(
            log_probs, old_log_probs, ref_log_probs if config.beta > 0 else None, advantages,
            mask, beta=config.beta, epsilon=config.epsilon, epsilon_high=config.epsilon_high,
            loss_type=config.loss_type, kl_estimator=config.kl_estimator,
            use_bias_correction_kl=config.use_bias_correction_kl,
        )  # fmt: skip
        (gradient,) = torch.autograd.grad(loss, leaf)
        rows.append(
            {
                "iteration": iteration + 1,
                "loss": loss.item(),
                "grad_norm": float(gradient.norm()),
                "kl": stats["kl"],
                "clip_ratio": stats["clip_ratio"],
                "max_ratio_deviation": float(
                    (log_probs.detach() - old_log_probs).exp().sub(1).abs().max()
                ),
                "max_ref_ratio": float((ref_log_probs - log_probs.detach()).exp().max()),
                "entropy": float(token_entropies(policy, current, sequences).mean()),
                **batch,
                "objective": float(policy.objective(current, reward_table)),
                "exact_kl": sequence_kl(policy, current, ref_logits),
                "exact_entropy": sequence_entropy(policy, current),
            }
        )
        current = current - config.learning_rate * gradient
    return current, rows


def train(
    policy: SequencePolicy,
    logits: Tensor,
    reward_table: Tensor,
    config: SequenceGRPOConfig,
    seed: int,
) -> pd.DataFrame:
    """`config.max_steps` steps of `grpo_update` from `logits` (also pi_ref), one row per
    optimizer step with its "step" (the GRPO step, 1-based) and "global_step" (TRL's count:
    num_iterations per GRPO step); a last row, step max_steps + 1, holds the exact quantities
    of the final policy (its TRL metrics are NaN), whose logits are in ``attrs["final_logits"]``.
    A run whose logits stop being finite ends there. Reproducible from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    ref_logits = logits.detach()
    current, rows = ref_logits.clone(), []
    for step in range(1, config.max_steps + 1):
        current, update = grpo_update(policy, current, ref_logits, reward_table, config, generator)
        rows += [{"step": step, **row} for row in update]
        if not torch.isfinite(current).all():
            break
    rows.append(
        {
            "step": step + 1,
            "objective": float(policy.objective(current, reward_table)),
            "exact_kl": sequence_kl(policy, current, ref_logits),
            "exact_entropy": sequence_entropy(policy, current),
        }
    )
    table = pd.DataFrame(rows)
    table.insert(1, "global_step", range(1, len(table) + 1))
    table.attrs["config"] = asdict(config)
    table.attrs["final_logits"] = current
    return table


def collapse_point(table: pd.DataFrame, drop: float) -> int | None:
    """The global step of the first optimizer step after which the exact J has fallen by more
    than `drop`, or whose logits stopped being finite; None if there is none."""
    objective = table["objective"].to_numpy()
    for row in range(len(table) - 1):
        after = objective[row + 1]
        if not (after == after) or objective[row] - after > drop:  # NaN or a fall
            return int(table["global_step"].iloc[row])
    return None


def collapse_records(sweep: pd.DataFrame, arms: dict[str, str]) -> dict[str, float]:
    """What section 6 reads from `collapse_sweep`: per arm (`arms`: the sweep's arm name -> a
    key suffix) the number of runs that collapsed, the median final J and the median peak of the
    logged "kl"; over the collapsed runs, the median of the logged "kl" and "grad_norm" at the
    collapse step over the same run's median before it, and of the "grad_norm" itself; and the
    largest "grad_norm" of the runs that never collapsed."""
    records = {}
    for arm, key in arms.items():
        runs = sweep[sweep["arm"] == arm]
        records[f"collapsed_{key}"] = int(runs["collapsed"].sum())
        records[f"final_objective_{key}"] = float(runs["final_objective"].median())
        records[f"peak_kl_{key}"] = float(runs["peak_kl"].median())
    collapsed = sweep[sweep["collapsed"]]
    for metric in ("kl", "grad_norm"):
        spikes = collapsed[f"{metric}_at_collapse"] / collapsed[f"median_{metric}_before"]
        records[f"collapse_{metric}_spike"] = float(spikes.median()) if len(spikes) else 0.0
    at_collapse = collapsed["grad_norm_at_collapse"]
    records["collapse_grad_norm"] = float(at_collapse.median()) if len(at_collapse) else 0.0
    records["steady_peak_grad_norm"] = float(sweep[~sweep["collapsed"]]["peak_grad_norm"].max())
    return records


def collapse_sweep(
    policy: SequencePolicy,
    logits: Tensor,
    reward_table: Tensor,
    arms: dict[str, SequenceGRPOConfig],
    seeds: list[int],
    drop: float,
) -> pd.DataFrame:
    """Every arm's `train` on every seed (the same seed draws the same first batch in every
    arm): one row per run with "collapse_step" (`collapse_point`, NaN if none), "collapsed",
    the final J, the peaks over the run of the logged "kl", "grad_norm" and "max_ref_ratio"
    (max pi_ref / pi over a batch's tokens, the weight k3's gradient puts on a token), and at
    the collapse step the logged "kl" and "grad_norm" and the run's medians of each before it."""
    rows = []
    for arm, config in arms.items():
        for seed in seeds:
            table = train(policy, logits, reward_table, config, seed)
            point = collapse_point(table, drop)
            logged = table.dropna(subset=["loss"])
            before = logged[logged["global_step"] < (point or len(table) + 1)]
            at = logged[logged["global_step"] == point]
            rows.append(
                {
                    "arm": arm,
                    "seed": seed,
                    "collapsed": point is not None,
                    "collapse_step": float("nan") if point is None else point,
                    "final_objective": table["objective"].iloc[-1],
                    "peak_kl": logged["kl"].max(),
                    "peak_grad_norm": logged["grad_norm"].max(),
                    "peak_max_ref_ratio": logged["max_ref_ratio"].max(),
                    "kl_at_collapse": at["kl"].iloc[0] if len(at) else float("nan"),
                    "median_kl_before": before["kl"].median() if len(before) else float("nan"),
                    "grad_norm_at_collapse": at["grad_norm"].iloc[0] if len(at) else float("nan"),
                    "median_grad_norm_before": before["grad_norm"].median()
                    if len(before)
                    else float("nan"),
                }
            )
    return pd.DataFrame(rows)
