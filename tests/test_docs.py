"""The docs hold together: every link in README.md and docs/ reaches a file, and the results
index (docs/results/README.md) cites the newest page of each question and no older one.

The index ends with a table of every dated page: its date, its questions (a page may answer
several), and, for a page replaced the same day, the page that replaced it. A question's
standing pages are its newest day's, less those replaced; the tables above cite exactly the
standing pages of all questions. So a new page that answers a question retires its
predecessors from the tables as soon as it is listed, and a table citing one fails here.
"""

import re
from pathlib import Path

import pytest
from conftest import REPO

RESULTS = REPO / "docs" / "results"
INDEX = RESULTS / "README.md"
EVERY_PAGE = "## Every page, newest first"
LINK = re.compile(r"\]\(([^)\s]+)\)")
REFERENCE = re.compile(r"^\[[^\]]+\]:\s*(\S+)", re.MULTILINE)  # [name]: target, for [text][name] links
DATED_PAGE = re.compile(r"^\d{4}-\d{2}-\d{2}-.+\.md$")


def documents() -> list[Path]:
    """README.md and docs/'s markdown, less what is kept beside the results pages: their raw runs
    and logs, and the notes a page inlines (whose links are the page's, checked there)."""
    in_results_folder = [RESULTS / name for name in ("notes", "unfiled")] + [p.with_suffix("") for p in dated_pages()]
    return [REPO / "README.md", *(p for p in sorted((REPO / "docs").rglob("*.md"))
                                  if not any(p.is_relative_to(folder) for folder in in_results_folder))]


def dated_pages() -> list[Path]:
    return sorted(p for p in RESULTS.glob("*.md") if DATED_PAGE.match(p.name))


def links(path: Path) -> list[str]:
    """The local targets of `path`'s markdown links, inline and reference-style, anchors cut off
    (code blocks left out)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    targets = (t.split("#")[0] for t in LINK.findall(text) + REFERENCE.findall(text) if not re.match(r"[a-z]+:", t))
    return [t for t in targets if t]


@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_reaches_a_file(document):
    missing = [t for t in links(document) if not (document.parent / t).exists()]
    assert not missing, f"{document.relative_to(REPO)} links to what is not there: {missing}"


# --- the results index ------------------------------------------------------------------------


def parse_index(text: str) -> tuple[set[str], dict[str, dict]]:
    """(the pages the tables above the list cite, {page: {"date", "questions", "superseded_by"}})."""
    tables, listing = text.split(EVERY_PAGE)
    cited = {Path(t).stem for t in LINK.findall(tables) if DATED_PAGE.match(Path(t).name) and "/" not in t}
    pages = {}
    for line in listing.splitlines():
        if not re.match(r"\| \d{4}-", line):
            continue
        date, page, questions, superseded = (c.strip() for c in line.strip().strip("|").split("|"))
        stem = Path(LINK.search(page).group(1)).stem
        assert stem not in pages, f"{stem} is listed twice"
        replaced_by = LINK.search(superseded)
        pages[stem] = {"date": date, "questions": {q.strip() for q in questions.split(",") if q.strip()},
                       "superseded_by": Path(replaced_by.group(1)).stem if replaced_by else None}
    return cited, pages


def standing(pages: dict[str, dict]) -> set[str]:
    """The pages that stand: of each question, the newest day's, less those replaced that day."""
    questions = {q for page in pages.values() for q in page["questions"]}
    stand = set()
    for question in questions:
        answers = {stem: page for stem, page in pages.items() if question in page["questions"]}
        newest = max(page["date"] for page in answers.values())
        stand |= {stem for stem, page in answers.items() if page["date"] == newest and not page["superseded_by"]}
    return stand


def test_the_index_lists_every_dated_page_once_with_its_date_and_a_question():
    _, pages = parse_index(INDEX.read_text())
    assert set(pages) == {p.stem for p in dated_pages()}
    for stem, page in pages.items():
        assert page["date"] == stem[:10] and page["questions"], stem


def test_a_page_is_replaced_only_by_a_page_of_its_question_no_older():
    _, pages = parse_index(INDEX.read_text())
    for stem, page in pages.items():
        if page["superseded_by"]:
            newer = pages[page["superseded_by"]]
            assert newer["date"] >= page["date"] and newer["questions"] & page["questions"], stem
            assert not newer["superseded_by"], f"{stem}: name the page that stands, not {page['superseded_by']}"


def test_the_index_cites_the_standing_pages_and_no_other():
    cited, pages = parse_index(INDEX.read_text())
    stand = standing(pages)
    assert not cited - stand, f"the index cites pages a newer page of their question replaced: {cited - stand}"
    assert not stand - cited, f"the index does not cite the newest page of a question: {stand - cited}"


def test_a_newer_page_of_a_question_retires_the_older_from_the_tables():
    listing = """| date | page | question | superseded by |
| 2026-01-02 | [b](2026-01-02-b.md) | speed | |
| 2026-01-02 | [b0](2026-01-02-b0.md) | speed | [b](2026-01-02-b.md) |
| 2026-01-01 | [a](2026-01-01-a.md) | speed, memory | |
"""
    cited, pages = parse_index(f"[now](2026-01-01-a.md)\n{EVERY_PAGE}\n{listing}")
    assert standing(pages) == {"2026-01-02-b", "2026-01-01-a"}  # a still answers `memory` alone
    assert standing({k: v for k, v in pages.items() if k != "2026-01-01-a"}) == {"2026-01-02-b"}
    assert cited == {"2026-01-01-a"}


def test_the_readme_fits_and_its_first_screen_shows_where_to_look():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move detail into docs/ and link it"
    first_screen = "\n".join(lines[:25])
    for target in ("docs/results/README.md", "docs/architecture.md", "docs/tutorial.md"):
        assert f"]({target})" in first_screen, target


def test_the_wait_before_a_peer_repeats_rank_0s_error_is_the_one_the_code_waits():
    from te_mixtral.errors import PEER_GRACE_S

    text = " ".join((REPO / "docs" / "checkpoints.md").read_text().split())
    said = re.search(r"the other ranks wait (\d+) s", text)
    assert said and float(said.group(1)) == PEER_GRACE_S, said and said.group(0)
