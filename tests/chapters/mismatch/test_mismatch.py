"""Chapter 13's module: the exact moments of the corrected GRPO estimator under a sampler that is
not the policy, against enumeration of every group and against Monte Carlo, and the identities
the page states.

Tolerances: exact moments against the enumeration of all multisets of a group, and identities
that hold exactly, 1e-12 (float64 sums of a few thousand terms). Monte Carlo: the mean error
statistic ||mean of n estimates - E g||^2 / (Var g / n) has mean 1 whatever the covariance; the
widest case of its law is the chi-square with one degree of freedom, above 10 with probability
0.0016, so it is held below 10; the sampled variance within 10% of the exact one at n = 4000.
"""

import math

import matplotlib.pyplot as plt
import pytest
import torch

from grpo_companion.chapters.mismatch.corrections import (
    CORRECTIONS,
    Correction,
    correction,
    settings_table,
    token_weights,
)
from grpo_companion.chapters.mismatch.exact import (
    NO_MISMATCH,
    binary_group_moments,
    corrected_score_table,
    mismatch_log_ratios,
    mismatch_sizes,
    mismatch_table,
    monte_carlo_check,
    on_policy_moments,
    sampler_logits,
    top_p_ratio_means,
)
from grpo_companion.chapters.mismatch.plots import plot_bias_variance
from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.group_estimators import group_estimator_moments, multisets
from grpo_companion.core.policy_gradient import SequencePolicy, sum_mod_reward

EXACT = 1e-12
ADVANTAGES = {"method": "grpo", "scale_rewards": "none"}  # the chapter's: Dr. GRPO's


def setting(vocab_size=3, length=4, seed=0, scale=1.5):
    policy = SequencePolicy(vocab_size=vocab_size, length=length)
    logits = policy.init_logits(seed, scale=scale)
    return policy, logits, sum_mod_reward(policy.all_sequences(), vocab_size)


def enumerated_moments(probs, rewards, table, group_size, **options):
    """E[g] and Var[g] by summing over every multiset of a group, weighted by its multinomial
    probability under `probs`: no use of the binary-reward formula."""
    members, log_multiplicity = multisets(len(probs), group_size)
    with torch.no_grad():
        weights = (log_multiplicity + probs.log()[members].sum(dim=1)).exp().nan_to_num(0.0)
    advantages = group_advantages(rewards[members], **options)
    estimates = torch.einsum("mg,mgp->mp", advantages, table[members]) / group_size
    mean = weights @ estimates
    return mean, weights @ (estimates - mean).square().sum(dim=1)


def test_the_on_policy_moments_are_chapter_2s():
    policy, logits, rewards = setting(vocab_size=2, length=3)
    for options in (ADVANTAGES, {"method": "grpo", "scale_rewards": "group"}, {"method": "rloo"}):
        ours = on_policy_moments(policy, logits, rewards, 4, **options)
        theirs = group_estimator_moments(policy, logits, rewards, 4, **options)
        assert (ours["mean"] - theirs["mean"]).abs().max() <= EXACT
        assert abs(float(ours["variance"] - theirs["variance"])) <= EXACT
    on_policy = on_policy_moments(policy, logits, rewards, 8, **ADVANTAGES)["mean"]
    assert (on_policy - (1 - 1 / 8) * policy.exact_gradient(logits, rewards)).abs().max() <= EXACT


@pytest.mark.parametrize("name", [row.name for row in CORRECTIONS])
@pytest.mark.parametrize(
    ("mismatch", "size"), [("temperature", 0.6), ("top_p", 0.8), ("rounding", 2)]
)
def test_the_binary_formula_is_the_enumeration_of_every_group(name, mismatch, size):
    policy, logits, rewards = setting(vocab_size=2, length=3)
    sampler = sampler_logits(logits, mismatch, size)
    parts = corrected_score_table(policy, logits, sampler, rewards, correction(name))
    ours = binary_group_moments(parts["probs"], rewards, parts["table"], 4, **ADVANTAGES)
    mean, variance = enumerated_moments(parts["probs"], rewards, parts["table"], 4, **ADVANTAGES)
    assert (ours["mean"] - mean).abs().max() <= EXACT
    assert abs(float(ours["variance"]) - float(variance)) <= EXACT


def test_without_a_mismatch_every_correction_is_the_on_policy_estimator():
    policy, logits, rewards = setting()
    mismatches = {name: [size] for name, size in NO_MISMATCH.items()}
    table = mismatch_table(policy, logits, rewards, 8, mismatches, **ADVANTAGES)
    assert len(table) == 3 * len(CORRECTIONS)
    assert table["bias"].max() <= EXACT
    assert (table["variance"] - 1).abs().max() <= 1e-9
    assert (table["kept"] - 1).abs().max() <= EXACT and (table["zeroed"] == 0).all()


def test_sequence_importance_sampling_is_unbiased_with_full_support_only():
    policy, logits, rewards = setting()
    mismatches = {"temperature": [0.6, 0.8, 1.3], "rounding": [6, 3], "top_p": [0.9, 0.8]}
    table = mismatch_table(policy, logits, rewards, 8, mismatches, **ADVANTAGES).set_index(
        ["mismatch", "size", "correction"]
    )
    for name, sizes in mismatches.items():
        for size in sizes:
            row = table.loc[(name, size, "sequence IS")]
            none = table.loc[(name, size, "none")]
            if name == "top_p":  # sequences outside the nucleus are lost for good
                assert row["bias"] > 0.01
            else:
                assert row["bias"] <= EXACT and abs(row["cosine"] - 1) <= EXACT
                assert none["bias"] > 1e-3
    # token-level weights leave a bias at every temperature, on the order of no correction's
    for size in mismatches["temperature"]:
        assert (
            table.loc[("temperature", size, "token IS"), "bias"]
            > 0.5 * table.loc[("temperature", size, "none"), "bias"]
        )


def test_caps_sit_between_plain_importance_sampling_and_none():
    policy, logits, rewards = setting(length=6)
    table = mismatch_table(policy, logits, rewards, 8, {"temperature": [0.7]}, **ADVANTAGES)
    table = table.set_index("correction")
    for capped in ("sequence_mask 3", "sequence_truncate 3"):
        assert 0 < table.loc[capped, "bias"] < table.loc["none", "bias"]
        assert table.loc["none", "variance"] < table.loc[capped, "variance"]
        assert table.loc[capped, "variance"] < table.loc["sequence IS", "variance"]


@pytest.mark.parametrize(
    ("mismatch", "size"), [("temperature", 0.7), ("top_p", 0.9), ("rounding", 3)]
)
def test_exact_moments_against_monte_carlo(mismatch, size):
    policy, logits, rewards = setting()
    names = (
        "none",
        "token_mask 3",
        "sequence_mask 3",
        "sequence TIS 2 + RS 0.5-2",
        "bypass PPO-clip",
    )
    rows = [correction(name) for name in names]
    check = monte_carlo_check(
        policy, logits, rewards, 8, mismatch, size, 4000, 1, corrections=rows, **ADVANTAGES
    )
    assert check["mean_error"].max() < 10
    assert check["variance_error"].abs().max() < 0.1


def test_a_row_that_rejects_everything_updates_nothing():
    policy, logits, rewards = setting()
    rows = [correction("geometric RS 0.999-1.001")]
    check = monte_carlo_check(policy, logits, rewards, 4, "top_p", 0.7, 200, 0, corrections=rows,
                              **ADVANTAGES)  # fmt: skip
    parts = corrected_score_table(
        policy, logits, sampler_logits(logits, "top_p", 0.7), rewards, rows[0]
    )
    assert parts["kept"] == 0 and check["max_abs_estimate"].item() == 0
    assert math.isnan(check["mean_error"].item())


def test_token_weights_per_row():
    policy, logits, rewards = setting()
    sequences = policy.all_sequences()
    sampler = sampler_logits(logits, "temperature", 0.7)
    log_ratio = mismatch_log_ratios(policy, logits, sampler, sequences).detach()
    mask = torch.ones_like(log_ratio)
    ratio, sequence_ratio = log_ratio.exp(), log_ratio.sum(dim=1, keepdim=True).exp()
    weights = {row.name: token_weights(row, log_ratio, mask, rewards) for row in CORRECTIONS}
    assert torch.equal(weights["none"][0], mask)
    assert torch.allclose(weights["token IS"][0], ratio, rtol=EXACT)
    assert torch.allclose(weights["sequence IS"][0], sequence_ratio.expand_as(mask), rtol=EXACT)
    masked = torch.where(sequence_ratio > 3, 0.0, sequence_ratio).expand_as(mask)
    assert torch.equal(weights["sequence_mask 3"][0], masked)
    # verl's rejection: the weights are 0 exactly where the mask rejects
    k3, kept = weights["K3 RS 0.01"]
    assert torch.equal(k3, kept) and 0 < kept.mean() < 1
    is_rs, kept = weights["sequence TIS 2 + RS 0.5-2"]
    in_bounds = (sequence_ratio >= 0.5) & (sequence_ratio <= 2)
    assert torch.equal(kept, in_bounds.double().expand_as(mask)) and 0 < kept.mean() < 1
    assert torch.allclose(is_rs, (sequence_ratio.clamp(max=2) * in_bounds).expand_as(mask))
    assert torch.equal(weights["geometric RS 0.999-1.001"][1], 0 * mask)  # rejects everything
    # bypass PPO-clip: chapter 3's weight, the ratio inside the clip region and 0 outside it
    bypass, _ = weights["bypass PPO-clip"]
    positive = rewards[:, None] > 0
    inside = torch.where(positive, ratio <= 1.2, (ratio >= 0.8) & (ratio <= 3.0))
    assert torch.allclose(bypass, torch.where(inside, ratio, 0.0), rtol=EXACT)
    assert (bypass == 0).any() and (bypass > 0).any()


def test_the_normaliser_is_the_only_difference_between_trls_mask_and_verls_rejection():
    """Exercise 3: TRL's sequence_mask on [0.5, 2] and verl's decoupled_seq_is_rs() weigh a
    kept sequence alike; verl divides by the kept fraction eta, so E[g] is 1/eta times TRL's and
    Var[g] 1/eta^2 times."""
    policy, logits, rewards = setting(length=6)
    sampler = sampler_logits(logits, "temperature", 0.7)
    trl = Correction("trl", mode="sequence_mask", clip_min=0.5, clip_max=2.0)
    verl = correction("sequence TIS 2 + RS 0.5-2")
    parts = {row.name: corrected_score_table(policy, logits, sampler, rewards, row)
             for row in (trl, verl)}  # fmt: skip
    moments = {name: binary_group_moments(part["probs"], rewards, part["table"], 8, **ADVANTAGES)
               for name, part in parts.items()}  # fmt: skip
    eta = parts[verl.name]["kept"]
    assert 0.5 < eta < 1 and parts["trl"]["kept"] == pytest.approx(1, abs=EXACT)
    assert torch.allclose(moments[verl.name]["mean"], moments["trl"]["mean"] / eta, rtol=1e-10)
    assert moments[verl.name]["variance"] == pytest.approx(
        float(moments["trl"]["variance"]) / eta**2, rel=1e-10
    )


def test_top_p_ratio_is_the_kept_mass():
    policy, logits, _ = setting()
    means = top_p_ratio_means(policy, logits, 0.9, 20_000, 0)
    assert means["max_context_error"] <= EXACT
    assert means["sampled_mean_ratio"] == pytest.approx(means["sampled_mean_kept_mass"], abs=EXACT)
    assert 0.9 <= means["min_kept_mass"] and means["exact_mean_ratio"] < 1
    sizes = mismatch_sizes(policy, logits, {"top_p": [0.9]}).iloc[0]
    assert sizes["lost_mass"] > 0 and sizes["above_cap"] == 0


def test_exercise_1_shorter_sequences_shrink_the_sequence_weights_spread():
    """The solution's prediction at the cold sampler: with length 3 instead of 6, plain sequence
    IS's variance ratio and sequence_mask's bias both fall, and token IS stays biased."""
    rows = [correction(name) for name in ("token IS", "sequence IS", "sequence_mask 3")]
    results = {}
    for length in (6, 3):
        policy, logits, rewards = setting(length=length)
        table = mismatch_table(
            policy, logits, rewards, 8, {"temperature": [0.7]}, rows, **ADVANTAGES
        )
        results[length] = table.set_index("correction")
    assert results[3].loc["sequence IS", "variance"] < results[6].loc["sequence IS", "variance"]
    assert results[3].loc["sequence_mask 3", "bias"] < results[6].loc["sequence_mask 3", "bias"]
    assert results[3].loc["token IS", "bias"] > 0.1


def test_the_settings_table_names_a_library_setting_for_every_row():
    table = settings_table()
    assert list(table.index) == [row.name for row in CORRECTIONS]
    assert len(set(table.index)) == len(table)
    assert ((table.iloc[:, 0] != "-") | (table.iloc[:, 1] != "-")).all()
    assert "the default" in table.loc["sequence_mask 3"].iloc[0]
    with pytest.raises(ValueError, match="no correction"):
        correction("sequence_clip")


def test_the_figure_has_a_line_per_correction_and_its_legend_outside():
    policy, logits, rewards = setting(length=3)
    mismatches = {"temperature": [0.8, 1.0], "top_p": [1.0, 0.9], "rounding": [53, 4]}
    table = mismatch_table(policy, logits, rewards, 4, mismatches, **ADVANTAGES)
    names = [row.name for row in CORRECTIONS]
    fig = plot_bias_variance(table, names)
    assert len(fig.axes) == 6 and all(len(ax.lines) == len(names) for ax in fig.axes)
    assert [text.get_text() for text in fig.legends[0].get_texts()] == names
    plt.close(fig)
