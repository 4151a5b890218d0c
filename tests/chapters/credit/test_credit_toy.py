"""Chapter 5, section 6: the exact k-step chain and its three arms."""

import numpy as np
import pytest
import torch

from grpo_companion.chapters.credit.toy import (
    ARMS,
    best_learning_rates,
    chain_advantages,
    chain_values,
    sample_actions,
    score_gradient,
    softmax,
    toy_summary,
    train_chain,
)
from grpo_companion.core.advantages import process_advantages


def test_exact_values_match_monte_carlo():
    """V(s_j) against the success rate of sampled continuations from the prefixes right so far,
    within 4 binomial standard errors of each (a false alarm about once in 16,000 checks)."""
    rng = np.random.default_rng(0)
    probs = softmax(rng.normal(size=(3, 4)) + np.array([1.5, 0.0, 0.0, 0.0]))
    n = 200_000
    actions = sample_actions(probs[None], rng.random((1, n, 3)))[0]
    values = chain_values(probs, actions)
    success = (actions == 0).all(axis=1)
    assert values[0, 0] == pytest.approx(np.prod(probs[:, 0]))
    assert np.array_equal(values[:, -1], success.astype(float))
    for j in range(3):
        alive = (actions[:, :j] == 0).all(axis=1)
        exact = np.prod(probs[j:, 0])
        assert np.allclose(values[alive, j], exact, rtol=1e-12) and (values[~alive, j] == 0).all()
        error = np.sqrt(exact * (1 - exact) / alive.sum())
        assert success[alive].mean() == pytest.approx(exact, abs=4 * error)


def test_sample_actions_has_the_policy_distribution():
    probs = np.array([[[0.1, 0.2, 0.3, 0.4]]])
    actions = sample_actions(probs, np.random.default_rng(1).random((1, 100_000, 1)))
    frequencies = np.bincount(actions.ravel(), minlength=4) / actions.size
    assert frequencies == pytest.approx(probs.ravel(), abs=0.005)


def test_advantages_hand_case():
    """k = 2, G = 2: rollout 0 right-right (reward 1), rollout 1 right-wrong (reward 0); q = 1/2."""
    probs = np.full((2, 2), 0.5)
    actions = np.array([[0, 0], [0, 1]])
    outcome = chain_advantages("outcome", probs, actions)
    a = 0.5 / (np.sqrt(0.5) + 1e-4)  # (1 - 1/2) / (Bessel std of {1, 0} + eps)
    assert outcome == pytest.approx(np.array([[a, a], [-a, -a]]))
    # V: J = 1/4; after a right first step 1/2; after right-right 1, after right-wrong 0.
    token = chain_advantages("token", probs, actions)
    assert token == pytest.approx(np.array([[0.25, 0.5], [0.25, -0.5]]))
    # Process: step rewards (1, 1, outcome 1) and (1, 0, outcome 0): mean 2/3, Bessel variance
    # 4/15; a 1 normalises to up = (1/3) / std, a 0 to down = -2 up; the outcome adds to step 2.
    process = chain_advantages("process", probs, actions)
    up = (1 / 3) / (np.sqrt(4 / 15) + 1e-4)
    down = -2 * up
    assert process == pytest.approx(np.array([[3 * up, 2 * up], [up + 2 * down, 2 * down]]))


def test_process_arm_is_the_books_process_rule():
    rng = np.random.default_rng(2)
    k, groups, size = 3, 5, 6
    probs = softmax(rng.normal(size=(groups, k, 4)))
    actions = sample_actions(probs, rng.random((groups, size, k)))
    ours = chain_advantages("process", probs, actions)
    reward = (actions == 0).all(axis=-1, keepdims=True)
    steps = torch.from_numpy(np.concatenate([actions == 0, reward], axis=-1).astype(float))
    ends = torch.tensor([*range(k), k - 1]).expand(groups, size, k + 1)
    book = process_advantages(steps, ends, torch.ones_like(steps, dtype=torch.bool), k)
    assert ours.reshape(-1, k) == pytest.approx(book.numpy(), abs=1e-12)


def test_score_gradient_is_the_softmax_score():
    rng = np.random.default_rng(3)
    probs = softmax(rng.normal(size=(2, 4)))
    actions = np.array([[1, 0], [3, 2]])
    coefficients = np.array([[0.5, -1.0], [2.0, 0.25]])
    expected = np.zeros((2, 4))
    for i in range(2):
        for j in range(2):
            expected[j] += coefficients[i, j] * (np.eye(4)[actions[i, j]] - probs[j]) / 2
    assert score_gradient(probs, actions, coefficients) == pytest.approx(expected)


def test_common_random_numbers_across_arms_and_rates():
    """Every arm and rate draws from the same uniforms: at the first update (the same uniform
    policy everywhere) all of them sample the same rollouts, and a seed's result does not depend
    on which other rates run beside it."""
    probs = softmax(np.zeros((len(ARMS), 2, 5, 3, 4)))
    uniforms = np.random.default_rng(4).random((5, 8, 3))
    actions = sample_actions(probs, uniforms)
    assert (actions == actions[:1, :1]).all()
    alone = train_chain(3, [1.0], 5, 8, 4, 400, 0.9, seed=7)
    beside = train_chain(3, [0.3, 1.0], 5, 8, 4, 400, 0.9, seed=7)
    assert np.array_equal(alone[:, 0], beside[:, 1])


def test_learning_rate_optimum_inside_check():
    # Medians over 3 seeds: arm 0 best in the middle; arm 1 best at the top edge; arm 2 a
    # plateau from the second rate on (the smallest within 10% is chosen: inside).
    medians = np.array(
        [[40.0, 20.0, 30.0, 60.0], [90.0, 70.0, 50.0, 10.0], [50.0, 20.0, 19.0, 19.0]]
    )
    rollouts = np.repeat(medians[:, :, None], 3, axis=2)
    index, inside = best_learning_rates(rollouts, tolerance=0.1)
    assert index.tolist() == [1, 3, 1]
    assert inside.tolist() == [True, False, True]
    index, inside = best_learning_rates(rollouts[:, ::-1], tolerance=0.1)
    assert inside.tolist() == [True, False, False]


def test_toy_summary_small_run():
    ks, lrs = [1, 2], [0.3, 1.0, 3.0]
    runs = {k: train_chain(k, lrs, 8, 8, 4, 800, 0.9, seed=0) for k in ks}
    records = toy_summary(ks, runs, lrs, 0.1, 800, num_bootstrap=50, seed=0)
    assert records["toy_chain_reached_k1_min"] == 1.0
    assert records["toy_chain_lr_cells"] == 6
    assert set(records["toy_chain_best_lr"]) == set(ARMS)
    assert records["predicted_toy_chain_log_ratio_slope"] == pytest.approx(np.log(2))
    low, high = records["toy_chain_log_ratio_slope_low"], records["toy_chain_log_ratio_slope_high"]
    assert low <= records["toy_chain_log_ratio_slope"] <= high
