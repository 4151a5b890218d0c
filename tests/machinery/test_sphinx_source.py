"""The book machinery's small pieces a page relies on: `function-source` shows a function as the
package has it, and `ChapterReport.record_all` publishes a section's numbers in one line."""

import json

import pytest

from grpo_companion.core.exact import degenerate_rate
from grpo_companion.machinery.report import ChapterReport
from grpo_companion.machinery.sphinx_ext import function_source


def test_function_source_is_the_functions_own_source():
    code = function_source("grpo_companion.core.exact.degenerate_rate")
    assert code.startswith("def degenerate_rate(pass_rates, group_size):")
    assert "return p**group_size + (1 - p) ** group_size" in code
    assert code.splitlines()[-1].strip() == "return p**group_size + (1 - p) ** group_size"
    assert degenerate_rate([0.5], 2)[0] == 0.5  # the function shown is the one that runs


@pytest.mark.parametrize("path", ["grpo_companion.core.exact.nothing", "no_such_module.f", "f"])
def test_function_source_names_what_it_cannot_find(path):
    with pytest.raises(ValueError, match="function-source: cannot import"):
        function_source(path)


def test_record_all_records_every_value_under_its_prefix(tmp_path):
    report = ChapterReport("00_test", str(tmp_path), "smoke", 0)
    values = {"a": 1.5, "b": 2}
    assert report.record_all(values, prefix="toy_") is values
    report.write()
    recorded = json.loads((tmp_path / "results.json").read_text())["values"]
    assert recorded == {"toy_a": 1.5, "toy_b": 2}
