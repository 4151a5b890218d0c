"""The book as one PDF: every page of the built HTML printed by headless Chromium, then merged.

`build_pdf(project)` serves `_build/html` on 127.0.0.1, opens each page of `_toc.yml` in toc
order in the Chromium that `make test` installs (Debian's `chromium` and `chromium-driver`,
driven by selenium), waits until MathJax has typeset the page, its web fonts and images have
loaded, opens the exercises' solutions, and prints the page through the DevTools protocol
(`Page.printToPDF`). pypdf merges the pages into `_build/pdf/book.pdf` with one bookmark per
page, under its part of the toc. Nothing is downloaded: MathJax and its fonts are the book's
local copy, and the browser is started with its network services off.
"""

import base64
import contextlib
import functools
import http.server
import io
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import yaml

from grpo_companion.machinery.pipeline import PipelineError, Project

CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
)

# A4 with 12 mm margins, in inches, as Page.printToPDF takes them.
PRINT_OPTIONS = {
    "paperWidth": 8.27,
    "paperHeight": 11.69,
    "marginTop": 0.47,
    "marginBottom": 0.47,
    "marginLeft": 0.47,
    "marginRight": 0.47,
    "printBackground": True,
}

# A page with a table this wide is printed in landscape.
WIDE_TABLE_COLUMNS = 8

# On paper nothing scrolls: wide tables (the ledger) wrap and shrink instead of hiding their
# right part behind a scroll bar, long code lines wrap, and the page's chrome goes.
PRINT_CSS = """
@media print {
  .bd-header, .bd-sidebar-primary, .bd-sidebar-secondary, .bd-footer, .bd-footer-article,
  .prev-next-area, .header-article, .bd-header-article, .headerlink, .toggle-button,
  details.hide.above-input, #pst-back-to-top { display: none !important; }
  .bd-main .bd-content .bd-article-container { max-width: 100% !important; }
  .bd-page-width { max-width: 100% !important; }
  .pst-scrollable-table-container, .table-wrapper, div.cell_output, .output {
    overflow: visible !important; max-height: none !important; }
  table { font-size: 7pt !important; }
  .cell_input { break-inside: avoid; }
  td, th { white-space: normal !important; overflow-wrap: break-word; padding: 0.15rem !important; }
  td code, td span.pre, th code { white-space: normal !important; overflow-wrap: break-word; }
  pre { white-space: pre-wrap !important; overflow-wrap: break-word; max-height: none !important;
    font-size: 7.5pt !important; }
  img { max-width: 100% !important; break-inside: avoid; }
  h1, h2, h3 { break-after: avoid; }
}
"""

# Resolves (in selenium's execute_async_script) with the page's title, and whether it has a wide
# table, once it is ready to print:
# MathJax has typeset the math, the fonts are loaded and every image is decoded; the dropdowns
# (exercise solutions) are opened, the print style sheet is added.
PREPARE_PAGE = """
const done = arguments[arguments.length - 1];
const WIDE_TABLE_COLUMNS = arguments[1];
const style = document.createElement("style");
style.textContent = arguments[0];
document.head.appendChild(style);
for (const hidden of document.querySelectorAll("details.dropdown, details.toggle-details")) {
  hidden.open = true;
}
for (const toggle of document.querySelectorAll(".toggle-hidden")) {
  toggle.classList.remove("toggle-hidden");
}
const typeset = window.MathJax && MathJax.startup ? MathJax.startup.promise : Promise.resolve();
const decoded = () => Promise.all(
  Array.from(document.images).map(img => img.decode().catch(() => null)));
typeset.then(() => document.fonts.ready).then(decoded).then(() => {
  const heading = document.querySelector("article h1");
  let title = document.title;
  if (heading) {
    const copy = heading.cloneNode(true);
    copy.querySelectorAll(".headerlink").forEach(link => link.remove());
    title = copy.textContent.trim();
  }
  // A page with a wide table (the ledger has 8 columns) is printed in landscape.
  const columns = Array.from(document.querySelectorAll("article table tr")).map(
    row => row.children.length);
  done({title: title, landscape: Math.max(0, ...columns) >= WIDE_TABLE_COLUMNS});
});
"""


def toc_pages(root: Path) -> list[tuple[str, str | None]]:
    """(page, caption of its part or None) for every page of `_toc.yml`, in reading order."""
    toc = yaml.safe_load((root / "_toc.yml").read_text())
    pages: list[tuple[str, str | None]] = [(toc["root"], None)]

    def walk(entries, caption):
        for entry in entries or []:
            if "file" in entry:
                pages.append((entry["file"], caption))
            walk(entry.get("sections"), caption)

    walk(toc.get("chapters"), None)
    for part in toc.get("parts", []):
        walk(part.get("chapters"), part.get("caption"))
    return pages


@contextlib.contextmanager
def serve(directory: Path) -> Iterator[str]:
    """The URL of `directory` served over HTTP on 127.0.0.1 (MathJax loads its fonts by URL)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def chromium() -> Iterator:
    """A headless Chromium driven by selenium; fails with what to install when it is missing."""
    binary, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (binary and driver_path):
        raise PipelineError(
            "headless Chromium is missing: `make browser` installs Debian's chromium and "
            "chromium-driver"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_script_timeout(120)
    try:
        yield driver
    finally:
        driver.quit()


# Shrinks each displayed equation wider than the text (MathJax's CHTML output scales with the
# font size, which MathJax itself set to match the text) instead of cutting it at the margin.
FIT_MATH = """
for (const math of document.querySelectorAll("mjx-container[display='true']")) {
  if (math.scrollWidth > math.clientWidth + 1) {
    const size = parseFloat(getComputedStyle(math).fontSize);
    math.style.fontSize = (0.98 * size * math.clientWidth / math.scrollWidth) + "px";
  }
}
"""


def _text_width(landscape: bool) -> int:
    """The width of the printed text in CSS pixels (96 per inch)."""
    paper = PRINT_OPTIONS["paperHeight"] if landscape else PRINT_OPTIONS["paperWidth"]
    return int(96 * (paper - PRINT_OPTIONS["marginLeft"] - PRINT_OPTIONS["marginRight"]))


def print_page(driver, url: str) -> tuple[str, bytes]:
    """(title, PDF bytes) of the page at `url`, printed once it has rendered."""
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"media": "print"})
    driver.get(url)
    page = driver.execute_async_script(PREPARE_PAGE, PRINT_CSS, WIDE_TABLE_COLUMNS)
    # Lay the page out at the paper's width, so that the equations are measured as printed.
    metrics = {"width": _text_width(page["landscape"]), "height": 1000}
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride", {**metrics, "deviceScaleFactor": 1, "mobile": False}
    )
    driver.execute_script(FIT_MATH)
    options = {**PRINT_OPTIONS, "landscape": page["landscape"]}
    printed = driver.execute_cdp_cmd("Page.printToPDF", options)
    return page["title"], base64.b64decode(printed["data"])


def build_pdf(project: Project, output: Path | None = None) -> Path:
    """Print every page of the built HTML in toc order into one PDF; returns its path.

    The PDF has one bookmark per page (the page's title), under one per part of the toc."""
    from pypdf import PdfReader, PdfWriter

    html = project.build_dir / "html"
    pages = toc_pages(project.root)
    missing = [page for page, _ in pages if not (html / f"{page}.html").exists()]
    if missing:
        named = ", ".join(missing[:3]) + (
            f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        )
        raise PipelineError(
            f"no built HTML for {named} under {html}; "
            "run `python -m grpo_companion book` (or `html`) first"
        )
    output = output or project.build_dir / "pdf" / "book.pdf"
    writer = PdfWriter()
    parts = {}
    with serve(html) as url, chromium() as driver:
        for page, caption in pages:
            title, data = print_page(driver, f"{url}/{page}.html")
            first = len(writer.pages)
            writer.append(PdfReader(io.BytesIO(data)), import_outline=False)
            if caption is not None and caption not in parts:
                parts[caption] = writer.add_outline_item(title=caption, page_number=first)
            writer.add_outline_item(title=title, page_number=first, parent=parts.get(caption))
    config = yaml.safe_load((project.root / "_config.yml").read_text())
    writer.add_metadata({"/Title": config["title"], "/Author": config["author"]})
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")
    with open(partial, "wb") as file:
        writer.write(file)
    partial.replace(output)
    return output
