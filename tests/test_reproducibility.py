"""grpo_companion.reproducibility: every process that imports the package computes on the pinned
code path (AVX2, one thread), a machine that cannot is refused in one line, and a process in
which torch or numpy already chose another path is refused rather than run."""

import os
import subprocess
import sys

import pytest
import torch

from grpo_companion import reproducibility
from grpo_companion.reproducibility import ENVIRONMENT, missing_instructions


def _python(code: str, **env) -> subprocess.CompletedProcess:
    clean = {key: value for key, value in os.environ.items() if key not in ENVIRONMENT}
    return subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True
    )


def test_this_process_is_pinned():
    """pytest loads the plugin before any test module imports torch (pyproject.toml)."""
    assert torch.backends.cpu.get_cpu_capability() == reproducibility.CAPABILITY
    assert all(os.environ[name] == value for name, value in ENVIRONMENT.items())


def test_importing_the_package_first_pins_a_fresh_process():
    code = (
        "import grpo_companion, torch, numpy\n"
        "from numpy._core._multiarray_umath import __cpu_features__ as f\n"
        "print(torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(),"
        " any(f.get(n) for n in ('X86_V4', 'AVX512_ICL', 'AVX512_SPR')))"
    )
    run = _python(code)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["AVX2", str(reproducibility.THREADS), "False"]


def test_a_path_chosen_before_the_package_is_refused_in_one_line():
    numpy_features = "from numpy._core._multiarray_umath import __cpu_features__ as f"
    avx512 = _python(f"{numpy_features}; print(f['X86_V4'])").stdout.strip() == "True"
    if not avx512:
        pytest.skip("this machine has no AVX-512: numpy's default path is the pinned one")
    run = _python("import numpy\nimport grpo_companion")
    assert run.returncode == 1
    assert run.stderr.strip().count("\n") == 0
    assert "numpy was imported before grpo_companion" in run.stderr
    # the same with the variables already set, as the book's kernels inherit them: no error
    inherited = _python("import numpy, torch\nimport grpo_companion", **ENVIRONMENT)
    assert inherited.returncode == 0, inherited.stderr


def test_opting_out_runs_unpinned_and_says_so():
    code = "import grpo_companion, torch\nprint(grpo_companion.reproducibility.settings())"
    run = _python(code, GRPO_COMPANION_UNPINNED="1")
    assert run.returncode == 0 and "'pinned': False" in run.stdout


@pytest.mark.parametrize(
    ("machine", "flags", "missing"),
    [
        ("x86_64", {"sse2", "avx", "avx2", "fma"}, []),
        ("x86_64", {"sse2", "avx", "avx2", "fma", "avx512f"}, []),
        ("x86_64", {"sse2", "avx"}, ["AVX2", "FMA"]),
        ("x86_64", {"sse2", "avx", "avx2"}, ["FMA"]),
        ("x86_64", None, []),  # no /proc/cpuinfo: torch's capability is checked once it loads
        ("aarch64", None, ["x86-64 (this is aarch64)"]),
        ("arm64", {"neon"}, ["x86-64 (this is arm64)"]),
    ],
)
def test_missing_instructions(machine, flags, missing):
    assert missing_instructions(machine, flags) == missing


def test_a_machine_without_avx2_gets_one_line(monkeypatch):
    monkeypatch.setattr(reproducibility, "_cpu_flags", lambda: {"sse2", "avx"})
    monkeypatch.delenv(reproducibility.OPT_OUT, raising=False)
    with pytest.raises(reproducibility.MachineError, match="lacks AVX2, FMA") as error:
        reproducibility.pin()
    assert "\n" not in str(error.value) and reproducibility.OPT_OUT in str(error.value)
