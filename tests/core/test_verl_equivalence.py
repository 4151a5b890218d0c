"""The book's verl-named advantages, KL estimators, loss aggregations and policy losses held to
verl's own functions (``verl.trainer.ppo.core_algos`` of verl 0.9.1, pinned:
`test_verl_is_the_pinned_version`).

verl is imported through `verl_stubs`, which stands in for the ray, tensordict, codetiming and
orjson that verl's package ``__init__`` imports and these functions never call.

One batch per seed: B = 4 prompts with G = 4 completions each, of unequal lengths (`LENGTHS`, rows
of response_mask with 1 to T = 8 tokens; three groups have one longest completion, one group two),
rewards mixed binary, continuous, all equal (std 0) and continuous with a tie at the top, random
log-probs and per-token advantages. verl gets its own inputs: token_level_rewards (B G, T) with
each completion's reward on its last token, response_mask, the group ids as a numpy object array,
and its `AlgoConfig` / `ActorConfig`; ours get the rewards (B, G), the lengths or the same
(B G, T) tensors. Losses are compared in value and in their gradient with respect to log pi.

Tolerance: float64 throughout and max |verl - ours| <= ATOL = 1e-6 (every value is O(1); verl
adds 1e-8 to the token counts it divides by). verl's ``grpo_vectorized`` computes in float32:
ATOL_FLOAT32 = 1e-5.

Where the book differs from verl on purpose, the test computes the difference and holds it to its
closed form: the population std (``unbiased_std=False``), REINFORCE++-baseline's whitening per
completion rather than per token, REINFORCE++'s return at masked tokens inside a completion, the
optimal token baseline without ``handle_zero_tail``, empty rows in B, k3 without verl's clamp, the
clipped surrogate without dual clip (``delta=None``, TRL's default) and CISPO without a lower clip.
"""

import importlib.metadata

import numpy as np
import pytest
import torch
from verl_stubs import import_core_algos

from grpo_companion.core import kl, losses
from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.verl_estimators import (
    opo_advantages,
    optimal_token_baseline_advantages,
    reinforce_plus_plus_advantages,
    remax_advantages,
)

core_algos = import_core_algos()

VERL_VERSION = "0.9.1"
ATOL = 1e-6  # float64; see the module docstring
ATOL_FLOAT32 = 1e-5  # grpo_vectorized
F64 = torch.float64
SEEDS = (0, 1, 2)

# Completion lengths per group (B = 4 rows of G = 4); T is the response width.
LENGTHS = ((8, 3, 5, 1), (2, 8, 6, 4), (7, 4, 8, 2), (5, 6, 3, 6))
B, G = len(LENGTHS), len(LENGTHS[0])
T = 8
VERL_EPS = 1e-6  # the epsilon verl's grpo and grpo_passk add to the std
GAMMA = 0.9  # REINFORCE++'s discount in these tests


def _mask(lengths) -> torch.Tensor:
    """(rows, T) float64, 1 on the first L_i tokens of row i."""
    return (torch.arange(T) < torch.tensor(lengths).reshape(-1, 1)).to(F64)


class Batch:
    """verl's tensors (B G, T) and ours for one seed."""

    def __init__(self, seed: int):
        generator = torch.Generator().manual_seed(seed)

        def uniform(*shape):
            return torch.rand(*shape, dtype=F64, generator=generator)

        binary = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64)[
            torch.randperm(G, generator=generator)
        ]
        tied = uniform(G)
        tied[0] = tied[3] = tied.max()
        self.rewards = torch.stack([binary, uniform(G), torch.ones(G, dtype=F64), tied])  # (B, G)
        self.lengths = torch.tensor(LENGTHS, dtype=F64)
        self.mask = _mask(LENGTHS)  # (B G, T)
        last = torch.tensor(LENGTHS).reshape(-1, 1) - 1
        self.token_rewards = torch.zeros(B * G, T, dtype=F64).scatter(
            1, last, self.rewards.reshape(-1, 1)
        )
        self.dense_rewards = torch.randn(B * G, T, dtype=F64, generator=generator) * self.mask
        self.index = np.array([f"prompt-{q}" for q in range(B) for _ in range(G)], dtype=object)
        self.greedy_rewards = uniform(B)
        self.old_log_probs = torch.log(0.05 + 0.95 * uniform(B * G, T))
        self.log_probs = self.old_log_probs + 0.6 * torch.randn(
            B * G, T, dtype=F64, generator=generator
        )
        self.ref_log_probs = self.old_log_probs + torch.randn(
            B * G, T, dtype=F64, generator=generator
        )
        self.ref_log_probs[0, :3] = torch.tensor([-30.0, 30.0, -15.0])  # beyond verl's k3 clamp
        pi = self.old_log_probs.exp()
        self.sum_pi_squared = pi**2 + (1 - pi) ** 2 * uniform(B * G, T)  # in [pi^2, 1]
        self.advantages = torch.randn(B * G, T, dtype=F64, generator=generator)
        # two tokens of row 1 (L = 3) at rho = e^1.5 = 4.5 with A < 0: verl's dual clip
        self.log_probs[1, :2] = self.old_log_probs[1, :2] + 1.5
        self.advantages[1, :2] = -self.advantages[1, :2].abs()
        self.sequence_advantages = torch.randn(B * G, dtype=F64, generator=generator)

    def tokens(self, per_completion: torch.Tensor) -> torch.Tensor:
        """(B, G) -> (B G, T): each completion's value on its tokens, 0 on padding."""
        return per_completion.reshape(-1, 1) * self.mask


BATCHES = {seed: Batch(seed) for seed in SEEDS}


def _grouped(x: torch.Tensor) -> torch.Tensor:
    """(B G, T) -> (B, G, T)."""
    return x.reshape(B, G, -1)


# --- advantage estimators: name -> (verl's, ours), each (B G, T) ----------------------------


def _grpo(batch, norm: bool, vectorized: bool = False):
    verl = core_algos.get_adv_estimator_fn("grpo_vectorized" if vectorized else "grpo")
    theirs, _ = verl(
        batch.token_rewards, batch.mask, batch.index, epsilon=VERL_EPS, norm_adv_by_std_in_grpo=norm
    )
    ours = group_advantages(batch.rewards, "grpo" if norm else "dr_grpo", eps=VERL_EPS)
    return theirs, batch.tokens(ours)


def _rloo(batch, vectorized: bool = False):
    verl = core_algos.get_adv_estimator_fn("rloo_vectorized" if vectorized else "rloo")
    theirs, _ = verl(batch.token_rewards, batch.mask, batch.index)
    return theirs, batch.tokens(group_advantages(batch.rewards, "rloo"))


def _grpo_passk(batch, norm: bool):
    theirs, _ = core_algos.compute_grpo_passk_outcome_advantage(
        batch.token_rewards, batch.mask, batch.index, epsilon=VERL_EPS,
        config=core_algos.AlgoConfig(norm_adv_by_std_in_grpo=norm),
    )  # fmt: skip
    scale_rewards = "group" if norm else "none"
    ours = group_advantages(batch.rewards, "grpo_passk", scale_rewards=scale_rewards, eps=VERL_EPS)
    return theirs, batch.tokens(ours)


def _reinforce_plus_plus(batch):
    """Advantages and returns side by side, from dense token rewards."""
    theirs = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        batch.dense_rewards, batch.mask, config=core_algos.AlgoConfig(gamma=GAMMA)
    )
    ours = reinforce_plus_plus_advantages(batch.dense_rewards, batch.mask, gamma=GAMMA)
    return torch.cat(theirs, dim=1), torch.cat(ours, dim=1)


def _remax(batch):
    theirs, _ = core_algos.compute_remax_outcome_advantage(
        batch.token_rewards, batch.greedy_rewards.repeat_interleave(G), batch.mask
    )
    return theirs, batch.tokens(remax_advantages(batch.rewards, batch.greedy_rewards))


def _opo(batch):
    theirs, _ = core_algos.compute_opo_outcome_advantage(
        batch.token_rewards, batch.mask, batch.index
    )
    return theirs, batch.tokens(opo_advantages(batch.rewards, batch.lengths))


def _gpg(batch):
    theirs, _ = core_algos.compute_gpg_outcome_advantage(
        batch.token_rewards, batch.mask, batch.index
    )
    return theirs, batch.tokens(group_advantages(batch.rewards, "gpg"))


def _optimal_token_baseline(batch, handle_zero_tail: bool = False):
    """Advantages and returns side by side, from dense token rewards."""
    theirs = core_algos.compute_optimal_token_baseline_advantage(
        batch.dense_rewards, batch.mask, batch.index, batch.old_log_probs, batch.sum_pi_squared,
        handle_zero_tail=handle_zero_tail,
    )  # fmt: skip
    ours = optimal_token_baseline_advantages(
        *map(_grouped, (batch.dense_rewards, batch.mask, batch.old_log_probs.exp())),
        _grouped(batch.sum_pi_squared),
    )
    return torch.cat(theirs, dim=1), torch.cat([x.reshape(B * G, T) for x in ours], dim=1)


def _kl_in_reward(batch, beta: float = 0.05):
    """verl's ``compute_rewards`` (token scores - beta k1, unmasked), summed over the tokens."""
    theirs = core_algos.compute_rewards(
        batch.token_rewards, batch.old_log_probs, batch.ref_log_probs, beta
    )
    k1 = ((batch.old_log_probs - batch.ref_log_probs) * batch.mask).sum(1).reshape(B, G)
    return (theirs * batch.mask).sum(1, keepdim=True), kl.kl_in_reward(
        batch.rewards, k1, beta
    ).reshape(-1, 1)


ADVANTAGE_CASES = {
    "grpo": (lambda batch: _grpo(batch, norm=True), ATOL),
    "grpo, norm_adv_by_std_in_grpo=False": (lambda batch: _grpo(batch, norm=False), ATOL),
    "grpo_vectorized": (lambda batch: _grpo(batch, True, vectorized=True), ATOL_FLOAT32),
    "grpo_vectorized, norm_adv_by_std_in_grpo=False": (
        lambda batch: _grpo(batch, False, vectorized=True),
        ATOL_FLOAT32,
    ),
    "rloo": (_rloo, ATOL),
    "rloo_vectorized": (lambda batch: _rloo(batch, vectorized=True), ATOL),
    "grpo_passk": (lambda batch: _grpo_passk(batch, norm=True), ATOL),
    "grpo_passk, norm_adv_by_std_in_grpo=False": (
        lambda batch: _grpo_passk(batch, norm=False),
        ATOL,
    ),
    "reinforce_plus_plus (advantages, returns)": (_reinforce_plus_plus, ATOL),
    "remax": (_remax, ATOL),
    "opo": (_opo, ATOL),
    "gpg": (_gpg, ATOL),
    "optimal_token_baseline, handle_zero_tail=False (advantages, returns)": (
        _optimal_token_baseline,
        ATOL,
    ),
    "compute_rewards (use_kl_in_reward)": (_kl_in_reward, ATOL),
}


# --- loss aggregation: verl's loss_agg_mode -> our loss_type -------------------------------

AGG_MODES = {
    "token-mean": "dapo",  # and "bnpo" on one batch (losses.py)
    "seq-mean-token-mean": "grpo",
    "seq-mean-token-sum": "luspo",
    "seq-mean-token-sum-norm": "dr_grpo",  # max_completion_length = the response width T
}


def _agg(batch, mode: str):
    return (
        core_algos.agg_loss(batch.advantages, batch.mask, mode),
        losses.aggregate(batch.advantages, batch.mask, AGG_MODES[mode]),
    )


def _agg_loss_scale_factor(batch, factor: int = 12):
    theirs = core_algos.agg_loss(
        batch.advantages, batch.mask, "seq-mean-token-sum-norm", loss_scale_factor=factor
    )
    return theirs, losses.aggregate(
        batch.advantages, batch.mask, "dr_grpo", max_completion_length=factor
    )


AGG_CASES = {mode: (lambda batch, mode=mode: _agg(batch, mode)) for mode in AGG_MODES} | {
    "seq-mean-token-sum-norm, loss_scale_factor=12": _agg_loss_scale_factor,
}


# --- KL penalties: verl's kl_penalty -> our estimator ---------------------------------------

KL_MODES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
# "+": verl's straight-through variants, the value of the estimator with the gradient of k2
STRAIGHT_THROUGH = {"kl+": "k1", "k1+": "k1", "low_var_kl+": "k3", "k3+": "k3", "k2+": "k2"}


def _value_and_gradient(function, log_probs: torch.Tensor) -> torch.Tensor:
    """The (B G, T) value of ``function(log_probs)`` and its gradient, side by side."""
    log_probs = log_probs.detach().requires_grad_()
    value = function(log_probs)
    (gradient,) = torch.autograd.grad(value.sum(), log_probs)
    return torch.cat([value.detach().reshape(B * G, -1), gradient], dim=1)


def _kl(batch, mode: str):
    estimator = KL_MODES.get(mode) or STRAIGHT_THROUGH[mode]
    theirs = _value_and_gradient(
        lambda lp: core_algos.kl_penalty(lp, batch.ref_log_probs, mode), batch.log_probs
    )

    def ours(lp, estimator):
        return kl.kl_penalty(lp, batch.ref_log_probs, estimator, clamp=estimator == "k3")

    value = _value_and_gradient(lambda lp: ours(lp, estimator), batch.log_probs)
    if mode in STRAIGHT_THROUGH:
        gradient = _value_and_gradient(lambda lp: ours(lp, "k2"), batch.log_probs)
        value[:, T:] = gradient[:, T:]
    return theirs, value


KL_CASES = {
    mode: (lambda batch, mode=mode: _kl(batch, mode)) for mode in KL_MODES | STRAIGHT_THROUGH
}


# --- policy losses: verl's loss (value and gradient) -> ours, for each aggregation ----------

EPSILON, EPSILON_HIGH, CLIP_RATIO_C = 0.2, 0.28, 3.0


def _actor_config(**options):
    """verl's ActorConfig with what its __post_init__ requires besides ``options``."""
    return core_algos.ActorConfig(
        strategy="fsdp", rollout_n=G, ppo_micro_batch_size_per_gpu=1, **options
    )


def _loss_and_gradient(loss_function, log_probs: torch.Tensor) -> torch.Tensor:
    """(1 + B G T,): the scalar loss, then its gradient with respect to log pi."""
    log_probs = log_probs.detach().requires_grad_()
    loss = loss_function(log_probs)
    (gradient,) = torch.autograd.grad(loss, log_probs)
    return torch.cat([loss.detach().reshape(1), gradient.flatten()])


def _policy_case(batch, verl_name, config, mode, loss_type, advantages, **ours_options):
    verl = core_algos.get_policy_loss_fn(verl_name)
    verl_advantages = advantages if advantages.dim() == 2 else advantages[:, None] * batch.mask
    theirs = _loss_and_gradient(
        lambda lp: verl(batch.old_log_probs, lp, verl_advantages, batch.mask, mode, config)[0],
        batch.log_probs,
    )

    def ours(lp):
        per_token = losses.policy_loss(
            lp, batch.old_log_probs, advantages, batch.mask, loss_type, **ours_options
        )
        return losses.aggregate(per_token, batch.mask, AGG_MODES[mode] if mode else loss_type)

    return theirs, _loss_and_gradient(ours, batch.log_probs)


def _vanilla(batch, mode):
    config = _actor_config(
        clip_ratio_low=EPSILON, clip_ratio_high=EPSILON_HIGH, clip_ratio_c=CLIP_RATIO_C
    )
    return _policy_case(
        batch, "vanilla", config, mode, "grpo", batch.advantages,
        epsilon=EPSILON, epsilon_high=EPSILON_HIGH, delta=CLIP_RATIO_C,
    )  # fmt: skip


def _gspo(batch, mode):
    config = _actor_config(clip_ratio_low=EPSILON, clip_ratio_high=EPSILON_HIGH)
    return _policy_case(
        batch, "gspo", config, mode, "grpo", batch.sequence_advantages,
        epsilon=EPSILON, epsilon_high=EPSILON_HIGH, importance_sampling_level="sequence",
    )  # fmt: skip


def _cispo(batch, mode):
    """verl's weight clip(rho, 1 - clip_ratio_low, 1 + clip_ratio_high) is ours,
    min(rho, epsilon_high), at clip_ratio_low = 1 and epsilon_high = 1 + clip_ratio_high."""
    config = _actor_config(clip_ratio_low=1.0, clip_ratio_high=EPSILON_HIGH)
    return _policy_case(
        batch, "cispo", config, mode, "cispo", batch.advantages, epsilon_high=1 + EPSILON_HIGH
    )


def _sapo(batch, tau_pos: float = 2.0, tau_neg: float = 3.0):
    """verl's SAPO always aggregates by "seq-mean-token-mean", as our "sapo" does."""
    config = _actor_config(tau_pos=tau_pos, tau_neg=tau_neg)
    return _policy_case(
        batch, "sapo", config, None, "sapo", batch.advantages,
        sapo_temperature_pos=tau_pos, sapo_temperature_neg=tau_neg,
    )  # fmt: skip


POLICY_CASES = {
    f"{name}, {mode}": (lambda batch, case=case, mode=mode: case(batch, mode))
    for name, case in (("vanilla", _vanilla), ("gspo", _gspo), ("cispo", _cispo))
    for mode in AGG_MODES
} | {"sapo": _sapo}


# verl's registered names whose book counterpart differs on purpose: held to the closed form
CLOSED_FORM_ONLY = {"reinforce_plus_plus_baseline"}
# verl's registered names held against verl's own function in tests/core/test_variants.py
ADVANTAGES_IN_TEST_VARIANTS = {"gdpo"}
POLICY_LOSSES_IN_TEST_VARIANTS = {
    "clip_cov",
    "dppo_kl",
    "dppo_tv",
    "dro",
    "geo_mean",
    "gpg",
    "kl_cov",
}
# verl's registered names that the book has no counterpart of
ADVANTAGES_WITHOUT_COUNTERPART = {"gae", "tir_optimal_token_baseline"}
POLICY_LOSSES_WITHOUT_COUNTERPART = {"bypass_mode"}


# --- the tests ------------------------------------------------------------------------------


def _gap(theirs: torch.Tensor, ours: torch.Tensor) -> float:
    assert theirs.shape == ours.shape
    return (theirs.to(F64) - ours).abs().max().item()


def test_verl_is_the_pinned_version():
    """The conventions below were checked against this verl; re-check them on any other."""
    assert importlib.metadata.version("verl") == VERL_VERSION


def _verl_names(cases) -> set[str]:
    """The verl name that starts each case's name."""
    return {name.split(",")[0].split(" ")[0] for name in cases}


def test_the_cases_cover_what_verl_registers_and_the_book_implements():
    """A verl estimator or policy loss added or renamed shows up here."""
    assert set(core_algos.ADV_ESTIMATOR_REGISTRY) == (
        _verl_names(ADVANTAGE_CASES) - {"compute_rewards"}
        | CLOSED_FORM_ONLY
        | ADVANTAGES_IN_TEST_VARIANTS
        | ADVANTAGES_WITHOUT_COUNTERPART
    )
    assert set(core_algos.POLICY_LOSS_REGISTRY) == (
        _verl_names(POLICY_CASES)
        | POLICY_LOSSES_IN_TEST_VARIANTS
        | POLICY_LOSSES_WITHOUT_COUNTERPART
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ADVANTAGE_CASES)
def test_advantages_equal_verl(name, seed):
    case, atol = ADVANTAGE_CASES[name]
    assert _gap(*case(BATCHES[seed])) <= atol


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", AGG_CASES)
def test_aggregate_equals_verl_agg_loss(mode, seed):
    assert _gap(*AGG_CASES[mode](BATCHES[seed])) <= ATOL


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", KL_CASES)
def test_kl_penalty_equals_verl(mode, seed):
    """Value and gradient; verl's "+" modes are the estimator's value with k2's gradient."""
    assert _gap(*KL_CASES[mode](BATCHES[seed])) <= ATOL


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", POLICY_CASES)
def test_policy_loss_equals_verl(name, seed):
    """Loss and its gradient with respect to log pi."""
    assert _gap(*POLICY_CASES[name](BATCHES[seed])) <= ATOL


def test_the_batches_reach_every_branch():
    """Clipped tokens on both sides, dual-clipped ones, k3 beyond verl's clamp, a group whose
    longest completion is unique, a group with zero std and a tie at the top."""
    batch = BATCHES[0]
    ratio = (batch.log_probs - batch.old_log_probs).exp()[batch.mask.bool()]
    advantages = batch.advantages[batch.mask.bool()]
    assert ((ratio > 1 + EPSILON_HIGH) & (advantages > 0)).any()
    assert ((ratio < 1 - EPSILON) & (advantages < 0)).any()
    assert ((ratio > CLIP_RATIO_C) & (advantages < 0)).any()
    k3 = kl.kl_penalty(batch.log_probs, batch.ref_log_probs)
    assert (k3 > 10).any()
    assert batch.rewards.std(dim=1).min() == 0
    top_two = batch.rewards.topk(2, dim=1).values
    assert (top_two[:, 0] == top_two[:, 1]).any() and (top_two[:, 0] > top_two[:, 1]).any()
    assert torch.count_nonzero(batch.rewards) < B * G  # gpg's alpha is not 1


# --- where the book differs from verl on purpose: the difference in closed form -------------


@pytest.mark.parametrize("seed", SEEDS)
def test_population_std_differs_from_verl_by_the_bessel_factor(seed):
    """unbiased_std=False: std_pop = std sqrt((G - 1) / G), so ours - verl's is
    c (1 / (std_pop + eps) - 1 / (std + eps)) with c = r - mean(r)."""
    batch = BATCHES[seed]
    theirs, _ = _grpo(batch, norm=True)
    ours = group_advantages(batch.rewards, "grpo", eps=VERL_EPS, unbiased_std=False)
    centered = group_advantages(batch.rewards, "dr_grpo")
    std = batch.rewards.std(dim=1, keepdim=True)
    expected = centered * (1 / (std * ((G - 1) / G) ** 0.5 + VERL_EPS) - 1 / (std + VERL_EPS))
    difference = batch.tokens(ours) - theirs
    assert _gap(difference, batch.tokens(expected)) <= ATOL
    assert difference.abs().max() > 0.1


def _reinforce_plus_plus_baseline(batch, mask):
    """verl's advantages (B G, T) with the rewards on each row's last token of ``mask``, and ours
    (B, G)."""
    lengths = mask.sum(1, keepdim=True).long()
    token_rewards = torch.zeros_like(mask).scatter(1, lengths - 1, batch.rewards.reshape(-1, 1))
    theirs, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        token_rewards, mask, batch.index, config=core_algos.AlgoConfig()
    )
    return theirs, group_advantages(batch.rewards, "reinforce_plus_plus_baseline")


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_baseline_whitens_tokens_in_verl(seed):
    """verl whitens the centred rewards c_i over the batch's tokens, so completion i weighs L_i:
    mean m = sum L_i c_i / sum L_i, variance sum L_i (c_i - m)^2 / (sum L_i - 1); ours whitens
    over the completions, each once."""
    batch = BATCHES[seed]
    theirs, ours = _reinforce_plus_plus_baseline(batch, batch.mask)
    centered, lengths = group_advantages(batch.rewards, "dr_grpo"), batch.lengths
    mean = (lengths * centered).sum() / lengths.sum()
    variance = (lengths * (centered - mean) ** 2).sum() / (lengths.sum() - 1)
    expected = (centered - mean) / (variance + 1e-8).sqrt()
    difference = theirs - batch.tokens(ours)
    assert _gap(difference, batch.tokens(expected - ours)) <= ATOL
    assert difference.abs().max() > 0.01


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_baseline_at_equal_lengths_differs_by_bessels_count(seed):
    """All N = B G completions of length L: the same mean, but verl's Bessel correction counts
    N L tokens, ours N completions, so verl's = ours sqrt((N L - 1) / (L (N - 1)))."""
    batch = BATCHES[seed]
    mask = torch.ones_like(batch.mask)
    theirs, ours = _reinforce_plus_plus_baseline(batch, mask)
    N = B * G
    expected = ours * ((N * T - 1) / (T * (N - 1))) ** 0.5
    assert _gap(theirs, expected.reshape(-1, 1) * mask) <= ATOL
    assert _gap(theirs, ours.reshape(-1, 1) * mask) > 0.01


def test_reinforce_plus_plus_return_skips_masked_tokens_in_verl():
    """A mask with 0s inside a completion (a multi-turn rollout's tool output): verl carries the
    return across them undiscounted, as if they were absent; ours stops it there."""
    batch = BATCHES[0]
    gapped = batch.mask.clone()
    gapped[[0, 5, 9], 2:4] = 0.0  # rows of lengths 8, 8 and 6
    rewards = batch.dense_rewards * gapped
    theirs = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        rewards, gapped, config=core_algos.AlgoConfig(gamma=GAMMA)
    )
    # ours on each row with the masked tokens removed, then put back in place
    keep = gapped.bool()
    compact_mask = _mask(keep.sum(1).tolist())
    compact = torch.zeros_like(rewards)
    compact[compact_mask.bool()] = rewards[keep]
    expected = [torch.zeros_like(rewards) for _ in range(2)]
    for placed, value in zip(
        expected, reinforce_plus_plus_advantages(compact, compact_mask, GAMMA)
    ):
        placed[keep] = value[compact_mask.bool()]
    assert _gap(torch.cat(theirs, 1), torch.cat(expected, 1)) <= ATOL
    ours = reinforce_plus_plus_advantages(rewards, gapped, GAMMA)
    assert _gap(theirs[1], ours[1]) > 0.01  # the returns before the gap


@pytest.mark.parametrize("seed", SEEDS)
def test_optimal_token_baseline_zero_tail_is_verls_default(seed):
    """handle_zero_tail=True: past the second-longest completion of a group the longest one is
    alone, and verl's baseline there is 0 (A = its return) instead of its own return (A ~ 0)."""
    batch = BATCHES[seed]
    theirs, ours = _optimal_token_baseline(batch, handle_zero_tail=True)
    their_advantages, our_advantages, our_returns = theirs[:, :T], ours[:, :T], ours[:, T:]
    tail = torch.zeros(B * G, T, dtype=torch.bool)
    for group, lengths in enumerate(LENGTHS):
        longest, second = sorted(lengths)[-1], sorted(lengths)[-2]
        if longest > second:
            tail[group * G + lengths.index(longest), second:] = True
    assert tail.sum() == 3 + 2 + 1  # groups 0, 1 and 2: 8 past 5, 8 past 6, 8 past 7
    expected = torch.where(tail, our_returns, our_advantages)
    assert _gap(their_advantages, expected) <= ATOL
    assert _gap(their_advantages, our_advantages) > 0.01


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_empty_rows_count_in_our_batch_size_not_in_verls(mode):
    """allow_empty: an empty completion (TRL's mask_truncated_completions) counts in our B, verl
    leaves it out, so ours = verl's (B - empty) / B."""
    batch = BATCHES[0]
    mask = batch.mask.clone()
    mask[[3, 6]] = 0.0
    theirs = core_algos.agg_loss(batch.advantages, mask, mode)
    ours = losses.aggregate(batch.advantages, mask, AGG_MODES[mode], allow_empty=True)
    assert abs(ours.item() - theirs.item() * (B * G - 2) / (B * G)) <= ATOL
    assert abs(ours.item() - theirs.item()) > 1e-3


def test_unclamped_k3_differs_from_verls_low_var_kl_only_beyond_its_bounds():
    """clamp=False (TRL): the log-ratio and k3 unbounded; verl clamps x to [-20, 20], then k3 to
    [-10, 10]."""
    batch = BATCHES[0]
    theirs = core_algos.kl_penalty(batch.log_probs, batch.ref_log_probs, "low_var_kl")
    ours = kl.kl_penalty(batch.log_probs, batch.ref_log_probs, "k3")
    x = (batch.log_probs - batch.ref_log_probs).clamp(-20.0, 20.0)
    expected = ours - (torch.exp(-x) - 1 + x).clamp(-10.0, 10.0)
    assert _gap(ours - theirs, expected) <= ATOL
    assert ((ours - theirs).abs() > 1.0).sum() >= 2  # the log-ratios of -30 and 30 at least


@pytest.mark.parametrize("seed", SEEDS)
def test_clipped_surrogate_without_delta_lacks_verls_dual_clip(seed):
    """delta=None (TRL's default): a token with A < 0 and rho > clip_ratio_c loses -A rho
    instead of verl's -A clip_ratio_c; token-mean."""
    batch = BATCHES[seed]
    config = _actor_config(
        clip_ratio_low=EPSILON, clip_ratio_high=EPSILON_HIGH, clip_ratio_c=CLIP_RATIO_C
    )
    theirs, _ = core_algos.compute_policy_loss_vanilla(
        batch.old_log_probs, batch.log_probs, batch.advantages, batch.mask, "token-mean", config
    )
    per_token = losses.policy_loss(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, "grpo",
        epsilon=EPSILON, epsilon_high=EPSILON_HIGH,
    )  # fmt: skip
    ours = losses.aggregate(per_token, batch.mask, "dapo")
    ratio = (batch.log_probs - batch.old_log_probs).exp()
    dual = (batch.advantages < 0) & (ratio > CLIP_RATIO_C)
    excess = (-batch.advantages * (ratio - CLIP_RATIO_C) * dual * batch.mask).sum()
    assert abs((ours - theirs).item() - (excess / batch.mask.sum()).item()) <= ATOL
    assert (ours - theirs).item() > 1e-3


@pytest.mark.parametrize("seed", SEEDS)
def test_cispo_without_verls_lower_clip(seed):
    """verl's CISPO weight is clip(rho, 1 - clip_ratio_low, 1 + clip_ratio_high); ours (TRL's) has
    no lower bound, so a token with rho < 1 - clip_ratio_low loses -(rho - (1 - clip_ratio_low))
    A log pi less than verl's; token-mean."""
    batch = BATCHES[seed]
    config = _actor_config(clip_ratio_low=EPSILON, clip_ratio_high=EPSILON_HIGH)
    theirs, _ = core_algos.compute_policy_loss_cispo(
        batch.old_log_probs, batch.log_probs, batch.advantages, batch.mask, "token-mean", config
    )
    per_token = losses.policy_loss(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, "cispo",
        epsilon_high=1 + EPSILON_HIGH,
    )  # fmt: skip
    ours = losses.aggregate(per_token, batch.mask, "cispo")
    ratio = (batch.log_probs - batch.old_log_probs).exp()
    below = (ratio < 1 - EPSILON) * batch.mask
    expected = (-(ratio - (1 - EPSILON)) * batch.advantages * batch.log_probs * below).sum()
    assert abs((ours - theirs).item() - (expected / batch.mask.sum()).item()) <= ATOL
    assert abs((ours - theirs).item()) > 1e-3
