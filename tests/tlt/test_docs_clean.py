"""The user documents name no commit, temporary path, development session or file outside the
repository, and every relative link in them resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *ROOT.glob("*/README.md")])
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
FORBIDDEN = {
    "a temporary path": re.compile(r"/tmp/"),
    # (a spot-training "session" is a product term: only phrases about development sessions)
    "a development session": re.compile(r"\bthis session\b|\bsessions? (that|which) built\b|\bsession's machine\b|"
                                        r"\bsession lent\b", re.IGNORECASE),
    "a file outside the repository": re.compile(r"\.\./shared|\bDESIGN\.md\b"),
}


def _problems(text: str) -> list[str]:
    out = [f"a commit ({m.group(0)})" for m in COMMIT.finditer(text)]
    out += [f"{what} ({m.group(0)!r})" for what, rx in FORBIDDEN.items() for m in rx.finditer(text)]
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_document_names_nothing_a_user_cannot_follow(doc):
    assert _problems(doc.read_text()) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
        assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"


def test_the_check_finds_what_it_looks_for():
    text = "measured on 1d6cc88 in /tmp/x by this session (see ../shared/DESIGN.md)"
    assert len(_problems(text)) == 5
    assert _problems("a sha256 of the weights, 1.23x, the spot session's phases") == []
