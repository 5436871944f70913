"""The docs name the headers and flags the code reads: a renamed header or flag fails here, not in a
reader's terminal (docs/architecture.md once named X-Request-Class where the router reads
X-Tessera-Class)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tessera.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = [
    p for folder in ("tessera", "worker", "operator", "sim", "bench") for p in (ROOT / folder).rglob("*.py")
]
# Flags of other tools that the docs show in their commands (git log, docker build).
OTHER_TOOLS = {"--oneline", "--target"}
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
COMMAND = re.compile(r"(?:^|[\s/(])tessera\s+([a-z][a-z-]*(?:\s+[a-z][a-z-]*)?)(.*)")


def _source_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in SOURCES)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(
        (a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)),
        {},
    )


def _all_flags(parser: argparse.ArgumentParser) -> set[str]:
    flags = {o for a in parser._actions for o in a.option_strings}
    for child in _subparsers(parser).values():
        flags |= _all_flags(child)
    return flags


def _spans(text: str) -> list[str]:
    """Inline code and the lines of code blocks (continuation lines joined)."""
    spans: list[str] = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        spans += block.replace("\\\n", " ").splitlines()
    return spans + re.findall(r"`([^`\n]+)`", text)


def test_every_header_the_docs_name_is_one_the_code_uses() -> None:
    code = _source_text().lower()
    for doc in DOCS:
        for header in set(re.findall(r"\bX-(?!kubernetes)[A-Za-z0-9-]*[A-Za-z0-9]", doc.read_text())):
            assert f'"{header.lower()}"' in code, f"{doc.name} names header {header}, which no code reads"


def test_a_tessera_command_in_the_docs_takes_each_flag_shown_with_it() -> None:
    root = build_parser()
    for doc in DOCS:
        for span in _spans(doc.read_text()):
            command = COMMAND.search(span)
            if command is None:
                continue
            parser, words = root, command[1].split()
            named: list[str] = []
            for word in words:
                children = _subparsers(parser)
                if word not in children:
                    break
                parser = children[word]
                named.append(word)
            if not named:  # "tessera/" in a layout, or prose such as "tessera and"
                continue
            accepted = {o for a in parser._actions for o in a.option_strings}
            for flag in FLAG.findall(" ".join(words[len(named) :]) + command[2]):
                assert flag in accepted, f"{doc.name}: `tessera {' '.join(named)}` has no {flag} ({span!r})"


def test_every_other_flag_the_docs_name_is_one_the_code_passes() -> None:
    known = _all_flags(build_parser()) | OTHER_TOOLS
    code = _source_text()
    for doc in DOCS:
        for flag in set(FLAG.findall(doc.read_text())) - known:
            assert flag in code, f"{doc.name} names {flag}: neither a tessera flag nor one the code passes"
