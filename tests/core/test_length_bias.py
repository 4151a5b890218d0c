"""Chapter 9's two-length toy against brute force: every token sequence enumerated, the update
taken by autograd through `grpo_companion.core.losses.aggregate(..., "length_alpha")`."""

import itertools
import math

import numpy as np
import pytest
import torch

from grpo_companion.chapters.advantage_zoo.length import (
    TwoLengthToy,
    length_alpha_choices,
    length_summary,
    length_tradeoff,
    length_tradeoff_table,
)
from grpo_companion.core.losses import aggregate

TOY = TwoLengthToy(short_length=2, long_length=4, long_logit=0.4, step_logit=1.1)


def enumerate_completions(toy):
    """Every completion as (token list, probability as a function of theta, reward)."""
    completions = []
    for form, length in enumerate(toy.lengths):
        for steps in itertools.product([0, 1], repeat=int(length) - 1):
            completions.append(([form, *steps], float(all(steps))))
    return completions


def token_log_probs(theta, tokens):
    """log pi of each token, (L,): the form token, then the steps."""
    form = torch.nn.functional.logsigmoid(theta[0] if tokens[0] else -theta[0])
    steps = [torch.nn.functional.logsigmoid(theta[1] if step else -theta[1]) for step in tokens[1:]]
    return torch.stack([form, *steps])


def brute_force_update(toy, alpha, baseline):
    """E over completions of -grad of the length_alpha loss of a batch of one, at ratio 1."""
    theta = torch.tensor([toy.long_logit, toy.step_logit], dtype=torch.float64, requires_grad=True)
    total = torch.zeros(2, dtype=torch.float64)
    for tokens, reward in enumerate_completions(toy):
        log_probs = token_log_probs(theta, tokens)
        # At ratio 1 the clipped surrogate's gradient is that of -A log pi, token by token.
        per_token_loss = -(reward - baseline) * log_probs[None, :]
        mask = torch.ones_like(per_token_loss)
        loss = aggregate(per_token_loss, mask, "length_alpha", alpha=alpha)
        (gradient,) = torch.autograd.grad(-loss, theta)
        total += log_probs.sum().exp().detach() * gradient
    return total.numpy()


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("baseline", [0.0, 0.6])
def test_expected_update_matches_brute_force(alpha, baseline):
    np.testing.assert_allclose(
        TOY.expected_update(alpha, baseline),
        brute_force_update(TOY, alpha, baseline),
        rtol=1e-12,
        atol=1e-14,
    )


def test_true_gradient_closed_form():
    q, s = 1 / (1 + math.exp(-TOY.long_logit)), 1 / (1 + math.exp(-TOY.step_logit))
    n_short, n_long = TOY.short_length - 1, TOY.long_length - 1
    expected = [
        q * (1 - q) * (s**n_long - s**n_short),
        (1 - q) * n_short * s**n_short * (1 - s) + q * n_long * s**n_long * (1 - s),
    ]
    np.testing.assert_allclose(TOY.true_gradient(), expected, rtol=1e-12)
    assert TOY.objective() == pytest.approx((1 - q) * s**n_short + q * s**n_long, rel=1e-12)


def test_only_alpha_one_is_unbiased_and_only_then_is_the_baseline_free():
    for baseline in (0.0, 0.3, TOY.objective()):
        np.testing.assert_allclose(
            TOY.expected_update(1.0, baseline), TOY.true_gradient(), rtol=1e-12, atol=1e-15
        )
        assert TOY.bias_angle(1.0, baseline) < 1e-5
        for alpha in (0.0, 0.5):
            assert TOY.bias_angle(alpha, baseline) > 0.01
    # The baseline pushes along grad E[f(L)] = q(1-q)(f(L_long) - f(L_short)) on the form logit.
    q, b = 1 / (1 + math.exp(-TOY.long_logit)), 0.3
    push = TOY.baseline_push(0.0, b)
    weight_gap = 1 / TOY.long_length - 1 / TOY.short_length  # f_0(L_long) - f_0(L_short)
    np.testing.assert_allclose(push, [-b * q * (1 - q) * weight_gap, 0.0], atol=1e-15)


def test_group_mean_baseline_is_the_value_baseline_shrunk():
    # Over every pair of outcomes: E[(1/2) sum_i f(L_i)(r_i - mean r) s_i] = (1 - 1/2) E_alpha(J).
    probs, lengths, rewards, scores = TOY.outcomes()
    alpha = 0.0
    weights = lengths.astype(float) ** (alpha - 1)
    total = np.zeros(2)
    for i, j in itertools.product(range(len(probs)), repeat=2):
        mean_reward = (rewards[i] + rewards[j]) / 2
        update = (
            weights[i] * (rewards[i] - mean_reward) * scores[i]
            + weights[j] * (rewards[j] - mean_reward) * scores[j]
        ) / 2
        total += probs[i] * probs[j] * update
    np.testing.assert_allclose(total, 0.5 * TOY.expected_update(alpha, TOY.objective()), rtol=1e-12)


def test_contribution_ratios():
    assert TOY.token_weight_ratio(0.0) == 1.0
    assert TOY.token_weight_ratio(1.0) == pytest.approx(TOY.long_length / TOY.short_length)
    q, s = 1 / (1 + math.exp(-TOY.long_logit)), 1 / (1 + math.exp(-TOY.step_logit))
    # E||score||^2 given the form: (d - q)^2 plus n s (1 - s) from the independent steps.
    mean_square = [
        q**2 + (TOY.short_length - 1) * s * (1 - s),
        (1 - q) ** 2 + (TOY.long_length - 1) * s * (1 - s),
    ]
    length_ratio = TOY.long_length / TOY.short_length
    for alpha in (0.0, 0.5, 1.0):
        expected = math.sqrt(mean_square[1] / mean_square[0]) * length_ratio ** (alpha - 1)
        assert TOY.gradient_size_ratio(alpha) == pytest.approx(expected, rel=1e-12)


def test_errors():
    with pytest.raises(ValueError, match="short_length < long_length"):
        TwoLengthToy(short_length=5, long_length=5)
    with pytest.raises(ValueError, match="2 <="):
        TwoLengthToy(short_length=1, long_length=5)


def test_relative_baseline_push_is_the_push_over_the_gradient_norm():
    b = 0.3
    q = 1 / (1 + math.exp(-TOY.long_logit))
    weight_gap = 1 / TOY.long_length - 1 / TOY.short_length
    expected = b * q * (1 - q) * abs(weight_gap) / np.linalg.norm(TOY.true_gradient())
    assert TOY.relative_baseline_push(0.0, b) == pytest.approx(expected, rel=1e-12)
    assert TOY.relative_baseline_push(1.0, b) < 1e-14


def test_length_tradeoff_curves_and_the_alpha_they_pick():
    alphas = np.linspace(0, 1, 11)
    tradeoff = length_tradeoff(TOY, alphas)
    assert tradeoff["angle_no_baseline"][3] == TOY.bias_angle(alphas[3], 0.0)
    assert tradeoff["angle_group_mean"][3] == TOY.bias_angle(alphas[3], TOY.objective())
    np.testing.assert_allclose(tradeoff["token_weight"], 2.0**alphas, rtol=1e-14)  # L ratio 2
    choices = length_alpha_choices(alphas, tradeoff)
    assert choices["unbiased_alpha"] == 1.0  # P1 only at alpha = 1
    assert choices["token_invariant_alpha"] == 0.0  # P2 as token weight only at alpha = 0
    # P2 as gradient size: the grid point nearest the root of gradient_size_ratio(alpha) = 1
    size = tradeoff["gradient_size"]
    assert choices["size_invariant_alpha"] == alphas[np.argmin(np.abs(np.log(size)))]
    assert 0.0 < choices["size_invariant_alpha"] < 1.0


def test_length_summary_and_table_agree():
    summary = length_summary(TOY)
    table = length_tradeoff_table(TOY, [0.0, 1.0])
    assert table.loc[0.0, "angle, b = J (deg)"] == summary["angle_grpo_group_mean"]
    assert table.loc[0.0, "angle, b = 0 (deg)"] == summary["angle_grpo_no_baseline"]
    assert table.loc[0.0, "baseline push / |grad J|"] == summary["baseline_push_grpo"]
    assert table.loc[1.0, "token weight ratio"] == summary["dr_grpo_token_weight_ratio"] == 2.0
    assert table.loc[1.0, "gradient size ratio"] == summary["dr_grpo_gradient_size_ratio"]
