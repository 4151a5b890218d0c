r"""Chapter 7's tables read: summaries of the measured ranks, their records, and the verdict.

Every function takes the tables of `groups` and `measure` (`group_rank_frame`,
`group_gradient_ranks` rows, `measure` results) or their summary (`summarise_ranks`) and
returns a smaller table, record values or the verdict's text. The intervals the ledger reads
come from a bootstrap over prompts, `grpo_companion.chapters.rank.bootstrap`. The verdict's
classes keep the paper's letter for the group size ("grows with R").

Chapter: :doc:`/book/07_rank`
"""

import re

import numpy as np
import pandas as pd
import torch

from grpo_companion.chapters.rank.bootstrap import (
    bootstrap_interval,
    change_over_sizes,
    missing_means,
    prompt_weights,
    resampled_means,
)
from grpo_companion.core.spectra import RANK_MEASURES, orthogonal_stable_rank
from grpo_companion.core.stats import interval_words, mean_interval


def summarise_ranks(frame, by: list[str], measures=RANK_MEASURES, confidence: float = 0.95):
    """Mean and t-interval of each measure over the mixed groups, per `by` (+ measure): a
    DataFrame with columns `by`, measure, n, mean, low, high. Degenerate groups (all rewards
    equal) have no gradient at all and are left out; `n` says how many groups are in. The t
    interval (n - 1 degrees of freedom) treats the groups as independent, which groups cut from
    one prompt's samples are not: it describes the spread, and the intervals the ledger reads
    come from `prompt_weights` (a bootstrap over prompts)."""
    rows = []
    for key, part in frame[frame["mixed"]].groupby(by, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        for measure in measures:
            rows.append(
                {
                    **dict(zip(by, key)),
                    "measure": measure,
                    **mean_interval(part[measure], confidence),
                }
            )
    return pd.DataFrame(rows)


def entropy_table(summary: pd.DataFrame, index: list[str]) -> pd.DataFrame:
    """The mean entropy effective rank of a `summarise_ranks` table, rows `index`, one column
    per group size, to two decimals."""
    entropy = summary[summary["measure"] == "entropy"]
    return entropy.pivot_table(index=index, columns="group_size", values="mean").round(2)


def group_size_records(summary: pd.DataFrame, group_sizes: list[int]) -> dict:
    """{record key: value} of the early stage's mean entropy effective rank of each (reward,
    candidate) of a `summarise_ranks` table at the smallest and the largest group size:
    "sequence_<candidate>_<reward>_smallest_R" and "..._largest_R", then the two sizes."""
    early = summary[(summary["stage"] == "early") & (summary["measure"] == "entropy")]
    records = {}
    for (reward, candidate), rows in early.groupby(["reward", "candidate"]):
        means = dict(zip(rows["group_size"], rows["mean"]))
        records[f"sequence_{candidate}_{reward}_smallest_R"] = means[min(group_sizes)]
        records[f"sequence_{candidate}_{reward}_largest_R"] = means[max(group_sizes)]
    return {**records, "smallest_R": min(group_sizes), "largest_R": max(group_sizes)}


def overview(results: dict) -> pd.DataFrame:
    """One row per (model, stage) of `{(model, stage): measure(...)}`: the mean binary reward,
    the fraction of prompts with mixed binary rewards and the mean completion length."""
    return pd.DataFrame(
        [
            {
                "model": name,
                "stage": stage,
                "mean binary reward": r["mean_binary"],
                "prompts with mixed binary rewards": r["mixed_binary"],
                "mean completion tokens": r["tokens"],
            }
            for (name, stage), r in results.items()
        ]
    )


def classify_ranks(means: dict[int, float], target: float = 2.0, tolerance: float = 0.5) -> str:
    """What a candidate's mean effective rank does over G, `means: {G: mean}`:

    "about 2"       every mean within `tolerance` of `target`: the paper's claim
    "about 1"       every mean within `tolerance` of 1
    "at most 2"     every mean at most `target`, but not all near it (a bounded rank whose
                    two singular values differ)
    "grows with R"  the mean at the largest G exceeds that at the smallest by > tolerance
    "other"         none of these
    "one R only"    fewer than two group sizes measured: "regardless of R" is untested
    """
    if len(means) < 2:
        return "one R only"
    values = [means[size] for size in sorted(means)]
    if all(abs(value - target) <= tolerance for value in values):
        return "about 2"
    if all(abs(value - 1) <= tolerance for value in values):
        return "about 1"
    if max(values) <= target:
        return "at most 2"
    if values[-1] - values[0] > tolerance:
        return "grows with R"
    return "other"


def verdict(summary, measure: str = "entropy", tolerance: float = 0.5) -> tuple[list[dict], str]:
    """(one row per setting with its class, a paragraph) from a `summarise_ranks` table that
    has columns model, reward, stage, candidate, group_size, measure, mean.

    A setting is (model, reward, stage, candidate); its class is `classify_ranks` of its mean
    `measure` over the group sizes measured. The paragraph lists where "effective rank about 2
    regardless of R" holds and where it does not, with the measured range."""
    table = summary[summary["measure"] == measure]
    rows = []
    for (model, reward, stage, candidate), part in table.groupby(
        ["model", "reward", "stage", "candidate"], sort=False
    ):
        means = dict(zip(part["group_size"].astype(int), part["mean"].astype(float)))
        rows.append(
            {
                "model": model,
                "reward": reward,
                "stage": stage,
                "candidate": candidate,
                "class": classify_ranks(means, tolerance=tolerance),
                "group_sizes": sorted(means),
                "low": min(means.values()),
                "high": max(means.values()),
            }
        )

    def settings(rows):  # "candidate: model, stage, reward (low to high); ..."
        by_candidate = {}
        for row in rows:
            by_candidate.setdefault(row["candidate"], []).append(
                f"{row['model']}, {row['stage']}, {row['reward']} ({row['low']:.2f} to "
                f"{row['high']:.2f})"
            )
        return "; ".join(f"{name} on {', '.join(items)}" for name, items in by_candidate.items())

    holds = [row for row in rows if row["class"] == "about 2"]
    fails = {}
    for row in rows:
        if row["class"] != "about 2":
            fails.setdefault(row["class"], []).append(row)
    sizes = sorted({size for row in rows for size in row["group_sizes"]})
    text = (
        f"Measured by the mean {measure} effective rank over groups at R = "
        f'{", ".join(map(str, sizes))}, and called "about 2" when every mean lies within '
        f"{tolerance} of 2, the claim holds for "
        + (settings(holds) if holds else "no matrix measured here")
        + ". "
    )
    for name, items in fails.items():
        text += f"It does not hold ({name}) for {settings(items)}. "
    return rows, text.strip()


def candidate_table(
    summary: pd.DataFrame, weight_summary: pd.DataFrame, cross: pd.DataFrame
) -> pd.DataFrame:
    """All five candidates in one `summarise_ranks`-like table for `verdict`: `summary` (the
    per-group candidates), `weight_summary` (summarised weight-gradient rows, column matrix)
    as candidate "weight gradient <matrix>", and the rows of `cross` (`group_gradient_ranks`,
    one matrix per G, so a mean without interval) with at least one group as "group gradients".
    """
    extra = pd.concat(
        [
            weight_summary.assign(candidate="weight gradient " + weight_summary["matrix"]).drop(
                columns="matrix"
            ),
            cross[cross["num_groups"] > 0]
            .melt(
                id_vars=["model", "stage", "reward", "group_size", "num_groups"],
                value_vars=list(RANK_MEASURES),
                var_name="measure",
                value_name="mean",
            )
            .assign(candidate="group gradients")
            .drop(columns="num_groups"),
        ],
        ignore_index=True,
    )
    return pd.concat([summary, extra], ignore_index=True)


def headline_records(summary: pd.DataFrame) -> dict:
    """The ledger's numbers: {"effective_rank_<candidate>": {model: {G: mean}}} of the mean
    entropy effective rank of the per-completion GRPO gradient rows ("weighted", the literal
    reading) and of the class sums ("level_sums"), binary rewards, early stage."""
    headline = summary[
        (summary["measure"] == "entropy")
        & (summary["reward"] == "binary")
        & (summary["stage"] == "early")
    ]
    records = {}
    for candidate in ("weighted", "level_sums"):
        part = headline[headline["candidate"] == candidate]
        records[f"effective_rank_{candidate}"] = {
            model: {int(size): mean for size, mean in zip(rows["group_size"], rows["mean"])}
            for model, rows in part.groupby("model")
        }
    return records


def rank_change_records(
    frame: pd.DataFrame,
    claim_sizes: list[int],
    num_resamples: int,
    seed: int,
    confidence: float = 0.95,
) -> dict:
    """ "Regardless of R" as a number with an interval: {"effective_rank_change": {model:
    {candidate: {"mean", "low", "high"}}}}, `change_over_sizes` of the mean entropy effective
    rank over G in `claim_sizes`, binary rewards before training, from `group_rank_frame`s
    (columns model, stage, reward, candidate, group_size, prompt, mixed, entropy). Every G cuts
    the same samples of each prompt, so the means at different G are dependent: the interval is
    a bootstrap over prompts (`prompt_weights`, `bootstrap_interval`). 0 says the rank does not
    move with R."""
    rows = frame[(frame["reward"] == "binary") & (frame["stage"] == "early")]
    rows = rows[rows["group_size"].isin(claim_sizes)]
    records = {}
    for (model, candidate), part in rows.groupby(["model", "candidate"], sort=True):
        weights = prompt_weights(int(part["prompt"].max()) + 1, num_resamples, seed)
        means = resampled_means(part, ["group_size"], "entropy", weights)
        stacked = np.stack([means.get((size,), missing_means(weights)) for size in claim_sizes], -1)
        change = change_over_sizes(stacked, claim_sizes)
        records.setdefault(model, {})[candidate] = bootstrap_interval(change, confidence)
    return {"effective_rank_change": records}


# ---------------------------------------------------------------------------------------------
# The factorial and the readings (chapter 7, sections 6-7): records the ledger reads

FACTORIAL_BY = ["reward", "advantage", "matrix", "group_size"]
NULL_HOW = (
    "the null model of orthogonal score rows of equal norm (the Gram matrix replaced by the "
    "identity) on the same groups' rewards, through the same statistic"
)


# What an interval beyond 0 (supports) and one short of the null's prediction (contradicts)
# say, per statistic of `reading_records`.
READING_WORDS = {
    "levels_effect": (
        "a third reward level raises the level sums' rank although the advantages are zero-sum",
        "the third reward level does not raise the rank as the null predicts",
    ),
    "zero_sum_effect": (
        "removing zero-sum raises the stable rank of diag(A)S",
        "removing zero-sum does not raise the stable rank of diag(A)S as the null predicts",
    ),
    "weighted_entropy_change": (
        "the entropy effective rank of diag(A)S grows with G",
        "the entropy effective rank of diag(A)S does not grow as the null predicts",
    ),
    "weighted_stable_change": (
        "the stable rank of diag(A)S moves with G in the direction the null predicts",
        "the stable rank of diag(A)S stays put where the null predicts it moves",
    ),
    "scores_entropy_change": (
        "the score rows' effective rank grows with G",
        "the score rows' effective rank does not grow as orthogonal scores would",
    ),
}


def model_slug(name: str) -> str:
    """A model's name as part of a record key: "tiny-llama" -> "tiny_llama",
    "nvidia/Nemotron-Mini-4B-Instruct" -> "nemotron_mini_4b_instruct"."""
    return re.sub(r"[^a-z0-9]+", "_", name.rsplit("/", 1)[-1].lower()).strip("_")


def factorial_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean of each measure and of its null over the mixed groups, one row per (model,
    reward, advantage, matrix, group_size, measure), columns n, mean, null; from
    `rank.factorial_frame`s with a model column."""
    mixed = frame[frame["mixed"]]
    keys = ["model", *FACTORIAL_BY]
    measures = [name for name in ("entropy", "stable", "energy_90") if name in frame]
    means = mixed.groupby(keys)[[*measures, *(f"null_{m}" for m in measures)]].mean()
    counts = mixed.groupby(keys).size()
    rows = [
        {**dict(zip(keys, key)), "measure": m, "n": int(counts[key]), "mean": row[m],
         "null": row[f"null_{m}"]}
        for key, row in means.iterrows()
        for m in measures
    ]  # fmt: skip
    return pd.DataFrame(rows)


def stable_rank_by_k(frame: pd.DataFrame) -> pd.DataFrame:
    """The stable rank of diag(A) S, binary reward, grpo advantages, per (model, G, k) of the
    mixed groups: n, the measured mean, and `spectra.orthogonal_stable_rank` beside it."""
    rows = frame[
        frame["mixed"]
        & (frame["reward"] == "binary")
        & (frame["advantage"] == "grpo")
        & (frame["matrix"] == "weighted")
    ]
    table = rows.groupby(["model", "group_size", "k"])["stable"].agg(["count", "mean"])
    table = table.reset_index().rename(columns={"count": "n", "mean": "measured"})
    sizes, correct = (torch.tensor(table[c].to_numpy()) for c in ("group_size", "k"))
    table["closed_form"] = orthogonal_stable_rank(sizes, correct).numpy()
    return table


def reading_records(
    frame: pd.DataFrame,
    claim_sizes: list[int],
    num_resamples: int,
    seed: int,
    confidence: float = 0.95,
) -> dict:
    """The ledger's flat keys for one model's `rank.factorial_frame` (binary and ternary
    rewards, grpo and sign advantages), m its `model_slug`, every interval a bootstrap over
    prompts (`prompt_weights`):

        levels_effect_m (+ _low, _high)   mean entropy effective rank of the level sums, ternary
                                          minus binary, grpo, at the largest G of `claim_sizes`:
                                          what a third reward level adds under zero-sum (P4a)
        zero_sum_effect_m (+ _low, _high) stable rank of diag(A) S, binary, sign minus grpo, same G:
                                          what removing zero-sum adds
        <reading>_change_m (+ _low, _high)  `change_over_sizes` over `claim_sizes`, binary,
                                          grpo, for weighted_entropy, weighted_stable and
                                          scores_entropy (P4b)
        <each of these>_m_words           its interval in words (`core.stats.interval_words`,
                                          against the prediction; `READING_WORDS`)
        predicted_<each of these>_m (+ _how)  the same statistic under the null model (K = I)
        level_sums_max_rank_m             the largest numerical rank of the binary level sums
        mixed_groups_m                    the fewest mixed binary groups at any G of `claim_sizes`
        three_level_groups_m              ternary groups with three levels at the largest G
    Values are None where there is no mixed group to measure.
    """
    model = model_slug(frame["model"].iloc[0])
    weights = prompt_weights(int(frame["prompt"].max()) + 1, num_resamples, seed)
    largest = max(claim_sizes)
    means = {
        value: resampled_means(frame, FACTORIAL_BY, value, weights)
        for value in ("entropy", "stable", "null_entropy", "null_stable")
    }

    def cell(value, reward, advantage, matrix, size):
        return means[value].get((reward, advantage, matrix, size), missing_means(weights))

    def change(value, matrix):
        stacked = [cell(value, "binary", "grpo", matrix, size) for size in claim_sizes]
        return change_over_sizes(np.stack(stacked, -1), claim_sizes)

    statistics = {
        "levels_effect": lambda v: cell(v + "entropy", "ternary", "grpo", "level_sums", largest)
        - cell(v + "entropy", "binary", "grpo", "level_sums", largest),
        "zero_sum_effect": lambda v: cell(v + "stable", "binary", "sign", "weighted", largest)
        - cell(v + "stable", "binary", "grpo", "weighted", largest),
        "weighted_entropy_change": lambda v: change(v + "entropy", "weighted"),
        "weighted_stable_change": lambda v: change(v + "stable", "weighted"),
        "scores_entropy_change": lambda v: change(v + "entropy", "scores"),
    }
    records = {}
    for name, statistic in statistics.items():
        interval = bootstrap_interval(statistic(""), confidence)
        predicted = statistic("null_")[0]
        predicted = float(predicted) if np.isfinite(predicted) else None
        records[f"{name}_{model}"] = interval["mean"]
        records[f"{name}_{model}_low"] = interval["low"]
        records[f"{name}_{model}_high"] = interval["high"]
        records[f"{name}_{model}_words"] = interval_words(
            interval["low"], interval["high"], predicted, *READING_WORDS[name]
        )
        records[f"predicted_{name}_{model}"] = predicted
        records[f"predicted_{name}_{model}_how"] = NULL_HOW
    mixed = frame[frame["mixed"]]
    binary_level_sums = mixed[(mixed["reward"] == "binary") & (mixed["matrix"] == "level_sums")]
    records[f"level_sums_max_rank_{model}"] = (
        int(binary_level_sums["rank"].max()) if len(binary_level_sums) else None
    )
    binary = mixed[
        (mixed["reward"] == "binary")
        & (mixed["advantage"] == "grpo")
        & (mixed["matrix"] == "scores")
    ]
    records[f"mixed_groups_{model}"] = min(
        int((binary["group_size"] == size).sum()) for size in claim_sizes
    )
    ternary = frame[
        (frame["reward"] == "ternary")
        & (frame["advantage"] == "grpo")
        & (frame["matrix"] == "scores")
        & (frame["group_size"] == largest)
    ]
    records[f"three_level_groups_{model}"] = int((ternary["levels"] >= 3).sum())
    return records


def readings_text(records: dict, model: str) -> str:
    """One paragraph on one model's `reading_records`: each change over G, its interval and the
    null's prediction, and the interval's reading in words (the `_words` records)."""
    slug = model_slug(model)

    def sentence(name):
        key = f"{name}_{slug}"
        label = name.replace("_", " ")
        if records.get(key) is None:
            return f"{label}: no mixed group to measure."
        low, high = records[f"{key}_low"], records[f"{key}_high"]
        span = "no interval" if low is None else f"interval [{low:.2f}, {high:.2f}]"
        null = records[f"predicted_{key}"]
        null = "no null" if null is None else f"null {null:.2f}"
        return f"{label} {records[key]:.2f} ({span}; {null}): {records[f'{key}_words']}."

    names = ("weighted_entropy_change", "weighted_stable_change", "scores_entropy_change")
    return " ".join([f"On the {model}:", *(sentence(name) for name in names)])


def cell_records(summary: pd.DataFrame, model: str, size: int) -> dict:
    """{"cell_<m>_<reward>_<advantage>_<matrix>_<measure>": mean} of one model's
    `factorial_summary` at G = `size`, m its `model_slug`: the numbers the prose quotes."""
    part = summary[(summary["model"] == model) & (summary["group_size"] == size)]
    return {
        f"cell_{model_slug(model)}_{row.reward}_{row.advantage}_{row.matrix}_{row.measure}": float(
            row.mean
        )
        for row in part.itertuples()
    }
