"""A Sphinx extension for the API reference (`book/api_*.md`, listed in `_config.yml`).

The package's docstrings are plain text written for `help()`: ASCII formulas (`|x|`,
`A_i*B`), aligned tables, shapes such as `(B * G,)` in front of a property's description, and
now and then a Google-style `Args:`/`Returns:` section for napoleon. Read as reStructuredText
under the book's `-W -n`, many of them would stop the build (an undefined substitution `|x|`,
an unexpected indentation) or link nonsense (napoleon reads a property's `(N, T): ...` as a
type). So each docstring is tried first: one that docutils parses without a warning goes on
as napoleon rendered it; any other is shown verbatim, as a literal block, as `help()` shows it.

A default computed from the package's location (a cache folder under the checkout) would show
the path of the machine that built the book: signatures show it relative to the checkout.

Either way, a docstring's lines that start with `Chapter:` stay reStructuredText, so
``Chapter: :doc:`/book/02_group_baseline` `` links a function back to the chapter that
derives it, as the chapter links the function with ``{py:func}``.
"""

import io
import re
from pathlib import Path

from docutils.core import publish_doctree
from docutils.utils import Reporter

LINK_LINE = re.compile(r"^\s*Chapters?:\s")
# Sphinx's roles are unknown to bare docutils; the text they wrap is kept.
ROLE = re.compile(r":[\w.:+-]+:(?=`)")
# napoleon reads a first line `x: y` of these as `type: description`; ours are `shape desc`.
VERBATIM_KINDS = ("attribute", "property", "data")

# The checkout the package is imported from.
ROOT = str(Path(__file__).resolve().parents[2])

_originals: dict[tuple[str, str], list[str]] = {}


def parses_cleanly(lines: list[str]) -> bool:
    """Whether docutils reads `lines` as reStructuredText without a warning or an error."""
    stream = io.StringIO()
    publish_doctree(
        ROLE.sub("", "\n".join(lines)),
        settings_overrides={
            "report_level": Reporter.WARNING_LEVEL,
            "halt_level": Reporter.SEVERE_LEVEL + 1,
            "warning_stream": stream,
        },
    )
    return not stream.getvalue()


def verbatim(lines: list[str]) -> list[str]:
    """A literal block of `lines`, then their `Chapter:` lines as reStructuredText."""
    body = [line for line in lines if not LINK_LINE.match(line)]
    links = [line.strip() for line in lines if LINK_LINE.match(line)]
    while body and not body[-1].strip():
        body.pop()
    block = [
        ".. code-block:: text",
        "",
        *(f"    {line}" if line.strip() else "" for line in body),
        "",
    ]
    return (block if any(line.strip() for line in body) else []) + [
        line for link in links for line in (link, "")
    ]


def _remember(app, what, name, obj, options, lines):
    _originals[what, name] = list(lines)


def _check(app, what, name, obj, options, lines):
    original = _originals.pop((what, name), list(lines))
    if what in VERBATIM_KINDS or not parses_cleanly(original):
        lines[:] = verbatim(original)


def _relative_paths(app, what, name, obj, options, signature, return_annotation):
    if signature and ROOT in signature:
        return signature.replace(ROOT + "/", "").replace(ROOT, "."), return_annotation
    return None


def setup(app):
    app.setup_extension("sphinx.ext.autodoc")
    app.setup_extension("sphinx.ext.napoleon")
    # napoleon rewrites the lines at the default priority, 500: remember them before, judge after.
    app.connect("autodoc-process-docstring", _remember, priority=100)
    app.connect("autodoc-process-docstring", _check, priority=900)
    app.connect("autodoc-process-signature", _relative_paths)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
