"""Chapter 3, section 2 (`chapters.grpo_loss.surrogate`): the importance-sampling identity by
exact enumeration against direct computation, the ratio's variance against the chi-square
divergence, and the clipped surrogate's zero-gradient region against autograd."""

import math

import pytest
import torch
from conftest import sum_mod_setup

from grpo_companion.chapters.grpo_loss.kl import kl_divergence
from grpo_companion.chapters.grpo_loss.surrogate import (
    chi_square,
    clip_case_records,
    clip_cases,
    estimate_variance,
    importance_records,
    importance_table,
    policy_gradient,
    ratio_variance,
    reused_gradient,
    surrogate,
    surrogate_gradient,
)
from grpo_companion.core.losses import clipped_surrogate

F64 = torch.float64


def _moved(vocab_size, length, distance=0.7):
    """The sum-mod set-up, a policy moved from it (pi_old = the set-up's), and random advantages."""
    policy, old_logits, rewards = sum_mod_setup(vocab_size=vocab_size, length=length, seed=0)
    logits = old_logits + distance * policy.init_logits(seed=5)
    advantages = torch.randn(
        policy.num_sequences, generator=torch.Generator().manual_seed(3), dtype=F64
    )
    return policy, old_logits, logits, rewards, advantages


def _autograd_expectation_gradient(policy, logits, weights, advantages):
    """grad of sum_y weights(y) A(y) log pi(y) by autograd: sum_y weights(y) A(y) s(y)."""
    leaf = logits.detach().clone().requires_grad_(True)
    value = weights @ (advantages * policy.log_prob(leaf, policy.all_sequences()))
    return torch.autograd.grad(value, leaf)[0].flatten()


@pytest.mark.parametrize(("vocab_size", "length"), [(3, 2), (2, 3)])
def test_the_importance_sampling_identity_by_enumeration(vocab_size, length):
    policy, old_logits, logits, rewards, advantages = _moved(vocab_size, length)
    probs, old_probs = policy.probs(logits), policy.probs(old_logits)
    # left side: autograd on the surrogate E_old[rho A]; and written out, E_old[rho A s]
    left = surrogate_gradient(policy, logits, old_logits, advantages)
    scores = policy.scores(logits, policy.all_sequences())
    written_out = old_probs @ ((probs / old_probs * advantages)[:, None] * scores)
    # right side: E_pi[A s] from the closed-form scores, and by autograd on sum_y pi(y) A log pi(y)
    right = policy_gradient(policy, logits, advantages)
    by_autograd = _autograd_expectation_gradient(policy, logits, probs.detach(), advantages)
    for other in (written_out, right, by_autograd):
        torch.testing.assert_close(left, other, rtol=0, atol=1e-13)
    assert left.norm() > 0.05  # not a trivial zero
    # with A = r - b, b constant, both sides are grad J at the moved policy
    constant_baseline = rewards - 0.3
    torch.testing.assert_close(
        surrogate_gradient(policy, logits, old_logits, constant_baseline),
        policy.exact_gradient(logits, rewards),
        rtol=0,
        atol=1e-13,
    )


def test_the_surrogate_value_is_the_expectation_under_the_current_policy():
    policy, old_logits, logits, _, advantages = _moved(3, 2)
    value = surrogate(policy, logits, old_logits, advantages)
    assert float(value) == pytest.approx(float(policy.probs(logits) @ advantages), abs=1e-14)
    ones = torch.ones(policy.num_sequences, dtype=F64)
    assert float(surrogate(policy, logits, old_logits, ones)) == pytest.approx(1.0, abs=1e-14)
    with pytest.raises(ValueError, match="unknown level"):
        surrogate(policy, logits, old_logits, advantages, "sentence")


def test_token_ratios_give_the_policy_gradient_at_pi_old_only():
    policy, old_logits, logits, _, advantages = _moved(2, 3)
    at_old = {
        level: surrogate_gradient(policy, old_logits, old_logits, advantages, level)
        for level in ("sequence", "token")
    }
    target = policy_gradient(policy, old_logits, advantages)
    for gradient in at_old.values():
        torch.testing.assert_close(gradient, target, rtol=0, atol=1e-14)
    moved = surrogate_gradient(policy, logits, old_logits, advantages, "token")
    target = policy_gradient(policy, logits, advantages)
    assert (moved - target).norm() / target.norm() > 0.05
    # one token: the token's ratio is the sequence's, at every policy
    policy, old_logits, logits, _, advantages = _moved(4, 1)
    torch.testing.assert_close(
        surrogate_gradient(policy, logits, old_logits, advantages, "token"),
        surrogate_gradient(policy, logits, old_logits, advantages, "sequence"),
        rtol=0,
        atol=1e-14,
    )


def test_the_batch_reused_without_the_ratio():
    policy, old_logits, logits, _, advantages = _moved(3, 2)
    old_probs = policy.probs(old_logits)
    reused = reused_gradient(policy, logits, old_logits, advantages)
    by_autograd = _autograd_expectation_gradient(policy, logits, old_probs, advantages)
    torch.testing.assert_close(reused, by_autograd, rtol=0, atol=1e-13)
    target = policy_gradient(policy, logits, advantages)
    assert (reused - target).norm() / target.norm() > 0.05
    torch.testing.assert_close(
        reused_gradient(policy, old_logits, old_logits, advantages),
        policy_gradient(policy, old_logits, advantages),
        rtol=0,
        atol=1e-14,
    )


def test_the_ratio_variance_is_the_chi_square_divergence():
    # problem 3-4: pi_old = (1/2, 1/2), pi = (3/4, 1/4)
    probs, old_probs = torch.tensor([0.75, 0.25], dtype=F64), torch.tensor([0.5, 0.5], dtype=F64)
    assert ratio_variance(probs, old_probs) == pytest.approx(0.25, abs=1e-15)
    assert chi_square(probs, old_probs) == pytest.approx(0.25, abs=1e-15)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        probs, old_probs = (torch.rand(7, generator=generator, dtype=F64) + 0.01 for _ in range(2))
        probs, old_probs = probs / probs.sum(), old_probs / old_probs.sum()
        chi2 = chi_square(probs, old_probs)
        assert ratio_variance(probs, old_probs) == pytest.approx(chi2, rel=1e-12)
        kl = float(probs @ (probs / old_probs).log())
        assert chi2 >= math.expm1(kl) > 0  # KL <= log(1 + chi^2)
    # near pi_old, chi^2 is twice the KL to second order
    near = old_probs * (1 + 1e-3 * torch.linspace(-1, 1, 7, dtype=F64))
    near = near / near.sum()
    kl = float(near @ (near / old_probs).log())
    assert chi_square(near, old_probs) == pytest.approx(2 * kl, rel=2e-3)


def test_estimate_variance_is_the_trace_of_the_covariance():
    policy, old_logits, logits, _, advantages = _moved(3, 2)
    probs, old_probs = policy.probs(logits), policy.probs(old_logits)
    scores = policy.scores(logits, policy.all_sequences())
    samples = (probs / old_probs * advantages)[:, None] * scores
    mean = old_probs @ samples
    by_definition = float(old_probs @ (samples - mean).square().sum(dim=1))
    assert estimate_variance(probs, old_probs, advantages, scores) == pytest.approx(
        by_definition, rel=1e-12
    )
    target = policy_gradient(policy, logits, advantages)
    torch.testing.assert_close(mean, target, atol=1e-14, rtol=0)
    on_policy = float(probs @ (advantages[:, None] * scores - mean).square().sum(dim=1))
    assert estimate_variance(probs, probs, advantages, scores) == pytest.approx(
        on_policy, rel=1e-12
    )


def test_importance_table_along_the_uphill_path():
    policy, old_logits, rewards = sum_mod_setup(vocab_size=2, length=3, seed=0)
    distances = [0.0, 0.5, 2.0]
    table = importance_table(policy, old_logits, rewards, distances)
    assert list(table.index) == distances
    start = table.loc[0.0]
    assert start["KL(π_θ ‖ π_old)"] == 0 and abs(start["Var_old[ρ] = χ²"]) < 1e-15
    for column in ("error, sequence ratio", "error, no ratio", "error, token ratios"):
        assert start[column] < 1e-13, column
    assert start["variance / on-policy"] == pytest.approx(1.0, abs=1e-12)
    assert (table["error, sequence ratio"] < 1e-13).all()  # the identity, at every distance
    assert table["KL(π_θ ‖ π_old)"].is_monotonic_increasing
    assert table["Var_old[ρ] = χ²"].is_monotonic_increasing
    far = table.loc[2.0]
    assert far["error, no ratio"] > 0.5 and far["error, token ratios"] > 0.2
    assert far["variance / on-policy"] > 1.2
    # the row's policy is old_logits + d u, u along grad J: uphill, and its KL is the exact one
    uphill = policy.exact_gradient(old_logits, rewards)
    logits = old_logits + 2.0 * (uphill / uphill.norm()).view(policy.logits_shape)
    assert far["KL(π_θ ‖ π_old)"] == kl_divergence(policy, logits, old_logits)
    assert policy.objective(logits, rewards) > policy.objective(old_logits, rewards)
    records = importance_records(table)
    assert records == {
        "is_identity_error": table["error, sequence ratio"].max(),
        "is_distance_largest": 2.0,
        "is_kl_largest": far["KL(π_θ ‖ π_old)"],
        "is_ratio_variance_largest": far["Var_old[ρ] = χ²"],
        "is_no_ratio_error_largest": far["error, no ratio"],
        "is_token_ratio_error_largest": far["error, token ratios"],
        "is_variance_factor_largest": far["variance / on-policy"],
    }


CASE_RATIOS = [1.1, 1.5, 0.9, 0.6, 0.6, 1.3]  # the chapter's: one token in each case
CASE_ADVANTAGES = [1.0, 1.0, -1.0, -1.0, 1.0, -1.0]


def test_clip_cases_by_hand():
    cases = clip_cases(CASE_RATIOS, CASE_ADVANTAGES, 0.2)
    assert cases["flat"].tolist() == [False, True, False, True, False, False]
    assert cases["objective"].tolist() == pytest.approx([1.1, 1.2, -0.9, -0.8, 0.6, -1.3])
    gradient = cases["d objective / d log π"].tolist()
    assert gradient == pytest.approx([1.1, 0.0, -0.9, 0.0, 0.6, -1.3], abs=1e-15)
    assert gradient[1] == gradient[3] == 0.0  # exactly zero where the objective is flat
    assert clip_case_records(cases, 0.2) == {
        "clip_case_flat_tokens": 2,
        "clip_case_gradient_error": pytest.approx(0.0, abs=1e-15),
        "clip_case_objective_error": pytest.approx(0.0, abs=1e-15),
    }
    with pytest.raises(ValueError, match="average to 1"):
        clip_cases([1.1, 1.5], [1.0, -1.0], 0.2)


@pytest.mark.parametrize("epsilon", [0.1, 0.2, 0.28])
def test_the_clip_gradient_is_zero_exactly_where_the_case_analysis_says(epsilon):
    """On a grid of ratios and advantages of both signs, autograd on `losses.clipped_surrogate`
    against the case analysis: d objective / d log pi is 0 for A > 0 above 1 + epsilon and for
    A < 0 below 1 - epsilon, and rho A everywhere else."""
    ratios = torch.linspace(0.3, 2.0, 171, dtype=F64)
    ratios = ratios[((ratios - 1).abs() - epsilon).abs() > 1e-9]  # off the kinks
    for advantage in (1.0, 0.5, -0.5, -1.0):
        log_probs = ratios.log()[None].clone().requires_grad_(True)
        loss, clipped = clipped_surrogate(
            log_probs, torch.zeros_like(log_probs), torch.tensor([advantage], dtype=F64),
            epsilon=epsilon,
        )  # fmt: skip
        (gradient,) = torch.autograd.grad(-loss.sum(), log_probs)
        flat = ratios > 1 + epsilon if advantage > 0 else ratios < 1 - epsilon
        assert clipped[0].tolist() == flat.tolist()
        assert (gradient[0][flat] == 0).all()
        slope = ratios[~flat] * advantage
        torch.testing.assert_close(gradient[0][~flat], slope, rtol=0, atol=1e-15)


def test_the_whole_clipped_surrogate_keeps_only_the_unclipped_tokens():
    """The gradient in the softmax's logits of E_old[min(rho A, clip(rho) A)], written with plain
    torch operations and differentiated by autograd, against the case analysis: the sum over the
    tokens that are not flat of pi_old(a) rho_a A_a (e_a - pi)."""
    epsilon, size = 0.2, len(CASE_RATIOS)
    old_probs = torch.full((size,), 1 / size, dtype=F64)
    ratios = torch.tensor(CASE_RATIOS, dtype=F64)
    advantages = torch.tensor(CASE_ADVANTAGES, dtype=F64)
    logits = (old_probs * ratios).log().requires_grad_(True)
    rho = torch.softmax(logits, dim=0) / old_probs
    objective = old_probs @ torch.minimum(
        rho * advantages, rho.clamp(1 - epsilon, 1 + epsilon) * advantages
    )
    (gradient,) = torch.autograd.grad(objective, logits)
    probs = torch.softmax(logits.detach(), dim=0)
    flat = torch.tensor(clip_cases(CASE_RATIOS, CASE_ADVANTAGES, epsilon)["flat"].tolist())
    weights = torch.where(flat, 0.0, old_probs * ratios * advantages)
    by_cases = weights - weights.sum() * probs  # sum_a w_a (e_a - pi)
    torch.testing.assert_close(gradient, by_cases, rtol=0, atol=1e-15)
