r"""A GRPO trainer to read top to bottom: `train` repeats `grpo_step`, one batch of rollouts.

One step, for a policy pi_theta and B = ``per_step_prompts`` prompts::

    1. sample:      G = ``num_generations`` completions per prompt from pi_theta, which is
                    pi_old for this step (``rollouts.generate_rollouts``), and their rewards;
    2. advantages:  one per completion from the rewards of its own group
                    (``advantages.group_advantages``), or, with ``credit="process"``, one per
                    token from the worked steps (``advantages.process_advantages``);
    3. filter:      optionally drop the groups whose rewards are all equal (DAPO's dynamic
                    sampling without the resampling): their advantages are 0 anyway, but they
                    still count in the loss's normaliser;
    4. update:      ``num_iterations`` AdamW steps on the clipped surrogate + beta KL
                    (``losses.grpo_loss``), each prompt through the model once for its group;
    5. record:      the metrics TRL logs, under TRL's names (`METRICS`), and, every
                    ``eval_every`` steps, the held-out greedy accuracy.

Settings, and where the bookkeeping differs from TRL's: `lm.config.GRPOConfig`. Simplified: a
constant learning rate (TRL decays it linearly), no dropout (eval mode: pi / pi_old is exactly 1
before the first update), one process. Randomness is a pure function of (seed, step)
(`batch_indices`, `rollout_seed`): a resumed run repeats an uninterrupted one exactly on CPU.

Chapter: :doc:`/book/04_testbed` (section 3; chapter 3's pseudocode box is `grpo_step`)
"""

import copy
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from grpo_companion.core.advantages import (
    group_advantages,
    per_step_process_advantages,
    process_advantages,
    shuffle_step_rewards,
    zero_advantage_fractions,
    zero_std_groups,
)
from grpo_companion.core.importance import (
    top_p_log_probs,
    vllm_importance_weights,
    weighted_advantages,
)
from grpo_companion.core.losses import grpo_loss
from grpo_companion.lm import gsm8k
from grpo_companion.lm.checkpoint import load_checkpoint, save_checkpoint
from grpo_companion.lm.config import GRPOConfig, loss_options
from grpo_companion.lm.evaluation import held_out_accuracy
from grpo_companion.lm.gsm8k import build_prompts
from grpo_companion.lm.rollouts import generate_rollouts
from grpo_companion.lm.scoring import completion_logits, sequence_log_probs, token_log_probs
from grpo_companion.lm.steps import rollout_step_rewards
from grpo_companion.lm.trainer_metrics import mean_entropy, rollout_metrics

# What every history record holds; None where a value was not measured at that step. The names
# are those of TRL's logs (`trainer.state.log_history`) for the same quantities, except "step",
# "all_correct", "all_wrong" (the zero-std groups split by their reward),
# "zero_advantage_token_share" (`core.advantages.zero_advantage_fractions`; on a TRL run the
# callback of `lm.trl_callback` records it) and "eval_accuracy".
METRICS = (
    "step",
    "reward",  # mean reward of the step's completions
    "reward_std",  # std (Bessel-corrected) of the step's rewards
    "frac_reward_zero_std",  # groups with equal rewards; under scale_rewards="batch": batch std = 0
    "all_correct",
    "all_wrong",
    "zero_advantage_token_share",  # completion tokens whose advantage is 0: no policy gradient
    "loss",
    "kl",
    "clip_ratio/region_mean",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "entropy",
    "grad_norm",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",  # truncated at max_completion_length (no EOS)
    "completions/mean_terminated_length",  # 0 when every completion was truncated, as TRL
    "num_tokens",  # prompt and completion tokens seen so far
    "eval_accuracy",
)
CHECKPOINT = "checkpoint.pt"


def batch_indices(step: int, num_examples: int, per_step_prompts: int, seed: int) -> list[int]:
    """Indices of the prompts of `step` (1-based) into a training set of `num_examples`.

    The set is walked through a fresh seeded permutation each epoch, so every prompt is seen
    once per epoch; a batch that straddles two epochs takes the end of one permutation and the
    start of the next.
    """
    start = (step - 1) * per_step_prompts
    epochs = range(start // num_examples, (start + per_step_prompts - 1) // num_examples + 1)
    walk = np.concatenate(
        [np.random.default_rng([seed, 0, epoch]).permutation(num_examples) for epoch in epochs]
    )
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
    initial_accuracy: float | None = None,
    until: int | None = None,
) -> list[dict]:
    """Train `model` in place with GRPO; returns the history.

    Args:
        model, tokenizer: a causal LM and its tokenizer (``models.load_policy``); prompts are
            ``gsm8k.build_prompts(tokenizer, data)``.
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
        initial_accuracy: record 0's held-out accuracy when the caller has it already
            (`held_out_accuracy` of the same model, data and config: runs from one start
            share it, and greedy decoding makes it the same number); None measures it.
        until: stop after this step (None: ``config.max_steps``), to train one run in segments
            (`sparsity_dynamics.probed_run` probes between them): with `checkpoint_dir`,
            ``resume=True`` and the same config, the segments are the whole run, its held-out
            evaluations included (every ``eval_every`` steps and at ``max_steps``, not at the
            end of each segment). A checkpoint is written after step `until` whatever
            ``save_steps`` says: the next segment resumes from it.

    Returns:
        history: one dict per step with the keys of `METRICS`; record 0 holds only the
        accuracy before training, record s the metrics of the rollouts sampled at step s and
        of its update, and the held-out greedy accuracy after it when s is a multiple of
        ``eval_every`` or the last step. Unmeasured values are None; ``kl`` is measured only
        when beta > 0. JSON-ready; ``pandas.DataFrame(history)`` makes a table of it.
    """
    last = config.max_steps if until is None else until
    if not 0 <= last <= config.max_steps:
        raise ValueError(f"until must be in [0, max_steps = {config.max_steps}], got {until}")
    prompts, golds = build_prompts(tokenizer, train_data)
    answers = list(train_data["answer"])  # the worked solutions, for credit="process"

    def evaluate() -> float:
        return held_out_accuracy(model, tokenizer, eval_data, config, reward_fn)

    reference, optimizer = reference_and_optimizer(model, config)
    checkpoint = Path(checkpoint_dir) / CHECKPOINT if checkpoint_dir is not None else None
    if resume and checkpoint is not None and checkpoint.exists():
        history = load_checkpoint(checkpoint, model, optimizer, config, reference)
    else:
        before = evaluate() if initial_accuracy is None else initial_accuracy
        history = [{**dict.fromkeys(METRICS), "step": 0, "eval_accuracy": before}]

    steps = tqdm(
        range(len(history), last + 1),
        desc="GRPO",
        disable=not progress,
        initial=len(history) - 1,
        total=config.max_steps,
    )
    for step in steps:
        record = grpo_step(
            model, tokenizer, reference, optimizer, prompts, golds, config, step, reward_fn,
            answers=answers,
        )  # fmt: skip
        record["num_tokens"] += history[-1]["num_tokens"] or 0  # TRL's count is cumulative
        if step % config.eval_every == 0 or step == config.max_steps:
            record["eval_accuracy"] = evaluate()
        history.append(record)
        steps.set_postfix(reward=f"{record['reward']:.3f}", accuracy=_latest_accuracy(history))
        periodic = config.save_steps and (step % config.save_steps == 0 or step == config.max_steps)
        ends_segment = until is not None and step == last
        if checkpoint is not None and (periodic or ends_segment):
            save_checkpoint(checkpoint, model, optimizer, config, reference, history)
    return history


def reference_and_optimizer(model, config: GRPOConfig):
    """What `train` keeps across the steps of `grpo_step`: a frozen copy of `model` as the KL
    reference (None when ``config.beta`` is 0: no reference is kept), and AdamW on `model`.

    Puts `model` in eval mode: no dropout anywhere, so the PPO ratio starts at exactly 1 (and
    the run is deterministic).
    """
    model.eval()
    reference = _frozen_copy(model) if config.beta > 0 else None
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
    )
    return reference, optimizer


def grpo_step(
    model, tokenizer, reference, optimizer, prompts, golds, config: GRPOConfig, step: int,
    reward_fn, *, answers: list[str] | None = None, steps_of=None, critic=None,
) -> dict:  # fmt: skip
    """Sample, score and learn from one batch of rollouts; returns the step's record.

    answers: each prompt's answer field (worked lines, then ``#### N``), for credit="process".
    steps_of: how a task's completions write their steps (`steps.rollout_step_rewards`; None:
    the arithmetic problems' worked lines). critic: for credit="value", a `critic.Critic` that
    gives each token its advantage and learns from the batch's outcomes.

    With several micro-batches per update, "kl", "entropy" and "clip_ratio/*" are token-weighted
    means over the batch, where TRL logs the plain mean of the micro-batches' token means (its
    ``_metrics`` lists): the two agree when every micro-batch holds as many completion tokens,
    and always with one micro-batch per update (the book's settings). Logs only, not gradients.
    """
    # 1. Sample G completions for each of the B prompts of this step from pi_theta = pi_old.
    rows = batch_indices(step, len(prompts), config.per_step_prompts, config.seed)
    rollouts = generate_rollouts(
        model,
        tokenizer,
        [prompts[i] for i in rows],
        [golds[i] for i in rows],
        num_generations=config.num_generations,
        max_completion_length=config.max_completion_length,
        temperature=config.temperature,
        top_p=config.top_p,
        seed=rollout_seed(config.seed, step),
        batch_size=config.rollout_batch_size,
        reward_fn=reward_fn,
        # pi_old's log-probs come from the update's own forward pass (below), or from a pass
        # like it before the first update: never from the rollouts' own log-prob pass.
        compute_log_probs=False,
    )
    rewards = rollouts.rewards  # (B, G)

    # 2. One advantage per completion, from the rewards of its own group: (B, G) -> (B * G,);
    # or, with process credit, one per token from the group's step rewards: (B * G, T).
    if config.credit == "value":
        if critic is None:
            raise ValueError("credit='value' needs a critic (lm.critic.Critic)")
        advantages = critic.advantages(rollouts)
    elif config.credit != "outcome":
        if answers is None:
            raise ValueError(f"credit={config.credit!r} needs the answers of the prompts")
        steps, ends, mask = rollout_step_rewards(tokenizer, rollouts, [answers[i] for i in rows],
                                                 steps_of=steps_of)  # fmt: skip
        if config.credit == "process_placebo":
            shuffle = torch.Generator(steps.device).manual_seed(rollout_seed(config.seed, step))
            steps = shuffle_step_rewards(steps, mask, shuffle)
        advantages = process_advantages(steps, ends, mask, rollouts.completion_ids.shape[1])
        if config.credit == "process_per_step":
            advantages = per_step_process_advantages(advantages, ends, mask)
    else:
        advantages = group_advantages(
            rewards, config.method, scale_rewards=config.scale_rewards
        ).flatten()

    # 3. The completions that enter the loss: all of them, or those of groups with mixed rewards.
    in_loss = torch.ones(len(advantages), dtype=torch.bool, device=advantages.device)
    if config.filter_degenerate:
        in_loss = ~zero_std_groups(rewards).repeat_interleave(config.num_generations)
    kept = in_loss.nonzero().flatten()

    # (B * G, P + T) prompt-then-completion tokens, and the (B * G, T) completion mask; the loss
    # sees the tokens of `loss_mask`, without the truncated completions if so configured.
    input_ids, attention_mask = rollouts.input_ids, rollouts.attention_mask
    completion_mask = rollouts.completion_mask
    loss_mask = completion_mask
    if config.mask_truncated_completions:
        loss_mask = completion_mask * ~rollouts.truncated.unsqueeze(1)
    # Each prompt through the model once for its group when the micro-batches hold whole
    # groups (`completion_logits`): the same gradient up to rounding, a third to half the work.
    # `kept` is whole groups in order, so a micro-batch is whole groups if its size says so.
    micro_batches = kept.split(config.micro_batch_size)
    whole_groups = all(len(batch) % config.num_generations == 0 for batch in micro_batches)
    shared = config.num_generations if whole_groups else 1

    # pi_old: with several updates on the batch, the policy's log-probs before the first, from
    # the very pass the update makes (same micro-batches, same sharing), so that rho starts at
    # exactly 1 as on-policy; with one update, the update's own (detached, below). The sampler's
    # log-probs come the same way: `log_probs_of` = `sampling_log_probs`, `extra` = (top_p,).
    def log_probs_without_grad(policy, log_probs_of=sequence_log_probs, *extra) -> torch.Tensor:
        values = torch.zeros(completion_mask.shape, device=completion_mask.device)
        with torch.no_grad():  # (B * G, T), 0 on filtered rows
            for batch in micro_batches:
                values[batch] = log_probs_of(
                    policy,
                    input_ids[batch],
                    attention_mask[batch],
                    completion_mask[batch],
                    config.temperature,
                    *extra,
                    num_generations=shared,
                    bucket_size=config.length_bucket_size,
                )
        return values

    correcting = config.vllm_importance_sampling_correction
    old_log_probs = (
        log_probs_without_grad(model) if config.num_iterations > 1 or correcting else None
    )
    ref_log_probs = None if reference is None else log_probs_without_grad(reference)
    # TRL's vLLM importance sampling: weights from pi_old against the sampler's own log-probs,
    # each token's policy loss times its weight (core.importance.weighted_advantages).
    loss_advantages = advantages
    if correcting:
        sampled = log_probs_without_grad(model, sampling_log_probs, config.top_p)
        weights = vllm_importance_weights(
            old_log_probs - sampled,
            loss_mask,
            config.vllm_importance_sampling_mode,
            config.vllm_importance_sampling_clip_max,
            config.vllm_importance_sampling_clip_min,
        )
        loss_advantages = weighted_advantages(advantages, weights)

    # 4. num_iterations updates on this batch. Summing share * micro-batch loss over the
    # micro-batches gives exactly the loss of the whole batch, hence the same gradient ("bnpo":
    # TRL's mean of the micro-batch losses instead, see `GRPOConfig`).
    names = ("loss", "kl", *CLIP_METRICS, "entropy", "grad_norm")
    totals = dict.fromkeys(names, 0.0)
    kept_tokens = max(loss_mask[kept].sum().item(), 1)
    num_updates = config.num_iterations if len(kept) else 0  # every group filtered: no update
    for _ in range(num_updates):
        optimizer.zero_grad(set_to_none=True)
        for batch in micro_batches:
            logits = completion_logits(
                model,
                input_ids[batch],
                attention_mask[batch],
                completion_mask.shape[1],
                num_generations=shared,
                bucket_size=config.length_bucket_size,
            )
            log_probs = token_log_probs(
                logits, input_ids[batch], completion_mask[batch], config.temperature
            )
            # TRL: on-policy, pi_old is the current policy itself, so rho = 1 exactly.
            pi_old = log_probs.detach() if old_log_probs is None else old_log_probs[batch]
            loss, stats = grpo_loss(
                log_probs,
                pi_old,
                None if ref_log_probs is None else ref_log_probs[batch],
                loss_advantages[batch],
                loss_mask[batch],
                max_completion_length=config.max_completion_length,
                allow_empty=config.mask_truncated_completions,
                **loss_options(config),
            )
            share = _normaliser_share(
                config.loss_type, loss_mask[batch], loss_mask[kept], len(micro_batches)
            )
            (share * loss).backward()
            tokens = loss_mask[batch].sum().item()
            totals["loss"] += share * loss.item()
            for name in ("kl", *CLIP_METRICS):
                value = stats["clip_ratio" if name == CLIP_METRICS[0] else name]
                totals[name] += value * tokens / kept_tokens
            if tokens:
                entropy = mean_entropy(logits.detach(), loss_mask[batch], config.temperature)
                totals["entropy"] += entropy * tokens / kept_tokens
        # The norm before clipping, as TRL logs it.
        totals["grad_norm"] += torch.nn.utils.clip_grad_norm_(
            model.parameters(), config.max_grad_norm
        ).item()
        optimizer.step()

    # 5. The step's record.
    record = {
        **dict.fromkeys(METRICS),
        **rollout_metrics(rollouts, config.scale_rewards),
        "grad_norm": 0.0,
    }
    record["step"] = step
    record["zero_advantage_token_share"] = zero_advantage_fractions(advantages, completion_mask)[
        "tokens"
    ]
    if len(kept):  # else nothing was learned: loss, clip ratio, entropy and KL stay None
        averages = {name: total / config.num_iterations for name, total in totals.items()}
        record.update(averages if reference is not None else {**averages, "kl": None})
    return record


CLIP_METRICS = ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean")


@torch.no_grad()
def sampling_log_probs(
    model, input_ids, attention_mask, completion_mask, temperature: float = 1.0,
    top_p: float = 1.0, *, num_generations: int = 1, bucket_size: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """log pi_samp of the completion tokens, (N, T), 0 off `completion_mask`: the sampler's
    own log-probs, the nucleus of softmax(logits / temperature) renormalised
    (`core.importance.top_p_log_probs`), as `generate_rollouts` samples with ``top_p`` and as
    vLLM reports them. Arguments as `scoring.sequence_log_probs`."""
    logits = completion_logits(
        model, input_ids, attention_mask, completion_mask.shape[1],
        num_generations=num_generations, bucket_size=bucket_size,
    )  # fmt: skip
    log_probs = top_p_log_probs(logits / temperature, top_p)
    targets = input_ids[:, -completion_mask.shape[1] :]
    values = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return torch.where(completion_mask.bool(), values, 0.0)


def _normaliser_share(loss_type: str, batch_mask, kept_mask, num_micro_batches: int) -> float:
    """Weight of a micro-batch's loss in the batch's: its share of the loss's normaliser, i.e. its
    completions' share for the per-sequence reductions and its tokens' share for the per-token
    ones ("dapo", "cispo", "vespo"); for "bnpo" 1 / num_micro_batches (TRL: each micro-batch's
    token mean, divided by the gradient-accumulation steps)."""
    if loss_type == "bnpo":
        return 1 / num_micro_batches
    if loss_type in ("dapo", "cispo", "vespo"):
        return (batch_mask.sum() / kept_mask.sum().clamp(min=1)).item()
    return len(batch_mask) / len(kept_mask)


def _frozen_copy(model):
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


def _latest_accuracy(history: list[dict]) -> str:
    accuracy = next(
        record["eval_accuracy"]
        for record in reversed(history)
        if record["eval_accuracy"] is not None
    )
    return f"{accuracy:.3f}"
