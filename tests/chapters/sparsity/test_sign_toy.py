"""Chapter 6, section 4: Sign against Dr. GRPO at tuned step sizes (sparsity_sign.py)."""

import numpy as np
import pytest

from grpo_companion.chapters.sparsity import sign as sparsity_sign
from grpo_companion.core.exact import binary_group_advantages
from grpo_companion.core.stats import seeds_for_power

METHODS = ["dr_grpo", "sign"]


def small_prompts(num_prompts=16, num_features=4, seed=0):
    return sparsity_sign.linear_logit_prompts(0.7, 3.0, num_prompts, num_features, seed)


def test_start_pass_rates_are_the_beta_quantiles():
    prompts = small_prompts()
    start = sparsity_sign.pass_rates(prompts, np.zeros(4))
    assert start.mean() == pytest.approx(0.7, abs=0.02)
    assert np.all(np.diff(start) > 0)


@pytest.mark.parametrize("method", METHODS)
def test_batch_gradient_mean_is_the_exact_expected_gradient(method):
    """Monte Carlo over 40,000 steps' draws at one theta: every coordinate of the mean estimate
    lies within 5 standard errors of mean_j m(p_j) phi_j (`estimator_moments`' exact mean)."""
    prompts, group_size, batch, draws = small_prompts(), 4, 8, 40_000
    theta = np.array([0.3, -0.2, 0.5, 0.1])
    rng = np.random.default_rng(1)
    indices = np.argsort(rng.random((draws, 16)), axis=1)[:, :batch]
    uniforms = rng.random((draws, batch, group_size))
    tables = sparsity_sign.advantage_tables([method], group_size)
    thetas = np.broadcast_to(theta, (1, draws, 4))
    grads = sparsity_sign.batch_gradient(prompts, thetas, indices, uniforms, tables)[0]
    exact = sparsity_sign.expected_gradient(prompts, theta, method, group_size)
    standard_error = grads.std(axis=0, ddof=1) / np.sqrt(draws)
    assert np.max(np.abs(grads.mean(axis=0) - exact) / standard_error) < 5
    assert np.linalg.norm(exact) > 10 * standard_error.max()  # the check has power


def test_tabular_estimators_never_lower_a_prompt():
    """With one logit per prompt both estimators are >= 0 for every k (the chapter's reason why
    the toy shares parameters): Dr. GRPO's is rbar (1 - rbar), Sign's k/G (1 - p) + (G-k)/G p."""
    G, p = 4, np.linspace(0.01, 0.99, 50)
    for method in METHODS:
        a_correct, a_incorrect = binary_group_advantages(G, method)
        k = np.arange(G + 1)[:, None]
        g = (np.nan_to_num(k * a_correct[:, None]) * (1 - p)
             - np.nan_to_num((G - k) * a_incorrect[:, None]) * p) / G  # fmt: skip
        assert np.all(g >= -1e-12)


def test_common_random_numbers():
    """A seed's draws do not depend on the other seeds run, and two identical arms see
    identical draws: their trajectories agree exactly."""
    indices, uniforms = sparsity_sign.common_draws([1, 2, 3], 5, 16, 4, 4)
    alone = sparsity_sign.common_draws([3], 5, 16, 4, 4)
    np.testing.assert_array_equal(indices[2], alone[0][0])
    np.testing.assert_array_equal(uniforms[2], alone[1][0])
    assert all(len(set(row)) == 4 for row in indices.reshape(-1, 4))  # without replacement
    prompts = small_prompts()
    runs = sparsity_sign.train_linear_logit(prompts, ["sign", "dr_grpo", "sign"], [0.1, 0.3],
                                            [4, 5], 12, 4, 4, record_every=4)  # fmt: skip
    np.testing.assert_array_equal(runs["J"][0], runs["J"][2])
    single = sparsity_sign.train_linear_logit(prompts, ["sign"], [0.1, 0.3], [5], 12, 4, 4, 4)
    np.testing.assert_allclose(single["J"][0, :, 0], runs["J"][0, :, 1], rtol=0, atol=1e-12)
    assert runs["steps"].tolist() == [0, 4, 8, 12]
    assert runs["rollouts"][-1] == 12 * 4 * 4


def synthetic_runs(peaks, num_lrs=5, num_seeds=6):
    """J (M, L, S, 2): start 0.5, final a tent in the lr index peaking at `peaks[m]`."""
    final = np.stack([[[0.9 - 0.05 * abs(i - peak)] * num_seeds for i in range(num_lrs)]
                      for peak in peaks])  # fmt: skip
    final = final + 0.001 * np.arange(num_seeds)
    return {"J": np.stack([np.full_like(final, 0.5), final], axis=-1)}


def test_grid_optimum_inside_check():
    lrs = [0.01, 0.03, 0.1, 0.3, 1.0]
    inside = sparsity_sign.tuned_comparison(synthetic_runs([1, 3]), METHODS, lrs, 3, "dr_grpo",
                                            "sign")  # fmt: skip
    assert inside["inside"] == 1 and inside["best_lr"] == {"dr_grpo": 0.03, "sign": 0.3}
    assert inside["difference"]["mean"] == pytest.approx(0.0) and inside["difference"]["n"] == 3
    for peaks in ([0, 2], [2, 4]):
        edge = sparsity_sign.tuned_comparison(synthetic_runs(peaks), METHODS, lrs, 3, "dr_grpo",
                                              "sign")  # fmt: skip
        assert edge["inside"] == 0


def test_error_grid_source_regime():
    """In the source's regime (mean 0.9, degenerate rate 0.69 at G = 4) Sign's error at its best
    step is below Dr. GRPO's only without score noise."""
    noises = [0.0, 0.5, 2.0]
    table = sparsity_sign.error_grid([0.3, 0.9], 0.69, 4, noises)
    assert table.loc[(0.9, "Sign"), "v = 0"] == pytest.approx(0.200, abs=5e-4)
    assert table.loc[(0.9, "Dr. GRPO"), "v = 0"] == pytest.approx(0.538, abs=5e-4)
    assert table.loc[(0.9, "Sign"), "all-correct share"] == pytest.approx(0.689, abs=1e-3)
    assert sparsity_sign.sign_wins(table, noises) == {0.3: [0.0], 0.9: [0.0]}


def test_seeds_for_power():
    assert seeds_for_power(1.0, 1.0) == 8  # (1.96 + 0.84)^2 = 7.85
    assert seeds_for_power(0.01, 1.0) == 2


def test_toy_regime_records_its_start_and_a_prediction():
    toy = {"prompts": 8, "features": 4, "batch_prompts": 4, "steps": 6, "record_every": 3,
           "tune_seeds": 2, "eval_seeds": 2}  # fmt: skip
    out = sparsity_sign.toy_regime(
        "easy", 0.9, 0.69, toy, [0.1, 0.3, 1.0], METHODS, "dr_grpo", "sign", 4, 0
    )
    records = out["records"]
    start = sparsity_sign.pass_rates(
        sparsity_sign.linear_logit_prompts(0.9, records["tabular_easy_concentration"], 8, 4, 0),
        np.zeros(4),
    )
    assert records["tabular_easy_degenerate_rate"] == pytest.approx(
        np.mean(start**4 + (1 - start) ** 4), rel=1e-12
    )
    assert np.isfinite(records["predicted_tabular_easy_sign_minus_dr_grpo"])
