import copy
import json
import math
from dataclasses import replace

import datasets
import pytest
import torch

from grpo_companion.core.advantages import (
    degenerate_fractions,
    group_advantages,
    process_advantages,
    shuffle_step_rewards,
)
from grpo_companion.core.losses import grpo_loss
from grpo_companion.lm import evaluation, trainer
from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.gsm8k import build_prompts, gold_answer, load_gsm8k
from grpo_companion.lm.rollouts import generate_rollouts
from grpo_companion.lm.steps import rollout_step_rewards
from grpo_companion.lm.trainer import METRICS, batch_indices, rollout_seed, train

CONFIG = GRPOConfig(
    num_generations=4,
    per_step_prompts=4,
    max_completion_length=8,
    learning_rate=1e-2,
    max_steps=3,
    eval_every=2,
    micro_batch_size=16,
    rollout_batch_size=16,
)


def has_digit(completion: str, gold: str) -> float:
    """1 for a completion with a digit in it: about half of the random model's completions."""
    return float(any(character.isdigit() for character in completion))


@pytest.fixture(scope="module")
def initial(random_tiny):
    return random_tiny


@pytest.fixture
def policy(initial):
    """A fresh copy of the initial model for each test: train() changes it in place."""
    model, tokenizer = initial
    return copy.deepcopy(model), tokenizer


@pytest.fixture(scope="module")
def data():
    return (
        load_gsm8k("train", source="arithmetic", num_examples=10, seed=0),
        load_gsm8k("test", source="arithmetic", num_examples=3, seed=0),
    )


def _train(policy, data, config=CONFIG, **kwargs):
    model, tokenizer = policy
    return train(model, tokenizer, *data, config, reward_fn=has_digit, progress=False, **kwargs)


def _step_one_rollouts(initial, data, config):
    """The rollouts of step 1, sampled again from the initial model."""
    model, tokenizer = initial
    rows = batch_indices(1, len(data[0]), config.per_step_prompts, config.seed)
    return generate_rollouts(
        model,
        tokenizer,
        *build_prompts(tokenizer, data[0].select(rows)),
        num_generations=config.num_generations,
        max_completion_length=config.max_completion_length,
        temperature=config.temperature,
        seed=rollout_seed(config.seed, 1),
        reward_fn=has_digit,
    )


def test_history_has_every_metric_finite(policy, data):
    history = _train(policy, data, replace(CONFIG, beta=0.1, num_iterations=2))
    assert [record["step"] for record in history] == [0, 1, 2, 3]
    for record in history:
        assert tuple(record) == METRICS
    assert [record["eval_accuracy"] is not None for record in history] == [True, False, True, True]
    assert all(
        value is None for name, value in history[0].items() if name not in ("step", "eval_accuracy")
    )
    for record in history[1:]:
        for name in METRICS:
            if name != "eval_accuracy":
                assert record[name] is not None and math.isfinite(record[name]), (
                    record["step"],
                    name,
                )
        clip = [record[f"clip_ratio/{part}_mean"] for part in ("region", "low", "high")]
        assert clip[0] == pytest.approx(clip[1] + clip[2]) and 0 <= clip[0] <= 1
        assert record["kl"] >= 0 and record["entropy"] > 0
        assert (
            1
            <= record["completions/min_length"]
            <= record["completions/mean_length"]
            <= record["completions/max_length"]
            <= CONFIG.max_completion_length
        )
    # TRL's num_tokens counts every prompt and completion token seen so far.
    step_tokens = [b["num_tokens"] - a["num_tokens"] for a, b in zip(history[1:], history[2:])]
    assert history[1]["num_tokens"] > 0 and min(step_tokens) > 0
    json.dumps(history)  # JSON-ready as it is


def test_records_agree_with_the_rollouts(initial, policy, data):
    record = _train(policy, data, replace(CONFIG, max_steps=1))[1]
    rollouts = _step_one_rollouts(initial, data, CONFIG)
    groups = degenerate_fractions(rollouts.rewards)
    assert record["reward"] == pytest.approx(rollouts.rewards.mean().item())
    assert record["reward_std"] == pytest.approx(rollouts.rewards.std().item())
    assert (
        record["frac_reward_zero_std"]
        == groups["degenerate"]
        == groups["all_correct"] + groups["all_wrong"]
    )
    assert (record["all_correct"], record["all_wrong"]) == (
        groups["all_correct"],
        groups["all_wrong"],
    )
    lengths, truncated = rollouts.lengths, rollouts.truncated
    # Zero-advantage tokens: those of the zero-std groups, counted by hand.
    zero_groups = rollouts.rewards.std(dim=1) == 0
    zero_tokens = lengths.view(zero_groups.shape[0], -1)[zero_groups].sum().item()
    assert record["zero_advantage_token_share"] == pytest.approx(zero_tokens / lengths.sum().item())
    assert record["completions/max_length"] == lengths.max().item()
    assert record["completions/min_length"] == lengths.min().item()
    assert record["completions/clipped_ratio"] == truncated.double().mean().item()
    assert record["completions/mean_terminated_length"] == pytest.approx(
        lengths[~truncated].double().mean().item() if (~truncated).any() else 0.0
    )
    assert record["num_tokens"] == (
        rollouts.attention_mask.sum().item()  # prompt (repeated G times) and completion tokens
    )
    assert record["kl"] is None  # beta = 0: no reference model
    assert record["clip_ratio/region_mean"] == 0  # on-policy: the ratio is exactly 1


def test_one_step_by_hand_is_trains_first_step(initial, data):
    """`reference_and_optimizer` then `grpo_step` at step 1 (chapter 4) give the record and the
    weights of `train`'s first step, KL reference included."""
    config = replace(CONFIG, max_steps=1, beta=0.1)
    trained = copy.deepcopy(initial[0])
    record = _train((trained, initial[1]), data, config)[1]
    model, tokenizer = copy.deepcopy(initial[0]), initial[1]
    reference, optimizer = trainer.reference_and_optimizer(model, config)
    assert not model.training and not any(p.requires_grad for p in reference.parameters())
    assert optimizer.defaults["lr"] == config.learning_rate
    prompts, golds = build_prompts(tokenizer, data[0])
    by_hand = trainer.grpo_step(
        model, tokenizer, reference, optimizer, prompts, golds, config, 1, has_digit
    )
    assert by_hand == {**record, "eval_accuracy": None} and record["kl"] == 0.0
    for a, b in zip(trained.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert trainer.reference_and_optimizer(model, replace(config, beta=0.0))[0] is None


def test_update_is_the_policy_gradient(initial, policy, data):
    """beta = 0, one iteration: the gradient is -1/N sum_i A_i / L_i sum_t grad log pi(o_it),
    computed here from the same rollouts with plain forward passes on unpadded sequences.
    AdamW's first step moves each parameter by -lr * g / (|g| + eps), eps = 1e-8; compared
    where |g| >> eps, as rounding noise in g (~1e-9 here) decides the ratio where |g| ~ eps."""
    config = replace(CONFIG, max_steps=1, temperature=0.8, max_grad_norm=math.inf)
    model, tokenizer = policy
    before = [parameter.detach().clone() for parameter in model.parameters()]
    record = _train(policy, data, config)[1]

    reference = copy.deepcopy(initial[0])
    rollouts = _step_one_rollouts(initial, data, config)
    advantages = (
        (rollouts.rewards - rollouts.rewards.mean(1, keepdim=True))
        / (rollouts.rewards.std(1, keepdim=True) + 1e-4)
    ).flatten()
    objective = 0.0
    for i, (prompt, completion) in enumerate(
        zip(rollouts.prompt_ids[rollouts.prompt_index], rollouts.completion_ids)
    ):
        prompt = prompt[rollouts.prompt_mask[i // config.num_generations].bool()]
        completion = completion[: rollouts.lengths[i]]
        logits = (
            reference(torch.cat([prompt, completion])[None]).logits[0, len(prompt) - 1 : -1]
            / config.temperature
        )
        log_probs = torch.log_softmax(logits, -1).gather(-1, completion[:, None])
        objective = objective + advantages[i] * log_probs.mean()
    gradients = torch.autograd.grad(-objective / len(rollouts.texts), list(reference.parameters()))

    gradient_norm = torch.cat([g.flatten() for g in gradients]).norm().item()
    assert record["grad_norm"] == pytest.approx(gradient_norm, rel=1e-4)
    for old, new, g in zip(before, model.parameters(), gradients):
        clear = g.abs() > 1e-6
        adam_step = -config.learning_rate * g[clear] / (g[clear].abs() + 1e-8)
        torch.testing.assert_close(
            (new.detach() - old)[clear], adam_step, rtol=0, atol=1e-3 * config.learning_rate
        )


def test_same_seed_same_history(initial, data):
    runs = []
    for _ in range(2):
        model, tokenizer = copy.deepcopy(initial[0]), initial[1]
        runs.append((_train((model, tokenizer), data), model))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1].parameters(), runs[1][1].parameters()):
        assert torch.equal(a, b)
    other = _train(copy.deepcopy(initial), data, replace(CONFIG, seed=1))
    assert other != runs[0][0]


@pytest.mark.parametrize("credit", ["outcome", "process"])
def test_resume_repeats_an_uninterrupted_run(initial, data, tmp_path, monkeypatch, credit):
    config = replace(
        CONFIG, beta=0.1, num_iterations=2, save_steps=1, credit=credit
    )  # reference, optimizer state, pi_old
    uninterrupted = copy.deepcopy(initial[0])
    expected = _train((uninterrupted, initial[1]), data, config, checkpoint_dir=tmp_path / "a")

    # Step 3 dies half-way: the checkpoint of step 2 must survive it.
    grpo_step = trainer.grpo_step

    def dies_at_step_3(*args, **kwargs):
        if args[-2] == 3:
            raise KeyboardInterrupt
        return grpo_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "grpo_step", dies_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        _train(copy.deepcopy(initial), data, config, checkpoint_dir=tmp_path / "b")
    monkeypatch.setattr(trainer, "grpo_step", grpo_step)
    assert [
        record["step"] for record in json.loads((tmp_path / "b" / "history.json").read_text())
    ] == [0, 1, 2]
    assert sorted(path.name for path in (tmp_path / "b").iterdir()) == [
        "checkpoint.pt",
        "history.json",
    ]

    resumed = copy.deepcopy(initial[0])
    history = _train(
        (resumed, initial[1]), data, config, checkpoint_dir=tmp_path / "b", resume=True
    )
    assert history == expected
    for a, b in zip(uninterrupted.parameters(), resumed.parameters()):
        assert torch.equal(a, b)

    with pytest.raises(ValueError, match="differs in learning_rate"):
        _train(
            copy.deepcopy(initial),
            data,
            replace(config, learning_rate=1.0),
            checkpoint_dir=tmp_path / "b",
            resume=True,
        )
    with pytest.raises(ValueError, match="not the initial model"):
        _train(
            (uninterrupted, initial[1]), data, config, checkpoint_dir=tmp_path / "b", resume=True
        )


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo"])
def test_micro_batches_give_the_same_step(initial, data, loss_type):
    config = replace(CONFIG, max_steps=1, loss_type=loss_type)
    whole = _train(copy.deepcopy(initial), data, config)[1]
    # 16 and 8: each micro-batch holds whole groups, whose prompts then go through the model
    # once (`scoring.completion_logits`); 3 splits groups, every row runs its own prompt.
    for size in (3, 8):
        split = _train(copy.deepcopy(initial), data, replace(config, micro_batch_size=size))[1]
        assert whole["reward"] == split["reward"]
        for name in ("loss", "grad_norm", "entropy"):
            assert split[name] == pytest.approx(whole[name], rel=1e-5, abs=1e-7), name


def test_bnpo_averages_the_token_means_of_the_micro_batches(initial, data):
    """TRL's bnpo: the loss of a step is the mean over its micro-batches of each one's token mean,
    so unlike dapo it depends on micro_batch_size when micro-batches hold different token counts.
    At ratio 1 each micro-batch's loss is -sum A_i L_i / sum L_i over its completions."""
    config = replace(CONFIG, max_steps=1, loss_type="bnpo")
    rollouts = _step_one_rollouts(initial, data, config)
    advantages = group_advantages(rollouts.rewards).flatten().double()
    lengths = rollouts.lengths.double()
    for size in (16, 4, 6):
        record = _train(copy.deepcopy(initial), data, replace(config, micro_batch_size=size))[1]
        parts = [
            -(advantages[i : i + size] * lengths[i : i + size]).sum() / lengths[i : i + size].sum()
            for i in range(0, len(lengths), size)
        ]
        assert record["loss"] == pytest.approx(sum(parts).item() / len(parts), abs=1e-6)
    whole = _train(copy.deepcopy(initial), data, config)[1]["loss"]
    dapo = _train(copy.deepcopy(initial), data, replace(config, loss_type="dapo"))[1]["loss"]
    assert whole == pytest.approx(dapo, abs=1e-7)  # one micro-batch: bnpo is dapo


def test_mask_truncated_completions_leaves_them_out_of_the_loss(initial, data):
    """TRL's mask_truncated_completions: at ratio 1 the dapo loss becomes the token-weighted mean
    advantage of the completions that ended with EOS."""
    config = replace(CONFIG, max_steps=1, loss_type="dapo", mask_truncated_completions=True)
    rollouts = _step_one_rollouts(initial, data, config)
    assert 0 < rollouts.truncated.double().mean() < 1
    advantages = group_advantages(rollouts.rewards).flatten().double()
    lengths = rollouts.lengths.double() * ~rollouts.truncated
    record = _train(copy.deepcopy(initial), data, config)[1]
    expected = -(advantages * lengths).sum() / lengths.sum()
    assert record["loss"] == pytest.approx(expected.item(), abs=1e-6)
    grpo = _train(copy.deepcopy(initial), data, replace(config, loss_type="grpo"))[1]
    assert math.isfinite(grpo["loss"])  # empty rows count in B, as TRL's clamp(min=1)


def test_trl_settings_are_accepted():
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"
    assert GRPOConfig().use_bias_correction_kl is False  # TRL 1.16: True; see the docstring
    with pytest.raises(ValueError, match="importance_sampling_level"):
        GRPOConfig(importance_sampling_level="step")


def test_filtering_degenerate_groups_only_rescales_the_gradient(initial, data):
    """Zero-std groups have zero advantages; with loss_type "grpo" (1/B per sequence) dropping
    them only changes B. Even golds: every completion is right, so those groups are degenerate."""

    def mixed_on_odd_golds(completion, gold):
        return 1.0 if int(gold) % 2 == 0 else has_digit(completion, gold)

    config = replace(CONFIG, max_steps=1)
    records = {}
    for filter_degenerate in (False, True):
        model, tokenizer = copy.deepcopy(initial)
        records[filter_degenerate] = train(
            model,
            tokenizer,
            *data,
            replace(config, filter_degenerate=filter_degenerate),
            reward_fn=mixed_on_odd_golds,
            progress=False,
        )[1]
    degenerate = records[False]["frac_reward_zero_std"]
    assert 0 < degenerate < 1
    assert records[True]["grad_norm"] == pytest.approx(
        records[False]["grad_norm"] / (1 - degenerate), rel=1e-5
    )


def test_all_groups_filtered_means_no_update(policy, data):
    model, _ = policy
    before = copy.deepcopy(model.state_dict())
    record = train(
        *policy,
        *data,
        replace(CONFIG, max_steps=1, filter_degenerate=True),
        reward_fn=lambda completion, gold: 1.0,
        progress=False,
    )[1]
    assert record["frac_reward_zero_std"] == record["all_correct"] == 1
    assert record["grad_norm"] == 0 and record["loss"] is None and record["entropy"] is None
    for name, weight in model.state_dict().items():
        assert torch.equal(weight, before[name]), name


def test_reward_rises_under_grpo(policy, data):
    """A reward the random model meets two times in three: six steps at a high learning rate
    raise its expected value, estimated on 320 completions, by 0.12 to 0.22 for each of the
    seeds 0-9 (checked while writing this test; the estimate's standard error is ~0.025)."""
    model, tokenizer = policy
    prompts, golds = build_prompts(tokenizer, data[0])

    def expected_reward():
        return (
            generate_rollouts(
                model,
                tokenizer,
                prompts,
                golds,
                num_generations=32,
                max_completion_length=8,
                seed=123,
                batch_size=320,
                reward_fn=has_digit,
            )
            .rewards.mean()
            .item()
        )

    before = expected_reward()
    _train(policy, data, replace(CONFIG, max_steps=6))
    assert expected_reward() > before + 0.08


def test_batches_walk_the_training_set_once_per_epoch():
    walk = [i for step in range(1, 6) for i in batch_indices(step, 10, 4, seed=0)]
    assert sorted(walk[:10]) == sorted(walk[10:20]) == list(range(10))
    assert walk[:10] != walk[10:20]
    assert batch_indices(3, 10, 4, seed=0) == walk[8:12]
    assert batch_indices(1, 10, 4, seed=1) != walk[:4]


def test_config_is_checked():
    with pytest.raises(ValueError, match="method"):
        GRPOConfig(method="ppo")
    with pytest.raises(ValueError, match="loss_type"):
        GRPOConfig(loss_type="mean")
    with pytest.raises(ValueError, match="num_generations"):
        GRPOConfig(num_generations=1)


# --- credit="process": step-level credit ----------------------------------------------------


def test_process_credit_trains_on_per_token_advantages(initial, data):
    """At ratio 1 the "grpo" loss is -1/N sum_i 1/L_i sum_t A_it, with A_it from the step
    rewards of the rollouts (`steps.rollout_step_rewards`, `process_advantages`)."""
    config = replace(CONFIG, max_steps=1, credit="process")
    trained = copy.deepcopy(initial[0])
    history = _train((trained, initial[1]), data, config)
    record = history[1]
    assert tuple(record) == METRICS and math.isfinite(record["loss"])
    rollouts = _step_one_rollouts(initial, data, config)
    rows = batch_indices(1, len(data[0]), config.per_step_prompts, config.seed)
    answers = [data[0]["answer"][i] for i in rows]
    step_values = rollout_step_rewards(initial[1], rollouts, answers)
    assert step_values[2].sum(-1).min() >= 3  # the references have 2 or 3 worked lines
    advantages = process_advantages(*step_values, rollouts.completion_ids.shape[1])
    mask = rollouts.completion_mask
    expected = -((advantages * mask).sum(1) / mask.sum(1)).mean()
    assert record["loss"] == pytest.approx(expected.item(), abs=1e-6)
    outcome = copy.deepcopy(initial[0])
    assert _train((outcome, initial[1]), data, replace(config, credit="outcome"))[1] != record
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), outcome.parameters()))


@pytest.mark.parametrize("credit", ["process_placebo", "process_per_step"])
def test_process_credit_variants_train_on_their_advantages(initial, data, credit):
    """The placebo shuffles the worked steps' rewards within each group with the step's own
    generator; per-step divides each completion's process advantages by its number of steps."""
    config = replace(CONFIG, max_steps=1, credit=credit)
    history = _train((copy.deepcopy(initial[0]), initial[1]), data, config)
    rollouts = _step_one_rollouts(initial, data, config)
    rows = batch_indices(1, len(data[0]), config.per_step_prompts, config.seed)
    steps, ends, mask = rollout_step_rewards(
        initial[1], rollouts, [data[0]["answer"][i] for i in rows]
    )
    if credit == "process_placebo":
        shuffle = torch.Generator().manual_seed(rollout_seed(config.seed, 1))
        steps = shuffle_step_rewards(steps, mask, shuffle)
    advantages = process_advantages(steps, ends, mask, rollouts.completion_ids.shape[1])
    if credit == "process_per_step":  # each token's advantage over the steps still ahead
        ahead = torch.zeros_like(advantages)
        for row, (row_ends, row_mask) in enumerate(zip(ends.flatten(0, 1), mask.flatten(0, 1))):
            for end in row_ends[row_mask].tolist():
                ahead[row, : end + 1] += 1
        advantages = advantages / ahead.clamp(min=1)
    completion = rollouts.completion_mask
    expected = -((advantages * completion).sum(1) / completion.sum(1)).mean()
    assert history[1]["loss"] == pytest.approx(expected.item(), abs=1e-6)


def test_process_credit_without_worked_steps_is_outcome_credit(initial, data):
    """References with no worked lines leave only the outcome step, on each completion's last
    token: the per-token advantages are the outcome advantages broadcast, the same run."""
    bare = [
        datasets.Dataset.from_dict(
            {
                "question": split["question"],
                "answer": [f"#### {gold_answer(answer)}" for answer in split["answer"]],
            }
        )
        for split in data
    ]
    runs = {}
    for credit in ("outcome", "process"):
        model = copy.deepcopy(initial[0])
        runs[credit] = (_train((model, initial[1]), bare, replace(CONFIG, credit=credit)), model)
    assert runs["process"][0] == runs["outcome"][0]
    for a, b in zip(runs["process"][1].parameters(), runs["outcome"][1].parameters()):
        assert torch.equal(a, b)


def test_process_credit_refuses_what_it_does_not_define(initial, data):
    with pytest.raises(ValueError, match="credit must be one of"):
        GRPOConfig(credit="token")
    for change in (
        {"filter_degenerate": True},
        {"method": "rloo"},
        {"scale_rewards": "batch"},
        {"importance_sampling_level": "sequence"},
    ):
        with pytest.raises(ValueError, match=f"credit='process' needs.*{next(iter(change))}="):
            GRPOConfig(credit="process", **change)
    model, tokenizer = copy.deepcopy(initial[0]), initial[1]
    config = replace(CONFIG, credit="process")
    reference, optimizer = trainer.reference_and_optimizer(model, config)
    prompts, golds = build_prompts(tokenizer, data[0])
    with pytest.raises(ValueError, match="needs the answers"):
        trainer.grpo_step(
            model, tokenizer, reference, optimizer, prompts, golds, config, 1, has_digit
        )


def test_a_shared_initial_accuracy_changes_nothing(initial, data):
    """Runs from one start may share the held-out accuracy before training (chapters 5 and 6
    do): the history is the one `train` measures itself."""
    from grpo_companion.lm.evaluation import held_out_accuracy

    model, tokenizer = initial
    config = replace(CONFIG, max_steps=1, eval_every=1)

    def odd_length(text, gold):  # right on some of the random model's answers, not all
        return float(len(text) % 2)

    before = held_out_accuracy(copy.deepcopy(model), tokenizer, data[1], config, odd_length)
    assert 0 < before < 1
    runs = [
        train(copy.deepcopy(model), tokenizer, *data, config, reward_fn=odd_length,
              progress=False, initial_accuracy=shared)
        for shared in (before, None)
    ]  # fmt: skip
    assert runs[0] == runs[1]


@pytest.mark.parametrize("save_steps", [2, 0])
def test_segments_with_until_are_the_whole_run(initial, data, tmp_path, save_steps):
    """Training in segments (`until`, resuming from the checkpoint, as chapter 6's probed runs
    do) gives the history and weights of one unbroken run, held-out evaluations included: at
    eval_every and max_steps, not at the end of every segment. Each segment's end is saved,
    also without periodic checkpoints (save_steps 0)."""
    config = replace(CONFIG, max_steps=5, eval_every=4, save_steps=save_steps)  # beta 0
    whole = copy.deepcopy(initial[0])
    expected = _train((whole, initial[1]), data, config)
    assert [r["step"] for r in expected if r["eval_accuracy"] is not None] == [0, 4, 5]
    pieces = copy.deepcopy(initial[0])
    for until in (1, 3, 5):  # ends that are not multiples of save_steps must be saved too
        history = _train((pieces, initial[1]), data, config, until=until,
                         checkpoint_dir=tmp_path, resume=True)  # fmt: skip
        assert len(history) == until + 1
    assert history == expected
    for a, b in zip(whole.parameters(), pieces.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="until"):
        _train(copy.deepcopy(initial), data, config, until=6)


def test_the_kl_term_has_no_gradient_while_the_policy_is_its_reference(policy, data):
    """beta > 0, every group degenerate (advantages 0): at step 1 pi = pi_ref, so k3's gradient
    is exactly 0 and the weights must not move: the frozen reference must round as the policy
    does. (On SmolLM2-135M it did not while the shared-prompt pass gave the last prompt token
    its own lm-head call, and AdamW turned a 1e-8 gradient into a full-size step; this batch
    happens not to show that, test_rollouts.py's frozen-copy check does.)"""
    config = replace(CONFIG, max_steps=1, beta=0.1)
    model, tokenizer = policy
    before = [p.detach().clone() for p in model.parameters()]
    history = train(model, tokenizer, *data, config, reward_fn=lambda text, gold: 0.0,
                    progress=False)  # fmt: skip
    assert history[1]["frac_reward_zero_std"] == 1.0
    assert history[1]["grad_norm"] == 0.0 and history[1]["kl"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("micro_batch_size", [16, 8, 6])
def test_several_updates_start_from_a_ratio_of_exactly_one(initial, data, micro_batch_size):
    """num_iterations > 1: pi_old is the policy's log-probs before the first update from the very
    pass the update makes (its micro-batches, prompts shared or not), so the first update's
    ratio pi / pi_old is exactly 1, whether or not micro-batches hold whole groups (6 does not);
    the second update's is not."""
    config = replace(CONFIG, max_steps=1, num_iterations=2, micro_batch_size=micro_batch_size)
    calls = []

    def recording_loss(log_probs, old_log_probs, *args, **kwargs):
        calls.append((log_probs.detach().clone(), old_log_probs.clone()))
        return grpo_loss(log_probs, old_log_probs, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer, "grpo_loss", recording_loss)
        _train(copy.deepcopy(initial), data, config)
    micro_batches = -(-config.per_step_prompts * config.num_generations // micro_batch_size)
    assert len(calls) == 2 * micro_batches
    assert all(torch.equal(new, old) for new, old in calls[:micro_batches])
    assert not all(torch.equal(new, old) for new, old in calls[micro_batches:])


def test_sampled_held_out_accuracy_is_greedy_accuracy_as_the_temperature_falls(random_tiny):
    """At a temperature near 0 every sample is the greedy completion, so the sampled accuracy
    equals the greedy one under the same reward; at temperature 1 the K samples differ."""
    model, tokenizer = random_tiny
    data = load_gsm8k("test", source="arithmetic", num_examples=3, seed=1)
    cold = replace(CONFIG, temperature=1e-4)
    greedy = evaluation.held_out_accuracy(model, tokenizer, data, cold, has_digit)
    sampled = evaluation.sampled_held_out_accuracy(model, tokenizer, data, cold, 4, 0, has_digit)
    assert sampled == pytest.approx(greedy)  # float32 mean against a float one
    prompts, golds = build_prompts(tokenizer, data)
    warm = generate_rollouts(model, tokenizer, prompts, golds, num_generations=4,
                             max_completion_length=CONFIG.max_completion_length, seed=7919,
                             reward_fn=has_digit, compute_log_probs=False)  # fmt: skip
    measured = evaluation.sampled_held_out_accuracy(model, tokenizer, data, CONFIG, 4, 0, has_digit)
    assert measured == pytest.approx(float(warm.rewards.float().mean()))
    assert 0 < measured < 1
