"""lm/critic.py: GAE against hand sums at lambda 0 and 1, whitening, and a critic that learns
the outcome's expectation from outcome rewards only."""

import pytest
import torch

from grpo_companion.lm import micro
from grpo_companion.lm.critic import Critic, gae_advantages, whiten
from grpo_companion.lm.gsm8k import build_prompts
from grpo_companion.lm.rollouts import generate_rollouts

VALUES = torch.tensor([[0.2, 0.5, 0.9, 0.0], [0.4, 0.1, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
REWARDS = torch.tensor([1.0, 0.0])


def test_gae_at_lambda_one_is_the_outcome_minus_the_value():
    advantages = gae_advantages(VALUES, REWARDS, MASK, lam=1.0)
    expected = torch.tensor([[0.8, 0.5, 0.1, 0.0], [-0.4, -0.1, 0.0, 0.0]])
    torch.testing.assert_close(advantages, expected)


def test_gae_at_lambda_zero_is_the_temporal_difference():
    advantages = gae_advantages(VALUES, REWARDS, MASK, lam=0.0)
    # delta_t = V(t+1) - V(t); the last token's: r - V(T-1)
    expected = torch.tensor([[0.3, 0.4, 0.1, 0.0], [-0.3, -0.1, 0.0, 0.0]])
    torch.testing.assert_close(advantages, expected)


def test_gae_sums_lambda_weighted_deltas():
    lam = 0.5
    deltas = torch.tensor([0.3, 0.4, 0.1])
    advantages = gae_advantages(VALUES, REWARDS, MASK, lam=lam)
    assert advantages[0, 0].item() == pytest.approx(0.3 + lam * 0.4 + lam**2 * 0.1)
    assert advantages[0, 1].item() == pytest.approx(float(deltas[1] + lam * deltas[2]))


def test_whiten_has_mean_zero_and_unit_std_on_the_mask():
    white = whiten(VALUES, MASK)
    chosen = white[MASK.bool()]
    assert chosen.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert chosen.std().item() == pytest.approx(1.0, abs=1e-6)
    assert (white[~MASK.bool()] == 0).all()


def test_the_critic_learns_the_pass_rate_from_outcomes_alone():
    """Fixed rollouts of one prompt from a random micro model; rewards 1 on the completions
    whose first token is "1", else 0. The critic sees only those outcomes; after training,
    its value before the first token is near the batch's mean reward, and after it near 0 or 1
    according to the first token, so its TD error credits the first token."""
    torch.manual_seed(0)
    tokenizer = micro.build_tokenizer()
    model = micro.build_model(micro.MicroSpec(), tokenizer)
    data = micro.problems("train", 2, 1, seed=0)
    prompts, golds = build_prompts(tokenizer, data)
    rollouts = generate_rollouts(model, tokenizer, prompts, golds, num_generations=64,
                                 max_completion_length=4, seed=0, compute_log_probs=False,
                                 reward_fn=lambda text, _: float(text.startswith("1")))  # fmt: skip
    rewards = rollouts.rewards.flatten()
    assert 0 < rewards.mean() < 1
    critic = Critic(model, learning_rate=3e-3)
    for _ in range(200):
        critic.advantages(rollouts)
    with torch.no_grad():
        length = rollouts.completion_mask.shape[1]
        values = critic.values(rollouts.input_ids, rollouts.attention_mask, length)
    assert values[:, 0].mean().item() == pytest.approx(rewards.mean().item(), abs=0.05)
    after_first = values[:, 1][rollouts.lengths > 1]
    assert torch.allclose(after_first, rewards[rollouts.lengths > 1], atol=0.1)
