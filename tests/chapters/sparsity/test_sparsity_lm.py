"""Chapter 6's measurements on language models: one batch, training runs over seeds, samples."""

import math

import numpy as np
import pytest
import torch
from scipy import stats
from tiny_llama_batch import one_layer_llama

from grpo_companion.chapters.sparsity.lm_runs import batch_sparsity, gradient_split, sample_sparsity
from grpo_companion.chapters.sparsity.rate import iid_degenerate_rate
from grpo_companion.chapters.sparsity.remedies import remedy_summary, runs_of, smoothed
from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.losses import grpo_loss
from grpo_companion.lm.rollouts import Rollouts
from grpo_companion.lm.scoring import sequence_log_probs

# One group each: all correct, all wrong, mixed, mixed.
REWARDS = torch.tensor(
    [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]]
)
LENGTHS = torch.tensor([1, 2, 3, 4, 2, 2, 2, 2, 5, 5, 5, 5, 1, 1, 1, 1])
WIDTH = 6


def hand_built_rollouts(rewards=REWARDS, lengths=LENGTHS, truncated=None, seed=3) -> Rollouts:
    num_prompts, group_size = rewards.shape
    generator = torch.Generator().manual_seed(seed)
    completion_mask = (torch.arange(WIDTH) < lengths[:, None]).long()
    return Rollouts(
        prompt_ids=torch.randint(1, 20, (num_prompts, 3), generator=generator),
        prompt_mask=torch.ones(num_prompts, 3, dtype=torch.long),
        completion_ids=torch.randint(1, 20, (len(lengths), WIDTH), generator=generator),
        completion_mask=completion_mask,
        log_probs=None,
        lengths=lengths,
        truncated=torch.zeros(len(lengths), dtype=torch.bool) if truncated is None else truncated,
        texts=[""] * len(lengths),
        rewards=rewards,
        num_generations=group_size,
        temperature=1.0,
    )


def test_batch_sparsity_hand_built():
    completion_mask = (torch.arange(WIDTH) < LENGTHS[:, None]).long()
    assert batch_sparsity(REWARDS, completion_mask) == {
        "batch_all_correct": 0.25,
        "batch_all_wrong": 0.25,
        "batch_degenerate": 0.5,
        "batch_zero_advantage_rollouts": 0.5,
        "batch_zero_advantage_tokens": pytest.approx((10 + 8) / (10 + 8 + 20 + 4)),
    }


def test_gradient_split_on_a_tiny_llama():
    model = one_layer_llama()
    batch = hand_built_rollouts()
    records, table = gradient_split(model, batch)
    assert set(records) == {
        "grpo_gradient_norm",
        "grpo_degenerate_gradient_norm",
        "sign_gradient_norm",
        "sign_degenerate_gradient_norm",
        "sign_mixed_share",
    }
    assert records["grpo_degenerate_gradient_norm"] < 1e-12  # zero advantages, zero gradient
    parameters = list(model.parameters())
    for method in ("grpo", "sign"):
        # The whole batch's ascent direction, from one loss over all groups.
        log_probs = sequence_log_probs(
            model, batch.input_ids, batch.attention_mask, batch.completion_mask
        )
        advantages = group_advantages(batch.rewards, method).flatten()
        loss, _ = grpo_loss(log_probs, log_probs.detach(), None, advantages, batch.completion_mask)
        gradient = torch.cat([g.flatten() for g in torch.autograd.grad(-loss, parameters)])
        assert records[f"{method}_gradient_norm"] == pytest.approx(gradient.norm().item(), rel=1e-9)
    assert records["sign_degenerate_gradient_norm"] > 1e-6  # A = +-1 on the degenerate groups
    assert 0 < records["sign_mixed_share"] != pytest.approx(1.0, abs=1e-3)
    assert table["correct of G"].tolist() == [4, 0, 1, 2]
    assert table["group"].tolist() == ["all correct", "all wrong", "mixed", "mixed"]
    assert table.columns.tolist()[2:] == ["GRPO gradient norm", "Sign gradient norm"]
    assert table["GRPO gradient norm"].iloc[:2].abs().max() < 1e-12


def history(all_correct, all_wrong, accuracy, zero_std):
    """Steps 1..n with the degenerate fractions, accuracy measured at steps 0 and n only."""
    n = len(all_correct)
    records = [
        {
            "step": 0,
            "all_correct": None,
            "all_wrong": None,
            "frac_reward_zero_std": None,
            "eval_accuracy": accuracy[0],
        }
    ]
    for step in range(1, n + 1):
        records.append(
            {
                "step": step,
                "all_correct": all_correct[step - 1],
                "all_wrong": all_wrong[step - 1],
                "frac_reward_zero_std": zero_std[step - 1],
                "eval_accuracy": accuracy[1] if step == n else None,
            }
        )
    return records


RISING = {
    ("grpo", 0): history([0.0, 0.25, 0.5, 0.75], [0.5, 0.5, 0.25, 0.25], [0.2, 0.4], [0.5] * 4),
    ("grpo", 1): history([0.0, 0.25, 0.5, 0.5], [0.75, 0.5, 0.5, 0.25], [0.3, 0.4], [0.25] * 4),
    ("grpo", 2): history([0.25, 0.25, 0.5, 0.75], [0.5, 0.5, 0.5, 0.0], [0.2, 0.5], [0.75] * 4),
    ("sign", 0): history([0.0] * 4, [1.0] * 4, [0.2, 0.6], [1.0] * 4),
    ("sign", 1): history([0.0] * 4, [1.0] * 4, [0.3, 0.6], [1.0] * 4),
    ("sign", 2): history([0.0] * 4, [1.0] * 4, [0.2, 0.8], [0.5] * 4),
}


def test_runs_of_keeps_the_runs_of_one_method_in_order():
    steps, values = runs_of(RISING, "grpo", "all_correct")
    assert steps.tolist() == [1, 2, 3, 4]
    assert values[:, -1].tolist() == [0.75, 0.5, 0.75]
    steps, accuracy = runs_of(RISING, "sign", "eval_accuracy")
    assert steps.tolist() == [0, 4] and accuracy.tolist() == [[0.2, 0.6], [0.3, 0.6], [0.2, 0.8]]


def test_smoothed():
    np.testing.assert_allclose(
        smoothed(np.array([[0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]]), 2),
        [[0.0, 0.5, 0.5, 0.5], [1.0, 1.0, 0.5, 0.0]],
    )


def test_remedy_summary_hand_built():
    records, table = remedy_summary(
        RISING, ["grpo", "sign"], "grpo", {"sign": 0.1}, {"grpo": "GRPO", "sign": "Sign"}
    )
    assert records["initial_accuracy"] == pytest.approx((0.2 + 0.3 + 0.2) * 2 / 6)
    finals = {"grpo": [0.4, 0.4, 0.5], "sign": [0.6, 0.6, 0.8]}
    for name, final in finals.items():
        low, high = stats.t.interval(0.95, 2, loc=np.mean(final), scale=stats.sem(final))
        assert records[f"{name}_final_accuracy"] == pytest.approx(np.mean(final))
        assert records[f"{name}_final_accuracy_low"] == pytest.approx(low)
        assert records[f"{name}_final_accuracy_high"] == pytest.approx(high)
        assert table.loc[name, "final accuracy"] == pytest.approx(np.mean(final))
    assert records["grpo_accuracy_gain"] == pytest.approx((0.2 + 0.1 + 0.3) / 3)
    assert records["grpo_accuracy_gain_low"] < records["grpo_accuracy_gain"]
    assert records["grpo_degenerate_rate"] == pytest.approx(0.5)
    assert records["sign_degenerate_rate"] == pytest.approx((1 + 1 + 0.5) / 3)
    difference = [0.2, 0.2, 0.3]  # paired by seed
    low, _ = stats.t.interval(0.95, 2, loc=np.mean(difference), scale=stats.sem(difference))
    assert records["sign_minus_grpo"] == pytest.approx(np.mean(difference))
    assert records["sign_minus_grpo_low"] == pytest.approx(low) and low > 0
    assert records["sign_versus_grpo"] == "lies above 0, on the predicted side of GRPO's"
    assert "grpo_minus_grpo" not in records
    assert table.index.tolist() == ["grpo", "sign"]


def test_sampled_summary_pairs_final_sampled_accuracies_by_seed():
    from grpo_companion.chapters.sparsity.remedies import sampled_summary

    def history(start, end):
        return [{"sampled_accuracy": start}, {"sampled_accuracy": end}]

    histories = {("dr", 0): history(0.3, 0.4), ("dr", 1): history(0.3, 0.3),
                 ("dr", 2): history(0.3, 0.5), ("sign", 0): history(0.3, 0.5),
                 ("sign", 1): history(0.3, 0.5), ("sign", 2): history(0.3, 0.6)}  # fmt: skip
    records = sampled_summary(histories, ["dr", "sign"], "dr")
    difference = [0.1, 0.2, 0.1]
    low, high = stats.t.interval(0.95, 2, loc=np.mean(difference), scale=stats.sem(difference))
    assert records["sign_minus_dr_sampled"] == pytest.approx(np.mean(difference))
    assert records["sign_minus_dr_sampled_low"] == pytest.approx(low)
    assert records["sign_minus_dr_sampled_high"] == pytest.approx(high)
    assert records["dr_sampled_gain"] == pytest.approx(0.1)
    assert records["sign_sampled_gain"] == pytest.approx((0.2 + 0.2 + 0.3) / 3)
    assert "dr_minus_dr_sampled" not in records
    rising = {key: [dict(h[0], sampled_accuracy=0.3), *h[1:-1], dict(h[-1], sampled_accuracy=0.4)]
              for key, h in RISING.items()}  # fmt: skip
    summary, _ = remedy_summary(rising, ["grpo", "sign"], "grpo", {"sign": 0.1},
                                {"grpo": "GRPO", "sign": "Sign"})  # fmt: skip
    assert summary["sign_minus_grpo_sampled"] == pytest.approx(0.0)
    plain, _ = remedy_summary(RISING, ["grpo", "sign"], "grpo", {"sign": 0.1},
                              {"grpo": "GRPO", "sign": "Sign"})  # fmt: skip
    assert not any("sampled" in key for key in plain)


def test_sample_sparsity_hand_built():
    rewards = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    truncated = torch.tensor([True, True, False, False, True, False])
    summary = sample_sparsity(
        hand_built_rollouts(rewards, torch.ones(6, dtype=torch.long), truncated)
    )
    assert summary == {
        "small_num_prompts": 3,
        "small_group_size": 2,
        "small_degenerate": pytest.approx(2 / 3),
        "small_all_correct": 0.0,
        "small_all_wrong": pytest.approx(2 / 3),
        "small_pass_rate": pytest.approx(1 / 6),
        "small_iid_prediction": pytest.approx(iid_degenerate_rate(1 / 6, 2)["degenerate"][0]),
        "small_truncated_fraction": pytest.approx(0.5),
        "small_groups_all_truncated": pytest.approx(1 / 3),
        "small_num_finished": 3,
        "small_num_completions": 6,
        "small_pass_rate_finished": pytest.approx(1 / 3),  # the finished: 1, 0 and 0
    }
    none_finished = sample_sparsity(
        hand_built_rollouts(rewards, torch.ones(6, dtype=torch.long), torch.ones(6, dtype=bool))
    )
    assert none_finished["small_pass_rate_finished"] == 0.0
    assert math.isclose(none_finished["small_groups_all_truncated"], 1.0)


def test_remedy_runs_train_every_method_on_every_seed_from_a_fresh_copy(random_tiny):
    import copy

    from grpo_companion.chapters.sparsity.remedies import remedy_runs
    from grpo_companion.lm.gsm8k import load_gsm8k

    model, tokenizer = random_tiny
    grpo = {"num_generations": 2, "per_step_prompts": 2, "max_completion_length": 4,
            "max_steps": 1, "eval_every": 1}  # fmt: skip
    methods = {"grpo": {"method": "grpo"}, "sign": {"method": "sign"}}
    histories = remedy_runs(
        lambda: copy.deepcopy(model), tokenizer,
        load_gsm8k("train", source="arithmetic", num_examples=4, seed=0),
        load_gsm8k("test", source="arithmetic", num_examples=2, seed=0),
        grpo, methods, [0, 1], initial_accuracy=0.0, workers=1,
    )  # fmt: skip
    assert list(histories) == [("grpo", 0), ("grpo", 1), ("sign", 0), ("sign", 1)]
    assert all(history[0]["eval_accuracy"] == 0.0 for history in histories.values())
    assert all("sampled_accuracy" not in history[-1] for history in histories.values())


def test_remedy_runs_add_the_sampled_accuracy_of_the_start_and_of_each_trained_model(random_tiny):
    import copy

    from grpo_companion.chapters.sparsity.remedies import remedy_runs
    from grpo_companion.lm.config import GRPOConfig
    from grpo_companion.lm.evaluation import sampled_held_out_accuracy
    from grpo_companion.lm.gsm8k import load_gsm8k

    model, tokenizer = random_tiny
    grpo = {"num_generations": 2, "per_step_prompts": 2, "max_completion_length": 4,
            "max_steps": 1, "eval_every": 1, "learning_rate": 1e-30}  # fmt: skip
    test = load_gsm8k("test", source="arithmetic", num_examples=2, seed=0)
    histories = remedy_runs(
        lambda: copy.deepcopy(model), tokenizer,
        load_gsm8k("train", source="arithmetic", num_examples=4, seed=0), test,
        grpo, {"grpo": {"method": "grpo"}}, [0, 1], initial_accuracy=0.0, eval_samples=3,
        sample_seed=5, workers=1,
    )  # fmt: skip
    for (_, seed), history in histories.items():  # a step of 1e-30 is below rounding: no change
        start = sampled_held_out_accuracy(model, tokenizer, test, GRPOConfig(**grpo), 3, 5 + seed)
        assert history[0]["sampled_accuracy"] == history[-1]["sampled_accuracy"] == start


def test_tuned_remedy_runs_take_each_methods_best_rate_then_compare_on_other_seeds(monkeypatch):
    from grpo_companion.chapters.sparsity import remedies

    calls, samplings = [], []
    best = {"dr_grpo": 3e-5, "sign": 1e-4}

    def fake_remedy_runs(load_model, tokenizer, train, evaluation, grpo, methods, seeds, *,
                         initial_accuracy, **sampling):  # fmt: skip
        calls.append((evaluation, dict(methods), list(seeds), initial_accuracy))
        samplings.append(sampling)
        return {
            (name, seed): [
                {"step": 0, "eval_accuracy": initial_accuracy},
                {"step": 2, "eval_accuracy": 0.5 - abs(np.log10(overrides["learning_rate"])
                                                       - np.log10(best[overrides["method"]]))
                 + 0.01 * seed},
            ]
            for name, overrides in methods.items()
            for seed in seeds
        }  # fmt: skip

    monkeypatch.setattr(remedies, "remedy_runs", fake_remedy_runs)
    methods = {"dr_grpo": {"method": "dr_grpo"}, "sign": {"method": "sign"}}
    histories, choice, tuned = remedies.tuned_remedy_runs(
        None, None, "train", "validation", "test", {"max_steps": 2}, methods, [1e-5, 3e-5, 1e-4],
        [1000], [0, 1], initial_validation=0.1, initial_test=0.2, eval_samples=4, sample_seed=7,
    )  # fmt: skip
    (tune_data, grid, tune_seeds, tune_start), (data, chosen, seeds, start) = calls
    assert samplings == [{"keep": None}, {"eval_samples": 4, "sample_seed": 7, "keep": None}]
    assert (tune_data, tune_seeds, tune_start) == ("validation", [1000], 0.1)
    assert len(grid) == 6 and grid[("sign", 1e-5)] == {"method": "sign", "learning_rate": 1e-5}
    assert (data, seeds, start) == ("test", [0, 1], 0.2)
    assert chosen == {name: {**methods[name], "learning_rate": best[name]} for name in methods}
    assert choice["dr_grpo"]["inside"] and not choice["sign"]["inside"]
    expected = [10.5 - np.log10(3), 10.5, 10.5 - np.log10(10 / 3)]  # + 0.01 x tuning seed 1000
    assert choice["dr_grpo"]["means"] == pytest.approx(expected)
    records = remedies.tuning_records(choice, methods, "dr_grpo")
    assert choice["dr_grpo"]["learned"] and choice["sign"]["learned"]  # above the start, 0.1
    assert records == {"dr_grpo_learning_rate": 3e-5, "dr_grpo_lr_inside": 1,
                       "dr_grpo_tune_learned": 1, "sign_tune_learned": 1,
                       "sign_learning_rate": 1e-4, "sign_lr_inside": 0,
                       "remedy_lr_inside": 0, "dr_grpo_same_loss": 1,
                       "sign_same_loss": 1}  # fmt: skip
    other_loss = {**methods, "sign": {"method": "sign", "loss_type": "grpo"}}
    assert remedies.tuning_records(choice, other_loss, "dr_grpo")["sign_same_loss"] == 0
    assert list(histories) == [("dr_grpo", 0), ("dr_grpo", 1), ("sign", 0), ("sign", 1)]
    # the tuning runs at each method's chosen rate, for a prediction made before the comparison
    assert list(tuned) == [("dr_grpo", 1000), ("sign", 1000)]
    gain = remedies.tuning_gain(tuned, "dr_grpo", 0.1)
    assert gain == pytest.approx(tuned[("dr_grpo", 1000)][-1]["eval_accuracy"] - 0.1)


def test_power_records_size_seeds_from_the_pilot_and_refuse_a_zero_prediction():
    from grpo_companion.chapters.sparsity.remedies import paired_differences, power_records

    np.testing.assert_allclose(paired_differences(RISING, "sign", "grpo"), [0.2, 0.2, 0.3])
    records = power_records(RISING, ["grpo", "sign"], "grpo", {"sign": 0.1}, num_pilot=2)
    sd = float(np.std([0.2, 0.2], ddof=1))  # the first two seeds' differences
    assert records["sign_pilot_sd"] == pytest.approx(sd) and sd == pytest.approx(0.0, abs=1e-12)
    assert records["sign_seeds_run"] == 3
    records = power_records(RISING, ["grpo", "sign"], "grpo", {"sign": 0.0}, num_pilot=3)
    assert records["sign_seeds_needed"] is None
    assert records["sign_power_words"].startswith("cannot be sized: the predicted difference is 0")
    # the first two seeds' differences are 0.2 and 0.2: no spread in the pilot
    records = power_records(RISING, ["grpo", "sign"], "grpo", {"sign": 0.1}, num_pilot=2)
    assert records["sign_seeds_needed"] is None
    assert records["sign_power_words"] == "cannot be sized: the pilot's differences have no spread"
    sd = float(np.std([0.2, 0.2, 0.3], ddof=1))
    needed = math.ceil(((stats.norm.ppf(0.975) + stats.norm.ppf(0.8)) * sd / 0.01) ** 2)
    records = power_records(RISING, ["grpo", "sign"], "grpo", {"sign": 0.01}, num_pilot=3)
    assert records["sign_seeds_needed"] == needed > 3
    assert records["sign_power_words"].startswith(f"needs {needed} seeds for 80% power")


def test_remedy_runs_keep_finished_runs_under_a_folder_named_by_their_inputs(
    random_tiny, tmp_path, monkeypatch
):
    import copy

    from grpo_companion.chapters.sparsity import remedies
    from grpo_companion.lm.gsm8k import load_gsm8k

    model, tokenizer = random_tiny
    grpo = {"num_generations": 2, "per_step_prompts": 2, "max_completion_length": 4,
            "max_steps": 1, "eval_every": 1}  # fmt: skip
    data = (load_gsm8k("train", source="arithmetic", num_examples=4, seed=0),
            load_gsm8k("test", source="arithmetic", num_examples=2, seed=0))  # fmt: skip

    def runs(methods):
        return remedies.remedy_runs(lambda: copy.deepcopy(model), tokenizer, *data, grpo, methods,
                                   [0], initial_accuracy=0.0, workers=1, keep=tmp_path)  # fmt: skip

    first = runs({"grpo": {"method": "grpo"}})

    def no_training(*args, **kwargs):
        raise AssertionError("a kept run was trained again")

    monkeypatch.setattr(remedies, "train", no_training)
    assert runs({"grpo": {"method": "grpo"}}) == first  # read back, not trained
    with pytest.raises(RuntimeError, match="a kept run was trained again"):
        runs({"grpo": {"method": "grpo", "learning_rate": 3e-5}})  # other inputs: another folder
