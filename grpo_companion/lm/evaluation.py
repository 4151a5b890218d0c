"""The trainer's held-out measures (chapter 4): greedy accuracy, and its sampled counterpart
(pass@1 averaged over K samples a problem), on problems in the GSM8K schema.

`trainer.train` records `held_out_accuracy` every ``eval_every`` steps; chapters 5 and 6 read
`sampled_held_out_accuracy` beside it, since training can sharpen the sampling distribution
without moving the greedy answers, or the reverse.
"""

from grpo_companion.lm import gsm8k
from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.gsm8k import build_prompts
from grpo_companion.lm.rollouts import generate_rollouts, greedy_accuracy


def held_out_accuracy(
    model, tokenizer, eval_data, config: GRPOConfig, reward_fn=gsm8k.reward
) -> float:
    """`train`'s held-out measure: the greedy accuracy on `eval_data` (GSM8K schema) with at
    most ``config.max_completion_length`` new tokens."""
    eval_prompts, eval_golds = build_prompts(tokenizer, eval_data)
    return greedy_accuracy(
        model,
        tokenizer,
        eval_prompts,
        eval_golds,
        reward_fn=reward_fn,
        max_completion_length=config.max_completion_length,
        batch_size=config.rollout_batch_size,
    )


def sampled_held_out_accuracy(
    model, tokenizer, eval_data, config: GRPOConfig, num_samples: int, seed: int,
    reward_fn=gsm8k.reward,
) -> float:  # fmt: skip
    """The share of right answers among `num_samples` completions of each problem of
    `eval_data`, sampled as the trainer samples (temperature, length) with its own `seed`:
    pass@1 averaged over K = `num_samples`, the sampled counterpart of `held_out_accuracy`."""
    eval_prompts, eval_golds = build_prompts(tokenizer, eval_data)
    rollouts = generate_rollouts(
        model, tokenizer, eval_prompts, eval_golds, num_generations=num_samples,
        max_completion_length=config.max_completion_length, temperature=config.temperature,
        seed=seed + 7919, batch_size=config.rollout_batch_size, reward_fn=reward_fn,
        compute_log_probs=False,
    )  # fmt: skip
    return float(rollouts.rewards.float().mean())
