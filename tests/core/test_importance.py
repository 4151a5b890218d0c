"""core/importance.py: each correction's weights against the code of the library it is named
after, run on the same tensors (TRL 1.16.0's own lines, verl 0.9.1's own functions), the
samplers against transformers' and bfloat16's, and the identities the chapter relies on, by
exact enumeration and by Monte Carlo.

Tolerances: the weights are the same float64 operations as TRL's and verl's, so equal to 1e-12;
the exact expectations are sums over all 81 sequences of a policy (1e-12); a Monte Carlo mean
of n draws is held to 5 standard errors of that mean.
"""

import importlib.util
import inspect
import math
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from verl_stubs import import_verl_module

from grpo_companion.core.importance import (
    VLLM_IMPORTANCE_SAMPLING_MODES,
    kept_mass,
    rollout_is_weights,
    rollout_rejection_mask,
    round_logits,
    sequence_log_ratio,
    top_p_log_probs,
    vllm_importance_weights,
    weighted_advantages,
)
from grpo_companion.core.kl import kl_penalty
from grpo_companion.core.losses import aggregate, grpo_loss, policy_loss
from grpo_companion.core.policy_gradient import SequencePolicy, sum_mod_reward

EXACT = 1e-12


def batch(seed: int = 0, rows: int = 256, width: int = 7, spread: float = 0.6):
    """log pi - log pi_samp (rows, width) and a completion mask of random lengths 1..width."""
    generator = torch.Generator().manual_seed(seed)
    log_ratio = spread * torch.randn(rows, width, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (rows, 1), generator=generator)
    mask = (torch.arange(width) < lengths).to(torch.float64)
    return log_ratio, mask


# --- TRL: its own lines ------------------------------------------------------------------------


def trl_weight_lines() -> str:
    """TRL 1.16.0 computes the weights inline in `GRPOTrainer._generate_and_score_completions`
    (trl/trainer/grpo_trainer.py, from `per_token_logps_diff = ...` to the `raise` of an unknown
    mode: lines 2662-2707 of the installed file). These are those lines, read from the installed
    source and dedented, not a copy."""
    from trl.trainer import grpo_trainer

    lines = inspect.getsource(grpo_trainer.GRPOTrainer._generate_and_score_completions).splitlines()
    start = next(i for i, line in enumerate(lines) if "per_token_logps_diff = (old_per" in line)
    unknown = next(i for i, line in enumerate(lines) if "Unknown vLLM importance sampling" in line)
    end = next(i for i in range(unknown, len(lines)) if lines[i].strip() == ")")
    return textwrap.dedent("\n".join(lines[start : end + 1]))


def trl_weights(log_ratio, mask, mode, clip_max, clip_min):
    pytest.importorskip("trl")
    self = SimpleNamespace(
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_max=clip_max,
        vllm_importance_sampling_clip_min=clip_min,
    )
    # old - sampling = log_ratio; any split of it gives the same difference
    scope = {
        "torch": torch,
        "math": math,
        "self": self,
        "mask": mask,
        "old_per_token_logps": log_ratio,
        "sampling_per_token_logps": torch.zeros_like(log_ratio),
    }
    exec(trl_weight_lines(), scope)
    return scope["vllm_importance_sampling_ratio"]


def test_trl_is_the_pinned_version():
    trl = pytest.importorskip("trl")
    assert trl.__version__ == "1.16.0"


@pytest.mark.parametrize("mode", VLLM_IMPORTANCE_SAMPLING_MODES)
@pytest.mark.parametrize("bounds", [(3.0, None), (1.5, 0.7), (None, 0.5), (math.inf, None)])
def test_vllm_importance_weights_are_trls(mode, bounds):
    clip_max, clip_min = bounds
    if mode.endswith("truncate") and clip_max is None and clip_min is None:
        pytest.skip("TRL refuses a truncate mode without bounds")
    log_ratio, mask = batch()
    ours = vllm_importance_weights(log_ratio, mask, mode, clip_max, clip_min)
    theirs = trl_weights(log_ratio, mask, mode, clip_max, clip_min)
    assert ours.shape == theirs.shape == ((256, 1) if mode.startswith("sequence") else (256, 7))
    assert (ours - theirs).abs().max().item() <= EXACT
    # the bounds act on this batch: some weights are changed, some are not
    level = mode.split("_")[0]
    raw = vllm_importance_weights(log_ratio, mask, f"{level}_truncate", math.inf)
    changed = (ours != raw).double().mean().item()
    assert changed == 0 if clip_max == math.inf else 0 < changed < 1


def test_trls_nan_sampling_log_prob_gives_ratio_one():
    log_ratio, mask = batch(rows=4)
    log_ratio[0, 0] = math.nan
    for mode in VLLM_IMPORTANCE_SAMPLING_MODES:
        ours = vllm_importance_weights(log_ratio, mask, mode, 3.0)
        assert torch.equal(ours, trl_weights(log_ratio, mask, mode, 3.0, None))
    assert vllm_importance_weights(log_ratio, mask, "token_mask", 3.0)[0, 0] == 1.0


def test_the_sequence_ratio_is_a_product_not_a_geometric_mean():
    log_ratio, mask = batch()
    weights = vllm_importance_weights(log_ratio, mask, "sequence_truncate", math.inf)
    for row in range(len(log_ratio)):
        tokens = log_ratio[row][mask[row] == 1].tolist()
        assert weights[row, 0].item() == pytest.approx(math.prod(map(math.exp, tokens)), rel=EXACT)


def test_truncation_at_infinity_is_plain_importance_sampling():
    log_ratio, mask = batch()
    token = vllm_importance_weights(log_ratio, mask, "token_truncate", math.inf)
    sequence = vllm_importance_weights(log_ratio, mask, "sequence_truncate", math.inf)
    assert torch.equal(token, torch.exp(log_ratio * mask))
    assert torch.equal(sequence, torch.exp(sequence_log_ratio(log_ratio, mask)))


def test_a_mask_with_a_huge_cap_is_plain_sequence_importance_sampling():
    log_ratio, mask = batch()
    plain = vllm_importance_weights(log_ratio, mask, "sequence_truncate", math.inf)
    for cap in (1e30, math.inf, None):
        assert torch.equal(vllm_importance_weights(log_ratio, mask, "sequence_mask", cap), plain)


def test_trls_checks():
    log_ratio, mask = batch(rows=2)
    with pytest.raises(ValueError, match="clip_min or clip_max"):
        vllm_importance_weights(log_ratio, mask, "token_truncate", None, None)
    with pytest.raises(ValueError, match="clip_min < clip_max"):
        vllm_importance_weights(log_ratio, mask, "token_mask", 1.0, 2.0)
    with pytest.raises(ValueError, match="unknown mode"):
        vllm_importance_weights(log_ratio, mask, "sequence_clip")


# --- verl: its own functions -------------------------------------------------------------------


@pytest.fixture(scope="module")
def verl_helper():
    """verl 0.9.1's ``verl.trainer.ppo.rollout_corr_helper``, imported with bare stand-ins for
    the distributed stack verl's package imports (and that these functions never use), taken
    out of sys.modules again afterwards."""
    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl is not installed (pip install --no-deps verl==0.9.1 omegaconf)")
    helper = import_verl_module("verl.trainer.ppo.rollout_corr_helper")
    assert sys.modules["verl"].__version__ == "0.9.1"
    return helper


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, 3.0, "0.5_5.0", "0.8_1.5", math.inf])
def test_rollout_is_weights_are_verls(verl_helper, level, threshold):
    log_ratio, mask = batch(seed=1)
    theirs, _ = verl_helper.compute_rollout_correction_weights(log_ratio, mask, level, threshold)
    ours = rollout_is_weights(log_ratio, mask, level, threshold)
    assert (ours - theirs).abs().max().item() <= EXACT


@pytest.mark.parametrize(
    ("option", "threshold"),
    [
        ("token_k1", "0.5_2.0"), ("token_k1", 2.0), ("token_k2", 0.1), ("token_k3", 0.05),
        ("seq_sum_k1", "0.5_2.0"), ("seq_sum_k2", 0.3), ("seq_sum_k3", 0.3),
        ("seq_mean_k1", "0.8_1.3"), ("seq_mean_k1", "0.999_1.001"), ("seq_mean_k2", 0.05),
        ("seq_mean_k3", 0.01), ("seq_max_k2", 0.2), ("seq_max_k3", 0.2),
        ("token_k1,seq_mean_k3", "0.5_2.0,0.05"), ("seq_sum_k1, seq_max_k2", 2.0),
    ],
)  # fmt: skip
def test_rollout_rejection_mask_is_verls(verl_helper, option, threshold):
    log_ratio, mask = batch(seed=2, spread=0.3)
    theirs, _ = verl_helper.compute_rollout_rejection_mask(log_ratio, mask, option, threshold)
    ours = rollout_rejection_mask(log_ratio, mask, option, threshold)
    assert torch.equal(ours, theirs.to(ours.dtype))


def test_verls_k1_bounds_are_on_minus_log_rho():
    """verl keeps a token when log(lower) <= -log rho <= log(upper): the ratio interval is
    [1/upper, 1/lower], the same as [lower, upper] only for reciprocal bounds."""
    log_ratio = torch.log(torch.tensor([[0.6, 1.9, 2.1, 0.4]], dtype=torch.float64))
    mask = torch.ones_like(log_ratio)
    assert rollout_rejection_mask(log_ratio, mask, "token_k1", "0.5_2.0").tolist() == [[1, 1, 0, 0]]
    kept = rollout_rejection_mask(log_ratio, mask, "token_k1", "0.55_1.8")  # rho in [0.556, 1.82]
    assert kept.tolist() == [[1, 0, 0, 0]]


# --- the samplers ----------------------------------------------------------------------------


@pytest.mark.parametrize("top_p", [0.5, 0.8, 0.9, 0.95, 0.999, 1.0])
def test_top_p_is_transformers_nucleus_renormalised(top_p):
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = 2 * torch.randn(64, 30, generator=torch.Generator().manual_seed(3))
    theirs = TopPLogitsWarper(top_p)(None, logits.clone()).log_softmax(dim=-1)
    ours = top_p_log_probs(logits, top_p)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    kept = torch.isfinite(ours)
    assert (ours[kept] - theirs[kept]).abs().max().item() <= 1e-6  # float32 logits
    mass = kept_mass(logits, top_p)
    assert (mass >= top_p - 1e-6).all()
    # smallest such set: without its least likely kept token the mass falls below top_p
    probs = logits.softmax(dim=-1)
    least = probs.masked_fill(~kept, math.inf).amin(dim=-1)
    # (to float32 rounding: the sums' order, and so the last bit, depends on the CPU's kernels)
    assert ((mass - least < top_p + 1e-6) | (kept.sum(dim=-1) == 1)).all()
    assert torch.allclose(ours[kept].exp(), (probs / mass[:, None])[kept], atol=1e-6)


def test_the_mean_ratio_under_top_p_is_the_kept_mass():
    """E_{y ~ pi_samp}[pi(y) / pi_samp(y)] = sum over the nucleus of pi = Z, exactly, at every
    context; and over sampled tokens, the mean ratio is the mean Z."""
    logits = 1.5 * torch.randn(
        50, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64
    )
    for top_p in (0.7, 0.8, 0.9):
        sampler = top_p_log_probs(logits, top_p)
        pi = logits.softmax(dim=-1)
        ratio = torch.where(torch.isfinite(sampler), pi / sampler.exp(), 0.0)
        exact = (sampler.exp() * ratio).sum(dim=-1)
        assert (exact - kept_mass(logits, top_p)).abs().max().item() <= EXACT
        draws = torch.multinomial(sampler.exp(), 2000, replacement=True,
                                  generator=torch.Generator().manual_seed(5))  # fmt: skip
        sampled = ratio.gather(1, draws).mean(dim=1)
        assert (sampled - exact).abs().max().item() <= EXACT  # every kept token's ratio is Z
        assert (exact <= 1).all() and (exact >= top_p).all()


def test_rounding_to_8_bits_is_bfloat16():
    values = 5 * torch.randn(100_000, generator=torch.Generator().manual_seed(6))
    assert torch.equal(round_logits(values, 8), values.to(torch.bfloat16).float())
    coarse = round_logits(values.double(), 3)
    assert ((coarse - values.double()).abs() <= values.double().abs() * 2.0**-3 + 1e-12).all()
    grid = torch.unique(round_logits(torch.linspace(1, 2, 1000), 3))  # step 2^(1 - 3) in [1, 2)
    assert grid.tolist() == [1.0, 1.25, 1.5, 1.75, 2.0]


# --- identities on the enumerable policy, exactly and by Monte Carlo -------------------------


@pytest.fixture(scope="module")
def toy():
    policy = SequencePolicy(vocab_size=3, length=4)
    logits = policy.init_logits(0, scale=1.5)
    sampler = logits / 0.8  # a colder sampler: some sequence ratios exceed 3
    sequences = policy.all_sequences()
    log_ratio = (
        policy.token_log_probs(logits, sequences) - policy.token_log_probs(sampler, sequences)
    ).detach()
    rewards = sum_mod_reward(sequences, 3)
    return policy, logits, sampler, log_ratio, rewards


def test_plain_sequence_importance_sampling_is_unbiased(toy):
    """E_samp[rho(y) r(y) s(y)] = grad J and E_samp[rho(y) s(y)] = 0 exactly; token-level
    weights are not: the prefix of token t is still drawn from the sampler."""
    policy, logits, sampler, log_ratio, rewards = toy
    mask = torch.ones_like(log_ratio)
    samp = policy.probs(sampler).detach()
    scores = policy.scores(logits, policy.all_sequences())
    rho = vllm_importance_weights(log_ratio, mask, "sequence_truncate", math.inf)[:, 0]
    assert (
        (samp * rho * rewards) @ scores - policy.exact_gradient(logits, rewards)
    ).abs().max() <= EXACT
    assert ((samp * rho) @ scores).abs().max() <= EXACT
    token = vllm_importance_weights(log_ratio, mask, "token_truncate", math.inf)
    token_scores = scores.view(len(scores), policy.length, -1)
    token_is = (samp * rewards) @ (token[:, :, None] * token_scores).flatten(start_dim=1)
    assert (token_is - policy.exact_gradient(logits, rewards)).norm() > 0.01


def test_capped_weights_by_monte_carlo(toy):
    """The exact mean of the sequence_mask-weighted REINFORCE term against 200,000 draws from
    the sampler: within 5 standard errors in every coordinate."""
    policy, logits, sampler, log_ratio, rewards = toy
    mask = torch.ones_like(log_ratio)
    samp = policy.probs(sampler).detach()
    weights = vllm_importance_weights(log_ratio, mask, "sequence_mask", 3.0)[:, 0]
    assert 0 < (weights == 0).double() @ samp < 0.05  # the cap acts, on a few draws
    terms = (weights * rewards)[:, None] * policy.scores(logits, policy.all_sequences())
    exact = samp @ terms
    draws = torch.multinomial(
        samp, 200_000, replacement=True, generator=torch.Generator().manual_seed(7)
    )
    sampled = terms[draws]
    error = (sampled.mean(dim=0) - exact).abs()
    standard_error = sampled.std(dim=0) / math.sqrt(len(draws))
    assert (error <= 5 * standard_error + EXACT).all()
    assert (exact - policy.exact_gradient(logits, rewards)).norm() > 1e-3  # and it is biased


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo"])
@pytest.mark.parametrize("mode", ["token_mask", "sequence_truncate"])
def test_weighted_advantages_weight_each_policy_loss(loss_type, mode):
    """grpo_loss with advantages u A is TRL's loss: per_token_loss * u + beta * KL, aggregated
    (value and gradient), away from ratio 1 where some tokens are clipped."""
    generator = torch.Generator().manual_seed(8)
    log_probs = 0.3 * torch.randn(6, 5, generator=generator, dtype=torch.float64)
    old = log_probs + 0.4 * torch.randn(6, 5, generator=generator, dtype=torch.float64)
    ref = log_probs + 0.2 * torch.randn(6, 5, generator=generator, dtype=torch.float64)
    advantages = torch.randn(6, generator=generator, dtype=torch.float64)
    mask = (torch.arange(5) < torch.tensor([[5], [3], [4], [5], [1], [2]])).to(torch.float64)
    weights = vllm_importance_weights(old - log_probs, mask, mode, 1.3)
    assert ((weights == 0) | (weights == 1.3)).any() and (weights.expand_as(mask) > 0).any()
    options = {"loss_type": loss_type} | ({"delta": 1.5} if loss_type in ("grpo", "dapo") else {})
    log_probs.requires_grad_(True)
    ours, _ = grpo_loss(
        log_probs, old, ref, weighted_advantages(advantages, weights), mask, beta=0.1, **options
    )
    per_token = policy_loss(log_probs, old, advantages, mask, **options) * weights
    trls = aggregate(per_token + 0.1 * kl_penalty(log_probs, ref), mask, loss_type)
    assert ours.item() == pytest.approx(trls.item(), abs=EXACT)
    (ours_gradient,) = torch.autograd.grad(ours, log_probs)
    (trls_gradient,) = torch.autograd.grad(trls, log_probs)
    assert (ours_gradient - trls_gradient).abs().max().item() <= EXACT
