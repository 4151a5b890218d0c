"""Chapter 8's baseline identities against brute force and exact enumeration.

Monte Carlo tolerance (one test): 400k groups with a fixed seed; the bound is several standard
errors of the sample variance and was checked not to sit near it.
"""

import pytest
import torch
from conftest import sum_mod_setup

from grpo_companion.chapters.baselines.optimal import (
    baseline_cases,
    baseline_gap,
    gap_table,
    group_variance_table,
    group_variances,
    rank_reward,
    squared_score_norms,
    uncorrelated_reward,
    variance_curve,
)
from grpo_companion.chapters.baselines.tokens import (
    optimal_token_baselines,
    token_baseline_candidates,
    token_baseline_comparison,
    token_baseline_moments,
    token_score_norms,
    value_baselines,
)
from grpo_companion.core.group_estimators import group_estimator_moments, sample_group_estimates
from grpo_companion.core.policy_gradient import SequencePolicy, estimator_variance, sum_mod_reward

F64 = torch.float64


@pytest.fixture
def setup():
    return sum_mod_setup(vocab_size=3, length=3, seed=1)


def test_gap_is_covariance_over_mean_squared_norm(setup):
    policy, logits, rewards = setup
    for reward in (
        rewards,
        rank_reward(policy, logits, 9, rarest=True),
        torch.linspace(-1, 2, 27, dtype=F64),
    ):
        gap = baseline_gap(policy, logits, reward)
        assert gap["gap"] == pytest.approx(
            gap["covariance"] / gap["mean_squared_norm"], rel=1e-9, abs=1e-15
        )
        # the parabola: the excess variance of the mean baseline is E||s||^2 gap^2
        excess = gap["variance_at_mean"] - gap["variance_at_optimal"]
        assert excess == pytest.approx(
            gap["mean_squared_norm"] * gap["gap"] ** 2, rel=1e-9, abs=1e-15
        )
        assert gap["excess_variance"] >= 0


def test_uniform_policy_makes_the_mean_optimal_for_any_reward(setup):
    policy, _, _ = setup
    uniform = torch.zeros(policy.logits_shape, dtype=F64)
    # ||s||^2 = sum_t (1 - 1/V) for every sequence
    torch.testing.assert_close(
        squared_score_norms(policy, uniform),
        torch.full((27,), 3 * (1 - 1 / 3), dtype=F64),
        rtol=0,
        atol=1e-14,
    )
    reward = torch.rand(27, generator=torch.Generator().manual_seed(0), dtype=F64)
    gap = baseline_gap(policy, uniform, reward)
    assert abs(gap["gap"]) < 1e-14 and gap["excess_variance"] == pytest.approx(0, abs=1e-12)
    assert gap["correlation"] != gap["correlation"]  # nan: the norm is constant


def test_uncorrelated_reward_closes_the_gap(setup):
    policy, logits, rewards = setup
    assert abs(baseline_gap(policy, logits, rewards)["gap"]) > 1e-3
    constructed = uncorrelated_reward(policy, logits, rewards)
    gap = baseline_gap(policy, logits, constructed)
    assert abs(gap["covariance"]) < 1e-14 and abs(gap["gap"]) < 1e-14
    assert gap["mean_reward"] == pytest.approx(policy.objective(logits, rewards).item(), rel=1e-12)


def test_rank_reward_picks_the_rarest_or_likeliest(setup):
    policy, logits, _ = setup
    probs = policy.probs(logits)
    rare, likely = (
        rank_reward(policy, logits, 5, rarest=True),
        rank_reward(policy, logits, 5, rarest=False),
    )
    assert rare.sum() == likely.sum() == 5
    assert probs[rare == 1].max() < probs[rare == 0].min()
    assert probs[likely == 1].min() > probs[likely == 0].max()
    with pytest.raises(ValueError, match="num_rewarded"):
        rank_reward(policy, logits, 27, rarest=True)


@pytest.mark.parametrize("group_size", [2, 3, 5])
def test_group_variance_closed_forms_against_exact_enumeration(setup, group_size):
    policy, logits, rewards = setup
    closed = group_variances(policy, logits, rewards, group_size)
    rloo = group_estimator_moments(policy, logits, rewards, group_size, "rloo")
    mean_self = group_estimator_moments(policy, logits, rewards, group_size, "dr_grpo")
    exact_gradient = policy.exact_gradient(logits, rewards)
    assert closed["rloo"] == pytest.approx(rloo["variance"].item(), rel=1e-9)
    assert closed["mean_self"] == pytest.approx(mean_self["variance"].item(), rel=1e-9)
    mse = mean_self["variance"] + (mean_self["mean"] - exact_gradient).square().sum()
    assert closed["mean_self_mse"] == pytest.approx(mse.item(), rel=1e-9)
    mean_reward = policy.objective(logits, rewards).item()
    assert closed["oracle_mean"] == pytest.approx(
        estimator_variance(policy, logits, rewards, mean_reward).item() / group_size, rel=1e-12
    )
    assert closed["oracle_optimal"] <= closed["oracle_mean"] < closed["rloo"]


def test_group_variance_closed_form_against_monte_carlo_at_large_g(setup):
    policy, logits, rewards = setup
    group_size, num_groups = 32, 100_000  # C(58, 32) multisets: too many to enumerate
    estimates = sample_group_estimates(
        policy, logits, rewards, group_size, num_groups, torch.Generator().manual_seed(4), "rloo"
    )
    # relative sd of a 100k-sample variance of a near-Gaussian 30-dimensional vector: well under 1%
    assert estimates.var(dim=0).sum().item() == pytest.approx(
        group_variances(policy, logits, rewards, group_size)["rloo"], rel=0.03
    )
    with pytest.raises(ValueError, match="group_size"):
        group_variances(policy, logits, rewards, 1)


def test_token_score_norms_add_up_to_the_sequence_norm(setup):
    policy, logits, _ = setup
    torch.testing.assert_close(
        token_score_norms(policy, logits).sum(dim=1),
        squared_score_norms(policy, logits),
        rtol=0,
        atol=1e-13,
    )


def test_constant_token_baseline_is_chapter_one(setup):
    policy, logits, rewards = setup
    for b in [0.0, 0.4]:
        moments = token_baseline_moments(policy, logits, rewards, torch.full((27, 3), b, dtype=F64))
        assert moments["variance"].item() == pytest.approx(
            estimator_variance(policy, logits, rewards, b).item(), rel=1e-12
        )
        torch.testing.assert_close(
            moments["mean"], policy.exact_gradient(logits, rewards), rtol=0, atol=1e-14
        )


def test_value_baselines_are_conditional_success_rates(setup):
    policy, logits, rewards = setup
    values = value_baselines(policy, logits, rewards)
    probs = policy.probs(logits)
    assert values[:, 0].unique().tolist() == pytest.approx(
        [policy.objective(logits, rewards).item()], rel=1e-12
    )
    # prefix (1, 2): sequences 1*9 + 2*3 + {0, 1, 2}; the reward needs y_3 = 0
    block = slice(15, 18)
    by_hand = (probs[block] @ rewards[block] / probs[block].sum()).item()
    assert values[15, 2].item() == pytest.approx(by_hand, rel=1e-12)
    assert values[15, 2].item() == pytest.approx(
        torch.softmax(logits[2, 2], -1)[0].item(), rel=1e-12
    )


def test_optimal_token_baselines_are_unbiased_and_locally_optimal(setup):
    policy, logits, rewards = setup
    best = optimal_token_baselines(policy, logits, rewards)
    moments = token_baseline_moments(policy, logits, rewards, best)
    torch.testing.assert_close(
        moments["mean"], policy.exact_gradient(logits, rewards), rtol=0, atol=1e-14
    )
    for other in (value_baselines(policy, logits, rewards), torch.full((27, 3), 0.3, dtype=F64)):
        assert (
            moments["variance"] < token_baseline_moments(policy, logits, rewards, other)["variance"]
        )
    # moving any one prefix's baseline either way raises the variance
    for step, first, last in [(0, 0, 27), (1, 9, 18), (2, 3, 6)]:
        for delta in (-1e-3, 1e-3):
            moved = best.clone()
            moved[first:last, step] += delta
            assert (
                token_baseline_moments(policy, logits, rewards, moved)["variance"]
                > moments["variance"]
            )


def test_token_baselines_that_see_the_token_are_refused(setup):
    policy, logits, rewards = setup
    cheating = rewards[:, None].repeat(1, 3)  # b_t = r: zero "variance", but biased
    with pytest.raises(ValueError, match="prefix"):
        token_baseline_moments(policy, logits, rewards, cheating)


# -- the chapter's comparisons ----------------------------------------------------------------


def test_baseline_cases_are_the_six_settings(setup):
    policy, logits, rewards = setup
    peaked = policy.init_logits(seed=1, scale=3.0)
    cases = baseline_cases(policy, logits, peaked, 9)
    assert list(cases) == ["uniform", "chapter1", "uncorrelated", "peaked", "rare", "likely"]
    assert not cases["uniform"][1].any()
    assert cases["peaked"][1] is peaked and cases["chapter1"][2].equal(rewards)
    assert cases["rare"][2].sum() == 9 and cases["likely"][2].sum() == 9
    probs = policy.probs(logits)
    # the rare sequences are all less likely than the likely ones
    assert probs[cases["rare"][2] == 1].max() < probs[cases["likely"][2] == 1].min()
    gap = baseline_gap(policy, logits, cases["uncorrelated"][2])
    assert abs(gap["covariance"]) < 1e-12


def test_gap_table_holds_the_identity(setup):
    policy, logits, _ = setup
    cases = baseline_cases(policy, logits, policy.init_logits(seed=2, scale=3.0), 5)
    gaps = {key: baseline_gap(policy, lg, reward) for key, (_, lg, reward) in cases.items()}
    table = gap_table(gaps, cases)
    assert list(table.index) == [label for label, _, _ in cases.values()]
    assert (table["gap"] - table["Cov / E||s||^2"]).abs().max() < 1e-12
    assert table.loc["rare answers rewarded", "gap"] == gaps["rare"]["gap"]


def test_variance_curve_is_the_parabola_with_vertex_b_star(setup):
    policy, logits, rewards = setup
    gap = baseline_gap(policy, logits, rewards)
    baselines, variance = variance_curve(policy, logits, rewards, gap, 5)
    half_width = max(3 * abs(gap["gap"]), 0.1)
    assert baselines[0].item() == pytest.approx(gap["optimal_baseline"] - half_width)
    assert variance[2].item() == pytest.approx(1.0, rel=1e-12)  # the middle point is b*
    # Var[g_b] = Var[g_b*] + E||s||^2 (b - b*)^2
    expected = (
        1
        + gap["mean_squared_norm"]
        * (baselines - gap["optimal_baseline"]) ** 2
        / gap["variance_at_optimal"]
    )
    torch.testing.assert_close(variance, expected, rtol=1e-10, atol=0)


def test_group_variance_table_replays_the_sampler(setup):
    policy, logits, rewards = setup
    groups = group_variance_table(
        policy, logits, rewards, [2, 5], 500, torch.Generator().manual_seed(4)
    )
    generator = torch.Generator().manual_seed(4)
    for size in (2, 5):
        estimates = sample_group_estimates(policy, logits, rewards, size, 500, generator, "rloo")
        assert groups.loc[size, "rloo, Monte Carlo"] == float(estimates.var(dim=0).sum())
        closed = group_variances(policy, logits, rewards, size)
        assert groups.loc[size, "rloo / oracle E[r]"] == closed["rloo"] / closed["oracle_mean"]
        assert groups.loc[size, "mean-self MSE / rloo"] == pytest.approx(
            (1 - 1 / size) ** 2
            + float(policy.exact_gradient(logits, rewards).square().sum())
            / size**2
            / closed["rloo"]
        )


def test_token_baseline_comparison(setup):
    policy, logits, rewards = setup
    candidates = token_baseline_candidates(policy, logits, rewards)
    mean_reward = float(policy.objective(logits, rewards))
    assert (candidates["constant E[r]"] == mean_reward).all()
    assert (candidates["none"] == 0).all()
    policies = {"a": ("policy a", logits), "b": ("policy b", policy.init_logits(seed=5))}
    per_token, unbiased_error, last_token_gaps = token_baseline_comparison(
        policy, policies, rewards
    )
    assert list(per_token.columns) == ["policy a", "policy b"]
    assert (per_token.loc["constant E[r]"] == 1.0).all()
    assert unbiased_error < 1e-12
    # the per-token optimum beats the constant optimum it generalises
    assert (per_token.loc["per-token optimal b*_t(y_<t)"] <= per_token.loc["constant b*"]).all()
    gap = (
        candidates["per-token optimal b*_t(y_<t)"][:, -1]
        - candidates["per-token value V(y_<t)"][:, -1]
    )
    assert last_token_gaps["a"] == pytest.approx(float(policy.probs(logits) @ gap.abs()))
    direct = token_baseline_moments(policy, logits, rewards, candidates["constant b*"])
    reference = token_baseline_moments(policy, logits, rewards, candidates["constant E[r]"])
    assert per_token.loc["constant b*", "policy a"] == pytest.approx(
        float(direct["variance"] / reference["variance"]), rel=1e-12
    )


def test_figures_draw_every_case_and_curve(setup):
    import matplotlib

    matplotlib.use("Agg")
    from grpo_companion.chapters.baselines.plots import (
        GROUP_CURVES,
        plot_group_estimator_variance,
        plot_variance_vs_baseline,
    )

    policy, logits, rewards = setup
    cases = baseline_cases(policy, logits, policy.init_logits(seed=2, scale=3.0), 5)
    gaps = {key: baseline_gap(policy, lg, reward) for key, (_, lg, reward) in cases.items()}
    curves = {
        key: variance_curve(policy, lg, r, gaps[key], 11) for key, (_, lg, r) in cases.items()
    }
    labels = {key: label for key, (label, _, _) in cases.items()}
    fig = plot_variance_vs_baseline(curves, gaps, labels)
    assert [ax.get_title() for ax in fig.axes] == list(labels.values())
    groups = group_variance_table(policy, logits, rewards, [2, 4], 50, torch.Generator())
    fig = plot_group_estimator_variance(groups)
    assert len(fig.axes[0].lines) == len(GROUP_CURVES) + 1


# --- verl's baselines and the KL placement ------------------------------------------------


def test_greedy_sequence_follows_the_argmax_token_by_token():
    from grpo_companion.chapters.baselines.tokens import greedy_sequence

    policy = SequencePolicy(vocab_size=3, length=2)
    logits = torch.zeros(policy.logits_shape, dtype=F64)
    logits[0, 3, 2] = 1.0  # from BOS, token 2
    logits[1, 2, 1] = 1.0  # after 2, token 1
    logits[1, 0, 0] = 5.0  # a likelier continuation of a prefix greedy never visits
    assert greedy_sequence(policy, logits) == 2 * 3 + 1


def test_otb_is_unbiased_and_ends_at_b_star():
    from grpo_companion.chapters.baselines.tokens import otb_baselines
    from grpo_companion.core.policy_gradient import optimal_baseline

    policy = SequencePolicy(vocab_size=3, length=3)
    logits = policy.init_logits(1, scale=1.5)
    rewards = sum_mod_reward(policy.all_sequences(), 3)
    baselines = otb_baselines(policy, logits, rewards)
    assert baselines[:, -1].sub(optimal_baseline(policy, logits, rewards)).abs().max() < 1e-12
    assert (baselines - baselines[:1]).abs().max() == 0  # one baseline per position
    moments = token_baseline_moments(policy, logits, rewards, baselines)
    assert (moments["mean"] - policy.exact_gradient(logits, rewards)).abs().max() < 1e-12


def test_verl_baseline_table_matches_the_parabola_and_the_closed_form():
    from grpo_companion.chapters.baselines.tokens import greedy_sequence, verl_baseline_table

    policy = SequencePolicy(vocab_size=3, length=3)
    logits = policy.init_logits(2, scale=1.5)
    rewards = sum_mod_reward(policy.all_sequences(), 3)
    table, greedy = verl_baseline_table(policy, {"a": ("A", logits)}, rewards, [2, 8])
    assert greedy["a"] == rewards[greedy_sequence(policy, logits)].item()
    mean_reward = float(policy.objective(logits, rewards))
    expected = estimator_variance(policy, logits, rewards, greedy["a"]) / estimator_variance(
        policy, logits, rewards, mean_reward
    )
    assert table.loc["ReMax: r(greedy)", "A"] == pytest.approx(float(expected), rel=1e-12)
    variances = group_variances(policy, logits, rewards, 8)
    ratio = variances["rloo"] / variances["oracle_mean"]
    assert table.loc["RLOO, G = 8", "A"] == pytest.approx(ratio, rel=1e-12)
    assert table.loc["constant b*", "A"] <= 1.0


def _per_token_reverse_kl_gradient(policy, logits, ref_logits):
    """grad of sum_t E_{y<t ~ pi (held fixed)} KL(pi_ref(. | y_{t-1}) || pi(. | y_{t-1}))."""
    sequences = policy.all_sequences()
    probs = policy.probs(logits).detach()
    contexts = torch.cat(
        [torch.full_like(sequences[:, :1], policy.vocab_size), sequences[:, :-1]], 1
    )
    steps = torch.arange(policy.length)
    theta = logits.detach().requires_grad_(True)
    log_pi = torch.log_softmax(theta, -1)[steps, contexts]  # (n, L, V)
    log_ref = torch.log_softmax(ref_logits, -1)[steps, contexts]
    kl = (log_ref.exp() * (log_ref - log_pi)).sum(dim=(1, 2))
    (gradient,) = torch.autograd.grad(probs @ kl, theta)
    return gradient.flatten()


def test_kl_placement_identities():
    from grpo_companion.chapters.baselines.optimal import kl_placement
    from grpo_companion.core.kl import kl_estimate_gradients

    policy = SequencePolicy(vocab_size=3, length=3)
    logits, ref_logits = policy.init_logits(0, scale=2.0), policy.init_logits(0, scale=1.0)
    rewards = sum_mod_reward(policy.all_sequences(), 3)
    result = kl_placement(policy, logits, ref_logits, rewards, beta=0.3)
    probs = policy.probs(logits)
    log_ratio = policy.log_prob(logits, policy.all_sequences()) - policy.log_prob(
        ref_logits, policy.all_sequences()
    )
    assert result["divergence"] == pytest.approx(float(probs @ log_ratio), rel=1e-12)
    assert result["reward_error"] < 1e-12
    assert result["loss_k1_norm"] < 1e-12
    assert 0 < result["loss_k3_cosine"] < 1 - 1e-3  # not the sequence-level KL's gradient
    expected_k3 = probs @ kl_estimate_gradients(policy, logits, ref_logits, "k3")
    reverse = _per_token_reverse_kl_gradient(policy, logits, ref_logits)
    assert (expected_k3 - reverse).abs().max() < 1e-12
    same = kl_placement(policy, logits, logits, rewards, beta=0.3)
    assert same["divergence"] == pytest.approx(0.0, abs=1e-12)
    assert same["reward_variance"] == pytest.approx(1.0, rel=1e-12)
    assert same["loss_k3_variance"] == pytest.approx(1.0, rel=1e-12)


def test_kl_in_reward_with_rloo_groups_is_unbiased_for_the_regularised_objective():
    """Every group of G = 2 enumerated: the RLOO update on r - beta k1 has mean
    grad J - beta grad KL, the group-mean update (1 - 1/G) times it."""
    from grpo_companion.core.advantages import group_advantages
    from grpo_companion.core.kl import kl_in_reward

    policy = SequencePolicy(vocab_size=2, length=2)
    logits, ref_logits = policy.init_logits(3, scale=1.5), policy.init_logits(4, scale=1.0)
    sequences = policy.all_sequences()
    rewards = sum_mod_reward(sequences, 2)
    k1 = (policy.log_prob(logits, sequences) - policy.log_prob(ref_logits, sequences)).detach()
    probs, scores = policy.probs(logits).detach(), policy.scores(logits, sequences)
    beta, n = 0.5, policy.num_sequences
    first, second = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    pairs = torch.stack([first.flatten(), second.flatten()], dim=1)  # (n^2, 2)
    shaped = kl_in_reward(rewards[pairs], k1[pairs], beta)
    weights = probs[pairs].prod(dim=1)
    theta = logits.detach().requires_grad_(True)
    ref_log_probs = policy.log_prob(ref_logits, sequences).detach()
    kl = policy.probs(theta) @ (policy.log_prob(theta, sequences) - ref_log_probs)
    (grad_kl,) = torch.autograd.grad(kl, theta)
    target = policy.exact_gradient(logits, rewards) - beta * grad_kl.flatten()
    for method, factor in [("rloo", 1.0), ("dr_grpo", 0.5)]:
        advantages = group_advantages(shaped, method)
        updates = (advantages[..., None] * scores[pairs]).mean(dim=1)
        assert (weights @ updates - factor * target).abs().max() < 1e-12


def _ordered_groups(policy, group_size):
    """Every ordered group of `group_size` sequences, `(M, G)`."""
    import itertools

    return torch.tensor(list(itertools.product(range(policy.num_sequences), repeat=group_size)))


@pytest.mark.parametrize("group_size", [2, 3])
def test_section_3s_derivation_x_minus_y_term_by_term(setup, group_size):
    """g_rloo = X - Y over every ordered group: X = (1/G) sum_i d_i s_i, the oracle, has
    Var[X] = Var[g_E[r]] / G; Y = sum_{i != j} d_j s_i / (G (G - 1)) has mean 0, is uncorrelated
    with X, and E||Y||^2 = (Var(r) E||s||^2 + ||grad J||^2) / (G (G - 1)): the page's closed
    form."""
    policy, logits, rewards = setup
    probs = policy.probs(logits).detach()
    scores = policy.scores(logits, policy.all_sequences())
    mu = float(probs @ rewards)
    members = _ordered_groups(policy, group_size)
    weights = probs[members].prod(dim=1)
    d, s = rewards[members] - mu, scores[members]  # (M, G), (M, G, P)
    x = (d[..., None] * s).mean(dim=1)
    others = (d.sum(dim=1, keepdim=True) - d) / (group_size - 1)  # mean of the other d_j
    y = (others[..., None] * s).mean(dim=1)
    advantages = rewards[members] - (
        rewards[members].sum(dim=1, keepdim=True) - rewards[members]
    ) / (group_size - 1)
    torch.testing.assert_close(
        x - y, (advantages[..., None] * s).mean(dim=1), rtol=1e-12, atol=1e-14
    )
    gradient = policy.exact_gradient(logits, rewards)
    torch.testing.assert_close(weights @ x, gradient, rtol=1e-10, atol=1e-14)
    assert (weights @ y).abs().max().item() < 1e-14
    assert (weights @ (x * y).sum(dim=1)).item() == pytest.approx(0.0, abs=1e-14)
    variance_x = weights @ (x - gradient).square().sum(dim=1)
    oracle = estimator_variance(policy, logits, rewards, mu).item()
    assert variance_x.item() == pytest.approx(oracle / group_size, rel=1e-10)
    reward_variance = float(probs @ (rewards - mu) ** 2)
    mean_norm = float(probs @ squared_score_norms(policy, logits))
    expected = (reward_variance * mean_norm + gradient.square().sum().item()) / (
        group_size * (group_size - 1)
    )
    assert (weights @ y.square().sum(dim=1)).item() == pytest.approx(expected, rel=1e-10)
    closed = group_variances(policy, logits, rewards, group_size)["rloo"]
    assert closed == pytest.approx(oracle / group_size + expected, rel=1e-12)


def test_the_price_of_the_estimated_baseline_is_chapter_10s_pair_noise(setup):
    """Var(r) E||s||^2 + ||grad J||^2 = 2 zeta_2 - 4 zeta_1, with zeta_2 = E||h - grad J||^2
    over every pair and 4 zeta_1 = Var[g_J], the oracle's one-sample variance."""
    policy, logits, rewards = setup
    probs = policy.probs(logits).detach()
    scores = policy.scores(logits, policy.all_sequences())
    mu = float(probs @ rewards)
    gradient = policy.exact_gradient(logits, rewards)
    kernel = (
        0.5
        * (rewards[:, None] - rewards[None, :])[..., None]
        * (scores[:, None, :] - scores[None, :, :])
    )
    pair_probs = probs[:, None] * probs[None, :]
    zeta_2 = (pair_probs * (kernel - gradient).square().sum(dim=-1)).sum().item()
    four_zeta_1 = estimator_variance(policy, logits, rewards, mu).item()
    price = float(probs @ (rewards - mu) ** 2) * float(probs @ squared_score_norms(policy, logits))
    price += gradient.square().sum().item()
    assert 2 * zeta_2 - four_zeta_1 == pytest.approx(price, rel=1e-10)


def test_shrinkage_beats_rloo_on_mse_exactly_when_the_mean_is_small(setup):
    """Problem 2: MSE((1 - 1/G) g) < MSE(g) = Var iff ||E g||^2 < (2G - 1) Var, for unbiased g;
    on the policy, the closed forms' mean-self MSE against RLOO's variance, and by numbers."""
    policy, logits, rewards = setup
    squared_mean = policy.exact_gradient(logits, rewards).square().sum().item()
    for group_size in (2, 8, 64):
        closed = group_variances(policy, logits, rewards, group_size)
        c = 1 - 1 / group_size
        assert closed["mean_self_mse"] == pytest.approx(
            c**2 * closed["rloo"] + (1 - c) ** 2 * squared_mean, rel=1e-12
        )
        wins = closed["mean_self_mse"] < closed["rloo"]
        assert wins == (squared_mean < (2 * group_size - 1) * closed["rloo"]) and wins
    for group_size in (2, 4, 16):
        for variance in (0.1, 1.0):
            bound = (2 * group_size - 1) * variance
            for mean_sq in (0.5 * bound, 2.0 * bound):
                c = 1 - 1 / group_size
                shrunk = c**2 * variance + (1 - c) ** 2 * mean_sq
                assert (shrunk < variance) == (mean_sq < bound)


def test_the_kl_term_breaks_the_shrinkage_by_g_over_g_minus_1():
    """Problem 3 and the section 6 box: (1 - 1/G) grad J - beta k is (1 - 1/G) times RLOO's
    update with beta G / (G - 1); the cosine is 1 at beta = 0 and below 1 otherwise."""
    from grpo_companion.chapters.baselines.optimal import shrinkage_with_kl_cosine

    generator = torch.Generator().manual_seed(0)
    gradient, kl = torch.randn(2, 12, dtype=F64, generator=generator)
    assert shrinkage_with_kl_cosine(gradient, kl, 0.0, 2) == pytest.approx(1.0, abs=1e-15)
    for group_size in (2, 8):
        beta = 0.3
        shrunk = (1 - 1 / group_size) * gradient - beta * kl
        rescaled = gradient - beta * group_size / (group_size - 1) * kl
        torch.testing.assert_close(shrunk, (1 - 1 / group_size) * rescaled)
        cosine = shrinkage_with_kl_cosine(gradient, kl, beta, group_size)
        expected = shrunk @ (gradient - beta * kl) / (shrunk.norm() * (gradient - beta * kl).norm())
        assert cosine == pytest.approx(float(expected), rel=1e-12) and cosine < 1
    assert shrinkage_with_kl_cosine(gradient, kl, 0.3, 2) < shrinkage_with_kl_cosine(
        gradient, kl, 0.3, 8
    )
