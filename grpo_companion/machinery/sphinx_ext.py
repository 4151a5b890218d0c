"""A Sphinx extension for the book's build (listed in `_config.yml`).

Under Jupyter Book 1.0.4 the inline scripts of sphinx-thebe and sphinx-togglebutton reach each
page twice (once with filename None, once with ""), so every page declared `const THEBE_JS_URL`
twice: a JavaScript error on every page.  Scripts with the same source and attributes are kept
once, the first.

No page may show where the book was built: a page whose body holds the absolute path of the build
folder (the pipeline renders `<build dir>/source`; an output that printed `output_dir`, say) or
of the checkout the package runs from (a default argument the API reference shows, say) is a
warning, which the pipeline's `-W` makes an error.

The directive `function-source` shows a function's source on the page, as d2l shows its saved
code: ```` ```{function-source} grpo_companion.core.group_estimators.per_sequence_estimates ````
renders the function as it is in the package, under a link to its API entry.
"""

import importlib
import inspect
import textwrap
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)


def _drop_repeated_scripts(app, pagename, templatename, context, doctree):
    seen, unique = set(), []
    for script in context.get("script_files", []):
        # The two copies differ only in filename None against "" (inline scripts have neither).
        key = (script.filename or "", tuple(sorted(script.attributes.items())))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"] = unique


def machine_folders(srcdir) -> list[str]:
    """The build folder the pipeline renders from (`<build dir>/source`) and the checkout holding
    the package, leaving out a folder too near the root to tell from ordinary text."""
    source = Path(srcdir).resolve()
    checkout = Path(__file__).resolve().parents[2]
    folders = [source.parent] if source.name == "source" else []
    return [str(folder) for folder in (*folders, checkout) if len(folder.parts) >= 3]


def _refuse_machine_paths(app, pagename, templatename, context, doctree):
    body = context.get("body", "")
    for folder in machine_folders(app.srcdir):
        if folder in body:
            logger.warning(
                f"page {pagename} shows a path of the machine that built it ({folder})",
                location=pagename,
            )


def function_source(path: str) -> str:
    """The source of the function or class at dotted `path`, dedented, as the package has it."""
    module_name, _, name = path.rpartition(".")
    try:
        target = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"function-source: cannot import {path!r} ({error})") from None
    return textwrap.dedent(inspect.getsource(target)).rstrip("\n")


class FunctionSource(SphinxDirective):
    """```{function-source} dotted.path.to.function```: its source, under a link to its API
    entry."""

    required_arguments = 1

    def run(self):
        path = self.arguments[0]
        try:
            code = function_source(path)
        except ValueError as error:
            return [self.state.document.reporter.warning(str(error), line=self.lineno)]
        name = path.rpartition(".")[2]
        link = addnodes.pending_xref(
            "", refdomain="py", reftype="obj", reftarget=path, refexplicit=False, refwarn=True,
            refdoc=self.env.docname,
        )  # fmt: skip
        link["py:module"] = link["py:class"] = None
        link += nodes.literal(name, name, classes=["xref", "py", "py-obj"])
        said = nodes.Text(", as the package runs it:")
        caption = nodes.paragraph("", "The source of ", link, said)
        block = nodes.literal_block(code, code, language="python")
        self.set_source_info(block)
        return [caption, block]


def setup(app):
    app.add_directive("function-source", FunctionSource)
    app.connect("html-page-context", _drop_repeated_scripts, priority=900)
    app.connect("html-page-context", _refuse_machine_paths)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
