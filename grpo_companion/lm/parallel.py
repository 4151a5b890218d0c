"""Runs in parallel: each run of a multi-seed experiment in its own one-thread worker process,
as many workers as cores.

The book's models are small: a GRPO run of the tiny Llama is only about 1.5x faster on two
threads than on one, while two one-thread processes, one per core, run two seeds in about the
time of one, about 1.3x the seeds per minute (benchmarks/parallel_seeds.py). A run that is a
pure function of its key (its seed, its arm) gives the same result in a worker as
`map_runs(..., workers=1)` gives in this process on one thread (tests/lm/test_parallel.py).
With `keep`, each finished run is stored on disk as it ends, so a run that fails (or a build
that is stopped) loses only the runs not yet finished; the folder is named by `run_store`, a
digest of everything the runs depend on. A worker ends with the process that started it, even
one killed outright (`_die_with_parent`): a stopped build leaves no orphans computing on.
"""

import ctypes
import hashlib
import os
import pickle
import signal
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

import torch
from tqdm.auto import tqdm

from grpo_companion.reproducibility import code_path

# The run of the current `map_runs`: forked workers inherit it, so a closure (a lambda that
# loads the model) need not be pickled; only the keys and the results cross between processes.
_RUN = None


def _one_run(key):
    torch.set_num_threads(1)
    try:
        return _RUN(key)
    except BaseException as error:  # its traceback, which the parent cannot see otherwise
        raise RuntimeError(
            f"run {key!r} failed in its worker:\n{traceback.format_exc()}"
        ) from error


def _die_with_parent(parent: int) -> None:
    """Have the kernel end this worker when its parent ends, however it ends (Linux's parent
    death signal; elsewhere a killed parent's workers end when they next find their pipe gone)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def default_workers() -> int:
    """One worker per core this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def map_runs(run, keys, *, workers: int | None = None, desc: str = "runs", progress=False,
             keep: str | Path | None = None) -> dict:  # fmt: skip
    """{key: run(key)} for every key, in order of `keys`.

    run: a function of one key (a seed, or a (method, seed) pair) returning picklable results
    (histories, tables, tensors). workers: processes to use (None: one per core); 1 runs every
    key in this process, on one torch thread, which is what each worker does. A run that raises
    fails the call with its key and traceback once the other runs have finished (a run that
    checkpoints, like chapter 6's probed runs, resumes from there on the next call). keep: a
    folder (`run_store`) where each finished run's result is written as it ends and read back
    instead of running it again on the next call: the finished runs of a failed call are kept.
    """
    global _RUN
    keys = list(keys)
    kept = _read_kept(Path(keep), keys) if keep is not None else {}
    todo = [key for key in keys if key not in kept]

    def finished(key, result):
        if keep is not None:
            _write_kept(Path(keep), key, result)
        return result

    workers = min(workers or default_workers(), len(todo)) or 1
    previous_run, previous_threads = _RUN, torch.get_num_threads()
    _RUN = run
    try:
        done, failures = dict(kept), []
        if workers == 1 or previous_run is not None:  # one worker, or already inside one
            for key in tqdm(todo, desc=desc, disable=not progress):
                done[key] = finished(key, _one_run(key))
            return {key: done[key] for key in keys}
        with ProcessPoolExecutor(
            workers,
            mp_context=get_context("fork"),
            initializer=_die_with_parent,
            initargs=(os.getpid(),),
        ) as pool:
            futures = {pool.submit(_one_run, key): key for key in todo}
            for future in tqdm(
                as_completed(futures), total=len(todo), desc=desc, disable=not progress
            ):
                try:
                    done[futures[future]] = finished(futures[future], future.result())
                except Exception as error:  # keep the others running; report every failure
                    failures.append(error)
        if failures:
            raise failures[0]
        return {key: done[key] for key in keys}
    finally:
        _RUN = previous_run
        torch.set_num_threads(previous_threads)


def run_store(root: str | Path, *parts) -> Path:
    """The folder under `root` for `map_runs(keep=...)` of runs that depend on `parts` (their
    settings, data and starting weights: values with a stable repr, tensors, dicts of them such as
    a state dict, models (their weights), functions (their names) and datasets (their rows)), on
    this package's source code and on the kernels' code path: a digest of all of them names it,
    so any change to what the runs depend on names another folder, and stale results are never
    read."""
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        digest.update(source.read_bytes())
    for part in (code_path(), *parts):
        _digest(digest, part)
    return Path(root) / digest.hexdigest()[:24]


def _digest(digest, part) -> None:
    if isinstance(part, torch.nn.Module):  # its weights
        part = part.state_dict()
    elif callable(part) and hasattr(part, "__qualname__"):  # a function by name, not address
        part = f"{part.__module__}.{part.__qualname__}"
    elif hasattr(part, "column_names") and hasattr(part, "to_dict"):  # a dataset: its rows
        part = part.to_dict()
    if isinstance(part, torch.Tensor):
        digest.update(part.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    elif isinstance(part, dict) and any(isinstance(v, torch.Tensor) for v in part.values()):
        for name in sorted(part):
            digest.update(name.encode())
            _digest(digest, part[name])
    else:
        digest.update(repr(part).encode())


def _kept_path(folder: Path, key) -> Path:
    return folder / f"{hashlib.sha256(repr(key).encode()).hexdigest()[:24]}.pkl"


def _read_kept(folder: Path, keys: list) -> dict:
    """The results `map_runs` kept in `folder` for any of `keys`."""
    kept = {}
    for key in keys:
        path = _kept_path(folder, key)
        if path.exists():
            with open(path, "rb") as file:
                stored_key, result = pickle.load(file)
            if stored_key == repr(key):
                kept[key] = result
    return kept


def _write_kept(folder: Path, key, result) -> None:
    """Store one run's result, atomically: a stopped write leaves no half file behind."""
    folder.mkdir(parents=True, exist_ok=True)
    path = _kept_path(folder, key)
    partial = path.with_suffix(".partial")
    with open(partial, "wb") as file:
        pickle.dump((repr(key), result), file, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(partial, path)
