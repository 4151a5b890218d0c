"""`make pdf` on the smoke build of tests/book/test_book.py (the `built` fixture of
conftest.py): one PDF with a bookmark per page of the toc, the math typeset, every figure, the
whole ledger."""

import json
import re
import time
import unicodedata

import pytest

from grpo_companion.machinery.pdf import build_pdf, toc_pages

pytestmark = [pytest.mark.book, pytest.mark.xdist_group("book")]


@pytest.fixture(scope="module")
def printed(built):
    """(project, pypdf reader of the book's PDF, seconds it took to print)."""
    from pypdf import PdfReader

    project, _, _ = built
    start = time.perf_counter()
    path = build_pdf(project)
    seconds = time.perf_counter() - start
    assert path == project.build_dir / "pdf" / "book.pdf"
    return project, PdfReader(path), seconds


@pytest.fixture(scope="module")
def texts(printed):
    """The text of every page of the PDF (extracting it takes pypdf about a second a page)."""
    _, reader, _ = printed
    return [page.extract_text() for page in reader.pages]


def _bookmarks(reader, outline=None, depth=0):
    """[(depth, title, first page index)] of the PDF's outline, in order."""
    items = []
    for item in reader.outline if outline is None else outline:
        if isinstance(item, list):
            items += _bookmarks(reader, item, depth + 1)
        else:
            items.append((depth, item.title, reader.get_destination_page_number(item)))
    return items


def test_one_bookmark_per_page_of_the_toc_in_order(printed):
    project, reader, seconds = printed
    pages = toc_pages(project.root)
    bookmarks = _bookmarks(reader)
    parts = [title for depth, title, _ in bookmarks if depth == 0 and title == "API reference"]
    assert parts == ["API reference"]
    captions = {caption for _, caption in pages if caption}
    pages_bookmarked = [item for item in bookmarks if item[1] not in captions]
    assert len(pages_bookmarked) == len(pages)
    assert len(reader.pages) >= len(pages)
    starts = [page for _, _, page in pages_bookmarked]
    assert starts[0] == 0 and starts == sorted(starts) and len(set(starts)) == len(starts)
    titles = [title for _, title, _ in pages_bookmarked]
    # each chapter's bookmark is its title, on the page where the chapter starts
    for chapter in project.chapters:
        (index,) = [i for i, (page, _) in enumerate(pages) if page == f"book/{chapter}"]
        first_page = reader.pages[starts[index]].extract_text()
        assert titles[index] and titles[index].split()[0] in first_page, (chapter, titles[index])
    print(f"printed {len(reader.pages)} PDF pages in {seconds:.0f} s")


def test_the_math_is_typeset_not_raw_tex(texts):
    raw = {
        number: marker
        for number, text in enumerate(texts)
        for marker in ("\\frac", "$$", "\\mathbb", "\\begin{")
        if marker in text
    }
    assert not raw


def test_every_figure_is_in_the_pdf(printed):
    project, reader, _ = printed
    figures = sum(
        len(json.loads(project.results_path(chapter).read_text())["figures"])
        for chapter in project.chapters
    )
    images = sum(
        1
        for page in reader.pages
        for image in (page.get("/Resources", {}).get("/XObject", {}) or {}).values()
        if image.get_object().get("/Subtype") == "/Image"
        and image.get_object().get("/Width", 0) > 200
    )
    assert figures > 0 and images >= figures


def test_the_ledger_is_whole_on_paper(printed, texts):
    """Every claim's row of chapter 12's table, verdict included, is in the text of the
    chapter's pages: the wide table wraps instead of losing its right-hand columns."""
    project, reader, _ = printed
    starts = [page for _, title, page in _bookmarks(reader)] + [len(texts)]
    titles = [title for _, title, _ in _bookmarks(reader)]
    first = starts[titles.index("The reproduction report")]
    last = min(start for start in starts if start > first)
    # a long identifier wraps inside its cell: compare without white space, and with the
    # font's ligatures (the "ffi" of "difficulty") as letters
    text = re.sub(r"\s+", "", unicodedata.normalize("NFKC", "".join(texts[first:last])))
    ledger = json.loads((project.build_dir / "results" / "claims.json").read_text())
    missing = [claim["id"] for claim in ledger["claims"] if claim["id"] not in text]
    assert ledger["claims"] and not missing
    for verdict, count in ledger["summary"].items():
        assert count == 0 or re.sub(r"\s+", "", verdict) in text, verdict
