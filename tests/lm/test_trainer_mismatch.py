"""The trainer's correction for a sampler that is not the policy, held to TRL 1.16.0's own.

TRL applies ``vllm_importance_sampling_correction`` only when it generates with vLLM, which does
not install here. Both trainers therefore learn from the fixed batch of
tests/lm/test_trl_equivalence.py (its helpers are imported), with sampling log-probs given to both:
TRL receives them from its (experimental, public) ``rollout_func`` as "logprobs", exactly as
from vLLM, and runs its own code: after construction ``trainer.use_vllm`` is set to True and a
stand-in ``vllm_generation`` whose ``sync_weights`` does nothing is attached (with
``_last_loaded_step``, the one private attribute, which TRL reads before syncing); nothing else
of TRL is patched. Ours computes them with `trainer.sampling_log_probs`, patched here to the same
function. That function is the model's own tempered log-probs plus a fixed perturbation of
+-0.6 nats per token, a function of the token id alone, so that the ratios fall on both sides of
1 and of the bounds.

Compared per case: the weights (TRL's ``inputs["importance_sampling_ratio"]`` against
`core.importance.vllm_importance_weights` on TRL's own ``old_per_token_logps`` and
``sampling_per_token_logps``), the loss and every parameter's gradient at every optimizer step,
all within ATOL = 1e-6 (float32, as tests/lm/test_trl_equivalence.py).
"""

import copy

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import test_trl_equivalence as equivalence  # noqa: E402
from test_trl_equivalence import (  # noqa: E402
    ATOL,
    B,
    Case,
    Recorder,
    make_batch,
    make_perturbation,
    memoised_results,
    our_config,
    train_trl_case,
)
from trl import GRPOConfig as TRLConfig  # noqa: E402

from grpo_companion.core.importance import vllm_importance_weights  # noqa: E402
from grpo_companion.lm import trainer as our_trainer  # noqa: E402
from grpo_companion.lm.config import GRPOConfig  # noqa: E402

pytestmark = equivalence.pytestmark
AMPLITUDE = 0.6  # nats: the sampler's log-prob differs from the policy's by up to this much


def perturbed_sampling_log_probs(model, input_ids, attention_mask, completion_mask, *args, **kw):
    """The sampler's log-probs of the test: the trainer's own `sampling_log_probs` plus
    AMPLITUDE * sin(token id) on each completion token."""
    values = REAL_SAMPLING_LOG_PROBS(model, input_ids, attention_mask, completion_mask, *args, **kw)
    tokens = input_ids[:, -completion_mask.shape[1] :].to(values.dtype)
    return values + AMPLITUDE * torch.sin(tokens) * completion_mask


REAL_SAMPLING_LOG_PROBS = our_trainer.sampling_log_probs


def correction_options(mode: str, clip_max, clip_min) -> tuple:
    return (
        ("vllm_importance_sampling_correction", True),
        ("vllm_importance_sampling_mode", mode),
        ("vllm_importance_sampling_clip_max", clip_max),
        ("vllm_importance_sampling_clip_min", clip_min),
    )


CASES = [
    Case(options=correction_options("token_truncate", 1.5, None)),
    Case(loss_type="dapo", options=correction_options("token_mask", 1.5, 0.7)),  # IcePop
    Case(options=correction_options("sequence_truncate", 3.0, None)),
    Case(loss_type="dapo", options=correction_options("sequence_mask", 3.0, None)),  # TRL's default
    Case(num_iterations=2, options=correction_options("sequence_mask", 3.0, 0.5)),
    Case(
        loss_type="cispo", num_iterations=2, options=correction_options("token_truncate", 1.2, 0.8)
    ),
    Case(
        loss_type="dapo",
        num_iterations=2,
        grad_accum=2,
        beta=0.04,
        options=correction_options("sequence_truncate", 2.0, None),
    ),
]


def run_trl(case: Case, model, tokenizer, batch, output_dir):
    rows = batch.rollouts(batch.prompts, model.device)
    sampled = perturbed_sampling_log_probs(
        model, rows.input_ids, rows.attention_mask, rows.completion_mask
    )
    trainer, optimizer = train_trl_case(case, model, tokenizer, batch, output_dir, sampled)
    steps = [
        trainer.recorded[i : i + case.grad_accum]
        for i in range(0, len(trainer.recorded), case.grad_accum)
    ]
    return {
        "inputs": [inputs for inputs, _ in steps[0]],
        "losses": [sum(loss.item() for _, loss in step) for step in steps],
        "grads": optimizer.grads,
    }


def run_ours(case: Case, model, tokenizer, batch, sampling=perturbed_sampling_log_probs):
    config = our_config(case)
    reference = copy.deepcopy(model).eval().requires_grad_(False) if case.beta > 0 else None
    optimizer = Recorder(model, make_perturbation(model))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            our_trainer, "generate_rollouts", lambda model, tokenizer, prompts, golds, **_: (
                batch.rollouts(prompts, model.device)
            ),
        )  # fmt: skip
        patch.setattr(our_trainer, "batch_indices", lambda step, n, per_step, seed: list(range(B)))
        patch.setattr(our_trainer, "sampling_log_probs", sampling)
        record = our_trainer.grpo_step(
            model, tokenizer, reference, optimizer, batch.prompts, [str(b) for b in range(B)],
            config, 1, None,
        )  # fmt: skip
    return {"loss": record["loss"], "grads": optimizer.grads}


@pytest.fixture(scope="module")
def results(random_tiny, tmp_path_factory):
    return memoised_results(run_trl, run_ours, random_tiny, tmp_path_factory)


def parametrize():
    return pytest.mark.parametrize("case", [pytest.param(case, id=case.id) for case in CASES])


@parametrize()
def test_weights_are_trls(case, results):
    theirs, _ = results(case)
    options = dict(case.options)
    changed = []
    for inputs in theirs["inputs"]:
        mask = inputs["completion_mask"]
        ours = vllm_importance_weights(
            inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"],
            mask,
            options["vllm_importance_sampling_mode"],
            options["vllm_importance_sampling_clip_max"],
            options["vllm_importance_sampling_clip_min"],
        )
        assert (ours - inputs["importance_sampling_ratio"]).abs().max().item() <= ATOL
        raw = torch.exp((inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]) * mask)
        if ours.shape[1] == 1:
            raw = raw.prod(dim=1, keepdim=True)
        changed.append(((ours - raw).abs() > 1e-6).double().mean().item())
    assert 0 < sum(changed) / len(changed) < 1  # the bounds act on some tokens, not all


@parametrize()
def test_loss_and_gradients_are_trls(case, results):
    theirs, ours = results(case)
    assert abs(sum(theirs["losses"]) / len(theirs["losses"]) - ours["loss"]) <= ATOL
    assert len(theirs["grads"]) == len(ours["grads"]) == case.num_iterations
    for theirs_step, ours_step in zip(theirs["grads"], ours["grads"]):
        for name, gradient in theirs_step.items():
            assert (gradient - ours_step[name]).abs().max().item() <= ATOL, name


def run_ours_plain(case: Case, random_tiny, sampling=REAL_SAMPLING_LOG_PROBS):
    """`run_ours` on a fresh copy, with the sampler's log-probs from `sampling`."""
    model, tokenizer = random_tiny
    return run_ours(case, copy.deepcopy(model), tokenizer, make_batch(tokenizer), sampling)


def max_difference(a, b) -> float:
    return max((a[0][name] - b[0][name]).abs().max().item() for name in a[0])


def test_the_correction_changes_the_step(random_tiny, results):
    case = CASES[3]
    _, corrected = results(case)
    plain = run_ours_plain(Case(loss_type=case.loss_type), random_tiny)
    assert max_difference(corrected["grads"], plain["grads"]) > 1000 * ATOL


def test_a_sampler_equal_to_the_policy_changes_nothing(random_tiny):
    """top_p = 1: the sampler's log-probs are the policy's own, every weight is 1 (to float32
    rounding), and the corrected step is the plain one."""
    for mode in ("token_mask", "sequence_mask"):
        case = Case(loss_type="dapo", options=correction_options(mode, 3.0, None))
        corrected = run_ours_plain(case, random_tiny)
        plain = run_ours_plain(Case(loss_type="dapo"), random_tiny)
        assert max_difference(corrected["grads"], plain["grads"]) <= ATOL


def test_sampling_log_probs_are_the_nucleus_the_sampler_draws_from(random_tiny):
    """Rollouts sampled with top_p: every sampled token is in its nucleus (a finite log-prob),
    and the log-prob is the renormalised one: log pi - log Z, with Z <= 1."""
    from grpo_companion.lm.rollouts import generate_rollouts
    from grpo_companion.lm.scoring import sequence_log_probs

    model, tokenizer = random_tiny
    rollouts = generate_rollouts(
        model, tokenizer, ["a", "bb"], ["1", "2"], num_generations=4, max_completion_length=6,
        top_p=0.7, seed=0, compute_log_probs=False, reward_fn=lambda text, gold: 0.0,
    )  # fmt: skip
    args = (model, rollouts.input_ids, rollouts.attention_mask, rollouts.completion_mask)
    sampled = our_trainer.sampling_log_probs(*args, 1.0, 0.7)
    full = sequence_log_probs(*args)
    mask = rollouts.completion_mask.bool()
    assert torch.isfinite(sampled[mask]).all()
    shift = sampled[mask] - full[mask]  # -log Z at each token: 0 < Z <= 1
    assert (shift >= -1e-6).all() and (shift > 1e-3).any()
    assert torch.exp(-shift).min() >= 0.7 - 1e-6  # Z >= top_p


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"top_p": 0.0}, "top_p"),
        ({"vllm_importance_sampling_mode": "sequence_clip"}, "vllm_importance_sampling_mode"),
        ({"vllm_importance_sampling_clip_min": 3.0}, "must be less than"),
        (
            {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode":
             "token_truncate", "vllm_importance_sampling_clip_max": None},
            "clip_min or clip_max",
        ),
        ({"vllm_importance_sampling_correction": True, "loss_type": "vespo"}, "vespo"),
        (
            {"vllm_importance_sampling_correction": True, "importance_sampling_level": "sequence",
             "vllm_importance_sampling_mode": "token_mask"},
            "sequence mode",
        ),
    ],
)  # fmt: skip
def test_config_checks(settings, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**settings)


def test_off_by_default():
    config = GRPOConfig()
    assert config.vllm_importance_sampling_correction is False and config.top_p == 1.0
    # TRL's defaults for the rest, so that switching it on means what it means in TRL
    trls = TRLConfig(output_dir="unused", use_cpu=True, report_to=[])
    for name in ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
                 "vllm_importance_sampling_clip_min", "top_p"):  # fmt: skip
        assert getattr(config, name) == getattr(trls, name), name
