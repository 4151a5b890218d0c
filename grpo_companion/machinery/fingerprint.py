"""A fingerprint of every value a build recorded, to check that a machine reproduces the book.

Per chapter: a SHA-256 over its recorded values (`results/<chapter>.json`'s `values`, floats by
their exact bits, `float.hex`), timings (keys named `seconds`) and provenance left out; beside it
each value, short ones as they are (YAML writes a float's shortest exact form), others as their
own digest, so that a check names what moved. Stored per profile in `book/fingerprints/`, as the
YAML that pytest-regressions' `data_regression` reads and writes: `make test` checks the smoke
build against `smoke.yml` with it, and `python -m grpo_companion fingerprint --check PROFILE`
checks a build against its profile's file.
"""

import hashlib
import json
import re
from pathlib import Path

import yaml

# A recorded key that is a timing: `seconds`, `train_seconds`, `seconds_per_step`.
TIMING = re.compile(r"(^|_)seconds(_|$)")
SHORT = 40  # characters: a value whose JSON is longer is stored as its digest


def is_timing(key: str) -> bool:
    return bool(TIMING.search(key))


def _exact(value):
    """`value` with every float replaced by its exact bits, `float.hex`."""
    if isinstance(value, float):
        return {"float": value.hex()}
    if isinstance(value, dict):
        return {str(key): _exact(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_exact(item) for item in value]
    return value


def digest(value) -> str:
    """SHA-256 of a JSON value, floats by their exact bits."""
    text = json.dumps(_exact(value), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _entry(value):
    """What the fingerprint keeps of one value: itself if short, else its digest."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if len(json.dumps(value)) <= SHORT:
        return value
    return f"sha256:{digest(value)[:16]}"


def chapter_fingerprint(values: dict) -> dict:
    """{'sha256': over every recorded value but timings, 'values': {key: entry}}."""
    kept = {key: value for key, value in values.items() if not is_timing(key)}
    return {"sha256": digest(kept), "values": {key: _entry(kept[key]) for key in sorted(kept)}}


def build_fingerprint(results_dir: Path, chapters: list[str]) -> dict:
    """{chapter: chapter_fingerprint} for every chapter of the build that has results."""
    found = {}
    for chapter in chapters:
        path = Path(results_dir) / f"{chapter}.json"
        if path.exists():
            found[chapter] = chapter_fingerprint(json.loads(path.read_text())["values"])
    return found


def differences(stored: dict, measured: dict) -> list[str]:
    """One line per chapter and value where `measured` does not reproduce `stored`."""
    lines = []
    for chapter in sorted(set(stored) | set(measured)):
        if chapter not in measured:
            lines.append(f"{chapter}: not in this build")
            continue
        if chapter not in stored:
            lines.append(f"{chapter}: no stored fingerprint")
            continue
        old, new = stored[chapter], measured[chapter]
        if old["sha256"] == new["sha256"]:
            continue
        moved = []
        for key in sorted(set(old["values"]) | set(new["values"])):
            before, after = old["values"].get(key, "(absent)"), new["values"].get(key, "(absent)")
            if _bits(before) != _bits(after):
                moved.append(f"{key} {before!r} -> {after!r}")
        lines.append(f"{chapter}: {len(moved)} values differ: " + "; ".join(moved))
    return lines


def _bits(entry):
    return digest(entry) if not isinstance(entry, str) else entry


def stored_path(root: Path, profile: str) -> Path:
    return Path(root) / "book" / "fingerprints" / f"{profile}.yml"


def dumps(fingerprint: dict) -> bytes:
    """The YAML `data_regression` writes (its dumper and options), so either can write it."""
    from pytest_regressions.data_regression import RegressionYamlDumper

    return yaml.dump_all(
        [fingerprint],
        Dumper=RegressionYamlDumper,
        default_flow_style=False,
        allow_unicode=True,
        indent=2,
        encoding="utf-8",
    )


def load(path: Path) -> dict:
    return yaml.safe_load(Path(path).read_text())
