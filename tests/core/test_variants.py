"""The cards of book/variants.md: each TRL 1.16.0 and verl 0.9.1 variant the book adds, held to
the library's own code where it implements it, else to an exact value. (The variants the book
already had are held to verl in tests/core/test_verl_equivalence.py and to TRL's trainer in
tests/lm/test_trl_equivalence.py.)

TRL's code runs on our tensors: `GRPOTrainer.compute_loss` (and `GMPOTrainer`'s), public API,
called on a stand-in trainer whose forward pass returns the tensors, with TRL's `GRPOConfig`
for every setting. verl's `core_algos` is imported through `verl_stubs`, with verl's own
`ActorConfig`. Everything is float64, so "equal" means to 1e-12 unless verl's 1e-8 guards
(its `masked_mean`, `agg_loss`, `geo_mean`, `masked_whiten`) set the tolerance.
"""

import importlib.util
import math
import types
from collections import defaultdict

import numpy as np
import pytest
import torch

from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.importance import vllm_importance_weights
from grpo_companion.core.kl import (
    adaptive_kl_coef,
    bias_corrected_kl,
    exact_kl,
    kl_penalty,
    verl_kl_penalty,
)
from grpo_companion.core.losses import (
    aggregate,
    clipped_surrogate,
    grpo_loss,
    off_policy_sequence_mask,
    policy_loss,
)
from grpo_companion.core.variants import (
    adaptive_entropy_coef,
    clip_cov_surrogate,
    dppo_mask,
    dppo_surrogate,
    dro_surrogate,
    entropy_bonus,
    geometric_mean_surrogate,
    high_entropy_mask,
    kl_cov_surrogate,
    token_covariance,
    weighted_reinforce_surrogate,
)
from grpo_companion.core.verl_estimators import gdpo_advantages

# transformers 5 renamed gradient checkpointing, which TRL 1.16's GRPOConfig still sets.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`gradient_checkpointing` is deprecated:FutureWarning"
)

F64 = torch.float64
EXACT = {"rtol": 0, "atol": 1e-12}
# verl divides by a count + 1e-8 (`masked_mean`, `agg_loss`): a relative 1e-8 / count.
VERL_CLOSE = {"rtol": 1e-7, "atol": 1e-12}
LENGTHS = (6, 4, 5, 2)  # one batch of four completions, the longest 6 tokens
ADVANTAGES = (1.2, -0.7, 0.0, -1.5)


def make_batch(seed: int = 0, shift: float = 0.5):
    """(log_probs leaf, old_log_probs, advantages (4,), mask (4, 6), entropies): probabilities in
    (0.05, 0.95), log_probs moved from old ones by `shift` times a standard normal, below 0."""
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.arange(6) < torch.tensor(LENGTHS)[:, None]).to(F64)
    old = (torch.rand(4, 6, generator=generator, dtype=F64) * 0.9 + 0.05).log()
    new = (old + shift * torch.randn(4, 6, generator=generator, dtype=F64)).clamp(max=-1e-3)
    entropies = 3 * torch.rand(4, 6, generator=generator, dtype=F64)
    return new.requires_grad_(), old, torch.tensor(ADVANTAGES, dtype=F64), mask, entropies


def value_and_grad(loss_fn, log_probs):
    """loss_fn(leaf) on a fresh leaf copy of log_probs: (value, d value / d log_probs)."""
    leaf = log_probs.detach().clone().requires_grad_()
    value = loss_fn(leaf)
    return value.detach(), torch.autograd.grad(value, leaf)[0]


def assert_same(ours, theirs, log_probs, **tolerance):
    """Two losses of log_probs agree in value and gradient."""
    tolerance = tolerance or EXACT
    value, grad = value_and_grad(ours, log_probs)
    their_value, their_grad = value_and_grad(theirs, log_probs)
    torch.testing.assert_close(value, their_value, **tolerance)
    torch.testing.assert_close(grad, their_grad, **tolerance)


# --- TRL's code on our tensors --------------------------------------------------------------


class _Accelerator:
    """One process: every collective is the identity."""

    num_processes = 1
    sync_gradients = True
    is_main_process = True

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather

    def pad_across_processes(self, tensor, dim=0, pad_index=0):
        return tensor


@pytest.fixture(scope="module")
def trl(tmp_path_factory):
    """make(**settings) -> a stand-in trainer with TRL's GRPOConfig (or GMPOConfig, gmpo=True),
    and loss(trainer, log_probs, old_log_probs, advantages, mask, entropies, **inputs) -> TRL's
    `compute_loss` on them."""
    pytest.importorskip("trl")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl import GRPOConfig, GRPOTrainer
        from trl.experimental.gmpo import GMPOConfig, GMPOTrainer
    output_dir = str(tmp_path_factory.mktemp("trl"))

    def make(gmpo=False, **settings):
        config, trainer = (GMPOConfig, GMPOTrainer) if gmpo else (GRPOConfig, GRPOTrainer)
        args = config(output_dir=output_dir, use_cpu=True, bf16=False, report_to=[], **settings)
        stub = types.SimpleNamespace(
            args=args,
            accelerator=_Accelerator(),
            model=types.SimpleNamespace(training=True),
            current_gradient_accumulation_steps=1,
            _metrics=defaultdict(lambda: defaultdict(list)),
            aux_loss_enabled=False,
            use_vllm=False,
            epsilon_low=args.epsilon,
            epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
            _entropy_bonus_enabled=args.entropy_coef != 0.0 or args.use_adaptive_entropy,
            _last_world_entropy=float("inf"),
            _entropy_window_stats=None,
            get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
            get_gamma_weights=GRPOTrainer.get_gamma_weights,
        )
        for name in (
            "loss_type", "beta", "importance_sampling_level", "top_entropy_quantile",
            "entropy_coef", "use_adaptive_entropy", "off_policy_mask_threshold",
            "vllm_importance_sampling_correction",
        ):  # fmt: skip
            setattr(stub, name, getattr(args, name))
        stub._compute_loss = types.MethodType(trainer._compute_loss, stub)
        stub.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, stub)
        stub.compute_loss = types.MethodType(trainer.compute_loss, stub)
        return stub

    def loss(stub, log_probs, old_log_probs, advantages, mask, entropies, **inputs):
        stub._get_per_token_logps_and_entropies = lambda *args, **kwargs: (
            log_probs, entropies, None,
        )  # fmt: skip
        rows, width = mask.shape
        batch = {
            "prompt_ids": torch.zeros(rows, 1, dtype=torch.long),
            "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
            "completion_ids": torch.zeros(rows, width, dtype=torch.long),
            "completion_mask": mask,
            "advantages": advantages,
            "old_per_token_logps": old_log_probs,
            "num_items_in_batch": mask.sum(),
            **inputs,
        }
        return stub.compute_loss(None, batch)

    return types.SimpleNamespace(make=make, loss=loss, trainer=GRPOTrainer)


def test_the_stand_in_runs_trls_loss_as_grpo_loss_does(trl):
    """The harness itself: TRL's dapo loss with the bias-corrected k3, off-policy, equals ours."""
    log_probs, old, advantages, mask, entropies = make_batch(1)
    ref = old - 0.3
    stub = trl.make(loss_type="dapo", beta=0.1)
    assert_same(
        lambda lp: grpo_loss(
            lp, old, ref, advantages, mask, beta=0.1, loss_type="dapo", use_bias_correction_kl=True
        )[0],
        lambda lp: trl.loss(stub, lp, old, advantages, mask, entropies, ref_per_token_logps=ref),
        log_probs,
    )


# --- verl's code ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verl():
    """verl 0.9.1's ``core_algos``, imported through `verl_stubs` as in test_verl_equivalence."""
    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl is not installed")
    from verl_stubs import import_core_algos

    return import_core_algos()


def actor_config(verl, policy_loss=None, **options):
    """verl's ActorConfig (its defaults, ``clip_ratio_c`` 3 included) with ``options``, and its
    PolicyLossConfig with ``policy_loss``."""
    from verl.workers.config import PolicyLossConfig

    return verl.ActorConfig(
        strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=1,
        policy_loss=PolicyLossConfig(**(policy_loss or {})), **options,
    )  # fmt: skip


def verl_policy_loss(verl, name, mode="token-mean", policy_loss=None, **options):
    """verl's registered policy loss `name` as a function of log_probs, per-token advantages."""
    function = verl.get_policy_loss_fn(name)
    config = actor_config(verl, policy_loss, **options)

    def loss(log_probs, old_log_probs, advantages, mask):
        value, _ = function(
            old_log_probs, log_probs, advantages[:, None].expand_as(log_probs), mask, mode, config
        )
        return value

    return loss


# --- the policy losses ----------------------------------------------------------------------


def test_gmpo_equals_trls_gmpo_and_verls_geo_mean(trl, verl):
    log_probs, old, advantages, mask, entropies = make_batch(2)
    ours = geometric_mean_surrogate  # TRL's default epsilon, 0.4 in log space
    assert_same(
        lambda lp: ours(lp, old, advantages, mask).mean(),
        lambda lp: trl.loss(trl.make(gmpo=True), lp, old, advantages, mask, entropies),
        log_probs,
    )
    # verl reads clip_ratio_low and clip_ratio_high (0.2 by default) as the log-space bounds
    theirs = verl_policy_loss(verl, "geo_mean", clip_ratio_low=0.4, clip_ratio_high=0.4)
    assert_same(
        lambda lp: ours(lp, old, advantages, mask).mean(),
        lambda lp: theirs(lp, old, advantages, mask),
        log_probs,
        rtol=1e-7,
        atol=1e-12,  # verl divides by L + 1e-8
    )


def test_gmpo_weights_each_unclipped_token_by_the_geometric_mean_over_the_length():
    log_ratio = torch.tensor([[0.1, 0.6, -0.2], [0.1, -0.6, 0.2]], dtype=F64)
    advantages, mask = torch.tensor([2.0, -1.0], dtype=F64), torch.ones(2, 3, dtype=F64)
    log_probs = log_ratio.clone().requires_grad_()
    loss = geometric_mean_surrogate(log_probs, torch.zeros_like(log_ratio), advantages, mask)
    (grad,) = torch.autograd.grad(loss.sum(), log_probs)
    # A > 0 caps log rho at 0.4 (token 2 is clipped), A < 0 floors it at -0.4 (token 2).
    geometric = torch.tensor(
        [math.exp((0.1 + 0.4 - 0.2) / 3), math.exp((0.1 - 0.4 + 0.2) / 3)], dtype=F64
    )
    torch.testing.assert_close(loss, -geometric * advantages, **EXACT)
    weight = -(geometric * advantages / 3)[:, None] * torch.tensor([[1, 0, 1], [1, 0, 1]])
    torch.testing.assert_close(grad, weight, **EXACT)


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_equals_verl(verl, divergence):
    log_probs, old, advantages, mask, _ = make_batch(3)
    theirs = verl_policy_loss(verl, f"dppo_{divergence}", clip_ratio_low=0.1, clip_ratio_high=0.15)
    keep = dppo_mask(
        log_probs, old, advantages, divergence=divergence, epsilon=0.1, epsilon_high=0.15
    )
    assert 0 < keep[mask > 0].mean() < 1  # the batch straddles the trust region
    assert_same(
        lambda lp: aggregate(
            dppo_surrogate(
                lp, old, advantages, divergence=divergence, epsilon=0.1, epsilon_high=0.15
            ),
            mask,
            "dapo",
        ),  # fmt: skip
        lambda lp: theirs(lp, old, advantages, mask),
        log_probs,
        **VERL_CLOSE,
    )


def test_dppo_tv_region_and_weight_hand_computed():
    # p_old = 0.5 at both tokens; p = 0.8 (moved up by 0.3) and 0.45 (down by 0.05).
    old = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=F64))
    log_probs = torch.log(torch.tensor([[0.8, 0.45], [0.8, 0.45]], dtype=F64)).requires_grad_()
    advantages = torch.tensor([1.0, -1.0], dtype=F64)
    keep = dppo_mask(log_probs, old, advantages, epsilon=0.2)
    # A > 0: up by 0.3 > 0.2 leaves the region; A < 0: any rise is fine, the fall 0.05 < 0.2.
    assert keep.tolist() == [[0.0, 1.0], [1.0, 1.0]]
    loss = dppo_surrogate(log_probs, old, advantages, clip_ratio_c=1.5)
    (grad,) = torch.autograd.grad(loss.sum(), log_probs)
    # omega = min(rho, c) inside: rho = 1.6 capped at 1.5, rho = 0.9.
    torch.testing.assert_close(grad, torch.tensor([[0, -0.9], [1.5, 0.9]], dtype=F64), **EXACT)


def test_dro_equals_verl_and_pulls_zero_advantage_tokens_back(verl):
    log_probs, old, advantages, mask, _ = make_batch(4)
    theirs = verl_policy_loss(verl, "dro", policy_loss={"dro_beta": 0.3})
    assert_same(
        lambda lp: aggregate(dro_surrogate(lp, old, advantages, 0.3), mask, "dapo"),
        lambda lp: theirs(lp, old, advantages, mask),
        log_probs,
        **VERL_CLOSE,
    )
    (grad,) = torch.autograd.grad(dro_surrogate(log_probs, old, advantages, 0.3).sum(), log_probs)
    expected = -(advantages[:, None] - 0.3 * (log_probs.detach() - old))
    torch.testing.assert_close(grad, expected, **EXACT)
    assert grad[2].abs().min() > 0  # A = 0, yet every token is pulled towards pi_old


def test_clip_cov_equals_verl_with_the_same_random_draw(verl):
    log_probs, old, _, mask, _ = make_batch(6, shift=0.2)
    advantages = torch.tensor([1.2, -0.7, 0.4, -1.5], dtype=F64)  # none 0: a zeroed token shows
    settings = {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.05, "clip_cov_ub": 5.0}
    theirs = verl_policy_loss(verl, "clip_cov", policy_loss=settings)

    def ours(lp):
        torch.manual_seed(11)  # verl draws with torch's global generator
        return aggregate(clip_cov_surrogate(lp, old, advantages, mask, **settings), mask, "dapo")

    def verls(lp):
        torch.manual_seed(11)
        return theirs(lp, old, advantages, mask)

    assert_same(ours, verls, log_probs, **VERL_CLOSE)
    torch.manual_seed(11)
    per_token = clip_cov_surrogate(log_probs, old, advantages, mask, **settings)
    plain, clipped = clipped_surrogate(log_probs, old, advantages)
    covariance = token_covariance(log_probs, advantages, mask)
    candidates = (covariance > 0.05) & (covariance < 5.0) & (mask > 0) & ~clipped
    zeroed = (per_token == 0) & (plain != 0) & (mask > 0)
    # int(0.2 * 17) = 3 tokens drawn out of the 6 candidates the clip has not already stopped
    assert (zeroed.sum().item(), candidates.sum().item()) == (3, 6)
    assert not (zeroed & ~candidates).any()


def test_kl_cov_equals_verl_and_is_inert_on_policy(verl):
    log_probs, old, advantages, mask, _ = make_batch(6)
    settings = {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.5}
    theirs = verl_policy_loss(verl, "kl_cov", policy_loss=settings)
    assert_same(
        lambda lp: aggregate(kl_cov_surrogate(lp, old, advantages, mask, **settings), mask, "dapo"),
        lambda lp: theirs(lp, old, advantages, mask),
        log_probs,
        **VERL_CLOSE,
    )
    on_policy = kl_cov_surrogate(log_probs, log_probs.detach(), advantages, mask, **settings)
    (grad,) = torch.autograd.grad((on_policy * mask).sum(), log_probs)
    torch.testing.assert_close(grad, -advantages[:, None] * mask, **EXACT)  # plain REINFORCE
    off_policy = kl_cov_surrogate(log_probs, old, advantages, mask, **settings)
    penalised = (off_policy + advantages[:, None] * (log_probs - old).exp()).detach().abs() > 0
    assert penalised.sum().item() == int(0.2 * mask.sum().item())


def test_verl_gpg_and_cispo_are_weighted_reinforce(verl):
    """verl's gpg is REINFORCE (w = 1) and its cispo weighs by clip(rho, 1 - clip_ratio_low,
    1 + clip_ratio_high), detached: TRL's "cispo" caps rho at epsilon_high only, from above."""
    log_probs, old, advantages, mask, _ = make_batch(7)
    gpg = verl_policy_loss(verl, "gpg")
    assert_same(
        lambda lp: aggregate(weighted_reinforce_surrogate(lp, advantages), mask, "dapo"),
        lambda lp: gpg(lp, old, advantages, mask),
        log_probs,
        **VERL_CLOSE,
    )
    cispo = verl_policy_loss(verl, "cispo", clip_ratio_low=0.2, clip_ratio_high=0.28)

    def ours(lp):
        weights = torch.clamp((lp - old).exp(), 1 - 0.2, 1 + 0.28)
        return aggregate(weighted_reinforce_surrogate(lp, advantages, weights), mask, "dapo")

    assert_same(ours, lambda lp: cispo(lp, old, advantages, mask), log_probs, **VERL_CLOSE)
    below = (log_probs - old).exp() < 0.8  # where the two CISPOs part
    trl_cispo = policy_loss(log_probs, old, advantages, mask, "cispo", epsilon_high=1.28)
    verl_cispo = weighted_reinforce_surrogate(
        log_probs, advantages, torch.clamp((log_probs - old).exp(), 0.8, 1.28)
    )
    differ = ~torch.isclose(trl_cispo, verl_cispo) & (mask > 0)
    assert below[differ].all() and differ.any()


def test_verl_token_sum_is_dapo_times_the_token_count(verl):
    per_token = torch.randn(4, 6, generator=torch.Generator().manual_seed(8), dtype=F64)
    mask = make_batch()[3]
    ours = mask.sum() * aggregate(per_token, mask, "dapo")  # 17 tokens
    torch.testing.assert_close(ours, verl.agg_loss(per_token, mask, "token-sum"), **EXACT)


# --- token masks and weights ----------------------------------------------------------------


@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5, 1.0])
def test_high_entropy_mask_equals_trls(trl, quantile):
    *_, mask, entropies = make_batch(9)
    entropies = entropies.float()  # TRL's entropies are float32: its quantile is taken in float32
    stub = trl.make(top_entropy_quantile=quantile)
    theirs = stub.get_high_entropy_mask(entropies, mask, 1 - quantile)
    ours = high_entropy_mask(entropies, mask, quantile)
    assert torch.equal(ours, theirs)
    kept = int(ours.sum())
    assert kept == {0.0: 1, 0.2: 4, 0.5: 9, 1.0: 17}[quantile]  # of 17 tokens


def test_top_entropy_quantile_masks_trls_loss(trl):
    log_probs, old, advantages, mask, entropies = make_batch(10)
    stub = trl.make(loss_type="dapo", top_entropy_quantile=0.2)
    keep = high_entropy_mask(entropies, mask, 0.2)
    assert_same(
        lambda lp: aggregate(policy_loss(lp, old, advantages, mask) * keep, mask, "dapo"),
        lambda lp: trl.loss(stub, lp, old, advantages, mask, entropies),
        log_probs,
    )


def test_off_policy_sequence_mask_equals_trls(trl):
    log_probs, old, advantages, mask, _ = make_batch(11)
    for threshold in (0.0, 0.1, 0.5):
        theirs = trl.trainer.get_off_policy_mask(
            advantages[:, None], log_probs, old, mask, threshold
        )
        ours = off_policy_sequence_mask(log_probs, old, advantages, mask, threshold)
        assert torch.equal(ours, theirs)


def test_a_small_mismatch_over_a_long_completion_is_masked_by_trls_default():
    """0.012 nats per token over 100 tokens: the sequence's weight e^1.2 = 3.32 exceeds TRL's
    default cap of 3, and the default sequence_mask drops the whole completion (its card)."""
    log_ratio, mask = torch.full((1, 100), 0.012, dtype=F64), torch.ones(1, 100, dtype=F64)
    assert vllm_importance_weights(log_ratio, mask).item() == 0.0
    truncated = vllm_importance_weights(log_ratio, mask, "sequence_truncate")
    assert truncated.item() == 3.0
    kept = vllm_importance_weights(log_ratio, mask, "sequence_mask", clip_max=4.0)
    assert kept.item() == pytest.approx(math.exp(1.2), rel=1e-12)


def test_vllm_importance_weights_multiply_trls_per_token_loss(trl):
    log_probs, old, advantages, mask, entropies = make_batch(12)
    sampling = old + 0.2 * torch.randn(4, 6, generator=torch.Generator().manual_seed(0), dtype=F64)
    weights = vllm_importance_weights(old - sampling, mask, "token_truncate", clip_max=1.1)
    stub = trl.make(loss_type="dapo")
    stub.use_vllm = stub.vllm_importance_sampling_correction = True
    assert_same(
        lambda lp: aggregate(policy_loss(lp, old, advantages, mask) * weights, mask, "dapo"),
        lambda lp: trl.loss(
            stub, lp, old, advantages, mask, entropies, importance_sampling_ratio=weights
        ),
        log_probs,
    )


# --- the entropy bonus ----------------------------------------------------------------------


def test_entropy_bonus_equals_trls(trl):
    log_probs, old, advantages, mask, entropies = make_batch(13)
    entropies = entropies.requires_grad_()
    stub = trl.make(loss_type="grpo", entropy_coef=0.05)

    def ours():
        policy = aggregate(policy_loss(log_probs, old, advantages, mask), mask, "grpo")
        return policy + entropy_bonus(entropies, mask, 0.05)

    theirs = trl.loss(stub, log_probs, old, advantages, mask, entropies)
    torch.testing.assert_close(ours(), theirs, **EXACT)
    grad = torch.autograd.grad(theirs, entropies)[0]
    torch.testing.assert_close(grad, -0.05 * mask / mask.sum(), **EXACT)  # 1/17 per token


def test_adaptive_entropy_coefficient_follows_trls_controller(trl):
    log_probs, old, advantages, mask, _ = make_batch(14)
    settings = dict(entropy_coef=0.1, entropy_target=1.0, entropy_coef_delta=0.04)
    stub = trl.make(loss_type="dapo", use_adaptive_entropy=True, **settings)
    coefficient, applied = 0.1, 0.0  # TRL applies nothing before it has measured the entropy
    policy = aggregate(policy_loss(log_probs, old, advantages, mask), mask, "dapo")
    for level in (0.5, 0.8, 1.5, 0.9, 2.0, 2.0, 2.0):  # the mean entropy of each step
        entropies = torch.full((4, 6), level, dtype=F64)
        theirs = trl.loss(stub, log_probs, old, advantages, mask, entropies)
        torch.testing.assert_close(theirs, policy + entropy_bonus(entropies, mask, applied))
        coefficient, applied = adaptive_entropy_coef(
            coefficient, level, entropy_target=1.0, entropy_coef_delta=0.04
        )
        assert stub.entropy_coef == pytest.approx(coefficient, abs=1e-15)
    # 0.1 -> 0.14 -> 0.18 -> 0.14 -> 0.18, then three steps above the target: 0.06, none applied
    assert coefficient == pytest.approx(0.06, abs=1e-15) and applied == 0.0


# --- KL estimators and controllers ----------------------------------------------------------


def test_exact_kl_is_what_k1_and_k3_estimate_without_bias():
    """exact_kl by hand, and the mean of k1 and k3 over the outcomes drawn from pi (k2's is off)."""
    bernoulli = exact_kl(torch.tensor([0.25, 0.75]).log(), torch.tensor([0.5, 0.5]).log())
    assert bernoulli.item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5))
    one_sided = exact_kl(torch.tensor([0.0, 1.0]).log(), torch.tensor([0.5, 0.5]).log())
    assert one_sided.item() == pytest.approx(math.log(2))  # pi = 0 adds nothing
    log_pi = torch.log_softmax(torch.tensor([[0.3, -1.0, 2.0]], dtype=F64), dim=-1)
    log_ref = torch.log_softmax(torch.tensor([[1.0, 0.5, -0.5]], dtype=F64), dim=-1)
    kl = exact_kl(log_pi, log_ref)
    means = {k: (log_pi.exp() * kl_penalty(log_pi, log_ref, k)).sum() for k in ("k1", "k2", "k3")}
    torch.testing.assert_close(means["k1"], kl[0], **EXACT)
    torch.testing.assert_close(means["k3"], kl[0], **EXACT)
    assert abs(means["k2"] - kl[0]) > 0.1


def test_each_kl_estimator_weights_the_score_by_its_slope():
    """d/d log pi of each per-token KL loss, at pi = pi_old: k1 1, k2 x, k3 1 - e^-x, and with
    TRL's ratio k + slope: for k3, x (k2's: the reverse KL's gradient)."""
    x = torch.tensor([-1.0, -0.1, 0.3, 2.0], dtype=F64)
    log_probs = x.clone().requires_grad_()
    ref = torch.zeros_like(x)
    slopes = {
        "k1": torch.ones_like(x),
        "k2": x,
        "k3": 1 - torch.exp(-x),
    }
    for estimator, slope in slopes.items():
        (grad,) = torch.autograd.grad(kl_penalty(log_probs, ref, estimator).sum(), log_probs)
        torch.testing.assert_close(grad, slope, **EXACT)
        kl = kl_penalty(log_probs, ref, estimator)
        corrected = bias_corrected_kl(kl, log_probs, log_probs.detach())
        torch.testing.assert_close(corrected, kl, **EXACT)  # rho = 1 in value
        (grad,) = torch.autograd.grad(corrected.sum(), log_probs)
        torch.testing.assert_close(grad, kl.detach() + slope, **EXACT)
    (grad,) = torch.autograd.grad(
        bias_corrected_kl(kl_penalty(log_probs, ref), log_probs, log_probs.detach()).sum(),
        log_probs,
    )
    torch.testing.assert_close(grad, x, **EXACT)


@pytest.mark.parametrize(
    "mode", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "abs+", "k3+", "k2+"]
)
def test_verl_kl_penalty_modes_equal_verls(verl, mode):
    log_probs, old, *_ = make_batch(15, shift=1.5)
    ref = old + 2.5  # pi far below pi_ref: low_var_kl's clamp at 10 acts on some tokens
    assert (kl_penalty(log_probs, ref, "k3") > 10).any()
    assert_same(
        lambda lp: verl_kl_penalty(lp, ref, mode).sum(),
        lambda lp: verl.kl_penalty(lp, ref, mode).sum(),
        log_probs,
    )
    if mode.endswith("+"):  # the straight-through gradient is k2's
        _, grad = value_and_grad(lambda lp: verl_kl_penalty(lp, ref, mode).sum(), log_probs)
        torch.testing.assert_close(grad, log_probs.detach() - ref, **EXACT)


def test_verl_full_kl_is_not_implemented(verl):
    """verl 0.9.1 names a "full" KL (over the vocabulary) but raises on it; so does ours."""
    log_probs, old, *_ = make_batch()
    for function in (verl_kl_penalty, verl.kl_penalty):
        with pytest.raises(NotImplementedError):
            function(log_probs, old, "full")


def test_adaptive_kl_coefficient_equals_verls_controller(verl):
    controller = verl.AdaptiveKLController(init_kl_coef=0.05, target_kl=0.1, horizon=10_000)
    coefficient = 0.05
    for kl in (0.02, 0.3, 0.11, 0.1, 0.0):
        controller.update(kl, n_steps=256)
        coefficient = adaptive_kl_coef(coefficient, kl, target_kl=0.1, horizon=10_000, n_steps=256)
        assert coefficient == pytest.approx(controller.value, rel=1e-15)
    # KL 0.02 is 80% under the target: the error is clipped at -0.2, so beta x (1 - 0.2 * 0.0256).
    assert adaptive_kl_coef(1.0, 0.02, target_kl=0.1, horizon=10_000, n_steps=256) == (
        pytest.approx(1 - 0.2 * 256 / 10_000)
    )


# --- advantages -----------------------------------------------------------------------------


def test_gdpo_hand_computed_gives_each_reward_its_own_scale():
    """One group of three, two rewards: r1 = (1, 0, 0) and a 10-times larger r2 = (0, 0, 10).
    Summing first follows r2 alone; normalising each first gives A = (1, -2, 1) / sqrt(3)."""
    rewards = torch.tensor([[[1.0, 0.0], [0.0, 0.0], [0.0, 10.0]]], dtype=F64)
    ours = gdpo_advantages(rewards, eps=0.0)
    torch.testing.assert_close(ours, torch.tensor([[1.0, -2.0, 1.0]], dtype=F64) / math.sqrt(3))
    summed = group_advantages(rewards.sum(-1), "grpo", eps=0.0)
    assert summed[0, 0] < 0 < ours[0, 0]  # right on r1, yet pushed down when rewards are summed
    weighted = gdpo_advantages(rewards, torch.tensor([1.0, 0.0], dtype=F64), eps=0.0)
    torch.testing.assert_close(weighted, group_advantages(rewards[..., 0], "grpo", eps=0.0))


def test_gdpo_equals_verls_up_to_its_token_whitening(verl):
    """verl's gdpo (reward keys read from its batch, as its trainer passes them) is the book's
    GDPO with eps 1e-6, whitened over the tokens: the Bessel factor of REINFORCE++'s test."""
    generator = torch.Generator().manual_seed(17)
    rewards = torch.rand(3, 4, 2, generator=generator)
    n, width, prompt = 12, 3, 2
    theirs, _ = verl.compute_gdpo_outcome_advantage(
        token_level_rewards=torch.zeros(n, width),
        response_mask=torch.ones(n, width),
        index=np.repeat(np.arange(3), 4),
        config=verl.AlgoConfig(
            gdpo_reward_keys=["accuracy", "format"], gdpo_reward_weights=[1.0, 0.5]
        ),
        non_tensor_batch={
            "accuracy": rewards[..., 0].flatten().numpy(),
            "format": rewards[..., 1].flatten().numpy(),
        },
        batch={
            "prompts": torch.zeros(n, prompt),
            "attention_mask": torch.ones(n, prompt + width, dtype=torch.long),
        },
    )
    ours = gdpo_advantages(rewards, torch.tensor([1.0, 0.5]), eps=1e-6)
    factor = math.sqrt((n / (n - 1)) / (n * width / (n * width - 1)))
    torch.testing.assert_close(theirs[:, 0].view(3, 4), ours * factor, rtol=1e-5, atol=1e-5)
