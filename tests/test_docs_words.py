"""The code, tests and docs speak of the product, not of how it was built: no work sessions
("session 21", "this session"), issue numbers ("issue 26", "the issue's aims"), aims or helpers
(the people who ran things). docs/results/HISTORY.md, the run history, is the one place that may
say when and why a run was made; raw result data (json, jsonl) is not read.

The patterns are narrow on purpose: an HTTP session, ``DraftSession``, "the session's generator",
an upstream project's issue URL or "issues" in general are product words and pass."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HISTORY = ROOT / "docs" / "results" / "HISTORY.md"

PROCESS_WORDS = re.compile(
    r"\bsessions? \d+"                                              # session 21
    r"|\bsessions? (?:earlier|later|ago)\b"                         # two sessions later
    r"|\b(?:this|next|previous|last|earlier|later|each) (?:GPU )?session\b"  # this session
    r"|\bissues? #?\d+"                                             # issue 26, issues 12
    r"|\bissue-\d+"                                                 # the issue-31 table
    r"|\bthe issue's\b"                                             # the aims
    r"|\baims?\b"                                                   # aim, aims
    r"|\bhelper(?:'s|s')",                                          # a helper's tests
    re.IGNORECASE)


def checked_files() -> list[Path]:
    files = [ROOT / "README.md"]
    files += sorted(p for p in (ROOT / "src").rglob("*") if p.suffix in (".py", ".md"))
    files += sorted(p for p in (ROOT / "docs").rglob("*.md") if p != HISTORY)
    files += sorted(p for p in (ROOT / "tests").rglob("*.py") if p.name != Path(__file__).name)
    return [p for p in files if p.is_file()]


def process_words(text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in PROCESS_WORDS.finditer(line):
            found.append(f"line {number}: {match.group(0)!r} in {line.strip()[:100]!r}")
    return found


@pytest.mark.parametrize("path", checked_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_process_words(path):
    found = process_words(path.read_text(errors="replace"))
    assert not found, f"{path.relative_to(ROOT)} speaks of how it was built: {found}"


@pytest.mark.parametrize("text", [
    "measured in session 21", "Sessions 17 and 18", "two sessions later", "in this session",
    "the next GPU session", "(issue 26)", "issue #12", "the issue-31 table",
    "the issue's aims", "The aim of 1.3x", "a helper's tests ran beside it",
])
def test_the_patterns_catch_process_words(text):
    assert process_words(text)


@pytest.mark.parametrize("text", [
    "aiohttp.ClientSession", "the session's generator (DraftSession)", "an HTTP session",
    "see https://github.com/pytorch/pytorch/issues/12345", "known issues with llama.cpp",
    "the test helpers, not shipped", "a helper function", "proton beam therapy",
])
def test_the_patterns_pass_product_words(text):
    assert not process_words(text)
