"""`lm.gradients` and `lm.streaming_gram`: per-rollout score rows (vmap, loop), their streaming
Gram matrix (ghost, materialised), and the weight gradients of one matrix; and
`scoring.sequence_log_probs` with an explicit causal mask, parameters or input embeddings, which
they differentiate.

The tiny Llamas run in float64 with eager attention, so the three gradient paths (vmap, loop,
streaming) do the same arithmetic in different orders and agree to rounding (~1e-13).
"""

from types import SimpleNamespace

import pytest
import torch
from tiny_llama_batch import COMPLETION, PROMPT, ROLLOUTS, padded_batch, tiny_llama

from grpo_companion.core.spectra import gram_singular_values
from grpo_companion.lm.gradients import (
    causal_attention_mask,
    layer_of,
    representative_matrices,
    score_rows,
    select_parameters,
    weight_gradient_spectra,
)
from grpo_companion.lm.scoring import sequence_log_probs
from grpo_companion.lm.streaming_gram import grams_by_layer, rollout_gram, score_grams


def log_pi(model, input_ids, attention_mask, completion_mask, **options):
    """log pi(y_i | x_i), `(N,)`, as `score_rows` and `score_grams` differentiate it."""
    causal_mask = causal_attention_mask(attention_mask, model.dtype)
    return sequence_log_probs(
        model, input_ids, attention_mask, completion_mask, causal_mask=causal_mask, **options
    ).sum(dim=1)


@pytest.fixture(scope="module")
def batch():
    return padded_batch()


@pytest.fixture(scope="module")
def rows_of(batch):
    """rows_of(tie): `score_rows` (vmap) of `tiny_llama(tie)`, computed once per value."""
    cache = {}

    def rows(tie):
        if tie not in cache:
            cache[tie] = score_rows(tiny_llama(tie), *batch, method="vmap")
        return cache[tie]

    return rows


def test_log_probs_equal_a_plain_forward_pass(batch):
    """With the explicit causal mask, left padding changes no log-prob, and each equals the
    log_softmax of a plain forward pass at the next token, summed over the completion."""
    model = tiny_llama(tie=True)
    input_ids, attention_mask, completion_mask = batch
    padded = log_pi(model, *batch)
    alone = log_pi(model, input_ids[:1, 2:], attention_mask[:1, 2:], completion_mask[:1])
    assert padded[0].item() == pytest.approx(alone.item(), abs=1e-12)
    for i in (0, 2):  # rollout 0 without its padding; rollout 2 has none
        ids = input_ids[i][attention_mask[i].bool()][None]
        start = ids.shape[1] - COMPLETION
        logits = model(ids).logits[0, start - 1 : -1]
        by_hand = logits.log_softmax(-1).gather(-1, input_ids[i, PROMPT:, None]).sum()
        assert padded[i].item() == pytest.approx(by_hand.item(), abs=1e-12)


def test_sequence_log_probs_options_change_no_value(batch):
    """Per token, float64 kept for a float64 model; the default 2-D mask, the explicit one, the
    model's own parameters passed in, and the embeddings passed in give the same numbers on
    rows without left padding (eager attention gives a float64 model's padding rows NaN)."""
    model = tiny_llama(tie=False)
    rows = tuple(t[1:] for t in batch)  # rollouts 1-4: no left padding
    per_token = sequence_log_probs(model, *rows)
    assert per_token.shape == (ROLLOUTS - 1, COMPLETION) and per_token.dtype == torch.float64
    assert (per_token[0, -2:] == 0).all()  # rollout 1's masked tokens
    params = {name: p.detach() for name, p in model.named_parameters()}
    embeds = model.get_input_embeddings()(rows[0])
    for options in ({}, {"params": params}, {"inputs_embeds": embeds}):
        torch.testing.assert_close(
            log_pi(model, *rows, **options), per_token.sum(dim=1), rtol=0, atol=1e-12
        )
    hot = sequence_log_probs(model, *rows, temperature=2.0)
    logits = model(rows[0][2:3]).logits[0, PROMPT - 1 : -1] / 2
    by_hand = logits.log_softmax(-1).gather(-1, rows[0][2, PROMPT:, None])[:, 0]
    torch.testing.assert_close(hot[2], by_hand, rtol=0, atol=1e-12)


def test_causal_attention_mask():
    mask = causal_attention_mask(torch.tensor([[0, 1, 1]]), torch.float32)
    low = torch.finfo(torch.float32).min
    # Query 0 is padding and sees itself only; real queries see real keys up to themselves.
    assert mask.shape == (1, 1, 3, 3)
    assert mask[0, 0].tolist() == [[0, low, low], [low, 0, low], [low, 0, 0]]


def test_vmap_and_loop_rows_agree(batch, rows_of):
    model, rows = tiny_llama(tie=True), rows_of(True)
    assert rows.shape == (ROLLOUTS, sum(p.numel() for p in model.parameters()))
    loop = score_rows(model, *batch, method="loop")
    torch.testing.assert_close(loop, rows, rtol=0, atol=1e-12)
    # Row 3 against plain autograd on the model's own parameters.
    model.zero_grad()
    log_pi(model, *(t[3:4] for t in batch)).sum().backward()
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
    assert list(layers) == [
        "model.embed_tokens.weight",
        "model.layers.0",
        "model.layers.1",
        "model.norm.weight",
        *head,
    ]
    layer_1 = score_rows(model, *batch, include=r"layers\.1\.")
    torch.testing.assert_close(layers["model.layers.1"], layer_1 @ layer_1.T, rtol=1e-10, atol=0)


def test_subsets_tied_weights_and_frozen_models(batch, rows_of):
    model, rows = tiny_llama(tie=True), rows_of(True)
    columns = dict(
        zip(
            select_parameters(model),
            rows.split([p.numel() for p in select_parameters(model).values()], dim=1),
        )
    )
    # "lm_head" selects the tied embedding, and its gradient counts both uses.
    ((name, param),) = select_parameters(model, "lm_head").items()
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


def test_weight_gradient_rank_is_bounded_by_tokens(batch):
    model = tiny_llama(tie=True)
    rows = 2

    def loss():
        log_probs = log_pi(model, *(t[:rows] for t in batch))
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


def test_rollout_gram_and_layer_names(batch, rows_of):
    model, rows = tiny_llama(tie=True), rows_of(True)
    input_ids, attention_mask, completion_mask = batch
    rollouts = SimpleNamespace(
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_mask=completion_mask,
        temperature=1.0,
    )
    torch.testing.assert_close(
        rollout_gram(model, rollouts, length_normalised=False),
        rows @ rows.T,
        rtol=1e-10,
        atol=1e-12,
    )
    normalised = rows / completion_mask.sum(dim=1, keepdim=True)  # rollout 1 has 4 tokens
    torch.testing.assert_close(
        rollout_gram(model, rollouts), normalised @ normalised.T, rtol=1e-10, atol=1e-12
    )
    assert layer_of("model.layers.3.mlp.up_proj.weight") == "model.layers.3"
    assert layer_of("lm_head.weight") == "lm_head.weight"


def test_representative_matrices():
    untied = representative_matrices(tiny_llama(tie=False))
    assert untied == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "lm_head.weight",
    ]
    # A tied head is still named (as the alias of the embedding).
    assert representative_matrices(tiny_llama(tie=True))[-1] == "lm_head.weight"


def test_rejects_bad_input(batch):
    model = tiny_llama(tie=True)
    with pytest.raises(ValueError, match="method"):
        score_rows(model, *batch, method="svd")
    with pytest.raises(ValueError, match="method"):
        score_grams(model, *batch, method="svd")
    with pytest.raises(ValueError, match="no parameter"):
        select_parameters(model, "attention_sink")
