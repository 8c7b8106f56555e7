"""The docs stay true to the code: the reliability page is what the tests' claim markers say, and every page is
reachable from the README through links that resolve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import claims

ROOT = claims.REPO_ROOT
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "bench/results/README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def _relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]


def test_the_reliability_page_is_what_the_tests_claim_markers_generate() -> None:
    assert claims.PAGE.read_text() == claims.render(), "docs/reliability.md is out of date: python -m tests.claims"


def _tree(tmp_path: Path, test_source: str) -> Path:
    (tmp_path / "tests/faults").mkdir(parents=True)
    (tmp_path / "tests/test_example.py").write_text(test_source)
    return tmp_path


def test_a_claim_marker_naming_no_known_claim_is_refused_with_its_place(tmp_path: Path) -> None:
    # Given a test that backs a claim CLAIMS does not list (a typo)
    marks = "".join(f"@pytest.mark.claim({claim!r})\n" for claim in claims.CLAIMS)
    source = f"import pytest\n\n{marks}@pytest.mark.claim('Exactly one ending')\ndef test_x():\n    pass\n"
    # Then collecting names the file, the line and the claim
    with pytest.raises(claims.ClaimError, match=r"tests/test_example.py:\d+: no claim 'Exactly one ending'"):
        claims.collect(_tree(tmp_path, source))


def test_a_claim_no_test_backs_is_refused(tmp_path: Path) -> None:
    # Given every claim backed by a module's pytestmark but one
    backed = [claim for claim in claims.CLAIMS if claim != "Exactly one end"]
    source = f"import pytest\n\npytestmark = [{', '.join(f'pytest.mark.claim({c!r})' for c in backed)}]\n"
    with pytest.raises(claims.ClaimError, match="Exactly one end"):
        claims.collect(_tree(tmp_path, source))


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {link.split("#")[0] for link in _relative_links(ROOT / "README.md")}
    pages = {str(page.relative_to(ROOT)) for page in _pages()[1:]}
    assert sorted(pages - linked) == []


def test_every_relative_link_in_the_readme_and_docs_resolves_to_a_file_and_heading() -> None:
    broken = []
    for page in _pages():
        for link in _relative_links(page):
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link}")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert broken == []


def test_the_readme_stays_a_front_door_of_at_most_250_lines() -> None:
    # What the README outgrows goes to a docs/ page it links (docs/design.md, docs/deploying.md, ...)
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
