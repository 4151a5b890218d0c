"""The package's layers, read from the source: imports only point down, and a chapter's modules
never import another chapter's modules or a private name of another module."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_companion"
# Each layer may import the layers after it in this order, and itself.
ORDER = ("machinery", "chapters", "lm", "core")
# machinery renders what chapters record but never calls chapter code.
FORBIDDEN = {"machinery": {"chapters"}}
# The main module of each chapter; `<main>_*.py` belong to the same chapter.
CHAPTER_MODULES = (
    "reinforce",
    "group_baseline",
    "grpo_loss",
    "testbed",
    "credit",
    "sparsity",
    "rank",
    "baselines",
    "advantage_zoo",
    "group_size",
    "gsm8k_run",
)


def modules():
    return sorted(path for path in PACKAGE.glob("*/*.py") if path.name != "__init__.py")


def imported(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import from the package in the file at `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("grpo_companion"):
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("grpo_companion")]
    return found


def chapter_of(module: str) -> str:
    matches = [main for main in CHAPTER_MODULES if module == main or module.startswith(main + "_")]
    assert matches, f"chapters/{module}.py belongs to no chapter of CHAPTER_MODULES"
    return max(matches, key=len)


def test_every_layer_has_modules():
    assert {path.parent.name for path in modules()} == set(ORDER)


def violations(layer: str, name: str, imports: list[tuple[str, list[str]]]) -> list[str]:
    """What breaks the layering in module `layer/name.py` with these imports."""
    allowed = set(ORDER[ORDER.index(layer) :]) - FORBIDDEN.get(layer, set())
    found = []
    for module, names in imports:
        parts = module.split(".")
        targets = names if len(parts) == 1 else [parts[1]]  # `from grpo_companion import core`
        found += [f"imports {module} ({target})" for target in targets if target not in allowed]
        if len(parts) >= 3 and parts[1:3] != [layer, name]:
            found += [f"imports private {n} from {module}" for n in names if n.startswith("_")]
        if layer == "chapters" and len(parts) >= 3 and parts[1] == "chapters":
            if chapter_of(parts[2]) != chapter_of(name):
                found.append(f"imports another chapter's module {module}")
    return found


@pytest.mark.parametrize("path", modules(), ids=lambda path: f"{path.parent.name}/{path.name}")
def test_imports_point_down(path):
    assert violations(path.parent.name, path.stem, imported(path)) == []


def test_the_rules_catch_a_bad_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from grpo_companion.chapters.rank import measure\n")
    imports = imported(bad)
    assert imports == [("grpo_companion.chapters.rank", ["measure"])]
    assert violations("chapters", "credit_plots", imports) == [
        "imports another chapter's module grpo_companion.chapters.rank"
    ]
    assert violations("chapters", "rank_plots", imports) == []
    assert violations("lm", "trainer", imports) == [
        "imports grpo_companion.chapters.rank (chapters)"
    ]
    assert violations("machinery", "claims", imports) != []
    private = [("grpo_companion.core.exact", ["_private"])]
    assert violations("chapters", "rank", private) == [
        "imports private _private from grpo_companion.core.exact"
    ]
