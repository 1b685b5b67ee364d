"""Test hooks: named points in prepare/unprepare where TOPODRA_CRASH_POINT makes the process exit as if
killed, so crash tests hit exactly the window they mean (docs/prepare.md, "Testing hooks")."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

CRASH_POINT_ENV = "TOPODRA_CRASH_POINT"
CRASH_EXIT_CODE = 137
CRASH_POINTS = frozenset({
    # In the order a prepare and an unprepare reach them (docs/prepare.md, "Testing hooks").
    "after-mig-created",             # MIG instances of the batch created, no CDI spec or checkpoint yet
    "prepare-before-write",          # claims planned and effects applied, nothing written yet
    "prepare-mid-cdi",               # after the first new CDI spec of the batch, before the others
    "after-cdi-written",             # every new spec written, checkpoint not yet
    "after-checkpoint-written",      # checkpoint written, answer not yet sent
    "after-unprepare-cdi-removed",   # first spec of the batch removed, checkpoint not yet
    "after-unprepare-checkpoint-written",  # checkpoint durable, effects not undone, answer not yet sent
})


def chosen(point: str | None) -> str | None:
    """``point``, else the environment's; ValueError for a name that is no crash point."""
    point = point if point is not None else os.environ.get(CRASH_POINT_ENV) or None
    if point is not None and point not in CRASH_POINTS:
        raise ValueError(f"unknown crash point {point!r}; known: {', '.join(sorted(CRASH_POINTS))}")
    return point


def reached(chosen_point: str | None, point: str) -> None:
    """Exit with ``CRASH_EXIT_CODE`` at once (no cleanup, like kill -9) when ``point`` is the chosen one."""
    if chosen_point == point:
        log.critical("crash point %s reached: exiting with %d as if killed", point, CRASH_EXIT_CODE)
        for h in logging.getLogger().handlers:
            h.flush()
        os._exit(CRASH_EXIT_CODE)
