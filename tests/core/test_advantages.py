import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_companion.core.advantages import (
    METHODS,
    group_advantages,
    per_step_process_advantages,
    process_advantages,
    shuffle_step_rewards,
)


@st.composite
def reward_batches(draw):
    """(num_groups, group_size) float64 rewards in [-100, 100], group_size >= 2."""
    num_groups = draw(st.integers(1, 4))
    group_size = draw(st.integers(2, 8))
    values = draw(
        st.lists(
            st.floats(-100, 100, allow_nan=False),
            min_size=num_groups * group_size,
            max_size=num_groups * group_size,
        )
    )
    return torch.tensor(values, dtype=torch.float64).reshape(num_groups, group_size)


def _tolerance(rewards):
    # Rounding in the group mean scales with the group size and the reward magnitude.
    return 1e-9 * rewards.shape[1] * (1 + rewards.abs().max().item())


# --- TRL conventions for "grpo" -------------------------------------------------


def test_grpo_two_completions_uses_bessel_std_and_eps_1e4():
    advantages = group_advantages(torch.tensor([[1.0, 0.0]], dtype=torch.float64))
    expected = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert expected == pytest.approx(0.70700680, abs=1e-8)
    torch.testing.assert_close(
        advantages, torch.tensor([[expected, -expected]], dtype=torch.float64), rtol=0, atol=1e-12
    )


def test_grpo_population_std_gives_about_plus_minus_one():
    rewards = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    advantages = group_advantages(rewards, unbiased_std=False)
    expected = 0.5 / (0.5 + 1e-4)
    torch.testing.assert_close(
        advantages, torch.tensor([[expected, -expected]], dtype=torch.float64), rtol=0, atol=1e-12
    )


def test_grpo_scale_rewards_group_vs_batch_hand_computed():
    rewards = torch.tensor([[0.0, 1.0, 2.0], [3.0, 3.0, 6.0]], dtype=torch.float64)
    # Group means 1 and 4; deviations [-1, 0, 1] and [-1, -1, 2].
    centered = torch.tensor([[-1.0, 0.0, 1.0], [-1.0, -1.0, 2.0]], dtype=torch.float64)
    # Bessel group stds: sqrt(2/2) = 1 and sqrt(6/2) = sqrt(3).
    group_std = torch.tensor([[1.0], [math.sqrt(3.0)]], dtype=torch.float64)
    # Batch: mean 2.5, squared deviations sum to 21.5, Bessel std sqrt(21.5/5).
    batch_std = math.sqrt(21.5 / 5)

    torch.testing.assert_close(
        group_advantages(rewards, scale_rewards="group"),
        centered / (group_std + 1e-4),
        rtol=0,
        atol=1e-12,
    )
    torch.testing.assert_close(
        group_advantages(rewards, scale_rewards="batch"),
        centered / (batch_std + 1e-4),
        rtol=0,
        atol=1e-12,
    )


def test_grpo_scale_rewards_none_equals_dr_grpo():
    rewards = torch.tensor([[0.0, 1.0, 2.0], [3.0, 3.0, 6.0]], dtype=torch.float64)
    none = group_advantages(rewards, scale_rewards="none")
    torch.testing.assert_close(none, group_advantages(rewards, "dr_grpo"), rtol=0, atol=0)
    torch.testing.assert_close(
        none, torch.tensor([[-1.0, 0.0, 1.0], [-1.0, -1.0, 2.0]], dtype=torch.float64)
    )


def test_grpo_constant_group_gets_zero_advantage():
    rewards = torch.tensor([[0.5, 0.5, 0.5], [1.0, 0.0, 0.0]])
    advantages = group_advantages(rewards)
    assert torch.equal(advantages[0], torch.zeros(3))
    assert advantages[1, 0] > 0


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_and_shape_are_kept(method, dtype):
    rewards = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]], dtype=dtype)
    advantages = group_advantages(rewards, method)
    assert advantages.dtype == dtype
    assert advantages.shape == rewards.shape


# --- properties ------------------------------------------------------------------


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo", "softmax"])
@settings(max_examples=50, deadline=None)
@given(rewards=reward_batches())
def test_zero_sum_per_group(method, rewards):
    sums = group_advantages(rewards, method).sum(dim=1)
    assert sums.abs().max().item() <= _tolerance(rewards)


@settings(max_examples=50, deadline=None)
@given(rewards=reward_batches())
def test_rloo_is_rescaled_dr_grpo(rewards):
    group_size = rewards.shape[1]
    expected = group_size / (group_size - 1) * group_advantages(rewards, "dr_grpo")
    diff = (group_advantages(rewards, "rloo") - expected).abs().max().item()
    assert diff <= _tolerance(rewards)


def test_rloo_matches_leave_one_out_loop():
    rewards = torch.tensor([[1.0, 0.0, 0.5, 2.0], [3.0, -1.0, 0.0, 0.0]], dtype=torch.float64)
    expected = torch.empty_like(rewards)
    for g in range(rewards.shape[0]):
        for i in range(rewards.shape[1]):
            others = [rewards[g, j].item() for j in range(rewards.shape[1]) if j != i]
            expected[g, i] = rewards[g, i] - sum(others) / len(others)
    torch.testing.assert_close(group_advantages(rewards, "rloo"), expected, rtol=0, atol=1e-12)


# --- softmax -----------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(rewards=reward_batches(), temperature=st.floats(1e-2, 1e2))
def test_softmax_bounds(rewards, temperature):
    group_size = rewards.shape[1]
    advantages = group_advantages(rewards, "softmax", temperature=temperature)
    assert advantages.min().item() >= -1.0
    assert advantages.max().item() <= group_size - 1 + 1e-12


def test_softmax_hand_computed():
    rewards = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)
    # softmax = [1/4, 3/4], A = 2 * softmax - 1 = [-1/2, 1/2]
    torch.testing.assert_close(
        group_advantages(rewards, "softmax"),
        torch.tensor([[-0.5, 0.5]], dtype=torch.float64),
        rtol=0,
        atol=1e-12,
    )


def test_softmax_high_temperature_gives_zero():
    rewards = torch.tensor([[1.0, 0.0, 0.3, 0.7]], dtype=torch.float64)
    advantages = group_advantages(rewards, "softmax", temperature=1e8)
    assert advantages.abs().max().item() < 1e-7


def test_softmax_low_temperature_concentrates_on_argmax():
    rewards = torch.tensor([[0.2, 1.0, 0.0, 0.3], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    advantages = group_advantages(rewards, "softmax", temperature=1e-3)
    # A unique maximum takes G - 1 = 3; two tied maxima split it: G/2 - 1 = 1.
    expected = torch.tensor([[-1.0, 3.0, -1.0, -1.0], [1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)


# --- sign ------------------------------------------------------------------------


def test_sign_binary_rewards():
    rewards = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    assert torch.equal(group_advantages(rewards, "sign"), torch.tensor([[1.0, -1.0, 1.0, 1.0]]))


def test_sign_threshold_and_single_completion_groups():
    rewards = torch.tensor([[0.2], [0.7], [0.5]], dtype=torch.float64)
    advantages = group_advantages(rewards, "sign", threshold=0.5)
    assert torch.equal(advantages, torch.tensor([[-1.0], [1.0], [-1.0]], dtype=torch.float64))


# --- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rewards", "kwargs", "match"),
    [
        (torch.tensor([1.0, 0.0]), {}, r"rewards must be 2-D.*\(2,\)"),
        (torch.tensor([[1, 0]]), {}, r"rewards must be floating point.*int64"),
        (torch.tensor([[1.0, float("nan")]]), {}, r"rewards must be finite"),
        (torch.tensor([[1.0, float("inf")]]), {}, r"rewards must be finite"),
        (torch.tensor([[1.0, 0.0]]), {"method": "ppo"}, r"unknown method 'ppo'.*'grpo'.*'softmax'"),
        (
            torch.tensor([[1.0, 0.0]]),
            {"scale_rewards": "global"},
            r"unknown scale_rewards 'global'.*'group'.*'batch'.*'none'",
        ),
        (torch.tensor([[1.0, 0.5]]), {"method": "sign"}, r"binary rewards.*threshold"),
        (
            torch.tensor([[1.0, 0.0]]),
            {"method": "softmax", "temperature": 0.0},
            r"temperature must be > 0",
        ),
        (
            torch.tensor([[1.0, 0.0]]),
            {"method": "softmax", "temperature": -1.0},
            r"temperature must be > 0",
        ),
    ],
)
def test_errors(rewards, kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, **kwargs)


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo", "softmax"])
def test_group_size_one_is_rejected_for_baseline_methods(method):
    with pytest.raises(ValueError, match=rf"method '{method}' needs group_size >= 2.*\(3, 1\)"):
        group_advantages(torch.ones(3, 1), method)


# --- verl's estimators -------------------------------------------------------------


def test_verl_group_methods_hand_computed():
    from grpo_companion.core.advantages import BATCH_METHODS

    assert set(BATCH_METHODS) <= set(METHODS)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    # pass@k: only a unique best completion gets r_max - r_second, here over std 0.5 + 1e-4
    passk = torch.zeros_like(rewards)
    passk[1, 2] = 1 / (0.5 + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, "grpo_passk"), passk, rtol=0, atol=1e-12)
    passk[1, 2] = 1.0
    torch.testing.assert_close(
        group_advantages(rewards, "grpo_passk", scale_rewards="none"), passk, rtol=0, atol=1e-12
    )
    # centred rewards (+-0.5 | -0.25 x3, 0.75) have mean 0 and Bessel variance 1.75 / 7 = 0.25
    whitened = torch.tensor([[1.0, -1.0, -1.0, 1.0], [-0.5, -0.5, 1.5, -0.5]], dtype=torch.float64)
    torch.testing.assert_close(
        group_advantages(rewards, "reinforce_plus_plus_baseline"),
        whitened / (1 + 4e-8) ** 0.5, rtol=0, atol=1e-12,
    )  # fmt: skip
    # GPG (verl): alpha = 8 rewards / 3 nonzero
    gpg = 8 / 3 * (rewards - rewards.mean(dim=1, keepdim=True))
    torch.testing.assert_close(group_advantages(rewards, "gpg"), gpg, rtol=0, atol=1e-12)


def test_passk_ties_at_the_top_give_nothing():
    rewards = torch.tensor([[1.0, 1.0, 0.0], [0.5, 0.2, 0.2]], dtype=torch.float64)
    advantages = group_advantages(rewards, "grpo_passk", scale_rewards="none")
    expected = torch.tensor([[0.0, 0.0, 0.0], [0.3, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="grpo_passk"):
        group_advantages(rewards, "grpo_passk", scale_rewards="batch")


def test_opo_and_remax_hand_computed():
    from grpo_companion.core.verl_estimators import opo_advantages, remax_advantages

    rewards = torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64)
    lengths = torch.tensor([[10, 30, 20]])
    # baseline (10 + 20) / 60 = 0.5
    torch.testing.assert_close(
        opo_advantages(rewards, lengths), torch.tensor([[0.5, -0.5, 0.5]], dtype=torch.float64)
    )
    equal = torch.full_like(lengths, 7)
    torch.testing.assert_close(opo_advantages(rewards, equal), group_advantages(rewards, "dr_grpo"))
    greedy = torch.tensor([1.0], dtype=torch.float64)
    torch.testing.assert_close(
        remax_advantages(rewards, greedy), torch.tensor([[0.0, -1.0, 0.0]], dtype=torch.float64)
    )
    with pytest.raises(ValueError, match="lengths"):
        opo_advantages(rewards, torch.tensor([[1, 0, 2]]))


def test_reinforce_plus_plus_returns_and_whitening():
    from grpo_companion.core.verl_estimators import reinforce_plus_plus_advantages

    token_rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    advantages, returns = reinforce_plus_plus_advantages(token_rewards, mask, gamma=0.5)
    expected_returns = torch.tensor(
        [[0.25, 0.5, 1.0, 0.0], [1.0, 2.0, 0.0, 0.0]], dtype=torch.float64
    )
    torch.testing.assert_close(returns, expected_returns)
    valid = torch.tensor([0.25, 0.5, 1.0, 1.0, 2.0], dtype=torch.float64)
    whitened = (valid - valid.mean()) / (valid.var() + 1e-8).sqrt()
    torch.testing.assert_close(advantages[mask.bool()], whitened, rtol=0, atol=1e-7)
    assert advantages[~mask.bool()].abs().max() == 0


def test_optimal_token_baseline_hand_computed():
    from grpo_companion.core.verl_estimators import optimal_token_baseline_advantages

    # one group of two completions of 2 tokens, outcome reward on the last token
    token_rewards = torch.tensor([[[0.0, 1.0], [0.0, 0.0]]], dtype=torch.float64)
    mask = torch.ones_like(token_rewards)
    probs = torch.tensor([[[0.5, 0.5], [0.25, 0.5]]], dtype=torch.float64)
    sum_sq = torch.full_like(probs, 0.5)
    # per-token weights 1 - 2 pi + 0.5: [0.5, 0.5] and [1.0, 0.5]; cumulative [0.5, 1] and [1, 1.5]
    # returns [1, 1] and [0, 0]: B_1 = 0.5 / 1.5, B_2 = 1 / 2.5
    advantages, returns = optimal_token_baseline_advantages(token_rewards, mask, probs, sum_sq)
    baseline = torch.tensor([1 / 3, 0.4], dtype=torch.float64)
    torch.testing.assert_close(returns[0, 0], torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(advantages[0, 0], 1 - baseline, rtol=0, atol=1e-7)
    torch.testing.assert_close(advantages[0, 1], -baseline, rtol=0, atol=1e-7)


def test_kl_in_reward_subtracts_before_the_baseline():
    from grpo_companion.core.kl import kl_in_reward

    rewards = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    kl = torch.tensor([[0.5, -1.0]], dtype=torch.float64, requires_grad=True)
    shaped = kl_in_reward(rewards, kl, beta=0.2)
    torch.testing.assert_close(shaped, torch.tensor([[0.9, 0.2]], dtype=torch.float64))
    assert not shaped.requires_grad  # it enters through the score function only
    # baselined like the reward: Dr. GRPO's advantages are +-0.35
    torch.testing.assert_close(
        group_advantages(shaped, "dr_grpo"), torch.tensor([[0.35, -0.35]], dtype=torch.float64)
    )


# --- process supervision: per-step rewards, per-token advantages ------------------------------


@given(reward_batches(), st.integers(1, 6))
@settings(max_examples=50, deadline=None)
def test_process_advantages_with_only_the_outcome_are_group_advantages(rewards, seq_len):
    """One step per completion, at its last token: every token gets group_advantages(rewards)."""
    num_groups, group_size = rewards.shape
    advantages = process_advantages(
        rewards[..., None],
        torch.full((num_groups, group_size, 1), seq_len - 1),
        torch.ones(num_groups, group_size, 1, dtype=torch.bool),
        seq_len,
    )
    expected = group_advantages(rewards).flatten()[:, None].expand(-1, seq_len)
    assert torch.equal(advantages, expected)


def test_process_advantages_hand_computed():
    """One group of two completions with two steps each, one more masked; rewards 1, 0 | 1, 1
    have mean 3/4 and Bessel std 1/2, so they normalise to 1/2, -3/2 | 1/2, 1/2 (eps = 0). A
    token's advantage sums the steps that end at or after it; past the last step it is 0."""
    rewards = torch.tensor([[[1.0, 0.0, 7.0], [1.0, 1.0, 7.0]]], dtype=torch.float64)
    ends = torch.tensor([[[1, 3, 0], [0, 4, 4]]])
    mask = torch.tensor([[[True, True, False], [True, True, False]]])
    advantages = process_advantages(rewards, ends, mask, seq_len=6, eps=0.0)
    expected = [[-1.0, -1.0, -1.5, -1.5, 0.0, 0.0], [1.0, 0.5, 0.5, 0.5, 0.5, 0.0]]
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64))
    # Two steps that end at one token add up there.
    same_end = process_advantages(rewards, torch.ones_like(ends), mask, seq_len=2, eps=0.0)
    torch.testing.assert_close(
        same_end, torch.tensor([[-1.0, -1.0], [1.0, 1.0]], dtype=rewards.dtype)
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda r, e, m: (r[0], e[0], m[0]), "must be floating point"),
        (lambda r, e, m: (r, e[..., :1], m), "must have the shape of step_rewards"),
        (lambda r, e, m: (r, e + 6, m), r"step_ends must lie in \[0, seq_len = 6\)"),
        (
            lambda r, e, m: (r, e, m & torch.tensor([[True, False], [False, False]])),
            r"steps per group: \[1\]",
        ),
        (lambda r, e, m: (r * float("nan"), e, m), "must be finite"),
    ],
)
def test_process_advantages_errors(change, match):
    rewards, ends, mask = torch.zeros(1, 2, 2), torch.zeros(1, 2, 2, dtype=torch.long), None
    mask = torch.ones(1, 2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=match):
        process_advantages(*change(rewards, ends, mask), seq_len=6)


def test_zero_advantage_fractions_per_completion_and_per_token():
    """The token share weights each rollout by its length; per-token advantages (process
    credit) count their zero tokens, and a rollout is zero when all its real tokens are."""
    from grpo_companion.core.advantages import zero_advantage_fractions

    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    per_completion = zero_advantage_fractions(torch.tensor([0.0, 1e-12, -0.5]), mask)
    assert per_completion == {"rollouts": pytest.approx(2 / 3), "tokens": pytest.approx(4 / 8)}
    per_token = torch.tensor([[0.0, 0.0, 0.0, 9.0], [0.3, 0, 0, 0], [0.0, 0.2, 0.0, 0.0]])
    fractions = zero_advantage_fractions(per_token, mask)
    assert fractions == {"rollouts": pytest.approx(1 / 3), "tokens": pytest.approx(6 / 8)}
    with pytest.raises(ValueError, match="completion_mask"):
        zero_advantage_fractions(torch.zeros(2), mask)


def test_shuffle_step_rewards_permutes_the_worked_steps_within_each_group():
    rewards = torch.tensor([[[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]], [[1.0, 1.0, 1.0], [0.0, 0.0, 1.0]]])
    mask = torch.tensor([[[True, True, True], [True, True, False]], [[True] * 3, [True] * 3]])
    shuffled = shuffle_step_rewards(rewards, mask, torch.Generator().manual_seed(0))
    # the outcome (each row's last present step) stays; the worked steps keep their multiset
    assert (
        shuffled[0, 0, 2] == 1.0
        and shuffled[0, 1, 1] == 1.0
        and shuffled[1, :, 2].tolist() == [1, 1]
    )
    for group in range(2):
        worked = mask[group].clone()
        worked[0, mask[group][0].sum() - 1] = False
        worked[1, mask[group][1].sum() - 1] = False
        assert sorted(shuffled[group][worked].tolist()) == sorted(rewards[group][worked].tolist())
    assert torch.equal(shuffled[~mask], rewards[~mask])
    draws = {
        tuple(shuffle_step_rewards(rewards, mask, torch.Generator().manual_seed(s))[0][0].tolist())
        for s in range(20)
    }
    assert len(draws) > 1  # a permutation, not the identity


def test_per_step_process_advantages_average_the_steps_still_ahead():
    # one group of two completions, T = 4: steps end at tokens (0, 2, 3) and (1, 3)
    rewards = torch.tensor([[[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]])
    ends = torch.tensor([[[0, 2, 3], [1, 3, 0]]])
    mask = torch.tensor([[[True, True, True], [True, True, False]]])
    summed = process_advantages(rewards, ends, mask, 4)
    averaged = per_step_process_advantages(summed, ends, mask)
    ahead = torch.tensor([[3.0, 2.0, 2.0, 1.0], [2.0, 2.0, 1.0, 1.0]])
    torch.testing.assert_close(averaged, summed / ahead)
    # the last token of each completion keeps its one term: the outcome's normalised reward
    torch.testing.assert_close(averaged[:, 3], summed[:, 3])
