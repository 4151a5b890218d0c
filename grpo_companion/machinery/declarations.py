"""What each chapter records, read from the code that records it: no table kept beside it.

`declare(page)` reads a chapter's code cells and returns the result keys (`values`) and figure
names (`figures`) its `report.record`, `report.record_all` and `report.figure` calls can
record. A key is read where it is written: a literal, an f-string over a literal loop, or the
keys of the dict a library function returns, read from that function's source (with the literal
arguments of the call, so `easy_summary(table, "easy")` declares "easy_..."). A key built from a
run's data is a glob pattern (`grpo_reward_first_*`). A key the code cannot name this way is an
error that names the line, so every published number keeps one home.

The pipeline fails a chapter that records a name its code does not declare, or misses a
`required` one (a literal recorded unconditionally); `tests/machinery/test_claims.py` checks
every claim of the ledger against `declare` without running a chapter.
"""

import ast
from fnmatch import fnmatchcase
from pathlib import Path

from grpo_companion.machinery.code_reading import (
    GLOB,
    DeclarationError,
    Reader,
    Scope,
    dotted,
    unconditional,
)

KINDS = {"values": "key", "figures": "figure"}


def is_glob(pattern: str) -> bool:
    return any(character in pattern for character in "*?[")


def is_declared(name: str, patterns: list[str]) -> bool:
    """Whether `name` is one of `patterns` or matches one of its glob patterns."""
    return any(name == pattern or fnmatchcase(name, pattern) for pattern in patterns)


def code_cells(page: Path) -> str:
    """The code cells of a MyST page, as one Python module (IPython magics dropped)."""
    import jupytext

    cells = [cell.source for cell in jupytext.read(page).cells if cell.cell_type == "code"]
    lines = [line for cell in cells for line in cell.splitlines() + [""]]
    return "\n".join(line for line in lines if not line.lstrip().startswith(("%", "!")))


def declare(page: Path) -> dict[str, list[str]]:
    """{"values", "figures", "required"} of the chapter at `page`: the names (plain or glob)
    its code can record, and the plain keys it records on every run."""
    tree = ast.parse(code_cells(page))
    scope, reader = Scope(tree), Reader()
    values, figures, required = set(), set(), set()
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and dotted(node.func.value) == "report"
        ):  # fmt: skip
            continue
        method, args = node.func.attr, node.args
        if method == "record" and args:
            names = reader.strings(args[0], scope)
            if names == {GLOB}:
                reader.fail(args[0], scope, "key")
            values |= names
            if unconditional(node, scope):
                required |= {name for name in names if not is_glob(name)}
        elif method == "record_all" and args:
            prefixes = {""}
            for keyword in node.keywords:
                if keyword.arg == "prefix":
                    prefixes = reader.strings(keyword.value, scope)
            keys = reader.keys(args[0], scope)
            values |= {prefix + key for prefix in prefixes for key in keys}
            if isinstance(args[0], ast.Dict) and len(prefixes) == 1 and unconditional(node, scope):
                required |= {
                    next(iter(prefixes)) + key.value
                    for key in args[0].keys
                    if isinstance(key, ast.Constant) and isinstance(key.value, str)
                }
        elif method == "figure" and len(args) >= 2:
            names = reader.strings(args[1], scope)
            if names == {GLOB}:
                reader.fail(args[1], scope, "figure")
            figures |= names
    for names in (values, figures):
        too_wide = [name for name in names if len(name.replace(GLOB, "").strip("_")) < 3]
        if too_wide:
            raise DeclarationError(f"{page.name}: names too wide to check: {sorted(too_wide)}")
    return {"values": sorted(values), "figures": sorted(figures), "required": sorted(required)}


def mismatches(declaration: dict[str, list[str]], results: dict) -> list[str]:
    """How a chapter's results (the JSON of `ChapterReport.write`) differ from what its code
    declares: each recorded name nothing declares, each required key not recorded."""
    problems = []
    for kind, noun in KINDS.items():
        problems += [
            f"undeclared {noun} {name!r}"
            for name in results[kind]
            if not is_declared(name, declaration[kind])
        ]
    problems += [
        f"declared key {name!r} not recorded"
        for name in declaration.get("required", [])
        if name not in results["values"]
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
