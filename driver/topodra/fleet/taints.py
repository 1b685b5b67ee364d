"""Device taints, from the device's slice and from DeviceTaintRules, and which of them block (pure).

What counts as unavailable: a taint with effect ``NoSchedule`` or ``NoExecute`` -- the scheduler
allocates such a device only to a claim that tolerates the taint, and we treat every claim as not
tolerating it (tolerations are rare and per claim; counting the device as free would overstate what
an ordinary claim can get). Other effects (e.g. ``None``, an informational taint) do not block.
A DeviceTaintRule selects devices by ``deviceSelector`` driver, pool and device, each optional.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

Obj = dict[str, Any]
BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})


def rule_taint(rule: Obj) -> Obj | None:
    """The taint a DeviceTaintRule puts on the devices it selects (None when it names no effect)."""
    taint = (rule.get("spec") or {}).get("taint") or {}
    return taint if taint.get("effect") else None


def rule_matches(rule: Obj, driver: str, pool: str, device: str) -> bool:
    """Whether a DeviceTaintRule's ``deviceSelector`` (driver, pool, device; each optional) selects a device.

    An empty or absent selector selects every device (the 1.37 behaviour).
    """
    sel = (rule.get("spec") or {}).get("deviceSelector") or {}
    return all(not sel.get(k) or sel.get(k) == v for k, v in (("driver", driver), ("pool", pool),
                                                               ("device", device)))


def device_taints(device: Obj, rules: Sequence[Obj], driver: str, pool: str) -> list[Obj]:
    """Every taint on a published device: its slice's, then those of the rules that select it."""
    name = str(device.get("name", ""))
    out = list(device.get("taints") or [])
    for r in rules:
        t = rule_taint(r)
        if t is not None and rule_matches(r, driver, pool, name):
            out.append(t)
    return out


def blocking(taints: Iterable[Obj]) -> bool:
    """Whether any of the taints keeps the device from an ordinary claim (NoSchedule/NoExecute)."""
    return any(t.get("effect") in BLOCKING_EFFECTS for t in taints)


def taint_text(t: Obj) -> str:
    """``key=value:Effect`` (``key:Effect`` without a value)."""
    value = t.get("value")
    return f"{t.get('key', '')}{'=' + str(value) if value else ''}:{t.get('effect', '')}"
