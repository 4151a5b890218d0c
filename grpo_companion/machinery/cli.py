"""Command line of the book: `python -m grpo_companion {list,run,book,html,pdf,fingerprint}`.

Every command and subcommand answers `--help` with what it does and an example. A command that
writes into the build folder holds its lock (`build_lock`): one run per folder at a time.
"""

import argparse
import json
import sys
import textwrap
import time
from pathlib import Path

from tqdm import tqdm

from grpo_companion.machinery import fingerprint
from grpo_companion.machinery.build_lock import BuildLocked, build_lock
from grpo_companion.machinery.pipeline import (
    PipelineError,
    Project,
    build_html,
    chapter_parameters,
    execute_chapter,
    parse_value,
)

DESCRIPTION = """\
Execute the GRPO Companion's chapters with papermill and render the book with Jupyter Book.
Outputs go under ROOT/_build: executed notebooks, figures/<chapter>/, results/<chapter>.json,
and html/."""

EXAMPLES = """\
examples:
  python -m grpo_companion list
  python -m grpo_companion run 01_policy_gradient -p num_repeats 50
  python -m grpo_companion book --profile smoke
  python -m grpo_companion --build-dir /tmp/book html
  python -m grpo_companion pdf
  python -m grpo_companion fingerprint --check smoke"""

# name: (what it does, in one line; more; an example)
COMMANDS = {
    "list": (
        "list the chapters, their parameters and the profiles",
        "Each chapter with its parameters (name: default), then the profiles of "
        "book/profiles.toml.",
        "python -m grpo_companion list",
    ),
    "run": (
        "execute chapters (no HTML)",
        "Execute the named chapters in order under a profile, with optional parameter overrides. "
        "A chapter's notebook, figures and results are published only once all its cells "
        "succeeded and it recorded only the keys and figures its code declares.",
        "python -m grpo_companion run 10_group_size --profile smoke -p group_sizes '[2, 4, 8]'",
    ),
    "book": (
        "execute every chapter, then build the HTML",
        "Execute every chapter of the book under a profile, then render the HTML with Sphinx "
        "warnings as errors, and say whether every recorded value reproduces the profile's "
        "stored fingerprint (book/fingerprints/PROFILE.yml).",
        "python -m grpo_companion book --profile smoke",
    ),
    "html": (
        "build the HTML from the chapters executed so far",
        "Render the HTML from the executed chapters under the build folder (every chapter must "
        "have run), with Sphinx warnings as errors.",
        "python -m grpo_companion html",
    ),
    "pdf": (
        "print the built HTML into one PDF",
        "Print every page of the built HTML, in the order of _toc.yml, with headless Chromium "
        "once MathJax has typeset it, and merge the pages into ROOT/_build/pdf/book.pdf with one "
        "bookmark per page. Needs the HTML (`book` or `html` first) and Debian's chromium and "
        "chromium-driver (`make browser`).",
        "python -m grpo_companion pdf",
    ),
    "fingerprint": (
        "store or check the fingerprint of a build's values",
        "Write the fingerprint of the build's recorded values (a SHA-256 per chapter over its "
        "values, floats by their exact bits, timings and provenance left out, and each value or "
        "its digest) to book/fingerprints/PROFILE.yml; with --check, compare the build with that "
        "file instead: exit 0 when it reproduces it bit for bit, else 1, naming every chapter and "
        "value that differs.",
        "python -m grpo_companion fingerprint --check cpu",
    ),
}
WRITES_BUILD = ("run", "book", "html", "pdf")


def _parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="python -m grpo_companion",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=formatter,
    )
    parser.add_argument(
        "--root", type=Path, default=Path.cwd(), help="the book's folder (default: here)"
    )
    parser.add_argument("--build-dir", type=Path, help="where outputs go (default: ROOT/_build)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (summary, text, example) in COMMANDS.items():
        command = commands.add_parser(
            name,
            help=summary,
            description=textwrap.fill(text, 79),
            epilog=f"example:\n  {example}",
            formatter_class=formatter,
        )
        if name in ("run", "book"):
            command.add_argument(
                "--profile",
                default="cpu",
                help="parameter profile of book/profiles.toml: smoke, cpu or gpu (default: cpu)",
            )
            command.add_argument(
                "--no-progress", action="store_true", help="hide papermill's cell progress bar"
            )
        if name == "fingerprint":
            command.add_argument("profile", help="the build's profile: smoke, cpu or gpu")
            command.add_argument(
                "--check", action="store_true", help="compare with the stored fingerprint"
            )
        if name == "run":
            command.add_argument(
                "chapters", nargs="+", metavar="CHAPTER", help="a chapter's name, e.g. 05_credit"
            )
            command.add_argument(
                "-p",
                "--parameter",
                nargs=2,
                action="append",
                default=[],
                metavar=("NAME", "VALUE"),
                help="override a parameter of the named chapters (repeatable); VALUE is a Python "
                "literal or else a string",
            )
    return parser


def _execute(
    project: Project, chapters: list[str], profile: str, overrides: dict, progress: bool
) -> dict[str, float]:
    for chapter in chapters:
        project.source(chapter)  # unknown names fail before anything runs
    timings = {}
    for chapter in tqdm(chapters, desc="chapters", unit="chapter", disable=len(chapters) == 1):
        timings[chapter] = execute_chapter(project, chapter, profile, overrides, progress)
    return timings


def _print_timings(project: Project, profile: str, timings: dict[str, float]) -> None:
    path = project.build_dir / "timings.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"profile": profile, "seconds": timings}, indent=2) + "\n")
    width = max(map(len, timings))
    print(f"\nprofile {profile}: seconds per chapter")
    for chapter, seconds in timings.items():
        print(f"  {chapter:<{width}}  {seconds:7.1f}")


def _fingerprint(project: Project, profile: str, check: bool) -> int:
    results = project.build_dir / "results"
    measured = fingerprint.build_fingerprint(results, project.chapters)
    profiles = {json.loads((results / f"{c}.json").read_text())["profile"] for c in measured}
    if not measured or profiles != {profile}:
        found = ", ".join(sorted(profiles)) or "none"
        raise PipelineError(
            f"{results} holds no {profile} build (profiles found: {found}); run "
            f"`python -m grpo_companion book --profile {profile}` first"
        )
    stored = fingerprint.stored_path(project.root, profile)
    if check:
        if not stored.exists():
            raise PipelineError(f"no stored fingerprint {stored}; write it without --check")
        lines = fingerprint.differences(fingerprint.load(stored), measured)
        for line in lines:
            print(line)
        verdict = "does not reproduce" if lines else "reproduces"
        print(f"the {profile} build {verdict} {stored.relative_to(project.root)}")
        return 1 if lines else 0
    missing = [chapter for chapter in project.chapters if chapter not in measured]
    if missing:
        raise PipelineError(f"the build lacks {', '.join(missing)}: run every chapter first")
    stored.parent.mkdir(parents=True, exist_ok=True)
    stored.write_bytes(fingerprint.dumps(measured))
    print(f"wrote {stored.relative_to(project.root)} ({len(measured)} chapters)")
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    project = Project(args.root, args.build_dir)
    try:
        if args.command in WRITES_BUILD:
            with build_lock(project.build_dir):
                return _command(project, args)
        return _command(project, args)
    except (PipelineError, BuildLocked) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


def _command(project: Project, args) -> int:
    """Run one parsed command; the exit status."""
    if args.command == "fingerprint":
        return _fingerprint(project, args.profile, args.check)
    if args.command == "list":
        for chapter in project.chapters:
            print(chapter, chapter_parameters(project.source(chapter)))
        print("profiles:", ", ".join(project.profiles))
        return 0
    if args.command in ("run", "book"):
        overrides = {name: parse_value(value) for name, value in getattr(args, "parameter", [])}
        chapters = args.chapters if args.command == "run" else project.chapters
        timings = _execute(project, chapters, args.profile, overrides, not args.no_progress)
        _print_timings(project, args.profile, timings)
    if args.command in ("book", "html"):
        start = time.perf_counter()
        html = build_html(project)
        seconds = time.perf_counter() - start
        print(f"built the HTML in {seconds:.1f} s; open {html / 'index.html'}")
    if args.command == "book" and fingerprint.stored_path(project.root, args.profile).exists():
        print("\nthe book's numbers, checked against the stored fingerprint:")
        _fingerprint(project, args.profile, check=True)
    if args.command == "pdf":
        from grpo_companion.machinery.pdf import build_pdf

        start = time.perf_counter()
        pdf = build_pdf(project)
        print(f"printed the PDF in {time.perf_counter() - start:.1f} s: {pdf}")
    return 0
