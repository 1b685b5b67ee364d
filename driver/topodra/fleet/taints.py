"""Device taints, from the device's slice and from DeviceTaintRules, which of them block, and which claim
tolerates which (pure).

What counts as unavailable: a taint with effect ``NoSchedule`` or ``NoExecute``: the scheduler allocates
such a device only to a request that tolerates the taint. A claim without tolerations (the common case)
tolerates none, so ``ClusterState.unavailable_indices`` counts every blocking-tainted device as unavailable;
a pod whose requests carry tolerations sees the devices whose blocking taints they all tolerate as free
(``ClusterState.unavailable_for``). Other effects (e.g. ``None``, an informational taint) do not block.
A DeviceTaintRule selects devices by ``deviceSelector`` driver, pool and device, each optional.

The toleration rule is the scheduler's, in ``k8s.io/dynamic-resource-allocation@v0.37.2`` (the staging copy of
v1.37.2): ``resourceclaim.ToleratesTaint`` (``resourceclaim/devicetoleration.go:35-56``), which the structured
allocator applies per request and device (``taintPreventsAllocation`` / ``taintTolerated``,
``structured/internal/stable/allocator_stable.go:1281-1301``: every ``NoSchedule``/``NoExecute`` taint of the
device must be tolerated by one of the request's tolerations; other effects, ``None`` included, are ignored):

1. an empty toleration effect matches every effect, else the effects must be equal;
2. an empty toleration key matches every key, else the keys must be equal;
3. operator ``Exists`` matches every value; ``Equal`` (or empty: the API defaults it) needs equal values;
   any other operator matches nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

Obj = dict[str, Any]
BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
Taint = tuple[str, str, str]  # (key, value, effect): hashable, what the toleration rule reads
Toleration = tuple[str, str, str, str]  # (key, operator, value, effect), as written ("" for absent fields)
# Per alternative (request or subrequest) of a pod's claims, its tolerations: what a device must be tolerated by.
Tolerance = tuple[tuple[Toleration, ...], ...]


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


def taint_tuple(t: Obj) -> Taint:
    """A taint object as the hashable ``(key, value, effect)``."""
    return str(t.get("key") or ""), str(t.get("value") or ""), str(t.get("effect") or "")


def blocking_tuples(taints: Iterable[Obj]) -> tuple[Taint, ...]:
    """The blocking taints among ``taints``, as tuples (what a toleration has to tolerate)."""
    return tuple(taint_tuple(t) for t in taints if t.get("effect") in BLOCKING_EFFECTS)


def toleration_tuple(tol: Obj) -> Toleration:
    """A DeviceToleration object as the hashable ``(key, operator, value, effect)``."""
    return (str(tol.get("key") or ""), str(tol.get("operator") or ""), str(tol.get("value") or ""),
            str(tol.get("effect") or ""))


def tolerates(tol: Toleration, taint: Taint) -> bool:
    """``resourceclaim.ToleratesTaint`` of v1.37 (devicetoleration.go; see the module docstring)."""
    key, op, value, effect = tol
    if effect and effect != taint[2]:
        return False
    if key and key != taint[0]:
        return False
    if op in ("", "Equal"):
        return value == taint[1]
    return op == "Exists"


def tolerated(taint: Taint, tolerance: Tolerance) -> bool:
    """Whether every alternative of the pod's claims tolerates the taint (so any of them may take the device).

    Per alternative the scheduler checks its own tolerations; the scorer keeps one view of the node per pod,
    so a device counts as free for the pod only when all of its alternatives could take it (the controller
    renders the same toleration into every request and subrequest, where this is exact)."""
    return bool(tolerance) and all(any(tolerates(t, taint) for t in tols) for tols in tolerance)


def taint_text(t: Obj) -> str:
    """``key=value:Effect`` (``key:Effect`` without a value)."""
    value = t.get("value")
    return f"{t.get('key', '')}{'=' + str(value) if value else ''}:{t.get('effect', '')}"
