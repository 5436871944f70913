"""Comments and docstrings cite only what a reader of the repository can open.

The papers' design notes and issue tracker are not in the repository, so the code must not send a
reader there: no ``*_spec`` documents, no ``DESIGN.md``, no "issue N". What matters is written in
the docstring itself or in ``docs/`` (the papers' content in docs/papers.md), and every ``docs/...md``
path the code names must exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tessera", "operator", "worker", "sim")

FORBIDDEN = {
    "a spec document": re.compile(r"\b\w+_spec(?:\.md)?\s*(?:§|part\s+[A-C]\b|[A-C]\.?\d)|\b\w+_spec\.md\b"),
    "a spec section": re.compile(r"\b[Ss]pec(?:'s)?\s+(?:§|part\s+[A-C]\b|[A-C]\.?\d)"),
    "the named specs": re.compile(r"\b(?:elis_andes|qlm_chiron|seallm)_spec\b"),
    "DESIGN.md": re.compile(r"\bDESIGN\.md\b"),
    "an issue number": re.compile(r"\b[Ii]ssue[ -]#?\d+"),
    "the reference folder": re.compile(r"\breference/(?:specs|seeds)\b"),
}
DOCS_PATH = re.compile(r"\bdocs/[\w./-]*\w\.md\b")


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def _hits(pattern: re.Pattern[str]) -> list[str]:
    out = []
    for path in _sources():
        for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in pattern.finditer(line):
                out.append(f"{path.relative_to(ROOT)}:{no}: {m.group(0)!r}")
    return out


def test_sources_found() -> None:
    assert len(_sources()) > 50


@pytest.mark.parametrize("what", sorted(FORBIDDEN))
def test_no_citation_outside_the_repository(what: str) -> None:
    hits = _hits(FORBIDDEN[what])
    assert not hits, f"cites {what}, which is not in the repository; say it here or in docs/:\n" + "\n".join(
        hits
    )


def test_named_docs_exist() -> None:
    missing = [
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for path in _sources()
        for m in DOCS_PATH.finditer(path.read_text(encoding="utf-8"))
        if not (ROOT / m.group(0)).is_file()
    ]
    assert not missing, "names docs that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("(qlm_chiron_spec B4)", "the named specs"),
        ("see seallm_spec.md §9.3", "a spec document"),
        ("(spec §A.4 #7)", "a spec section"),
        ("the spec's part C table", "a spec section"),
        ("spec A12-9", "a spec section"),
        ('See DESIGN.md, "The keystone"', "DESIGN.md"),
        ("(issue 3, item 7)", "an issue number"),
        ("issue-4 report", "an issue number"),
        ("../shared/reference/specs/x.md", "the reference folder"),
    ],
)
def test_patterns_catch_the_old_citations(text: str, what: str) -> None:
    assert FORBIDDEN[what].search(text)


@pytest.mark.parametrize(
    "text",
    ["pod_spec = {}", "importlib.util.find_spec(name)", "module_from_spec(spec)", "self.gate.issue(m)"],
)
def test_patterns_spare_code(text: str) -> None:
    assert not any(p.search(text) for p in FORBIDDEN.values())
