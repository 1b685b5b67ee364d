"""Which devices allocated claims hold (pure): ``status.allocation.devices.results`` of one driver."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Obj = dict[str, Any]
DeviceKey = tuple[str, str]  # (pool, device)


def allocated_keys(claim: Obj, driver: str) -> tuple[DeviceKey, ...]:
    """(pool, device) of each of ``driver``'s devices in the claim's allocation (empty when unallocated)."""
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return tuple((str(r.get("pool", "")), str(r.get("device", ""))) for r in results if r.get("driver") == driver)


def holders(claims: Iterable[Obj], driver: str) -> dict[DeviceKey, tuple[str, str]]:
    """(pool, device) -> (namespace, claim name) for every allocated device of ``driver``."""
    out: dict[DeviceKey, tuple[str, str]] = {}
    for c in claims:
        meta = c.get("metadata") or {}
        for key in allocated_keys(c, driver):
            out[key] = (str(meta.get("namespace", "")), str(meta.get("name", "")))
    return out
