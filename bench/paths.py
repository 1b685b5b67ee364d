"""Where a bench finds the repository and writes its results, so every bench names its files alike."""

from __future__ import annotations

import re
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"

_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def utc_stamp(when: float | None = None) -> str:
    """``20261201T031813Z``: sorts by time, and readable in a file name."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when))


def result_file(bench: str, label: str = "", suffix: str = ".json", when: float | None = None) -> Path:
    """``bench/results/<bench>/<UTC>-<label><suffix>`` (no ``-<label>`` when it is empty).

    The label says what the run was for (``compare-before-01ac3a9``); a bad one is refused rather
    than turned into a path outside the folder.
    """
    if label and not _LABEL.fullmatch(label):
        raise ValueError(f"result label {label!r}: use letters, digits, '.', '_' and '-' only")
    return RESULTS / bench / f"{utc_stamp(when)}{'-' + label if label else ''}{suffix}"
