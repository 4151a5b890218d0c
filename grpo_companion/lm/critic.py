r"""A learned critic: token credit from a value head trained on outcome rewards only.

The value V(s_t) of the state s_t = (prompt, the first t completion tokens) regresses the
completion's outcome reward r (no intermediate reward, gamma = 1), so it estimates the chance
that the completion succeeds from there. Its token advantages are GAE (Schulman et al. 2016,
`gae_advantages`) on the deltas

    delta_t = V(s_{t+1}) - V(s_t)  (t < T - 1),     delta_{T-1} = r - V(s_{T-1}),
    A_t = sum_l lambda^l delta_{t+l}:   lambda = 1 gives r - V(s_t), lambda = 0 the TD error,

whitened over the batch's completion tokens (PPO's normalisation). Unlike process credit it
knows nothing but outcomes: whatever credit it gives a step, it learned. The critic is the
policy's trunk copied at the start (its own weights from then on: the policy's gradient never
sees the value loss) with a scalar head initialised to 0, trained by Adam on the squared error
to r of every completion token's value, one update per batch, after the batch's advantages are
taken (PPO's order).

Chapter: :doc:`/book/05_credit` (section 7)
"""

import copy

import torch
from torch import Tensor, nn


def gae_advantages(values: Tensor, rewards: Tensor, mask: Tensor, lam: float) -> Tensor:
    """(N, T) GAE advantages from values (N, T) of the states before each completion token,
    outcome rewards (N,) and the completion mask (N, T) (1 on a prefix of each row); 0 off the
    mask. gamma = 1 and no reward but the outcome at the last token."""
    mask = mask.to(values.dtype)
    lengths = mask.sum(dim=1).long()
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    last = torch.nn.functional.one_hot((lengths - 1).clamp(min=0), values.shape[1]).to(mask)
    next_values = next_values * (1 - last) + rewards[:, None].to(values) * last
    deltas = (next_values - values) * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        running = deltas[:, t] + lam * running * mask[:, t]
        advantages[:, t] = running
    return advantages * mask


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(values - mean) / (std + eps) over the masked entries, 0 off the mask."""
    mask = mask.bool()
    chosen = values[mask]
    if chosen.numel() < 2:
        return torch.zeros_like(values)
    return torch.where(mask, (values - chosen.mean()) / (chosen.std() + eps), 0.0)


class Critic:
    """A value head on a copy of `policy`'s trunk (``policy.base_model``), trained on outcomes.

    `advantages(rollouts)` returns the batch's whitened GAE token advantages (B * G, T) and then
    takes one Adam step on the values' squared error to the outcome rewards."""

    def __init__(self, policy, *, learning_rate: float = 1e-3, lam: float = 0.95):
        self.body = copy.deepcopy(policy.base_model).train(False)
        self.head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        parameters = [*self.body.parameters(), *self.head.parameters()]
        for parameter in parameters:
            parameter.requires_grad_(True)
        self.optimizer = torch.optim.Adam(parameters, lr=learning_rate)
        self.lam = lam

    def values(self, input_ids: Tensor, attention_mask: Tensor, completion_length: int) -> Tensor:
        """(N, T) V of the state before each of the last T tokens of `input_ids`."""
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids).last_hidden_state  # fmt: skip
        before = hidden[:, -completion_length - 1 : -1]
        return self.head(before).squeeze(-1)

    def advantages(self, rollouts) -> Tensor:
        mask = rollouts.completion_mask
        rewards = rollouts.rewards.flatten().float()
        length = mask.shape[1]
        values = self.values(rollouts.input_ids, rollouts.attention_mask, length)
        advantages = gae_advantages(values.detach(), rewards, mask, self.lam)
        weights = mask.float()
        loss = ((values - rewards[:, None]) ** 2 * weights).sum() / weights.sum().clamp(min=1)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return whiten(advantages, mask)
