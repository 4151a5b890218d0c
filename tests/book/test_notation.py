"""One notation across the book: the notation page lists each symbol once, every page and term it
links to exists, and the chapters' prose keeps the letters G, R, V and beta to their one meaning.
Reads the markdown only; no chapter is executed."""

import re
from pathlib import Path

import pytest

BOOK = Path(__file__).resolve().parents[2] / "book"
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


# Clashes the notation page rules out. A page that still carries one is listed here, so that the
# test names it and fails once it is gone (delete the entry then) or when a new page adds one.
SIGMA_PENDING: dict[str, str] = {}
HAT_PENDING: dict[str, str] = {}
STATE_PENDING = {"05_credit.md": "V(s_1): a state with a number for its token, as s_1 the score"}
NOTATION_PAGES = CHAPTERS + [BOOK / "glossary.md"]


def symbol_uses(pattern: str, pages=NOTATION_PAGES) -> dict[str, list[str]]:
    """{page name: [math segments in which `pattern` matches]}, pages without a match left out."""
    found = {}
    for page in pages:
        hits = [segment for segment in math_segments(prose(page)) if re.search(pattern, segment)]
        if hits:
            found[page.name] = hits
    return found


def test_hat_a_is_grpo_std_scaled_advantage_only():
    """A_i is the advantage of the method in play, \\hat A_i only GRPO's: an A_i defined with a
    division by the group's std must wear the hat, and a \\hat A_i defined from the rewards must
    divide by it (a number, \\hat A_i = 0.866, says nothing either way)."""
    definition = re.compile(
        r"(?:^|,|\\q?quad)\s*(\\hat\s*\{?\s*)?A_i\}?\s*=\s*(.*?)(?=,|\\q?quad|$)", re.S
    )
    clashes = set()
    for page in PAGES:
        for segment in math_segments(prose(page)):
            for match in definition.finditer(segment):
                hat, value = bool(match.group(1)), match.group(2)
                if "std" in value and not hat or hat and "r_" in value and "std" not in value:
                    clashes.add(page.name)
    assert clashes == set(HAT_PENDING)


# A token-indexed s: s_t, s_{t+1}, s_{<t}, s_{\text{last}}; a completion-indexed one: s_i, s_1.
STATE = re.compile(r"(?<![A-Za-z\\])s_(?:t\b|\{\s*(?:<\s*)?t|\{\\text)")
SCORE = re.compile(r"(?<![A-Za-z\\])s(?:_(?:[ij0-9]\b|\{[ij0-9])|\s*\(\s*y)")


def test_s_with_a_token_index_is_a_state_and_with_a_completion_index_a_score():
    """s(y), s_i are scores and s_t is a state (the prefix before token t). A state is the
    argument of a value, a baseline or a conditional (V(s_t), b_t(s_t), | s_t) or is being
    defined (s_t = (q, o_{<t})); a score is never conditioned on or valued, and never carries a
    token index (s_{i,t}: the token's part of the score is psi_t)."""
    clashes = set()
    for page in PAGES:
        for segment in math_segments(prose(page)):
            assert not re.search(r"(?<![A-Za-z\\])s_\{\s*[ij]\s*,", segment), (page.name, segment)
            for match in STATE.finditer(segment):
                before = segment[: match.start()].rstrip()
                after = segment[match.end() :]
                argument = before.endswith(("(", r"\mid", ",", "|")) or before == ""
                defined = re.match(r"\}?\s*=\s*(\(q|y_\{<)", after)
                assert argument or defined, (page.name, segment)
            for match in SCORE.finditer(segment):
                before = segment[: match.start()].rstrip()
                if before.endswith((r"\mid", "V(", "Q(")):
                    clashes.add(page.name)
    assert clashes == set(STATE_PENDING)


def test_w_is_the_weight_along_grad_p_and_omega_the_ratio_weight():
    """w(p) weighs a method's expected update along grad p; a policy loss's weight at ratio rho
    is omega(rho) (chapter 3)."""
    assert symbol_uses(r"(?<![A-Za-z\\])w\s*\(\s*\\rho", PAGES) == {}
    assert symbol_uses(r"\\omega", NOTATION_PAGES).keys() == {"03_grpo_loss.md"}


def test_sigma_is_a_singular_value():
    """sigma_j is a singular value and nothing else: the sigmoid is written out and a noise
    variance is Var[.]. Every sigma in a chapter's math carries a subscript."""
    bare = symbol_uses(r"\\sigma(?!\s*_)")
    assert set(bare) == set(SIGMA_PENDING), bare


def test_delta_is_the_token_credit():
    """delta_t is the token credit of chapter 5 (which may write it without its index); the
    two-sided clip's bound is rho_max. Elsewhere every delta carries a subscript."""
    assert set(symbol_uses(r"\\delta(?!\s*_)")) <= {"05_credit.md"}


def test_k_is_the_correct_count_and_k_with_1_to_3_a_kl_estimator():
    """Bare k counts the correct completions of a group (k_j: of prompt j); k_1, k_2, k_3 are the
    KL estimators and no other number is a subscript of k. The pass@k of the literature is pass@G
    here (verl's `grpo_passk` keeps its name in code), and VESPO's k and lambda are TRL's
    parameter names."""
    assert symbol_uses(r"(?<![A-Za-z\\])k_\{?\s*(?![123]\b)[0-9]") == {}
    for page in NOTATION_PAGES:
        assert "pass@k" not in plain(prose(page)), page.name


def test_the_paper_is_the_one_paper():
    """'The paper' is the work the book accompanies; its only letter the book quotes is R, the
    group size. Another paper's letter is named with the paper (mu is DeepSeekMath's)."""
    for page in PAGES:
        text = plain(prose(page))
        for letter in re.findall(r"paper's\s+\$([^$]+)\$", text):
            assert letter.strip() == "R", (page.name, letter)
        for sentence in re.findall(r"[^.]*paper's (?:name|letter)[^.]*", text):
            assert "group size" in sentence or "$R$" in sentence or "class names" in sentence, (
                page.name,
                sentence,
            )
    rows = [
        line
        for line in (BOOK / "notation.md").read_text().splitlines()
        if line.startswith("|") and "paper" in line
    ]
    assert [row.split("|")[1].strip() for row in rows] == ["$G$"]


def test_no_page_holds_a_control_character():
    """A tab or other control character in a page's source is an escape gone wrong: "\\text"
    written through a string that reads "\\t" as a tab shows as "ext" in the rendered math."""
    for page in PAGES:
        bad = [
            (number, line)
            for number, line in enumerate(page.read_text().splitlines(), 1)
            if any(ord(c) < 32 for c in line)
        ]
        assert bad == [], (page.name, bad)
