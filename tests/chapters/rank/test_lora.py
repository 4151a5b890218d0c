"""Chapter 7, section 10: LoRA under the book's GRPO trainer, and the spectra of the accumulated
update. A LoRA model's step is the same GRPO step (its adapter gradients are the chain rule of
the merged model's gradient on the same rollouts); the measures of related work give known
numbers on matrices built to have them; the comparison's bookkeeping is checked on hand-made
results; a whole (tiny) run of every arm goes through `practice_runs`."""

import copy
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from matplotlib import pyplot as plt
from scipy import stats

from grpo_companion.chapters.rank import accumulated, lora, plots
from grpo_companion.core.stats import mean_interval
from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.gsm8k import build_prompts, load_gsm8k
from grpo_companion.lm.trainer import grpo_step, reference_and_optimizer

CONFIG = GRPOConfig(
    num_generations=4,
    per_step_prompts=2,
    max_completion_length=6,
    learning_rate=1e-2,
    max_steps=2,
    micro_batch_size=8,
    rollout_batch_size=8,
    max_grad_norm=math.inf,  # no clipping: the two models' gradients have different norms
)


def has_digit(completion: str, gold: str) -> float:
    """1 for a completion with a digit in it: about half of the random model's completions."""
    return float(any(character.isdigit() for character in completion))


@pytest.fixture(scope="module")
def data():
    return (
        load_gsm8k("train", source="arithmetic", num_examples=8, seed=0),
        load_gsm8k("test", source="arithmetic", num_examples=2, seed=0),
    )


def _gradient_step(model, tokenizer, data, config=CONFIG):
    """One `grpo_step` at step 1 with a zero learning rate: the record, and `.grad` left set."""
    prompts, golds = build_prompts(tokenizer, data[0])
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    model.eval()
    return grpo_step(model, tokenizer, None, optimizer, prompts, golds, config, 1, has_digit)


def test_lora_gradients_are_the_chain_rule_of_the_merged_models_step(random_tiny, data):
    """With B != 0 (as after some training), the trainer's gradients of every adapter are
    s B^T G and s G A^T, G the gradient the same `grpo_step` gives the merged model, on the
    same rollouts (float64: sampling sees the same probabilities to rounding)."""
    base, tokenizer = random_tiny
    model = lora.add_adapters(copy.deepcopy(base).double(), rank=2, alpha=4.0, seed=3)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    merged = copy.deepcopy(model).merge_and_unload().requires_grad_(True)  # W' = W + s B A
    record = _gradient_step(model, tokenizer, data)
    merged_record = _gradient_step(merged, tokenizer, data)
    assert record["reward"] == merged_record["reward"]  # the same rollouts
    assert 0 < record["reward"] < 1 and record["frac_reward_zero_std"] < 1  # a real gradient
    merged_parameters = dict(merged.named_parameters())
    modules = dict(model.named_modules())
    scalings = []
    for name, module in modules.items():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        weight_name = name.removeprefix("base_model.model.") + ".weight"
        expected = lora.lora_chain_rule(
            merged_parameters[weight_name].grad,
            module.lora_A["default"].weight,
            module.lora_B["default"].weight,
            module.scaling["default"],
        )
        torch.testing.assert_close(module.lora_A["default"].weight.grad, expected["A"])
        torch.testing.assert_close(module.lora_B["default"].weight.grad, expected["B"])
        assert module.base_layer.weight.grad is None  # frozen
        scalings.append(module.scaling["default"])
    assert scalings == [2.0] * 2 * len(accumulated.LAYER_TYPES)  # alpha / r; 2 layers x 7


def test_a_lora_model_starts_as_the_base_model_and_its_first_step_moves_only_b(random_tiny, data):
    base, tokenizer = random_tiny
    before = copy.deepcopy(base)
    model = lora.add_adapters(copy.deepcopy(base), rank=1, alpha=8.0, seed=0)
    ids = torch.arange(1, 9)[None]
    torch.testing.assert_close(model(input_ids=ids).logits, before(input_ids=ids).logits)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    reference, optimizer = reference_and_optimizer(model, CONFIG)
    prompts, golds = build_prompts(tokenizer, data[0])
    grpo_step(model, tokenizer, reference, optimizer, prompts, golds, CONFIG, 1, has_digit)
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, start[name])}
    # B = 0 makes dL/dA = s B^T G = 0, and AdamW leaves a parameter with a zero gradient alone.
    assert moved and all("lora_B" in name for name in moved)
    assert len(moved) == 2 * len(accumulated.LAYER_TYPES)
    assert all("lora" in name for name, p in model.named_parameters() if p.requires_grad)


def test_lora_chain_rule_is_autograd_of_the_merged_weight():
    generator = torch.Generator().manual_seed(0)
    w, a, b, c = (torch.randn(*shape, generator=generator, dtype=torch.float64)
                  for shape in [(5, 4), (2, 4), (5, 2), (5, 4)])  # fmt: skip
    a.requires_grad_(True)
    b.requires_grad_(True)
    merged = w + 3.0 * b @ a
    (merged * c).sum().backward()  # dL/dW' = c
    expected = lora.lora_chain_rule(c, a.detach(), b.detach(), 3.0)
    torch.testing.assert_close(a.grad, expected["A"])
    torch.testing.assert_close(b.grad, expected["B"])


def test_top_share_and_the_spectrum_measures():
    values = torch.tensor([3.0, 4.0, 0.0], dtype=torch.float64)
    assert accumulated.top_share(values).item() == pytest.approx(16 / 25)
    assert accumulated.top_share(values, 2).item() == pytest.approx(1.0)
    assert accumulated.top_share(torch.zeros(3)).item() == 0.0
    measures = accumulated.spectrum_measures(values)
    assert measures["stable"] == pytest.approx(25 / 16)  # 1 / top share
    assert measures["top_share"] == pytest.approx(1 / measures["stable"])
    p = np.array([4, 3]) / 7  # the entropy effective rank of (4, 3)
    assert measures["entropy"] == pytest.approx(np.exp(-(p * np.log(p)).sum()))


def test_numerical_rank_fraction_counts_the_directions_of_a_float32_update():
    generator = torch.Generator().manual_seed(0)
    low_rank = torch.randn(256, 3, generator=generator) @ torch.randn(3, 128, generator=generator)
    values = torch.linalg.svdvals(low_rank.double()).numpy()
    assert accumulated.numerical_rank_fraction(values, (256, 128)) == 3 / 128
    dense = torch.linalg.svdvals(torch.randn(256, 128, generator=generator).double()).numpy()
    assert accumulated.numerical_rank_fraction(dense, (256, 128)) == 1.0
    assert accumulated.numerical_rank_fraction(np.zeros(4), (4, 4)) == 0.0


def test_changed_fraction_in_float32_and_after_bfloat16_rounding():
    start = {"w": torch.ones(10), "b": torch.full((10,), 2.0)}
    end = {"w": start["w"].clone(), "b": start["b"].clone()}
    end["w"][:4] += 1e-4  # below half of bfloat16's 2^-7 spacing at 1: rounds back to 1
    end["w"][4:6] += 0.25  # survives
    end["b"][:1] -= 0.5
    assert accumulated.changed_fraction(start, end) == 7 / 20
    assert accumulated.changed_fraction(start, end, torch.bfloat16) == 3 / 20


def test_truncated_weights_keep_the_top_directions_of_the_update():
    generator = torch.Generator().manual_seed(1)
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=generator, dtype=torch.float64))
    r, _ = torch.linalg.qr(torch.randn(4, 4, generator=generator, dtype=torch.float64))
    start = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    top, second = 3.0 * torch.outer(q[:, 0], r[:, 0]), 1.0 * torch.outer(q[:, 1], r[:, 1])
    final = {"w": start + top + second}
    torch.testing.assert_close(accumulated.truncated_weights({"w": start}, final, 1)["w"],
                               start + top)  # fmt: skip
    torch.testing.assert_close(accumulated.truncated_weights({"w": start}, final, 2)["w"],
                               final["w"])  # fmt: skip


def test_truncation_records_share_of_the_gain_only_when_full_fine_tuning_learned():
    runs = {s: {"accuracy": a, "truncated_accuracy": {1: b}}
            for s, (a, b) in enumerate([(0.5, 0.45), (0.6, 0.5), (0.55, 0.5)])}  # fmt: skip
    records = accumulated.truncation_records(runs, [1], initial_accuracy=0.4)
    assert records["accumulated_rank1_minus_full"] == pytest.approx(-0.2 / 3)
    assert records["accumulated_rank1_minus_full_low"] == pytest.approx(
        mean_interval([-0.05, -0.1, -0.05])["low"]
    )
    assert records["accumulated_rank1_recovered"] == pytest.approx((1.45 / 3 - 0.4) / 0.15)
    flat = accumulated.truncation_records(runs, [1], initial_accuracy=0.55)  # gain 0 +- 0.12
    assert flat["accumulated_rank1_recovered"] is None


def test_seeds_for_margin_is_the_smallest_n_with_the_power():
    n = lora.seeds_for_margin(0.05, 0.04)

    def half_width(k):  # of the interval at the power quantile
        return (stats.t.ppf(0.975, k - 1) + stats.t.ppf(0.8, k - 1)) * 0.05 / np.sqrt(k)

    assert half_width(n) <= 0.04 < half_width(n - 1)
    # the normal approximation ((1.96 + 0.84) sd / margin)^2 = 12.3 is a little low for small n
    assert 13 <= n <= 16
    assert lora.seeds_for_margin(0.0, 0.04) == 0
    assert lora.seeds_for_margin(0.05, 0.0) is None
    assert lora.seeds_for_margin(float("nan"), 0.04) is None


def test_margin_words_follow_the_ledgers_rule():
    """Margin 0.04: the decision point is -0.02, half way to the rank model's -0.04."""
    words = lora.MARGIN_WORDS
    assert lora.margin_words(-0.01, 0.02, 0.04, 0.03, True) == words["reaches"]
    assert lora.margin_words(-0.015, -0.005, 0.04, 0.03, True) == words["short"]
    assert lora.margin_words(-0.06, 0.04, 0.04, 0.03, True) == words["wide"]
    assert lora.margin_words(-0.11, -0.05, 0.04, 0.03, True) == words["below"]
    assert lora.margin_words(-0.03, -0.021, 0.04, 0.03, True) == words["below"]
    assert lora.margin_words(None, None, 0.04, 0.03, True) == words["none"]
    assert lora.margin_words(-0.01, 0.02, 0.04, -0.01, True) == words["no learning"]
    assert lora.margin_words(-0.01, 0.02, 0.0, 0.03, True) == words["no margin"]
    # the regime gate comes first, as in the ledger: an optimum at a grid's edge decides nothing
    assert lora.margin_words(-0.01, 0.02, 0.04, 0.03, False) == words["edge"]
    assert lora.margin_words(-0.01, 0.02, 0.04, -0.01, False) == words["edge"]


def test_predicted_difference():
    assert lora.predicted_difference(0.75, 0.2) == pytest.approx(-0.05)
    assert lora.predicted_difference(1.0, 0.2) == 0.0
    assert lora.predicted_difference(0.75, -0.02) == 0.0  # full fine-tuning lost: nothing to lose


def _result(accuracy):
    return {"accuracy": accuracy}


def test_tuning_choice_takes_the_best_mean_and_says_whether_it_is_inside():
    grids = {"full": [1e-5, 1e-4, 1e-3], "r1": [1e-4, 1e-3, 1e-2]}
    results = {
        ("full", 1e-5, 0): _result(0.1), ("full", 1e-5, 1): _result(0.2),
        ("full", 1e-4, 0): _result(0.3), ("full", 1e-4, 1): _result(0.2),
        ("full", 1e-3, 0): _result(0.0), ("full", 1e-3, 1): _result(0.1),
        ("r1", 1e-4, 0): _result(0.1), ("r1", 1e-4, 1): _result(0.1),
        ("r1", 1e-3, 0): _result(0.2), ("r1", 1e-3, 1): _result(0.2),
        ("r1", 1e-2, 0): _result(0.3), ("r1", 1e-2, 1): _result(0.3),
    }  # fmt: skip
    choice = lora.tuning_choice(results, grids)
    assert choice["full"]["learning_rate"] == 1e-4 and choice["full"]["inside"]
    assert choice["full"]["means"] == pytest.approx([0.15, 0.25, 0.05])
    assert choice["r1"]["index"] == 2 and not choice["r1"]["inside"]  # at the edge
    tied = {key: _result(0.2) for key in results}
    assert lora.tuning_choice(tied, grids)["full"]["index"] == 0  # the lowest rate wins a tie


def test_comparison_records_pair_the_arms_by_seed():
    full, adapter = [0.30, 0.34, 0.28, 0.33], [0.31, 0.30, 0.29, 0.35]
    results = {("full", 1e-4, s): _result(a) for s, a in enumerate(full)}
    results |= {("r2", 1e-3, s): _result(a) for s, a in enumerate(adapter)}
    records, table = lora.comparison_records(results, ["full", "r2"], 0.25, {"r2": 0.75})
    differences = np.subtract(adapter, full)
    expected = mean_interval(differences)
    assert records["lora_r2_minus_full"] == pytest.approx(expected["mean"])
    assert records["lora_r2_minus_full_low"] == pytest.approx(expected["low"])
    assert records["lora_r2_minus_full_sd"] == pytest.approx(np.std(differences, ddof=1))
    assert records["lora_full_gain"] == pytest.approx(np.mean(full) - 0.25)
    # the rank model from the measured gain: -(1 - c_2) D, the decision point half way to 0
    predicted = -(1 - 0.75) * (np.mean(full) - 0.25)
    assert records["predicted_lora_r2_minus_full"] == pytest.approx(predicted)
    assert records["lora_r2_margin"] == pytest.approx(-predicted)
    assert records["lora_r2_decision_point"] == pytest.approx(predicted / 2)
    assert records["lora_seeds_run"] == 4
    needed = records["lora_seeds_needed_r2"]
    assert needed == lora.seeds_for_margin(np.std(differences, ddof=1), -predicted / 2)
    assert records["lora_r2_minus_full_words"] == lora.reading_words(
        expected["low"], expected["high"], -predicted
    )
    assert list(table.index) == ["full", "r2"]
    assert table.loc["r2", "predicted"] == pytest.approx(predicted)
    fell = {key: _result(0.2) for key in results if key[0] == "full"} | {
        key: value for key, value in results.items() if key[0] == "r2"
    }
    records, _ = lora.comparison_records(fell, ["full", "r2"], 0.25, {"r2": 0.75})
    assert records["lora_r2_margin"] == 0.0  # full fine-tuning lost: nothing to lose
    assert records["lora_r2_minus_full_words"] == lora.MARGIN_WORDS["no margin"]


def test_practice_runs_train_every_arm_and_track_full_fine_tuning(random_tiny, data):
    """Two steps of each arm through the one-thread path of `map_runs`; the LoRA arm trains
    1088 r parameters (2 layers of hidden 32 and MLP 64: r (4 (32 + 32) + 2 (32 + 64) + 96))."""
    base, tokenizer = random_tiny
    grpo = {"num_generations": 4, "per_step_prompts": 2, "max_completion_length": 6,
            "max_steps": 2, "micro_batch_size": 8, "rollout_batch_size": 8}  # fmt: skip
    runs = {("full", 1e-5, 0): (0, 1e-5, 0), ("r2", 1e-2, 0): (2, 1e-2, 0)}
    results = lora.practice_runs(
        lambda: copy.deepcopy(base), tokenizer, *data, grpo, runs, lora_alpha=4.0,
        track_every=1, truncation_ranks=(1,), reward_fn=has_digit, workers=1,
    )  # fmt: skip
    full, adapter = results[("full", 1e-5, 0)], results[("r2", 1e-2, 0)]
    assert adapter["parameters"] == 1088 * 2 and "spectra" not in adapter
    assert full["parameters"] == sum(p.numel() for p in base.parameters())
    assert [row["step"] for row in full["history"]] == [1, 2]
    assert len(full["spectra"]) == 2 * 14 * 2  # steps x matrices x (gradient, accumulated)
    first = [row for row in full["spectra"] if row["step"] == 1]
    # AdamW moves every entry with a gradient by about the learning rate, 1e-5: float32 keeps
    # nearly all of those moves, bfloat16 (about 3 significant digits) rounds most away
    assert full["changed"]["float32"] > 0.9 and full["changed"]["bfloat16"] < 0.5
    assert set(full["truncated_accuracy"]) == {1} and 0 <= full["truncated_accuracy"][1] <= 1
    frame = accumulated.spectra_frame([{**row, "seed": 0} for row in full["spectra"]])
    assert set(frame["kind"]) == {"gradient", "accumulated"}
    assert (frame["top_share"].between(0, 1) & (frame["stable"] >= 1 - 1e-9)).all()
    assert {row["layer"] for row in first} == {0, 1}
    spectrum = accumulated.mean_normalised_spectrum(full["spectra"], "accumulated", "q_proj", 2, 8)
    assert spectrum[0] == 1.0 and (np.diff(spectrum) <= 1e-12).all()
    for figure in (
        plots.plot_accumulated_update(
            frame, {"accumulated": spectrum, "gradient": spectrum}, "q_proj"
        ),
    ):
        assert len(figure.axes) == 3 and len(figure.legends) == 1
        plt.close(figure)


def test_step_gradient_spectra_leave_the_model_unchanged(random_tiny, data):
    base, tokenizer = random_tiny
    model = copy.deepcopy(base)
    rows = lora.step_gradient_spectra(model, tokenizer, data[0], replace(CONFIG), [1, 2],
                                      reward_fn=has_digit)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), base.parameters()))
    assert len(rows) == 2 * 14 and {row["kind"] for row in rows} == {"gradient"}
    shares = lora.mean_top_shares(rows, [1, 2, 8])
    assert 0 < shares[1] < shares[2] < shares[8] <= 1
    with pytest.raises(ValueError, match="beta"):
        lora.step_gradient_spectra(model, tokenizer, data[0], replace(CONFIG, beta=0.1), [1])


def test_the_comparison_figure_keeps_its_legend_outside_the_panels():
    choice = {"full": {"means": [0.1, 0.3, 0.2], "index": 1},
              "r1": {"means": [0.1, 0.2, 0.25], "index": 2}}  # fmt: skip
    grids = {"full": [1e-5, 1e-4, 1e-3], "r1": [1e-4, 1e-3, 1e-2]}
    results = {("full", 1e-4, s): _result(a) for s, a in enumerate([0.3, 0.32])}
    results |= {("r1", 1e-2, s): _result(a) for s, a in enumerate([0.28, 0.33])}
    _, table = lora.comparison_records(results, ["full", "r1"], 0.2, {"r1": 0.9})
    figure = plots.plot_lora_comparison(choice, table, grids, start=0.2)
    assert len(figure.axes) == 3 and len(figure.legends) == 1
    legend = figure.legends[0].get_window_extent(figure.canvas.get_renderer())
    rightmost = max(ax.get_window_extent().x1 for ax in figure.axes)
    assert legend.x0 >= rightmost
    plt.close(figure)


def test_the_update_figure_draws_a_run_without_tracked_ranks_without_a_warning():
    """A run too short to track a step has no positive rank: the axis stays linear instead of
    warning (a warning would print the package's path on the page)."""
    import warnings

    import matplotlib.pyplot as plt
    import numpy as np
    import pandas as pd

    frame = pd.DataFrame(
        {"layer_type": ["q_proj"] * 2, "kind": ["accumulated", "gradient"], "step": [1, 1],
         "stable": [np.nan, np.nan], "entropy": [np.nan, np.nan], "top_share": [np.nan, np.nan]}
    )  # fmt: skip
    spectra = {"accumulated": np.array([1.0, 0.5]), "gradient": np.array([1.0, 0.2])}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = plots.plot_accumulated_update(frame, spectra, "q_proj")
    assert fig.axes[1].get_yscale() == "linear"
    plt.close(fig)


def test_practice_runs_keep_finished_runs(random_tiny, data, tmp_path, monkeypatch):
    """With `keep`, a second call with the same inputs reads the runs back instead of training."""
    base, tokenizer = random_tiny
    grpo = {"num_generations": 4, "per_step_prompts": 2, "max_completion_length": 6,
            "max_steps": 1, "micro_batch_size": 8, "rollout_batch_size": 8}  # fmt: skip
    runs = {("r2", 1e-2, 0): (2, 1e-2, 0)}

    def call():
        return lora.practice_runs(lambda: copy.deepcopy(base), tokenizer, *data, grpo, runs,
                                  lora_alpha=4.0, reward_fn=has_digit, workers=1,
                                  keep=tmp_path)  # fmt: skip

    first = call()

    def no_training(*args, **kwargs):
        raise AssertionError("a kept run was trained again")

    monkeypatch.setattr(lora, "grpo_run", no_training)
    again = call()
    assert again[("r2", 1e-2, 0)]["history"] == first[("r2", 1e-2, 0)]["history"]
