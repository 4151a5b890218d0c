"""The pipeline's promises, on a two-chapter fixture book: parameters resolve from the profile's
shared values, the chapter's table and the overrides (dicts merged key by key); bad input is
refused before any cell runs; a failing chapter, or one that records other keys or figures than it
declares, is reported in one line and leaves every published output intact; a Sphinx warning
fails the HTML build; the published notebook shows what the chapter needs and the parameters it
ran with, and no path of the machine; and the command line explains itself."""

import json
from pathlib import Path

import pytest

from grpo_companion.machinery.cli import COMMANDS, main
from grpo_companion.machinery.pipeline import (
    PipelineError,
    Project,
    build_html,
    execute_chapter,
    parse_value,
    resolve_parameters,
)
from grpo_companion.machinery.provenance import field_problems, load_timings

ROOT = Path(__file__).resolve().parents[2]

FRONT_MATTER = """\
---
jupytext:
  text_representation: {extension: .md, format_name: myst}
kernelspec: {display_name: Python 3, language: python, name: python3}
---
"""


def chapter_source(title: str, parameters: str, cells: str = "") -> str:
    """A chapter's MyST source: the front matter, its title, a parameters cell of profile,
    output_dir, seed and `parameters` (lines), then `cells`."""
    head = 'profile = "cpu"\noutput_dir = "scratch"\nseed = 0\n'
    parameters_cell = f"```{{code-cell}} ipython3\n:tags: [parameters]\n\n{head}{parameters}```\n"
    return f"{FRONT_MATTER}\n# {title}\n\n{parameters_cell}{cells}"


# The cells of the fixture book's chapters, after the parameters cell: a `str.format` template.
CHAPTER_CELLS = """\

```{{code-cell}} ipython3
import matplotlib.pyplot as plt
from grpo_companion.machinery.report import ChapterReport

report = ChapterReport("{name}", output_dir, profile, seed)
report.record("total", num_samples * rate)
fig, ax = plt.subplots()
ax.plot([0, 1], [0, num_samples])
report.figure(fig, "line")
plt.show()
```

```{{code-cell}} ipython3
if fail:
    raise RuntimeError("deliberately broken")
report.write();
```

The total is {{glue:text}}`{glue_key}`.
"""


CHAPTERS = {"01_first": "First", "02_second": "Second"}


def make_book(root: Path, glue_key: str = "total") -> Project:
    (root / "book").mkdir(parents=True)
    (root / "_config.yml").write_text((ROOT / "_config.yml").read_text())
    files = "".join(f"  - file: book/{name}\n" for name in CHAPTERS)
    (root / "_toc.yml").write_text(f"format: jb-book\nroot: book/intro\nchapters:\n{files}")
    (root / "book" / "intro.md").write_text("# Fixture book\n")
    # _config.yml names the bibliography: the fixture book has the real one
    (root / "book" / "references.bib").write_text((ROOT / "book" / "references.bib").read_text())
    (root / "book" / "profiles.toml").write_text("[cpu]\n[smoke.01_first]\nnum_samples = 2\n")
    for name, title in CHAPTERS.items():
        (root / "book" / f"{name}.md").write_text(
            chapter_source(
                title,
                "num_samples = 10\nrate = 0.5\nfail = False\n",
                CHAPTER_CELLS.format(name=name, glue_key=glue_key),
            )
        )
    (root / "node_modules").mkdir()
    (root / "node_modules" / "mathjax").symlink_to(ROOT / "node_modules" / "mathjax")
    return Project(root)


@pytest.fixture
def book(tmp_path) -> Project:
    return make_book(tmp_path)


def published(project: Project) -> dict[str, bytes]:
    return {
        str(path.relative_to(project.build_dir)): path.read_bytes()
        for folder in ("results", "figures", "source")
        for path in sorted((project.build_dir / folder).rglob("*"))
        if path.is_file()
    }


def test_profile_values_and_overrides_are_resolved(book):
    assert resolve_parameters(book, "01_first", "smoke") == {"num_samples": 2}
    assert resolve_parameters(book, "01_first", "smoke", {"rate": 1}) == {
        "num_samples": 2,
        "rate": 1,
    }
    assert resolve_parameters(book, "02_second", "smoke") == {}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["run", "01_first", "-p", "num_smaples", "3"],
            "chapter 01_first: unknown parameter 'num_smaples'; "
            "accepted parameters: fail, num_samples, rate, seed",
        ),
        (
            ["run", "01_first", "-p", "num_samples", "many"],
            "chapter 01_first: parameter 'num_samples' must be int like its default 10, "
            "got str 'many'",
        ),
        (["run", "01_first", "-p", "fail", "1"], "parameter 'fail' must be bool"),
        (
            ["run", "01_first", "-p", "output_dir", "x"],
            "parameter 'output_dir' is set by the pipeline",
        ),
        (
            ["run", "01_first", "--profile", "fast"],
            "unknown profile 'fast'; valid profiles: cpu, smoke",
        ),
        (["run", "03_third"], "unknown chapter '03_third'; valid chapters: 01_first, 02_second"),
    ],
)
def test_bad_input_is_refused_before_any_cell_runs(book, capsys, argv, message):
    assert main(["--root", str(book.root), *argv]) == 1
    error = capsys.readouterr().err
    assert message in error
    assert error.count("\n") == 1  # one line
    assert not book.build_dir.exists()  # nothing was executed, nothing written


DICT_CHAPTER = chapter_source(
    "Dicts", 'rate = 0.5\noptions = {"depth": 1, "width": 2, "name": "a"}\n'
)

SHARED_PROFILES = """\
[cpu]

[smoke.shared]
rate = 0.25
options = { depth = 3 }

[smoke.01_first]
num_samples = 2

[smoke.02_second]
rate = 0.75

[smoke.03_dicts]
options = { width = 4 }
"""


def test_shared_values_reach_only_the_chapters_that_declare_them_and_dicts_merge(book):
    (book.root / "book" / "03_dicts.md").write_text(DICT_CHAPTER)
    (book.root / "book" / "profiles.toml").write_text(SHARED_PROFILES)
    # `options` is shared but only 03_dicts declares it; `rate` goes to every chapter
    assert resolve_parameters(book, "01_first", "smoke") == {"rate": 0.25, "num_samples": 2}
    # a chapter's own table wins over the shared value
    assert resolve_parameters(book, "02_second", "smoke") == {"rate": 0.75}
    # a dict merges key by key: the default, then the shared dict, then the chapter's table
    assert resolve_parameters(book, "03_dicts", "smoke") == {
        "rate": 0.25,
        "options": {"depth": 3, "width": 4, "name": "a"},
    }
    # ... then the override, which changes one key and keeps the others
    assert resolve_parameters(book, "03_dicts", "smoke", {"options": {"name": "b"}}) == {
        "rate": 0.25,
        "options": {"depth": 3, "width": 4, "name": "b"},
    }
    assert resolve_parameters(book, "03_dicts", "cpu", {"options": {"width": 9}}) == {
        "options": {"depth": 1, "width": 9, "name": "a"}
    }
    # documented: the keys inside a dict are not checked here (a default such as `{}` names
    # none); a misspelt key reaches the chapter, whose constructor refuses it
    assert resolve_parameters(book, "03_dicts", "cpu", {"options": {"wdith": 9}}) == {
        "options": {"depth": 1, "width": 2, "name": "a", "wdith": 9}
    }
    with pytest.raises(PipelineError, match="parameter 'options' must be dict"):
        resolve_parameters(book, "03_dicts", "cpu", {"options": 3})
    (book.root / "book" / "profiles.toml").write_text("[smoke.shared]\nrate = 'fast'\n")
    with pytest.raises(PipelineError, match="chapter 01_first: parameter 'rate' must be float"):
        resolve_parameters(book, "01_first", "smoke")


def test_a_chapter_recording_a_name_its_code_does_not_spell_is_refused_before_any_cell_runs(
    book, capsys
):
    page = book.root / "book" / "02_second.md"
    page.write_text(page.read_text().replace('report.record("total"', "report.record(key"))
    assert main(["--root", str(book.root), "run", "02_second", "--no-progress"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: chapter 02_second: line ")
    assert "cannot tell which key `key` records" in error
    assert error.count("\n") == 1 and not book.build_dir.exists()


def test_a_chapter_that_records_other_keys_than_its_code_declares_fails_and_publishes_nothing(
    book,
):
    page = book.root / "book" / "01_first.md"
    page.write_text(
        page.read_text().replace(
            'report.record("total", num_samples * rate)',
            'values = {"total": num_samples * rate}\n'
            'values.setdefault("mean", rate)  # a key no code reading can see\n'
            "report.record_all(values)\n"
            'if fail:\n    report.record("never", 0)',
        )
    )
    with pytest.raises(PipelineError) as error:
        execute_chapter(book, "01_first", "smoke", progress=False)
    failed = book.build_dir / "failed" / "01_first.ipynb"
    assert str(error.value) == (
        "chapter 01_first recorded other names than its code declares: undeclared key "
        f"'mean'; executed notebook: {failed}"
    )
    assert failed.exists() and not (book.build_dir / "results").exists()
    assert not (book.build_dir / "figures").exists()


def test_every_command_explains_itself_with_an_example(capsys):
    with pytest.raises(SystemExit) as exit_code:
        main(["--help"])
    assert exit_code.value.code == 0
    text = capsys.readouterr().out
    assert "Execute the GRPO Companion's chapters with papermill" in text
    for name, (summary, _, example) in COMMANDS.items():
        assert f"{name}  " in text and summary in text
        assert f"python -m grpo_companion {name}" in text or name in ("html", "pdf")
        with pytest.raises(SystemExit):
            main([name, "--help"])
        command_help = capsys.readouterr().out
        assert command_help.startswith(f"usage: python -m grpo_companion {name}")
        assert f"example:\n  {example}" in command_help
    assert "--profile PROFILE" in command_help or name in ("html", "pdf", "fingerprint")


def test_parse_value_reads_literals_and_falls_back_to_strings():
    assert parse_value("2000") == 2000 and parse_value("0.5") == 0.5 and parse_value("True") is True
    assert parse_value("[2, 4]") == [2, 4] and parse_value("tiny-llama") == "tiny-llama"


def test_failing_chapter_names_its_cell_and_keeps_previous_outputs(book, capsys):
    assert main(["--root", str(book.root), "run", "01_first", "02_second", "--no-progress"]) == 0
    assert json.loads(book.results_path("01_first").read_text())["values"] == {"total": 5.0}
    before = published(book)
    assert "figures/01_first/line.png" in before and "source/book/02_second.ipynb" in before

    assert (
        main(
            [
                "--root",
                str(book.root),
                "run",
                "01_first",
                "-p",
                "fail",
                "True",
                "-p",
                "num_samples",
                "99",
                "--no-progress",
            ]
        )
        == 1
    )
    error = capsys.readouterr().err
    failed = book.build_dir / "failed" / "01_first.ipynb"
    assert (
        "chapter 01_first failed in code cell 3 (`if fail:`) with RuntimeError: deliberately broken"
        in error
    )
    assert f"partially executed notebook: {failed}" in error
    assert "deliberately broken" in failed.read_text()
    assert published(book) == before  # the earlier run's outputs, byte for byte

    execute_chapter(book, "01_first", progress=False)
    assert not failed.exists()  # a failed notebook in _build/failed/ is always the latest run


def test_a_sphinx_warning_fails_the_build(tmp_path):
    project = make_book(tmp_path, glue_key="no_such_key")
    # a page that shows where the book was built is a warning too (sphinx_ext)
    second = project.root / "book" / "02_second.md"
    second.write_text(second.read_text() + "\n```{code-cell} ipython3\nprint(output_dir)\n```\n")
    for chapter in project.chapters:
        execute_chapter(project, chapter, "smoke", progress=False)
    with pytest.raises(PipelineError, match="no_such_key") as error:
        build_html(project)
    assert (
        f"page book/02_second shows a path of the machine that built it ({project.build_dir})"
        in str(error.value)
    )
    assert "page book/01_first shows" not in str(error.value)
    assert not (project.build_dir / "html").exists()


def test_html_needs_every_chapter_executed(book):
    execute_chapter(book, "01_first", "smoke", progress=False)
    with pytest.raises(PipelineError, match="not executed yet: 02_second"):
        build_html(book)


LEDGER = chapter_source(
    "Ledger",
    'build_dir = "_build"\n',
    """\

```{code-cell} ipython3
import json
from pathlib import Path

from grpo_companion.machinery.report import ChapterReport

report = ChapterReport("03_ledger", output_dir, profile, seed)
first = json.loads((Path(build_dir) / "results" / "01_first.json").read_text())
report.record("first_total", first["values"]["total"])
report.record("build_dir", build_dir)
report.write();
```

The first chapter's total is {glue:text}`first_total`, its figure
[a line](../figures/01_first/line.png).
""",
)


def test_a_chapter_that_declares_build_dir_reads_the_build_and_links_its_figures(book, capsys):
    (book.root / "book" / "03_ledger.md").write_text(LEDGER)
    toc = book.root / "_toc.yml"
    toc.write_text(toc.read_text() + "  - file: book/03_ledger\n")
    argv = ["--root", str(book.root), "run", "03_ledger", "-p", "build_dir", "elsewhere"]
    assert main(argv) == 1
    assert "parameter 'build_dir' is set by the pipeline" in capsys.readouterr().err
    assert "build_dir" not in resolve_parameters(book, "03_ledger", "smoke")

    for chapter in book.chapters:
        execute_chapter(book, chapter, "smoke", progress=False)
    values = json.loads(book.results_path("03_ledger").read_text())["values"]
    assert values == {"first_total": 1.0, "build_dir": str(book.build_dir)}  # smoke: 2 x 0.5
    html = build_html(book)
    assert (book.build_dir / "source" / "figures" / "01_first" / "line.png").exists()
    assert len(list((html / "_downloads").rglob("line.png"))) == 1


def test_the_published_notebook_shows_what_the_chapter_needs_and_no_path_of_the_machine(book):
    execute_chapter(book, "01_first", "smoke", {"rate": 0.25}, progress=False)
    assert not (book.build_dir / "timings").exists()  # a run with overrides is not the profile's
    execute_chapter(book, "01_first", "smoke", progress=False)
    assert list(load_timings(book.build_dir)) == ["smoke"]
    notebook_path = book.build_dir / "source" / "book" / "01_first.ipynb"
    text = notebook_path.read_text()
    # papermill's injected cell and its notes of the paths it read and wrote are gone
    for path in (str(book.root), str(book.build_dir), "/tmp/"):
        assert path not in text
    notebook = json.loads(text)
    assert not [cell for cell in notebook["cells"] if "injected-parameters" in str(cell)]
    title = "".join(notebook["cells"][0]["source"])
    assert title.startswith("# First\n\n```{admonition} What this chapter needs")
    assert "`cpu` not measured yet, `smoke` " in title and " min. Re-run it" in title
    assert "| `num_samples` | `2` | profile `smoke` |" in title
    assert "| `rate` | `0.5` | default |" in title

    provenance = json.loads(book.results_path("01_first").read_text())["provenance"]
    assert field_problems(provenance) == []
    assert provenance["profile"] == "smoke" and provenance["seed"] == 0
    assert provenance["parameters"] == {"seed": 0, "num_samples": 2, "rate": 0.5, "fail": False}
    assert provenance["command"] == "python -m grpo_companion run 01_first --profile smoke"
    assert provenance["commit"] is None  # the fixture book is no git checkout
    assert 0 < provenance["wall_seconds"] and 0 < provenance["cpu_seconds"]
