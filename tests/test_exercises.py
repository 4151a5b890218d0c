"""The exercises whose solutions predict what a parameter change does, each checked by calling the
chapter's module functions at small size with the changed parameter (not by running the notebook).

Covered (chapter, exercise): 01-1, 02-1, 03-1, 03-2, 03-3, 05-1, 09-1, 09-3, 10-1, 12-3 (its
solution's ledger entry reads only declared keys). The exercises that need a language model
(04-1, 06-1, 06-3, 07-1, 11-1) and 08-1 and 12-1 are not checked here.
"""

import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo_companion.chapters import credit_exact
from grpo_companion.chapters.advantage_zoo import TwoLengthToy
from grpo_companion.chapters.group_baseline import prompt_weights
from grpo_companion.chapters.group_size import rloo_best_group_size
from grpo_companion.chapters.grpo_loss import (
    batch_loss,
    first_step_loss,
    kl_divergence,
    kl_estimator_moments,
    length_bias_group,
)
from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.exact import best_step_error, beta_quadrature
from grpo_companion.core.policy_gradient import (
    SequencePolicy,
    estimator_variance,
    exact_prefix_values,
    optimal_baseline,
    reinforce_gradient,
    sum_mod_reward,
)
from grpo_companion.machinery.claims import load_claims
from grpo_companion.machinery.declarations import load_declarations, undeclared_references

ROOT = Path(__file__).resolve().parents[1]


def _kl_moments(scale):
    """Chapter 3's section 3 at one distance: relative std and bias of each estimator."""
    policy = SequencePolicy(vocab_size=2, length=3)
    ref_logits = policy.init_logits(0, scale=1.5)
    logits = ref_logits + scale * policy.init_logits(2)
    kl = kl_divergence(policy, logits, ref_logits)
    moments = kl_estimator_moments(policy, logits, ref_logits)
    return {
        estimator: {"std": m["variance"] ** 0.5 / kl, "bias": m["bias"] / kl}
        for estimator, m in moments.items()
    }


def test_01_exercise_1_a_peaked_policy_widens_the_gap_between_b_star_and_the_mean():
    def gap_and_gain(logit_scale):
        policy = SequencePolicy(vocab_size=4, length=3)
        logits = policy.init_logits(0, scale=logit_scale)
        rewards = sum_mod_reward(policy.all_sequences(), 4)
        mean = float(policy.objective(logits, rewards))
        b_star = optimal_baseline(policy, logits, rewards)
        variance_mean = float(estimator_variance(policy, logits, rewards, mean))
        variance_optimal = float(estimator_variance(policy, logits, rewards, b_star))
        return abs(b_star - mean), 1 - variance_optimal / variance_mean

    gap, gain = gap_and_gain(1.5)
    peaked_gap, peaked_gain = gap_and_gain(4.0)
    assert peaked_gap > gap and peaked_gain > gain


def test_02_exercise_1_at_group_size_2_every_weight_is_flat():
    # Section 3's table at group_size 2, on three of its prompts (exact sums over every group).
    policy = SequencePolicy(vocab_size=2, length=3)
    rewards = sum_mod_reward(policy.all_sequences(), 2)
    table = prompt_weights(policy, rewards, 2, 3, seed=0, logit_scale=2.0)
    assert table["w dr_grpo"].to_numpy() == pytest.approx(0.5, abs=1e-9)
    assert table["w rloo"].to_numpy() == pytest.approx(1.0, abs=1e-9)
    # grpo = dr_grpo / (1/sqrt 2 + 1e-4), ~0.707 whatever the pass rate
    assert table["w grpo"].to_numpy() == pytest.approx(0.5 / (2**-0.5 + 1e-4), abs=1e-9)
    assert table["pass rate p"].max() - table["pass rate p"].min() > 0.05


def test_03_exercise_1_far_from_the_reference_k3_spreads_more_and_k2_bias_shrinks():
    page_largest, farther, nearer, page_smallest = (
        _kl_moments(scale) for scale in (2.0, 3.0, 0.05, 0.1)
    )
    assert farther["k3"]["std"] > 2 * farther["k1"]["std"]  # "several times k1's"
    assert abs(farther["k2"]["bias"]) < abs(page_largest["k2"]["bias"])
    assert nearer["k1"]["std"] > page_smallest["k1"]["std"]
    # near the reference k2 and k3 are close to unbiased, with a spread far below k1's
    assert abs(nearer["k2"]["bias"]) < 0.01
    assert max(nearer["k2"]["std"], nearer["k3"]["std"]) < nearer["k1"]["std"] / 10


def test_03_exercise_2_shorter_long_completions():
    group, losses = length_bias_group(50, 100, 512)
    _, page_losses = length_bias_group(50, 400, 512)
    push = group["push per token, grpo"]
    assert push["short, wrong"] / push["long, wrong"] == pytest.approx(2.0)
    assert abs(losses["dr_grpo"]) < abs(page_losses["dr_grpo"])  # towards zero


def test_03_exercise_3_dapo_matches_grpo_at_one_length():
    # Every completion has L tokens: the dapo gradient is grpo's, -g / L.
    policy = SequencePolicy(vocab_size=2, length=3)
    logits = policy.init_logits(0, scale=1.5)
    rewards = sum_mod_reward(policy.all_sequences(), 2)
    draws = policy.sample(logits, 32, torch.Generator().manual_seed(0))
    advantages = group_advantages(rewards[draws].view(8, 4)).flatten()
    sequences = policy.all_sequences()[draws]
    _, grpo_gradient = first_step_loss(policy, logits, sequences, advantages)
    leaf = logits.clone().requires_grad_(True)
    loss, _ = batch_loss(policy, leaf, logits, sequences, advantages, loss_type="dapo")
    (dapo_gradient,) = torch.autograd.grad(loss, leaf)
    g = reinforce_gradient(policy.scores(logits, policy.all_sequences())[draws], advantages)
    assert dapo_gradient.flatten() == pytest.approx(grpo_gradient, abs=1e-14)
    assert grpo_gradient == pytest.approx(-g / 3, abs=1e-14)


def test_05_exercise_1_a_uniform_policy_gives_a_variance_ratio_of_length():
    vocab_size, length = 4, 5
    policy = SequencePolicy(vocab_size, length)
    logits = policy.init_logits(0, scale=0.0)
    sequences = policy.all_sequences()
    rewards = credit_exact.answer_reward(sequences, vocab_size, [1, 3])
    values = exact_prefix_values(policy, logits, rewards)
    outcome = (rewards - values[0, 0])[:, None].expand(-1, length)
    coefficients = {"outcome": outcome, "token": values.diff(dim=1)}
    scores = credit_exact.token_scores(policy, logits, sequences)
    moments = {
        name: credit_exact.exact_moments(
            policy.probs(logits), credit_exact.per_sequence_estimates(c, scores)
        )
        for name, c in coefficients.items()
    }
    exact = policy.exact_gradient(logits, rewards)
    records = credit_exact.compare_estimators(exact, moments)
    assert records["variance_ratio"] == pytest.approx(length, rel=1e-9)


def test_09_exercise_1_without_score_noise_sign_has_the_least_error_at_the_best_step():
    pass_rates, weights = beta_quadrature(1.0, 1.0)
    errors = {
        method: best_step_error(pass_rates, weights, 8, method, score_noise=0.0)["relative_error"]
        for method in ("sign", "rloo", "grpo", "dr_grpo")
    }
    assert min(errors, key=errors.get) == "sign"
    noisy = {
        method: best_step_error(pass_rates, weights, 8, method, score_noise=4.0)["relative_error"]
        for method in ("sign", "rloo")
    }
    assert noisy["sign"] > noisy["rloo"]  # the effect disappears with score noise


def test_09_exercise_3_the_baseline_push_on_long_logit_changes_sign_at_alpha_1():
    toy = TwoLengthToy(4, 16, 0.0, 2.0)
    assert toy.baseline_push(0.0, 0.5)[0] > 0  # towards the long form
    assert toy.baseline_push(2.0, 0.5)[0] < 0
    assert toy.baseline_push(1.0, 0.5) == pytest.approx(np.zeros(2), abs=1e-15)


def test_10_exercise_1_medium_prompts_raise_rloos_best_group_size():
    page = rloo_best_group_size(*beta_quadrature(1.0, 1.0), score_noise=4.0)
    medium = rloo_best_group_size(*beta_quadrature(8.0, 8.0), score_noise=4.0)
    assert medium > page


def test_12_exercise_3_the_solution_entry_loads_and_reads_declared_keys(tmp_path):
    text = (ROOT / "book" / "12_report.md").read_text()
    exercise = text[text.index("3. Chapter 7 records") :]
    entry = re.search(r"```toml\n(.*?)```", exercise, re.DOTALL).group(1)
    entry = "\n".join(line.removeprefix("   ") for line in entry.splitlines())
    path = tmp_path / "claims.toml"
    path.write_text(entry)
    tomllib.loads(entry)
    claims = load_claims(path)
    assert [claim.id for claim in claims] == ["P4_rank_two_smollm2"]
    declarations = load_declarations(ROOT / "book" / "results.toml")
    assert undeclared_references(claims, declarations) == []
    ledger = {claim.id for claim in load_claims(ROOT / "book" / "claims.toml")}
    assert "P4_rank_two_nemotron" in ledger
