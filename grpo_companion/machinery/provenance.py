"""Where a chapter's numbers came from, and what a chapter needs to run.

Every `_build/results/<chapter>.json` carries a `provenance` record, gathered in two places:

- in the kernel, by `ChapterReport.write` (`kernel_provenance`): package versions, torch's thread
  count and CPU capability in force with the pinning variables (`reproducibility.settings`), the
  CPU model, the GPU's name when torch sees one, and the kernel's CPU seconds;
- in the pipeline, after the chapter ran (`pipeline_provenance`): the git commit and whether the
  tree was dirty, the profile, every resolved parameter and where it came from, the seed, the
  device, the start time, the wall seconds and the command that re-runs the chapter.

`differences` says where the records of a build's chapters disagree (two builds mixed in one
`_build`), and chapter 12 shows `provenance_markdown`.  The pipeline keeps the seconds of each
chapter's last run per profile (`_build/timings/<profile>.json`, `record_timing`), from which
`header_markdown` writes the top of each chapter's page: what it needs, how long it took, the
command that re-runs it, and the parameters it ran with.

No field holds a path of the machine: records and pages must not say where the book was built.
"""

import importlib.metadata
import json
import platform
import shlex
import subprocess
import time
from pathlib import Path

# Versions recorded for every chapter; python is added from the running interpreter.
PACKAGES = ("torch", "transformers", "trl", "numpy", "datasets", "papermill", "jupyter-book")
# Parameters injected by the pipeline: the profile has its own field, the others are paths.
NOT_PARAMETERS = ("profile", "output_dir", "build_dir")
# The profiles a chapter's header always names, measured or not.
HEADER_PROFILES = ("cpu", "smoke")

# Every field of a provenance record and its type(s): None where the machine has no answer
# (no git checkout, no GPU).
FIELDS = {
    "commit": (str, type(None)),
    "dirty": (bool, type(None)),
    "profile": (str,),
    "parameters": (dict,),
    "parameter_sources": (dict,),
    "seed": (int, type(None)),
    "versions": (dict,),
    "torch_threads": (int,),
    "cpu_capability": (str,),
    "pinning": (dict,),
    "cpu_model": (str,),
    "device": (str,),
    "gpu_name": (str, type(None)),
    "start_time": (str,),
    "wall_seconds": (float,),
    "cpu_seconds": (float,),
    "command": (str,),
}
# The fields on which the chapters of one build must agree; the rest are per chapter.
SHARED_FIELDS = (
    "commit",
    "dirty",
    "profile",
    "versions",
    "cpu_model",
    "gpu_name",
    "torch_threads",
    "cpu_capability",
    "pinning",
)


def package_versions() -> dict[str, str | None]:
    """{'python': '3.11.7', 'torch': ..., ...}; None for a package that is not installed."""
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cpu_model() -> str:
    """The CPU's marketing name where Linux tells it, else what `platform` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def kernel_provenance() -> dict:
    """What only the chapter's kernel knows: called by `ChapterReport.write`, so `cpu_seconds`
    is the kernel process's CPU time (all its threads) from its start to the chapter's end."""
    import torch

    from grpo_companion.reproducibility import settings

    pinning = settings()
    return {
        "versions": package_versions(),
        "torch_threads": pinning.pop("torch_threads"),
        "cpu_capability": pinning.pop("cpu_capability"),
        "pinning": pinning,
        "cpu_model": cpu_model(),
        "gpu_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu_seconds": round(time.process_time(), 3),
    }


def git_state(root: Path) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout holding `root`; (None, None) outside a git checkout.
    Untracked files count as dirty: a new module can change a number as much as an edit."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)

    try:
        commit = git("rev-parse", "HEAD")
    except FileNotFoundError:  # no git on this machine
        return None, None
    if commit.returncode != 0:
        return None, None
    return commit.stdout.strip(), bool(git("status", "--porcelain").stdout.strip())


def command_line(chapter: str, profile: str, overrides: dict | None = None) -> str:
    """The command that re-runs `chapter` as it ran: paths (`--root`, `--build-dir`) left out."""
    words = ["python", "-m", "grpo_companion", "run", chapter, "--profile", profile]
    for name, value in (overrides or {}).items():
        # A string that reads as a literal ('2000') must be quoted to stay a string.
        text = value if isinstance(value, str) and not _is_literal(value) else repr(value)
        words += ["-p", name, text]
    return shlex.join(words)


def _is_literal(text: str) -> bool:
    import ast

    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return False
    return True


def pipeline_provenance(
    root: Path,
    chapter: str,
    profile: str,
    parameters: dict,
    sources: dict,
    overrides: dict | None,
    start_time: str,
    wall_seconds: float,
) -> dict:
    """What the pipeline knows of one run; `parameters` are every parameter the chapter ran
    with (defaults, profile and overrides merged), `sources` where each came from."""
    commit, dirty = git_state(root)
    kept = {name: value for name, value in parameters.items() if name not in NOT_PARAMETERS}
    return {
        "commit": commit,
        "dirty": dirty,
        "profile": profile,
        "parameters": kept,
        "parameter_sources": {name: sources[name] for name in kept},
        "seed": kept.get("seed"),
        "device": str(kept.get("device", "cpu")),
        "start_time": start_time,
        "wall_seconds": round(wall_seconds, 3),
        "command": command_line(chapter, profile, overrides),
    }


def field_problems(record: dict) -> list[str]:
    """Missing fields and fields of the wrong type in a provenance record."""
    problems = [f"missing {name}" for name in FIELDS if name not in record]
    problems += [
        f"{name} is {type(record[name]).__name__}"
        for name, types in FIELDS.items()
        if name in record and not isinstance(record[name], types)
    ]
    return problems


def load_provenance(build_dir: Path) -> dict[str, dict | None]:
    """{chapter: provenance record, or None for results written before provenance existed}."""
    records = {}
    for path in sorted((Path(build_dir) / "results").glob("[0-9][0-9]_*.json")):
        records[path.stem] = json.loads(path.read_text()).get("provenance")
    return records


def differences(records: dict[str, dict | None]) -> list[str]:
    """One line per shared field on which the chapters disagree, e.g. "commit: abc1234
    (01_policy_gradient, 02_group_baseline), def5678 (05_credit)"; versions compared package
    by package. Empty when all chapters come from one build."""
    lines = []
    missing = [chapter for chapter, record in records.items() if record is None]
    if missing:
        lines.append(f"no provenance recorded: {', '.join(missing)}")
    present = {chapter: record for chapter, record in records.items() if record is not None}
    keys = [(name,) for name in SHARED_FIELDS if name != "versions"]
    packages = sorted({p for record in present.values() for p in record.get("versions", {})})
    keys += [("versions", package) for package in packages]
    for key in keys:
        groups: dict[str, list[str]] = {}
        for chapter, record in present.items():
            value = record.get(key[0])
            if len(key) == 2:
                value = (value or {}).get(key[1])
            shown = value[:7] if key == ("commit",) and isinstance(value, str) else value
            groups.setdefault(json.dumps(shown), []).append(chapter)
        if len(groups) > 1:
            parts = [f"{value} ({', '.join(chapters)})" for value, chapters in groups.items()]
            lines.append(f"{' '.join(key)}: {'; '.join(parts)}")
    return lines


def provenance_markdown(build_dir: Path) -> str:
    """Chapter 12's table: one row per chapter of the build, the package versions, the machine,
    and where the chapters disagree."""
    records = load_provenance(build_dir)
    rows = [
        "| chapter | commit | dirty | profile | seed | wall s | CPU s | threads | device |",
        "|---|---|---|---|---|---:|---:|---:|---|",
    ]
    for chapter, record in records.items():
        if record is None:
            rows.append(f"| {chapter} | no provenance recorded |  |  |  |  |  |  |  |")
            continue
        commit = (record.get("commit") or "none")[:7]
        device = record.get("device", "")
        if record.get("gpu_name") and device.startswith("cuda"):
            device = f"{device} ({record['gpu_name']})"
        rows.append(
            f"| {chapter} | `{commit}` | {_yes_no(record.get('dirty'))} | "
            f"`{record.get('profile')}` | {record.get('seed')} | "
            f"{record.get('wall_seconds', 0):.1f} | {record.get('cpu_seconds', 0):.1f} | "
            f"{record.get('torch_threads')} | {device} |"
        )
    present = [record for record in records.values() if record is not None]
    text = "\n".join(rows)
    if present:
        versions = present[0].get("versions", {})
        # python first, then the packages by name (results.json sorts its keys)
        names = sorted(versions, key=lambda name: (name != "python", name))
        text += "\n\nPackages: " + ", ".join(
            f"{name} {versions[name]}" for name in names if versions[name]
        )
        gpu = present[0].get("gpu_name") or "none"
        text += f". CPU: {present[0].get('cpu_model')}; GPU: {gpu}."
        pinning = present[0].get("pinning") or {}
        if pinning.get("pinned"):
            text += (
                f" Kernels pinned to the {present[0].get('cpu_capability')} code path "
                f"({', '.join(f'`{k}={v}`' for k, v in pinning['environment'].items())})."
            )
        elif pinning:
            text += " **Kernels not pinned**: numbers may differ from the book's."
    found = differences(records)
    if found:
        text += "\n\n**The chapters of this build differ in:**\n\n" + "\n".join(
            f"- {line}" for line in found
        )
    else:
        text += (
            "\n\nEvery chapter ran from the same commit, profile, packages and machine "
            "(same CPU, GPU and thread count)."
        )
    return text + "\n"


def _yes_no(flag: bool | None) -> str:
    return "unknown" if flag is None else ("yes" if flag else "no")


def timings_path(build_dir: Path, profile: str) -> Path:
    return Path(build_dir) / "timings" / f"{profile}.json"


def record_timing(build_dir: Path, profile: str, chapter: str, seconds: float) -> None:
    """Merge one chapter's seconds into the profile's timings; other chapters keep theirs."""
    path = timings_path(build_dir, profile)
    timings = json.loads(path.read_text()) if path.exists() else {}
    timings[chapter] = round(seconds, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(sorted(timings.items())), indent=2) + "\n")


def load_timings(build_dir: Path) -> dict[str, dict[str, float]]:
    """{profile: {chapter: seconds of its last run under that profile}}."""
    folder = Path(build_dir) / "timings"
    return {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}


def needs_line(chapter: str, timings: dict[str, dict[str, float]], devices: dict[str, str]) -> str:
    """What `chapter` needs, how long it last took and how to re-run it, in one paragraph.
    `devices`: {profile: the device the chapter runs on under it}."""
    gpu = sorted(profile for profile, device in devices.items() if device.startswith("cuda"))
    if gpu:
        cpu = sorted(set(devices) - set(gpu))
        needs = (
            f"Runs on a CPU under {_profiles(cpu)}; {_profiles(gpu)} "
            f"{'needs' if len(gpu) == 1 else 'need'} a CUDA GPU."
        )
    else:
        needs = "Runs on a CPU under every profile."
    profiles = list(HEADER_PROFILES) + sorted(set(timings) - set(HEADER_PROFILES))
    measured = ", ".join(
        f"`{profile}` {_minutes(timings[profile][chapter])}"
        if chapter in timings.get(profile, {})
        else f"`{profile}` not measured yet"
        for profile in profiles
    )
    command = f"python -m grpo_companion run {chapter} -p seed 1"
    return (
        f"{needs} Last measured: {measured}. "
        f"Re-run it with a changed parameter, any of the table below: `{command}`."
    )


def _profiles(names: list[str]) -> str:
    quoted = [f"`{name}`" for name in names]
    text = " and ".join(quoted) if len(quoted) <= 2 else ", ".join(quoted)
    return f"the {text} profile{'s' if len(quoted) > 1 else ''}"


def _minutes(seconds: float) -> str:
    return f"{max(seconds / 60, 0.1):.1f} min"


def parameter_table(parameters: dict, sources: dict, profile: str) -> str:
    """Markdown table of the parameters a chapter ran with: name, value, where it came from."""
    rows = ["| parameter | value | from |", "|---|---|---|"]
    for name, value in parameters.items():
        if name in NOT_PARAMETERS:
            continue
        shown = repr(value).replace("|", "\\|")
        source = sources[name] if sources[name] != "profile" else f"profile `{profile}`"
        rows.append(f"| `{name}` | `{shown}` | {source} |")
    return "\n".join(rows)


def header_markdown(
    chapter: str,
    profile: str,
    parameters: dict,
    sources: dict,
    timings: dict[str, dict[str, float]],
    devices: dict[str, str],
) -> str:
    """The MyST the pipeline puts under a chapter's title: the needs line, then the parameters
    of this run in a collapsed box."""
    return (
        f"```{{admonition}} What this chapter needs\n:class: note\n"
        f"{needs_line(chapter, timings, devices)}\n```\n\n"
        # No backticks in a fence's title: CommonMark would not read the fence as one.
        f"````{{admonition}} The parameters of this run (profile {profile})\n"
        f":class: dropdown\n{parameter_table(parameters, sources, profile)}\n````\n"
    )
