r"""Chapter 7's tables read: summaries of the measured ranks, their records, and the verdict.

Every function takes the tables of `rank` (`group_rank_frame`, `group_gradient_ranks` rows,
`measure` results) or their summary (`summarise_ranks`) and returns a smaller table, record
values or the verdict's text. The verdict's classes keep the paper's letter for the group size
("grows with R").
"""

import pandas as pd
from scipy import stats

from grpo_companion.core.spectra import RANK_MEASURES
from grpo_companion.core.stats import mean_interval, slope_of_means


def summarise_ranks(frame, by: list[str], measures=RANK_MEASURES, confidence: float = 0.95):
    """Mean and t-interval of each measure over the mixed groups, per `by` (+ measure): a
    DataFrame with columns `by`, measure, n, mean, low, high. Degenerate groups (all rewards
    equal) have no gradient at all and are left out; `n` says how many groups are in."""
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


def rank_change_records(table: pd.DataFrame, confidence: float = 0.95) -> dict:
    """ "Regardless of R" as a number with an interval: {"effective_rank_change": {model:
    {candidate: {"mean", "low", "high"}}}}, the least-squares slope of the mean entropy effective
    rank against G (`slope_of_means`, the groups at each G independent of the others) times the
    span of G measured, for binary rewards before training, from a `candidate_table`. The
    standard error of each mean is read back from its t-interval; a candidate without one (the
    stacked group gradients: one matrix per G) has low and high None, as has one measured at a
    single G. 0 says the rank does not move with R; the ledger bounds the interval by 0.5."""
    headline = (table["reward"] == "binary") & (table["stage"] == "early")
    rows = table[headline & (table["measure"] == "entropy")]
    records = {}
    for (model, candidate), part in rows.groupby(["model", "candidate"], sort=True):
        part = part.sort_values("group_size")
        sizes = part["group_size"].astype(float).to_numpy()
        if len(set(sizes)) < 2:
            continue
        errors = [
            (row["high"] - row["low"]) / (2 * stats.t.ppf((1 + confidence) / 2, row["n"] - 1))
            if row.get("n", 0) >= 2 and pd.notna(row["high"])
            else None
            for row in part.to_dict("records")
        ]
        slope = slope_of_means(sizes, part["mean"].to_numpy(dtype=float), errors)
        span = sizes[-1] - sizes[0]
        records.setdefault(model, {})[candidate] = {
            key: None if value is None else float(value * span) for key, value in slope.items()
        }
    return {"effective_rank_change": records}
