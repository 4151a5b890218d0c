"""Each chapter's parameters carry their accepted range beside their default, and the command line
refuses a value outside it before any cell runs, with one line naming the parameter and range."""

from pathlib import Path

import pytest

from grpo_companion.machinery.parameters import ParameterError, read_cell, violation
from grpo_companion.machinery.pipeline import (
    PipelineError,
    Project,
    chapter_constraints,
    chapter_parameters,
    resolve_parameters,
)

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "book").glob("[0-9][0-9]_*.md"))
# Parameters without a range: names, modes and tables of the chapter's own design, checked by
# the code they select (an unknown method or model name fails with the accepted ones).
FREE = {"profile", "output_dir", "build_dir", "workers", "long_logit", "step_logit"}


def test_a_cell_gives_defaults_and_constraints():
    source = 'profile = "cpu"\nnum_repeats: ">= 1" = 200\ngrpo: "GRPOConfig" = {}\n'
    defaults, constraints = read_cell(source, "page.md")
    assert defaults == {"profile": "cpu", "num_repeats": 200, "grpo": {}}
    assert constraints == {"num_repeats": ">= 1", "grpo": "GRPOConfig"}


@pytest.mark.parametrize(
    "source", ['n: ">= one" = 1\n', 'n: "between 1 and 2" = 1\n', "n: 3 = 1\n", "n += 1\n"]
)
def test_an_unreadable_cell_is_refused(source):
    with pytest.raises(ParameterError):
        read_cell(source, "page.md")


@pytest.mark.parametrize(
    ("value", "constraint", "message"),
    [
        (-5, ">= 1", "parameter 'n' must be >= 1, got -5"),
        (0, "> 0", "parameter 'n' must be > 0, got 0"),
        (1.5, "> 0 and < 1", "parameter 'n' must be > 0 and < 1, got 1.5"),
        ([2, 1], ">= 2", "parameter 'n' must be >= 2 in every entry, got [2, 1]"),
        ([], ">= 2", "parameter 'n' needs at least one entry, got []"),
        ("tpu", "in ('cpu', 'cuda')", "parameter 'n' must be in ('cpu', 'cuda'), got 'tpu'"),
        ("3", ">= 1", "parameter 'n' must be >= 1, got '3'"),
    ],
)
def test_a_value_outside_its_range_is_named_with_the_range(value, constraint, message):
    assert violation("n", value, constraint) == message


@pytest.mark.parametrize(
    ("value", "constraint"),
    [(1, ">= 1"), (0.5, "> 0 and < 1"), ([2, 3], ">= 2"), ("cpu", "in ('cpu', 'cuda')")],
)
def test_a_value_inside_its_range_passes(value, constraint):
    assert violation("n", value, constraint) is None


def test_a_config_parameter_is_checked_by_the_config_it_builds():
    assert violation("grpo", {"learning_rate": 3e-5}, "GRPOConfig") is None
    assert violation("grpo", {"learning_rate": -1}, "GRPOConfig") == (
        "parameter 'grpo' is refused by GRPOConfig: learning_rate must be > 0, got -1"
    )
    assert "unexpected keyword" in violation("grpo", {"learing_rate": 1.0}, "GRPOConfig")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.stem)
def test_every_number_of_every_chapter_has_a_range(page):
    defaults, constraints = chapter_parameters(page), chapter_constraints(page)
    numeric = {
        name
        for name, value in defaults.items()
        if (isinstance(value, (int, float)) and not isinstance(value, bool))
        or (isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value))
    }
    assert sorted(numeric - set(constraints) - FREE) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.stem)
def test_every_profile_is_inside_the_ranges(page):
    project = Project(ROOT)
    for profile in project.profiles:
        resolve_parameters(project, page.stem, profile)  # raises outside a range


@pytest.mark.parametrize(
    ("chapter", "overrides", "message"),
    [
        (
            "01_policy_gradient",
            {"num_repeats": -5},
            "chapter 01_policy_gradient: parameter 'num_repeats' must be >= 2, got -5",
        ),
        (
            "06_sparsity",
            {"grpo": {"learning_rate": -1}},
            "chapter 06_sparsity: parameter 'grpo' is refused by GRPOConfig: "
            "learning_rate must be > 0, got -1",
        ),
    ],
)
def test_the_command_line_refuses_before_any_cell_runs(chapter, overrides, message):
    with pytest.raises(PipelineError) as error:
        resolve_parameters(Project(ROOT), chapter, "cpu", overrides)
    assert str(error.value) == message
