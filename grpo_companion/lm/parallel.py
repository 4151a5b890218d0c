"""Runs in parallel: each run of a multi-seed experiment in its own one-thread worker process,
as many workers as cores.

The book's models are small: one run on two threads is slower than on one (the threads spend
more time agreeing than multiplying), while two one-thread processes, one per core, run two
seeds in about the time of one. A run that is a pure function of its key (its seed, its arm)
gives the same result in a worker as `map_runs(..., workers=1)` gives in this process on one
thread (tests/lm/test_parallel.py).
"""

import os
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context

import torch
from tqdm.auto import tqdm

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


def default_workers() -> int:
    """One worker per core this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def map_runs(run, keys, *, workers: int | None = None, desc: str = "runs", progress=False) -> dict:
    """{key: run(key)} for every key, in order of `keys`.

    run: a function of one key (a seed, or a (method, seed) pair) returning picklable results
    (histories, tables, tensors). workers: processes to use (None: one per core); 1 runs every
    key in this process, on one torch thread, which is what each worker does. A run that raises
    fails the call with its key and traceback once the other runs have finished (a run that
    checkpoints, like chapter 6's probed runs, resumes from there on the next call).
    """
    global _RUN
    keys = list(keys)
    workers = min(workers or default_workers(), len(keys)) or 1
    previous_run, previous_threads = _RUN, torch.get_num_threads()
    _RUN = run
    try:
        if workers == 1 or previous_run is not None:  # one worker, or already inside one
            results = {}
            for key in tqdm(keys, desc=desc, disable=not progress):
                results[key] = _one_run(key)
            return results
        done, failures = {}, []
        with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
            futures = {pool.submit(_one_run, key): key for key in keys}
            for future in tqdm(
                as_completed(futures), total=len(keys), desc=desc, disable=not progress
            ):
                try:
                    done[futures[future]] = future.result()
                except Exception as error:  # keep the others running; report every failure
                    failures.append(error)
        if failures:
            raise failures[0]
        return {key: done[key] for key in keys}
    finally:
        _RUN = previous_run
        torch.set_num_threads(previous_threads)
