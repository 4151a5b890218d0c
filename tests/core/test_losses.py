import math

import pytest
import torch

from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.kl import kl_penalty
from grpo_companion.core.losses import (
    CLIPPED_LOSS_TYPES,
    LOSS_TYPES,
    aggregate,
    clipped_surrogate,
    grpo_loss,
    length_weights,
    off_policy_sequence_mask,
    policy_loss,
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
    estimates = kl_penalty(
        PI.log()[samples].unsqueeze(0), REF.log()[samples].unsqueeze(0), estimator
    )

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
    dr_grpo = aggregate(
        per_token_loss, mask, "dr_grpo", max_completion_length=max_completion_length
    )
    assert abs(alpha_0.item() - grpo.item()) < 1e-12
    assert abs(alpha_1.item() - dr_grpo.item() * max_completion_length) < 1e-12


def test_length_weights():
    weights = length_weights(torch.tensor([1, 2, 4]), 0.5)
    torch.testing.assert_close(weights, torch.tensor([1.0, 2**-0.5, 0.5]))


# --- full loss ------------------------------------------------------------------------

LENGTHS = [4, 2, 5, 1]
ADVANTAGES = [1.5, -0.5, 0.25, 2.0]


def _expected_ratio_one_loss(loss_type, log_probs, alpha=0.5):
    """At ratio 1 every token's loss is -c_i A_i g_it: g = 1 for the ratio-based losses, g = log pi
    for the REINFORCE-like cispo (c = min(1, epsilon_high) = 0.2) and vespo (c = phi(1) = 1);
    sapo's c = sigmoid(0) 4 / tau = 2 / tau. Then each sequence weighs as loss_type says."""
    batch, seq_len = log_probs.shape
    sums = []  # sum_t of the per-token loss of each sequence
    for i, (a, n) in enumerate(zip(ADVANTAGES, LENGTHS)):
        g = log_probs[i, :n].sum().item() if loss_type in ("cispo", "vespo") else n
        c = {"cispo": 0.2, "sapo": 2 / (1.0 if a > 0 else 1.05)}.get(loss_type, 1.0)
        sums.append(-c * a * g)
    if loss_type in ("grpo", "sapo"):
        return sum(t / n for t, n in zip(sums, LENGTHS)) / batch
    if loss_type == "dr_grpo":
        return sum(sums) / (batch * seq_len)
    if loss_type in ("bnpo", "dapo", "cispo", "vespo"):
        return sum(sums) / sum(LENGTHS)
    if loss_type == "luspo":
        return sum(sums) / batch
    return sum(t * n ** (alpha - 1) for t, n in zip(sums, LENGTHS)) / batch


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
    assert loss.item() == pytest.approx(_expected_ratio_one_loss(loss_type, log_probs), abs=1e-12)
    zero = {"kl": 0.0, "clip_ratio": 0.0, "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0}
    assert stats == zero


# cispo and vespo weigh log pi itself, sapo weighs A > 0 and A < 0 differently: not zero there.
@pytest.mark.parametrize("loss_type", CLIPPED_LOSS_TYPES)
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
        (
            lambda: clipped_surrogate(LP, torch.zeros(2, 4), ADV),
            r"log_probs and old_log_probs.*\(2, 3\).*\(2, 4\)",
        ),
        (
            lambda: clipped_surrogate(LP, LP, torch.zeros(3)),
            r"advantages must have shape \(batch,\) = \(2,\).*\(3,\)",
        ),
        (lambda: clipped_surrogate(LP, LP, torch.zeros(2, 4)), r"advantages must have shape"),
        (
            lambda: clipped_surrogate(LP, LP, M, mask=M, importance_sampling_level="sequence"),
            r"'sequence' \(GSPO\) has one ratio per sequence.*per-token advantages \(2, 3\)",
        ),
        (lambda: clipped_surrogate(torch.zeros(3), torch.zeros(3), ADV), r"log_probs must be 2-D"),
        (
            lambda: kl_penalty(LP, torch.zeros(3, 2)),
            r"log_probs and ref_log_probs.*\(2, 3\).*\(3, 2\)",
        ),
        (lambda: aggregate(LP, torch.ones(2, 4)), r"per_token_loss and mask.*\(2, 3\).*\(2, 4\)"),
        (lambda: grpo_loss(LP, LP, None, ADV, torch.ones(2, 4)), r"log_probs and mask"),
        (
            lambda: clipped_surrogate(LP, LP, ADV, epsilon=-0.1),
            r"epsilon and epsilon_high must be >= 0.*-0.1",
        ),
        (
            lambda: clipped_surrogate(LP, LP, ADV, epsilon_high=-0.1),
            r"epsilon and epsilon_high must be >= 0",
        ),
        (
            lambda: aggregate(LP, _mask([3, 0], 3), "grpo"),
            r"'grpo' divides by sequence lengths.*rows \[1\]",
        ),
        (
            lambda: aggregate(LP, _mask([0, 2], 3), "length_alpha", alpha=0.5),
            r"'length_alpha'.*rows \[0\]",
        ),
        (
            lambda: aggregate(LP, torch.zeros(2, 3), "bnpo"),
            r"'bnpo' needs at least one unmasked token",
        ),
        (lambda: aggregate(LP, M, "length_alpha"), r"'length_alpha' needs alpha"),
        (
            lambda: aggregate(LP, M, "dr_grpo", max_completion_length=0),
            r"max_completion_length must be > 0",
        ),
        (lambda: length_weights(torch.tensor([2, 0]), 0.5), r"lengths must be positive"),
        (lambda: grpo_loss(LP, LP, None, ADV, M, beta=0.1), r"beta = 0.1 > 0 needs ref_log_probs"),
        (lambda: grpo_loss(LP, LP, LP, ADV, M, beta=-0.1), r"beta must be >= 0"),
        (lambda: grpo_loss(LP, LP, LP, ADV, M, kl_estimator="k9"), r"unknown KL estimator 'k9'"),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# verl's `agg_loss` modes are held by verl's own function: tests/core/test_verl_equivalence.py.


def test_kl_clamp_is_verls_low_var_kl_and_matters_only_far_from_the_reference():
    x = torch.tensor([[-25.0, -15.0, -2.0, 0.5, 2.0, 3.0, 25.0]], dtype=F64, requires_grad=True)
    ref = torch.zeros_like(x)
    clamped = kl_penalty(x, ref, clamp=True)
    # verl: kl = ref - logp clamped to [-20, 20]; (exp(kl) - kl - 1) clamped to [-10, 10].
    kl = (ref - x.detach()).clamp(-20, 20)
    verl = (kl.exp() - kl - 1).clamp(-10, 10)
    torch.testing.assert_close(clamped.detach(), verl, rtol=0, atol=1e-12)
    plain = kl_penalty(x, ref)
    differs = (clamped != plain).flatten().tolist()
    # k3 > 10 only for x < -2.61 or x > 11.0: here at -25, -15, 25 (and at 25 also the log clamp)
    assert differs == [True, True, False, False, False, False, True]
    (grad,) = torch.autograd.grad(clamped.sum(), x)
    assert grad.flatten().tolist()[:2] == [0.0, 0.0] and grad[0, -1] == 0.0  # clamped: no gradient
    with pytest.raises(ValueError, match="clamp is verl's bound on k3"):
        kl_penalty(x, ref, "k1", clamp=True)


def test_bias_correction_multiplies_the_kl_by_the_differentiable_ratio():
    """TRL's use_bias_correction_kl: the per-token loss gets beta * k3 * exp(logp - old_logp)."""
    generator = torch.Generator().manual_seed(7)
    log_probs = torch.randn(3, 5, dtype=F64, generator=generator).requires_grad_()
    old_log_probs = log_probs.detach() + 0.1 * torch.randn(3, 5, dtype=F64, generator=generator)
    ref_log_probs = torch.randn(3, 5, dtype=F64, generator=generator)
    advantages, mask = torch.tensor([1.0, -0.5, 0.3], dtype=F64), _mask([5, 3, 4], 5)
    loss, stats = grpo_loss(
        log_probs, old_log_probs, ref_log_probs, advantages, mask, beta=0.3,
        use_bias_correction_kl=True, loss_type="dapo",
    )  # fmt: skip
    ratio = (log_probs - old_log_probs).exp()
    k3 = (ref_log_probs - log_probs).exp() - (ref_log_probs - log_probs) - 1
    surrogate = -torch.minimum(
        ratio * advantages[:, None], ratio.clamp(0.8, 1.2) * advantages[:, None]
    )
    expected = ((surrogate + 0.3 * k3 * ratio) * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    assert stats["kl"] == pytest.approx(((k3 * ratio * mask).sum() / mask.sum()).item(), abs=1e-12)
    grads = [torch.autograd.grad(value, log_probs)[0] for value in (loss, expected)]
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)
    # On-policy (ratio 1) the value is unchanged, the gradient is not: + beta k3 grad log pi.
    on, _ = grpo_loss(log_probs, log_probs, ref_log_probs, advantages, mask, beta=0.3,
                      use_bias_correction_kl=True, loss_type="dapo")  # fmt: skip
    off, _ = grpo_loss(log_probs, log_probs, ref_log_probs, advantages, mask, beta=0.3,
                       loss_type="dapo")  # fmt: skip
    assert on.item() == pytest.approx(off.item(), abs=1e-12)
    difference = torch.autograd.grad(on - off, log_probs)[0]
    torch.testing.assert_close(
        difference, 0.3 * k3.detach() * mask / mask.sum(), rtol=0, atol=1e-12
    )


# --- policy-loss variants of TRL and verl --------------------------------------------------

RATIOS = [[1.5, 0.5, 4.0, 1.1], [0.5, 1.5, 4.0, 0.9]]  # row 0: A = +1, row 1: A = -1


def test_delta_caps_negative_advantages_as_verls_dual_clip():
    loss, is_clipped, grad = _surrogate(RATIOS, [1.0, -1.0], delta=3.0)
    # TRL: -min(min(rho, delta) A, clip(rho) A). verl's dual clip, written independently:
    # A < 0: min(max(-A rho, -A clip(rho)), -A c); A >= 0: max(-A rho, -A clip(rho)).
    rho, a = torch.tensor(RATIOS, dtype=F64), torch.tensor([[1.0], [-1.0]], dtype=F64)
    ppo = torch.maximum(-a * rho, -a * rho.clamp(0.8, 1.2))
    verl = torch.where(a < 0, torch.minimum(ppo, -a * 3.0), ppo)
    torch.testing.assert_close(loss, verl, rtol=0, atol=1e-12)
    assert loss[1, 2].item() == 3.0 and grad[1, 2].item() == 0.0  # capped: no gradient
    plain, _, plain_grad = _surrogate(RATIOS, [1.0, -1.0])
    assert plain[1, 2].item() == 4.0 and plain_grad[1, 2].item() == pytest.approx(4.0)
    assert is_clipped.tolist() == [[True, False, True, False], [True, False, False, False]]
    with pytest.raises(ValueError, match="delta must be > 1"):
        _surrogate(RATIOS, [1.0, -1.0], delta=0.9)


def test_sequence_level_ratio_is_gspo():
    """GSPO: rho_i = exp(mean_t log(pi / pi_old)), clipped per sequence; grad through the mean."""
    generator = torch.Generator().manual_seed(8)
    log_probs = torch.randn(2, 4, dtype=F64, generator=generator).requires_grad_()
    old_log_probs = log_probs.detach() + torch.tensor([[0.3], [-0.05]], dtype=F64)
    mask, advantages = _mask([4, 2], 4), torch.tensor([-1.0, 2.0], dtype=F64)
    per_token, is_clipped = clipped_surrogate(
        log_probs, old_log_probs, advantages, mask=mask, importance_sampling_level="sequence"
    )
    rho = torch.exp(((log_probs - old_log_probs) * mask).sum(1) / mask.sum(1))  # e^-0.3, e^0.05
    expected = -torch.minimum(rho * advantages, rho.clamp(0.8, 1.2) * advantages)
    torch.testing.assert_close(per_token, expected[:, None].expand(2, 4), rtol=0, atol=1e-12)
    assert is_clipped[:, 0].tolist() == [True, False]  # e^-0.3 = 0.74 < 0.8 with A < 0
    loss, stats = grpo_loss(
        log_probs, old_log_probs, None, advantages, mask, importance_sampling_level="sequence"
    )
    (grad,) = torch.autograd.grad(loss, log_probs)
    # Row 0 is clipped (no gradient); row 1: d/dlogp_t of -(rho A)/2 = -rho A / (2 * L_1).
    expected_grad = torch.zeros(2, 4, dtype=F64)
    expected_grad[1, :2] = -rho[1].item() * 2.0 / (2 * 2)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)
    assert stats["clip_ratio/low_mean"] == 0.5  # TRL: the mean over sequences


def _variant(loss_type, log_probs, old_log_probs, advantages, mask, **options):
    per_token = policy_loss(log_probs, old_log_probs, advantages, mask, loss_type, **options)
    return per_token, torch.autograd.grad((per_token * mask).sum(), log_probs)[0]


def test_cispo_sapo_vespo_formulas_and_gradients():
    generator = torch.Generator().manual_seed(9)
    log_probs = (torch.randn(2, 3, dtype=F64, generator=generator) - 1).requires_grad_()
    shift = torch.tensor([[0.5, -0.2, 0.05], [1.0, 0.1, -0.7]], dtype=F64)
    old_log_probs = log_probs.detach() - shift  # log rho = shift
    mask, advantages = _mask([3, 2], 3), torch.tensor([0.7, -1.2], dtype=F64)
    rho, a, lp = shift.exp(), advantages[:, None], log_probs.detach()

    # CISPO (TRL): -sg(min(rho, epsilon_high)) A log pi; gradient -min(rho, eps_high) A.
    loss, grad = _variant("cispo", log_probs, old_log_probs, advantages, mask, epsilon_high=1.3)
    weight = rho.clamp(max=1.3)
    torch.testing.assert_close(loss, -weight * a * lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, -weight * a * mask, rtol=0, atol=1e-12)

    # SAPO: -sigmoid(tau (rho - 1)) 4 / tau A; gradient -4 A sigma'(tau (rho - 1)) rho.
    loss, grad = _variant("sapo", log_probs, old_log_probs, advantages, mask)
    tau = torch.tensor([[1.0], [1.05]], dtype=F64)
    sigma = torch.sigmoid(tau * (rho - 1))
    torch.testing.assert_close(loss, -sigma * 4 / tau * a, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, -4 * a * sigma * (1 - sigma) * rho * mask, rtol=0, atol=1e-12)

    # VESPO: phi(w) = exp(lambda) w^k exp(-lambda w), w = prod_t rho_t over the sequence.
    loss, grad = _variant("vespo", log_probs, old_log_probs, advantages, mask)
    w = torch.tensor([math.exp(0.5 - 0.2 + 0.05), math.exp(1.0 + 0.1)], dtype=F64)
    k, lam = torch.tensor([2.0, 3.0], dtype=F64), torch.tensor([3.0, 2.0], dtype=F64)
    phi = (lam.exp() * w**k * (-lam * w).exp())[:, None]
    torch.testing.assert_close(loss, -phi * a * lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, -phi * a * mask, rtol=0, atol=1e-12)


def test_off_policy_mask_drops_drifted_negative_sequences():
    log_probs = torch.zeros(3, 2, dtype=F64)
    old_log_probs = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.05, 0.1]], dtype=F64)
    advantages, mask = torch.tensor([1.0, -1.0, -1.0], dtype=F64), torch.ones(3, 2)
    keep = off_policy_sequence_mask(log_probs, old_log_probs, advantages, mask, threshold=0.1)
    # Row 0 has A >= 0; row 1 drifted by 0.5 > 0.1 with A < 0; row 2 by 0.075 <= 0.1.
    assert keep.flatten().tolist() == [1.0, 0.0, 1.0]
    masked, _ = grpo_loss(log_probs, old_log_probs, None, advantages, mask,
                          off_policy_mask_threshold=0.1, loss_type="luspo")  # fmt: skip
    per_token, _ = clipped_surrogate(log_probs, old_log_probs, advantages)
    assert masked.item() == pytest.approx((per_token.sum(1) * keep.flatten()).mean().item())


def test_allow_empty_rows_count_in_the_batch():
    """mask_truncated_completions empties rows: TRL clamps their length at 1 (they add 0)."""
    per_token_loss, mask = PER_TOKEN_LOSS, torch.cat([MASK, torch.zeros(1, 4, dtype=F64)])
    per_token_loss = torch.cat([per_token_loss, torch.full((1, 4), 100.0, dtype=F64)])
    assert aggregate(per_token_loss, mask, "grpo", allow_empty=True).item() == pytest.approx(
        (6 / 3 + 11 / 2) / 3
    )


# --- per-token advantages (process supervision) -----------------------------------------------


def _loss_and_gradient(advantages, loss_type, **options):
    generator = torch.Generator().manual_seed(11)
    log_probs = (torch.randn(4, 5, dtype=F64, generator=generator) - 1).requires_grad_()
    old_log_probs = log_probs.detach() + 0.3 * torch.randn(4, 5, dtype=F64, generator=generator)
    ref_log_probs = log_probs.detach() + 0.2 * torch.randn(4, 5, dtype=F64, generator=generator)
    loss, stats = grpo_loss(
        log_probs, old_log_probs, ref_log_probs, advantages, _mask([5, 3, 1, 4], 5),
        loss_type=loss_type, alpha=0.5, beta=0.05, **options,
    )  # fmt: skip
    return loss, torch.autograd.grad(loss, log_probs)[0], stats


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize(
    "options",
    [{}, {"delta": 1.5, "epsilon_high": 0.28, "off_policy_mask_threshold": 0.05}],
)
def test_advantages_broadcast_over_the_tokens_give_the_same_loss_and_gradient(loss_type, options):
    advantages = torch.tensor([1.2, -0.7, 0.0, -1.5], dtype=F64)
    per_sequence = _loss_and_gradient(advantages, loss_type, **options)
    per_token = _loss_and_gradient(advantages[:, None].expand(4, 5), loss_type, **options)
    assert per_token[0].item() == per_sequence[0].item()
    assert torch.equal(per_token[1], per_sequence[1])
    assert per_token[2] == per_sequence[2]


def test_per_token_advantages_clip_and_weigh_each_token_by_its_own_advantage():
    """-min(rho A_t, clip(rho) A_t) token by token: a token is clipped by its own sign."""
    log_probs = torch.log(torch.tensor([[1.5, 1.5, 0.5], [1.0, 0.5, 1.5]], dtype=F64))
    log_probs.requires_grad_()
    advantages = torch.tensor([[1.0, -2.0, -1.0], [0.5, 2.0, 0.0]], dtype=F64)
    per_token, is_clipped = clipped_surrogate(log_probs, torch.zeros(2, 3, dtype=F64), advantages)
    expected = [[-1.2, 3.0, 0.8], [-0.5, -1.0, 0.0]]
    torch.testing.assert_close(per_token, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)
    assert is_clipped.tolist() == [[True, False, True], [False, False, False]]
    (grad,) = torch.autograd.grad(per_token.sum(), log_probs)
    # d/dlog pi of -rho A is -rho A where the unclipped term is the minimum, else 0.
    expected_grad = [[0.0, 3.0, 0.0], [-0.5, -1.0, 0.0]]
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=F64), rtol=0, atol=1e-12)
