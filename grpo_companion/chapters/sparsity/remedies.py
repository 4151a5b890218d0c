"""Chapter 6, section 4: Sign against Dr. GRPO, trained over seeds on the tiny Llama.

`histories` is a dict (method, seed) -> `trainer.train` history, every method run on the same
seeds, so differences between methods are paired, and the runs, not the steps, are the
independent units (every interval is a Student-t interval over seeds, `core.stats`). Each
method's learning rate is tuned on validation problems first (`tuned_remedy_runs`); the
prediction a run is judged against is `predicted_difference`.
"""

import numpy as np
import pandas as pd

from grpo_companion.chapters.sparsity.rate import (
    beta_concentration_for,
    iid_degenerate_rate,
)
from grpo_companion.core.exact import best_step_error, beta_quadrature
from grpo_companion.core.stats import (
    accuracy_noise,
    choice_records,
    grid_choice,
    interval_words,
    metric_by_step,
    seed_band,
    seeds_for_power,
)
from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.evaluation import sampled_held_out_accuracy
from grpo_companion.lm.parallel import map_runs, run_store
from grpo_companion.lm.trainer import train


def remedy_runs(load_model, tokenizer, train_data, eval_data, grpo: dict, methods: dict, seeds, *,
                initial_accuracy: float, eval_samples: int = 0, sample_seed: int = 0,
                workers: int | None = None, keep: str | None = None) -> dict:  # fmt: skip
    """(method, seed) -> `trainer.train` history of every method (name -> GRPOConfig overrides)
    on every seed, each from a fresh `load_model()` copy, in one-thread workers
    (`lm.parallel.map_runs`: the same histories as one run after another). `eval_samples` K > 0
    adds the sampled accuracy on `eval_data` (`evaluation.sampled_held_out_accuracy`, K completions
    a problem) as "sampled_accuracy", the warm start's to the first record and the trained
    model's to the last, both drawn with the sampling seed `sample_seed` + the run's seed: the
    methods of a seed share the sampler's seed, and the seeds differ, so the sampling noise of
    the measure lands in the interval over seeds.
    `keep`: a folder under which finished runs are stored and read back on the next call
    (`lm.parallel.run_store`, named by every input here and the starting weights).
    """
    config = GRPOConfig(**grpo)
    seeds = list(seeds)
    store = None
    if keep is not None:
        store = run_store(keep, grpo, methods, seeds, train_data, eval_data, initial_accuracy,
                          eval_samples, sample_seed, load_model())  # fmt: skip

    def sampled(model, seed: int) -> float:
        return sampled_held_out_accuracy(model, tokenizer, eval_data, config, eval_samples,
                                         sample_seed + seed)  # fmt: skip

    start = (map_runs(lambda seed: sampled(load_model(), seed), seeds, workers=workers,
                      keep=store) if eval_samples else {})  # fmt: skip

    def run(key):
        name, seed = key
        config = GRPOConfig(**{**grpo, **methods[name]}, seed=seed)
        model = load_model()
        history = train(model, tokenizer, train_data, eval_data, config, progress=False,
                        initial_accuracy=initial_accuracy)  # fmt: skip
        if eval_samples:
            history[0]["sampled_accuracy"] = start[seed]
            history[-1]["sampled_accuracy"] = sampled(model, seed)
        return history

    keys = [(name, seed) for name in methods for seed in seeds]
    return map_runs(run, keys, workers=workers, keep=store)


def tuned_remedy_runs(load_model, tokenizer, train_data, validation_data, test_data, grpo: dict,
                      methods: dict, learning_rates, tune_seeds, eval_seeds, *,
                      initial_validation: float, initial_test: float, eval_samples: int = 0,
                      sample_seed: int = 0, keep: str | None = None) -> tuple:  # fmt: skip
    """Each method at its own tuned learning rate, then compared on other seeds.

    Tuning: every method at every rate of `learning_rates` on `tune_seeds`, held-out accuracy on
    `validation_data` (problems no run trains on); each method takes the rate with the highest
    mean final validation accuracy (`core.stats.grid_choice`). Comparison: every method at its
    rate on `eval_seeds` (paired: the same prompts in the same order), evaluated on `test_data`
    by greedy accuracy and, with `eval_samples` K > 0, sampled accuracy (`remedy_runs`, which
    also stores finished runs under `keep`).
    Returns (histories of the comparison, as `remedy_runs`; choice: method -> {"learning_rate",
    "index", "inside", "learned", "means": the mean final validation accuracy at each rate};
    the tuning runs at each method's chosen rate, (method, seed) -> history, from which the
    prediction is made before the comparison runs).
    """
    grid = {(name, rate): {**methods[name], "learning_rate": rate}
            for name in methods for rate in learning_rates}  # fmt: skip
    tuning = remedy_runs(load_model, tokenizer, train_data, validation_data, grpo, grid, tune_seeds,
                         initial_accuracy=initial_validation, keep=keep)  # fmt: skip
    choice = {}
    for name in methods:
        means = [float(np.mean([h[-1]["eval_accuracy"] for (arm, _), h in tuning.items()
                                if arm == (name, rate)])) for rate in learning_rates]  # fmt: skip
        choice[name] = grid_choice(
            list(learning_rates),
            means,
            start=initial_validation,
            margin=accuracy_noise(initial_validation, len(validation_data)),
        )
    chosen = {name: {**methods[name], "learning_rate": choice[name]["learning_rate"]}
              for name in methods}  # fmt: skip
    histories = remedy_runs(load_model, tokenizer, train_data, test_data, grpo, chosen, eval_seeds,
                            initial_accuracy=initial_test, eval_samples=eval_samples,
                            sample_seed=sample_seed, keep=keep)  # fmt: skip
    tuned = {(name, seed): history for ((name, rate), seed), history in tuning.items()
             if rate == choice[name]["learning_rate"]}  # fmt: skip
    return histories, choice, tuned


def tuning_records(choice: dict, methods: dict, reference: str) -> dict:
    """The records of `tuned_remedy_runs`' choice: "<m>_learning_rate", "<m>_lr_inside" (1 or
    0) and "<m>_tune_learned" (1 when its best rate raised validation accuracy above the start
    by more than two binomial standard errors, None when unmeasured) per method;
    "remedy_lr_inside", 1 when every method's optimum lies inside the grid; and "<m>_same_loss",
    1 when a method's overrides (`methods`: name -> GRPOConfig fields) differ
    from the `reference`'s only in the advantage (`method`) and `filter_degenerate`: the same
    loss aggregation, so the comparison changes one thing."""
    records = choice_records(choice, "", "remedy_lr_inside")
    varied = ("method", "filter_degenerate", "learning_rate")
    base = {k: v for k, v in methods[reference].items() if k not in varied}
    for name, overrides in methods.items():
        same = {k: v for k, v in overrides.items() if k not in varied} == base
        records[f"{name}_same_loss"] = int(same)
    return records


def tuning_gain(tuned: dict, method: str, initial_accuracy: float) -> float:
    """`method`'s mean gain in validation accuracy over its tuning runs at its chosen rate
    (`tuned_remedy_runs`' third result), from `initial_accuracy`: the scale of the prediction,
    fixed before the comparison runs."""
    return float(np.mean([h[-1]["eval_accuracy"] - initial_accuracy
                          for (name, _), h in tuned.items() if name == method]))  # fmt: skip


def paired_differences(histories: dict, method: str, reference: str) -> np.ndarray:
    """Per seed, `method`'s final held-out accuracy minus `reference`'s, (num_seeds,)."""
    final = {
        name: runs_of(histories, name, "eval_accuracy")[1][:, -1] for name in (method, reference)
    }
    return final[method] - final[reference]


def power_records(histories: dict, methods, reference: str, predicted: dict, num_pilot: int):
    """Power before seeds for each method's paired difference from `reference`: "<m>_pilot_sd"
    (SD of the first `num_pilot` seeds' differences), "<m>_seeds_needed" for 80% power at the
    predicted difference (`core.stats.seeds_for_power`; None when the prediction is 0, an effect no
    number of seeds can size), "<m>_seeds_run" and "<m>_power_words", the sentence."""
    records = {}
    for name in [name for name in methods if name != reference]:
        differences = paired_differences(histories, name, reference)
        sd = float(np.std(differences[:num_pilot], ddof=1))
        effect = predicted[name]
        sizable = np.isfinite(sd) and sd > 1e-12 and np.isfinite(effect) and effect != 0
        needed = seeds_for_power(sd, effect) if sizable else None
        records[f"{name}_pilot_sd"] = sd
        records[f"{name}_seeds_needed"] = needed
        records[f"{name}_seeds_run"] = len(differences)
        if needed:
            words = (f"needs {needed} seeds for 80% power at the predicted difference of "
                     f"{effect:+.3f} (normal approximation; a t interval needs a seed or two "
                     f"more), against the {len(differences)} run")  # fmt: skip
        elif not (np.isfinite(effect) and effect != 0):
            words = (
                "cannot be sized: the predicted difference is 0 (the exact model predicts no "
                "difference, or the reference arm gained nothing for it to scale)"
            )
        else:
            words = "cannot be sized: the pilot's differences have no spread"
        records[f"{name}_power_words"] = words
    return records


def runs_of(histories: dict, method: str, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values (num_seeds, num_steps)) of `metric` over the runs of `method`.

    histories: (method, seed) -> `trainer.train` history, seeds in the order the runs were made.
    """
    return metric_by_step([h for (name, _), h in histories.items() if name == method], metric)


def smoothed(values, window: int) -> np.ndarray:
    """Each run's moving average over `window` steps, (num_runs, num_steps): one step has only
    `per_step_prompts` groups, so its fractions move in large jumps."""
    return pd.DataFrame(np.asarray(values).T).rolling(window, min_periods=1).mean().to_numpy().T


def remedy_summary(histories: dict, methods, reference: str, predicted: dict,
                   names: dict) -> tuple[dict, pd.DataFrame]:  # fmt: skip
    """Final held-out accuracy of each method over seeds, and its difference from the reference's.

    histories: (method, seed) -> `trainer.train` history; every method run on the same seeds, so
    the differences are paired. reference: the arm the others are compared with; predicted:
    method -> its predicted difference from the reference (`predicted_difference`); names:
    method -> its name in the text. Returns records "initial_accuracy" (mean over all runs of the
    first evaluation); per method "<m>_final_accuracy{,_low,_high}" (mean and 95% interval over
    seeds), "<m>_accuracy_gain{,_low,_high}" (final minus first evaluation) and
    "<m>_degenerate_rate" (over all steps); per other method "<m>_minus_<reference>{,_low,_high}"
    and "<m>_versus_<reference>" (`core.stats.interval_words` against the prediction); and a
    table by method. Where the runs measured sampled accuracy (`remedy_runs`' eval_samples), the
    same for it: "<m>_sampled_gain{,_low,_high}" and "<m>_minus_<reference>_sampled{,_low,_high}".
    """
    records = {"initial_accuracy": np.mean([h[0]["eval_accuracy"] for h in histories.values()])}
    rows = []
    for name in methods:
        _, accuracy = runs_of(histories, name, "eval_accuracy")
        _, zero_std = runs_of(histories, name, "frac_reward_zero_std")
        final = seed_band(accuracy[:, -1:])
        gain = seed_band(accuracy[:, -1:] - accuracy[:, :1])
        for key, suffix in (("mean", ""), ("low", "_low"), ("high", "_high")):
            records[f"{name}_final_accuracy{suffix}"] = final[key][0]
            records[f"{name}_accuracy_gain{suffix}"] = gain[key][0]
        records[f"{name}_degenerate_rate"] = zero_std.mean()
        rows.append(
            {
                "method": name,
                "final accuracy": final["mean"][0],
                "95% low": final["low"][0],
                "95% high": final["high"][0],
                "gain over the warm start": gain["mean"][0],
                "degenerate rate (all steps)": zero_std.mean(),
            }
        )
    _, reference_accuracy = runs_of(histories, reference, "eval_accuracy")
    for name in [name for name in methods if name != reference]:
        _, accuracy = runs_of(histories, name, "eval_accuracy")
        difference = seed_band(accuracy[:, -1:] - reference_accuracy[:, -1:])
        key = f"{name}_minus_{reference}"
        records[key] = difference["mean"][0]
        records[f"{key}_low"] = difference["low"][0]
        records[f"{key}_high"] = difference["high"][0]
        records[f"{name}_versus_{reference}"] = interval_words(
            difference["low"][0], difference["high"][0], predicted[name],
            supports=f"lies above 0, on the predicted side of {names[reference]}'s",
            contradicts="excludes the predicted difference",
        )  # fmt: skip
    if all("sampled_accuracy" in h[-1] for h in histories.values()):
        records |= sampled_summary(histories, methods, reference)
    return records, pd.DataFrame(rows).set_index("method")


def sampled_summary(histories: dict, methods, reference: str) -> dict:
    """`remedy_summary`'s records for the sampled accuracy: each method's gain over the warm
    start, "<m>_sampled_gain{,_low,_high}", and each other method's paired difference from
    `reference`, "<m>_minus_<reference>_sampled{,_low,_high}" (mean and 95% interval over seeds)."""
    final = {name: np.array([[h[0]["sampled_accuracy"], h[-1]["sampled_accuracy"]]
                             for (arm, _), h in histories.items() if arm == name])
             for name in methods}  # fmt: skip
    records = {}
    for name in methods:
        bands = {f"{name}_sampled_gain": seed_band(final[name][:, 1:] - final[name][:, :1])}
        if name != reference:
            bands[f"{name}_minus_{reference}_sampled"] = seed_band(
                final[name][:, 1:] - final[reference][:, 1:]
            )
        for key, band in bands.items():
            for statistic, suffix in (("mean", ""), ("low", "_low"), ("high", "_high")):
                records[f"{key}{suffix}"] = band[statistic][0]
    return records


def run_regime(histories: dict, method: str, group_size: int) -> dict:
    """Where the runs of `method` sat, over all their steps: "mean_pass_rate" (mean reward),
    "degenerate_rate", "all_correct_share" (of the G-groups), and "concentration", the kappa of
    the Beta(m kappa, (1 - m) kappa) with that mean and degenerate rate
    (`sparsity.beta_concentration_for`), kept in [1e-3, 1e3] where Gauss-Jacobi quadrature
    holds: 1e3 (nearly one pass rate) when the rate is at or below the i.i.d. prediction, 1e-3
    when every group was degenerate."""
    mean = runs_of(histories, method, "reward")[1].mean()
    rate = runs_of(histories, method, "frac_reward_zero_std")[1].mean()
    all_correct = runs_of(histories, method, "all_correct")[1].mean()
    floor = iid_degenerate_rate(mean, group_size)["degenerate"][0]
    if not 0 < mean < 1 or rate >= 1:
        concentration = 1e-3
    elif rate <= floor + 1e-9:
        concentration = 1e3
    else:
        concentration = min(1e3, max(1e-3, beta_concentration_for(rate, mean, group_size)))
    return {
        "mean_pass_rate": float(mean),
        "degenerate_rate": float(rate),
        "all_correct_share": float(all_correct),
        "concentration": float(concentration),
    }


def best_step_progress(mean: float, concentration: float, group_size: int, method: str,
                       **options) -> float:  # fmt: skip
    """1 - `exact.best_step_error`: the share of the squared true gradient that one step of
    `method` at its best step size recovers, on prompts p ~ Beta(m kappa, (1 - m) kappa) with
    no score noise (the setting most favourable to Sign, chapter 9)."""
    mean = min(max(mean, 1e-3), 1 - 1e-3)
    nodes, weights = beta_quadrature(mean * concentration, (1 - mean) * concentration)
    return 1 - best_step_error(nodes, weights, group_size, method, **options)["relative_error"]


def predicted_difference(reference_gain: float, progress: float, reference_progress: float):
    """The predicted held-out gain of a method minus the reference's: the reference's measured
    gain (0 if it fell) times the ratio of their `best_step_progress` less 1."""
    return max(reference_gain, 0.0) * (progress / reference_progress - 1)
