"""core.stats additions for the claims ledger: the expected range of n normals (the noise level
of chapter 5's credit spread) and the slope of independent means with its interval (chapter 7's
"regardless of R")."""

import numpy as np
import pytest

from grpo_companion.core.stats import expected_normal_range, moving_block_bootstrap, slope_of_means


def test_expected_normal_range_closed_forms_and_monte_carlo():
    assert expected_normal_range(1) == 0.0
    assert expected_normal_range(2) == pytest.approx(2 / np.sqrt(np.pi), rel=1e-9)
    assert expected_normal_range(3) == pytest.approx(3 / np.sqrt(np.pi), rel=1e-9)
    samples = np.random.default_rng(0).standard_normal((200_000, 30))
    ranges = np.ptp(samples, axis=1)
    assert expected_normal_range(30) == pytest.approx(ranges.mean(), abs=4 * ranges.std() / 447)
    # the numbers: 3.5 to 4.5 standard errors for 15 to 48 tokens
    assert 3.4 < expected_normal_range(15) < 3.5 and 4.4 < expected_normal_range(48) < 4.5


def test_slope_of_means_exact_line_and_interval_width():
    x = [2, 4, 8, 16]
    line = slope_of_means(x, [1 + 0.5 * v for v in x], [0.0] * 4)
    assert line == {
        "mean": pytest.approx(0.5),
        "low": pytest.approx(0.5),
        "high": pytest.approx(0.5),
    }
    errors = [0.1, 0.2, 0.1, 0.3]
    noisy = slope_of_means(x, [2.0] * 4, errors)
    centred = np.array(x) - np.mean(x)
    sd = np.sqrt(centred**2 @ np.square(errors)) / (centred @ centred)
    assert noisy["mean"] == pytest.approx(0.0, abs=1e-15)
    assert noisy["high"] == pytest.approx(1.959964 * sd, rel=1e-5) == -noisy["low"]
    assert slope_of_means(x, [2.0] * 4, [0.1, None, 0.1, 0.1])["low"] is None
    with pytest.raises(ValueError, match="two distinct"):
        slope_of_means([4, 4], [1.0, 2.0], [0.1, 0.1])


def ar1_series(n: int, phi: float, seed: int) -> np.ndarray:
    """x_t = phi x_(t-1) + e_t, standard normal e, started from the stationary law."""
    noise = np.random.default_rng(seed).standard_normal(n)
    series = np.empty(n)
    series[0] = noise[0] / np.sqrt(1 - phi**2)
    for t in range(1, n):
        series[t] = phi * series[t - 1] + noise[t]
    return series


def test_moving_block_bootstrap_is_wider_than_the_iid_one_on_an_ar1_series():
    series = ar1_series(400, 0.8, seed=0)
    iid = moving_block_bootstrap(series, 1, 4000, seed=1)
    blocks = moving_block_bootstrap(series, 20, 4000, seed=1)
    # The mean of an AR(1) series has variance about (1 + phi) / (1 - phi) = 9 times the i.i.d.
    # one: the blocks recover most of that factor, the i.i.d. bootstrap none of it.
    assert iid.std() == pytest.approx(series.std() / np.sqrt(400), rel=0.1)
    assert blocks.std() > 2 * iid.std()
    assert blocks.mean() == pytest.approx(series.mean(), abs=0.1)


def test_moving_block_bootstrap_is_seeded_and_checks_its_block():
    series = np.arange(10.0)
    first = moving_block_bootstrap(series, 3, 50, seed=7)
    assert first.shape == (50,)
    np.testing.assert_array_equal(first, moving_block_bootstrap(series, 3, 50, seed=7))
    assert not np.array_equal(first, moving_block_bootstrap(series, 3, 50, seed=8))
    # One block of the whole series is the series itself: every resample has its mean.
    np.testing.assert_allclose(moving_block_bootstrap(series, 10, 5, seed=0), 4.5)
    for bad in (0, 11):
        with pytest.raises(ValueError, match="block_length"):
            moving_block_bootstrap(series, bad, 5, seed=0)


def test_grid_choice_takes_the_best_the_lowest_on_a_tie_and_says_whether_it_is_inside():
    from grpo_companion.core.stats import grid_choice

    assert grid_choice([1, 2, 3], [0.1, 0.5, 0.2]) == {
        "learning_rate": 2,
        "index": 1,
        "inside": True,
        "means": [0.1, 0.5, 0.2],
        "learned": None,
    }
    assert grid_choice([1, 2, 3], [0.5, 0.5, 0.2]) == {
        "learning_rate": 1,
        "index": 0,
        "inside": False,
        "means": [0.5, 0.5, 0.2],
        "learned": None,
    }
    assert grid_choice([1, 2, 3], [0.1, 0.2, 0.3])["inside"] is False
    assert grid_choice([1, 2], [0.3, 0.3])["learning_rate"] == 1
    # a grid on which nothing learns ties at the start: its lowest rate, and learned False
    flat = grid_choice([1, 2, 3], [0.3, 0.3, 0.3], start=0.3)
    assert (flat["learning_rate"], flat["inside"], flat["learned"]) == (1, False, False)
    assert grid_choice([1, 2, 3], [0.2, 0.31, 0.1], start=0.3)["learned"] is True
    # a gain within the measure's noise is not learning
    assert grid_choice([1, 2, 3], [0.2, 0.31, 0.1], start=0.3, margin=0.05)["learned"] is False


def test_choice_records_name_each_arms_rate_and_gates():
    from grpo_companion.core.stats import choice_records, grid_choice

    choice = {
        "a": grid_choice([1, 2, 3], [0.1, 0.5, 0.2], start=0.3),  # inside, learned
        "b": grid_choice([1, 2, 3], [0.1, 0.2, 0.25], start=0.3),  # at the edge, not learned
        "c": grid_choice([1, 2, 3], [0.1, 0.5, 0.2]),  # learning not measured
    }
    assert choice_records(choice, "x_", "x_lr_inside") == {
        "x_a_learning_rate": 2, "x_a_lr_inside": 1, "x_a_tune_learned": 1,
        "x_b_learning_rate": 3, "x_b_lr_inside": 0, "x_b_tune_learned": 0,
        "x_c_learning_rate": 2, "x_c_lr_inside": 1, "x_c_tune_learned": None,
        "x_lr_inside": 0,
    }  # fmt: skip
    inside = {name: choice[name] for name in ("a", "c")}
    assert choice_records(inside, "", "all_inside")["all_inside"] == 1


def test_accuracy_noise_is_two_binomial_standard_errors():
    from grpo_companion.core.stats import accuracy_noise

    assert accuracy_noise(0.5, 100) == pytest.approx(0.1)
    assert accuracy_noise(0.4, 100) == pytest.approx(2 * (0.24 / 100) ** 0.5)
    assert accuracy_noise(0.0, 100) == 0.0 and accuracy_noise(1.2, 10) == 0.0
