"""Where the repository is: the kit is installed in editable mode, so it finds the tree it came from."""

from __future__ import annotations

from pathlib import Path

TESTKIT = Path(__file__).resolve().parent
HACK = TESTKIT.parent
REPO = HACK.parent
