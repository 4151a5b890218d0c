"""chapters/sparsity/micro.py: the start's exact shares, and the flow's prediction in and out of
the claim's regime."""

import numpy as np
import pytest
import torch

from grpo_companion.chapters.sparsity import micro as sparsity_micro


def test_start_shares_are_the_exact_group_probabilities():
    rates = torch.tensor([0.9, 0.5, 0.1])
    shares = sparsity_micro.start_shares(rates, 4)
    assert shares["all_correct"] == pytest.approx(np.mean([0.9**4, 0.5**4, 0.1**4]))
    assert shares["all_wrong"] == pytest.approx(np.mean([0.1**4, 0.5**4, 0.9**4]))
    assert shares["degenerate"] == pytest.approx(shares["all_correct"] + shares["all_wrong"])


def test_the_flow_predicts_a_rise_above_one_half_and_a_fall_below():
    high = np.linspace(0.6, 0.95, 50)
    low = np.linspace(0.05, 0.4, 50)
    options = {"step_size": 0.05, "max_steps": 10_000}
    rise = sparsity_micro.flow_prediction(high, 4, 0.03, [0.0, 1.0], **options)
    fall = sparsity_micro.flow_prediction(low, 4, 0.03, [0.0, 1.0], **options)
    assert rise["degenerate"] > 0 and fall["degenerate"] < 0
    assert rise["target"] == pytest.approx(high.mean() + 0.03)
    assert min(rise["by_sharing"].values(), key=abs) == rise["degenerate"]
    assert sparsity_micro.flow_prediction(high, 4, 0.0, [0.0], **options)["degenerate"] == 0.0
