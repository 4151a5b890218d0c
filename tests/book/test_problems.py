"""The pen-and-paper problems of chapters 1 to 6 and 12 ("Problems" sections), checked against the
library: each test computes what the solution states by hand, with the chapter's own functions
where one exists, and asserts the solution's numbers. The problems' structure (a dropdown
solution for each) is checked like the exercises'."""

import math
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo_companion.chapters.credit import toy as credit_toy
from grpo_companion.chapters.grpo_loss.surrogate import (
    chi_square,
    policy_gradient,
    ratio_variance,
    surrogate_gradient,
)
from grpo_companion.chapters.sparsity.rate import iid_degenerate_rate
from grpo_companion.core.advantages import group_advantages, process_advantages
from grpo_companion.core.exact import degenerate_rate_slope, estimator_moments
from grpo_companion.core.kl import kl_penalty
from grpo_companion.core.losses import aggregate, clipped_surrogate
from grpo_companion.core.policy_gradient import (
    SequencePolicy,
    estimator_variance,
    optimal_baseline,
    softmax_policy_gradient,
)
from grpo_companion.core.stats import mean_interval
from grpo_companion.lm.gsm8k import reward
from grpo_companion.machinery.claims import INCONCLUSIVE, NOT_REPRODUCED, judge, load_claims

BOOK = Path(__file__).resolve().parents[2] / "book"
CHAPTERS = [
    "01_policy_gradient",
    "02_group_baseline",
    "03_grpo_loss",
    "04_testbed",
    "05_credit",
    "06_sparsity",
    "12_report",
]
PROBLEM = re.compile(r"^\d+\. ", re.MULTILINE)
SOLUTION = re.compile(r"`{3,}\{admonition\} Solution\n\s*:class: dropdown\n")


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_problems_come_before_the_exercises_each_with_a_dropdown_solution(chapter):
    text = (BOOK / f"{chapter}.md").read_text()
    sections = re.split(r"^## ", text, flags=re.MULTILINE)
    titles = [section.split("\n", 1)[0] for section in sections]
    assert titles[-2:] == ["Problems", "Exercises"], chapter
    problems = PROBLEM.split(sections[-2])[1:]
    assert 2 <= len(problems) <= 5, chapter
    assert all(SOLUTION.search(problem) for problem in problems), chapter
    assert not any("python -m grpo_companion run" in problem for problem in problems), chapter
    # the scaffolding of the page: objectives near the top, a summary before the problems
    assert text.index("```{admonition} Learning objectives") < text.index("\n## ")
    summary = text.index("```{admonition} Summary")
    assert summary < text.index("\n## Problems")
    assert ":class: warning" in text[: text.index("\n## Problems")]


def _two_action_bandit():
    """Problem 1-1: pi = (1/4, 3/4), r = (1, 0), as a sequence policy of one token."""
    policy = SequencePolicy(vocab_size=2, length=1)
    logits = torch.zeros(policy.logits_shape, dtype=torch.float64)
    logits[0, -1, 1] = math.log(3.0)  # the start token's row
    return policy, logits, torch.tensor([1.0, 0.0], dtype=torch.float64)


def test_01_problem_1_the_bandit_gradient():
    policy, logits, rewards = _two_action_bandit()
    assert policy.probs(logits).tolist() == pytest.approx([0.25, 0.75])
    bandit = softmax_policy_gradient(logits[0, -1], rewards)
    assert bandit.tolist() == pytest.approx([3 / 16, -3 / 16], abs=1e-15)
    assert policy.exact_gradient(logits, rewards).view(-1)[-2:].tolist() == pytest.approx(
        [3 / 16, -3 / 16], abs=1e-15
    )


def test_01_problem_2_the_optimal_baseline_removes_all_the_variance():
    policy, logits, rewards = _two_action_bandit()
    b_star = optimal_baseline(policy, logits, rewards)
    assert b_star == pytest.approx(0.75, abs=1e-12)
    variances = estimator_variance(policy, logits, rewards, [0.0, 0.25, b_star]).tolist()
    assert variances == pytest.approx([27 / 128, 3 / 32, 0.0], abs=1e-12)
    squared_norms = policy.scores(logits, policy.all_sequences()).square().sum(dim=1)
    assert float(policy.probs(logits) @ squared_norms) == pytest.approx(3 / 8)
    # exercise 3's identity on the two numbers
    assert Fraction(3, 32) == Fraction(3, 8) * (Fraction(3, 4) - Fraction(1, 4)) ** 2


def test_02_problem_1_three_methods_on_one_group_of_three():
    rewards = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    expected = {
        "dr_grpo": [2 / 3, -1 / 3, -1 / 3],
        "grpo": [2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)],
        "rloo": [1.0, -0.5, -0.5],
    }
    for method, values in expected.items():
        advantages = group_advantages(rewards, method, eps=0.0)[0].tolist()
        assert advantages == pytest.approx(values, abs=1e-12), method
    assert group_advantages(rewards, "grpo")[0, 0] == pytest.approx(1.155, abs=1e-3)


@pytest.mark.parametrize("group_size", [3, 4, 8, 16])
def test_02_problem_2_the_rarest_success_has_the_largest_advantage(group_size):
    def a_plus(k):
        rewards = torch.zeros(1, group_size, dtype=torch.float64)
        rewards[0, :k] = 1.0
        return float(group_advantages(rewards, "grpo", eps=0.0)[0, 0])

    G = group_size
    values = [a_plus(k) for k in range(1, G)]
    formula = [math.sqrt((G - k) * (G - 1) / (k * G)) for k in range(1, G)]
    assert values == pytest.approx(formula, rel=1e-12)
    assert max(values) == values[0] == pytest.approx((1 - 1 / G) * math.sqrt(G), rel=1e-12)
    if G == 8:
        assert values[0] == pytest.approx(2.475, abs=5e-4)


def test_02_problem_3_dr_grpo_weighs_every_pass_rate_alike():
    for G in (2, 4, 8):
        weights = estimator_moments([0.05, 0.3, 0.5, 0.9], G, "dr_grpo")["weight"]
        assert list(weights) == pytest.approx([1 - 1 / G] * 4, abs=1e-12)


def test_03_problem_1_which_tokens_the_clip_stops():
    # (advantage, ratio) -> (objective, derivative in rho), the solution's four cases
    cases = {(1.0, 0.9): (0.9, 1.0), (1.0, 1.3): (1.2, 0.0), (-1.0, 0.7): (-0.8, 0.0),
             (-1.0, 1.3): (-1.3, -1.0)}  # fmt: skip
    for (advantage, ratio), (objective, derivative) in cases.items():
        rho = torch.tensor([[ratio]], dtype=torch.float64, requires_grad=True)
        loss, _ = clipped_surrogate(
            rho.log(), torch.zeros(1, 1, dtype=torch.float64), torch.tensor([advantage]),
            epsilon=0.2,
        )  # fmt: skip
        (gradient,) = torch.autograd.grad(loss.sum(), rho)
        assert -loss.item() == pytest.approx(objective, abs=1e-12)
        assert -float(gradient) == pytest.approx(derivative, abs=1e-12)


def test_03_problem_2_three_estimators_on_two_tokens():
    policy = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    reference = torch.tensor([[0.25, 0.75]], dtype=torch.float64)
    estimates = {k: kl_penalty(policy.log(), reference.log(), k)[0] for k in ("k1", "k2", "k3")}
    assert float(estimates["k1"][0]) == pytest.approx(0.693, abs=5e-4)
    assert float(estimates["k2"][0]) == pytest.approx(0.240, abs=5e-4)
    assert float(estimates["k3"][0]) == pytest.approx(0.193, abs=5e-4)
    assert float(estimates["k1"][1]) == pytest.approx(-0.405, abs=5e-4)
    assert float(estimates["k3"][1]) == pytest.approx(0.095, abs=5e-4)
    kl = float((policy * (policy / reference).log()).sum())
    assert kl == pytest.approx(0.144, abs=5e-4)
    for k in ("k1", "k3"):
        assert float((policy * estimates[k]).sum()) == pytest.approx(kl, abs=1e-12)


def test_03_problem_3_token_weights_and_first_step_losses():
    mask = torch.zeros(2, 8, dtype=torch.float64)
    mask[0, :2], mask[1, :6] = 1.0, 1.0
    per_token = -torch.tensor([[1.0], [-1.0]], dtype=torch.float64) * mask  # -A at rho = 1
    expected = {"grpo": ([1 / 4, 1 / 12], 0.0), "dr_grpo": ([1 / 16] * 2, 0.25),
                "dapo": ([1 / 8] * 2, 0.5)}  # fmt: skip
    for loss_type, (weights, value) in expected.items():
        leaf = per_token.clone().requires_grad_(True)
        loss = aggregate(leaf, mask, loss_type, max_completion_length=8)
        (gradient,) = torch.autograd.grad(loss, leaf)
        assert loss.item() == pytest.approx(value, abs=1e-12), loss_type
        assert [float(gradient[0, 0]), float(gradient[1, 0])] == pytest.approx(weights), loss_type


def test_03_problem_4_the_importance_sampling_identity_on_two_tokens():
    # pi_old = (1/2, 1/2), pi = (3/4, 1/4), as one-token sequence policies
    policy = SequencePolicy(vocab_size=2, length=1)
    old_logits = torch.zeros(policy.logits_shape, dtype=torch.float64)
    logits = old_logits.clone()
    logits[0, -1, 0] = math.log(3.0)  # the start token's row
    probs, old_probs = policy.probs(logits), policy.probs(old_logits)
    assert probs.tolist() == pytest.approx([0.75, 0.25]) and old_probs.tolist() == [0.5, 0.5]
    ratios = probs / old_probs
    assert ratios.tolist() == pytest.approx([1.5, 0.5])
    assert float(old_probs @ ratios) == pytest.approx(1.0, abs=1e-15)
    assert ratio_variance(probs, old_probs) == pytest.approx(0.25, abs=1e-15)
    assert chi_square(probs, old_probs) == pytest.approx(0.25, abs=1e-15)
    kl = float(probs @ ratios.log())
    assert kl == pytest.approx(0.131, abs=5e-4)
    # (a): the gradient of E_old[rho A] is E_pi[A grad log pi], for any fixed advantages
    advantages = torch.tensor([1.0, -2.0], dtype=torch.float64)
    torch.testing.assert_close(
        surrogate_gradient(policy, logits, old_logits, advantages),
        policy_gradient(policy, logits, advantages),
        rtol=0,
        atol=1e-15,
    )


def test_03_problem_5_the_clipped_gradient_outside_the_range():
    # (rho, A) -> (objective, weight omega on A grad log pi): the solution's three tokens
    cases = {(1.5, 1.0): (1.2, 0.0), (0.5, 1.0): (0.5, 0.5), (1.5, -1.0): (-1.5, 1.5)}
    for (ratio, advantage), (objective, weight) in cases.items():
        log_prob = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
        loss, _ = clipped_surrogate(
            log_prob, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([advantage]),
            epsilon=0.2,
        )  # fmt: skip
        (gradient,) = torch.autograd.grad(loss.sum(), log_prob)
        assert -loss.item() == pytest.approx(objective, abs=1e-12)
        # d loss / d log pi = -omega A: descent moves log pi by +omega A (times the step)
        assert float(gradient) == pytest.approx(-weight * advantage, abs=1e-12)
    assert float(gradient) == pytest.approx(1.5)  # the third token is pushed down


def test_04_problem_1_strict_and_flexible():
    cases = [("#### 1,024", "1024", 1.0, 1.0), ("I think 12 or 13. #### 13", "12", 0.0, 0.0),
             ("The answer is $12.00", "12", 0.0, 1.0)]  # fmt: skip
    for completion, gold, strict, flexible in cases:
        assert reward(completion, gold) == strict, completion
        assert reward(completion, gold, mode="flexible") == flexible, completion


def test_04_problem_2_mixed_groups_in_a_batch():
    mixed = {G: 1 - float(iid_degenerate_rate([0.1], G)["degenerate"][0]) for G in (4, 8)}
    assert 16 * mixed[8] == pytest.approx(9.1, abs=0.05)
    assert 32 * mixed[4] == pytest.approx(11.0, abs=0.05)
    assert 128 * mixed[8] == pytest.approx(73, abs=0.5)
    assert 128 * mixed[4] == pytest.approx(44, abs=0.5)


def test_04_problem_3_colder_draws_agree_more_often():
    logits = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64).log()
    cold = torch.softmax(logits / 0.5, dim=-1)
    assert cold.tolist() == pytest.approx([0.783, 0.196, 0.022], abs=5e-4)
    agree = {T: float((torch.softmax(logits / T, dim=-1) ** 8).sum()) for T in (1.0, 0.5)}
    assert agree[1.0] == pytest.approx(0.017, abs=5e-4)
    assert agree[0.5] == pytest.approx(0.141, abs=5e-4)
    assert agree[0.5] / agree[1.0] == pytest.approx(8, rel=0.05)


def test_05_problem_1_token_credit_telescopes():
    values = torch.tensor([0.4, 0.5, 0.2, 0.0], dtype=torch.float64)  # the last is r
    credit = values.diff()
    assert credit.tolist() == pytest.approx([0.1, -0.3, -0.2], abs=1e-12)
    assert float(credit.sum()) == pytest.approx(0.0 - 0.4, abs=1e-12)


def test_05_problem_2_process_advantages_by_hand():
    # two completions of 6 tokens; steps end at tokens 1 and 3, the outcome at token 5
    step_rewards = torch.tensor([[[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]], dtype=torch.float64)
    step_ends = torch.tensor([[[1, 3, 5], [1, 3, 5]]])
    advantages = process_advantages(step_rewards, step_ends, torch.ones_like(step_ends), 6, eps=0)
    by_step = advantages[:, [0, 2, 4]]  # a token of step 1, of step 2 and of the answer
    assert by_step.tolist()[0] == pytest.approx([-1.94, -2.58, -1.29], abs=5e-3)
    assert by_step.tolist()[1] == pytest.approx([1.94, 1.29, 0.65], abs=5e-3)
    outcome = group_advantages(step_rewards[:, :, -1], eps=0.0)[0]
    assert outcome.tolist() == pytest.approx([-0.707, 0.707], abs=5e-4)


def test_05_problem_3_the_exact_critic_needs_no_success():
    k, vocab_size = 3, 4
    probs = np.full((k, vocab_size), 1 / vocab_size)
    # token 0 is the right one; right at step 1, wrong at step 2
    group = np.array([[0, 1, 0]] + [[1, 1, 1]] * 7)
    values = credit_toy.chain_values(probs, group)
    assert values[0, 0] == pytest.approx(1 / 64)
    assert np.diff(values[0]).tolist() == pytest.approx([3 / 64, -1 / 16, 0.0])
    token = credit_toy.chain_advantages("token", probs, group)
    assert token[0].tolist() == pytest.approx([3 / 64, -1 / 16, 0.0])
    assert credit_toy.chain_advantages("outcome", probs, group) == pytest.approx(0.0)


def test_06_problem_1_the_jensen_gap_of_two_kinds_of_prompt():
    iid = float(iid_degenerate_rate([0.5], 4)["degenerate"][0])
    mixed = iid_degenerate_rate([0.1, 0.9], 4)["degenerate"].mean()
    assert iid == pytest.approx(0.125) and mixed == pytest.approx(0.6562, abs=1e-12)
    assert mixed - iid == pytest.approx(0.531, abs=5e-4)


def test_06_problem_2_the_sign_of_the_change_of_d():
    slopes = degenerate_rate_slope([0.3, 0.8], 4)
    assert list(slopes) == pytest.approx([-1.264, 2.016], abs=1e-12)
    assert slopes.mean() * 0.05 == pytest.approx(0.019, abs=5e-4)
    assert slopes[0] / 2 * 0.05 == pytest.approx(-0.032, abs=5e-4)
    # the first-order answer has the exact change's sign
    before = iid_degenerate_rate([0.3, 0.8], 4)["degenerate"].mean()
    both = iid_degenerate_rate([0.35, 0.85], 4)["degenerate"].mean()
    first = iid_degenerate_rate([0.35, 0.8], 4)["degenerate"].mean()
    assert both > before > first


def test_06_problem_3_sign_and_dr_grpo_point_the_same_way():
    pass_rates = [0.1, 0.3, 0.5, 0.9]
    assert list(estimator_moments(pass_rates, 4, "sign")["weight"]) == pytest.approx([2.0] * 4)
    assert list(estimator_moments(pass_rates, 4, "dr_grpo")["weight"]) == pytest.approx([0.75] * 4)
    rewards = torch.zeros(1, 4, dtype=torch.float64)
    assert group_advantages(rewards, "sign")[0].tolist() == [-1.0] * 4
    assert group_advantages(rewards, "dr_grpo")[0].tolist() == [0.0] * 4


# Problem 12-1's rule: a regime gate, reproduced when the interval lies above 0, not reproduced
# when it does not and lies wholly below the prediction.
INTERVAL_RULE = """
[[claims]]
id = "problem_12_1"
statement = "An intervention raises held-out accuracy."
sources = []
chapter = "12_report"
figure = "none"
measured = "gain"
prediction = "predicted_gain"
gates = [{ gate = "regime", expression = "in_regime", low = 1 }]
reproduced = [{ expression = "reading(gain_low, gain_high, predicted_gain)", low = 1 }]
contradicted = [{ expression = "reading(gain_low, gain_high, predicted_gain)", high = -1 }]
"""


def test_12_problem_1_an_interval_that_holds_0_can_still_contradict(tmp_path):
    interval = mean_interval([0.01, 0.03, 0.05, 0.07])
    assert interval["mean"] == pytest.approx(0.04)
    assert interval["low"] == pytest.approx(-0.0011, abs=5e-5)
    assert interval["high"] == pytest.approx(0.0811, abs=5e-5)
    assert math.sqrt(0.002 / 3) == pytest.approx(0.02582, abs=5e-6)
    path = tmp_path / "claims.toml"
    path.write_text(INTERVAL_RULE)
    (claim,) = load_claims(path)

    def verdict(predicted, in_regime=1):
        values = {"gain": interval["mean"], "gain_low": interval["low"],
                  "gain_high": interval["high"], "predicted_gain": predicted,
                  "in_regime": in_regime}  # fmt: skip
        return judge(claim, {"values": values, "profile": "cpu"})

    assert verdict(0.10)["verdict"] == NOT_REPRODUCED
    assert verdict(0.05)["verdict"] == INCONCLUSIVE
    assert verdict(0.05)["reason"] == "neither reproduced nor contradicted"
    gated = verdict(0.10, in_regime=0)
    assert gated["verdict"] == INCONCLUSIVE and "gate regime" in gated["reason"]


def test_12_problem_2_a_reference_arm_that_did_not_learn_gates_the_contradiction():
    (claim,) = [c for c in load_claims(BOOK / "claims.toml") if c.id == "R_sign_beats_dr_grpo"]
    values = {"comparator_is_dr_grpo": 1, "sign_same_loss": 1, "reference_all_correct_share": 0.5,
              "dr_grpo_lr_inside": 1, "sign_lr_inside": 1, "dr_grpo_tune_learned": 1,
              "dr_grpo_accuracy_gain_low": -0.02, "sign_minus_dr_grpo": -0.025,
              "sign_minus_dr_grpo_low": -0.04, "sign_minus_dr_grpo_high": -0.01,
              "predicted_sign_minus_dr_grpo": 0.05}  # fmt: skip
    gated = judge(claim, {"values": values, "profile": "gpu"})  # a gpu-profile row
    assert gated["verdict"] == INCONCLUSIVE and "gate learned" in gated["reason"]
    # the contradicted check alone holds: what the gate keeps from counting
    assert all(row["passed"] for row in gated["checks"]["contradicted"])
    learned_values = values | {"dr_grpo_accuracy_gain_low": 0.01}
    learned = judge(claim, {"values": learned_values, "profile": "gpu"})
    assert learned["verdict"] == NOT_REPRODUCED
