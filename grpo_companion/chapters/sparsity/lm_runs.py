"""Chapter 6, sections 2 and 5: gradient sparsity measured on language models.

Section 2 splits one batch's policy gradient into its groups (`per_group_gradients`,
`gradient_split`); section 5 summarises a pretrained model's samples (`sample_sparsity`).
Section 3's long runs are `sparsity.dynamics`, section 4's training runs over seeds
`sparsity.remedies`.
"""

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from grpo_companion.chapters.sparsity.rate import (
    gradient_share,
    iid_degenerate_rate,
)
from grpo_companion.core.advantages import (
    degenerate_fractions,
    group_advantages,
    zero_advantage_fractions,
    zero_std_groups,
)
from grpo_companion.core.losses import grpo_loss
from grpo_companion.lm.rollouts import Rollouts
from grpo_companion.lm.scoring import sequence_log_probs


def per_group_gradients(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
    temperature: float = 1.0,
) -> Tensor:
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
        raise ValueError(
            f"need B * G = {num_rollouts} rows of input_ids and completion_mask, "
            f"got {input_ids.shape[0]} and {completion_mask.shape[0]}"
        )
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    rows = []
    for group in range(num_prompts):
        members = slice(group * group_size, (group + 1) * group_size)
        log_probs = sequence_log_probs(
            model,
            input_ids[members],
            attention_mask[members],
            completion_mask[members],
            temperature,
        )
        # On-policy (old = current) the clipped surrogate's gradient is the policy gradient.
        loss, _ = grpo_loss(
            log_probs, log_probs.detach(), None, advantages[group], completion_mask[members]
        )
        gradients = torch.autograd.grad(-loss / num_prompts, parameters, allow_unused=True)
        rows.append(
            torch.cat(
                [
                    torch.zeros(parameter.numel(), dtype=parameter.dtype)
                    if gradient is None
                    else gradient.flatten()
                    for parameter, gradient in zip(parameters, gradients)
                ]
            )
        )
    return torch.stack(rows)


# --- section 2: one batch of rollouts ----------------------------------------------------------


def batch_sparsity(rewards: Tensor, completion_mask: Tensor) -> dict:
    """How sparse one batch is: "batch_all_correct", "batch_all_wrong" and "batch_degenerate"
    (fractions of groups), "batch_zero_advantage_rollouts" and "batch_zero_advantage_tokens"
    (fractions with GRPO advantage 0). rewards (B, G); completion_mask (B * G, T)."""
    groups = degenerate_fractions(rewards)
    zero = zero_advantage_fractions(group_advantages(rewards), completion_mask)
    return {
        "batch_all_correct": groups["all_correct"],
        "batch_all_wrong": groups["all_wrong"],
        "batch_degenerate": groups["degenerate"],
        "batch_zero_advantage_rollouts": zero["rollouts"],
        "batch_zero_advantage_tokens": zero["tokens"],
    }


METHOD_NAMES = {"grpo": "GRPO", "sign": "Sign"}


def gradient_split(model, batch: Rollouts, methods=("grpo", "sign")) -> tuple[dict, pd.DataFrame]:
    """Where each method's policy gradient on `batch` lives: its degenerate groups or the rest.

    Returns records "<method>_gradient_norm" (the whole batch), "<method>_degenerate_gradient_norm"
    (the degenerate groups' part), "sign_mixed_share" (the mixed groups' `gradient_share` under
    Sign; GRPO's is 1 whenever a group is mixed, and undefined when none is), and a table of each
    group: its number of correct completions, kind, and each method's gradient norm.
    """
    degenerate = zero_std_groups(batch.rewards)
    records, norms = {}, {}
    for method in methods:
        gradients = per_group_gradients(
            model,
            batch.input_ids,
            batch.attention_mask,
            batch.completion_mask,
            group_advantages(batch.rewards, method),
            batch.temperature,
        )
        norms[method] = gradients.norm(dim=1).numpy()
        records[f"{method}_gradient_norm"] = gradients.sum(dim=0).norm().item()
        records[f"{method}_degenerate_gradient_norm"] = (
            gradients[degenerate].sum(dim=0).norm().item()
        )
        if method == "sign":
            records["sign_mixed_share"] = gradient_share(gradients, ~degenerate)
    rewards = batch.rewards
    kind = np.where(
        (rewards == 1).all(1), "all correct", np.where((rewards == 0).all(1), "all wrong", "mixed")
    )
    table = pd.DataFrame({"correct of G": rewards.sum(1).int().numpy(), "group": kind})
    for method in methods:
        table[f"{METHOD_NAMES.get(method, method)} gradient norm"] = norms[method]
    return records, table


# --- section 5: a pretrained model's samples --------------------------------------------------


def sample_sparsity(samples: Rollouts) -> dict:
    """How degenerate a sampled batch is, and how much of that is truncation.

    Returns "small_num_prompts", "small_group_size", "small_degenerate", "small_all_correct",
    "small_all_wrong", "small_pass_rate", "small_iid_prediction" (f at that mean pass rate),
    "small_truncated_fraction" (of completions), "small_groups_all_truncated" (fraction of
    groups), "small_num_finished", "small_num_completions" and "small_pass_rate_finished" (0
    when no completion finished: 0 correct of 0 is shown as 0).
    """
    groups = degenerate_fractions(samples.rewards)
    truncated = samples.truncated.view(samples.num_prompts, samples.num_generations)
    pass_rate = samples.rewards.mean().item()
    finished = ~samples.truncated
    return {
        "small_num_prompts": samples.num_prompts,
        "small_group_size": samples.num_generations,
        "small_degenerate": groups["degenerate"],
        "small_all_correct": groups["all_correct"],
        "small_all_wrong": groups["all_wrong"],
        "small_pass_rate": pass_rate,
        "small_iid_prediction": iid_degenerate_rate(pass_rate, samples.num_generations)[
            "degenerate"
        ][0],
        "small_truncated_fraction": truncated.double().mean().item(),
        "small_groups_all_truncated": truncated.all(dim=1).double().mean().item(),
        "small_num_finished": int(finished.sum()),
        "small_num_completions": finished.numel(),
        "small_pass_rate_finished": (
            samples.rewards.flatten()[finished].mean().item() if finished.any() else 0.0
        ),
    }
