"""The README's layout table names every package folder, so a newcomer reading it finds every part.

A package (a folder with ``__init__.py``) under ``driver/topodra/`` or ``hack/``, each bench folder, each test
tier and each top-level folder must be named by a path in the table's first column; a path there that does
not exist fails too, so the table cannot drift either way.
"""

from __future__ import annotations

import re

from testkit.paths import REPO

TOP_LEVEL = ("driver", "proto", "deviceclasses", "deploy", "tests", "hack", "docs", "bench")


def layout_paths(readme: str) -> set[str]:
    """Every path the first column of the '## Layout' table names (``a/b/``, ``a/b.py``; ``c.py`` after
    ``a/b.py`` in one cell is ``a/c.py``)."""
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    out: set[str] = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cell = line.split("|")[1]
        base = ""
        for item in re.findall(r"`([^`]+)`", cell):
            if "/" not in item.rstrip("/") and base:
                item = base + item
            out.add(item)
            base = item[: item.rstrip("/").rfind("/") + 1]
    return out


def test_layout_reader_resolves_cells() -> None:
    text = "## Layout\n\n| path | what |\n|---|---|\n| `driver/topodra/state.py`, `cdi.py`, `effects/` | x |\n## Next\n"
    assert layout_paths(text) == {"driver/topodra/state.py", "driver/topodra/cdi.py", "driver/topodra/effects/"}


def test_every_package_folder_is_in_the_readme_layout() -> None:
    named = layout_paths((REPO / "README.md").read_text())
    tops = {n.split("/", 1)[0] for n in named}
    missing_top = [d for d in TOP_LEVEL if d not in tops]
    assert not missing_top, f"README.md's layout table names nothing under: {missing_top}"
    wanted: set[str] = set()
    for root in ("driver/topodra", "hack"):
        for init in (REPO / root).glob("*/__init__.py"):
            rel = init.parent.relative_to(REPO).as_posix()
            if rel != "driver/topodra/pb":  # generated stubs, named in the proto/ row's text
                wanted.add(rel)
    wanted |= {"tests/unit/<layer>", "tests/cluster", "tests/node", "tests/kind"}
    missing = sorted(w for w in wanted if not any(w == n.rstrip("/") for n in named))
    assert not missing, f"README.md's layout table does not name: {missing}"


def test_every_layout_path_exists() -> None:
    named = layout_paths((REPO / "README.md").read_text())
    gone = sorted(n for n in named if "<" not in n and not (REPO / n.rstrip("/")).exists())
    assert not gone, f"README.md's layout table names paths that do not exist: {gone}"
