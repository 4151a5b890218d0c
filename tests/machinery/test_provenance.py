"""Provenance records, the difference detector, per-profile timings and the chapter header, on
hand-made records (no chapter runs here; tests/machinery/test_pipeline.py runs the fixture book)."""

import json
import shlex
import subprocess

import pytest

from grpo_companion.machinery.pipeline import parse_value
from grpo_companion.machinery.provenance import (
    FIELDS,
    command_line,
    differences,
    field_problems,
    git_state,
    header_markdown,
    kernel_provenance,
    load_timings,
    needs_line,
    package_versions,
    parameter_table,
    pipeline_provenance,
    provenance_markdown,
    record_timing,
)


def record(**changes) -> dict:
    """A complete provenance record as the pipeline writes it, with `changes`."""
    base = {
        "commit": "a" * 40,
        "dirty": False,
        "profile": "smoke",
        "parameters": {"seed": 0, "num_repeats": 20},
        "parameter_sources": {"seed": "default", "num_repeats": "profile"},
        "seed": 0,
        "versions": {"python": "3.11.7", "torch": "2.5.0", "numpy": "2.1.0"},
        "torch_threads": 1,
        "cpu_capability": "AVX2",
        "pinning": {"pinned": True, "environment": {"ATEN_CPU_CAPABILITY": "avx2"}},
        "cpu_model": "Some CPU",
        "device": "cpu",
        "gpu_name": None,
        "start_time": "2026-01-01T00:00:00+00:00",
        "wall_seconds": 12.5,
        "cpu_seconds": 20.25,
        "command": "python -m grpo_companion run 01_x --profile smoke",
    }
    return {**base, **changes}


def test_the_kernel_and_the_pipeline_together_fill_every_field_with_its_type(tmp_path):
    kernel = kernel_provenance()
    pipeline = pipeline_provenance(
        tmp_path,
        "05_credit",
        "smoke",
        {"profile": "smoke", "output_dir": "/tmp/x", "seed": 3, "num_prompts": 4},
        {
            "profile": "default",
            "output_dir": "default",
            "seed": "override",
            "num_prompts": "profile",
        },
        {"seed": 3},
        "2026-01-01T00:00:00+00:00",
        1.23456,
    )
    assert set(kernel) | set(pipeline) == set(FIELDS)
    assert field_problems({**kernel, **pipeline}) == []
    # outside a git checkout there is no commit to record, and no path is recorded
    assert pipeline["commit"] is None and pipeline["dirty"] is None
    assert pipeline["parameters"] == {"seed": 3, "num_prompts": 4} and pipeline["seed"] == 3
    assert pipeline["parameter_sources"] == {"seed": "override", "num_prompts": "profile"}
    assert pipeline["device"] == "cpu" and pipeline["wall_seconds"] == 1.235
    assert pipeline["command"] == "python -m grpo_companion run 05_credit --profile smoke -p seed 3"
    assert "/tmp" not in json.dumps(pipeline)
    versions = package_versions()
    for name in ("python", "torch", "transformers", "numpy", "datasets", "papermill"):
        assert isinstance(versions[name], str) and versions[name][0].isdigit()
    assert "jupyter-book" in versions
    assert kernel["torch_threads"] >= 1 and kernel["cpu_seconds"] > 0


def test_field_problems_names_missing_and_mistyped_fields():
    broken = record(seed="0", wall_seconds=3)
    del broken["commit"]
    assert field_problems(broken) == ["missing commit", "seed is str", "wall_seconds is int"]


def test_git_state_reads_the_commit_and_sees_an_untracked_file(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.txt").write_text("a")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
    commit, dirty = git_state(tmp_path)
    assert len(commit) == 40 and dirty is False
    (tmp_path / "b.txt").write_text("b")
    assert git_state(tmp_path) == (commit, True)


def test_command_line_quotes_values_so_the_cli_reads_them_back():
    assert command_line("10_group_size", "cpu", {"group_sizes": [2, 4], "name": "tiny-llama"}) == (
        "python -m grpo_companion run 10_group_size --profile cpu "
        "-p group_sizes '[2, 4]' -p name tiny-llama"
    )
    # a string that reads as a number stays a string when the shell and the CLI read it back
    assert parse_value(shlex.split(command_line("x", "cpu", {"tag": "2000"}))[-1]) == "2000"


def test_one_build_has_no_differences():
    assert differences({"01_a": record(), "02_b": record(wall_seconds=3.0, seed=1)}) == []


def test_differences_name_the_field_the_values_and_the_chapters():
    records = {
        "01_a": record(),
        "02_b": record(),
        "05_c": record(
            commit="b" * 40, profile="cpu", versions={"python": "3.11.7", "torch": "2.6.0"}
        ),
        "12_d": None,
    }
    assert differences(records) == [
        "no provenance recorded: 12_d",
        'commit: "aaaaaaa" (01_a, 02_b); "bbbbbbb" (05_c)',
        'profile: "smoke" (01_a, 02_b); "cpu" (05_c)',
        'versions numpy: "2.1.0" (01_a, 02_b); null (05_c)',
        'versions torch: "2.5.0" (01_a, 02_b); "2.6.0" (05_c)',
    ]
    assert differences({"01_a": record(), "02_b": record(dirty=True)}) == [
        "dirty: false (01_a); true (02_b)"
    ]


def write_results(build_dir, chapter, provenance):
    path = build_dir / "results" / f"{chapter}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    results = {"chapter": chapter, "values": {}, "figures": []}
    if provenance is not None:
        results["provenance"] = provenance
    path.write_text(json.dumps(results))


def test_provenance_markdown_has_a_row_per_chapter_and_flags_a_mixed_build(tmp_path):
    write_results(tmp_path, "01_a", record())
    write_results(tmp_path, "02_b", record(wall_seconds=61.25, torch_threads=1))
    (tmp_path / "results" / "claims.json").write_text("{}")  # not a chapter: no row
    text = provenance_markdown(tmp_path)
    rows = [line for line in text.splitlines() if line.startswith("| 0")]
    assert rows == [
        "| 01_a | `aaaaaaa` | no | `smoke` | 0 | 12.5 | 20.2 | 1 | cpu |",
        "| 02_b | `aaaaaaa` | no | `smoke` | 0 | 61.2 | 20.2 | 1 | cpu |",
    ]
    assert "Packages: python 3.11.7, numpy 2.1.0, torch 2.5.0. CPU: Some CPU; GPU: none." in text
    assert "Kernels pinned to the AVX2 code path (`ATEN_CPU_CAPABILITY=avx2`)." in text
    assert "Every chapter ran from the same commit" in text and "differ" not in text
    write_results(tmp_path, "05_c", record(commit="c" * 40))
    text = provenance_markdown(tmp_path)
    assert "**The chapters of this build differ in:**" in text
    assert '- commit: "aaaaaaa" (01_a, 02_b); "ccccccc" (05_c)' in text


def test_timings_merge_per_profile(tmp_path):
    record_timing(tmp_path, "cpu", "01_a", 192.04)
    record_timing(tmp_path, "cpu", "02_b", 30.0)
    record_timing(tmp_path, "smoke", "01_a", 24.0)  # a smoke run keeps the cpu timings
    record_timing(tmp_path, "cpu", "02_b", 31.26)  # the last run of a chapter wins
    assert load_timings(tmp_path) == {
        "cpu": {"01_a": 192.0, "02_b": 31.3},
        "smoke": {"01_a": 24.0},
    }


def test_the_needs_line_reads_the_timings_and_says_what_is_not_measured():
    timings = {"cpu": {"05_credit": 192.0}, "smoke": {"01_a": 3.0}}
    line = needs_line("05_credit", timings, {"cpu": "cpu", "smoke": "cpu", "gpu": "cpu"})
    assert line == (
        "Runs on a CPU under every profile. Last measured: `cpu` 3.2 min, `smoke` not measured "
        "yet. Re-run it with a changed parameter, any of the table below: "
        "`python -m grpo_companion run 05_credit -p seed 1`."
    )
    assert "`cpu` not measured yet, `smoke` not measured yet." in needs_line("05_credit", {}, {})
    gpu_run = {"gpu": {"11_g": 1800.0}, "smoke": {"11_g": 2.0}}
    line = needs_line("11_g", gpu_run, {"cpu": "cpu", "smoke": "cpu", "gpu": "cuda"})
    assert line.startswith(
        "Runs on a CPU under the `cpu` and `smoke` profiles; the `gpu` profile needs a CUDA GPU. "
        "Last measured: `cpu` not measured yet, `smoke` 0.1 min, `gpu` 30.0 min."
    )


def test_the_parameter_table_says_where_each_value_came_from():
    table = parameter_table(
        {"profile": "smoke", "output_dir": "/tmp/x", "seed": 1, "grpo": {"beta": 0.0}, "n": 3},
        {
            "profile": "default",
            "output_dir": "default",
            "seed": "override",
            "grpo": "profile",
            "n": "default",
        },
        "smoke",
    )
    assert table.splitlines() == [
        "| parameter | value | from |",
        "|---|---|---|",
        "| `seed` | `1` | override |",
        "| `grpo` | `{'beta': 0.0}` | profile `smoke` |",
        "| `n` | `3` | default |",
    ]


@pytest.mark.parametrize("measured", [True, False])
def test_the_header_is_an_admonition_and_a_collapsed_table(measured):
    timings = {"smoke": {"01_a": 30.0}} if measured else {}
    text = header_markdown("01_a", "smoke", {"seed": 0}, {"seed": "default"}, timings, {})
    assert text.startswith("```{admonition} What this chapter needs\n:class: note\nRuns on a CPU")
    assert ("`smoke` 0.5 min" in text) is measured
    assert ("`smoke` not measured yet" in text) is not measured
    assert "````{admonition} The parameters of this run (profile smoke)\n:class: dropdown\n" in text
    assert text.endswith("| `seed` | `0` | default |\n````\n")
