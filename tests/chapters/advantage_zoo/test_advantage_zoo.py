"""Chapter 9's zoo: every aggregate against the exact moments it is built from, or numbers by
hand."""

import math

import matplotlib
import numpy as np
import pandas as pd
import pytest

from grpo_companion.chapters.advantage_zoo.zoo import (
    FILTER,
    advantage_zoo,
    best_of,
    growth_summary,
    grpo_limit_deviation,
    grpo_scaled_weights,
    nearest_index,
    pass_rate_grid,
    score_noise_summary,
    signal_summary,
    sup_weights,
    which_one_when,
    zoo_table,
    zoo_weights,
)
from grpo_companion.core.exact import (
    best_step_error,
    best_step_errors,
    beta_quadrature,
    errors_against_score_noise,
    estimator_moments,
)

matplotlib.use("Agg")
ZOO = advantage_zoo([0.5, 2.0])
GRID = pass_rate_grid(49)
NODES, NODE_WEIGHTS = beta_quadrature(1.0, 1.0, 32)


def test_zoo_lists_the_methods_with_their_options():
    assert list(ZOO) == [
        "GRPO", "Dr. GRPO", "RLOO", "Sign", "Softmax τ=0.5", "Softmax τ=2", "DAPO filter",
        "Reinforce-Rej",
    ]  # fmt: skip
    assert ZOO["Softmax τ=2"] == ("softmax", {"temperature": 2.0})
    assert ZOO["Reinforce-Rej"] == ("sign", FILTER) and ZOO["DAPO filter"] == ("grpo", FILTER)


def test_grid_and_nearest_index():
    np.testing.assert_allclose(pass_rate_grid(3), [0.25, 0.5, 0.75])
    assert nearest_index(GRID, 0.5) == 24 and GRID[24] == 0.5
    assert nearest_index(GRID, 0.05) == 2  # 0.04 and 0.06 tie; argmin takes the first


def test_weights_are_the_exact_weights_and_the_flat_ones_are_flat():
    weights = zoo_weights(GRID, 8, ZOO)
    np.testing.assert_allclose(weights["RLOO"], 1.0, rtol=1e-12)
    np.testing.assert_allclose(weights["Dr. GRPO"], 1 - 1 / 8, rtol=1e-12)
    np.testing.assert_allclose(weights["Sign"], 2.0, rtol=1e-12)
    # Reinforce-Rej per drawn group: 2 - (1 - p)^(G - 1) - p^(G - 1)
    np.testing.assert_allclose(weights["Reinforce-Rej"], 2 - (1 - GRID) ** 7 - GRID**7, rtol=1e-10)
    summary = signal_summary(weights, nearest_index(GRID, 0.1), 24, [0.5, 2.0])
    assert summary["rloo_hard_over_middle"] == pytest.approx(1.0, rel=1e-12)
    grpo = estimator_moments([0.1, 0.5], 8, "grpo")["weight"]
    assert summary["grpo_hard_over_middle"] == pytest.approx(grpo[0] / grpo[1], rel=1e-12)
    assert summary["grpo_hard_over_middle"] > 1.2  # std scaling favours hard prompts
    assert summary["dapo_max_abs_difference_from_grpo"] < 1e-12
    expected = weights["Softmax τ=0.5"][4] / weights["Softmax τ=0.5"][24]
    assert summary["softmax_lowest_temperature_hard_over_middle"] == pytest.approx(expected)


def test_sup_weights_and_their_summary():
    sup = sup_weights(GRID, [4, 64], ZOO)
    assert list(sup) == ["GRPO", "RLOO", "Softmax τ=0.5", "Softmax τ=2"]
    assert sup["RLOO"] == pytest.approx([1.0, 1.0], rel=1e-9)
    # the refined grid reaches p = 1e-5, beyond GRID's 0.02
    coarse = np.nanmax(estimator_moments(GRID, 64, "grpo")["weight"])
    assert sup["GRPO"][1] > coarse
    for bound, label in [(np.expm1(2.0), "Softmax τ=0.5"), (np.expm1(0.5), "Softmax τ=2")]:
        assert max(sup[label]) < bound
    summary = growth_summary(sup, [4, 64], [0.5, 2.0])
    assert summary["grpo_sup_weight_over_sqrt_g"] == pytest.approx(sup["GRPO"][1] / 8)
    assert summary["softmax_lowest_temperature_bound"] == pytest.approx(np.e**2 - 1)
    assert summary["softmax_highest_temperature_sup_weight"] == sup["Softmax τ=2"][1]


def test_grpo_tends_to_one_over_the_spread():
    scaled = grpo_scaled_weights(GRID, [4, 256])
    spread = np.sqrt(GRID * (1 - GRID))
    np.testing.assert_allclose(
        scaled[4], estimator_moments(GRID, 4, "grpo")["weight"] * spread, rtol=1e-14
    )
    deviation = grpo_limit_deviation(GRID, 256)
    inside = (GRID > 0.1) & (GRID < 0.9)
    assert deviation == pytest.approx(np.max(np.abs(scaled[256][inside] - 1)))
    assert deviation < 0.02 < grpo_limit_deviation(GRID, 4)


def test_zoo_table_against_the_moments():
    table = zoo_table(NODES, NODE_WEIGHTS, ZOO, [2, 8], 4.0)
    assert len(table) == 2 * len(ZOO)
    row = table[(table["method"] == "Dr. GRPO") & (table["G"] == 8)].iloc[0]
    assert row["mean weight"] == pytest.approx(1 - 1 / 8, rel=1e-10)
    true_gradient = NODE_WEIGHTS @ (NODES * (1 - NODES))
    assert row["squared bias"] == pytest.approx(
        NODE_WEIGHTS @ (NODES * (1 - NODES) / 8) ** 2, rel=1e-9
    )
    moments = estimator_moments(NODES, 8, "dr_grpo", score_noise=4.0)
    assert row["variance"] == NODE_WEIGHTS @ moments["variance"]
    scale_free = best_step_error(NODES, NODE_WEIGHTS, 8, "dr_grpo", score_noise=4.0)
    assert row["error at best step"] == scale_free["relative_error"]
    assert row["alignment"] == pytest.approx(1.0, rel=1e-12) and true_gradient > 0


def test_errors_against_score_noise_and_the_summary():
    errors = errors_against_score_noise(NODES, NODE_WEIGHTS, 8, ZOO, [0.0, 4.0])
    at_four = best_step_errors(NODES, NODE_WEIGHTS, 8, ZOO, 4.0)
    assert {label: values[1] for label, values in errors.items()} == at_four
    table = zoo_table(NODES, NODE_WEIGHTS, ZOO, [8], 4.0)
    summary = score_noise_summary(table, errors, 8)
    assert summary["sign_error_default_noise"] == at_four["Sign"]
    assert summary["reinforce_rej_error_default_noise"] == at_four["Reinforce-Rej"]
    assert summary["rloo_error_no_noise"] == errors["RLOO"][0]
    # Without score noise Sign's positive terms make it the best; with v = 4 it is not.
    assert summary["sign_error_no_noise"] < summary["rloo_error_no_noise"]
    assert summary["sign_error_default_noise"] > summary["rloo_error_default_noise"]


def test_best_of_keeps_ties_within_rounding():
    assert best_of({"a": 0.5, "b": 0.25, "c": 0.25 * (1 + 1e-12)}) == ("b, c", "0.2500")
    assert best_of({"a": 0.1}) == ("a", "0.1000")


def test_which_one_when_answers_by_its_rules():
    weights = zoo_weights(GRID, 8, ZOO)
    rows = [("least error", {"RLOO": 0.3, "Sign": 0.2})]
    choices = {"unbiased_alpha": 1.0, "token_invariant_alpha": 0.0}
    summary = which_one_when(weights, GRID, 2, 24, 8, rows, choices).set_index("question")
    assert isinstance(summary, pd.DataFrame) and len(summary) == 6
    answers = summary["answer here"].tolist()
    assert answers[0] == "RLOO"
    assert answers[1] == "Dr. GRPO, RLOO, Sign"
    assert summary.loc["least error"].tolist() == ["Sign", "0.2000"]
    assert answers[4:] == ["alpha = 1.00", "alpha = 0.00"]
    hard_focus = {label: weight[2] / weight[24] for label, weight in weights.items()}
    assert answers[3] == max(hard_focus, key=hard_focus.get)


def test_figures_have_their_panels():
    from grpo_companion.chapters.advantage_zoo import plots

    weights = zoo_weights(GRID, 8, ZOO)
    assert len(plots.plot_weights(GRID, weights, 8).axes[0].lines) == len(ZOO)
    styles = plots.zoo_styles(ZOO)
    assert styles["Softmax τ=0.5"]["color"] == "C4" and styles["Softmax τ=2"]["color"] == "C5"
    sup = sup_weights(GRID, [4, 16], ZOO)
    fig = plots.plot_weights_as_group_grows(GRID, grpo_scaled_weights(GRID, [4, 16]), sup)
    assert len(fig.axes) == 2
    table = zoo_table(NODES, NODE_WEIGHTS, ZOO, [2, 8], 4.0)
    assert len(plots.plot_bias_and_variance(table, [2, 8]).axes) == 2


def test_verl_zoo_in_the_table_and_its_summary():
    from grpo_companion.chapters.advantage_zoo import plots
    from grpo_companion.chapters.advantage_zoo.zoo import verl_summary, verl_zoo
    from grpo_companion.core.exact import grad_pass_at_g

    extra = verl_zoo(NODES, NODE_WEIGHTS)
    assert extra["GRPO pass@k"] == ("grpo_passk", {})
    table = zoo_table(NODES, NODE_WEIGHTS, ZOO | extra, [2, 8], 4.0)
    summary = verl_summary(table, GRID, 8)
    # GPG and REINFORCE++-baseline are Dr. GRPO rescaled: the same error at the best step
    for key in ("gpg", "rfpp_baseline"):
        assert summary[f"{key}_error_default_noise"] == pytest.approx(
            summary["dr_grpo_error_default_noise"], rel=1e-12
        )
    rows = table[table["G"] == 8].set_index("method")
    # GPG's alpha -> 1 / E[p] = 2 under the uniform prior: mean weight 2 (1 - 1/8)
    assert rows.loc["GPG", "mean weight"] == pytest.approx(1.75, rel=1e-10)
    passk = best_step_error(NODES, NODE_WEIGHTS, 8, "grpo_passk", score_noise=4.0)
    assert summary["passk_error_default_noise"] == pytest.approx(passk["relative_error"])
    assert summary["passk_alignment"] == pytest.approx(passk["alignment"])
    assert 0 < summary["passk_alignment"] < 0.99
    assert summary["passk_pass_at_g_identity_error"] < 1e-15
    assert grad_pass_at_g(GRID, 8).max() > 0.1  # the identity compares non-trivial numbers
    styles = plots.zoo_styles(ZOO | extra)
    assert len({(s["color"], s.get("ls")) for s in styles.values()}) == len(styles)
    assert len(plots.plot_bias_and_variance(table, [2, 8]).axes) == 2


def test_opo_baseline_comparison_by_hand():
    from grpo_companion.chapters.advantage_zoo.length import TwoLengthToy, opo_baseline_comparison

    toy = TwoLengthToy(short_length=2, long_length=4, long_logit=0.4, step_logit=1.1)
    result = opo_baseline_comparison(toy)
    q, s = 1 / (1 + np.exp(-0.4)), 1 / (1 + np.exp(-1.1))
    # reward 1 when every step is right: 1 step (short, L = 2) or 3 steps (long, L = 4)
    mean_reward = (1 - q) * s + q * s**3
    assert result["toy_mean_reward"] == pytest.approx(mean_reward, rel=1e-12)
    opo = (2 * (1 - q) * s + 4 * q * s**3) / (2 * (1 - q) + 4 * q)
    assert result["opo_baseline"] == pytest.approx(opo, rel=1e-12)
    assert result["opo_excess_variance"] >= 0 and result["mean_reward_excess_variance"] >= 0
    # the excess is E||s||^2 (b - b*)^2 over Var[g_b*]: the farther baseline costs more
    probs, _, rewards, scores = toy.outcomes()
    norms = (scores**2).sum(axis=1)
    b_star = result["toy_optimal_baseline"]
    best = (probs * norms) @ (rewards - b_star) ** 2 - np.sum(toy.true_gradient() ** 2)
    excess = (probs @ norms) * (opo - b_star) ** 2 / best
    assert result["opo_excess_variance"] == pytest.approx(excess, rel=1e-9)


def test_the_main_text_teaches_the_core_and_the_rest_are_extensions():
    from grpo_companion.chapters.advantage_zoo.zoo import (
        CORE_METHODS,
        softmax_weight_bounds,
        split_methods,
        verl_zoo,
    )

    core, extensions = split_methods(ZOO | verl_zoo(NODES, NODE_WEIGHTS))
    assert core == list(CORE_METHODS)
    assert extensions == [
        "Softmax τ=0.5", "Softmax τ=2", "GRPO pass@k", "GPG", "REINFORCE++ baseline",
    ]  # fmt: skip
    assert softmax_weight_bounds([0.5, 2.0]) == pytest.approx(
        {"Softmax τ=0.5": np.e**2 - 1, "Softmax τ=2": np.e**0.5 - 1}
    )


def test_the_main_figures_draw_the_core_and_the_extension_figure_the_rest():
    from grpo_companion.chapters.advantage_zoo import plots
    from grpo_companion.chapters.advantage_zoo.zoo import (
        CORE_METHODS,
        softmax_weight_bounds,
        split_methods,
        verl_zoo,
    )

    weights = zoo_weights(GRID, 8, ZOO)
    ax = plots.plot_weights(GRID, weights, 8, CORE_METHODS).axes[0]
    assert [line.get_label() for line in ax.lines] == list(CORE_METHODS)
    table = zoo_table(NODES, NODE_WEIGHTS, ZOO | verl_zoo(NODES, NODE_WEIGHTS), [2, 8], 4.0)
    bias_axes = plots.plot_bias_and_variance(table, [2, 8], CORE_METHODS).axes
    assert [line.get_label() for line in bias_axes[1].lines] == list(CORE_METHODS)
    errors = errors_against_score_noise(NODES, NODE_WEIGHTS, 8, ZOO, [0.0, 1.0, 4.0])
    noise_ax = plots.plot_error_vs_score_noise(np.array([0.0, 1.0, 4.0]), errors, 4.0, 8,
                                               CORE_METHODS).axes[0]  # fmt: skip
    assert [line.get_label() for line in noise_ax.lines][: len(CORE_METHODS)] == list(CORE_METHODS)
    _, extensions = split_methods(table["method"].unique())
    sup = sup_weights(GRID, [4, 16], ZOO)
    bounds = softmax_weight_bounds([0.5, 2.0])
    fig = plots.plot_extensions(GRID, weights, sup, [4, 16], bounds, table, 8, extensions)
    left, middle, right = fig.axes
    assert [line.get_label() for line in left.lines] == [
        "GRPO", "Dr. GRPO", "Softmax τ=0.5", "Softmax τ=2",
    ]  # fmt: skip
    # GRPO and two Softmax curves, each Softmax with its dotted bound
    assert len(middle.lines) == 5
    assert sorted(line.get_ydata()[0] for line in middle.lines if line.get_linestyle() == ":")[
        -1
    ] == pytest.approx(np.e**2 - 1)
    assert [line.get_label() for line in right.lines] == ["GRPO", "Dr. GRPO", *extensions]
    # GPG and REINFORCE++ are Dr. GRPO rescaled: their markers lie on its line
    drawn = {line.get_label(): line.get_ydata() for line in right.lines}
    for label in ("GPG", "REINFORCE++ baseline"):
        np.testing.assert_allclose(drawn[label], drawn["Dr. GRPO"], rtol=1e-12)


@pytest.mark.parametrize("method", ["grpo", "rloo", "sign"])
def test_the_binary_reward_reduction_of_section_0_against_every_group(method):
    """Section 0: on chapter 1's sequence policy (the chapter's 4 tokens, length 3, logits at
    scale 1.5) every group of G = 3 enumerated: E[g] = w(p) grad p, and Var[g] is ||u||^2 times
    the one-parameter model's with the two measured noises v_1 / ||u||^2, v_0 / ||u||^2."""
    from grpo_companion.core.exact import reward_geometry
    from grpo_companion.core.group_estimators import group_estimator_moments
    from grpo_companion.core.policy_gradient import SequencePolicy, sum_mod_reward

    policy = SequencePolicy(vocab_size=4, length=3)
    logits = policy.init_logits(0, scale=1.5)
    rewards = sum_mod_reward(policy.all_sequences(), 4)
    geometry = reward_geometry(policy, logits, rewards)
    assert geometry["noise_correct"] != pytest.approx(geometry["noise_incorrect"], rel=0.05)
    exact = group_estimator_moments(policy, logits, rewards, 3, method)
    noises = (geometry["noise_correct"], geometry["noise_incorrect"])
    model = estimator_moments([geometry["pass_rate"]], 3, method, score_noise=noises)
    gradient = policy.exact_gradient(logits, rewards)
    np.testing.assert_allclose(exact["mean"].numpy(), model["weight"][0] * gradient.numpy(),
                               rtol=1e-10, atol=1e-14)  # fmt: skip
    assert float(exact["variance"]) == pytest.approx(
        geometry["kappa"] * model["variance"][0], rel=1e-10
    )
    # one v for both classes (the chapter's assumption 1) would miss it
    one_v = estimator_moments([geometry["pass_rate"]], 3, method, score_noise=np.mean(noises))
    assert float(exact["variance"]) != pytest.approx(
        geometry["kappa"] * one_v["variance"][0], rel=1e-4
    )


def test_problem_1_the_advantages_of_one_lone_correct_completion():
    import torch

    from grpo_companion.core.advantages import group_advantages

    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    by_hand = {
        "dr_grpo": [0.75, -0.25],
        "rloo": [1.0, -1 / 3],
        "sign": [1.0, -1.0],
        "grpo": [0.75 / (0.5 + 1e-4), -0.25 / (0.5 + 1e-4)],  # Bessel std 1/2, plus TRL's 1e-4
    }
    for method, (correct, incorrect) in by_hand.items():
        advantages = group_advantages(rewards, method)[0].numpy()
        np.testing.assert_allclose(advantages, [correct] + 3 * [incorrect], rtol=1e-12)
    assert group_advantages(rewards, "sign").sum() == -2


def test_problem_2_rloo_and_dr_grpo_weights_from_the_formula():
    p = GRID
    for G in (2, 5, 8):
        k = np.arange(G + 1)[:, None]
        binomial = np.array([math.comb(G, j) for j in range(G + 1)])[:, None]
        probs = binomial * p**k * (1 - p) ** (G - k)
        a_plus, a_minus = (G - k) / (G - 1), -k / (G - 1)
        w = (probs * (k * a_plus * (1 - p) - (G - k) * a_minus * p)).sum(axis=0) / (G * p * (1 - p))
        np.testing.assert_allclose(w, 1.0, rtol=1e-12)
        np.testing.assert_allclose(estimator_moments(p, G, "rloo")["weight"], w, rtol=1e-12)
        np.testing.assert_allclose(
            estimator_moments(p, G, "dr_grpo")["weight"], 1 - 1 / G, rtol=1e-12
        )
        np.testing.assert_allclose((probs * k * (G - k)).sum(axis=0), G * (G - 1) * p * (1 - p))


def test_problem_3_the_noise_parts_and_when_sign_loses():
    p = np.array([0.1, 0.3, 0.5, 0.9])
    for G in (4, 8):
        for method, noise_part in [("sign", np.full_like(p, 3.0 / G)),
                                   ("rloo", 3.0 * p * (1 - p) / (G - 1))]:  # fmt: skip
            noisy = estimator_moments(p, G, method, score_noise=3.0)["variance"]
            clean = estimator_moments(p, G, method)["variance"]
            np.testing.assert_allclose(noisy - clean, noise_part, rtol=1e-10)
    # uniform prompts, E p(1 - p) = 1/6 < 7/32: Sign loses at large v; all at p = 1/2, it wins
    uniform = beta_quadrature(1.0, 1.0)
    half = (np.array([0.5]), np.array([1.0]))
    for prompts, sign_loses in [(uniform, True), (half, False)]:
        for v in (4.0, 1e4):
            sign, rloo = (
                best_step_error(*prompts, 8, method, score_noise=v)["relative_error"]
                for method in ("sign", "rloo")
            )
            assert (sign > rloo) == sign_loses, (prompts, v)
