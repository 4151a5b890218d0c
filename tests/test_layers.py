"""The package's layers, read from the source: imports only point down, each chapter's code is
one folder named after its page, and a chapter never imports another chapter's modules or a
private name of another module."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpo_companion"
# Each layer may import the layers after it in this order, and itself.
ORDER = ("machinery", "chapters", "lm", "core")
# machinery renders what chapters record but never calls chapter code.
FORBIDDEN = {"machinery": {"chapters"}}
# Beneath every layer: the module that pins the kernels when the package is imported.
FOUNDATION = {"reproducibility"}


def modules() -> list[Path]:
    paths = list(PACKAGE.glob("*/*.py")) + list(PACKAGE.glob("chapters/*/*.py"))
    return sorted(path for path in paths if path.name != "__init__.py")


def dotted(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def imported(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import from the package in the file at `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("grpo_companion"):
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("grpo_companion")]
    return found


def test_every_layer_has_modules():
    assert {dotted(path).split(".")[1] for path in modules()} == set(ORDER)


def test_each_chapter_folder_is_named_after_its_page():
    """`book/05_credit.md` leads to `grpo_companion/chapters/credit/`: the page's name without
    its number. Chapter code lives only in such folders."""
    pages = {path.stem.split("_", 1)[1] for path in (ROOT / "book").glob("[0-9][0-9]_*.md")}
    folders = {path.name for path in (PACKAGE / "chapters").iterdir() if path.is_dir()}
    folders -= {"__pycache__"}
    assert folders <= pages, f"chapter folders without a page: {folders - pages}"
    assert not [p.name for p in (PACKAGE / "chapters").glob("*.py") if p.name != "__init__.py"]
    assert all((PACKAGE / "chapters" / folder / "__init__.py").exists() for folder in folders)


def violations(module: str, imports: list[tuple[str, list[str]]]) -> list[str]:
    """What breaks the layering in the module of dotted name `module` with these imports."""
    layer = module.split(".")[1]
    allowed = set(ORDER[ORDER.index(layer) :]) - FORBIDDEN.get(layer, set()) | FOUNDATION
    found = []
    for target, names in imports:
        parts = target.split(".")
        layers = names if len(parts) == 1 else [parts[1]]  # `from grpo_companion import core`
        found += [f"imports {target} ({name})" for name in layers if name not in allowed]
        if target != module:
            found += [f"imports private {n} from {target}" for n in names if n.startswith("_")]
        if layer == "chapters" and len(parts) >= 3 and parts[1] == "chapters":
            if parts[2] != module.split(".")[2]:
                found.append(f"imports another chapter's module {target}")
    return found


@pytest.mark.parametrize("path", modules(), ids=lambda path: dotted(path).split(".", 1)[1])
def test_imports_point_down(path):
    assert violations(dotted(path), imported(path)) == []


def test_the_rules_catch_a_bad_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from grpo_companion.chapters.rank import measure\n")
    imports = imported(bad)
    assert imports == [("grpo_companion.chapters.rank", ["measure"])]
    assert violations("grpo_companion.chapters.credit.plots", imports) == [
        "imports another chapter's module grpo_companion.chapters.rank"
    ]
    assert violations("grpo_companion.chapters.rank.plots", imports) == []
    assert violations("grpo_companion.lm.trainer", imports) == [
        "imports grpo_companion.chapters.rank (chapters)"
    ]
    assert violations("grpo_companion.machinery.claims", imports) != []
    private = [("grpo_companion.core.exact", ["_private"])]
    assert violations("grpo_companion.chapters.rank.measure", private) == [
        "imports private _private from grpo_companion.core.exact"
    ]
