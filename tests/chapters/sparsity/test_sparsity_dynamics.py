import copy
import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from grpo_companion.chapters.sparsity import dynamics as sd
from grpo_companion.core.stats import interval_words
from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.gsm8k import load_gsm8k

NEITHER = interval_words(None, None, 1.0, "", "")


@pytest.mark.parametrize("num_samples, group_size", [(4, 4), (8, 4), (16, 8)])
@pytest.mark.parametrize("p", [0.0, 0.13, 0.5, 0.91, 1.0])
def test_probe_estimate_of_p_to_the_g_is_unbiased(num_samples, group_size, p):
    """E[C(k, G) / C(K, G)] over k ~ Binomial(K, p) is p^G exactly (enumeration over k)."""
    ks = np.arange(num_samples + 1)
    pmf = stats.binom.pmf(ks, num_samples, p)
    expected = {"all_correct": 0.0, "all_wrong": 0.0}
    for k, weight in zip(ks, pmf):
        prediction = sd.predicted_degenerate([k], num_samples, group_size)
        expected["all_correct"] += weight * prediction["all_correct"]
        expected["all_wrong"] += weight * prediction["all_wrong"]
    assert expected["all_correct"] == pytest.approx(p**group_size, abs=1e-12)
    assert expected["all_wrong"] == pytest.approx((1 - p) ** group_size, abs=1e-12)


def test_plug_in_p_hat_to_the_g_would_be_biased():
    """Why not p_hat^G: with K = 8, p = 0.5, G = 4 its expectation exceeds p^G = 1/16."""
    ks = np.arange(9)
    plug_in = (stats.binom.pmf(ks, 8, 0.5) * (ks / 8) ** 4).sum()
    assert plug_in > 0.0625 + 0.02


def test_prediction_sees_the_jensen_gap():
    """Half the prompts solved, half never: every group degenerate, the i.i.d. rate 1/8."""
    prediction = sd.predicted_degenerate([8, 8, 0, 0], 8, 4)
    assert prediction["degenerate"] == 1.0
    assert prediction["iid_degenerate"] == pytest.approx(0.125)
    assert prediction["share_near_one"] == 0.5


@pytest.mark.parametrize("bad", [[9], [-1]])
def test_prediction_rejects_impossible_counts(bad):
    with pytest.raises(ValueError, match="counts"):
        sd.predicted_degenerate(bad, 8, 4)
    with pytest.raises(ValueError, match="probe_samples"):
        sd.predicted_degenerate([1], 2, 4)


def _history(fractions):
    """A trainer history whose step s has all-correct fraction fractions[s - 1], none all-wrong."""
    return [{"step": 0, "eval_accuracy": 0.5}] + [
        {
            "step": s,
            "all_correct": c,
            "all_wrong": 0.0,
            "frac_reward_zero_std": c,
            "zero_advantage_token_share": c / 2,
            "eval_accuracy": 1 - c if s % 2 == 0 else None,  # measured every other step
        }
        for s, c in enumerate(fractions, start=1)
    ]


def _probe(step, all_correct):
    return {"step": step, "pass_rate": all_correct, "share_near_one": 0.0,
            "all_correct": all_correct, "all_wrong": 0.0, "degenerate": all_correct,
            "iid_degenerate": 0.0}  # fmt: skip


def _tables(slopes, seed=0):
    rng = np.random.default_rng(seed)
    tables = {}
    for run, slope in enumerate(slopes):
        steps = np.arange(0, 50, 10)
        observed = np.clip(0.3 + slope * steps + rng.normal(0, 0.01, steps.size), 0, 1)
        tables[run] = pd.DataFrame({
            "step": steps, "pass_rate": 0.5 + slope * steps, "share_near_one": 0.0,
            "predicted_all_correct": observed, "predicted_all_wrong": 0.0,
            "predicted_degenerate": observed, "iid_degenerate": observed * 0,
            "observed_all_correct": observed, "observed_all_wrong": 0 * observed,
            "observed_degenerate": observed, "observed_zero_advantage_tokens": observed / 2,
            "eval_accuracy": 0.4 - slope * steps, "eval_accuracy_next": 0.3 - slope * steps,
        })  # fmt: skip
    return tables


def has_digit(completion: str, gold: str) -> float:
    return float(any(character.isdigit() for character in completion))


def test_an_interrupted_probed_run_resumes_to_the_same_result(random_tiny, tmp_path):
    model, tokenizer = random_tiny
    train_data = load_gsm8k("train", source="arithmetic", num_examples=6, seed=0)
    eval_data = load_gsm8k("test", source="arithmetic", num_examples=2, seed=0)
    config = GRPOConfig(num_generations=2, per_step_prompts=2, max_completion_length=6,
                        learning_rate=1e-2, max_steps=4, eval_every=100,
                        micro_batch_size=8, rollout_batch_size=8)  # fmt: skip
    kwargs = {"probe_every": 2, "probe_samples": 3, "reward_fn": has_digit}
    whole = sd.probed_run(copy.deepcopy(model), tokenizer, train_data, eval_data, config,
                          checkpoint_dir=tmp_path / "whole", **kwargs)  # fmt: skip
    # Interrupted after the first segment: a run with fewer steps leaves the same checkpoint.
    partial = copy.deepcopy(model)
    first = GRPOConfig(**{**vars(config), "max_steps": 2})
    sd.probed_run(partial, tokenizer, train_data, eval_data, first,
                  checkpoint_dir=tmp_path / "resumed", **kwargs)  # fmt: skip
    probes = json.loads((tmp_path / "resumed" / sd.PROBES).read_text())
    assert [probe["step"] for probe in probes] == [0, 2]
    resumed = sd.probed_run(copy.deepcopy(model), tokenizer, train_data, eval_data, config,
                            checkpoint_dir=tmp_path / "resumed", **kwargs)  # fmt: skip
    assert resumed[1] == whole[1]
    assert [probe["step"] for probe in whole[1]] == [0, 2, 4]
    assert [r["reward"] for r in resumed[0]] == [r["reward"] for r in whole[0]]
    assert all(math.isfinite(p["pass_rate"]) for p in whole[1])
    for probe in whole[1]:  # every completion's outcome kept, and the counts are their sums
        assert [len(row) for row in probe["outcomes"]] == [3] * len(train_data)
        assert [sum(row) for row in probe["outcomes"]] == probe["correct"]


def test_split_half_classifies_on_one_half_and_measures_on_the_other():
    # Prompt 0: classified low on (0, 0, 0, 0), measured on (1, 1, 1, 1) then (0, 0, 0, 0).
    # Prompt 1: classified high on (1, 1, 1, 1), measured on all correct both times.
    # Prompt 2: a tie (1, 1, 0, 0): left out of both sides.
    first = [[0, 0, 0, 0, 1, 1, 1, 1], [1] * 8, [1, 1, 0, 0, 0, 0, 0, 0]]
    last = [[0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    split = sd.split_half_change(first, last, group_size=4)
    assert split["group_size"] == 4
    assert (split["low_prompts"], split["high_prompts"]) == (1, 1)
    assert split["low_change"] == 0.0  # all correct -> all wrong: degenerate both times
    assert split["high_change"] == 0.0
    assert split["low_pass_rate_change"] == -1.0 and split["high_pass_rate_change"] == 0.0
    # criterion: f'(0) (0 - 1) for prompt 0, f'(1/2) = 0 for prompt 2, nothing moves for 1.
    assert split["criterion"] == pytest.approx(4 / 3)
    # Too few samples in a half for G = 4: the estimate falls back to the half's size, 2.
    short = sd.split_half_change([[0, 0, 1, 1]], [[1, 0, 1, 0]], group_size=4)
    assert short["group_size"] == 2 and short["low_prompts"] == 1
    # measured on (1, 1): degenerate at G = 2; last (1, 0, 1, 0): 1/6 + 1/6 of pairs agree.
    assert short["low_change"] == pytest.approx(1 / 3 - 1)
