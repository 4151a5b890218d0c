import copy
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

from grpo_companion.chapters.gsm8k import run, sparsity
from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.gsm8k import build_prompts, gold_answer, load_gsm8k, reward
from grpo_companion.lm.tiny_llama import TinyLlamaSpec
from grpo_companion.lm.trainer import METRICS, grpo_step

# --- held-out problems -----------------------------------------------------------------------


def test_num_seen_problems_counts_the_warm_start_only_for_the_tiny_llama():
    spec = TinyLlamaSpec(num_train_examples=300, num_validation_examples=50)
    assert run.num_seen_problems("tiny-llama", spec, 100) == 350
    assert run.num_seen_problems("tiny-llama", spec, 400) == 400
    assert run.num_seen_problems("smollm2-135m", spec, 100) == 100


def test_held_out_problems_are_the_test_split_or_unseen_training_problems():
    settings = {"source": "arithmetic", "num_examples": 5, "seed": 3, "validation_start": 40}
    test = run.held_out_problems("test", num_seen=100, **settings)  # no check on the test split
    assert (
        test.to_dict() == load_gsm8k("test", source="arithmetic", num_examples=5, seed=3).to_dict()
    )
    validation = run.held_out_problems("validation", num_seen=40, **settings)
    train = load_gsm8k("train", source="arithmetic", num_examples=45, seed=3)
    assert validation.to_dict() == train.select(range(40, 45)).to_dict()
    with pytest.raises(ValueError, match="overlaps the 41"):
        run.held_out_problems("validation", num_seen=41, **settings)
    with pytest.raises(ValueError, match="eval_split"):
        run.held_out_problems("train", num_seen=0, **settings)


# --- the signal fraction of batch gradients ----------------------------------------------------


def test_identical_gradients_are_all_signal_and_orthogonal_ones_all_noise():
    same = run.gradient_signal(torch.tensor([[1.0, 2.0, 2.0]] * 4, dtype=torch.float64))
    assert same["signal_fraction"] == pytest.approx(1.0, abs=1e-12)
    assert same["mean_gradient_cosine"] == pytest.approx(1.0, abs=1e-12)
    # Orthogonal, equal norms: ||mean||^2 = 4 / 16 = 1/K of the mean square, so R = 1/K.
    orthogonal = run.gradient_signal(3 * torch.eye(4, dtype=torch.float64))
    assert orthogonal["signal_fraction"] == pytest.approx(0.0, abs=1e-12)
    np.testing.assert_allclose(orthogonal["cosines"], np.eye(4), atol=1e-12)


def test_gradient_signal_against_its_formula():
    gradients = torch.tensor(
        [[1.0, 0.0, 2.0], [0.5, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64
    )
    result = run.gradient_signal(gradients)
    g = gradients.numpy()
    ratio = np.sum(g.mean(0) ** 2) / np.mean(np.sum(g**2, axis=1))
    assert result["signal_fraction"] == pytest.approx((ratio - 1 / 3) / (1 - 1 / 3), rel=1e-12)
    cosine = g[0] @ g[1] / np.linalg.norm(g[0]) / np.linalg.norm(g[1])
    # The zero gradient (a batch of degenerate groups only) has cosine 0 with every other.
    assert result["mean_gradient_cosine"] == pytest.approx(cosine / 3, rel=1e-12)
    assert result["cosines"][2, 2] == 0.0


def test_signal_fraction_estimates_phi_of_noisy_gradients():
    """g_k = mu + noise with ||mu||^2 = 1 and E||noise||^2 = 3: phi = 1/4. In 200_000
    dimensions the norms concentrate, so six batches estimate phi to about +-0.01."""
    generator = torch.Generator().manual_seed(0)
    dimension = 200_000
    mu = torch.randn(dimension, generator=generator, dtype=torch.float64)
    mu /= mu.norm()
    noise = torch.randn(6, dimension, generator=generator, dtype=torch.float64) * math.sqrt(
        3 / dimension
    )
    result = run.gradient_signal(mu + noise)
    assert result["signal_fraction"] == pytest.approx(0.25, abs=0.02)
    assert result["mean_gradient_cosine"] == pytest.approx(0.25, abs=0.02)


def test_gradient_signal_needs_two_batches():
    with pytest.raises(ValueError, match="at least 2"):
        run.gradient_signal(torch.ones(1, 3, dtype=torch.float64))


def digits(completion: str, gold: str) -> float:
    return float(any(character.isdigit() for character in completion))


@pytest.fixture(scope="module")
def tiny_setup(random_tiny):
    model, tokenizer = random_tiny
    data = load_gsm8k("train", source="arithmetic", num_examples=6, seed=0)
    config = GRPOConfig(
        num_generations=4,
        per_step_prompts=2,
        max_completion_length=6,
        micro_batch_size=8,
        rollout_batch_size=8,
        beta=0.04,
        max_grad_norm=1e6,
    )
    return model, tokenizer, *build_prompts(tokenizer, data), config


def test_batch_gradients_are_the_steps_gradients_at_one_policy(tiny_setup):
    model, tokenizer, prompts, golds, config = tiny_setup
    model = copy.deepcopy(model)
    before = [parameter.detach().clone() for parameter in model.parameters()]
    # `digits`: mixed groups from a random model, so that the gradients are not zero.
    gradients = run.batch_gradients(model, tokenizer, prompts, golds, config, 3, reward_fn=digits)
    assert gradients.shape == (3, sum(p.numel() for p in model.parameters()))
    assert gradients.dtype == torch.float64 and gradients.norm(dim=1).min() > 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # lr 0: no change
    assert all(parameter.grad is None for parameter in model.parameters())
    # Step 3 alone, with the KL term (beta > 0) to a reference equal to the policy: the same
    # gradient, since the KL term's gradient vanishes at the reference.
    fresh = copy.deepcopy(model)
    optimizer = torch.optim.SGD(fresh.parameters(), lr=0.0)
    grpo_step(fresh, tokenizer, copy.deepcopy(fresh), optimizer, prompts, golds, config, 3, digits)
    alone = torch.cat([p.grad.flatten() for p in fresh.parameters()]).double()
    torch.testing.assert_close(gradients[2], alone, rtol=1e-5, atol=1e-7)


# --- held-out outcomes ---------------------------------------------------------------------------


def test_held_out_outcomes_are_greedy_rewards_and_seeded_pass_rates(tiny_setup):
    model, tokenizer, _, _, config = tiny_setup
    problems = load_gsm8k("test", source="arithmetic", num_examples=3, seed=0)
    outcomes = run.held_out_outcomes(model, tokenizer, problems, config, num_samples=4)
    assert outcomes["greedy"].shape == outcomes["sampled"].shape == (3,)
    assert len(outcomes["completions"]) == 3
    golds = build_prompts(tokenizer, problems)[1]
    expected = [reward(text, gold) for text, gold in zip(outcomes["completions"], golds)]
    assert outcomes["greedy"].tolist() == expected
    assert set((outcomes["sampled"] * 4).tolist()) <= {0.0, 1.0, 2.0, 3.0, 4.0}
    again = run.held_out_outcomes(model, tokenizer, problems, config, num_samples=4)
    np.testing.assert_array_equal(again["sampled"], outcomes["sampled"])  # common random numbers


# --- paired tests ------------------------------------------------------------------------------


def test_paired_sampled_gain_is_the_paired_t_test():
    before = np.array([0.0, 0.25, 0.5, 0.125, 1.0, 0.0])
    after = np.array([0.25, 0.25, 0.75, 0.0, 1.0, 0.5])
    result = run.paired_sampled_gain(before, after)
    d = after - before
    standard_error = np.std(d, ddof=1) / math.sqrt(6)
    t = d.mean() / standard_error
    assert result["sampled_accuracy_gain"] == pytest.approx(0.875 / 6)
    assert result["sampled_accuracy_gain_standard_error"] == pytest.approx(standard_error)
    assert result["sampled_accuracy_gain_p_value"] == pytest.approx(2 * stats.t.sf(abs(t), df=5))
    assert result["sampled_accuracy_before"] == pytest.approx(1.875 / 6)
    assert run.paired_sampled_gain(before, before)["sampled_accuracy_gain_p_value"] == 1.0


def test_paired_greedy_gain_is_mcnemars_exact_test():
    """5 problems fixed, 1 broken, 4 unchanged: two-sided binomial p = 2 P(X <= 1),
    X ~ Bin(6, 1/2), = 2 * 7 / 64."""
    before = np.array([0, 0, 0, 0, 0, 1, 1, 1, 0, 0])
    after = np.array([1, 1, 1, 1, 1, 0, 1, 1, 0, 0])
    result = run.paired_greedy_gain(before, after)
    assert (result["problems_fixed"], result["problems_broken"]) == (5, 1)
    assert result["mcnemar_p_value"] == pytest.approx(14 / 64)
    assert result["accuracy_gain"] == pytest.approx(0.4)
    assert result["accuracy_before"] == pytest.approx(0.3) and result[
        "accuracy_after"
    ] == pytest.approx(0.7)
    # The standard error of the mean of the paired differences d in {-1, 0, 1}, with 1/n
    # (not 1/(n - 1)) in the variance: sqrt(f + b - (f - b)^2 / n) / n.
    d = after - before
    assert result["accuracy_gain_standard_error"] == pytest.approx(d.std(ddof=0) / math.sqrt(10))
    unchanged = run.paired_greedy_gain(before, before)
    assert unchanged["mcnemar_p_value"] == 1.0 and unchanged["accuracy_gain_standard_error"] == 0


# --- training summaries -------------------------------------------------------------------------


def _history(rewards, kls):
    history = [{**dict.fromkeys(METRICS), "step": 0, "eval_accuracy": 0.5}]
    for step, (reward_mean, kl) in enumerate(zip(rewards, kls), start=1):
        history.append(
            {
                **dict.fromkeys(METRICS),
                "step": step,
                "reward": reward_mean,
                "frac_reward_zero_std": 1 - reward_mean,
                "all_correct": reward_mean / 2,
                "kl": kl,
            }
        )
    return history


def test_training_summary_averages_the_first_and_last_steps():
    frame = run.history_frame(_history([0.1, 0.2, 0.3, 0.4, 0.5], [0.0, 0.01, 0.02, 0.03, 0.04]))
    assert list(frame.index) == [0, 1, 2, 3, 4, 5] and math.isnan(frame.loc[0, "reward"])
    summary = run.training_summary(frame, window=2, beta=0.04)
    assert summary["reward_window"] == 2
    assert summary["train_reward_first"] == pytest.approx(0.15)
    assert summary["train_reward_last"] == pytest.approx(0.45)
    assert summary["zero_std_first"] == pytest.approx(0.85)
    assert summary["all_correct_last"] == pytest.approx(0.225)
    assert summary["kl_last"] == pytest.approx(0.04)
    assert run.training_summary(frame, window=2, beta=0.0)["kl_last"] == 0.0
    assert [run.reward_window(steps) for steps in (3, 10, 100, 105)] == [1, 1, 10, 10]


def _sparsity_frame(rewards, all_correct, all_wrong):
    rows = [{"step": 0, "reward": None, "all_correct": None, "all_wrong": None}]
    for step, values in enumerate(zip(rewards, all_correct, all_wrong), start=1):
        rows.append(dict(zip(("step", "reward", "all_correct", "all_wrong"), (step, *values))))
    return run.history_frame(rows)


def test_window_change_and_its_block_bootstrap_interval():
    values = np.r_[np.full(10, 0.2), np.linspace(0.2, 0.5, 80), np.full(10, 0.5)]
    values = values + 0.02 * np.random.default_rng(0).standard_normal(100)
    change = sparsity.window_change(values, 10, 2000, seed=0)
    assert change["mean"] == pytest.approx(values[-10:].mean() - values[:10].mean())
    assert 0 < change["low"] < change["mean"] < change["high"] < 0.5
    assert change == sparsity.window_change(values, 10, 2000, seed=0)  # seeded
    assert sparsity.window_change(values, 1, 2000, seed=0)["low"] is None  # one step: no interval
    assert [sparsity.block_length(n) for n in (1, 3, 10, 20, 30)] == [1, 1, 2, 3, 3]


def test_degenerate_prediction_is_the_iid_rate_at_the_window_means():
    G = 8
    rate = lambda p: p**G + (1 - p) ** G  # noqa: E731
    assert sparsity.degenerate_prediction(0.6, 0.8, G) == pytest.approx(rate(0.8) - rate(0.6))
    assert sparsity.degenerate_prediction(0.6, 0.8, G) > 0  # away from 1/2: more degenerate groups
    assert sparsity.degenerate_prediction(0.2, 0.4, G) < 0  # towards 1/2: fewer
    assert sparsity.degenerate_prediction(0.3, 0.7, G) == pytest.approx(0.0, abs=1e-15)


def test_sparsity_change_reads_the_change_against_the_prediction():
    steps = 40
    rising = np.linspace(0.6, 0.9, steps)  # a run past p = 1/2: the iid rate rises
    noise = 0.01 * np.random.default_rng(1).standard_normal(steps)
    records = sparsity.sparsity_change(
        _sparsity_frame(rising, rising**4 + noise, (1 - rising) ** 4), 8, 4, 1000, seed=0
    )
    assert records["train_reward_change_low"] > 0  # the training reward rose
    assert records["predicted_degenerate_change"] > 0
    assert records["predicted_degenerate_change_how"].startswith(
        f"{records['predicted_degenerate_change']:+.4f}, "
    )
    assert records["degenerate_change_low"] > 0 and records["degenerate_change_words"] == "supports"
    flat = sparsity.sparsity_change(
        _sparsity_frame(rising, np.full(steps, 0.1) + noise, np.zeros(steps)), 8, 4, 1000, seed=0
    )
    assert flat["degenerate_change_high"] < flat["predicted_degenerate_change"]
    assert flat["degenerate_change_words"] == "contradicts"
    assert flat["degenerate_block_length"] == 2
    low, high = flat["degenerate_change_low"], flat["degenerate_change_high"]
    assert flat["degenerate_change_text"].endswith(f"95% interval [{low:+.3f}, {high:+.3f}]")
    short = sparsity.sparsity_change(
        _sparsity_frame(rising[:3], rising[:3], rising[:3]), 1, 4, 10, 0
    )
    assert short["degenerate_change_low"] is None
    assert short["degenerate_change_text"].endswith("(no interval: a window of one step)")
    assert short["degenerate_change_words"].startswith("can neither")


def test_changed_problems_lists_the_flipped_ones():
    problems = load_gsm8k("test", source="arithmetic", num_examples=4, seed=0)
    golds = [gold_answer(answer) for answer in problems["answer"]]
    before = {"greedy": np.array([0.0, 1.0, 1.0, 0.0]), "completions": ["a", "b", "c", "d"]}
    after = {"greedy": np.array([1.0, 1.0, 0.0, 0.0]), "completions": ["A", "B", "C", "D"]}
    table = run.changed_problems(problems, before, after)
    assert list(table.index) == [0, 2] and table["gold"].tolist() == [golds[0], golds[2]]
    assert table["before"].tolist() == ["a", "c"] and table["after"].tolist() == ["A", "C"]


# --- the small model's samples ------------------------------------------------------------------


def test_sample_summary_and_answer_table():
    rollouts = SimpleNamespace(
        num_generations=2,
        texts=["#### 5", "it is 5", "#### 7", "#### 3 or 4"],
        rewards=torch.tensor([[1.0, 0.0], [1.0, 0.0]]),
        truncated=torch.tensor([False, True, False, False]),
        lengths=torch.tensor([3, 8, 3, 5]),
    )
    summary = run.sample_summary(rollouts, ["5", "7"])
    # Flexible: the last number, 5 5 7 4 against golds 5 5 7 7.
    assert summary == {
        "strict_reward": 0.5,
        "flexible_reward": 0.75,
        "truncated_fraction": 0.25,
        "num_completions": 4,
    }
    table = run.answer_table(rollouts, ["5", "7"])
    assert table["gold"].tolist() == ["5", "5", "7", "7"]
    assert table["strict answer"].fillna("none").tolist() == ["5", "none", "7", "3"]
    assert table["flexible answer"].tolist() == ["5", "5", "7", "4"]
    assert run.flexible_accuracy(["so 12", "#### 13"], ["12", "12"]) == 0.5


# --- figures ---------------------------------------------------------------------------------


def test_figures_have_their_panels():
    frame = run.history_frame(_history([0.1, 0.2, 0.3], [0.0, 0.1, 0.2]))
    frame = frame.fillna(
        {
            "entropy": 1.0,
            "clip_ratio/region_mean": 0.0,
            "grad_norm": 1.0,
            "completions/mean_length": 5.0,
            "completions/max_length": 8.0,
            "completions/clipped_ratio": 0.0,
            "all_wrong": 0.2,
        }
    )
    config = replace(GRPOConfig(), max_completion_length=8)
    assert len(run.plot_learning_curves(frame, 2, config).axes) == 7  # six panels and a twin
    assert len(run.plot_gradient_cosines(np.eye(3)).axes) == 2  # the heatmap and its colorbar
    figure = run.plot_before_after(np.array([0.0, 0.5]), np.array([0.5, 1.0]), 8, seed=0)
    assert figure.axes[0].get_title() == "2 held-out problems, 8 samples each"
    assert isinstance(frame, pd.DataFrame)
