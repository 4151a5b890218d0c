"""The same numbers on every machine: one code path for torch's, numpy's and their libraries' CPU
kernels, and one thread per computation.

Torch's vectorised kernels (ATen), MKL, oneDNN, numpy's dispatched loops and OpenBLAS each pick
their code at run time from the machine's instruction set, so an AVX2-only machine and an AVX-512
one round differently, and a trained model's weights drift apart within steps. A reduction split
over more threads sums in another order. `pin` sets each library's choice to the AVX2 path, which
every x86-64 machine with AVX2 and FMA runs, and the thread count to `THREADS`, through the
environment variables each library reads when it loads (or, for ATen, at its first operation).

It runs when `grpo_companion` is imported, so it must be imported before torch and numpy in any
process that computes a recorded number; the book's processes all do (`python -m grpo_companion`
sets the environment its chapters' kernels and their workers inherit; pytest loads this module as
a plugin, `pyproject.toml`; benchmarks import it first). Where torch or numpy loaded first with
another path, `pin` says so rather than let a run give other numbers. A machine without AVX2 gets
a one-line error; `GRPO_COMPANION_UNPINNED=1` runs anyway, unpinned, and provenance records it.

A computation may set its own fixed thread count (the tiny Llama's warm start uses
`TinyLlamaSpec.num_threads`): what must not happen is a count read from the machine.
"""

import os
import platform
import sys

THREADS = 1
CAPABILITY = "AVX2"  # what torch.backends.cpu.get_cpu_capability() reports when pinned
# Every variable and what it pins; all are read when their library loads, ATen's at first use.
ENVIRONMENT = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's vectorised kernels (ATen's CPU dispatch)
    "MKL_CBWR": "AVX2",  # MKL's conditional numerical reproducibility branch (torch's BLAS)
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN's JIT kernels (torch's mkldnn)
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",  # numpy's AVX-512 loops
    "OPENBLAS_CORETYPE": "Haswell",  # numpy's and scipy's BLAS (OpenBLAS's AVX2 kernels)
    "OMP_NUM_THREADS": str(THREADS),
    "MKL_NUM_THREADS": str(THREADS),
    "OPENBLAS_NUM_THREADS": str(THREADS),
}
NUMPY_OFF = ENVIRONMENT["NPY_DISABLE_CPU_FEATURES"].split()
# The instructions of the pinned path: ATen's AVX2 kernels need AVX2 and FMA.
NEEDED_FLAGS = ("avx2", "fma")
OPT_OUT = "GRPO_COMPANION_UNPINNED"


class MachineError(RuntimeError):
    """This machine or process cannot run the pinned code path; the message says why and what
    to do, in one line."""


def missing_instructions(machine: str, cpu_flags: set[str] | None) -> list[str]:
    """The instructions of the pinned path that a CPU lacks: `machine` is `platform.machine()`,
    `cpu_flags` the flags /proc/cpuinfo lists (None where the system does not say)."""
    if machine.lower() not in ("x86_64", "amd64"):
        return [f"x86-64 (this is {machine})"]
    if cpu_flags is None:
        return []  # not Linux: torch's capability is checked once it loads
    return [flag.upper() for flag in NEEDED_FLAGS if flag not in cpu_flags]


def _cpu_flags() -> set[str] | None:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def pin() -> None:
    """Pin every library's code path and thread count for this process and the processes it
    starts; raises `MachineError` where that cannot hold (see the module's docstring)."""
    if os.environ.get(OPT_OUT) == "1":
        return
    missing = missing_instructions(platform.machine(), _cpu_flags())
    if missing:
        raise MachineError(
            f"the book's numbers are pinned to the x86-64 AVX2 code path, which this machine "
            f"cannot run (it lacks {', '.join(missing)}); set {OPT_OUT}=1 to run unpinned, "
            f"with numbers that may differ from the book's"
        )
    os.environ.update(ENVIRONMENT)
    if "numpy" in sys.modules:
        from numpy._core._multiarray_umath import __cpu_features__

        on = [feature for feature in NUMPY_OFF if __cpu_features__.get(feature)]
        if on:
            raise MachineError(
                f"numpy was imported before grpo_companion and dispatches to {', '.join(on)}; "
                f"import grpo_companion first (restart the kernel) or start Python with "
                f"NPY_DISABLE_CPU_FEATURES='{ENVIRONMENT['NPY_DISABLE_CPU_FEATURES']}'"
            )
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(THREADS)
        capability = torch.backends.cpu.get_cpu_capability()  # reads the variable if unread
        if capability != CAPABILITY:
            raise MachineError(
                f"torch ran an operation before grpo_companion was imported and chose its "
                f"{capability} kernels; import grpo_companion first (restart the kernel) or start "
                f"Python with ATEN_CPU_CAPABILITY=avx2"
            )


def code_path() -> str:
    """The code path this process computes on, for cache keys: 'AVX2' when pinned, else
    'unpinned <capability>' (a checkpoint or a kept run from another path is another's)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return capability if os.environ.get(OPT_OUT) != "1" else f"unpinned {capability}"


def settings() -> dict:
    """What is in force in this process, for provenance: torch's CPU capability and thread
    count, and each pinning variable's value (None where unset)."""
    import torch

    return {
        "pinned": os.environ.get(OPT_OUT) != "1",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "environment": {name: os.environ.get(name) for name in ENVIRONMENT},
    }
