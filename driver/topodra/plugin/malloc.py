"""glibc malloc arenas of the plugin process, capped by the process itself at start.

glibc gives a thread that finds the existing arenas busy an arena of its own (up to 8 per core), and
memory freed in one is not reused by another: the gRPC workers and claim readers that run at once
under concurrent kubelet calls each grew one. ``MALLOC_ARENA_MAX=2`` in the DaemonSet did this
before; set here with ``mallopt`` (before any thread starts), every start of ``topodra
kubelet-plugin`` gets it — the chart, a host process, the benchmark. An explicit
``MALLOC_ARENA_MAX`` in the environment wins (glibc read it at process start). Measured in
docs/benchmarks.md ("Side by side with the Go example driver", 2026-12-02, RSS).
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc malloc.h
ARENAS = 2


def cap_arenas(environ: os._Environ[str] | dict[str, str] = os.environ, arenas: int = ARENAS) -> bool:
    """Cap the malloc arenas unless the environment sets ``MALLOC_ARENA_MAX``; False where not glibc."""
    if environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): nothing to cap
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_ARENA_MAX, arenas))
    if not ok:
        log.warning("mallopt(M_ARENA_MAX, %d) failed; malloc arenas are not capped", arenas)
    return ok
