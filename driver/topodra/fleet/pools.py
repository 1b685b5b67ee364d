"""The ResourceSlices that count: the newest generation of each pool (pure).

A driver bumps a pool's generation when it republishes; slices of older generations may linger
until deleted, and the scheduler ignores them. Everyone who counts devices must drop them the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Obj = dict[str, Any]


def pool_of(s: Obj) -> tuple[str, int]:
    """(pool name, generation) of a slice."""
    pool = (s.get("spec") or {}).get("pool") or {}
    return str(pool.get("name", "")), int(pool.get("generation", 0))


def newest_slices(slices: Iterable[Obj], driver: str | None = None, *, node_local: bool = False) -> list[Obj]:
    """Slices (of ``driver`` when given; only node-local ones when ``node_local``) from the newest
    generation of their pool, in input order."""
    mine = [s for s in slices if (driver is None or (s.get("spec") or {}).get("driver") == driver)
            and (not node_local or (s.get("spec") or {}).get("nodeName"))]
    newest: dict[str, int] = {}
    for s in mine:
        name, gen = pool_of(s)
        newest[name] = max(newest.get(name, -1), gen)
    return [s for s in mine if pool_of(s)[1] == newest[pool_of(s)[0]]]
