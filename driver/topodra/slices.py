"""Pure translation of a node's devices into ``resource.k8s.io/v1`` ResourceSlices.

One pool per node, named after the node.  Devices are ordered deterministically
(GPUs before NICs, then by index) and split into slices of at most 128 devices
(64 when a device uses taints or counters), each carrying the pool's generation
and the total slice count, so the scheduler sees a consistent pool.  Counter
sets of partitionable devices (MIG, topodra.sharing) go in slices of their own,
at most 8 per slice, ahead of the device slices: the API allows a slice either
``sharedCounters`` or ``devices``, never both.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from topodra.devices import Device
from topodra.health.policy import DeviceTaint

MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_ADVANCED = 64
MAX_COUNTER_SETS_PER_SLICE = 8
_KIND_ORDER = {"gpu": 0, "mig": 0, "nic": 1}
_NUM = re.compile(r"(\d+)")


def device_sort_key(d: Device) -> tuple[int, tuple[Any, ...]]:
    """gpu-2 < gpu-10 < nic-0: kind first, then natural order of the name."""
    parts = tuple(int(p) if p.isdigit() else p for p in _NUM.split(d.name))
    return (_KIND_ORDER.get(d.kind, 9), parts)


def device_to_api(d: Device, taints: Sequence[DeviceTaint] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"name": d.name}
    if d.attributes:
        out["attributes"] = {k: v.to_api() for k, v in sorted(d.attributes.items())}
    if d.capacity:
        out["capacity"] = {k: {"value": v} for k, v in sorted(d.capacity.items())}
        for k, p in d.capacity_policies.items():
            out["capacity"][k]["requestPolicy"] = {"default": p["default"],
                                                   "validRange": {"min": p["min"], "step": p["step"]}}
    if d.allow_multiple_allocations:
        out["allowMultipleAllocations"] = True
    if d.consumes_counters:
        out["consumesCounters"] = [
            {"counterSet": cs, "counters": {k: {"value": v} for k, v in sorted(c.items())}}
            for cs, c in sorted(d.consumes_counters.items())
        ]
    if taints:
        out["taints"] = [t.to_api() for t in taints]
    return out


def slice_name(node_name: str, driver_name: str, index: int) -> str:
    return f"{node_name}-{driver_name}-{index:03d}"


def build_slices(driver_name: str, node_name: str, node_uid: str | None,
                 devices: Sequence[Device], generation: int,
                 taints: Mapping[str, Sequence[DeviceTaint]] | None = None) -> list[dict[str, Any]]:
    """The complete desired set of ResourceSlices for one node's pool; ``taints``: device name → its taints."""
    taints = {n: list(ts) for n, ts in (taints or {}).items() if ts}
    # A MIG slice is as healthy as its GPU: it carries the parent's taints (published_taints skips them).
    for d in devices:
        parent = d.attributes.get("parentDevice")
        if d.kind == "mig" and parent is not None and str(parent.value) in taints:
            taints[d.name] = [*taints.get(d.name, []), *taints[str(parent.value)]]
    names = [d.name for d in devices]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"duplicate device names in pool {node_name}: {dupes}")
    ordered = sorted(devices, key=device_sort_key)
    counter_sets = [(n, c) for d in ordered for n, c in sorted(d.shared_counters.items())]
    set_names = [n for n, _ in counter_sets]
    if len(set(set_names)) != len(set_names):
        raise ValueError(f"duplicate counter set names in pool {node_name}")
    unknown = sorted({cs for d in ordered for cs in d.consumes_counters} - set(set_names))
    if unknown:
        raise ValueError(f"devices in pool {node_name} consume undeclared counter sets {unknown}")
    # The API allows fewer devices per slice once any of them is tainted or consumes counters.
    advanced = any(d.name in taints or d.consumes_counters for d in ordered)
    per_slice = MAX_DEVICES_PER_SLICE_ADVANCED if advanced else MAX_DEVICES_PER_SLICE
    counter_chunks = [counter_sets[i:i + MAX_COUNTER_SETS_PER_SLICE]
                      for i in range(0, len(counter_sets), MAX_COUNTER_SETS_PER_SLICE)]
    device_chunks = [ordered[i:i + per_slice] for i in range(0, len(ordered), per_slice)] or [[]]
    n_slices = len(counter_chunks) + len(device_chunks)
    owner = ([{"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}]
             if node_uid else [])
    bodies: list[dict[str, Any]] = [
        {"sharedCounters": [{"name": n, "counters": {k: {"value": v} for k, v in sorted(c.items())}}
                            for n, c in chunk]}
        for chunk in counter_chunks
    ] + [{"devices": [device_to_api(d, taints.get(d.name, ())) for d in chunk]} for chunk in device_chunks]
    slices = []
    for idx, body in enumerate(bodies):
        meta: dict[str, Any] = {"name": slice_name(node_name, driver_name, idx),
                                "labels": {"app.kubernetes.io/managed-by": "topodra"}}
        if owner:
            meta["ownerReferences"] = owner
        slices.append({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": meta,
            "spec": {
                "driver": driver_name,
                "nodeName": node_name,
                "pool": {"name": node_name, "generation": generation, "resourceSliceCount": n_slices},
                **body,
            },
        })
    return slices


def published_taints(slices: Iterable[dict[str, Any]]) -> dict[str, list[DeviceTaint]]:
    """Device → our taints in the newest generation of a pool's slices (admins' taints are not ours)."""
    slices = list(slices)
    newest = max((int(s["spec"]["pool"].get("generation", 0)) for s in slices), default=0)
    out: dict[str, list[DeviceTaint]] = {}
    for s in slices:
        if int(s["spec"]["pool"].get("generation", 0)) != newest:
            continue
        for d in s["spec"].get("devices") or []:
            if ((d.get("attributes") or {}).get("type") or {}).get("string") == "mig":
                continue  # derived from the parent GPU's taints
            ours = [t for t in (DeviceTaint.from_api(x) for x in d.get("taints") or []) if t is not None]
            if ours:
                out[str(d["name"])] = ours
    return out


def same_content(existing: dict[str, Any], desired: dict[str, Any]) -> bool:
    """True when an existing slice already carries the desired spec (including pool generation)."""
    e, d = existing.get("spec", {}), desired["spec"]
    keys = ("driver", "nodeName", "pool", "devices", "sharedCounters")
    return all(_normalize(e.get(k)) == _normalize(d.get(k)) for k in keys)


def _normalize(v: Any) -> Any:
    """Quantities come back canonicalized ("80Gi" stays, "1000Mi" may not); compare structurally."""
    if isinstance(v, dict):
        return {k: _normalize(x) for k, x in v.items() if x not in (None, [], {})}
    if isinstance(v, list):
        return [_normalize(x) for x in v]
    return v
