"""Chapter 7's experiment: the rank statements of `rank`'s docstring, exactly on the
enumerable sequence policy; the candidates measured over many groups; one language model
measured end to end; the tables, records and verdict of `rank_verdict`; the figures."""

import math

import matplotlib
import pandas as pd
import pytest
import torch
from tiny_llama_batch import padded_batch, tiny_llama

from grpo_companion.chapters.rank.bootstrap import (
    bootstrap_interval,
    change_over_sizes,
    prompt_weights,
    resampled_means,
)
from grpo_companion.chapters.rank.factorial import (
    factorial_advantages,
    factorial_frame,
    factorial_grams,
    level_mixing,
    near_miss_reward,
    sequence_factorial,
)
from grpo_companion.chapters.rank.groups import (
    GROUP_CANDIDATES,
    candidate_matrices,
    centroid_coefficient,
    centroid_difference,
    class_sums,
    disjoint_groups,
    group_candidate_grams,
    group_gradient_gram,
    group_gradient_ranks,
    group_rank_frame,
    mechanism,
    reward_levels,
    sequence_policy_ranks,
    sequence_reward_tables,
)
from grpo_companion.chapters.rank.measure import (
    group_loss,
    measure,
)
from grpo_companion.chapters.rank.plots import (
    plot_factorial,
    plot_ranks,
    plot_singular_values,
    plot_stable_rank_by_k,
    plot_weight_spectra,
)
from grpo_companion.chapters.rank.verdict import (
    candidate_table,
    cell_records,
    classify_ranks,
    entropy_table,
    factorial_summary,
    group_size_records,
    headline_records,
    model_slug,
    overview,
    rank_change_records,
    reading_records,
    readings_text,
    stable_rank_by_k,
    summarise_ranks,
    verdict,
)
from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.group_estimators import group_gradient
from grpo_companion.core.policy_gradient import SequencePolicy, sum_mod_reward
from grpo_companion.core.spectra import effective_rank, gram_singular_values, weighted_gram
from grpo_companion.lm.gradients import score_rows
from grpo_companion.lm.gsm8k import graded_reward, load_gsm8k
from grpo_companion.lm.steps import ternary_reward

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def batch():
    return padded_batch()


@pytest.fixture(scope="module")
def sequence_policy():
    policy = SequencePolicy(vocab_size=3, length=3)
    logits = policy.init_logits(seed=2)
    all_sequences = policy.all_sequences()
    rewards = sum_mod_reward(all_sequences, policy.vocab_size)  # 9 of the 27 are correct
    return policy, logits, all_sequences, rewards


def _group(sequence_policy, indices):
    policy, logits, all_sequences, rewards = sequence_policy
    sequences = all_sequences[torch.tensor(indices)]
    return policy.scores(logits, sequences), rewards[torch.tensor(indices)]


GROUP = [0, 4, 7, 13, 20, 22, 24, 26]  # sequences 0, 4, 20 are correct: k = 3 of R = 8
SIXTEEN = [0, 1, 3, 5, 7, 9, 11, 12, 13, 15, 17, 19, 21, 23, 25, 26]  # 4 correct


def test_group_gradient_is_a_multiple_of_the_centroid_difference(sequence_policy):
    scores, rewards = _group(sequence_policy, GROUP[:5])  # k = 3 of R = 5: no symmetry
    k, size = 3, 5
    assert rewards.sum().item() == k
    difference = centroid_difference(scores, rewards)
    std = math.sqrt(k * (size - k) / (size * (size - 1)))  # Bessel, as group_advantages
    expected = {
        "dr_grpo": k * (size - k) / size,
        "grpo": k * (size - k) / size / (std + 1e-4),
        "rloo": k * (size - k) / (size - 1),
    }
    for method, c in expected.items():
        advantages = group_advantages(rewards[None], method)[0]
        assert centroid_coefficient(rewards, advantages) == pytest.approx(c, rel=1e-12)
        # S^T A = sum_i A_i s_i is G times the group's gradient g.
        torch.testing.assert_close(
            size * group_gradient(scores, advantages), c * difference, rtol=0, atol=1e-12
        )
    # "sign" is not zero-sum unless k = R / 2.
    with pytest.raises(ValueError, match="zero-sum"):
        centroid_coefficient(rewards, group_advantages(rewards[None], "sign")[0])
    with pytest.raises(ValueError, match="within a reward class"):
        centroid_coefficient(rewards, torch.tensor([0.5, -0.5, 0.1, -0.2, 0.1]).double())


def test_the_rank_two_matrix_is_the_class_sums(sequence_policy):
    scores, rewards = _group(sequence_policy, GROUP)
    sums = class_sums(scores, rewards)
    assert torch.linalg.matrix_rank(sums).item() == 2
    for method in ("grpo", "sign", "softmax"):  # any advantage equal within reward classes
        g = group_gradient(scores, group_advantages(rewards[None], method)[0])
        coefficients = torch.linalg.lstsq(sums.T, g[:, None]).solution
        torch.testing.assert_close(sums.T @ coefficients, g[:, None], rtol=0, atol=1e-12)


def test_weighted_rows_have_the_rank_of_the_scores_not_two(sequence_policy):
    policy, logits, all_sequences, _ = sequence_policy
    # Every score lives in the tangent space of the softmaxes it touches: 2 dimensions for
    # BOS at step 0, 2 x 3 contexts at steps 1 and 2, so rank <= 14 < 27 sequences.
    assert torch.linalg.matrix_rank(policy.scores(logits, all_sequences)).item() == 14

    def rank(matrix):
        return torch.linalg.matrix_rank(matrix).item()

    for indices, expected in [(GROUP[1:3], 2), (GROUP[:4], 4), (GROUP, 8), (SIXTEEN, 14)]:
        scores, group_rewards = _group(sequence_policy, indices)
        advantages = group_advantages(group_rewards[None], "grpo")[0]
        assert (advantages != 0).all()
        assert rank(advantages[:, None] * scores) == rank(scores) == expected
    # Continuous rewards: a reward at the group mean has A = 0 and drops out of the rank.
    scores, _ = _group(sequence_policy, GROUP)
    continuous = torch.tensor([1.0, 0.5, 0.0, 0.5, 0.25, 0.75, 0.5, 0.5]).double()
    advantages = group_advantages(continuous[None], "grpo")[0]
    nonzero = advantages != 0
    assert nonzero.sum().item() == 4
    weighted = advantages[:, None] * scores
    assert rank(weighted) == rank(scores[nonzero]) == 4 < rank(scores) == 8
    # The same through the Gram matrix, as the streaming path sees it.
    sigma = gram_singular_values(weighted_gram(scores @ scores.T, advantages))
    assert (sigma > 1e-8 * sigma[0]).sum().item() == 4


def test_reward_levels():
    levels = reward_levels(torch.tensor([[1.0, 0.0, 1.0, 0.5], [0.0, 0.0, 0.0, 0.0]]))
    assert levels.int().tolist() == [
        [[1, 0, 1, 0], [0, 0, 0, 1], [0, 1, 0, 0], [0, 0, 0, 0]],
        [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
    ]


def test_candidate_grams_equal_those_of_the_explicit_matrices():
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(6, 50, dtype=torch.float64, generator=generator)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    advantages = group_advantages(rewards[None], "grpo")[0]
    grams = group_candidate_grams(scores @ scores.T, rewards, advantages)
    assert list(grams) == list(GROUP_CANDIDATES)
    explicit = {
        "scores": scores,
        "weighted": advantages[:, None].double() * scores,
        "level_sums": class_sums(scores, rewards),
    }
    for name, matrix in explicit.items():
        sigma = gram_singular_values(grams[name])
        torch.testing.assert_close(sigma[: len(matrix)], torch.linalg.svdvals(matrix))
        assert (sigma[len(matrix) :] < 1e-6 * sigma[0]).all()  # the padded rows of E
    # Group gradients of three groups of two, from the Gram of all six rows.
    groups = disjoint_groups(6, 2)
    gradients = torch.stack([2 * group_gradient(scores[g], advantages[g]) for g in groups])
    torch.testing.assert_close(
        group_gradient_gram(scores @ scores.T, advantages, groups), gradients @ gradients.T
    )


def test_rank_frame_on_orthonormal_scores():
    """Orthonormal score rows (G = I): each candidate's singular values are known in closed
    form, sigma = |A_i| for the weighted rows and sqrt(k), sqrt(R - k) for the class sums."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]])  # (B = 1, M = 8)
    grams = torch.eye(8, dtype=torch.float64)[None]
    frame = group_rank_frame(grams, rewards, [4, 8]).set_index(["group_size", "group", "candidate"])
    assert not frame.loc[(4, 1, "weighted"), "mixed"]
    assert frame.loc[(4, 1, "weighted"), "entropy"] == 0  # all rewards equal: no gradient
    assert frame.loc[(4, 0, "scores"), "entropy"] == pytest.approx(4)

    def entropy_rank(sigma):
        p = torch.tensor(sigma, dtype=torch.float64) / sum(sigma)
        return math.exp(-(p * p.log()).sum().item())

    # Group 0 of four: k = 1 correct. Class sums: sigma = 1, sqrt(3).
    assert frame.loc[(4, 0, "level_sums"), "entropy"] == pytest.approx(entropy_rank([1, 3**0.5]))
    assert frame.loc[(4, 0, "level_sums"), "stable"] == pytest.approx(4 / 3)
    advantages = group_advantages(rewards[:, :4], "grpo")[0].abs().tolist()
    assert frame.loc[(4, 0, "weighted"), "entropy"] == pytest.approx(entropy_rank(advantages))
    assert frame.loc[(4, 0, "weighted"), "energy_90"] == 3  # 3^2 + 3 * 1 of 12 in units a^2
    # The whole eight: k = 5, class sums sqrt(5), sqrt(3).
    assert frame.loc[(8, 0, "level_sums"), "stable"] == pytest.approx(8 / 5)
    assert frame.loc[(8, 0, "weighted"), "entropy"] == pytest.approx(
        entropy_rank(group_advantages(rewards, "grpo")[0].abs().tolist())
    )


def test_binary_class_sums_stay_at_most_two_on_the_sequence_policy(sequence_policy):
    policy, logits, all_sequences, rewards = sequence_policy
    samples = policy.sample(logits, 40 * 16, torch.Generator().manual_seed(0)).view(40, 16)
    scores = policy.scores(logits, all_sequences)
    grams = (scores @ scores.T)[samples[:, :, None], samples[:, None, :]]
    frame = group_rank_frame(grams, rewards[samples], [2, 4, 8, 16])
    mixed = frame[frame["mixed"]]
    sums = mixed[mixed["candidate"] == "level_sums"]
    assert sums["energy_99"].max() == 2 and (sums["entropy"] <= 2 + 1e-9).all()
    # The weighted rows of a mixed group of two: two rows of equal |A|, the scores' own ranks.
    pairs = mixed[mixed["group_size"] == 2].pivot_table(
        index=["prompt", "group"], columns="candidate", values="entropy"
    )
    torch.testing.assert_close(
        torch.tensor(pairs["weighted"].values), torch.tensor(pairs["scores"].values)
    )
    weighted = mixed[mixed["candidate"] == "weighted"].groupby("group_size")["entropy"].mean()
    assert weighted[16] > weighted[8] > weighted[4] > 3


def test_summarise_ranks_leaves_degenerate_groups_out():
    rewards = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    frame = group_rank_frame(torch.eye(4, dtype=torch.float64)[None], rewards, [2])
    summary = summarise_ranks(frame, ["candidate", "group_size"]).set_index(
        ["candidate", "measure"]
    )
    assert summary.loc[("scores", "entropy"), "n"] == 1  # group 1 (1, 1) is left out
    assert summary.loc[("scores", "entropy"), "mean"] == pytest.approx(2)
    assert summary.loc[("scores", "entropy"), "low"] is None  # one group: no interval


def test_classify_ranks_and_verdict():
    assert classify_ranks({2: 1.9, 4: 2.3, 8: 1.6}) == "about 2"
    assert classify_ranks({2: 1.9, 4: 3.5, 8: 6.0}) == "grows with R"
    assert classify_ranks({2: 1.0, 4: 1.2}) == "about 1"
    assert classify_ranks({2: 3.0, 4: 2.8}) == "other"
    assert classify_ranks({2: 1.29, 16: 1.89}) == "at most 2"
    assert classify_ranks({8: 2.0}) == "one R only"
    pd = pytest.importorskip("pandas")
    summary = pd.DataFrame(
        [
            {
                "model": "m",
                "reward": "binary",
                "stage": "s",
                "candidate": candidate,
                "group_size": size,
                "measure": "entropy",
                "mean": mean,
            }
            for candidate, means in [("level_sums", (1.9, 1.95)), ("weighted", (1.9, 7.5))]
            for size, mean in zip((2, 16), means)
        ]
    )
    rows, text = verdict(summary)
    assert [row["class"] for row in rows] == ["about 2", "grows with R"]
    assert "holds for level_sums on m, s, binary (1.90 to 1.95)." in text
    assert "does not hold (grows with R) for weighted on m, s, binary (1.90 to 7.50)." in text
    none_hold = verdict(summary[summary["candidate"] == "weighted"])[1]
    assert "holds for no matrix" in none_hold


def test_graded_reward():
    assert graded_reward("so the answer is 10", "10") == 1.0
    assert graded_reward("12 apples", "10") == pytest.approx(1 / 1.2)
    assert graded_reward("it is 0.5", "0") == pytest.approx(1 / 1.5)  # |gold| < 1: absolute
    assert graded_reward("no number", "3") == 0.0


def test_group_loss_gradient_is_the_weighted_score_sum(batch):
    model = tiny_llama(tie=True)
    rows = score_rows(model, *batch)
    advantages = torch.tensor([0.5, -1.0, 2.0, 0.0, -1.5], dtype=torch.float64)
    lengths = batch[2].sum(dim=1)
    model.zero_grad()
    group_loss(model, *batch, advantages).backward()
    gradient = torch.cat([p.grad.flatten() for p in model.parameters()])
    # Batched here, one row at a time there: Llama's RMSNorm rounds through float32, so the
    # two differ by ~1e-8, far below the size of any error in the weights (~1e-1).
    torch.testing.assert_close(gradient, -(advantages / lengths) @ rows / 5, rtol=0, atol=1e-6)
    model.zero_grad()


def test_group_gradient_ranks_count_the_mixed_groups():
    # Orthonormal scores: different groups' gradients are orthogonal, with norm ||A||.
    rewards = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    rows = group_gradient_ranks(torch.eye(8, dtype=torch.float64), rewards, [2, 4])
    assert [row["num_groups"] for row in rows] == [2, 2]  # (1, 0), (0, 1); both fours
    for row in rows:  # two orthogonal gradients of equal norm (k = 1 and k = 3 mirror)
        assert row["entropy"] == pytest.approx(2) and row["stable"] == pytest.approx(2)
    rewards[1] = 0.0  # one group of four left with a gradient
    assert group_gradient_ranks(torch.eye(8, dtype=torch.float64), rewards, [4])[0][
        "entropy"
    ] == pytest.approx(1)


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="binary"):
        class_sums(torch.zeros(2, 3), torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match="one reward value"):
        centroid_difference(torch.zeros(2, 3), torch.tensor([1.0, 1.0]))
    assert disjoint_groups(7, 3).tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="group_size"):
        disjoint_groups(4, 1)


# ---------------------------------------------------------------------------------------------
# The chapter's steps: the mechanism, the sequence policy's groups, a language model


def test_mechanism_records_the_exact_identity(sequence_policy):
    policy, logits, all_sequences, rewards = sequence_policy
    tables = sequence_reward_tables(policy, seed=0)
    torch.testing.assert_close(tables["binary"], rewards.double())
    assert ((tables["uniform"] > 0) & (tables["uniform"] < 1)).all()
    assert len(set(tables["uniform"].tolist())) == policy.num_sequences
    records, spectra = mechanism(policy, logits, tables["binary"], 8, "grpo", seed=3)
    # The group it took, independently: the first mixed one the same generator draws.
    generator = torch.Generator().manual_seed(3)
    group = policy.sample(logits, 8, generator)
    while not 0 < tables["binary"][group].sum() < 8:
        group = policy.sample(logits, 8, generator)
    group_rewards = tables["binary"][group]
    scores = policy.scores(logits, all_sequences[group]) / policy.length
    advantages = group_advantages(group_rewards[None], "grpo")[0]
    assert records["mechanism_group_size"] == 8
    assert records["mechanism_num_correct"] == group_rewards.sum().item()
    assert records["mechanism_relative_deviation"] < 1e-14
    assert records["sequence_score_rank"] == 14  # see the test of the weighted rows
    assert records["mechanism_rank_level_sums"] == 2
    distinct = torch.linalg.matrix_rank(scores).item()  # repeated samples repeat rows
    assert records["mechanism_rank_weighted"] == records["mechanism_rank_scores"] == distinct
    assert list(spectra) == list(GROUP_CANDIDATES)
    for name, matrix in candidate_matrices(scores, group_rewards, advantages).items():
        sigma = torch.linalg.svdvals(matrix)
        torch.testing.assert_close(spectra[name], sigma, rtol=0, atol=0)
        assert records[f"mechanism_erank_{name}"] == pytest.approx(effective_rank(sigma).item())


def test_sequence_policy_ranks_measure_the_sampled_groups(sequence_policy):
    policy, logits, all_sequences, rewards = sequence_policy
    tables = {"binary": rewards.double()}
    frame, cross = sequence_policy_ranks(
        policy, {"early": logits}, tables, [2, 4], num_prompts=3, num_cross_prompts=2, seed=5
    )
    # 3 prompts x (2 groups of 2 + 1 group of 4) x 3 candidates.
    assert len(frame) == 3 * 3 * 3
    assert set(frame["model"]) == {"sequence policy"} and set(frame["reward"]) == {"binary"}
    samples = policy.sample(logits, 3 * 4, torch.Generator().manual_seed(5)).view(3, 4)
    scores = policy.scores(logits, all_sequences[samples[1]]) / policy.length
    row = frame.set_index(["group_size", "prompt", "group", "candidate"]).loc[(4, 1, 0, "scores")]
    assert row["entropy"] == pytest.approx(effective_rank(torch.linalg.svdvals(scores)).item())
    assert [r["group_size"] for r in cross] == [2, 4]
    group_rewards = rewards[samples[:2]].view(-1, 4)
    mixed = ((group_rewards != group_rewards[:, :1]).any(dim=1)).sum().item()
    assert cross[1]["num_groups"] == mixed


def test_measure_one_language_model(random_tiny):
    model, tokenizer = random_tiny
    problems = load_gsm8k("test", source="arithmetic", num_examples=2, seed=0)
    spec = {
        "name": "tiny",
        "max_completion_length": 4,
        "reward_mode": "strict",
        "weight_gradient_groups": 1,
    }
    result = measure(model, tokenizer, spec, "early", problems, group_sizes=[2, 4], seed=0)
    frames = pd.concat(result["frames"])
    assert set(frames["reward"]) == {"binary", "graded", "uniform"}
    # 2 prompts x 3 groups (2 of two, 1 of four) x 3 candidates, per reward.
    assert len(frames) == 3 * 2 * 3 * 3
    assert [(r["reward"], r["group_size"]) for r in result["cross"]] == [
        (reward, size) for reward in ("binary", "graded", "uniform") for size in (2, 4)
    ]
    assert result["matrices"] == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "lm_head.weight",
    ]
    # One weight-gradient group per G at most, each measuring the three matrices.
    sizes = [row["group_size"] for row in result["weights"]]
    assert len(sizes) == 3 * len(set(sizes)) and set(sizes) <= {2, 4}
    assert set(key[0] for key in result["spectra"]) == set(sizes)
    for row in result["weights"]:  # a weight gradient's rank is bounded by its tokens
        assert 1 <= row["entropy"] <= row["tokens"] + 1e-9
    assert 0 <= result["mixed_binary"] <= 1 and 0 <= result["mean_binary"] <= 1
    assert 1 <= result["tokens"] <= 4
    assert (
        overview({("tiny", "early"): result}).iloc[0]["mean completion tokens"]
        == (result["tokens"])
    )


# ---------------------------------------------------------------------------------------------
# Tables, records, figures


def _summary():
    """A `summarise_ranks`-like table: one model, two rewards, two stages, two candidates."""
    return pd.DataFrame(
        [
            {
                "model": "m",
                "stage": stage,
                "reward": reward,
                "candidate": candidate,
                "group_size": size,
                "measure": measure,
                "n": 3,
                "mean": mean,
                "low": mean - 0.1,
                "high": mean + 0.1,
            }
            for stage in ("early", "late")
            for reward in ("binary", "uniform")
            for candidate, means in [("level_sums", (1.5, 1.9)), ("weighted", (1.9, 7.0))]
            for size, mean in zip((2, 16), means)
            for measure in ("entropy", "stable")
        ]
    )


def test_records_and_tables_of_a_summary():
    summary = _summary()
    records = group_size_records(summary, [2, 16])
    assert records["sequence_level_sums_binary_smallest_R"] == 1.5
    assert records["sequence_weighted_uniform_largest_R"] == 7.0
    assert records["smallest_R"] == 2 and records["largest_R"] == 16
    assert headline_records(summary) == {
        "effective_rank_weighted": {"m": {2: 1.9, 16: 7.0}},
        "effective_rank_level_sums": {"m": {2: 1.5, 16: 1.9}},
    }
    table = entropy_table(summary, ["stage", "reward", "candidate"])
    assert table.loc[("late", "binary", "weighted"), 16] == 7.0 and table.shape == (8, 2)


def test_candidate_table_adds_weight_and_group_gradients():
    summary = _summary()
    weights = (
        summary[summary["candidate"] == "weighted"]
        .drop(columns="candidate")
        .assign(matrix="lm_head.weight")
    )
    cross = pd.DataFrame(
        [
            {
                "model": "m",
                "stage": "early",
                "reward": "binary",
                "group_size": size,
                "num_groups": groups,
                "entropy": 3.0,
                "stable": 2.5,
                "energy_90": 2,
                "energy_99": 3,
            }
            for size, groups in ((2, 0), (16, 4))
        ]
    )
    table = candidate_table(summary, weights, cross)
    gradients = table[table["candidate"] == "group gradients"]
    assert len(gradients) == 4 and set(gradients["group_size"]) == {16}  # no groups at 2
    assert gradients.set_index("measure").loc["stable", "mean"] == 2.5
    assert (table["candidate"] == "weight gradient lm_head.weight").sum() == len(weights)
    rows, _ = verdict(table[table["reward"] == "binary"])
    classes = {(row["stage"], row["candidate"]): row["class"] for row in rows}
    assert classes[("early", "level_sums")] == "about 2"  # 1.5 and 1.9
    assert classes[("early", "weight gradient lm_head.weight")] == "grows with R"
    assert classes[("early", "group gradients")] == "one R only"


def test_figures():
    summary = _summary()
    fig = plot_ranks(summary, [2, 16], "subject")
    assert fig._suptitle.get_text() == "subject: entropy effective rank (dotted: 2)"
    assert len(fig.axes) == 4  # (early, late) x (binary, uniform)
    lines = {bars.get_label(): bars.lines[0] for bars in fig.axes[0].containers}  # early, binary
    assert list(lines["level_sums"].get_ydata()) == [1.5, 1.9]
    assert list(lines["weighted"].get_ydata()) == [1.9, 7.0] and "scores" not in lines
    sigma = torch.tensor([4.0, 1.0, 1e-3], dtype=torch.float64)
    fig = plot_singular_values({"scores": sigma}, 8)
    assert list(fig.axes[0].lines[0].get_ydata()) == [4.0, 1.0, 1e-3]
    measured = {"spectra": {(2, "a"): sigma, (4, "b"): sigma}, "matrices": ["a", "b"]}
    fig = plot_weight_spectra(measured, [2, 4], "title")
    assert [len(ax.lines) for ax in fig.axes] == [1, 1]
    assert list(fig.axes[1].lines[0].get_ydata()) == [1.0, 0.25, 2.5e-4]
    matplotlib.pyplot.close("all")


# ---------------------------------------------------------------------------------------------
# The factorial and the readings (sections 6-7)


def test_ternary_rewards():
    reference = "3 + 4 = 7\n7 * 2 = 14\n#### 14"
    assert ternary_reward("3 + 4 = 7\n7 * 2 = 14\n#### 14", reference) == 1.0
    assert ternary_reward("3 + 4 = 7\n7 * 3 = 21\n#### 21", reference) == 0.5  # first step right
    assert ternary_reward("3 + 4 = 8\n8 * 2 = 16\n#### 16", reference) == 0.0
    assert ternary_reward("the answer is 5", reference) == 0.0
    assert ternary_reward("#### 14", "#### 14") == 1.0  # no worked lines: no middle level
    assert ternary_reward("#### 15", "#### 14") == 0.0
    policy = SequencePolicy(vocab_size=3, length=3)
    table = near_miss_reward(policy)
    binary = sum_mod_reward(policy.all_sequences(), 3)
    assert torch.equal(table == 1, binary == 1)
    assert (table == 0.5).sum() == 9 and (table == 0).sum() == 9


def test_factorial_grams_equal_those_of_the_explicit_matrices():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 40, generator=generator, dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.5, 0.0, 0.5, 1.0, 0.0])
    for advantage in ("grpo", "sign"):
        a = factorial_advantages(rewards, advantage)
        levels = torch.stack([(a * (rewards == v))[:, None] * scores for v in (1.0, 0.5, 0.0)])
        grams = factorial_grams(scores @ scores.T, rewards, a)
        expected = levels.sum(dim=1)
        assert torch.allclose(grams["level_sums"][:3, :3], expected @ expected.T)
        assert torch.allclose(grams["weighted"], (a[:, None] * scores) @ (a[:, None] * scores).T)
    assert factorial_advantages(rewards, "grpo").sum().abs() < 1e-12  # zero-sum
    assert factorial_advantages(rewards, "sign").tolist() == [1, 0, -1, 0, 1, -1]  # not
    assert level_mixing(rewards, factorial_advantages(rewards, "sign"))[1].abs().sum() == 0
    with pytest.raises(ValueError, match="advantage"):
        factorial_advantages(rewards, "rloo")


def test_factorial_on_orthonormal_scores_is_its_own_null_and_the_closed_form():
    generator = torch.Generator().manual_seed(1)
    rewards = torch.randint(0, 3, (30, 8), generator=generator).double() / 2
    grams = torch.eye(8, dtype=torch.float64).expand(30, 8, 8)
    frame = factorial_frame(
        grams, {"binary": (rewards == 1).double(), "ternary": rewards}, [2, 4, 8]
    )
    for name in ("entropy", "stable", "energy_90"):
        assert frame[name].to_numpy() == pytest.approx(frame[f"null_{name}"].to_numpy(), abs=1e-9)
    mixed = frame[frame["mixed"] & (frame["reward"] == "binary")]
    assert mixed[mixed["matrix"] == "level_sums"]["rank"].max() == 2
    table = stable_rank_by_k(frame.assign(model="m"))
    assert table["measured"].to_numpy() == pytest.approx(table["closed_form"].to_numpy())
    records = reading_records(frame.assign(model="m"), [2, 4, 8], 50, seed=0)
    for name in ("levels_effect", "weighted_stable_change", "scores_entropy_change"):
        assert records[f"{name}_m"] == pytest.approx(records[f"predicted_{name}_m"])
    assert records["scores_entropy_change_m"] == pytest.approx(6.0)
    assert records["levels_effect_m"] > 0  # a third level: above the binary reward's 2
    assert records["level_sums_max_rank_m"] == 2


def test_sequence_factorial_levels_raise_the_rank_and_sign_keeps_binary_at_two(sequence_policy):
    policy, logits, _, _ = sequence_policy
    frame = sequence_factorial(policy, logits, [2, 4, 8], 40, seed=0)
    summary = factorial_summary(frame)
    cells = cell_records(summary, "sequence policy", 8)
    assert cells["cell_sequence_policy_binary_sign_level_sums_entropy"] <= 2
    assert cells["cell_sequence_policy_ternary_grpo_level_sums_entropy"] > 2
    records = reading_records(frame, [2, 4, 8], 100, seed=0)
    assert records["levels_effect_sequence_policy_low"] > 0
    assert "a third reward level raises" in records["levels_effect_sequence_policy_words"]
    assert "grows with G" in readings_text(records, "sequence policy")
    fig = plot_factorial(summary, [2, 4, 8])
    assert len(fig.axes) == 6
    fig = plot_stable_rank_by_k(stable_rank_by_k(frame))
    assert len(fig.axes) == 3
    matplotlib.pyplot.close("all")


def test_no_mixed_group_records_none_and_says_so():
    rewards = torch.zeros(3, 8, dtype=torch.float64)
    frame = factorial_frame(torch.eye(8).expand(3, 8, 8), {"binary": rewards, "ternary": rewards},
                            [2, 4, 8]).assign(model="tiny-llama")  # fmt: skip
    records = reading_records(frame, [2, 4, 8], 20, seed=0)
    assert records["levels_effect_tiny_llama"] is None
    assert records["levels_effect_tiny_llama_low"] is None
    assert records["predicted_levels_effect_tiny_llama"] is None
    assert records["mixed_groups_tiny_llama"] == 0
    assert records["level_sums_max_rank_tiny_llama"] is None
    assert "no mixed group" in readings_text(records, "tiny-llama")


def test_bootstrap_over_prompts():
    weights = prompt_weights(5, 200, seed=0)
    assert weights.shape == (201, 5) and (weights[0] == 1).all() and (weights.sum(1) == 5).all()
    frame = pd.DataFrame(
        {"prompt": [0, 0, 1, 2, 2], "group_size": 2, "mixed": [True, True, True, True, False],
         "entropy": [1.0, 2.0, 3.0, 4.0, 99.0]}
    )  # fmt: skip
    means = resampled_means(frame, ["group_size"], "entropy", prompt_weights(3, 10, seed=0))
    assert means[(2,)][0] == pytest.approx(2.5)  # the unmixed group is left out
    assert change_over_sizes(torch.tensor([[1.0, 2.0, 4.0]]).numpy(), [2, 4, 8]) == pytest.approx(3)
    import numpy as np

    assert bootstrap_interval(np.array([np.nan, 1.0])) == {"mean": None, "low": None, "high": None}
    assert bootstrap_interval(np.array([1.0, np.nan, np.nan, 2.0]))["low"] is None
    interval = bootstrap_interval(np.array([1.0, *np.linspace(0, 2, 101)]))
    assert interval["low"] == pytest.approx(0.05) and interval["high"] == pytest.approx(1.95)
    assert model_slug("nvidia/Nemotron-Mini-4B-Instruct") == "nemotron_mini_4b_instruct"


def test_rank_change_records_resample_prompts_and_fit_the_claims_range():
    base = {"model": "m", "stage": "early", "reward": "binary", "candidate": "weighted"}
    base["mixed"] = True
    rows = []
    for prompt in range(6):
        for size in (2, 4, 8, 16):
            for group in range(16 // size):
                value = 1 + 0.5 * size + 0.1 * prompt  # a change of 3 over G = 2..8
                rows.append({**base, "group_size": size, "prompt": prompt, "group": group,
                             "entropy": value})  # fmt: skip
    records = rank_change_records(pd.DataFrame(rows), [2, 4, 8], 100, seed=0)
    change = records["effective_rank_change"]["m"]["weighted"]
    assert change["mean"] == pytest.approx(3.0)
    # the prompt offset moves every G together: it cancels in the change, so the interval is tight
    assert change["low"] == pytest.approx(3.0) and change["high"] == pytest.approx(3.0)
