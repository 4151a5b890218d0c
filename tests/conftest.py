import subprocess
from pathlib import Path

import pytest
import torch

from grpo_companion.core.policy_gradient import SequencePolicy, sum_mod_reward
from grpo_companion.lm.gsm8k import build_prompts, load_gsm8k
from grpo_companion.lm.tiny_llama import TinyLlamaSpec, warm_start
from grpo_companion.machinery.pipeline import Project, build_html, execute_chapter

ROOT = Path(__file__).resolve().parents[1]

# A random-init Llama built through models.py (tokenizer, config, seeding) without training:
# a forward pass costs milliseconds, and its completions are random tokens, so a reward on their
# surface is mixed within groups.
RANDOM_TINY = TinyLlamaSpec(
    num_hidden_layers=2,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=2,
    train_steps=0,
    num_train_examples=200,
    num_eval_examples=2,
    max_completion_length=4,
    num_threads=1,
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """On a busy 2-core machine, syncing two threads costs ~10x the arithmetic of the tiny
    tensors these tests use; the global setting is restored after each module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def random_tiny(one_thread):
    """(model, tokenizer) of `RANDOM_TINY`; tests that train it must copy it first."""
    model, tokenizer, _ = warm_start(RANDOM_TINY, progress=False)
    return model, tokenizer


@pytest.fixture(scope="module")
def arithmetic_prompts(random_tiny):
    """(prompts, golds) of 3 arithmetic test problems (seed 1) in `random_tiny`'s chat format:
    prompts of different lengths, so that a batch of them is left-padded."""
    data = load_gsm8k("test", source="arithmetic", num_examples=3, seed=1)
    return build_prompts(random_tiny[1], data)


def sum_mod_setup(vocab_size: int, length: int, seed: int, scale: float = 1.5):
    """(policy, logits, rewards): chapter 1's enumerable sequence policy at `init_logits(seed,
    scale)` with its sum-mod reward, the set-up most exact tests start from."""
    policy = SequencePolicy(vocab_size=vocab_size, length=length)
    logits = policy.init_logits(seed, scale=scale)
    return policy, logits, sum_mod_reward(policy.all_sequences(), vocab_size)


@pytest.fixture
def sum_mod_policy():
    """`sum_mod_setup`, as a fixture: call it with (vocab_size, length, seed[, scale])."""
    return sum_mod_setup


@pytest.fixture
def close_figures():
    """Close every matplotlib figure after the test (`pytest.mark.usefixtures` in a module of
    figure tests)."""
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def _git_status() -> str:
    return subprocess.run(
        ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True
    ).stdout


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """(project, seconds per chapter, git status before) after executing every chapter under
    the smoke profile and rendering the book: once per session, for tests/book/test_book.py and
    tests/machinery/test_pdf.py."""
    status_before = _git_status()
    project = Project(ROOT, build_dir=tmp_path_factory.mktemp("book") / "_build")
    timings = {
        chapter: execute_chapter(project, chapter, "smoke", progress=False)
        for chapter in project.chapters
    }
    build_html(project)
    return project, timings, status_before
