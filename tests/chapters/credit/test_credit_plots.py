"""Chapter 5's figure helpers draw exactly the data they are given."""

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
import pytest
import torch

from grpo_companion.chapters.credit.plots import (
    plot_class_shares,
    plot_estimator_errors,
    plot_rollout_credit,
    plot_toy_token_advantages,
    token_labels,
)
from grpo_companion.chapters.credit.tokens import SHARE_COLUMNS, TOKEN_CLASSES
from grpo_companion.lm.rollouts import Rollouts
from grpo_companion.lm.tiny_llama import build_tokenizer

pytestmark = pytest.mark.usefixtures("close_figures")


def heatmap_data(ax) -> np.ndarray:
    return np.ma.filled(ax.collections[0].get_array(), np.nan)


def test_toy_heatmaps_show_the_shown_rows_on_one_scale():
    coefficients = {
        "outcome": torch.tensor([[0.5, 0.5, 0.5], [-0.5, -0.5, -0.5], [2.0, 2.0, 2.0]]),
        "token": torch.tensor([[0.0, 0.1, 0.4], [0.0, -0.2, -0.3], [9.0, 9.0, 9.0]]),
    }
    sequences = torch.tensor([[0, 1, 1], [1, 0, 1], [1, 1, 1]])
    rewards = torch.tensor([1.0, 0.0, 1.0])
    shown = torch.tensor([1, 0])
    fig = plot_toy_token_advantages(coefficients, sequences, rewards, shown, [1])
    outcome_ax, token_ax = fig.axes[:2]
    assert np.array_equal(heatmap_data(outcome_ax).ravel(), [-0.5, -0.5, -0.5, 0.5, 0.5, 0.5])
    assert np.allclose(heatmap_data(token_ax).ravel(), [0.0, -0.2, -0.3, 0.0, 0.1, 0.4])
    # The colour limit is the largest shown magnitude (not row 2's 9.0), on both panels.
    assert outcome_ax.collections[0].get_clim() == (-0.5, 0.5)
    assert token_ax.collections[0].get_clim() == (-0.5, 0.5)
    assert [label.get_text() for label in outcome_ax.get_xticklabels()] == [
        "0\nfiller",
        "1\nresult",
        "2\nanswer",
    ]
    assert [label.get_text() for label in outcome_ax.get_yticklabels()] == ["0", "1"]


def test_estimator_errors_plot_the_sampled_means_and_variance_over_n():
    sample_sizes = [10, 100]
    errors = {
        "outcome": torch.tensor([[0.2, 0.4], [0.02, 0.04]]),
        "token": torch.tensor([[0.1, 0.1], [0.01, 0.01]]),
    }
    moments = {
        "outcome": (torch.zeros(2), torch.tensor(3.0)),
        "token": (torch.zeros(2), torch.tensor(1.0)),
    }
    ax = plot_estimator_errors(sample_sizes, errors, moments, num_repeats=2).axes[0]
    sampled_outcome, exact_outcome, sampled_token, exact_token = ax.lines
    assert np.allclose(sampled_outcome.get_ydata(), [0.3, 0.03])
    assert np.allclose(exact_outcome.get_ydata(), [0.3, 0.03])
    assert np.allclose(sampled_token.get_ydata(), [0.1, 0.01])
    assert np.allclose(exact_token.get_ydata(), [0.1, 0.01])
    assert exact_outcome.get_color() == sampled_outcome.get_color()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(["12+5=17\n#### 17"])


def test_token_labels_hand_built(tokenizer):
    ids = tokenizer("1\n#", add_special_tokens=False)["input_ids"]
    row = ids + [tokenizer.eos_token_id, tokenizer.pad_token_id]
    mask = torch.tensor([[1] * (len(ids) + 1) + [0]])
    labels = token_labels(tokenizer, torch.tensor([row]), mask)
    assert labels.tolist() == [["1", "⏎", "#", "E", ""]]


def test_rollout_credit_masks_padding_and_separates_groups(tokenizer):
    ids = tokenizer("17", add_special_tokens=False)["input_ids"]
    width = len(ids) + 1
    completion_ids = torch.tensor(
        [ids + [tokenizer.eos_token_id]] * 3 + [ids[:1] + [0] * (width - 1)]
    )
    completion_mask = torch.ones(4, width, dtype=torch.long)
    completion_mask[3, 1:] = 0
    rollouts = Rollouts(
        prompt_ids=torch.zeros(2, 1, dtype=torch.long),
        prompt_mask=torch.ones(2, 1, dtype=torch.long),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        log_probs=None,
        lengths=completion_mask.sum(dim=1),
        truncated=torch.zeros(4, dtype=torch.bool),
        texts=["17"] * 3 + ["1"],
        rewards=torch.tensor([[1.0, 0.0], [1.0, 1.0]]),
        num_generations=2,
        temperature=1.0,
    )
    outcome = torch.full((4, width), 0.5) * completion_mask
    credit = torch.arange(4 * width, dtype=torch.float32).view(4, width) / 100
    fig = plot_rollout_credit(tokenizer, rollouts, outcome, credit, num_resamples=8)
    top, bottom = fig.axes[:2]  # then their colour bars
    data = heatmap_data(bottom).reshape(4, width)
    assert np.isnan(data[3, 1:]).all() and not np.isnan(data[3, 0])
    assert np.allclose(data[:3], credit[:3].numpy())
    assert [label.get_text() for label in top.get_yticklabels()] == ["r=1", "r=0", "r=1", "r=1"]
    assert [line.get_ydata()[0] for line in top.lines] == [2]  # one boundary between 2 groups
    assert "K = 8" in bottom.get_title()


def test_class_share_bars_are_the_table():
    shares = pd.DataFrame(
        {
            column: np.linspace(0.1, 0.5, 5) * (k + 1)
            for k, column in enumerate(SHARE_COLUMNS.values())
        },
        index=pd.Index(TOKEN_CLASSES, name="token class"),
    )
    ax = plot_class_shares(shares).axes[0]
    heights = [patch.get_height() for patch in ax.patches]
    assert np.allclose(heights, shares.to_numpy().T.ravel())
    assert [text.get_text() for text in ax.get_legend().get_texts()] == [
        "tokens",
        r"outcome $A_i^2$",
        r"credit $\delta_t^2$ (noise-corrected)",
    ]
