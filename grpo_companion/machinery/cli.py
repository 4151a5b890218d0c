"""Command line: `python -m grpo_companion {list,run,book,html}`; `--help` on each says more.

python -m grpo_companion book --profile smoke           # every chapter, then the HTML
python -m grpo_companion run 01_policy_gradient -p num_repeats 50
"""

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from grpo_companion.machinery.pipeline import PipelineError, Project, build_html, execute_chapter, parse_value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m grpo_companion", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--root", type=Path, default=Path.cwd(), help="the book's folder (default: here)"
    )
    parser.add_argument("--build-dir", type=Path, help="where outputs go (default: ROOT/_build)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="chapters, their parameters and the profiles")
    for name, text in (
        ("run", "execute chapters (no HTML)"),
        ("book", "execute every chapter, then build the HTML"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument(
            "--profile",
            default="cpu",
            help="parameter profile from book/profiles.toml (default: cpu)",
        )
        if name == "run":
            command.add_argument("chapters", nargs="+", metavar="CHAPTER")
            command.add_argument(
                "-p",
                "--parameter",
                nargs=2,
                action="append",
                default=[],
                metavar=("NAME", "VALUE"),
                help="override a parameter of the named chapters (repeatable)",
            )
        command.add_argument(
            "--no-progress", action="store_true", help="hide papermill's cell progress bar"
        )
    commands.add_parser("html", help="build the HTML from the chapters executed so far")
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


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    project = Project(args.root, args.build_dir)
    try:
        if args.command == "list":
            from grpo_companion.machinery.pipeline import chapter_parameters

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
            print(
                f"built the HTML in {time.perf_counter() - start:.1f} s; open {html / 'index.html'}"
            )
    except PipelineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


