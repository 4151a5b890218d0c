"""Chapter 5's spectra: per-rollout gradient rows, the streaming Gram matrix, effective ranks,
and the rank statements of `spectrum`'s docstring, exactly on the enumerable sequence policy.

The tiny Llamas run in float64 with eager attention, so the three gradient paths (vmap, loop,
streaming) do the same arithmetic in different orders and agree to rounding (~1e-13).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.policy_gradient import SequencePolicy, sum_mod_reward
from grpo_companion.chapters.rank import (
    GROUP_CANDIDATES,
    centroid_coefficient,
    centroid_difference,
    class_sums,
    classify_ranks,
    completion_log_probs,
    diagonal_blocks,
    disjoint_groups,
    effective_rank,
    energy_rank,
    graded_reward,
    gram_singular_values,
    grams_by_layer,
    group_candidate_grams,
    group_gradient,
    group_gradient_gram,
    group_gradient_ranks,
    group_loss,
    group_rank_frame,
    rank_measures,
    reward_levels,
    score_grams,
    score_rows,
    select_parameters,
    stable_rank,
    summarise_ranks,
    verdict,
    weight_gradient_spectra,
    weighted_gram,
)
from grpo_companion.core.stats import mean_interval

VOCAB, PROMPT, COMPLETION, ROLLOUTS = 40, 5, 6, 5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tensors here are tiny: a second thread only adds synchronisation, which on a busy
    machine costs more than the arithmetic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_llama(tie: bool, seed: int = 0) -> LlamaForCausalLM:
    """2 layers, hidden 32; the untied one has biases in attention and MLP."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie, pad_token_id=0,
        attention_bias=not tie, mlp_bias=not tie, attn_implementation="eager",
    )
    return LlamaForCausalLM(config).double().eval()


@pytest.fixture(scope="module")
def batch():
    """A group with left padding (rollout 0's prompt is 2 tokens shorter), a completion that
    ended early (rollout 1: its last 2 tokens are padding, masked out) and a real token equal
    to the padding id (rollout 3, as SmolLM2's EOS is also its pad token): nn.Embedding gives
    the padding row no gradient even there."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, VOCAB, (ROLLOUTS, PROMPT + COMPLETION), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    completion_mask = torch.ones(ROLLOUTS, COMPLETION, dtype=torch.float64)
    input_ids[0, :2], attention_mask[0, :2] = 0, 0
    input_ids[1, -2:], attention_mask[1, -2:], completion_mask[1, -2:] = 0, 0, 0
    input_ids[3, PROMPT + 2] = 0
    return input_ids, attention_mask, completion_mask


@pytest.fixture(scope="module")
def rows_of(batch):
    """rows_of(tie): `score_rows` (vmap) of `tiny_llama(tie)`, computed once per value."""
    cache = {}

    def rows(tie):
        if tie not in cache:
            cache[tie] = score_rows(tiny_llama(tie), *batch, method="vmap")
        return cache[tie]

    return rows


def test_left_padding_changes_no_log_prob(batch):
    model = tiny_llama(tie=True)
    input_ids, attention_mask, completion_mask = batch
    padded = completion_log_probs(model, *batch)
    alone = completion_log_probs(
        model, input_ids[:1, 2:], attention_mask[:1, 2:], completion_mask[:1]
    )
    assert padded[0].item() == pytest.approx(alone.item(), abs=1e-12)
    # By hand for rollout 2: sum of log softmax(logits)[next token] over the completion.
    logits = model(input_ids[2:3]).logits[0, PROMPT - 1 : -1]
    by_hand = logits.log_softmax(-1).gather(-1, input_ids[2, PROMPT:, None]).sum()
    assert padded[2].item() == pytest.approx(by_hand.item(), abs=1e-12)


def test_vmap_and_loop_rows_agree(batch, rows_of):
    model, rows = tiny_llama(tie=True), rows_of(True)
    assert rows.shape == (ROLLOUTS, sum(p.numel() for p in model.parameters()))
    loop = score_rows(model, *batch, method="loop")
    torch.testing.assert_close(loop, rows, rtol=0, atol=1e-12)
    # Row 3 against plain autograd on the model's own parameters.
    model.zero_grad()
    completion_log_probs(model, *(t[3:4] for t in batch)).sum().backward()
    by_autograd = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(rows[3], by_autograd, rtol=0, atol=1e-12)
    # Rollout 1's masked tokens count for nothing: a zero completion mask gives a zero row.
    no_tokens = tuple(t[1:2].clone() for t in batch)
    no_tokens[2].zero_()
    assert score_rows(model, *no_tokens).abs().max().item() == 0.0


@pytest.mark.parametrize("method", ["ghost", "materialise"])
@pytest.mark.parametrize("tie", [True, False])
def test_streaming_gram_equals_materialised(batch, rows_of, tie, method):
    model, rows = tiny_llama(tie), rows_of(tie)
    # A tiny chunk budget splits every matrix into many row chunks.
    grams = score_grams(model, *batch, method=method, max_block_elements=1000)
    params = select_parameters(model)
    assert list(grams) == list(params)
    blocks = rows.split([p.numel() for p in params.values()], dim=1)
    for (name, gram), block in zip(grams.items(), blocks):
        torch.testing.assert_close(gram, block @ block.T, rtol=1e-10, atol=1e-12, msg=name)
    total = sum(grams.values())
    torch.testing.assert_close(
        gram_singular_values(total), torch.linalg.svdvals(rows), rtol=1e-10, atol=0
    )
    layers = grams_by_layer(grams)
    head = ["lm_head.weight"] if not tie else []
    assert list(layers) == ["model.embed_tokens.weight", "model.layers.0", "model.layers.1",
                            "model.norm.weight", *head]
    layer_1 = score_rows(model, *batch, include=r"layers\.1\.")
    torch.testing.assert_close(layers["model.layers.1"], layer_1 @ layer_1.T, rtol=1e-10, atol=0)


def test_subsets_tied_weights_and_frozen_models(batch, rows_of):
    model, rows = tiny_llama(tie=True), rows_of(True)
    columns = dict(zip(select_parameters(model), rows.split(
        [p.numel() for p in select_parameters(model).values()], dim=1
    )))
    # "lm_head" selects the tied embedding, and its gradient counts both uses.
    (name, param), = select_parameters(model, "lm_head").items()
    assert name == "lm_head.weight" and param is model.model.embed_tokens.weight
    embedding = columns["model.embed_tokens.weight"]
    torch.testing.assert_close(score_rows(model, *batch, include="lm_head"), embedding)
    # A frozen model: the streaming and the loop paths don't need requires_grad.
    model.requires_grad_(False)
    norms = torch.cat([block for name, block in columns.items() if "norm" in name], dim=1)
    torch.testing.assert_close(score_rows(model, *batch, include="norm", method="loop"), norms)
    gram = sum(score_grams(model, *batch, include=r"^lm_head|norm").values())
    both = torch.cat([embedding, norms], dim=1)
    torch.testing.assert_close(gram, both @ both.T, rtol=1e-10, atol=1e-12)


def test_weighted_gram_is_gram_of_weighted_rows():
    rows = torch.randn(4, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    advantages = torch.tensor([1.5, -0.5, 0.0, -1.0])
    weighted = advantages[:, None].double() * rows
    torch.testing.assert_close(weighted_gram(rows @ rows.T, advantages), weighted @ weighted.T)


# ---------------------------------------------------------------------------------------------
# Rank measures on spectra with known answers


def _with_singular_values(values, rows=6, cols=9, seed=0):
    """U diag(values) V^T with random orthonormal U (rows, k) and V (cols, k)."""
    generator = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, len(values), dtype=torch.float64, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(cols, len(values), dtype=torch.float64, generator=generator))
    return u @ torch.diag(torch.tensor(values, dtype=torch.float64)) @ v.T


def test_known_spectra():
    identity = torch.linalg.svdvals(torch.eye(10, dtype=torch.float64))
    assert effective_rank(identity).item() == pytest.approx(10)
    assert stable_rank(identity).item() == pytest.approx(10)
    assert energy_rank(identity, 0.9).item() == 9
    assert energy_rank(identity, 0.99).item() == 10

    column, row = torch.arange(1.0, 7).double(), torch.arange(1.0, 10).double()
    rank_one = torch.linalg.svdvals(torch.outer(column, row))
    assert effective_rank(rank_one).item() == pytest.approx(1, abs=1e-12)
    assert stable_rank(rank_one).item() == pytest.approx(1)
    assert energy_rank(rank_one, 0.99).item() == 1

    two = torch.linalg.svdvals(_with_singular_values([2.0, 2.0]))
    assert effective_rank(two).item() == pytest.approx(2)
    assert stable_rank(two).item() == pytest.approx(2)
    assert energy_rank(two, 0.5).item() == 1 and energy_rank(two, 0.9).item() == 2

    # sigma = 3, 2, 1, 0.5: p = sigma / 6.5, squares 9, 4, 1, 0.25 of 14.25.
    sigma = torch.linalg.svdvals(_with_singular_values([0.5, 3.0, 1.0, 2.0]))
    p = [3 / 6.5, 2 / 6.5, 1 / 6.5, 0.5 / 6.5]
    entropy = -sum(q * math.log(q) for q in p)
    assert effective_rank(sigma).item() == pytest.approx(math.exp(entropy))
    assert effective_rank(sigma).item() == pytest.approx(3.33607, abs=1e-5)
    assert stable_rank(sigma).item() == pytest.approx(14.25 / 9)
    assert energy_rank(sigma, 0.9).item() == 2  # 13 / 14.25 = 0.912
    assert energy_rank(sigma, 0.99).item() == 4  # 14 / 14.25 = 0.982 < 0.99

    zero = torch.zeros(3, dtype=torch.float64)
    assert [f(zero).item() for f in (effective_rank, stable_rank, energy_rank)] == [0, 0, 0]
    batched = torch.stack([identity[:3], zero])  # (2, 3) -> (2,)
    assert effective_rank(batched).tolist() == pytest.approx([3, 0])
    assert energy_rank(batched, 1.0).tolist() == [3, 0]
    with pytest.raises(ValueError, match="threshold"):
        energy_rank(identity, 0.0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.just(0.0) | st.floats(1e-300, 1e300), min_size=1, max_size=12),
    st.floats(1e-3, 1e3),
)
def test_rank_measures_lie_between_one_and_the_rank(values, scale):
    sigma = torch.tensor(values, dtype=torch.float64)
    rank = int((sigma > 0).sum())
    for measure in (effective_rank, stable_rank, lambda s: energy_rank(s, 0.99)):
        value = measure(sigma).item()
        assert (value == 0) if rank == 0 else (1 - 1e-9 <= value <= rank + 1e-9)
        assert measure(scale * sigma).item() == pytest.approx(value, rel=1e-9)


def test_gram_singular_values_of_rank_deficient_matrix():
    m = _with_singular_values([5.0, 1e-3, 0.0, 0.0], rows=4)
    sigma = gram_singular_values(m @ m.T)
    assert sigma.isfinite().all() and sigma[0] == sigma.max()
    torch.testing.assert_close(sigma, torch.tensor([5.0, 1e-3, 0, 0]).double(), atol=1e-7, rtol=0)


def test_weight_gradient_rank_is_bounded_by_tokens(batch):
    model = tiny_llama(tie=True)
    rows = 2

    def loss():
        log_probs = completion_log_probs(model, *(t[:rows] for t in batch))
        return -(torch.tensor([1.0, -1.0]).double() * log_probs).sum()

    names = ["model.layers.0.self_attn.q_proj.weight", "lm_head.weight"]
    spectra = weight_gradient_spectra(model, loss(), names)
    loss().backward()
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in names:
        torch.testing.assert_close(spectra[name], torch.linalg.svdvals(params[name].grad))
    # dW = sum_t D_t x_t^T over the positions whose query can move a counted log-prob: in each
    # rollout the real ones up to the last that predicts a counted token (8), less the first,
    # which attends to itself alone whatever its query (7). Generic outer products: rank 14.
    q = spectra[names[0]]
    assert q.shape == (32,) and (q > 1e-10 * q[0]).sum().item() == 14
    with pytest.raises(ValueError, match="2-D"):
        weight_gradient_spectra(model, loss(), ["model.norm.weight"])
    with pytest.raises(KeyError):
        weight_gradient_spectra(model, loss(), ["nope"])


# ---------------------------------------------------------------------------------------------
# The mechanism, exactly on the enumerable sequence policy


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
        torch.testing.assert_close(
            group_gradient(scores, advantages), c * difference, rtol=0, atol=1e-12
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


def test_rejects_bad_input(batch):
    model = tiny_llama(tie=True)
    with pytest.raises(ValueError, match="method"):
        score_rows(model, *batch, method="svd")
    with pytest.raises(ValueError, match="method"):
        score_grams(model, *batch, method="svd")
    with pytest.raises(ValueError, match="no parameter"):
        select_parameters(model, "attention_sink")
    with pytest.raises(ValueError, match="binary"):
        class_sums(torch.zeros(2, 3), torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match="one reward value"):
        centroid_difference(torch.zeros(2, 3), torch.tensor([1.0, 1.0]))


# ---------------------------------------------------------------------------------------------
# The candidates, their measures over many groups, and the verdict


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
    explicit = {"scores": scores, "weighted": advantages[:, None].double() * scores,
                "level_sums": class_sums(scores, rewards)}
    for name, matrix in explicit.items():
        sigma = gram_singular_values(grams[name])
        torch.testing.assert_close(sigma[: len(matrix)], torch.linalg.svdvals(matrix))
        assert (sigma[len(matrix):] < 1e-6 * sigma[0]).all()  # the padded rows of E
    # Group gradients of three groups of two, from the Gram of all six rows.
    groups = disjoint_groups(6, 2)
    gradients = torch.stack([group_gradient(scores[g], advantages[g]) for g in groups])
    torch.testing.assert_close(group_gradient_gram(scores @ scores.T, advantages, groups),
                               gradients @ gradients.T)


def test_rank_frame_on_orthonormal_scores():
    """Orthonormal score rows (G = I): each candidate's singular values are known in closed
    form, sigma = |A_i| for the weighted rows and sqrt(k), sqrt(R - k) for the class sums."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]])  # (B = 1, M = 8)
    grams = torch.eye(8, dtype=torch.float64)[None]
    frame = group_rank_frame(grams, rewards, [4, 8]).set_index(["group_size", "group",
                                                                 "candidate"])
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
    assert frame.loc[(8, 0, "weighted"), "entropy"] == pytest.approx(entropy_rank(
        group_advantages(rewards, "grpo")[0].abs().tolist()))


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
        index=["prompt", "group"], columns="candidate", values="entropy")
    torch.testing.assert_close(torch.tensor(pairs["weighted"].values),
                               torch.tensor(pairs["scores"].values))
    weighted = mixed[mixed["candidate"] == "weighted"].groupby("group_size")["entropy"].mean()
    assert weighted[16] > weighted[8] > weighted[4] > 3


def test_mean_interval_and_summary():
    t_975_2 = 4.302652729911275  # Student t quantile, 2 degrees of freedom
    assert mean_interval([1, 2, 3]) == pytest.approx(
        {"n": 3, "mean": 2.0, "low": 2 - t_975_2 / 3**0.5, "high": 2 + t_975_2 / 3**0.5})
    assert mean_interval([2.5]) == {"n": 1, "mean": 2.5, "low": None, "high": None}
    rewards = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    frame = group_rank_frame(torch.eye(4, dtype=torch.float64)[None], rewards, [2])
    summary = summarise_ranks(frame, ["candidate", "group_size"]).set_index(
        ["candidate", "measure"])
    assert summary.loc[("scores", "entropy"), "n"] == 1  # group 1 (1, 1) is left out
    assert summary.loc[("scores", "entropy"), "mean"] == pytest.approx(2)


def test_classify_ranks_and_verdict():
    assert classify_ranks({2: 1.9, 4: 2.3, 8: 1.6}) == "about 2"
    assert classify_ranks({2: 1.9, 4: 3.5, 8: 6.0}) == "grows with R"
    assert classify_ranks({2: 1.0, 4: 1.2}) == "about 1"
    assert classify_ranks({2: 3.0, 4: 2.8}) == "other"
    assert classify_ranks({2: 1.29, 16: 1.89}) == "at most 2"
    assert classify_ranks({8: 2.0}) == "one R only"
    pd = pytest.importorskip("pandas")
    summary = pd.DataFrame([
        {"model": "m", "reward": "binary", "stage": "s", "candidate": candidate,
         "group_size": size, "measure": "entropy", "mean": mean}
        for candidate, means in [("level_sums", (1.9, 1.95)), ("weighted", (1.9, 7.5))]
        for size, mean in zip((2, 16), means)
    ])
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


def test_group_loss_gradient_is_the_weighted_score_sum(batch, rows_of):
    model, rows = tiny_llama(tie=True), rows_of(True)
    advantages = torch.tensor([0.5, -1.0, 2.0, 0.0, -1.5], dtype=torch.float64)
    lengths = batch[2].sum(dim=1)
    model.zero_grad()
    group_loss(model, *batch, advantages).backward()
    gradient = torch.cat([p.grad.flatten() for p in model.parameters()])
    # Batched here, one row at a time there: Llama's RMSNorm rounds through float32, so the
    # two differ by ~1e-8, far below the size of any error in the weights (~1e-1).
    torch.testing.assert_close(gradient, -(advantages / lengths) @ rows / 5, rtol=0, atol=1e-6)
    model.zero_grad()


def test_blocks_and_groups():
    gram = torch.arange(36.0).view(6, 6)
    torch.testing.assert_close(diagonal_blocks(gram, 3)[1], gram[3:, 3:])
    with pytest.raises(ValueError, match="blocks"):
        diagonal_blocks(gram, 4)
    assert disjoint_groups(7, 3).tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="group_size"):
        disjoint_groups(4, 1)
    assert set(rank_measures(torch.ones(3))) == {"entropy", "stable", "energy_90", "energy_99"}


def test_group_gradient_ranks_count_the_mixed_groups():
    # Orthonormal scores: different groups' gradients are orthogonal, with norm ||A||.
    rewards = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    rows = group_gradient_ranks(torch.eye(8, dtype=torch.float64), rewards, [2, 4])
    assert [row["num_groups"] for row in rows] == [2, 2]  # (1, 0), (0, 1); both fours
    for row in rows:  # two orthogonal gradients of equal norm (k = 1 and k = 3 mirror)
        assert row["entropy"] == pytest.approx(2) and row["stable"] == pytest.approx(2)
    rewards[1] = 0.0  # one group of four left with a gradient
    assert group_gradient_ranks(torch.eye(8, dtype=torch.float64), rewards, [4])[0][
        "entropy"] == pytest.approx(1)
