"""A Sphinx extension for the book's build (listed in `_config.yml`).

Under Jupyter Book 1.0.4 the inline scripts of sphinx-thebe and sphinx-togglebutton reach each
page twice (once with filename None, once with ""), so every page declared `const THEBE_JS_URL`
twice: a JavaScript error on every page.  Scripts with the same source and attributes are kept
once, the first.

No page may show where the book was built: a page whose body holds the absolute path of the build
folder (the pipeline renders `<build dir>/source`; an output that printed `output_dir`, say) or
of the checkout the package runs from (a default argument the API reference shows, say) is a
warning, which the pipeline's `-W` makes an error.
"""

from pathlib import Path

from sphinx.util import logging

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


def setup(app):
    app.connect("html-page-context", _drop_repeated_scripts, priority=900)
    app.connect("html-page-context", _refuse_machine_paths)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
