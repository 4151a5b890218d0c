"""A Sphinx extension for the book's build (listed in `_config.yml`).

Under Jupyter Book 1.0.4 the inline scripts of sphinx-thebe and sphinx-togglebutton reach each
page twice (once with filename None, once with ""), so every page declared `const THEBE_JS_URL`
twice: a JavaScript error on every page.  Scripts with the same source and attributes are kept
once, the first.
"""


def _drop_repeated_scripts(app, pagename, templatename, context, doctree):
    seen, unique = set(), []
    for script in context.get("script_files", []):
        # The two copies differ only in filename None against "" (inline scripts have neither).
        key = (script.filename or "", tuple(sorted(script.attributes.items())))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"] = unique


def setup(app):
    app.connect("html-page-context", _drop_repeated_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
