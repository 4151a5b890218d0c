"""One run at a time per build folder.

A command that writes into a build folder (`run`, `book`, `html`, `pdf`) holds `build_lock` on it
for its whole run: a second one into the same folder is refused in one line that names the first
(its process, command and start), rather than overwriting its results in the middle. The lock is
the operating system's (`filelock`, an advisory lock on `<build>/.lock`), so it ends with its
process however that ends: a dead run's lock is simply taken over. A run that wrote nothing into
a folder it created (bad input, refused before any cell ran) removes the folder again.
"""

import json
import os
import shlex
import sys
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from filelock import FileLock, Timeout


class BuildLocked(Exception):
    """Another process holds the build folder; the message names it."""


@contextmanager
def build_lock(build_dir: Path, command: list[str] | None = None):
    """Hold `build_dir`'s lock while the block runs; raises `BuildLocked` at once if another
    process holds it. `command` (default: this process's arguments) is what a refused run is
    told is running."""
    build_dir = Path(build_dir)
    created = not build_dir.exists()
    build_dir.mkdir(parents=True, exist_ok=True)
    lock, owner = FileLock(build_dir / ".lock", timeout=0), build_dir / ".lock.owner"
    try:
        lock.acquire()
    except Timeout:
        raise BuildLocked(f"{build_dir} is in use by {_describe(owner)}") from None
    try:
        words = command or ["python", "-m", "grpo_companion", *sys.argv[1:]]
        owner.write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "command": shlex.join(words),
                    "since": datetime.now(UTC).isoformat(timespec="seconds"),
                }
            )
        )
        yield
    finally:
        owner.unlink(missing_ok=True)
        if created and [path.name for path in build_dir.iterdir()] == [".lock"]:
            (build_dir / ".lock").unlink()  # a run refused before it wrote anything leaves none
            build_dir.rmdir()
        lock.release()


def _describe(owner: Path) -> str:
    try:
        record = json.loads(owner.read_text())
    except (OSError, ValueError):
        return "another process (starting)"
    return (
        f"process {record['pid']} (`{record['command']}`, since {record['since']}); wait for it "
        f"to end, or give this run another --build-dir"
    )
