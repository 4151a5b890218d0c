"""Chapter 5's exact toy: the outcome and token-level estimators on an enumerable policy."""

import pandas as pd
import pytest
import torch

from grpo_companion.chapters.credit.exact import (
    answer_reward,
    compare_estimators,
    exact_moments,
    per_sequence_estimates,
    position_credit,
    position_roles,
    sampled_errors,
    token_scores,
)
from grpo_companion.chapters.credit.tokens import token_advantages
from grpo_companion.core.policy_gradient import SequencePolicy, exact_prefix_values


def _small_policy(vocab_size=3, length=4, seed=0):
    policy = SequencePolicy(vocab_size, length)
    return policy, policy.init_logits(seed)


def test_exact_prefix_values_hand_built():
    policy, logits = _small_policy(vocab_size=2, length=2)
    sequences = policy.all_sequences()
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0])  # r = y0 xor y1
    values = exact_prefix_values(policy, logits, rewards)
    first = torch.softmax(logits[0, 2], dim=-1)  # context BOS
    second = torch.softmax(logits[1, :2], dim=-1)  # (y0, y1)
    after_first = torch.stack([second[0, 1], second[1, 0]])  # P(y1 != y0 | y0)
    assert torch.allclose(values[:, 0], (first @ after_first).expand(4))
    assert torch.allclose(values[:, 1], after_first[sequences[:, 0]])
    assert torch.equal(values[:, 2], rewards)


def test_both_estimators_unbiased_and_variances_by_enumeration():
    policy, logits = _small_policy()
    sequences = policy.all_sequences()
    rewards = answer_reward(sequences, policy.vocab_size, positions=[1])
    probs, exact = policy.probs(logits), policy.exact_gradient(logits, rewards)
    values = exact_prefix_values(policy, logits, rewards)
    scores = token_scores(policy, logits, sequences)
    mask = torch.ones(sequences.shape, dtype=torch.float64)
    outcome = per_sequence_estimates(token_advantages(rewards - values[:, 0], mask), scores)
    token = per_sequence_estimates(values.diff(dim=1), scores)
    for estimates in (outcome, token):
        mean, _ = exact_moments(probs, estimates)
        assert torch.allclose(mean, exact, atol=1e-12)
    # The outcome estimator with b = J is chapter 1's estimator_variance at that baseline.
    _, outcome_variance = exact_moments(probs, outcome)
    reference = policy.scores(logits, sequences)
    assert torch.allclose(outcome, (rewards - values[0, 0])[:, None] * reference, atol=1e-12)
    # The token-level estimator is not the outcome one: its coefficients vary along a row.
    _, token_variance = exact_moments(probs, token)
    assert not torch.isclose(outcome_variance, token_variance)


def test_sampled_errors_match_exact_variance():
    policy, logits = _small_policy()
    sequences = policy.all_sequences()
    rewards = answer_reward(sequences, policy.vocab_size, positions=[0, 2])
    probs = policy.probs(logits)
    values = exact_prefix_values(policy, logits, rewards)
    estimates = per_sequence_estimates(values.diff(dim=1), token_scores(policy, logits, sequences))
    mean, variance = exact_moments(probs, estimates)
    errors = sampled_errors(probs, estimates, mean, [10, 40], num_repeats=4000, seed=0)
    # E||mean of n - mean||^2 = variance / n; 4000 repeats: a few % of noise, 10% tolerance.
    for n, row in zip([10, 40], errors):
        assert row.mean().item() == pytest.approx(variance.item() / n, rel=0.1)


def test_answer_reward_hand_built():
    sequences = torch.tensor([[1, 2, 0, 3], [1, 2, 0, 0], [3, 3, 3, 2]])
    assert torch.equal(answer_reward(sequences, 4, [0, 1]), torch.tensor([1.0, 0.0, 1.0]).double())


def test_token_scores_are_the_closed_form_scores_split_by_token():
    policy, logits = _small_policy()
    sequences = policy.all_sequences()
    scores = token_scores(policy, logits, sequences)
    assert scores.shape == (policy.num_sequences, policy.length, logits.numel())
    assert torch.allclose(scores.sum(dim=1), policy.scores(logits, sequences), atol=1e-12)


def test_exact_moments_hand_built():
    probs = torch.tensor([0.25, 0.75], dtype=torch.float64)
    estimates = torch.tensor([[4.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    mean, variance = exact_moments(probs, estimates)
    assert torch.allclose(mean, torch.tensor([1.0, 1.5], dtype=torch.float64))
    # E||g||^2 - ||E g||^2 = (0.25 * 16 + 0.75 * 4) - (1 + 2.25)
    assert variance.item() == pytest.approx(7.0 - 3.25)


def test_compare_estimators_hand_built():
    exact = torch.tensor([3.0, 4.0])
    moments = {
        "outcome": (torch.tensor([3.0, 4.0]), torch.tensor(6.0)),
        "token": (torch.tensor([0.0, 0.0]), torch.tensor(2.0)),
    }
    assert compare_estimators(exact, moments) == {
        "gradient_norm": 5.0,
        "outcome_bias": 0.0,
        "outcome_variance": 6.0,
        "token_bias": 5.0,
        "token_variance": 2.0,
        "variance_ratio": 3.0,
    }


def test_position_roles():
    assert position_roles(5, [1, 3]) == ["filler", "result", "filler", "result", "answer"]
    assert position_roles(2, []) == ["filler", "answer"]


def test_position_credit_hand_built():
    probs = torch.tensor([0.5, 0.5], dtype=torch.float64)
    credit = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 3.0]], dtype=torch.float64)
    table, shares = position_credit(probs, credit, result_positions=[1])
    # E[delta^2] by position: 0, 1, 5; shares 0, 1/6, 5/6.
    expected = pd.DataFrame(
        {
            "role": ["filler", "result", "answer"],
            "E[delta_t^2]": [0.0, 1.0, 5.0],
            "share": [0.0, 1 / 6, 5 / 6],
        },
        index=pd.Index(range(3), name="position"),
    )
    pd.testing.assert_frame_equal(table, expected)
    assert shares == pytest.approx(
        {"credit_share_results": 1 / 6, "credit_share_answer": 5 / 6, "credit_share_filler": 0.0}
    )


def test_uniform_policy_variance_ratio_is_the_length():
    """Exercise 1 of the chapter: under the uniform policy only the last token carries credit,
    and the outcome estimator's variance is `length` times the token-level one's."""
    policy = SequencePolicy(vocab_size=3, length=4)
    logits = torch.zeros(policy.logits_shape, dtype=torch.float64)
    sequences = policy.all_sequences()
    rewards = answer_reward(sequences, 3, [1, 2])
    probs = policy.probs(logits)
    values = exact_prefix_values(policy, logits, rewards)
    scores = token_scores(policy, logits, sequences)
    outcome = token_advantages(rewards - values[0, 0], torch.ones_like(values[:, 1:]))
    moments = {
        name: exact_moments(probs, per_sequence_estimates(coefficients, scores))
        for name, coefficients in (("outcome", outcome), ("token", values.diff(dim=1)))
    }
    records = compare_estimators(policy.exact_gradient(logits, rewards), moments)
    assert records["variance_ratio"] == pytest.approx(4.0, rel=1e-12)
    assert records["gradient_norm"] == pytest.approx(0.0, abs=1e-12)
    _, shares = position_credit(probs, values.diff(dim=1), [1, 2])
    assert shares["credit_share_answer"] == pytest.approx(1.0, rel=1e-12)
