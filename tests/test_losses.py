import math

import pytest
import torch

from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.losses import (
    LOSS_TYPES,
    aggregate,
    clipped_surrogate,
    grpo_loss,
    kl_penalty,
    length_weights,
)

F64 = torch.float64


def _mask(lengths, seq_len):
    return (torch.arange(seq_len) < torch.tensor(lengths).unsqueeze(1)).to(F64)


# --- clipped surrogate ---------------------------------------------------------------


def _surrogate(ratios, advantages, **kwargs):
    log_probs = torch.log(torch.tensor(ratios, dtype=F64)).requires_grad_()
    old_log_probs = torch.zeros_like(log_probs)
    loss, is_clipped = clipped_surrogate(
        log_probs, old_log_probs, torch.tensor(advantages, dtype=F64), **kwargs
    )
    loss.sum().backward()
    return loss.detach(), is_clipped, log_probs.grad


def test_clipping_symmetric_epsilon_hand_computed():
    # Row 0: A = +1, row 1: A = -1; ratios above 1 + eps, below 1 - eps, and inside.
    loss, is_clipped, grad = _surrogate([[1.5, 0.5, 1.1], [0.5, 1.5, 0.9]], [1.0, -1.0])
    expected = torch.tensor(
        [
            [-1.2, -0.5, -1.1],  # A > 0: min(1.5, 1.2) clipped; min(0.5, 0.8) not
            [0.8, 1.5, 0.9],  # A < 0: min(-0.5, -0.8) clipped; min(-1.5, -1.2) not
        ],
        dtype=F64,
    )
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    assert is_clipped.tolist() == [[True, False, False], [True, False, False]]
    # Clipped tokens carry no gradient; the others get -A * ratio.
    torch.testing.assert_close(
        grad, torch.tensor([[0.0, -0.5, -1.1], [0.0, 1.5, 0.9]], dtype=F64), rtol=0, atol=1e-12
    )


def test_clipping_asymmetric_epsilon_high():
    loss, is_clipped, _ = _surrogate(
        [[1.25, 1.5, 0.5], [0.5, 0.75, 1.5]], [1.0, -1.0], epsilon=0.2, epsilon_high=0.28
    )
    expected = torch.tensor(
        [
            [-1.25, -1.28, -0.5],  # upper bound moves to 1.28
            [0.8, 0.8, 1.5],  # lower bound stays at 1 - epsilon = 0.8
        ],
        dtype=F64,
    )
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    assert is_clipped.tolist() == [[False, True, False], [True, True, False]]


def test_epsilon_high_defaults_to_epsilon():
    loss, is_clipped, _ = _surrogate([[1.25]], [1.0], epsilon=0.2)
    assert loss.item() == pytest.approx(-1.2, abs=1e-12)
    assert is_clipped.item()


# --- KL estimators --------------------------------------------------------------------

PI = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
REF = torch.tensor([0.2, 0.5, 0.3], dtype=F64)
EXACT_KL = (PI * (PI / REF).log()).sum().item()


def _estimates_per_category(estimator):
    return kl_penalty(PI.log().unsqueeze(0), REF.log().unsqueeze(0), estimator).squeeze(0)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_unbiased_estimators_match_kl_by_monte_carlo(estimator):
    num_samples = 200_000
    generator = torch.Generator().manual_seed(0)
    samples = torch.multinomial(PI, num_samples, replacement=True, generator=generator)
    estimates = kl_penalty(PI.log()[samples].unsqueeze(0), REF.log()[samples].unsqueeze(0), estimator)

    per_category = _estimates_per_category(estimator)
    std = (PI * (per_category - EXACT_KL) ** 2).sum().sqrt().item()
    tolerance = 4 * std / math.sqrt(num_samples)  # 4 sigma of the Monte Carlo mean
    assert abs(estimates.mean().item() - EXACT_KL) < tolerance


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_unbiased_estimators_have_exact_expectation_kl(estimator):
    expectation = (PI * _estimates_per_category(estimator)).sum().item()
    assert expectation == pytest.approx(EXACT_KL, abs=1e-12)


def test_k2_is_biased():
    expectation = (PI * _estimates_per_category("k2")).sum().item()
    # E[k2] = 0.2655..., KL = 0.2238...
    assert expectation - EXACT_KL > 0.04


def test_k2_k3_are_nonnegative_and_zero_at_equal_policies():
    log_probs = torch.randn(4, 6, dtype=F64, generator=torch.Generator().manual_seed(1))
    for estimator in ("k2", "k3"):
        assert (kl_penalty(log_probs, log_probs.flip(0), estimator) >= 0).all()
        assert torch.equal(kl_penalty(log_probs, log_probs, estimator), torch.zeros_like(log_probs))


# --- aggregation ----------------------------------------------------------------------

# Masked positions hold 100 so that any leak into the result is obvious.
PER_TOKEN_LOSS = torch.tensor([[1.0, 2.0, 3.0, 100.0], [5.0, 6.0, 100.0, 100.0]], dtype=F64)
MASK = _mask([3, 2], 4)  # token sums 6 and 11


@pytest.mark.parametrize(
    ("loss_type", "kwargs", "expected"),
    [
        ("grpo", {}, (6 / 3 + 11 / 2) / 2),
        ("dr_grpo", {}, (6 + 11) / (2 * 4)),
        ("dr_grpo", {"max_completion_length": 10}, (6 + 11) / (2 * 10)),
        ("bnpo", {}, (6 + 11) / 5),
        ("dapo", {}, (6 + 11) / 5),
        ("length_alpha", {"alpha": 0.5}, (6 / math.sqrt(3) + 11 / math.sqrt(2)) / 2),
    ],
)
def test_aggregate_hand_computed(loss_type, kwargs, expected):
    assert aggregate(PER_TOKEN_LOSS, MASK, loss_type, **kwargs).item() == pytest.approx(
        expected, abs=1e-12
    )


def test_length_alpha_interpolates_grpo_and_dr_grpo():
    generator = torch.Generator().manual_seed(2)
    per_token_loss = torch.randn(6, 9, dtype=F64, generator=generator)
    mask = _mask(torch.randint(1, 10, (6,), generator=generator).tolist(), 9)
    max_completion_length = 12

    alpha_0 = aggregate(per_token_loss, mask, "length_alpha", alpha=0.0)
    alpha_1 = aggregate(per_token_loss, mask, "length_alpha", alpha=1.0)
    grpo = aggregate(per_token_loss, mask, "grpo")
    dr_grpo = aggregate(per_token_loss, mask, "dr_grpo", max_completion_length=max_completion_length)
    assert abs(alpha_0.item() - grpo.item()) < 1e-12
    assert abs(alpha_1.item() - dr_grpo.item() * max_completion_length) < 1e-12


def test_length_weights():
    weights = length_weights(torch.tensor([1, 2, 4]), 0.5)
    torch.testing.assert_close(weights, torch.tensor([1.0, 2**-0.5, 0.5]))


# --- full loss ------------------------------------------------------------------------

LENGTHS = [4, 2, 5, 1]
ADVANTAGES = [1.5, -0.5, 0.25, 2.0]


def _expected_ratio_one_loss(loss_type, seq_len, alpha=0.5):
    """-(mean advantage), weighting each sequence as loss_type does."""
    batch = len(LENGTHS)
    weighted = sum(a * n for a, n in zip(ADVANTAGES, LENGTHS))
    if loss_type == "grpo":
        return -sum(ADVANTAGES) / batch
    if loss_type == "dr_grpo":
        return -weighted / (batch * seq_len)
    if loss_type in ("bnpo", "dapo"):
        return -weighted / sum(LENGTHS)
    return -sum(a * n**alpha for a, n in zip(ADVANTAGES, LENGTHS)) / batch


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_loss_at_ratio_one_is_weighted_mean_advantage(loss_type):
    seq_len = 6
    log_probs = torch.randn(4, seq_len, dtype=F64, generator=torch.Generator().manual_seed(3))
    loss, stats = grpo_loss(
        log_probs,
        log_probs,
        None,
        torch.tensor(ADVANTAGES, dtype=F64),
        _mask(LENGTHS, seq_len),
        loss_type=loss_type,
        alpha=0.5,
    )
    assert loss.item() == pytest.approx(_expected_ratio_one_loss(loss_type, seq_len), abs=1e-12)
    assert stats == {"kl": 0.0, "clip_ratio": 0.0}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_zero_sum_advantages_give_zero_loss_but_nonzero_gradient(loss_type):
    rewards = torch.tensor([[1.0, 0.0, 0.0], [0.2, 0.9, 0.4]], dtype=F64)
    advantages = group_advantages(rewards).flatten()
    log_probs = torch.randn(6, 5, dtype=F64, generator=torch.Generator().manual_seed(4))
    log_probs.requires_grad_()
    # Same tensor as old_log_probs: the on-policy step of TRL with num_iterations=1.
    loss, _ = grpo_loss(
        log_probs, log_probs, None, advantages, torch.ones(6, 5), loss_type=loss_type, alpha=0.5
    )
    loss.backward()
    assert abs(loss.item()) < 1e-12
    assert log_probs.grad.norm().item() > 0.1


def test_grpo_loss_gradient_at_ratio_one_is_advantage_over_length():
    advantages = torch.tensor(ADVANTAGES, dtype=F64)
    mask = _mask(LENGTHS, 6)
    log_probs = torch.zeros(4, 6, dtype=F64, requires_grad=True)
    loss, _ = grpo_loss(log_probs, log_probs, None, advantages, mask)
    loss.backward()
    lengths = torch.tensor(LENGTHS, dtype=F64).unsqueeze(1)
    expected = -advantages.unsqueeze(1) / (lengths * 4) * mask
    torch.testing.assert_close(log_probs.grad, expected, rtol=0, atol=1e-12)


def test_grpo_loss_adds_beta_times_kl_and_reports_stats():
    generator = torch.Generator().manual_seed(5)
    log_probs = torch.randn(2, 3, dtype=F64, generator=generator)
    ref_log_probs = torch.randn(2, 3, dtype=F64, generator=generator)
    # Ratio 1.5 on one unmasked token of a positive-advantage row: 1 of 5 tokens clipped.
    old_log_probs = log_probs.clone()
    old_log_probs[0, 0] -= math.log(1.5)
    old_log_probs[1, 2] -= math.log(1.5)  # masked out, must not count
    advantages = torch.tensor([1.0, -1.0], dtype=F64)
    mask = _mask([3, 2], 3)

    loss, stats = grpo_loss(log_probs, old_log_probs, ref_log_probs, advantages, mask, beta=0.1)

    kl = kl_penalty(log_probs, ref_log_probs, "k3")
    surrogate, _ = clipped_surrogate(log_probs, old_log_probs, advantages)
    expected = aggregate(surrogate + 0.1 * kl, mask, "grpo")
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    assert stats["kl"] == pytest.approx(((kl * mask).sum() / 5).item(), abs=1e-12)
    assert stats["kl"] > 0
    assert stats["clip_ratio"] == pytest.approx(1 / 5, abs=1e-12)


# --- errors ---------------------------------------------------------------------------

LP = torch.zeros(2, 3)
ADV = torch.zeros(2)
M = torch.ones(2, 3)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: aggregate(LP, M, "sum"), r"unknown loss_type 'sum'.*'grpo'.*'length_alpha'"),
        (lambda: kl_penalty(LP, LP, "k4"), r"unknown KL estimator 'k4'.*'k1', 'k2', 'k3'"),
        (lambda: clipped_surrogate(LP, torch.zeros(2, 4), ADV), r"log_probs and old_log_probs.*\(2, 3\).*\(2, 4\)"),
        (lambda: clipped_surrogate(LP, LP, torch.zeros(3)), r"advantages must have shape \(batch,\) = \(2,\).*\(3,\)"),
        (lambda: clipped_surrogate(LP, LP, torch.zeros(2, 3)), r"advantages must have shape"),
        (lambda: clipped_surrogate(torch.zeros(3), torch.zeros(3), ADV), r"log_probs must be 2-D"),
        (lambda: kl_penalty(LP, torch.zeros(3, 2)), r"log_probs and ref_log_probs.*\(2, 3\).*\(3, 2\)"),
        (lambda: aggregate(LP, torch.ones(2, 4)), r"per_token_loss and mask.*\(2, 3\).*\(2, 4\)"),
        (lambda: grpo_loss(LP, LP, None, ADV, torch.ones(2, 4)), r"log_probs and mask"),
        (lambda: clipped_surrogate(LP, LP, ADV, epsilon=-0.1), r"epsilon and epsilon_high must be >= 0.*-0.1"),
        (lambda: clipped_surrogate(LP, LP, ADV, epsilon_high=-0.1), r"epsilon and epsilon_high must be >= 0"),
        (lambda: aggregate(LP, _mask([3, 0], 3), "grpo"), r"'grpo' divides by sequence lengths.*rows \[1\]"),
        (lambda: aggregate(LP, _mask([0, 2], 3), "length_alpha", alpha=0.5), r"'length_alpha'.*rows \[0\]"),
        (lambda: aggregate(LP, torch.zeros(2, 3), "bnpo"), r"'bnpo' needs at least one unmasked token"),
        (lambda: aggregate(LP, M, "length_alpha"), r"'length_alpha' needs alpha"),
        (lambda: aggregate(LP, M, "dr_grpo", max_completion_length=0), r"max_completion_length must be > 0"),
        (lambda: length_weights(torch.tensor([2, 0]), 0.5), r"lengths must be positive"),
        (lambda: grpo_loss(LP, LP, None, ADV, M, beta=0.1), r"beta = 0.1 > 0 needs ref_log_probs"),
        (lambda: grpo_loss(LP, LP, LP, ADV, M, beta=-0.1), r"beta must be >= 0"),
        (lambda: grpo_loss(LP, LP, LP, ADV, M, kl_estimator="k9"), r"unknown KL estimator 'k9'"),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
