"""What each chapter records, declared in `book/results.toml`: its result keys (`values`) and
figure names (`figures`), one table per chapter.

The pipeline fails a chapter whose results differ from its declaration, and
`tests/machinery/test_claims.py` checks every claim of the ledger against the declarations
without running a chapter, so a renamed key fails in seconds. A plain name must be recorded; a
glob pattern (`grpo_reward_first_*`) declares a family of names that depends on the run (one
per model of the profile, say), of which the run may record any number.
"""

import tomllib
from fnmatch import fnmatchcase
from pathlib import Path

KINDS = {"values": "key", "figures": "figure"}


def load_declarations(path: Path) -> dict[str, dict[str, list[str]]]:
    """`{chapter: {"values": [...], "figures": [...]}}` from the TOML file at `path`."""
    with open(path, "rb") as file:
        tables = tomllib.load(file)
    return {
        chapter: {kind: list(table.get(kind, [])) for kind in KINDS}
        for chapter, table in tables.items()
    }


def is_glob(pattern: str) -> bool:
    return any(character in pattern for character in "*?[")


def is_declared(name: str, patterns: list[str]) -> bool:
    """Whether `name` is one of `patterns` or matches one of its glob patterns."""
    return any(name == pattern or fnmatchcase(name, pattern) for pattern in patterns)


def mismatches(declaration: dict[str, list[str]], results: dict) -> list[str]:
    """How a chapter's results (the JSON of `ChapterReport.write`) differ from its declaration:
    each recorded name that nothing declares, each declared plain name not recorded."""
    problems = []
    for kind, noun in KINDS.items():
        recorded, patterns = list(results[kind]), declaration[kind]
        problems += [
            f"undeclared {noun} {name!r}" for name in recorded if not is_declared(name, patterns)
        ]
        problems += [
            f"declared {noun} {name!r} not recorded"
            for name in patterns
            if not is_glob(name) and name not in recorded
        ]
    return problems


def undeclared_references(claims, declarations: dict[str, dict[str, list[str]]]) -> list[str]:
    """What `claims` (each with `id`, `chapter`, `keys`, `figure`) read that their chapter does
    not declare: no chapter run needed, so a renamed key fails in seconds."""
    problems = []
    for claim in claims:
        declared = declarations.get(claim.chapter)
        if declared is None:
            problems.append(f"claim {claim.id}: chapter {claim.chapter} declares no results")
            continue
        problems += [
            f"claim {claim.id}: chapter {claim.chapter} declares no key {key!r}"
            for key in claim.keys
            if not is_declared(key, declared["values"])
        ]
        if not is_declared(claim.figure, declared["figures"]):
            problems.append(
                f"claim {claim.id}: chapter {claim.chapter} declares no figure {claim.figure!r}"
            )
    return problems
