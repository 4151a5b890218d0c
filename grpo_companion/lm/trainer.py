r"""A GRPO trainer to read top to bottom.

One step of `train`, for a policy pi_theta and B = ``per_step_prompts`` prompts:

    1. sample:      G = ``num_generations`` completions per prompt from pi_theta, which is
                    pi_old for this step (``rollouts.generate_rollouts``), and their rewards;
    2. advantages:  A_i from the rewards of the completion's own group
                    (``advantages.group_advantages``), one scalar per completion;
    3. filter:      optionally drop the groups whose rewards are all equal (DAPO's dynamic
                    sampling without the resampling): their advantages are 0 anyway, but they
                    still count in the loss's normaliser;
    4. update:      ``num_iterations`` AdamW steps on the clipped surrogate + beta KL
                    (``losses.grpo_loss``), log-probs from ``rollouts.sequence_log_probs``;
    5. record:      the metrics TRL logs (reward, ``frac_reward_zero_std``, KL, clip ratio,
                    entropy, gradient norm, completion lengths) and, every ``eval_every``
                    steps, the held-out greedy accuracy.

Names follow TRL's ``GRPOConfig``. One difference in bookkeeping: TRL's
``per_device_train_batch_size`` counts *completions* and a TRL step is one optimizer update;
here a step is one batch of rollouts, ``per_step_prompts * num_generations`` completions
(TRL: ``per_device_train_batch_size * gradient_accumulation_steps`` on one process with
``steps_per_generation = 1``), followed by ``num_iterations`` full-batch updates. So with
``num_iterations = 1`` the two count steps alike. ``micro_batch_size`` (completions per
forward-backward pass) is TRL's ``per_device_train_batch_size`` and changes memory, not the
gradient: micro-batch losses are weighted by their share of the loss's normaliser.
``rollout_batch_size`` is the same for sampling; it changes which random numbers each
completion draws (not their distribution), so it is part of what a seed reproduces.

Deliberate simplifications: a constant learning rate (TRL decays it linearly by default),
no dropout (the model stays in eval mode, so that pi / pi_old is exactly 1 before the first
update), one process.

Randomness is a pure function of (seed, step): the prompts of a step come from a seeded
permutation of the training set per epoch (`batch_indices`) and its rollouts from a seeded
sampler (`rollout_seed`). With AdamW's state and the RNG saved in the checkpoint, a resumed
run repeats an uninterrupted one exactly on CPU.
"""

import copy
import json
import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from grpo_companion.lm import gsm8k
from grpo_companion.core.advantages import METHODS, SCALE_REWARDS, group_advantages
from grpo_companion.core.losses import LOSS_TYPES, grpo_loss
from grpo_companion.lm.models import format_prompt
from grpo_companion.lm.rollouts import generate_rollouts, greedy_accuracy, sequence_log_probs
from grpo_companion.core.advantages import degenerate_fractions, zero_std_groups

# What every history record holds; None where a value was not measured at that step.
METRICS = (
    "step",
    "reward_mean",
    "frac_reward_zero_std",
    "all_correct",
    "all_wrong",
    "loss",
    "kl",
    "clip_ratio",
    "entropy",
    "grad_norm",
    "completion_length_mean",
    "completion_length_max",
    "truncated_fraction",
    "eval_accuracy",
)
CHECKPOINT, HISTORY = "checkpoint.pt", "history.json"


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO hyper-parameters, with TRL's names where TRL has the setting."""

    # Sampling
    num_generations: int = 8  # G, completions per prompt
    per_step_prompts: int = 16  # B; TRL: per_device_train_batch_size * grad_accum = B * G
    max_completion_length: int = 256
    temperature: float = 1.0
    # Advantages (advantages.py)
    method: str = "grpo"  # one of advantages.METHODS
    scale_rewards: str = "group"
    filter_degenerate: bool = False  # drop zero-std groups from the loss (DAPO)
    # Loss (losses.py)
    loss_type: str = "grpo"
    beta: float = 0.0  # KL coefficient; 0 means no reference model is kept
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon (symmetric clipping)
    alpha: float | None = None  # loss_type "length_alpha" only (not in TRL)
    # Optimisation
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    num_iterations: int = 1  # mu, updates per batch of rollouts
    micro_batch_size: int = 64  # completions per forward-backward pass
    rollout_batch_size: int = 64  # completions per `generate` call and log-prob pass of the rollouts
    max_steps: int = 100
    # Bookkeeping
    eval_every: int = 10
    save_steps: int = 0  # checkpoint every save_steps steps (and at the end); 0: never
    seed: int = 0

    def __post_init__(self):
        for name, allowed in [("method", METHODS), ("scale_rewards", SCALE_REWARDS), ("loss_type", LOSS_TYPES)]:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("num_generations", "per_step_prompts", "max_completion_length", "num_iterations",
                     "micro_batch_size", "rollout_batch_size", "max_steps", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_generations < 2:
            raise ValueError(f"a group needs num_generations >= 2, got {self.num_generations}")
        if self.save_steps < 0 or self.beta < 0 or self.temperature <= 0:
            raise ValueError("save_steps and beta must be >= 0 and temperature > 0")


def batch_indices(step: int, num_examples: int, per_step_prompts: int, seed: int) -> list[int]:
    """Indices of the prompts of `step` (1-based) into a training set of `num_examples`.

    The set is walked through a fresh seeded permutation each epoch, so every prompt is seen
    once per epoch; a batch that straddles two epochs takes the end of one permutation and the
    start of the next.
    """
    start = (step - 1) * per_step_prompts
    epochs = range(start // num_examples, (start + per_step_prompts - 1) // num_examples + 1)
    walk = np.concatenate([np.random.default_rng([seed, 0, epoch]).permutation(num_examples) for epoch in epochs])
    offset = start - epochs[0] * num_examples
    return walk[offset : offset + per_step_prompts].tolist()


def rollout_seed(seed: int, step: int) -> int:
    """Seed of the sampler at `step`: independent streams for different steps and seeds."""
    return int(np.random.SeedSequence([seed, 1, step]).generate_state(1)[0])


def train(
    model,
    tokenizer,
    train_data,
    eval_data,
    config: GRPOConfig,
    *,
    reward_fn: Callable[[str, str], float] = gsm8k.reward,
    checkpoint_dir: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
) -> list[dict]:
    """Train `model` in place with GRPO; returns the history.

    Args:
        model, tokenizer: a causal LM and its tokenizer (``models.load_policy``); prompts are
            ``models.format_prompt(tokenizer, question)``.
        train_data, eval_data: GSM8K-schema datasets (``gsm8k.load_gsm8k``): columns
            ``question`` and ``answer`` (ending in ``#### N``).
        reward_fn: ``reward_fn(completion_text, gold) -> float``, for training and evaluation.
        checkpoint_dir: where ``checkpoint.pt`` (model, optimizer, RNG, history) and
            ``history.json`` are written every ``config.save_steps`` steps, each replaced
            atomically.
        resume: continue from the checkpoint in `checkpoint_dir` if there is one. Pass the
            same *initial* model as the first run: it is the KL reference, and the
            checkpoint's weights are then loaded into it. Only ``max_steps`` may differ from
            the checkpoint's config.

    Returns:
        history: one dict per step with the keys of `METRICS`; record 0 holds only the
        accuracy before training, record s the metrics of the rollouts sampled at step s and
        of its update, and the held-out greedy accuracy after it when s is a multiple of
        ``eval_every`` or the last step. Unmeasured values are None; ``kl`` is measured only
        when beta > 0. JSON-ready; ``pandas.DataFrame(history)`` makes a table of it.
    """
    prompts = [format_prompt(tokenizer, question) for question in train_data["question"]]
    golds = [gsm8k.gold_answer(answer) for answer in train_data["answer"]]
    eval_prompts = [format_prompt(tokenizer, question) for question in eval_data["question"]]
    eval_golds = [gsm8k.gold_answer(answer) for answer in eval_data["answer"]]

    def evaluate() -> float:
        return greedy_accuracy(model, tokenizer, eval_prompts, eval_golds, reward_fn=reward_fn,
                               max_completion_length=config.max_completion_length,
                               batch_size=config.rollout_batch_size)

    # No dropout anywhere: the PPO ratio must start at exactly 1 (and the run be deterministic).
    model.eval()
    reference = _frozen_copy(model) if config.beta > 0 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    checkpoint = Path(checkpoint_dir) / CHECKPOINT if checkpoint_dir is not None else None
    if resume and checkpoint is not None and checkpoint.exists():
        history = _load_checkpoint(checkpoint, model, optimizer, config, reference)
    else:
        history = [{**dict.fromkeys(METRICS), "step": 0, "eval_accuracy": evaluate()}]

    steps = tqdm(range(len(history), config.max_steps + 1), desc="GRPO", disable=not progress,
                 initial=len(history) - 1, total=config.max_steps)
    for step in steps:
        record = grpo_step(model, tokenizer, reference, optimizer, prompts, golds, config, step, reward_fn)
        if step % config.eval_every == 0 or step == config.max_steps:
            record["eval_accuracy"] = evaluate()
        history.append(record)
        steps.set_postfix(reward=f"{record['reward_mean']:.3f}", accuracy=_latest_accuracy(history))
        if checkpoint is not None and config.save_steps and (step % config.save_steps == 0 or step == config.max_steps):
            _save_checkpoint(checkpoint, model, optimizer, config, reference, history)
    return history


def grpo_step(model, tokenizer, reference, optimizer, prompts, golds, config: GRPOConfig, step: int,
              reward_fn) -> dict:
    """Sample, score and learn from one batch of rollouts; returns the step's record."""
    # 1. Sample G completions for each of the B prompts of this step from pi_theta = pi_old.
    rows = batch_indices(step, len(prompts), config.per_step_prompts, config.seed)
    rollouts = generate_rollouts(
        model, tokenizer, [prompts[i] for i in rows], [golds[i] for i in rows],
        num_generations=config.num_generations, max_completion_length=config.max_completion_length,
        temperature=config.temperature, seed=rollout_seed(config.seed, step),
        batch_size=config.rollout_batch_size, reward_fn=reward_fn,
        # On-policy, pi_old's log-probs are those of the update's own forward pass (below).
        compute_log_probs=config.num_iterations > 1,
    )
    rewards = rollouts.rewards  # (B, G)

    # 2. One advantage per completion, from the rewards of its own group: (B, G) -> (B * G,).
    advantages = group_advantages(rewards, config.method, scale_rewards=config.scale_rewards).flatten()

    # 3. The completions that enter the loss: all of them, or those of groups with mixed rewards.
    in_loss = torch.ones_like(advantages, dtype=torch.bool)
    if config.filter_degenerate:
        in_loss = ~zero_std_groups(rewards).repeat_interleave(config.num_generations)
    kept = in_loss.nonzero().flatten()

    # (B * G, P + T) prompt-then-completion tokens, and the (B * G, T) completion mask.
    input_ids, attention_mask = rollouts.input_ids, rollouts.attention_mask
    completion_mask = rollouts.completion_mask
    ref_log_probs = None
    if reference is not None:
        with torch.no_grad():
            ref_log_probs = torch.zeros(completion_mask.shape, device=completion_mask.device)
            for batch in kept.split(config.micro_batch_size):
                ref_log_probs[batch] = sequence_log_probs(reference, input_ids[batch], attention_mask[batch],
                                                          completion_mask[batch], config.temperature)

    # 4. num_iterations updates on this batch. Summing share * micro-batch loss over the
    # micro-batches gives exactly the loss of the whole batch, hence the same gradient.
    totals = dict.fromkeys(("loss", "kl", "clip_ratio", "entropy", "grad_norm"), 0.0)
    kept_tokens = completion_mask[kept].sum().item()
    num_updates = config.num_iterations if len(kept) else 0  # every group filtered: no update
    for _ in range(num_updates):
        optimizer.zero_grad(set_to_none=True)
        for batch in kept.split(config.micro_batch_size):
            with _captured_logits(model) as captured:
                log_probs = sequence_log_probs(model, input_ids[batch], attention_mask[batch],
                                               completion_mask[batch], config.temperature)
            # TRL: on-policy, pi_old is the current policy itself, so rho = 1 exactly.
            old_log_probs = log_probs.detach() if config.num_iterations == 1 else rollouts.log_probs[batch]
            loss, stats = grpo_loss(
                log_probs, old_log_probs, None if ref_log_probs is None else ref_log_probs[batch],
                advantages[batch], completion_mask[batch],
                beta=config.beta, epsilon=config.epsilon, epsilon_high=config.epsilon_high,
                loss_type=config.loss_type, max_completion_length=config.max_completion_length,
                alpha=config.alpha,
            )
            share = _normaliser_share(config.loss_type, completion_mask[batch], completion_mask[kept])
            (share * loss).backward()
            tokens = completion_mask[batch].sum().item()
            totals["loss"] += share * loss.item()
            totals["kl"] += stats["kl"] * tokens / kept_tokens
            totals["clip_ratio"] += stats["clip_ratio"] * tokens / kept_tokens
            totals["entropy"] += _mean_entropy(captured[-1], completion_mask[batch], config.temperature) * tokens / kept_tokens
        # The norm before clipping, as TRL logs it.
        totals["grad_norm"] += torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm).item()
        optimizer.step()

    # 5. The step's record.
    groups = degenerate_fractions(rewards)
    lengths = rollouts.lengths.double()
    record = {
        **dict.fromkeys(METRICS),
        "step": step,
        "reward_mean": rewards.mean().item(),
        "frac_reward_zero_std": groups["degenerate"],
        "all_correct": groups["all_correct"],
        "all_wrong": groups["all_wrong"],
        "completion_length_mean": lengths.mean().item(),
        "completion_length_max": int(lengths.max().item()),
        "truncated_fraction": rollouts.truncated.double().mean().item(),
        "grad_norm": 0.0,
    }
    if len(kept):  # else nothing was learned: loss, clip ratio, entropy and KL stay None
        averages = {name: total / config.num_iterations for name, total in totals.items()}
        record.update(averages if reference is not None else {**averages, "kl": None})
    return record


def _normaliser_share(loss_type: str, batch_mask, kept_mask) -> float:
    """Fraction of the loss's normaliser held by a micro-batch: its completions' share for the
    per-sequence reductions, its tokens' share for the per-token ones ("bnpo", "dapo")."""
    if loss_type in ("bnpo", "dapo"):
        return (batch_mask.sum() / kept_mask.sum()).item()
    return len(batch_mask) / len(kept_mask)


@contextmanager
def _captured_logits(model):
    """Keep the logits of the model's forward passes inside the block.

    `sequence_log_probs` returns only the sampled tokens' log-probs; the entropy needs the
    whole distribution, which the same forward pass has already computed.
    """
    captured = []
    handle = model.register_forward_hook(lambda module, args, output: captured.append(output.logits.detach()))
    try:
        yield captured
    finally:
        handle.remove()


@torch.no_grad()
def _mean_entropy(logits, completion_mask, temperature: float) -> float:
    """Mean entropy of softmax(logits / temperature) over the completion tokens.

    logits: (N, T + 1, V) from `sequence_log_probs`'s forward pass (its last position predicts
    nothing); completion_mask: (N, T).
    """
    log_p = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(-1)  # (N, T)
    mask = completion_mask.to(entropy.dtype)
    return ((entropy * mask).sum() / mask.sum()).item()


def _frozen_copy(model):
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


def _latest_accuracy(history: list[dict]) -> str:
    accuracy = next(record["eval_accuracy"] for record in reversed(history) if record["eval_accuracy"] is not None)
    return f"{accuracy:.3f}"


# --- checkpoints ---------------------------------------------------------------------------


def _save_checkpoint(path: Path, model, optimizer, config: GRPOConfig, reference, history: list[dict]) -> None:
    """Write model, optimizer, RNG states and history to `path`, and the history alone to
    history.json beside it; each file is written under a temporary name, then renamed, so an
    interrupted save leaves the previous checkpoint intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "config": asdict(config),
        "reference": _fingerprint(reference),
        "history": history,
    }
    _atomic_write(path, lambda scratch: torch.save(state, scratch))
    _atomic_write(path.with_name(HISTORY), lambda scratch: scratch.write_text(json.dumps(history, indent=1)))


def _load_checkpoint(path: Path, model, optimizer, config: GRPOConfig, reference) -> list[dict]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    changed = [field.name for field in fields(config)
               if field.name != "max_steps" and state["config"][field.name] != getattr(config, field.name)]
    if changed:
        raise ValueError(f"cannot resume from {path}: its config differs in {', '.join(changed)} "
                         f"(only max_steps may change)")
    if state["reference"] != _fingerprint(reference):
        raise ValueError(f"cannot resume from {path}: the model passed is not the initial model of "
                         f"that run, and with beta > 0 it is the KL reference")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"]:
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state["history"]


def _fingerprint(reference) -> float | None:
    """A checksum of the reference weights (None without a reference)."""
    if reference is None:
        return None
    return sum(parameter.double().sum().item() for parameter in reference.parameters())


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    scratch = path.with_name(path.name + ".tmp")
    write(scratch)
    os.replace(scratch, path)
