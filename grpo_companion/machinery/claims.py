"""The claims ledger engine: load the claims of `book/claims.toml`, judge each on the values its
chapter recorded (`_build/results/<chapter>.json`), render the ledger.

A claim cites works by key of `book/references.bib` and carries its verdict rule, checks over the
recorded values (`machinery/checks.py`), judged in this order: "needs hardware or data this run
lacked" when the run's setup (`profile`, or a recorded value such as `model_name`) is not the
claim's `requires`; "inconclusive" when the claim is `pending` or one of its `gates` fails (the
run is outside the claim's regime, its reference arm did not learn: the reason names the gate);
"reproduced" when every `reproduced` check holds; "reproduced qualitatively" when every
`qualitatively` check holds; "not reproduced" only when a `contradicted` check holds; and
"inconclusive" otherwise (neither supported nor contradicted). A claim whose thresholds compare
with an effect size names the recorded `prediction` they come from. Each claim carries
`examples` the rule must judge (tests/machinery/test_claims.py). A claim whose chapter has no
results, failed in its last run, or lacks a key or figure the claim names raises a one-line
`ClaimError`.
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
# The example sets of a claim, by the verdict each must get (and, for the last two, the gate
# whose failure must give it).
EXAMPLES = {
    "supporting": REPRODUCED,
    "contradicting": NOT_REPRODUCED,
    "underpowered": INCONCLUSIVE,
    "out_of_regime": INCONCLUSIVE,
    "no_learning": INCONCLUSIVE,
}
GATE_EXAMPLES = {"out_of_regime": "regime", "no_learning": "learned"}


class ClaimError(Exception):
    """A claim that cannot be loaded or judged: its chapter, result key or figure is missing."""


TIERS = ("gates", "reproduced", "qualitatively", "contradicted")


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
    contradicted: tuple[Check, ...] = ()
    qualitatively: tuple[Check, ...] = ()
    gates: tuple[tuple[str, Check], ...] = ()  # (name, check): each must hold
    prediction: str = ""  # the recorded key of the effect the thresholds compare with
    never_inconclusive: str = ""
    pending: str = ""
    source_value: float | None = None
    equation: str = ""  # TeX of the claim's key equation, for the one-page summary
    requires: dict = field(default_factory=dict)
    notes: str = ""
    examples: dict = field(default_factory=dict)

    def checks(self, tier: str) -> tuple[Check, ...]:
        """The checks of one tier, the gates without their names."""
        rows = getattr(self, tier)
        return tuple(check for _, check in rows) if tier == "gates" else rows

    @property
    def keys(self) -> list[str]:
        checks = [check for tier in TIERS for check in self.checks(tier)]
        predicted = [self.prediction] if self.prediction else []
        expressions = [self.measured, *predicted, *(check.expression for check in checks)]
        keys = [key for expression in expressions for key in expression_keys(expression)]
        return list(dict.fromkeys(keys + [key for key in self.requires if key != "profile"]))


def _check(row: dict, tolerances: dict) -> Check:
    """`{expression, low?, high?}` or `{near, target, within}`, either with `outside = true`;
    a bound may name a tolerance."""

    def bound(value) -> float:
        return tolerances[value] if isinstance(value, str) else float(value)

    unknown = set(row) - {"expression", "low", "high", "near", "target", "within", "outside"}
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)} in check {row}")
    outside = bool(row.get("outside", False))
    if "near" in row:
        return near(row["near"], row["target"], bound(row["within"]), outside)
    low, high = bound(row.get("low", -math.inf)), bound(row.get("high", math.inf))
    return Check(row["expression"], low, high, outside)


def _gate(row: dict, tolerances: dict) -> tuple[str, Check]:
    """`{gate = name, ...a check}`: the gate passes when the check holds."""
    row = dict(row)
    return row.pop("gate"), _check(row, tolerances)


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
                tier: tuple(
                    (_gate if tier == "gates" else _check)(c, tolerances) for c in row.get(tier, ())
                )
                for tier in TIERS
            }
            claims.append(Claim(**{**row, **rules, "sources": tuple(row["sources"])}))
        except (KeyError, TypeError, ValueError) as error:
            raise ClaimError(f"{path}: claim {row.get('id', '?')}: {error!r}") from None
    return tuple(claims)


def setup_mismatch(claim: Claim, results: dict) -> dict:
    """The parts of the run's setup (`profile`, or a recorded value such as `model_name`) that
    are not what the claim `requires`: {key: the run's value}; empty when the setup matches."""
    values = results["values"]
    setup = {key: results["profile"] if key == "profile" else values[key] for key in claim.requires}
    return {
        key: setup[key]
        for key, wanted in claim.requires.items()
        if setup[key] not in (wanted if isinstance(wanted, list | tuple) else [wanted])
    }


def judge(claim: Claim, results: dict) -> dict:
    """The verdict of `claim` on one chapter's results (the JSON of `ChapterReport.write`),
    with its reason, the measured value, the prediction and every check's value. The keys must
    be present. Raises `ClaimError` when the results both reproduce and contradict the claim (a
    defect of the rule)."""
    values = results["values"]
    mismatched = setup_mismatch(claim, results)
    # Another setup's numbers say nothing about the claim, and may not exist at all (the value
    # of a model the run did not load): then nothing is measured, nothing is checked.
    checks = {
        tier: [] if mismatched else [check.judge(values) for check in claim.checks(tier)]
        for tier in TIERS
    }
    for (name, _), row in zip(claim.gates, checks["gates"]):
        row["gate"] = name
    failed_gates = [f"gate {row['gate']}: {row['rule']} failed" for row in checks["gates"]]
    failed_gates = [text for text, row in zip(failed_gates, checks["gates"]) if not row["passed"]]
    holds = {tier: all(row["passed"] for row in checks[tier]) for tier in TIERS}
    contradictions = [row["rule"] for row in checks["contradicted"] if row["passed"]]
    if holds["reproduced"] and contradictions and not (mismatched or claim.pending or failed_gates):
        raise ClaimError(
            f"claim {claim.id}: the rule both reproduces and contradicts: {contradictions[0]}"
        )
    reason = ""
    if mismatched:
        verdict = NEEDS_SETUP
    elif claim.pending:
        verdict, reason = INCONCLUSIVE, claim.pending
    elif failed_gates:
        verdict, reason = INCONCLUSIVE, failed_gates[0]
    elif holds["reproduced"]:
        verdict = REPRODUCED
    elif claim.qualitatively and holds["qualitatively"]:
        verdict = QUALITATIVE
    elif contradictions:
        verdict, reason = NOT_REPRODUCED, f"contradicted: {contradictions[0]}"
    else:
        verdict, reason = INCONCLUSIVE, "neither reproduced nor contradicted"
    measured = None if mismatched else _measured(claim.measured, values)
    predicted = None if mismatched or not claim.prediction else _measured(claim.prediction, values)
    how = values.get(f"{claim.prediction}_how", "") if claim.prediction and not mismatched else ""
    return {
        "verdict": verdict,
        "reason": reason,
        "measured_value": measured,
        "predicted_value": predicted,
        "prediction_how": how,
        "checks": checks,
        "setup_mismatch": mismatched,
    }


def _measured(expression: str, values: dict) -> float | None:
    try:
        return finite(float(evaluate_expression(expression, values)))
    except (LookupError, TypeError):  # a subscript the run did not record
        return None


def rules(claim: Claim) -> dict[str, str]:
    """The claim's conditions as text: "gates" (each must hold, by name), "reproduced" (every
    check), "qualitatively" (every check, or ""), "contradicted" (any check, or why no run can
    leave the claim undecided), and "pending" (the experiment that could decide it, or "")."""
    text = {
        tier: " and ".join(f"`{check}`" for check in claim.checks(tier))
        for tier in ("reproduced", "qualitatively")
    }
    gates = " and ".join(f"{name}: `{check}`" for name, check in claim.gates)
    contradicted = " or ".join(f"`{check}`" for check in claim.contradicted)
    return text | {"gates": gates, "contradicted": contradicted, "pending": claim.pending}


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
    for missing in (key for key in claim.requires if key != "profile"):
        if missing not in results["values"]:
            raise ClaimError(f"{where} recorded no key {missing!r} in {path}")
    # Another setup's run need not record what the claim would read (a model it did not load).
    needed = [] if setup_mismatch(claim, results) else claim.keys
    for missing in (key for key in needed if key not in results["values"]):
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
            key: value for key, value in asdict(claim).items() if key not in (*TIERS, "examples")
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
    "pending": "pending until",
    "gates": "judged only if",
    "reproduced": "reproduced if",
    "qualitatively": "qualitatively if",
    "contradicted": "not reproduced if",
}
# sphinx-design's badge roles, one colour per verdict.
BADGES = {
    REPRODUCED: "bdg-success",
    QUALITATIVE: "bdg-info",
    INCONCLUSIVE: "bdg-warning",
    NOT_REPRODUCED: "bdg-danger",
    NEEDS_SETUP: "bdg-secondary",
}


# The verdicts' short names, for the badges of the summary.
SHORT = {NEEDS_SETUP: "needs hardware"}


def verdict_badge(row: dict) -> str:
    """The verdict as a coloured badge, with the gate that stopped it (`inconclusive: regime`)."""
    label = SHORT.get(row["verdict"], row["verdict"])
    if row["reason"].startswith("gate "):
        label += ": " + row["reason"].removeprefix("gate ").split(":")[0]
    return f"{{{BADGES[row['verdict']]}}}`{label}`"


def markdown_table(table: dict, figures_prefix: str = "../figures") -> str:
    """The full ledger as a MyST table: each row cites its sources (`{cite:p}`,
    sphinxcontrib-bibtex), links its chapter (`{doc}`) and its figure's PNG (a local link, which
    Sphinx checks), and states its rule and key equation."""
    lines = [
        "| claim | verdict | measured, predicted | conditions | source reports | source "
        "| tested in | profile, model |",
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
        equation = f"${row['equation']}$: " if row["equation"] else ""
        predicted = ""
        if row.get("prediction"):
            predicted = f"; predicted `{row['prediction']}` = {_number(row['predicted_value'])}"
        lines.append(
            f"| **{row['id']}**: {equation}{_cell(row['statement'])} | {verdict} "
            f"| `{row['measured']}` = {_number(row['measured_value'])}{predicted} | {conditions} "
            f"| {_number(row['source_value'])} | {{cite:p}}`{','.join(row['sources'])}` "
            f"| {{doc}}`{row['chapter']}`, figure [{row['figure']}]({figure}) "
            f"| {row['profile']}, {row['model_name'] or 'no model'} |"
        )
    return "\n".join(lines)


def markdown_summary(table: dict) -> str:
    """One short line per claim, every verdict visible without scrolling: the claim's name and
    chapter (by number), its verdict as a badge, the effect this setting predicts and the
    measurement (a MyST table; equations, rules and sources are in the full ledger)."""
    lines = ["| claim, chapter | verdict | predicted → measured |", "|---|---|---|"]
    for row in table["claims"]:
        predicted = _number(row.get("predicted_value")) if row.get("prediction") else "—"
        chapter = f"{{doc}}`{int(row['chapter'][:2])} <{row['chapter']}>`"
        lines.append(
            f"| **{row['id']}**, {chapter} | {verdict_badge(row)} "
            f"| {predicted} → {_number(row['measured_value'])} |"
        )
    return "\n".join(lines)


def _tier_label(tier: str, check: dict) -> str:
    return f"gate {check['gate']}" if tier == "gates" else tier


def markdown_checks(table: dict) -> str:
    """Every check of every claim with its measured value, and the reasons for the bounds."""
    lines = ["| claim | rule | check | value | holds |", "|---|---|---|---|---|"]
    for row in table["claims"]:
        for tier, checks in row["checks"].items():
            lines += [
                f"| {row['id']} | {_tier_label(tier, check)} "
                f"| `{check['rule']}` | {_number(check['value'])} "
                f"| {'yes' if check['passed'] else 'no'} |"
                for check in checks
            ]
    lines.append("")
    for row in table["claims"]:
        how = f" Prediction: {row['prediction_how']}" if row.get("prediction_how") else ""
        if row["notes"] or how:
            lines.append(f"- **{row['id']}**: {row['notes']}{how}")
    return "\n".join(lines)
