"""bench/results/INDEX.md lists every result file, and every result a doc names exists.

A renamed or deleted result would otherwise leave a number in the docs with nothing behind it.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest
from bench.paths import REPO, RESULTS, result_file

INDEX = RESULTS / "INDEX.md"
DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md", REPO / "bench" / "README.md"]
NAME = re.compile(r"\d{8}T\d{6}Z(-[A-Za-z0-9][A-Za-z0-9._-]*)?\.(json|md|png)")


def result_files() -> list[str]:
    return sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file() and p != INDEX)


def indexed() -> set[str]:
    """``<bench>/<file>`` for each table row of INDEX.md (rows sit under a ``## <bench>`` heading)."""
    out, bench = set(), ""
    for line in INDEX.read_text().splitlines():
        if line.startswith("## "):
            bench = line[3:].strip()
        elif m := re.match(r"\| `([^`]+)` \|", line):
            out.add(f"{bench}/{m[1]}")
    return out


def expand(pattern: str, ranges: bool) -> list[str]:
    """The shell-style alternatives of a doc's path pattern: ``{a,b}`` lists, or (``ranges``) ``{05..19}``."""
    for m in re.finditer(r"\{([^{}]*)\}", pattern):
        r = re.fullmatch(r"(\d+)\.\.(\d+)", m[1])
        if bool(r) != ranges:
            continue
        alts = [str(i).zfill(len(r[1])) for i in range(int(r[1]), int(r[2]) + 1)] if r else m[1].split(",")
        return [x for alt in alts for x in expand(pattern[:m.start()] + alt + pattern[m.end():], ranges)]
    return [pattern]


def names_something(pattern: str, files: list[str]) -> bool:
    """Each ``{a,b}`` alternative must match a file; a ``{05..19}`` range needs a match somewhere in it."""
    return all(any(fnmatch.filter(files, p) for p in expand(alt, ranges=True)) for alt in expand(pattern, ranges=False))


def doc_references() -> list[tuple[str, str]]:
    """(doc, pattern relative to bench/results) for each result a doc names."""
    refs = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"`(?:bench/results/)?((?:prepare|placement|reliability|inventory|kueue_latency|simulate|"
                             r"scorer_latency|schedule_throughput)/[^`\s]*\.(?:json|md|png))`", text):
            if "<" not in m[1]:  # a template such as prepare/<UTC time>.json names no file
                refs.append((doc.name, m[1]))
    return refs


def test_every_result_file_is_indexed_and_every_indexed_file_exists() -> None:
    files = set(result_files())
    assert files, "no result files found"
    assert sorted(files - indexed()) == [], "result files INDEX.md does not list"
    assert sorted(indexed() - files) == [], "INDEX.md lists files that do not exist"


def test_result_files_are_named_utc_then_label() -> None:
    bad = [f for f in result_files() if not NAME.fullmatch(Path(f).name)]
    assert bad == []


def test_every_result_a_doc_names_exists() -> None:
    files = result_files()
    refs = doc_references()
    assert len(refs) > 20  # the docs do cite results: a broken pattern must not pass by matching nothing
    missing = [(doc, ref) for doc, ref in refs if not names_something(ref, files)]
    assert missing == []


def test_brace_forms_of_the_docs() -> None:
    files = ["p/2026-05-a.json", "p/2026-07-b.json"]
    assert expand("p/2026-{05..07}-{a,b}.json", ranges=False) == ["p/2026-{05..07}-a.json", "p/2026-{05..07}-b.json"]
    assert names_something("p/2026-{05..07}-{a,b}.json", files)
    assert not names_something("p/2026-{05..07}-{a,c}.json", files)  # c names nothing
    assert not names_something("p/2026-{08..09}-a.json", files)


def test_default_result_names_follow_the_rule() -> None:
    assert NAME.fullmatch(result_file("prepare", "compare").name)
    assert NAME.fullmatch(result_file("inventory").name)
    with pytest.raises(ValueError, match="label"):
        result_file("simulate", "../escape")
