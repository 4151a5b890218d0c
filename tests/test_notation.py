"""One notation across the book: the notation page lists each symbol once, every page and term it
links to exists, and the chapters' prose keeps the letters G, R, V and beta to their one meaning.
Reads the markdown only; no chapter is executed."""

import re
from pathlib import Path

import pytest

BOOK = Path(__file__).resolve().parents[1] / "book"
PAGES = sorted(BOOK.glob("*.md"))
CHAPTERS = sorted(BOOK.glob("[0-9][0-9]_*.md"))

CODE_CELL = re.compile(r"^```\{code-cell\}.*?^```[ \t]*$", re.S | re.M)
FRONT_MATTER = re.compile(r"\A---\n.*?\n---\n", re.S)
ROLE = re.compile(r"\{([a-z:]+)\}`([^`]*)`")
CODE_SPAN = re.compile(r"`[^`\n]*`")
DISPLAY_MATH = re.compile(r"\$\$(.*?)\$\$", re.S)
INLINE_MATH = re.compile(r"\$([^$]+?)\$", re.S)


def prose(path: Path) -> str:
    """The page's markdown without its front matter and code cells (which the prose rules skip)."""
    return CODE_CELL.sub("", FRONT_MATTER.sub("", path.read_text()))


def plain(text: str) -> str:
    """Prose without roles and inline code: what a reader sees as words and math."""
    return CODE_SPAN.sub("", ROLE.sub("", text))


def math_segments(text: str) -> list[str]:
    text = plain(text)
    display = DISPLAY_MATH.findall(text)
    return display + INLINE_MATH.findall(DISPLAY_MATH.sub("", text))


def roles(name: str) -> list[tuple[Path, str]]:
    """(page, target) of every `{name}` role in the book; `text <target>` gives its target."""
    found = []
    for page in PAGES:
        for role, content in ROLE.findall(prose(page)):
            if role == name:
                explicit = re.fullmatch(r"(?s).*<([^<>]+)>\s*", content)
                found.append((page, explicit.group(1) if explicit else content))
    return found


def notation_rows() -> list[str]:
    """First cells of the notation tables' rows (headers and separator rows left out)."""
    rows = []
    for line in (BOOK / "notation.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] not in ("symbol",) and not set(cells[0]) <= {"-"}:
            rows.append(cells[0])
    return rows


def glossary_terms() -> list[str]:
    block = re.search(
        r"^```\{glossary\}\n(.*?)^```", (BOOK / "glossary.md").read_text(), re.S | re.M
    )
    assert block, "glossary.md has no glossary directive"
    return [
        line.strip()
        for line in block.group(1).splitlines()
        if line.strip() and not line.startswith((" ", "\t", ":"))
    ]


def test_notation_lists_every_symbol_once():
    symbols = [
        re.sub(r"\s+", " ", symbol.strip())
        for row in notation_rows()
        for symbol in INLINE_MATH.findall(row)
    ]
    assert len(symbols) > 40
    duplicates = sorted({symbol for symbol in symbols if symbols.count(symbol) > 1})
    assert duplicates == []
    # The letters the issue names each have a row of their own.
    for symbol in ("G", "B", "N", r"\beta", r"\epsilon", r"s_t", r"V(s_t)", r"\delta_t"):
        assert symbol in symbols, symbol


def test_every_linked_page_exists():
    links = roles("doc")
    assert any(page.name == "notation.md" for page, _ in links)
    missing = [
        (page.name, target) for page, target in links if not (BOOK / f"{target}.md").exists()
    ]
    assert missing == []


def test_every_term_used_is_defined_and_every_term_is_used():
    defined = {term.lower() for term in glossary_terms()}
    assert 15 <= len(defined) <= 25 and len(defined) == len(glossary_terms())
    used = roles("term")
    # Sphinx matches terms case-insensitively, with runs of whitespace as one space.
    undefined = [
        (page.name, target)
        for page, target in used
        if re.sub(r"\s+", " ", target.strip()).lower() not in defined
    ]
    assert undefined == []
    linked_from_chapters = {target.lower() for page, target in used if page in CHAPTERS}
    assert sorted(defined - linked_from_chapters) == []


# A standalone capital R, not part of a name (`R_universal`) or a macro (`\mathbb{R}`).
LETTER_R = re.compile(r"(?<![A-Za-z\\{])R(?![A-Za-z_])")


def test_r_is_the_group_size_only_where_the_paper_is_quoted():
    """The paper writes R for the group size; the book writes G and says so once, in the rank
    chapter. Any other R in the prose (math or words; code, roles and labels in backticks are
    not prose) would be R used for something, most likely the group size again."""
    quoted = []
    for chapter in CHAPTERS:
        for paragraph in re.split(r"\n\s*\n", prose(chapter)):
            if LETTER_R.search(plain(paragraph)):
                quoted.append((chapter.name, paragraph))
    assert [name for name, _ in quoted] == ["07_rank.md"]
    assert "the paper's name for the group size" in quoted[0][1]
    assert re.search(r"this book\s+writes \$G\$", quoted[0][1])


# What may follow a V in math: the value function of a state, V(s_t) or its estimate \hat V.
VALUE_OF_A_STATE = re.compile(r"\s*\(\s*s_")


def test_v_is_the_value_function_only():
    """No variance is written V (Var[...] is), and the vocabulary size is |\\mathcal V|: every
    V in the book's math is the value of a state, V(s_t), or an estimate \\hat V of it."""
    for page in PAGES:
        for segment in math_segments(prose(page)):
            assert not re.search(
                r"\\mathbb\s*\{?\s*V|\\(operatorname|mathrm)\s*\{\s*V\s*\}", segment
            )
            for match in re.finditer(r"(?<![A-Za-z])V(?![A-Za-z])", segment):
                before, after = segment[: match.start()], segment[match.end() :]
                if re.search(r"\\mathcal\s*\{?\s*$", before):
                    continue  # the vocabulary, |\mathcal V|
                estimate = re.search(r"\\(hat|widehat)\s*\{?\s*$", before)
                assert VALUE_OF_A_STATE.match(after) or estimate, (page.name, segment)


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda path: path.stem)
def test_beta_and_epsilon_keep_their_meaning(chapter):
    """beta is the KL coefficient and epsilon the clip range: a Beta distribution of pass rates is
    written Beta(m kappa, (1 - m) kappa), and noise terms are xi, not varepsilon."""
    text = prose(chapter)
    for segment in math_segments(text):
        assert r"\varepsilon" not in segment, segment
        for beta in re.finditer(r"\\mathrm\{Beta\}\(", segment):
            assert segment[beta.end() :].startswith(r"m\kappa"), segment
    assert not re.search(r"Beta\(a, ?b\)", plain(text))
