"""lm/parallel.py: a run in a worker process gives what it gives in this process on one thread,
every key comes back in order, and a failing run fails the map with its key and traceback."""

import copy

import pytest
import torch

from grpo_companion.lm.config import GRPOConfig
from grpo_companion.lm.gsm8k import load_gsm8k
from grpo_companion.lm.parallel import map_runs
from grpo_companion.lm.trainer import train

CONFIG = GRPOConfig(
    num_generations=4,
    per_step_prompts=2,
    max_completion_length=6,
    learning_rate=1e-2,
    max_steps=2,
    eval_every=2,
)


def has_digit(completion: str, gold: str) -> float:
    return float(any(character.isdigit() for character in completion))


def test_seeds_in_workers_give_the_sequential_results(random_tiny):
    model, tokenizer = random_tiny
    train_data = load_gsm8k("train", source="arithmetic", num_examples=6, seed=0)
    eval_data = load_gsm8k("test", source="arithmetic", num_examples=2, seed=0)

    def run(seed):
        policy = copy.deepcopy(model)
        config = GRPOConfig(**{**vars(CONFIG), "seed": seed})
        history = train(policy, tokenizer, train_data, eval_data, config, reward_fn=has_digit,
                        progress=False)  # fmt: skip
        return history, policy.model.embed_tokens.weight.detach().clone()

    threads = torch.get_num_threads()
    sequential = map_runs(run, [0, 1, 2], workers=1)
    parallel = map_runs(run, [0, 1, 2], workers=2)
    assert list(parallel) == [0, 1, 2] and torch.get_num_threads() == threads
    for seed in (0, 1, 2):
        assert parallel[seed][0] == sequential[seed][0]  # every metric of every step
        assert torch.equal(parallel[seed][1], sequential[seed][1])  # the trained weights
    # the seeds differ: the equality above is not that of three identical runs
    assert not torch.equal(sequential[0][1], sequential[1][1])


def test_a_failing_run_fails_the_map_with_its_key_and_traceback():
    def run(key):
        if key == "b":
            raise ValueError("no such arm")
        return key * 2

    with pytest.raises(
        RuntimeError, match=r"run 'b' failed in its worker:(.|\n)*ValueError: no such arm"
    ):
        map_runs(run, ["a", "b", "c"], workers=2)
    assert map_runs(run, ["a", "c"], workers=2) == {"a": "aa", "c": "cc"}


def test_kept_runs_survive_a_failed_map_and_are_not_run_again(tmp_path):
    from grpo_companion.lm.parallel import run_store

    store = run_store(tmp_path, {"learning_rate": 1e-5}, ["question one"])
    log = tmp_path / "ran.txt"

    def run(key):
        with open(log, "a") as file:  # workers are processes: count the runs in a file
            file.write(f"{key}\n")
        if key == "b" and not (tmp_path / "fixed").exists():
            raise ValueError("no such arm")
        return {"key": key, "weights": torch.full((2,), float(len(key)))}

    with pytest.raises(RuntimeError, match="no such arm"):
        map_runs(run, ["a", "b", "cc"], workers=2, keep=store)
    assert sorted(log.read_text().split()) == ["a", "b", "cc"]
    (tmp_path / "fixed").touch()
    log.unlink()
    results = map_runs(run, ["a", "b", "cc"], workers=1, keep=store)
    assert log.read_text().split() == ["b"]  # a and cc were kept
    assert list(results) == ["a", "b", "cc"]
    assert torch.equal(results["cc"]["weights"], torch.tensor([2.0, 2.0]))
    assert not list(store.glob("*.partial"))


def test_run_store_is_named_by_everything_the_runs_depend_on(tmp_path):
    from grpo_companion.lm.parallel import run_store

    weights = {"w": torch.zeros(3), "b": torch.ones(1)}
    same = run_store(tmp_path, {"learning_rate": 1e-5}, weights)
    assert run_store(tmp_path, {"learning_rate": 1e-5}, dict(weights)) == same
    assert run_store(tmp_path, {"learning_rate": 3e-5}, weights) != same
    moved = {"w": torch.tensor([0.0, 0.0, 1e-7]), "b": torch.ones(1)}
    assert run_store(tmp_path, {"learning_rate": 1e-5}, moved) != same
    assert same.parent == tmp_path


def test_run_store_reads_models_functions_and_datasets_by_their_content(tmp_path):
    from grpo_companion.lm.parallel import run_store

    model = torch.nn.Linear(3, 2)
    assert run_store(tmp_path, model) == run_store(tmp_path, model.state_dict())
    name = f"{has_digit.__module__}.{has_digit.__qualname__}"  # not its address
    assert run_store(tmp_path, has_digit) == run_store(tmp_path, name)
    data = load_gsm8k("test", source="arithmetic", num_examples=2, seed=0)
    assert run_store(tmp_path, data) == run_store(tmp_path, data.to_dict())
    other = load_gsm8k("test", source="arithmetic", num_examples=2, seed=1)
    assert run_store(tmp_path, other) != run_store(tmp_path, data)


WORKERS_THAT_OUTLIVE = """
import os, sys, time
import grpo_companion
from grpo_companion.lm.parallel import map_runs

folder = sys.argv[1]

def run(key):
    open(os.path.join(folder, f"{key}.pid"), "w").write(str(os.getpid()))
    time.sleep(120)

map_runs(run, [0, 1], workers=2)
"""


def test_workers_end_when_their_parent_is_killed(tmp_path):
    """A build killed outright (SIGKILL) takes its seed workers with it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(WORKERS_THAT_OUTLIVE)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = [int(path.read_text()) for path in tmp_path.glob("*.pid")]
        assert len(workers) == 2
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()

    def alive(pid: int) -> bool:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        return state != "Z"

    deadline = time.monotonic() + 10
    while any(map(alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in workers if alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert survivors == []
