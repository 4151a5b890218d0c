"""The claims ledger engine: load the claims of `book/claims.toml`, judge each on the values its
chapter recorded (`_build/results/<chapter>.json`), render the ledger.

A claim cites works by key of `book/references.bib` and carries its verdict rule: checks, each an
expression over the recorded values with bounds (`machinery/checks.py`). The verdict is
"needs hardware or data this run lacked" when the run's setup (`profile`, or a recorded value
such as `model_name`) is not the claim's `requires`; else "inconclusive" when the claim is
`pending` (the experiment that could decide it is not in the book yet: the reason is given) or
when any check of `inconclusive` holds (the run could not show the effect either way: an
interval wider than the effect, or a run that never entered the regime the claim is about);
else "reproduced" when every check of `reproduced` holds, "reproduced qualitatively" when every
check of the looser, optional `qualitatively` holds, and "not reproduced", a measurement that
contradicts the claim, otherwise. A claim that no run can leave undecided (an exact identity)
says why in `never_inconclusive` instead. Each claim carries `examples`, recorded values that
support it, contradict it and cannot decide it (tests/test_claims.py judges all three). A claim
whose chapter has no results, failed in its last run, or lacks a key or figure the claim names
raises a one-line `ClaimError`.
"""

import json
import math
import os
import tomllib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grpo_companion.machinery.checks import (
    Check,
    evaluate_expression,
    expression_keys,
    finite,
    near,
)

REPRODUCED = "reproduced"
QUALITATIVE = "reproduced qualitatively"
NOT_REPRODUCED = "not reproduced"
INCONCLUSIVE = "inconclusive"
NEEDS_SETUP = "needs hardware or data this run lacked"
VERDICTS = (REPRODUCED, QUALITATIVE, INCONCLUSIVE, NOT_REPRODUCED, NEEDS_SETUP)
# The example sets of a claim, by the verdict each must get.
EXAMPLES = {"supporting": REPRODUCED, "contradicting": NOT_REPRODUCED, "underpowered": INCONCLUSIVE}


class ClaimError(Exception):
    """A claim that cannot be loaded or judged: its chapter, result key or figure is missing."""


TIERS = ("reproduced", "qualitatively", "inconclusive")


@dataclass(frozen=True)
class Claim:
    """One row of the ledger, a `[[claims]]` table of claims.toml. `requires` maps `profile` or
    a recorded value (`model_name`, `data_source`) to the setup the source measured on (a list:
    any of its values)."""

    id: str
    statement: str
    sources: tuple[str, ...]
    chapter: str
    figure: str
    measured: str
    reproduced: tuple[Check, ...]
    qualitatively: tuple[Check, ...] = ()
    inconclusive: tuple[Check, ...] = ()
    never_inconclusive: str = ""
    pending: str = ""
    source_value: float | None = None
    equation: str = ""  # TeX of the claim's key equation, for the one-page summary
    requires: dict = field(default_factory=dict)
    notes: str = ""
    examples: dict = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        checks = self.reproduced + self.qualitatively + self.inconclusive
        expressions = [self.measured, *(check.expression for check in checks)]
        keys = [key for expression in expressions for key in expression_keys(expression)]
        return list(dict.fromkeys(keys + [key for key in self.requires if key != "profile"]))


def _check(row: dict, tolerances: dict) -> Check:
    """`{expression, low?, high?}` or `{near, target, within}`; a bound may name a tolerance."""

    def bound(value) -> float:
        return tolerances[value] if isinstance(value, str) else float(value)

    if "near" in row:
        return near(row["near"], row["target"], bound(row["within"]))
    low, high = bound(row.get("low", -math.inf)), bound(row.get("high", math.inf))
    return Check(row["expression"], low, high)


def load_tolerances(path: Path) -> dict[str, float]:
    """The named tolerances of claims.toml (`exact`: the bound of exact computations)."""
    with open(path, "rb") as file:
        return tomllib.load(file).get("tolerances", {})


def load_claims(path: Path) -> tuple[Claim, ...]:
    """Every `[[claims]]` of the TOML file at `path`, in order."""
    with open(path, "rb") as file:
        data = tomllib.load(file)
    tolerances, claims = data.get("tolerances", {}), []
    for row in data["claims"]:
        try:
            rules = {
                tier: tuple(_check(c, tolerances) for c in row.get(tier, ())) for tier in TIERS
            }
            claims.append(Claim(**{**row, **rules, "sources": tuple(row["sources"])}))
        except (KeyError, TypeError, ValueError) as error:
            raise ClaimError(f"{path}: claim {row.get('id', '?')}: {error!r}") from None
    return tuple(claims)


def judge(claim: Claim, results: dict) -> dict:
    """The verdict of `claim` on one chapter's results (the JSON of `ChapterReport.write`),
    with the measured value and every check's value. The keys must be present."""
    values = results["values"]
    setup = {key: results["profile"] if key == "profile" else values[key] for key in claim.requires}
    mismatched = {
        key: setup[key]
        for key, wanted in claim.requires.items()
        if setup[key] not in (wanted if isinstance(wanted, list | tuple) else [wanted])
    }
    # Another setup's numbers say nothing about the claim, and may not exist at all (the value
    # of a model the run did not load): then nothing is measured, nothing is checked.
    checks = {
        tier: [] if mismatched else [check.judge(values) for check in getattr(claim, tier)]
        for tier in TIERS
    }
    holds = {tier: all(row["passed"] for row in rows) for tier, rows in checks.items()}
    undecided = [row["rule"] for row in checks["inconclusive"] if row["passed"]]
    reason = claim.pending or "; ".join(undecided)
    if mismatched:
        verdict, reason = NEEDS_SETUP, ""
    elif reason:
        verdict = INCONCLUSIVE
    elif holds["reproduced"]:
        verdict = REPRODUCED
    elif claim.qualitatively and holds["qualitatively"]:
        verdict = QUALITATIVE
    else:
        verdict = NOT_REPRODUCED
    measured = None if mismatched else _measured(claim.measured, values)
    return {
        "verdict": verdict,
        "reason": reason,
        "measured_value": measured,
        "checks": checks,
        "setup_mismatch": mismatched,
    }


def _measured(expression: str, values: dict) -> float | None:
    try:
        return finite(float(evaluate_expression(expression, values)))
    except (LookupError, TypeError):  # a subscript the run did not record
        return None


def rules(claim: Claim) -> dict[str, str]:
    """The claim's conditions as text: "reproduced" (every check), "qualitatively" (every
    check, or ""), "inconclusive" (any check, or why it cannot be, or the pending reason)."""
    text = {
        tier: " and ".join(f"`{check}`" for check in getattr(claim, tier)) for tier in TIERS[:2]
    }
    undecided = " or ".join(f"`{check}`" for check in claim.inconclusive)
    if claim.pending:
        undecided = f"always until: {claim.pending}"
    elif claim.never_inconclusive:
        undecided = f"never: {claim.never_inconclusive}"
    return text | {"inconclusive": undecided}


def chapter_results(build_dir: Path, claim: Claim) -> dict:
    """The results a claim reads, after checking that its chapter ran, did not fail last,
    and recorded every key and figure the claim names."""
    build_dir, chapter = Path(build_dir), claim.chapter
    key = (claim.keys or [claim.measured])[0]
    path = build_dir / "results" / f"{chapter}.json"
    failed = build_dir / "failed" / f"{chapter}.ipynb"
    where = f"claim {claim.id}: chapter {chapter}"
    if failed.exists():
        raise ClaimError(f"{where} failed in its last run ({failed}); key {key!r} would be stale")
    if not path.exists():
        run = f"python -m grpo_companion run {chapter}"
        raise ClaimError(f"{where} has no results ({path}) for key {key!r}; run `{run}` first")
    results = json.loads(path.read_text())
    for missing in (key for key in claim.keys if key not in results["values"]):
        raise ClaimError(f"{where} recorded no key {missing!r} in {path}")
    figure = build_dir / "figures" / chapter / f"{claim.figure}.png"
    if claim.figure not in results["figures"] or not figure.exists():
        raise ClaimError(f"{where} has no figure {claim.figure!r} ({figure}); key {key!r}")
    return results


def ledger(build_dir: Path, claims) -> dict:
    """Every claim judged on the results under `build_dir`: the ledger chapter 12 renders and
    `claims.json` holds. Raises `ClaimError` on the first claim that cannot be judged."""
    rows = []
    for claim in claims:
        results = chapter_results(build_dir, claim)
        row = {
            key: value
            for key, value in asdict(claim).items()
            if key not in (*TIERS, "examples", "never_inconclusive")
        } | {"rules": rules(claim)}
        rows.append(
            row
            | judge(claim, results)
            | {
                "figure_path": f"figures/{claim.chapter}/{claim.figure}.png",
                "profile": results["profile"],
                "seed": results["seed"],
                "model_name": results["values"].get("model_name"),
            }
        )
    counts = Counter(row["verdict"] for row in rows)
    return {
        "verdicts": list(VERDICTS),
        "summary": {verdict: counts[verdict] for verdict in VERDICTS},
        "profiles": sorted({row["profile"] for row in rows}),
        "claims": rows,
    }


def write_ledger(table: dict, path: Path) -> Path:
    """Write the ledger as JSON, replacing any earlier one in a single move."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(path.name + ".tmp")
    scratch.write_text(json.dumps(table, indent=2, ensure_ascii=False) + "\n")
    os.replace(scratch, path)
    return path


def _cell(text: str) -> str:
    """Text for a table cell: a `|` of the text (as in |o|) must not end the cell."""
    return text.replace("|", "\\|")


def _number(value) -> str:
    return "—" if value is None else f"{value:.3g}"


CONDITIONS = {
    "reproduced": "reproduced if",
    "qualitatively": "qualitatively if",
    "inconclusive": "inconclusive if",
}


def markdown_table(table: dict, figures_prefix: str = "../figures") -> str:
    """The ledger as a MyST table: each row cites its sources (`{cite:p}`, sphinxcontrib-bibtex)
    and links its chapter (`{doc}`) and its figure's PNG (a local link, which Sphinx checks)."""
    lines = [
        "| claim | verdict | measured | conditions | source reports | source | tested in "
        "| profile, model |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in table["claims"]:
        figure = f"{figures_prefix}/{row['chapter']}/{row['figure']}.png"
        verdict = f"**{row['verdict']}**" + (f" ({_cell(row['reason'])})" if row["reason"] else "")
        conditions = "; ".join(
            f"*{label}* {_cell(row['rules'][tier])}"
            for tier, label in CONDITIONS.items()
            if row["rules"][tier]
        )
        lines.append(
            f"| **{row['id']}**: {_cell(row['statement'])} | {verdict} "
            f"| `{row['measured']}` = {_number(row['measured_value'])} | {conditions} "
            f"| {_number(row['source_value'])} | {{cite:p}}`{','.join(row['sources'])}` "
            f"| {{doc}}`{row['chapter']}`, figure [{row['figure']}]({figure}) "
            f"| {row['profile']}, {row['model_name'] or 'no model'} |"
        )
    return "\n".join(lines)


def markdown_summary(table: dict) -> str:
    """One line per claim for the book's one-page summary: the claim, its key equation, the
    measured value and the verdict (a MyST table; the equation is inline math)."""
    lines = ["| claim | key equation | measured | verdict |", "|---|---|---|---|"]
    for row in table["claims"]:
        equation = f"${row['equation']}$" if row["equation"] else "—"
        lines.append(
            f"| **{row['id']}** ({{doc}}`{row['chapter']}`) | {equation} "
            f"| `{row['measured']}` = {_number(row['measured_value'])} | **{row['verdict']}** |"
        )
    return "\n".join(lines)


def markdown_checks(table: dict) -> str:
    """Every check of every claim with its measured value, and the reasons for the bounds."""
    lines = ["| claim | rule | check | value | holds |", "|---|---|---|---|---|"]
    for row in table["claims"]:
        for tier, checks in row["checks"].items():
            lines += [
                f"| {row['id']} | {tier} | `{check['rule']}` | {_number(check['value'])} "
                f"| {'yes' if check['passed'] else 'no'} |"
                for check in checks
            ]
    lines.append("")
    lines += [f"- **{row['id']}**: {row['notes']}" for row in table["claims"] if row["notes"]]
    return "\n".join(lines)
