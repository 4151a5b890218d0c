"""Page code is code: the code cells of every chapter page pass `ruff check` and are formatted as
`ruff format` writes them, under the project's settings (pyproject.toml). No chapter is executed.

jupytext converts each page to a notebook in a temporary directory, and ruff reads it as a
notebook, cell by cell: a cell may end with the value it displays, the trailing semicolon that
hides a cell's value is kept, and imports may start any cell. (A percent-format script would not
do: there ruff format drops those semicolons and ruff check flags them and the displayed values.)
The rules a page still needs switched off are in pyproject.toml's per-file-ignores for the
converted pages.

    python tests/book/test_page_code.py --fix [page.md ...]

applies ruff's safe fixes (import order among them) and ruff's formatting to the pages' code
cells and writes them back into the pages; markdown cells and cell options are left as they are.
"""

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "book").glob("[0-9][0-9]_*.md"))
RUFF = Path(sys.executable).with_name("ruff")
CONFIG = ROOT / "pyproject.toml"
OPENING = re.compile(r"^```\{code-cell\}")
CLOSING = re.compile(r"^```\s*$")


def closing_lines(lines: list[str]) -> list[int]:
    """0-based index of the closing fence of each code cell of a page's lines, in order."""
    closings, inside = [], False
    for index, line in enumerate(lines):
        if not inside and OPENING.match(line):
            inside = True
        elif inside and CLOSING.match(line):
            closings.append(index)
            inside = False
    return closings


class Page:
    """A page's code cells as a notebook for ruff, and where each cell's source lies on the page.

    A code cell's source is verbatim on the page and ends at the cell's closing fence, so cell
    line `row` (1-based) of a source of `n` lines is page line `closing - n + row`.
    """

    def __init__(self, path: Path, folder: Path):
        self.path = path
        self.lines = path.read_text().splitlines()
        self.notebook = jupytext.read(path)
        self.code = [i for i, cell in enumerate(self.notebook.cells) if cell.cell_type == "code"]
        self.closings = closing_lines(self.lines)
        assert len(self.closings) == len(self.code), f"{path.name}: code cells and fences differ"
        for number, cell in enumerate(self.code):
            source = self.notebook.cells[cell].source.splitlines()
            end = self.closings[number]
            assert self.lines[end - len(source) : end] == source, f"{path.name}: cell {cell + 1}"
        self.file = folder / f"{path.stem}.ipynb"
        jupytext.write(self.notebook, self.file, fmt="ipynb")

    def sources(self) -> list[str]:
        """The code cells' sources, as the notebook file holds them now."""
        cells = json.loads(self.file.read_text())["cells"]
        return ["".join(cells[i]["source"]) for i in self.code]

    def page_line(self, cell: int, row: int) -> int:
        """The page line (1-based) of line `row` (1-based) of notebook cell `cell` (0-based)."""
        number = self.code.index(cell)
        source = self.notebook.cells[cell].source.splitlines()
        return self.closings[number] - len(source) + row

    def where(self, cell: int, row: int) -> str:
        return f"book/{self.path.name}:{self.page_line(cell, row)}"

    def ruff(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(RUFF), *args, "--config", str(CONFIG), "--no-cache", str(self.file)],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )

    def lint(self) -> list[str]:
        """`page:line: code message` for each of ruff check's findings."""
        run = self.ruff("check", "--output-format", "json")
        assert run.returncode in (0, 1) and run.stdout, run.stderr
        return [
            f"{self.where(item['cell'] - 1, item['location']['row'])}: "
            f"{item['code']} {item['message']}"
            for item in json.loads(run.stdout)
        ]

    def unformatted(self) -> list[str]:
        """`page:line: ...` for each code cell that ruff format would change, at its first line
        that differs."""
        before = self.sources()
        run = self.ruff("format")
        assert run.returncode == 0, run.stderr
        found = []
        for cell, old, new in zip(self.code, before, self.sources()):
            if old != new:
                old_lines, new_lines = old.splitlines(), new.splitlines()
                row = next(
                    (i for i, pair in enumerate(zip(old_lines, new_lines)) if pair[0] != pair[1]),
                    min(len(old_lines), len(new_lines)),
                )
                expected = new_lines[row] if row < len(new_lines) else "(end of cell)"
                found.append(f"{self.where(cell, row + 1)}: ruff format writes {expected!r}")
        return found

    def fix(self) -> bool:
        """Apply ruff's safe fixes and its formatting; write changed cells back into the page."""
        before = self.sources()
        self.ruff("check", "--fix-only", "--exit-zero")
        assert self.ruff("format").returncode == 0
        after = self.sources()
        lines = list(self.lines)
        changed = False
        # From the last cell up, so that the earlier cells' line numbers stay where they were.
        for number in reversed(range(len(self.code))):
            old, new = before[number], after[number]
            if old == new:
                continue
            end = self.closings[number]
            lines[end - len(old.splitlines()) : end] = new.rstrip("\n").splitlines()
            changed = True
        if changed:
            self.path.write_text("\n".join(lines) + "\n")
        return changed


def test_ruff_is_beside_python():
    assert RUFF.exists(), f"ruff is not installed next to {sys.executable}"


@pytest.mark.parametrize("path", PAGES, ids=lambda path: path.stem)
def test_page_code_passes_ruff_check(path, tmp_path):
    findings = Page(path, tmp_path).lint()
    if findings:
        pytest.fail("ruff check on the page's code cells:\n" + "\n".join(findings))


@pytest.mark.parametrize("path", PAGES, ids=lambda path: path.stem)
def test_page_code_is_formatted(path, tmp_path):
    cells = Page(path, tmp_path).unformatted()
    if cells:
        pytest.fail(
            "code cells that ruff format would change "
            f"(python {Path(__file__).relative_to(ROOT)} --fix {path.relative_to(ROOT)}):\n"
            + "\n".join(cells)
        )


if __name__ == "__main__":
    if sys.argv[1:2] != ["--fix"]:
        sys.exit(f"usage: python {sys.argv[0]} --fix [page.md ...]")
    pages = [Path(name).resolve() for name in sys.argv[2:]] or PAGES
    with tempfile.TemporaryDirectory() as name:
        for page in pages:
            if Page(page, Path(name)).fix():
                print(f"formatted {page.relative_to(ROOT)}")
