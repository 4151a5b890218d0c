"""Execute the chapters with papermill and render the book with Jupyter Book 1.

Chapter sources are MyST-markdown notebooks `book/NN_name.md` without outputs. A run:

1. refuses, before any cell runs, an override that the chapter's `parameters` cell does not
   declare, of another type than the default's or outside its declared range (`parameters.py`),
   and a chapter whose code records a name it does not spell out (`declarations.declare`);
2. converts the source with jupytext and executes it with papermill into `_build/tmp/<chapter>/`,
   injecting the profile's parameters (`book/profiles.toml`), the overrides, `profile`,
   `output_dir` and, when declared (chapter 12), `build_dir`;
3. only when every cell succeeded and the chapter recorded only what its code declares, adds the
   pipeline's part of the `provenance` record, stores the run's seconds in
   `_build/timings/<profile>.json` (runs without overrides only), strips the notebook of
   papermill's injected cell and absolute paths, heads it with what the chapter needs (device,
   minutes, re-run command, parameters), and replaces its published outputs in one move each:
   `_build/source/book/<chapter>.ipynb`, `_build/figures/<chapter>/`,
   `_build/results/<chapter>.json`. A failing chapter leaves its notebook in `_build/failed/`
   (until it next succeeds) and every published output as it was.

`build_html` renders `_build/source` (the book with the executed notebooks, its other pages,
`references.bib` and `_build/figures` as `figures/`) into `_build/html` with
`execute_notebooks: off` and warnings as errors.
"""

import ast
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from grpo_companion.machinery.declarations import DeclarationError, declare, mismatches
from grpo_companion.machinery.parameters import ParameterError, read_cell, violation
from grpo_companion.machinery.provenance import (
    header_markdown,
    load_timings,
    pipeline_provenance,
    record_timing,
)

RESERVED = ("profile", "output_dir")  # injected by the pipeline, declared by every chapter
INJECTED_IF_DECLARED = ("build_dir",)  # injected into the chapters that declare it
SHARED = "shared"  # profiles.toml: `[<profile>.shared]` values go to every chapter declaring them


class _DropUnparsedLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unable to parse line")


_UNPARSED_LINES = _DropUnparsedLines()


class PipelineError(Exception):
    """Bad input or a failed step; the message is the whole story, one line where possible."""


@dataclass(frozen=True)
class Project:
    """A book: `root` holds `_config.yml`, `_toc.yml`, `book/` and `node_modules/mathjax`;
    everything generated goes under `build_dir` (default `root/_build`)."""

    root: Path
    build_dir: Path | None = None

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root).resolve())
        object.__setattr__(
            self, "build_dir", Path(self.build_dir or self.root / "_build").resolve()
        )

    @property
    def chapters(self) -> list[str]:
        return sorted(path.stem for path in (self.root / "book").glob("[0-9][0-9]_*.md"))

    @property
    def profiles(self) -> dict[str, dict[str, dict]]:
        with open(self.root / "book" / "profiles.toml", "rb") as file:
            return tomllib.load(file)

    def source(self, chapter: str) -> Path:
        if chapter not in self.chapters:
            raise PipelineError(
                f"unknown chapter {chapter!r}; valid chapters: {', '.join(self.chapters)}"
            )
        return self.root / "book" / f"{chapter}.md"

    def results_path(self, chapter: str) -> Path:
        return self.build_dir / "results" / f"{chapter}.json"

    def declaration(self, chapter: str) -> dict[str, list[str]]:
        """The result keys and figures `chapter`'s code records (`declarations.declare`)."""
        try:
            return declare(self.source(chapter))
        except DeclarationError as error:
            raise PipelineError(f"chapter {chapter}: {error}") from None


def chapter_parameters(path: Path) -> dict:
    """The defaults declared in the cell tagged `parameters`, as Python values."""
    return _parameters_cell(path)[0]


def chapter_constraints(path: Path) -> dict[str, str]:
    """The accepted range declared beside each default (`name: ">= 1" = 200`), by name."""
    return _parameters_cell(path)[1]


def _parameters_cell(path: Path) -> tuple[dict, dict]:
    import jupytext

    cells = [
        cell for cell in jupytext.read(path).cells if "parameters" in cell.metadata.get("tags", [])
    ]
    if len(cells) != 1:
        raise PipelineError(
            f"{path.name}: needs exactly one cell tagged 'parameters', found {len(cells)}"
        )
    try:
        defaults, constraints = read_cell(cells[0].source, path.name)
    except ParameterError as error:
        raise PipelineError(str(error)) from None
    missing = [name for name in RESERVED if name not in defaults]
    if missing:
        raise PipelineError(f"{path.name}: the parameters cell must declare {', '.join(missing)}")
    return defaults, constraints


def parse_value(text: str):
    """A command-line value: a Python literal when it is one (`2000`, `0.5`, `True`, `[2, 4]`),
    else the string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _type_ok(value, default) -> bool:
    if default is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return type(value) is type(default)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


def resolve_parameters(
    project: Project, chapter: str, profile: str, overrides: dict | None = None
) -> dict:
    """The parameters `chapter` runs with: the profile's `shared` values for the parameters the
    chapter declares, then the profile's table for the chapter, then `overrides`, each later one
    winning, each checked against the chapter's defaults (name, type and range). Returns only what
    these set; papermill injects it after the parameters cell.

    A dict-valued parameter is merged key by key into the chapter's default dict, so a profile or
    an override lists only the keys it changes. The keys inside such a dict are not checked here
    (a default like `tiny_llama = {}` names none): a misspelt one reaches the chapter, whose
    constructor (`GRPOConfig(**grpo)`, `TinyLlamaSpec(**tiny_llama)`) refuses it when it runs."""
    return _resolve(project, chapter, profile, overrides)[1]


def _resolve(
    project: Project, chapter: str, profile: str, overrides: dict | None
) -> tuple[dict, dict, dict]:
    """(defaults, what the profile and overrides set, where each parameter came from:
    'default', 'profile' or 'override')."""
    profiles = project.profiles
    if profile not in profiles:
        raise PipelineError(f"unknown profile {profile!r}; valid profiles: {', '.join(profiles)}")
    defaults = chapter_parameters(project.source(chapter))
    # A profile's `shared` table applies to every chapter that declares the parameter.
    shared = {
        name: value for name, value in profiles[profile].get(SHARED, {}).items() if name in defaults
    }
    layers = (shared, profiles[profile].get(chapter, {}), overrides or {})
    for layer in layers:
        _check_layer(chapter, layer, defaults)
    # A chapter's table that changes one key of a shared dict keeps the shared dict's other keys.
    parameters, sources = {}, dict.fromkeys(defaults, "default")
    for layer, source in zip(layers, ("profile", "profile", "override"), strict=True):
        for name, value in layer.items():
            if isinstance(defaults[name], dict):
                value = {**defaults[name], **parameters.get(name, {}), **value}
            parameters[name], sources[name] = value, source
    constraints = chapter_constraints(project.source(chapter))
    for name, value in parameters.items():
        problem = violation(name, value, constraints[name]) if name in constraints else None
        if problem:
            raise PipelineError(f"chapter {chapter}: {problem}")
    return defaults, parameters, sources


def _check_layer(chapter: str, parameters: dict, defaults: dict) -> None:
    for name, value in parameters.items():
        if name in RESERVED + INJECTED_IF_DECLARED:
            raise PipelineError(
                f"chapter {chapter}: parameter {name!r} is set by the pipeline, not by hand"
            )
        if name not in defaults:
            accepted = ", ".join(sorted(set(defaults) - set(RESERVED + INJECTED_IF_DECLARED)))
            raise PipelineError(
                f"chapter {chapter}: unknown parameter {name!r}; accepted parameters: {accepted}"
            )
        if not _type_ok(value, defaults[name]):
            raise PipelineError(
                f"chapter {chapter}: parameter {name!r} must be {type(defaults[name]).__name__} "
                f"like its default {defaults[name]!r}, got {type(value).__name__} {value!r}"
            )


def _failing_cell(notebook_path: Path) -> str:
    """'code cell N (`first line`)' for the first cell with an error output, N counting the
    source's code cells from 1 (the injected parameters cell is not one of them)."""
    notebook = json.loads(notebook_path.read_text())
    number = 0
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code" or "injected-parameters" in cell["metadata"].get("tags", []):
            continue
        number += 1
        if any(output.get("output_type") == "error" for output in cell.get("outputs", [])):
            first_line = "".join(cell["source"]).strip().splitlines()[0] if cell["source"] else ""
            return f"code cell {number} (`{first_line}`)"
    return "an unknown cell"


def _replace(new: Path, old: Path) -> None:
    """Put `new` where `old` is, in as few steps as a POSIX file system allows."""
    old.parent.mkdir(parents=True, exist_ok=True)
    if new.is_dir() and old.exists():
        trash = old.with_name(old.name + ".old")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(old, trash)
        os.replace(new, old)
        shutil.rmtree(trash)
    else:
        os.replace(new, old)


def execute_chapter(
    project: Project,
    chapter: str,
    profile: str = "cpu",
    overrides: dict | None = None,
    progress: bool = True,
) -> float:
    """Execute one chapter and publish its outputs; returns the seconds it took.

    A run without overrides also stores its seconds in `_build/timings/<profile>.json` (a run
    with overrides measures other work than the profile's)."""
    import jupytext
    import papermill

    # papermill's cell inspector reads one "=" per line, so a range beside a default
    # (`n: ">= 1" = 200`, read by `parameters.py`) would print "Unable to parse line" for
    # every such parameter; the injected values do not depend on that inspection.
    logging.getLogger("papermill.translators").addFilter(_UNPARSED_LINES)
    defaults, parameters, sources = _resolve(project, chapter, profile, overrides)
    declaration = project.declaration(chapter)
    work = project.build_dir / "tmp" / chapter
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    jupytext.write(jupytext.read(project.source(chapter)), work / "source.ipynb")
    executed = work / f"{chapter}.ipynb"
    parameters = {**parameters, "profile": profile, "output_dir": str(work / "out")}
    if "build_dir" in defaults:
        parameters["build_dir"] = str(project.build_dir)
    start_time = datetime.now(UTC).isoformat(timespec="seconds")
    start = time.perf_counter()
    try:
        papermill.execute_notebook(
            work / "source.ipynb",
            executed,
            parameters=parameters,
            cwd=str(project.root),
            progress_bar=progress,
            kernel_name="python3",
            language="python",
        )
    except papermill.PapermillExecutionError as error:
        failed = project.build_dir / "failed" / f"{chapter}.ipynb"
        _replace(executed, failed)
        raise PipelineError(
            f"chapter {chapter} failed in {_failing_cell(failed)} with {error.ename}: "
            f"{error.evalue}; partially executed notebook: {failed}"
        ) from None
    seconds = time.perf_counter() - start
    results = work / "out" / "results.json"
    if not results.exists():
        raise PipelineError(
            f"chapter {chapter} ran but wrote no results.json (call report.write() at the end)"
        )
    recorded = json.loads(results.read_text())
    problems = mismatches(declaration, recorded)
    if problems:
        failed = project.build_dir / "failed" / f"{chapter}.ipynb"
        _replace(executed, failed)
        raise PipelineError(
            f"chapter {chapter} recorded other names than its code declares: "
            f"{'; '.join(problems)}; executed notebook: {failed}"
        )
    resolved = {**defaults, **parameters}
    recorded["provenance"] = {
        **recorded.get("provenance", {}),
        **pipeline_provenance(
            project.root, chapter, profile, resolved, sources, overrides, start_time, seconds
        ),
    }
    results.write_text(json.dumps(recorded, indent=2, sort_keys=True) + "\n")
    if not overrides:
        record_timing(project.build_dir, profile, chapter, seconds)
    header = header_markdown(
        chapter,
        profile,
        resolved,
        sources,
        load_timings(project.build_dir),
        _devices(project, chapter),
    )
    _publishable(executed, header)
    _replace(work / "out" / "figures", project.build_dir / "figures" / chapter)
    _replace(results, project.results_path(chapter))
    _replace(executed, project.build_dir / "source" / "book" / f"{chapter}.ipynb")
    (project.build_dir / "failed" / f"{chapter}.ipynb").unlink(missing_ok=True)
    shutil.rmtree(work)
    return seconds


def _devices(project: Project, chapter: str) -> dict[str, str]:
    """{profile: the device `chapter` runs on under it}, from its `device` parameter."""
    devices = {}
    for profile in project.profiles:
        try:
            defaults, parameters, _ = _resolve(project, chapter, profile, None)
        except PipelineError:  # a profile broken for this chapter says so when it is run
            continue
        devices[profile] = str({**defaults, **parameters}.get("device", "cpu"))
    return devices


def _publishable(notebook_path: Path, header: str) -> None:
    """Make an executed notebook fit to publish: drop papermill's injected cell and the paths
    papermill notes in the metadata (no page may show where the book was built), and put
    `header` under the chapter's title."""
    import nbformat

    notebook = nbformat.read(notebook_path, as_version=4)
    notebook.cells = [
        cell
        for cell in notebook.cells
        if "injected-parameters" not in cell.metadata.get("tags", [])
    ]
    for key in ("parameters", "input_path", "output_path"):
        notebook.metadata.get("papermill", {}).pop(key, None)
    title = next((cell for cell in notebook.cells if cell.cell_type == "markdown"), None)
    if title is not None and title.source.startswith("# "):
        first, _, rest = title.source.partition("\n")
        title.source = "\n".join((first, "", header, rest.lstrip("\n")))
    else:
        notebook.cells.insert(0, nbformat.v4.new_markdown_cell(header))
    nbformat.write(notebook, notebook_path)


def build_html(project: Project) -> Path:
    """Render `_build/source` to `_build/html` with Sphinx warnings as errors."""
    source = project.build_dir / "source"
    missing = [
        chapter
        for chapter in project.chapters
        if not (source / "book" / f"{chapter}.ipynb").exists()
    ]
    if missing:
        command = f"python -m grpo_companion run {missing[0]}"
        raise PipelineError(f"not executed yet: {', '.join(missing)}; run `{command}` first")
    mathjax = project.root / "node_modules" / "mathjax" / "es5"
    if not mathjax.exists():
        raise PipelineError(f"no local MathJax at {mathjax}; run `npm ci` (or `make setup`) first")
    for name in ("_config.yml", "_toc.yml"):
        shutil.copy2(project.root / name, source / name)
    for page in (project.root / "book").glob("*.md"):
        if page.stem not in project.chapters:
            shutil.copy2(page, source / "book" / page.name)
    for bibliography in (project.root / "book").glob("*.bib"):
        shutil.copy2(bibliography, source / "book" / bibliography.name)
    figures = source / "figures"
    shutil.rmtree(figures, ignore_errors=True)
    if (project.build_dir / "figures").exists():
        shutil.copytree(project.build_dir / "figures", figures)
    static = source / "_mathjax" / "mathjax"
    if not static.exists():
        shutil.copytree(mathjax, static)
    html = project.build_dir / "html"
    # jupyter-book writes to <path-output>/_build/html; build in a scratch folder, then swap.
    scratch = project.build_dir / "tmp" / "html"
    shutil.rmtree(scratch, ignore_errors=True)
    jupyter_book = Path(sys.executable).with_name("jupyter-book")
    command = [
        str(jupyter_book),
        "build",
        str(source),
        "--path-output",
        str(scratch),
        "-W",
        "-n",
        "--keep-going",
        "-q",
    ]
    run = subprocess.run(command, check=False, capture_output=True, text=True)
    if run.returncode != 0:
        output = f"{run.stdout[-4000:]}{run.stderr[-4000:]}"
        raise PipelineError(f"jupyter-book build failed (warnings are errors):\n{output}")
    _replace(scratch / "_build" / "html", html)
    shutil.rmtree(scratch)
    return html
