"""Code, tests, docs and benchmarks say why and how in the present tense: no dates of work and no words
about work sessions (git keeps the history)."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
SOURCES = ("tf_commstrategy", "tests", "docs", "benchmarks", "examples", ".ci")
SUFFIXES = {".py", ".md", ".sh", ".cc", ".toml", ".cfg", ".yml", ".yaml", ".sbatch", ""}
ORDINAL = (r"(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
           r"fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|twenty-\w+)")
DIARY = re.compile(
    rf"\b{ORDINAL} session\b|\b(this|that|last|previous|next|earlier|a later) session\b|\bsessions? of 20\d\d"
    r"|\b20\d\d-[01]\d-[0-3]\d\b|\b(yesterday|tonight|this night|last night)\b", re.IGNORECASE)


def _files():
    yield REPO / "README.md"
    yield REPO / "Makefile"
    for top in SOURCES:
        for p in (REPO / top).rglob("*"):
            if p.is_file() and p.suffix in SUFFIXES and p.name != pathlib.Path(__file__).name:
                yield p


def test_no_dates_of_work_and_no_session_words():
    found = []
    for p in _files():
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            m = DIARY.search(line)
            if m:
                found.append(f"{p.relative_to(REPO)}:{n}: {m.group(0)!r}")
    assert found == [], "say why in the present tense; history lives in git:\n" + "\n".join(found[:40])


def test_the_check_finds_diary_words():
    word = "sess" + "ion"  # spelled apart, so that this file itself holds no diary line
    for text in (f"measured in the nineteenth {word}", f"as this {word} showed", "run on " + "2026-12-06",
                 f"Fifth {word} of " + "2026-12-03", "slower this " + "night than"):
        assert DIARY.search(text), text
    for text in ("start_new_session=True", "a gloo Session", "each session of the benchmark"):
        assert not DIARY.search(text), text
