"""Chapter 14's answers (`chapters.questions`) against exact values, brute force and the libraries
themselves: each effect the chapter demonstrates, asserted on the numbers that could be wrong."""

import math

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch

from grpo_companion.chapters.questions import exact, libraries, runs
from grpo_companion.chapters.questions.plots import (
    plot_clip_by_iteration,
    plot_collapse,
    plot_loss_and_kl,
)
from grpo_companion.core.advantages import group_advantages, zero_std_groups
from grpo_companion.core.group_estimators import gradient_weight, group_estimator_moments
from grpo_companion.core.kl import kl_penalty
from grpo_companion.core.policy_gradient import SequencePolicy, reinforce_gradient, sum_mod_reward

G = 8


@pytest.fixture(scope="module")
def setting():
    """The chapter's policy: chapter 1's sequence policy, 2 tokens, 3 steps, its reward table."""
    policy = SequencePolicy(vocab_size=2, length=3)
    theta = policy.init_logits(0, scale=1.5)
    return policy, theta, sum_mod_reward(policy.all_sequences(), 2)


def sampled_batch(policy, theta, rewards, num_groups, seed):
    draws = policy.sample(theta, num_groups * G, torch.Generator().manual_seed(seed))
    group_rewards = rewards[draws].view(num_groups, G)
    return policy.all_sequences()[draws], group_rewards, group_advantages(group_rewards).flatten()


# --- 1. the loss at ratio 1 ----------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
def test_the_loss_is_zero_while_its_gradient_is_the_group_estimator(setting, loss_type):
    policy, theta, rewards = setting
    batch, _, advantages = sampled_batch(policy, theta, rewards, 64, 0)
    value, gradient = exact.surrogate_at_ratio_one(policy, theta, batch, advantages, loss_type)
    group_estimate = reinforce_gradient(policy.scores(theta, batch), advantages)
    assert abs(value) < 1e-12
    assert gradient.norm() > 0.05
    # Equal lengths: every aggregation divides by B G L (dr_grpo's L_max is the padded length L).
    torch.testing.assert_close(gradient, -group_estimate / policy.length, atol=1e-14, rtol=0)


def test_the_mean_of_the_loss_gradient_is_the_policy_gradient(setting):
    """Dr. GRPO's advantages: E[g] = (1 - 1/G) grad J exactly; GRPO's: a multiple of grad J."""
    policy, theta, rewards = setting
    true = policy.exact_gradient(theta, rewards)
    centred = group_estimator_moments(policy, theta, rewards, G, "dr_grpo")["mean"]
    torch.testing.assert_close(centred, (1 - 1 / G) * true, atol=1e-14, rtol=0)
    grpo_mean = group_estimator_moments(policy, theta, rewards, G, "grpo")["mean"]
    weight, residual = gradient_weight(grpo_mean, true)
    assert weight > 1 and residual < 1e-12


def test_without_kl_the_logged_loss_stays_zero_while_j_rises(setting):
    policy, theta, rewards = setting
    table = runs.train(policy, theta, rewards, runs.SequenceGRPOConfig(max_steps=15), seed=0)
    logged = table.dropna(subset=["loss"])
    assert logged["loss"].abs().max() < 1e-12
    assert (logged["grad_norm"] > 0).mean() > 0.8
    assert table["objective"].iloc[-1] > table["objective"].iloc[0] + 0.2


def test_with_kl_the_loss_is_beta_times_the_logged_kl_and_starts_at_zero(setting):
    policy, theta, rewards = setting
    beta = 0.1
    config = runs.SequenceGRPOConfig(max_steps=15, beta=beta, use_bias_correction_kl=True)
    table = runs.train(policy, theta, rewards, config, seed=0)
    logged = table.dropna(subset=["loss"])
    assert abs(logged["loss"].iloc[0]) < 1e-15 and logged["kl"].iloc[0] == 0.0
    torch.testing.assert_close(
        torch.tensor(logged["loss"].to_numpy()), beta * torch.tensor(logged["kl"].to_numpy()),
        atol=1e-15, rtol=0,
    )  # fmt: skip
    assert logged["loss"].iloc[-5:].mean() > 0.005 and table["exact_kl"].iloc[-1] > 0.2


def test_train_logs_one_row_per_optimizer_step_and_reproduces_from_its_seed(setting):
    policy, theta, rewards = setting
    config = runs.SequenceGRPOConfig(max_steps=3, num_iterations=2)
    table = runs.train(policy, theta, rewards, config, seed=4)
    assert table["global_step"].tolist() == list(range(1, 8))
    assert table["step"].tolist() == [1, 1, 2, 2, 3, 3, 4]
    assert table["loss"].isna().tolist() == [False] * 6 + [True]
    again = runs.train(policy, theta, rewards, config, seed=4)
    pd.testing.assert_frame_equal(table, again)
    exact_entropy = -(policy.probs(theta) * policy.probs(theta).log()).sum()
    assert table["exact_entropy"].iloc[0] == pytest.approx(float(exact_entropy), abs=1e-12)
    assert table["exact_kl"].iloc[0] == 0.0


def test_token_entropies_are_the_entropies_of_the_next_token_distributions(setting):
    policy, theta, _ = setting
    sequences = policy.all_sequences()
    entropies = runs.token_entropies(policy, theta, sequences)
    probs = torch.softmax(theta, dim=-1)
    assert entropies[5, 0] == pytest.approx(float(-(probs[0, 2] * probs[0, 2].log()).sum()))
    previous = int(sequences[5, 1])  # token 2 follows token 1
    assert entropies[5, 2] == pytest.approx(
        float(-(probs[2, previous] * probs[2, previous].log()).sum())
    )


# --- 2. degenerate groups and truncation ---------------------------------------------------


def test_degenerate_groups_give_exactly_zero_gradient(setting):
    policy, theta, rewards = setting
    batch, group_rewards, advantages = sampled_batch(policy, theta, rewards, 512, 1)
    degenerate = zero_std_groups(group_rewards).repeat_interleave(G)
    assert 0 < degenerate.sum() < len(degenerate)
    _, gradient = exact.surrogate_at_ratio_one(
        policy, theta, batch[degenerate], advantages[degenerate]
    )
    assert gradient.abs().max() == 0.0
    cut = group_advantages(torch.zeros_like(group_rewards)).flatten()
    assert exact.surrogate_at_ratio_one(policy, theta, batch, cut)[1].abs().max() == 0.0
    assert zero_std_groups(torch.zeros_like(group_rewards)).all()


@pytest.mark.parametrize("truncated_fraction", [0.0, 0.3, 0.9, 1.0])
def test_truncated_degenerate_rate_against_the_binomial_sum(truncated_fraction):
    """Each completion right with probability p (1 - c): sum over the number right k of the
    binomial probability of k = 0 or k = G."""
    pass_rate, group_size = 0.6, 5
    seen = pass_rate * (1 - truncated_fraction)
    binomial = [
        math.comb(group_size, k) * seen**k * (1 - seen) ** (group_size - k) for k in range(6)
    ]
    rate = exact.truncated_degenerate_rate(pass_rate, truncated_fraction, group_size)
    assert rate == pytest.approx(binomial[0] + binomial[-1], abs=1e-15)
    if truncated_fraction == 1.0:
        assert rate == 1.0


def test_truncated_degenerate_rate_refuses_bad_input():
    with pytest.raises(ValueError, match="G >= 2"):
        exact.truncated_degenerate_rate(0.5, 0.1, 1)
    with pytest.raises(ValueError):
        exact.truncated_degenerate_rate(1.5, 0.1, 4)


def test_simulated_zero_std_fraction_matches_the_exact_rate(setting):
    policy, theta, rewards = setting
    pass_rate = float(policy.objective(theta, rewards))
    for c, seed in ((0.0, 0), (0.9, 1)):
        num_groups = 20_000
        rate = exact.truncated_degenerate_rate(pass_rate, c, G)
        simulated = exact.simulated_zero_std_fraction(
            policy, theta, rewards, G, num_groups, c, torch.Generator().manual_seed(seed)
        )
        assert abs(simulated - rate) < 4 * math.sqrt(rate * (1 - rate) / num_groups)
    ones = exact.simulated_zero_std_fraction(
        policy, theta, rewards, G, 100, 1.0, torch.Generator().manual_seed(0)
    )
    assert ones == 1.0


# --- 3. clipping acts only from the second inner iteration ----------------------------------


def test_the_clip_ratio_is_zero_at_the_first_iteration_and_not_after(setting):
    policy, theta, rewards = setting
    config = runs.SequenceGRPOConfig(learning_rate=5.0, num_iterations=6)
    _, rows = runs.grpo_update(
        policy, theta, theta, rewards, config, torch.Generator().manual_seed(2)
    )
    rows = pd.DataFrame(rows)
    assert rows["clip_ratio"].iloc[0] == 0.0 and rows["max_ratio_deviation"].iloc[0] == 0.0
    assert (rows["clip_ratio"].iloc[1:] > 0).all()
    assert (rows["max_ratio_deviation"].iloc[1:] > config.epsilon).all()
    # the batch's statistics are those of one draw, shared by every inner iteration
    assert rows["reward"].nunique() == 1 and rows["objective"].iloc[0] == pytest.approx(
        float(policy.objective(theta, rewards))
    )


# --- 4. TRL's batch arithmetic, read from TRL -----------------------------------------------


def test_trl_batch_layout_is_trls_own():
    from trl import GRPOConfig

    defaults = libraries.trl_defaults()
    assert defaults == {name: GRPOConfig.__dataclass_fields__[name].default for name in defaults}
    assert defaults["loss_type"] == "dapo" and defaults["use_bias_correction_kl"] is True
    assert libraries.trl_batch_layout(16, 8) == {
        "generation_batch_size": 16, "steps_per_generation": 1, "prompts_per_generation": 2,
    }  # fmt: skip
    assert libraries.trl_batch_layout(12, 8) == {
        "error": "generation_batch_size (12) must be divisible by num_generations (8)."
    }
    assert libraries.trl_batch_layout(12, 8, 2)["prompts_per_generation"] == 3
    assert libraries.trl_batch_layout(4, 8, 2) == {
        "generation_batch_size": 8, "steps_per_generation": 2, "prompts_per_generation": 1,
    }  # fmt: skip
    assert "at least 2 generations" in libraries.trl_batch_layout(4, 1)["error"]


# --- 5. where the KL goes -----------------------------------------------------------------


def test_kl_placements_against_their_exact_mean_gradients(setting):
    policy, theta, _ = setting
    logits = theta + policy.init_logits(3)
    gradients = exact.kl_placement_gradients(policy, logits, theta, G)
    target = gradients["grad KL(pi || ref)"]
    assert gradients["k1_loss"].abs().max() < 1e-15  # E[grad log pi] = 0
    torch.testing.assert_close(gradients["k1_reward"], target, atol=1e-14, rtol=0)
    torch.testing.assert_close(gradients["k1_reward_rloo"], target, atol=1e-14, rtol=0)
    torch.testing.assert_close(
        gradients["k1_reward_group_mean"], (1 - 1 / G) * target, atol=1e-14, rtol=0
    )
    torch.testing.assert_close(gradients["ratio_k3_loss"], gradients["k2_loss"], atol=1e-14, rtol=0)
    table = exact.kl_placement_table(gradients)
    assert table.loc["k3_loss", "off-direction part"] > 0.05
    assert table.loc["k1_reward_group_mean", "w"] == pytest.approx(1 - 1 / G, abs=1e-12)


def test_in_loss_mean_gradient_by_brute_force(setting):
    """sum_y pi(y) grad sum_t k3_t(y), each sequence differentiated on its own."""
    policy, theta, _ = setting
    logits = theta + 0.5 * policy.init_logits(7)
    sequences = policy.all_sequences()
    total = torch.zeros(logits.numel(), dtype=torch.float64)
    probs = policy.probs(logits).detach()
    for y in range(len(sequences)):
        leaf = logits.clone().requires_grad_(True)
        row = sequences[y : y + 1]
        kl = kl_penalty(policy.token_log_probs(leaf, row), policy.token_log_probs(theta, row), "k3")
        total += probs[y] * torch.autograd.grad(kl.sum(), leaf)[0].flatten()
    torch.testing.assert_close(
        exact.expected_in_loss_gradient(policy, logits, theta, "k3", False), total,
        atol=1e-14, rtol=0,
    )  # fmt: skip


# --- 6. collapse --------------------------------------------------------------------------


def test_collapse_point_finds_the_first_fall_or_non_finite_step():
    table = pd.DataFrame({"global_step": [1, 2, 3, 4], "objective": [0.5, 0.9, 0.2, 0.1]})
    assert runs.collapse_point(table, 0.5) == 2
    assert runs.collapse_point(table, 0.8) is None
    table.loc[3, "objective"] = float("nan")
    assert runs.collapse_point(table, 0.8) == 3


def _collapse_arms(learning_rate: float) -> dict:
    """The three arms of section 6 at `learning_rate`, 40 steps, beta = 0.1: k3, ratio x k3 and
    no KL."""
    base = dict(learning_rate=learning_rate, max_steps=40, beta=0.1)
    return {
        "k3": runs.SequenceGRPOConfig(**base),
        "ratio x k3": runs.SequenceGRPOConfig(**base, use_bias_correction_kl=True),
        "beta = 0": runs.SequenceGRPOConfig(**{**base, "beta": 0.0}),
    }


def test_k3_collapses_where_the_ratio_corrected_kl_does_not(setting):
    """The chapter's settings: a step of 30 with beta = 0.1; seeds 0 to 3."""
    policy, theta, rewards = setting
    sweep = runs.collapse_sweep(policy, theta, rewards, _collapse_arms(30.0), [0, 1, 2, 3], 0.5)
    counts = sweep.groupby("arm", sort=False)["collapsed"].sum().to_dict()
    assert counts == {"k3": 2, "ratio x k3": 0, "beta = 0": 0}
    records = runs.collapse_records(sweep, {"k3": "k3", "ratio x k3": "ratio", "beta = 0": "zero"})
    assert records["collapsed_k3"] == 2 and records["collapsed_ratio"] == 0
    assert records["collapse_kl_spike"] > 5 and records["collapse_grad_norm_spike"] > 5
    at_collapse = sweep[sweep["collapsed"]]["grad_norm_at_collapse"]
    assert records["collapse_grad_norm"] == pytest.approx(float(at_collapse.median()))
    assert records["peak_kl_ratio"] > records["peak_kl_k3"]  # the value spikes without a collapse


def test_exercise_1_no_run_collapses_at_two_thirds_of_the_step(setting):
    policy, theta, rewards = setting
    sweep = runs.collapse_sweep(policy, theta, rewards, _collapse_arms(20.0), list(range(12)), 0.5)
    assert not sweep["collapsed"].any()


# --- 7. token weights ---------------------------------------------------------------------


def test_token_weights_of_each_loss_type():
    lengths = torch.tensor([100, 100, 400, 400])
    max_length = 512
    weights = {
        t: exact.token_weights(lengths, t, max_length, 2)
        for t in ("grpo", "bnpo", "dr_grpo", "dapo")
    }
    torch.testing.assert_close(weights["grpo"], 1 / (4 * lengths.double()))
    torch.testing.assert_close(
        weights["dr_grpo"], torch.full((4,), 1 / (4 * max_length), dtype=torch.float64)
    )
    torch.testing.assert_close(weights["dapo"], torch.full((4,), 1 / 1000, dtype=torch.float64))
    # TRL's bnpo: each micro-batch over its own tokens, the two averaged
    torch.testing.assert_close(
        weights["bnpo"], torch.tensor([1 / 400, 1 / 400, 1 / 1600, 1 / 1600], dtype=torch.float64)
    )
    mixed = exact.token_weights(torch.tensor([100, 400, 100, 400]), "bnpo", max_length, 2)
    torch.testing.assert_close(mixed, torch.full((4,), 1 / 1000, dtype=torch.float64))


# --- 8. entropy -----------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [0.5, 1.5, 3.0])
def test_entropy_change_is_minus_the_covariance(setting, scale):
    policy, _, rewards = setting
    logits = policy.init_logits(5, scale=scale)
    for direction in (policy.exact_gradient(logits, rewards), policy.init_logits(6).flatten()):
        change = exact.entropy_change(policy, logits, direction)
        assert change["covariance"] == pytest.approx(change["gradient"], abs=1e-13)
        assert change["covariance"] == pytest.approx(change["finite difference"], abs=1e-8)


def test_entropy_falls_along_the_policy_gradient_once_the_policy_prefers_right_answers(setting):
    policy, theta, rewards = setting
    trained = runs.train(policy, theta, rewards, runs.SequenceGRPOConfig(max_steps=20), 0)
    logits = trained.attrs["final_logits"]
    assert float(policy.objective(logits, rewards)) > 0.85
    grad_j = policy.exact_gradient(logits, rewards)
    assert exact.entropy_change(policy, logits, grad_j)["covariance"] < 0
    grad_h = exact.sequence_entropy_gradient(policy, logits)
    coefficient = -(grad_h @ grad_j) / (grad_h @ grad_h)
    assert coefficient > 0
    balanced = exact.entropy_change(policy, logits, grad_j + coefficient * grad_h)
    assert abs(balanced["covariance"]) < 1e-15


def test_softmax_bandit_entropy_rate_is_minus_the_covariance_of_log_probs_and_logit_changes():
    """Exercise 3: length 1, d = the exact gradient pi_a (r_a - J)."""
    policy = SequencePolicy(vocab_size=4, length=1)
    logits = policy.init_logits(2)
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    direction = policy.exact_gradient(logits, rewards)
    probs = policy.probs(logits)
    logit_change = direction.view(policy.logits_shape)[0, policy.vocab_size]  # the BOS row
    torch.testing.assert_close(logit_change, probs * (rewards - probs @ rewards))
    covariance = probs @ (probs.log() * logit_change) - (probs @ probs.log()) * (
        probs @ logit_change
    )
    assert exact.entropy_change(policy, logits, direction)["covariance"] == pytest.approx(
        float(-covariance), abs=1e-14
    )


# --- 9 and 10. the mismatch cap and LoRA's first step --------------------------------------


def test_sequence_ratio_cap_length():
    length = exact.sequence_ratio_cap_length(0.01, 3.0)
    assert math.exp(0.01 * length) == pytest.approx(3.0)
    with pytest.raises(ValueError):
        exact.sequence_ratio_cap_length(0.0, 3.0)


@pytest.mark.parametrize(("width", "rank"), [(512, 1), (512, 16), (1024, 4)])
def test_loras_first_adam_step_against_the_closed_form(width, rank):
    full = libraries.first_adam_step_norm(width, width, 1e-3, 0)
    # every entry moves by the rate, but those whose gradient is not large against AdamW's eps
    assert full == pytest.approx(1e-3 * width, rel=2e-3)
    lora = libraries.first_adam_step_norm(width, width, 1e-3, 0, rank, 32.0)
    assert lora / full == pytest.approx(libraries.lora_first_step_ratio(width, rank, 32.0), rel=0.1)


# --- figures -------------------------------------------------------------------------------


def test_the_figures_draw(setting):
    policy, theta, rewards = setting
    tables = {
        "a": runs.train(policy, theta, rewards, runs.SequenceGRPOConfig(max_steps=2), 0),
        "b": runs.train(policy, theta, rewards, runs.SequenceGRPOConfig(max_steps=2, beta=0.1), 0),
    }
    _, rows = runs.grpo_update(
        policy, theta, theta, rewards, runs.SequenceGRPOConfig(num_iterations=3),
        torch.Generator().manual_seed(0),
    )  # fmt: skip
    for figure in (
        plot_loss_and_kl(tables),
        plot_collapse(tables),
        plot_clip_by_iteration(pd.DataFrame(rows)),
    ):
        assert len(figure.axes) >= 2
        plt.close(figure)
