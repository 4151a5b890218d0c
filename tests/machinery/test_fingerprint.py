"""machinery/fingerprint.py and build_lock.py: a fingerprint changes with any bit of any recorded
value but not with timings, names what moved, round-trips through its YAML exactly; the CLI
stores and checks it; one run per build folder, a dead run's lock taken over."""

import json
import signal
import subprocess
import sys
import time

import pytest

from grpo_companion.machinery import fingerprint
from grpo_companion.machinery.build_lock import BuildLocked, build_lock
from grpo_companion.machinery.cli import main

VALUES = {
    "p_hat": 0.30000000000000004,
    "tiny": 5e-324,
    "count": 7,
    "verdict": "reproduced",
    "flag": True,
    "curve": [0.1 * i for i in range(20)],
    "train_seconds": 12.5,
    "seconds_per_step": 0.4,
}


def test_a_value_one_bit_away_changes_the_fingerprint():
    base = fingerprint.chapter_fingerprint(VALUES)
    nudged = dict(VALUES, p_hat=0.3)  # the next float below
    assert fingerprint.chapter_fingerprint(nudged)["sha256"] != base["sha256"]
    curve = dict(VALUES, curve=[*VALUES["curve"][:-1], VALUES["curve"][-1] * (1 + 2**-52)])
    assert fingerprint.chapter_fingerprint(curve)["sha256"] != base["sha256"]
    assert fingerprint.chapter_fingerprint(dict(VALUES, count=7.0))["sha256"] != base["sha256"]


def test_timings_are_left_out():
    base = fingerprint.chapter_fingerprint(VALUES)
    slower = fingerprint.chapter_fingerprint(dict(VALUES, train_seconds=99.0, seconds_per_step=1))
    assert slower == base
    assert "train_seconds" not in base["values"] and "seconds_per_step" not in base["values"]
    assert not fingerprint.is_timing("clipped_kl_change_second_half")


def test_differences_name_the_chapter_and_the_values():
    stored = {"01_a": fingerprint.chapter_fingerprint(VALUES)}
    same = {"01_a": fingerprint.chapter_fingerprint(dict(VALUES, train_seconds=1.0))}
    assert fingerprint.differences(stored, same) == []
    moved = {"01_a": fingerprint.chapter_fingerprint(dict(VALUES, p_hat=0.3, verdict="no"))}
    (line,) = fingerprint.differences(stored, moved)
    assert line.startswith("01_a: 2 values differ") and "p_hat 0.30000000000000004 -> 0.3" in line
    assert "verdict 'reproduced' -> 'no'" in line
    assert fingerprint.differences(stored, {}) == ["01_a: not in this build"]


def test_the_yaml_holds_every_float_exactly(tmp_path):
    stored = {"01_a": fingerprint.chapter_fingerprint(VALUES)}
    path = tmp_path / "f.yml"
    path.write_bytes(fingerprint.dumps(stored))
    assert fingerprint.load(path) == stored
    assert fingerprint.differences(fingerprint.load(path), stored) == []


def _build(root, profile: str, values: dict):
    results = root / "_build" / "results"
    results.mkdir(parents=True, exist_ok=True)
    for chapter, chapter_values in values.items():
        record = {"chapter": chapter, "profile": profile, "values": chapter_values}
        (results / f"{chapter}.json").write_text(json.dumps(record))


@pytest.fixture
def book(tmp_path):
    """A book of two chapters (empty pages) and a smoke build of both."""
    (tmp_path / "book").mkdir()
    for chapter in ("01_a", "02_b"):
        (tmp_path / "book" / f"{chapter}.md").write_text("# page\n")
    _build(tmp_path, "smoke", {"01_a": VALUES, "02_b": {"x": 1.5}})
    return tmp_path


def test_the_cli_stores_then_checks(book, capsys):
    assert main(["--root", str(book), "fingerprint", "smoke"]) == 0
    assert (book / "book" / "fingerprints" / "smoke.yml").exists()
    assert main(["--root", str(book), "fingerprint", "--check", "smoke"]) == 0
    assert "reproduces" in capsys.readouterr().out
    _build(book, "smoke", {"02_b": {"x": 1.5000000000000002}})
    assert main(["--root", str(book), "fingerprint", "--check", "smoke"]) == 1
    out = capsys.readouterr().out
    assert "02_b: 1 values differ: x 1.5 -> 1.5000000000000002" in out and "01_a" not in out


def test_the_cli_refuses_another_profile_or_a_missing_file(book, capsys):
    assert main(["--root", str(book), "fingerprint", "cpu"]) == 1
    assert "holds no cpu build (profiles found: smoke)" in capsys.readouterr().err
    assert main(["--root", str(book), "fingerprint", "--check", "smoke"]) == 1
    assert "no stored fingerprint" in capsys.readouterr().err


HOLDER = """
import sys, time
from grpo_companion.machinery.build_lock import build_lock
with build_lock(sys.argv[1], ["python", "-m", "grpo_companion", "book", "--profile", "cpu"]):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_second_run_into_a_locked_folder_is_refused_and_a_dead_lock_taken_over(tmp_path, capsys):
    build = tmp_path / "_build"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(build)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        status = main(["--build-dir", str(build), "run", "01_policy_gradient"])
        assert status == 1 and time.monotonic() - start < 5
        error = capsys.readouterr().err
        assert error.count("\n") == 1
        assert f"is in use by process {holder.pid}" in error
        assert "python -m grpo_companion book --profile cpu" in error
        with pytest.raises(BuildLocked):
            with build_lock(build):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with build_lock(build, ["test"]):  # the dead process's lock is taken over
        assert json.loads((build / ".lock.owner").read_text())["command"] == "test"
    assert not (build / ".lock.owner").exists()
