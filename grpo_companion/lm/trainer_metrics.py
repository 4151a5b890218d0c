"""The metrics `trainer.grpo_step` records that do not come out of the loss: what TRL logs of a
batch of rollouts, and the entropy of the policy at the completion tokens."""

import torch

from grpo_companion.core.advantages import degenerate_fractions


def rollout_metrics(rollouts, scale_rewards: str) -> dict:
    """What TRL logs of a batch of rollouts, under TRL's names (`METRICS`): rewards, the
    zero-std fraction, completion lengths, and the tokens of this batch as "num_tokens" (`train`
    accumulates them over the steps, as TRL's ``num_input_tokens_seen``)."""
    rewards = rollouts.rewards  # (B, G)
    groups = degenerate_fractions(rewards)
    frac_reward_zero_std = groups["degenerate"]
    if scale_rewards == "batch":  # TRL tests the std it divides by: the batch's
        frac_reward_zero_std = float(torch.isclose(rewards.std(), rewards.new_zeros(())).item())
    lengths = rollouts.lengths.double()
    terminated = lengths[~rollouts.truncated]
    prompt_tokens = rollouts.prompt_mask.sum().item() * rollouts.num_generations
    return {
        "reward": rewards.mean().item(),
        "reward_std": rewards.std().item(),
        "frac_reward_zero_std": frac_reward_zero_std,
        "all_correct": groups["all_correct"],
        "all_wrong": groups["all_wrong"],
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": int(lengths.min().item()),
        "completions/max_length": int(lengths.max().item()),
        "completions/clipped_ratio": rollouts.truncated.double().mean().item(),
        "completions/mean_terminated_length": terminated.mean().item() if len(terminated) else 0.0,
        "num_tokens": int(prompt_tokens + lengths.sum().item()),
    }


@torch.no_grad()
def mean_entropy(logits, completion_mask, temperature: float) -> float:
    """Mean entropy of softmax(logits / temperature) over the completion tokens.

    logits: (N, T, V) from `scoring.completion_logits`, the update's own forward pass;
    completion_mask: (N, T).
    """
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(-1)  # (N, T)
    mask = completion_mask.to(entropy.dtype)
    return ((entropy * mask).sum() / mask.sum()).item()
