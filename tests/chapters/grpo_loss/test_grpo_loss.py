"""Chapter 3's experiments on the loss (`chapters.grpo_loss.loss`) against brute force,
closed forms and hand-computed values.

Monte Carlo tolerances: seeds are fixed, so each check is deterministic; every bound is at least
four standard errors of the quantity it checks and was checked not to sit near it.
"""

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
import torch
from conftest import sum_mod_setup

from grpo_companion.chapters.grpo_loss.kl import (
    kl_divergence,
    kl_estimator_moments,
    kl_estimator_table,
    kl_records,
    sequence_kl,
    sequence_kl_estimates,
)
from grpo_companion.chapters.grpo_loss.kl_gradient import (
    FORWARD,
    KL_GRADIENT_LOSSES,
    REVERSE,
    expected_kl_gradient,
    kl_gradient_records,
    kl_gradient_table,
    kl_gradients,
    token_kls,
)
from grpo_companion.chapters.grpo_loss.loss import (
    COMPARED_LOSS_TYPES,
    POLICY_VARIANTS,
    batch_loss,
    clip_settings,
    clipped_objective,
    clipping_batch_records,
    clipping_histories,
    clipping_records,
    clipping_summary,
    completion_mask,
    first_step_loss,
    length_bias_group,
    optimize_on_batch,
    policy_gradient_weights,
    sample_batches,
    token_weights,
)
from grpo_companion.chapters.grpo_loss.plots import (
    plot_clipped_objective,
    plot_clipping_trajectories,
    plot_kl_estimators,
    plot_token_weights,
)
from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.policy_gradient import SequencePolicy, reinforce_gradient

F64 = torch.float64


def test_kl_estimators_exact_moments():
    policy, ref_logits, _ = sum_mod_setup(vocab_size=3, length=3, seed=0)
    logits = ref_logits + 0.5 * policy.init_logits(seed=1)
    probs = policy.probs(logits)
    by_definition = (probs * (probs / policy.probs(ref_logits)).log()).sum().item()
    kl = kl_divergence(policy, logits, ref_logits)
    assert kl == pytest.approx(by_definition, rel=1e-12)
    moments = kl_estimator_moments(policy, logits, ref_logits)
    assert abs(moments["k1"]["bias"]) < 1e-12 and abs(moments["k3"]["bias"]) < 1e-12
    assert abs(moments["k2"]["bias"]) > 1e-3  # k2 is biased
    # k3 = k1 + (pi_ref / pi - 1) per token; the exact variance matches a sample variance.
    draws = policy.sample(logits, 400_000, torch.Generator().manual_seed(2))
    for estimator in ("k1", "k3"):
        samples = sequence_kl_estimates(
            policy, logits, ref_logits, policy.all_sequences()[draws], estimator
        )
        # k3's tail (pi_ref / pi) is heavy: its sample variance is within ~1.5% here, so 4%.
        assert samples.var().item() == pytest.approx(moments[estimator]["variance"], rel=0.04)
        assert abs(samples.mean().item() - kl) < 5 * math.sqrt(
            moments[estimator]["variance"] / len(draws)
        )


def test_token_weights_closed_forms():
    lengths = torch.tensor([2, 5, 8])
    mask = (torch.arange(10) < lengths[:, None]).to(F64)
    batch = len(lengths)
    torch.testing.assert_close(
        token_weights(mask, "grpo"), mask / (batch * lengths[:, None]), rtol=0, atol=1e-15
    )
    torch.testing.assert_close(
        token_weights(mask, "dr_grpo", max_completion_length=16),
        mask / (batch * 16),
        rtol=0,
        atol=1e-15,
    )
    torch.testing.assert_close(
        token_weights(mask, "dapo"), mask / lengths.sum(), rtol=0, atol=1e-15
    )
    torch.testing.assert_close(
        token_weights(mask, "length_alpha", alpha=0.0),
        token_weights(mask, "grpo"),
        rtol=0,
        atol=1e-15,
    )


def test_first_step_loss_is_zero_but_its_gradient_is_the_group_estimator():
    policy, logits, rewards = sum_mod_setup(vocab_size=2, length=3, seed=0)
    draws = policy.sample(logits, 6 * 4, torch.Generator().manual_seed(0))
    sequences = policy.all_sequences()[draws]
    advantages = group_advantages(rewards[draws].view(6, 4)).flatten()
    leaf = logits.clone().requires_grad_(True)
    loss, stats = batch_loss(policy, leaf, logits, sequences, advantages)
    (gradient,) = torch.autograd.grad(loss, leaf)
    assert abs(loss.item()) < 1e-15 and stats["clip_ratio"] == 0.0
    # grpo's loss_type averages the L tokens of a sequence: the gradient is -1/L times g.
    estimator = reinforce_gradient(policy.scores(logits, sequences), advantages)
    torch.testing.assert_close(gradient.flatten(), -estimator / policy.length, rtol=0, atol=1e-15)
    assert gradient.norm().item() > 1e-2


def test_optimize_on_batch_takes_plain_gradient_steps():
    policy, logits, rewards = sum_mod_setup(vocab_size=2, length=3, seed=0)
    draws = policy.sample(logits, 16, torch.Generator().manual_seed(1))
    sequences = policy.all_sequences()[draws]
    advantages = group_advantages(rewards[draws].view(4, 4)).flatten()
    history = optimize_on_batch(
        policy, logits, rewards, sequences, advantages, 2, 0.5, epsilon=math.inf
    )
    assert history["kl"][0] == 0.0 and history["clip_ratio"] == [0.0, 0.0]
    assert history["objective"][0] == pytest.approx(
        policy.objective(logits, rewards).item(), rel=1e-15
    )
    leaf = logits.clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(
        batch_loss(policy, leaf, logits, sequences, advantages)[0], leaf
    )
    assert history["kl"][1] == pytest.approx(
        kl_divergence(policy, logits - 0.5 * gradient, logits), rel=1e-12
    )
    # with a tiny epsilon the second step already clips tokens
    clipped = optimize_on_batch(
        policy, logits, rewards, sequences, advantages, 2, 0.5, epsilon=1e-3
    )
    assert clipped["clip_ratio"][1] > 0
    assert np.isfinite(clipped["kl"]).all()


def test_first_step_loss_is_batch_loss_and_its_gradient():
    policy, logits, rewards = sum_mod_setup(vocab_size=2, length=3, seed=0)
    draws = policy.sample(logits, 5 * 4, torch.Generator().manual_seed(4))
    sequences = policy.all_sequences()[draws]
    advantages = group_advantages(rewards[draws].view(5, 4)).flatten()
    loss, gradient = first_step_loss(policy, logits, sequences, advantages)
    assert abs(loss) < 1e-15 and gradient.shape == (logits.numel(),)
    estimator = reinforce_gradient(policy.scores(logits, sequences), advantages)
    torch.testing.assert_close(gradient, -estimator / policy.length, rtol=0, atol=1e-15)


def test_clipped_objective_by_hand():
    ratios = torch.tensor([0.5, 0.9, 1.0, 1.1, 1.5], dtype=F64)
    objective, is_clipped = clipped_objective(ratios, 1.0, 0.2)
    # A > 0: min(rho, clip(rho)) is rho below 1 + epsilon and 1.2 above it, where it is flat.
    torch.testing.assert_close(objective, torch.tensor([0.5, 0.9, 1.0, 1.1, 1.2], dtype=F64))
    assert is_clipped.tolist() == [False, False, False, False, True]
    objective, is_clipped = clipped_objective(ratios, -1.0, 0.2)
    # A < 0: min(-rho, -clip(rho)) is -0.8 below 1 - epsilon, -rho elsewhere.
    torch.testing.assert_close(objective, torch.tensor([-0.8, -0.9, -1.0, -1.1, -1.5], dtype=F64))
    assert is_clipped.tolist() == [True, False, False, False, False]


def test_sample_batches_draw_in_order_from_one_generator():
    policy, logits, rewards = sum_mod_setup(vocab_size=2, length=3, seed=0)
    batches = sample_batches(policy, logits, rewards, 3, 2, 4, torch.Generator().manual_seed(9))
    generator = torch.Generator().manual_seed(9)
    for sequences, advantages in batches:
        draws = policy.sample(logits, 8, generator)
        assert torch.equal(sequences, policy.all_sequences()[draws])
        expected = group_advantages(rewards[draws].view(2, 4), "grpo").flatten()
        torch.testing.assert_close(advantages, expected, rtol=0, atol=0)
        assert advantages.view(2, 4).sum(dim=1).abs().max() < 1e-12


def test_clip_settings_names():
    settings = clip_settings([0.1, 0.2])
    assert list(settings) == ["epsilon = 0.1", "epsilon = 0.2", "no clipping"]
    assert settings["epsilon = 0.2"] == 0.2 and settings["no clipping"] == math.inf


def test_clipping_histories_run_optimize_on_batch_per_setting():
    policy, logits, rewards = sum_mod_setup(vocab_size=2, length=3, seed=0)
    batches = sample_batches(policy, logits, rewards, 2, 2, 4, torch.Generator().manual_seed(1))
    settings = clip_settings([0.05])
    histories = clipping_histories(policy, logits, rewards, batches, 3, [0.5, 2.0], settings)
    assert list(histories) == [
        (0.5, "epsilon = 0.05"),
        (0.5, "no clipping"),
        (2.0, "epsilon = 0.05"),
        (2.0, "no clipping"),
    ]
    sequences, advantages = batches[1]
    direct = optimize_on_batch(policy, logits, rewards, sequences, advantages, 3, 2.0, epsilon=0.05)
    assert histories[(2.0, "epsilon = 0.05")][1] == direct
    assert histories[(2.0, "no clipping")][0]["clip_ratio"] == [0.0, 0.0, 0.0]


def _history(kl, objective, clip_ratio):
    return {"kl": kl, "objective": objective, "clip_ratio": clip_ratio}


def test_clipping_summary_and_records_by_hand():
    histories = {
        (1.0, "epsilon = 0.2"): [
            _history([0.0, 0.1, 0.2], [0.5, 0.6, 0.7], [0.0, 0.1, 0.3]),
            _history([0.0, 0.3, 0.4], [0.5, 0.4, 0.3], [0.0, 0.2, 0.5]),
        ],
        (1.0, "no clipping"): [
            _history([0.0, 0.5, 1.0], [0.5, 0.9, 0.6], [0.0, 0.0, 0.0]),
            _history([0.0, 0.5, 2.0], [0.5, 0.8, 0.2], [0.0, 0.0, 0.0]),
        ],
    }
    summary = clipping_summary(histories, initial_objective=0.5)
    row = summary.loc[(1.0, "epsilon = 0.2")]
    assert row["mean final KL"] == pytest.approx(0.3)
    assert row["mean final J"] == pytest.approx(0.5)
    assert row["lowest final J"] == pytest.approx(0.3)
    assert row["mean highest J on the way"] == pytest.approx(0.6)  # (0.7 + 0.5) / 2
    assert row["batches ending below the start"] == 0.5
    assert row["clipped tokens at the last step"] == pytest.approx(0.4)
    records = clipping_records(summary, [1.0], 0.2)
    assert records == pytest.approx(
        {
            "final_kl_clipped_lr0": 0.3,
            "final_objective_clipped_lr0": 0.5,
            "below_start_clipped_lr0": 0.5,
            "final_kl_unclipped_lr0": 1.5,
            "final_objective_unclipped_lr0": 0.4,
            "below_start_unclipped_lr0": 0.5,
            "peak_objective_unclipped_lr1": 0.85,
        }
    )
    # batch 0: unclipped 0.6 > clipped 0.7? no; batch 1: 0.2 > 0.3? no.
    assert clipping_batch_records(histories, [1.0], 0.2) == pytest.approx(
        {"unclipped_above_clipped_lr0": 0.0, "clipped_kl_change_second_half_lr0": 0.1}
    )
    histories[(1.0, "no clipping")][1]["objective"][-1] = 0.35
    assert clipping_batch_records(histories, [1.0], 0.2)["unclipped_above_clipped_lr0"] == 0.5


def test_sequence_kl_by_definition_and_differentiable():
    policy, logits, _ = sum_mod_setup(vocab_size=3, length=2, seed=0)
    ref_logits = policy.init_logits(5)
    p, q = policy.probs(logits), policy.probs(ref_logits)
    assert float(sequence_kl(policy, logits, ref_logits)) == pytest.approx(
        float((p * (p / q).log()).sum()), rel=1e-12
    )
    assert kl_divergence(policy, ref_logits, logits) == pytest.approx(
        float((q * (q / p).log()).sum()), rel=1e-12
    )
    leaf = logits.clone().requires_grad_(True)
    sequence_kl(policy, leaf, ref_logits).backward()
    assert leaf.grad.abs().max() > 1e-3


def test_token_kls_by_hand():
    # Step t's KL depends only on the previous token: compare with the softmax rows directly.
    policy, logits, _ = sum_mod_setup(vocab_size=3, length=2, seed=0)
    ref_logits = policy.init_logits(7)
    sequences = policy.all_sequences()
    kls = token_kls(policy, logits, ref_logits, sequences)
    p, q = torch.softmax(logits, -1), torch.softmax(ref_logits, -1)
    row_kl = (p * (p / q).log()).sum(-1)  # (length, vocab_size + 1): BOS is the last context
    assert kls[:, 0] == pytest.approx(torch.full((9,), float(row_kl[0, 3]), dtype=F64), rel=1e-12)
    assert kls[:, 1] == pytest.approx(row_kl[1, sequences[:, 0]], rel=1e-12)


@pytest.mark.parametrize(("vocab_size", "length"), [(3, 1), (2, 3)])
def test_expected_kl_gradients_are_the_per_token_kl_gradients(vocab_size, length):
    policy, ref_logits, _ = sum_mod_setup(vocab_size, length, seed=0)
    logits = ref_logits + 0.7 * policy.init_logits(11)
    targets = kl_gradients(policy, logits, ref_logits)
    gradients = {
        loss: expected_kl_gradient(policy, logits, ref_logits, loss) for loss in KL_GRADIENT_LOSSES
    }
    assert gradients["k1"].abs().max() < 1e-14
    for loss, (*_, kl) in KL_GRADIENT_LOSSES.items():
        if kl is not None:
            assert gradients[loss] == pytest.approx(targets[(kl, "per token")], abs=1e-13)
            assert targets[(kl, "per token")].abs().max() > 1e-2
    assert gradients["ratio x k3"] == pytest.approx(gradients["k2"], abs=1e-13)
    # k2's and k3's mean gradients differ: reverse and forward KL.
    assert (gradients["k2"] - gradients["k3"]).abs().max() > 1e-2
    sequence_gap = (targets[(REVERSE, "sequence")] - targets[(REVERSE, "per token")]).norm()
    if length == 1:  # one token: the per-token KL is the sequence KL
        for kl in (REVERSE, FORWARD):
            assert targets[(kl, "sequence")] == pytest.approx(targets[(kl, "per token")], abs=1e-13)
    else:  # later tokens' KL depends on earlier tokens: the per-token gradient misses it
        assert sequence_gap > 1e-3


def test_expected_kl_gradient_by_hand_on_one_token():
    # One token, vocab 2: pi = softmax(z), ref = softmax(0). k3's mean gradient in z is
    # sum_a pi_a (1 - r_a / pi_a) (e_a - pi) = -(r - pi) = pi - r, the forward KL's.
    policy = SequencePolicy(vocab_size=2, length=1)
    logits = torch.tensor([[[0.0, 0.0], [0.0, 0.0], [0.4, -0.8]]], dtype=F64)
    ref_logits = torch.zeros_like(logits)
    pi, ref = torch.softmax(logits[0, 2], -1), torch.tensor([0.5, 0.5], dtype=F64)
    gradient = expected_kl_gradient(policy, logits, ref_logits, "k3").view(logits.shape)
    assert gradient[0, 2] == pytest.approx(pi - ref, abs=1e-15)
    assert gradient[0, :2].abs().max() == 0.0  # rows of contexts that never occur
    # k2: sum_a pi_a x_a (e_a - pi), x = log(pi / ref).
    x = (pi / ref).log()
    k2 = expected_kl_gradient(policy, logits, ref_logits, "k2").view(logits.shape)[0, 2]
    assert k2 == pytest.approx(pi * x - pi * (pi @ x), abs=1e-15)


def test_kl_gradient_table_and_records():
    policy, ref_logits, _ = sum_mod_setup(vocab_size=2, length=3, seed=0)
    direction = policy.init_logits(2)
    table, forward_reverse = kl_gradient_table(policy, ref_logits, direction, [0.1, 2.0])
    assert list(table.index) == list(KL_GRADIENT_LOSSES)
    assert table["max error"].max() < 1e-13
    assert table.loc["k2", "max"] == pytest.approx(table.loc["ratio x k3", "max"], abs=1e-12)
    # On three tokens the per-token gradients are not the sequence KLs'.
    assert table.loc["k2", "relative gap to the sequence KL's, min"] > 1e-3
    assert table.loc["k3", "relative gap to the sequence KL's, min"] > 1e-2
    # k1's mean gradient is 0: its gap to the gradient of KL(pi || ref) is the whole of it.
    assert table.loc["k1", "relative gap to the sequence KL's, min"] == pytest.approx(1, abs=1e-12)
    assert table.loc["k1", "max"] == pytest.approx(1, abs=1e-12)
    # Near the reference the two KLs' gradients nearly agree; far from it they do not.
    assert forward_reverse[0] < 0.05 < 0.5 < forward_reverse[1]
    logits = ref_logits + 2.0 * direction
    targets = kl_gradients(policy, logits, ref_logits)
    gradient = expected_kl_gradient(policy, logits, ref_logits, "k3")
    sequence = targets[(FORWARD, "sequence")]
    assert table.loc["k3", "max"] >= float((gradient - sequence).norm() / sequence.norm()) - 1e-15
    records = kl_gradient_records(table, forward_reverse)
    assert records["kl_gradient_max_error"] == float(table["max error"].max())
    assert records["kl_gradient_gap_k3_max"] == float(table.loc["k3", "max"])
    assert records["kl_gradient_forward_reverse_largest"] == forward_reverse[1]


def test_kl_estimator_table_is_the_exact_moments_and_a_seeded_monte_carlo_mean():
    policy, ref_logits, _ = sum_mod_setup(vocab_size=2, length=3, seed=0)
    direction = policy.init_logits(seed=7)
    table = kl_estimator_table(
        policy, ref_logits, direction, [0.5, 1.0], 20_000, torch.Generator().manual_seed(3)
    )
    assert table["estimator"].tolist() == ["k1", "k2", "k3"] * 2
    generator = torch.Generator().manual_seed(3)
    for scale, rows in table.groupby("kl_scale", sort=False):
        logits = ref_logits + scale * direction
        kl = kl_divergence(policy, logits, ref_logits)
        moments = kl_estimator_moments(policy, logits, ref_logits)
        samples = policy.all_sequences()[policy.sample(logits, 20_000, generator)]
        for _, row in rows.iterrows():
            estimator = row["estimator"]
            assert row["exact KL"] == kl
            assert row["relative bias"] == pytest.approx(moments[estimator]["bias"] / kl)
            std = math.sqrt(moments[estimator]["variance"])
            assert row["relative std"] == pytest.approx(std / kl)
            mc = sequence_kl_estimates(policy, logits, ref_logits, samples, estimator).mean()
            assert row["Monte Carlo mean"] == pytest.approx(mc.item(), rel=1e-12)
            z = (mc.item() - moments[estimator]["mean"]) / (std / math.sqrt(20_000))
            assert row["MC - exact mean, in standard errors"] == pytest.approx(z, rel=1e-9)
            assert abs(z) < 5
    unbiased = table[table["estimator"] != "k2"]["relative bias"].abs()
    assert unbiased.max() < 1e-12


def test_kl_records_by_hand():
    table = pd.DataFrame(
        {
            "kl_scale": [0.1] * 3 + [1.0] * 3,
            "exact KL": [0.01] * 3 + [0.5] * 3,
            "estimator": ["k1", "k2", "k3"] * 2,
            "relative bias": [1e-14, 0.1, -2e-14, 3e-14, -0.4, 1e-15],
            "relative std": [5.0, 0.6, 0.7, 1.5, 0.9, 4.0],
            "MC - exact mean, in standard errors": [0.5, -2.5, 1.0, 0.1, 0.2, -0.3],
        }
    )
    assert kl_records(table) == {
        "kl_smallest": 0.01,
        "kl_largest": 0.5,
        "k1_relative_std_smallest": 5.0,
        "k1_relative_std_largest": 1.5,
        "k2_relative_std_smallest": 0.6,
        "k2_relative_std_largest": 0.9,
        "k3_relative_std_smallest": 0.7,
        "k3_relative_std_largest": 4.0,
        "k2_relative_bias_smallest": 0.1,
        "k2_relative_bias_largest": -0.4,
        "max_unbiased_relative_bias": 3e-14,
        "kl_max_monte_carlo_z": 2.5,
    }


def test_completion_mask():
    mask = completion_mask(torch.tensor([1, 3]), 4)
    assert mask.dtype == F64
    assert mask.tolist() == [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]]


def test_length_bias_group_by_hand():
    short, long, max_length = 10, 40, 64
    group, losses = length_bias_group(short, long, max_length)
    lengths = np.array([short, long, short, long, long], dtype=float)
    rewards = np.array([1.0, 1.0, 0.0, 0.0, 0.0])
    # TRL's grpo advantage: Bessel-corrected std sqrt(0.3) of two ones and three zeros, eps 1e-4.
    advantages = (rewards - 0.4) / (math.sqrt(0.3) + 1e-4)
    np.testing.assert_allclose(group["advantage"], advantages, rtol=1e-12)
    np.testing.assert_allclose(
        group["push per token, grpo"], advantages / (5 * lengths), rtol=1e-12
    )
    np.testing.assert_allclose(
        group["push per completion, dr_grpo"], advantages * lengths / (5 * max_length), rtol=1e-12
    )
    np.testing.assert_allclose(
        group["push per token, dapo"], advantages / lengths.sum(), rtol=1e-12
    )
    push = group["push per token, grpo"]
    assert push["short, wrong"] / push["long, wrong"] == pytest.approx(long / short, rel=1e-12)
    assert list(losses) == list(COMPARED_LOSS_TYPES)
    assert abs(losses["grpo"]) < 1e-15
    assert losses["dr_grpo"] == pytest.approx(-(lengths @ advantages) / (5 * max_length), rel=1e-12)
    assert losses["dapo"] == pytest.approx(-(lengths @ advantages) / lengths.sum(), rel=1e-12)


def test_figures_draw_the_data_they_are_given():
    ratios = torch.linspace(0.5, 1.5, 11, dtype=F64)
    curves = {advantage: clipped_objective(ratios, advantage, 0.2) for advantage in (1.0, -1.0)}
    fig = plot_clipped_objective(ratios, curves, 0.2)
    np.testing.assert_allclose(fig.axes[1].lines[1].get_ydata(), curves[-1.0][0].numpy())
    plt.close(fig)

    histories = {
        (1.0, name): [_history([0.0, 0.1, 0.3], [0.5, 0.6, 0.7], [0.0] * 3)] * 2
        for name in ("epsilon = 0.2", "no clipping")
    }
    fig = plot_clipping_trajectories(histories, [1.0], ["epsilon = 0.2", "no clipping"], 0.5)
    top = fig.axes[0].lines[0]
    np.testing.assert_allclose(top.get_xdata(), [1, 2])  # step 0 (KL 0) is left off
    np.testing.assert_allclose(top.get_ydata(), [0.1, 0.3])
    plt.close(fig)

    table = pd.DataFrame(
        {
            "exact KL": [0.1, 0.2] * 3,
            "estimator": ["k1", "k1", "k2", "k2", "k3", "k3"],
            "relative bias": [0.0, 0.0, 0.1, 0.2, 0.0, 0.0],
            "relative std": [3.0, 2.0, 0.5, 0.6, 0.4, 0.9],
        }
    )
    fig = plot_kl_estimators(table)
    np.testing.assert_allclose(fig.axes[1].lines[2].get_ydata(), [0.4, 0.9])
    plt.close(fig)

    lengths = torch.tensor([2, 4])
    mask = completion_mask(lengths, 4)
    weights = {loss_type: token_weights(mask, loss_type) for loss_type in COMPARED_LOSS_TYPES}
    fig = plot_token_weights(lengths, weights)
    # grpo: each token 1/(B L_i), each completion 1/B.
    np.testing.assert_allclose(fig.axes[0].lines[0].get_ydata(), [1 / 4, 1 / 8])
    np.testing.assert_allclose(fig.axes[1].lines[0].get_ydata(), [0.5, 0.5])
    plt.close(fig)


def test_policy_gradient_weights_golden():
    """w(rho) of each variant from its definition: the clip passes rho inside (1 - eps, 1 + eps)
    in the direction A asks for and 0 beyond; cispo min(rho, eps_high); delta zeroes A < 0 beyond
    delta; sapo 4 sigma (1 - sigma) rho; every variant 1 at rho = 1."""
    ratios = torch.tensor([0.5, 0.9, 1.0, 1.1, 1.25, 2.0, 4.0], dtype=torch.float64)
    weights = policy_gradient_weights(ratios)
    rho = ratios.numpy()
    clip, higher, two_sided, cispo, sapo, vespo = POLICY_VARIANTS
    up, down = weights["A = +1"], weights["A = -1"]
    np.testing.assert_allclose(up[clip], np.where(rho <= 1.2, rho, 0.0))
    np.testing.assert_allclose(up[higher], np.where(rho <= 1.28, rho, 0.0))
    np.testing.assert_allclose(down[clip], np.where(rho >= 0.8, rho, 0.0))
    np.testing.assert_allclose(down[two_sided], np.where((rho >= 0.8) & (rho <= 3.0), rho, 0.0))
    np.testing.assert_allclose(up[cispo], np.minimum(rho, 5.0))
    np.testing.assert_allclose(down[cispo], np.minimum(rho, 5.0))
    gate = 1 / (1 + np.exp(-(rho - 1)))
    np.testing.assert_allclose(up[sapo], 4 * gate * (1 - gate) * rho, rtol=1e-12)
    assert (weights.loc[1.0] == 1.0).all()
    assert up[vespo].iloc[-1] < 0.01  # vespo's weight vanishes far off-policy
    assert not np.signbit(weights.to_numpy()).any()  # no weight is negative, not even -0.0
