"""The API reference without building it: every module is on its layer's page, the pages are in
the toc, and a docstring that is not reStructuredText is shown verbatim instead of failing the
build. The built pages are checked in tests/book/test_book.py."""

import re
from pathlib import Path

import pytest

from grpo_companion.machinery.pdf import toc_pages
from grpo_companion.machinery.sphinx_api import parses_cleanly, verbatim

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("core", "lm", "chapters", "machinery")


@pytest.mark.parametrize("layer", LAYERS)
def test_every_module_is_on_its_layers_page(layer):
    page = (ROOT / "book" / f"api_{layer}.md").read_text()
    documented = re.findall(r"^\.\. automodule:: (\S+)$", page, flags=re.MULTILINE)
    modules = sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in (ROOT / "grpo_companion" / layer).rglob("*.py")
        if path.stem != "__init__"
    )
    assert sorted(documented) == modules


def test_the_api_pages_are_a_part_of_the_toc_after_the_chapters():
    pages = [page for page, _ in toc_pages(ROOT)]
    assert pages[0] == "book/intro"
    assert pages[-4:] == [f"book/api_{layer}" for layer in LAYERS]
    assert {caption for page, caption in toc_pages(ROOT) if page.startswith("book/api_")} == {
        "API reference"
    }
    assert "book/01_policy_gradient" in pages and "book/12_report" in pages


@pytest.mark.parametrize(
    ("docstring", "clean"),
    [
        ("Advantages of a group.\n\nChapter: :doc:`/book/02_group_baseline`", True),
        ("Args:\n    rewards: (B, G) rewards.", True),
        ("|x| > 2.2 clamps the estimate.", False),  # an undefined substitution
        ("The table:\n    grpo  A_i = r_i - mean(r)\nends here.", False),  # bad indentation
        ("Scaled by *the std, then clipped.", False),  # an unclosed emphasis
    ],
)
def test_a_docstring_is_rst_only_when_docutils_reads_it_cleanly(docstring, clean):
    assert parses_cleanly(docstring.splitlines()) is clean


def test_a_verbatim_docstring_keeps_its_chapter_link_as_rst():
    lines = [
        "|x| is clamped:",
        "",
        "    k3 = exp(-x) - 1 + x",
        "",
        "Chapter: :doc:`/book/03_grpo_loss`",
    ]
    assert verbatim(lines) == [
        ".. code-block:: text",
        "",
        "    |x| is clamped:",
        "",
        "        k3 = exp(-x) - 1 + x",
        "",
        "Chapter: :doc:`/book/03_grpo_loss`",
        "",
    ]
    assert verbatim([]) == []
