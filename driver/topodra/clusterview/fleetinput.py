"""What the inventory feeds the fleet state: only what the fragmentation measure reads. Pure.

``build_view`` computes F_n with the placement scorer's own state and measure (``fleet.state``,
``fleet.fgd``). Built from the raw slices and every DeviceClass, that state was 80-90% of the inventory's
time at 2,048 nodes (32,768 devices): each device was matched against all 22 shipped classes, and each
``DeviceMatch.matches`` call rebuilt the device's 25-attribute map; then every attribute went into the
node's shape key. Yet F_n(m) for a request class m of the mix reads only (``fleet.allocator``): the device
order, whether a device is a GPU (``type``), its membership of m's DeviceClasses, the attributes m's
constraints name (``nvlinkDomain`` for the prior), and what is unavailable (claims, taints). So:

* ``measure_inputs`` keeps the classes the mix names (none for the prior's "any GPU" classes), wrapped so
  that all of them are decided at once per device *signature* (``memoised``), and names the attributes and
  capacities that decide them plus the constraint attributes;
* ``slim_slices`` gives the state copies of the slices with only those attributes (names, taints, order
  unchanged), so node views and shape keys are built over 1-5 attributes instead of 25.

F_n is unchanged (a unit test compares it with the state built the old way); nodes that differ only in
attributes the measure never reads now share a shape, so its memo hits more often. Which names a class
reads comes from its CEL form (``fleet.cel`` ``Term``s; a ``DeviceMatch`` via the CEL it renders, which
is the selector the API server evaluates). When a class's reads cannot be named, nothing is slimmed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from topodra.fleet.cel import Selector, recognise
from topodra.fleet.demand import ANY_GPU
from topodra.fleet.fgd import Mix
from topodra.fleet.state import CelClass, DevicePredicate

Obj = dict[str, Any]
_Names = tuple[tuple[str, ...], tuple[str, ...]]  # (attribute keys, capacity keys) as they may appear raw


def _selectors(pred: DevicePredicate, driver: str) -> tuple[Selector, ...] | None:
    if isinstance(pred, CelClass):
        return pred.selectors
    from topodra.selectors import DeviceMatch  # loaded already when pred is one (fleet.state.class_matcher)

    if isinstance(pred, DeviceMatch):
        sel = recognise(pred.to_cel(driver))
        return (sel,) if sel is not None else None
    return None


def read_names(pred: DevicePredicate, driver: str) -> _Names | None:
    """The raw attribute and capacity keys the class's selectors read (both spellings of the driver's own),
    or None when they cannot be named."""
    sels = _selectors(pred, driver)
    if sels is None:
        return None
    attrs: set[str] = set()
    caps: set[str] = set()
    prefix = driver + "/"
    for sel in sels:
        for t in sel.terms:
            if t.kind == "driver":
                continue
            if not t.name:
                return None
            keys = {t.name, t.name[len(prefix):]} if t.name.startswith(prefix) else {t.name}
            (caps if t.source == "capacity" else attrs).update(keys)
    return tuple(sorted(attrs)), tuple(sorted(caps))


def _raw(value: Any) -> Any:
    return tuple(value.items()) if value.__class__ is dict else value


class _Shared:
    """Every class's answer for the device last asked about, memoised by the values the classes read."""

    def __init__(self, preds: Mapping[str, DevicePredicate], driver: str, names: _Names) -> None:
        self.preds = dict(preds)
        self.driver = driver
        self.attr_keys, self.cap_keys = names
        self._memo: dict[tuple[Any, ...], frozenset[str]] = {}
        self._last: Obj | None = None  # a strong reference: identity stays meaningful
        self._last_classes: frozenset[str] = frozenset()

    def classes_of(self, device: Obj) -> frozenset[str]:
        if device is self._last:
            return self._last_classes
        attrs = device.get("attributes") or {}
        caps = device.get("capacity") or {}
        parts: list[Any] = [_raw(attrs.get(k)) for k in self.attr_keys]
        parts.append(None)  # attributes | capacities
        parts += [_raw(caps.get(k)) for k in self.cap_keys]
        key: tuple[Any, ...] | None = tuple(parts)
        try:
            got = self._memo.get(key)  # type: ignore[arg-type]
        except TypeError:  # an unhashable value: ask the predicates directly
            key, got = None, None
        if got is None:
            got = frozenset(n for n, p in self.preds.items() if p.matches(device, self.driver))
            if key is not None:
                self._memo[key] = got
        self._last, self._last_classes = device, got
        return got


class MemoClass:
    """One class of a memoised set (``DevicePredicate``): answers from the set's shared result."""

    def __init__(self, name: str, shared: _Shared) -> None:
        self.name = name
        self._shared = shared

    def matches(self, device: dict[str, Any], driver: str) -> bool:
        if driver != self._shared.driver:
            return self._shared.preds[self.name].matches(device, driver)
        return self.name in self._shared.classes_of(device)


def memoised(classes: Mapping[str, DevicePredicate | None], driver: str) -> dict[str, DevicePredicate | None]:
    """``classes`` (a ``ClusterState.classes``) with each predicate wrapped, or unchanged when one of them
    reads something that cannot be named."""
    preds = {k: p for k, p in classes.items() if p is not None}
    attrs: set[str] = set()
    caps: set[str] = set()
    for p in preds.values():
        names = read_names(p, driver)
        if names is None:
            return dict(classes)
        attrs.update(names[0])
        caps.update(names[1])
    shared = _Shared(preds, driver, (tuple(sorted(attrs)), tuple(sorted(caps))))
    return {k: (MemoClass(k, shared) if p is not None else None) for k, p in classes.items()}


def measure_inputs(classes: Mapping[str, DevicePredicate | None], mix: Mix,
                   driver: str) -> tuple[dict[str, DevicePredicate | None], _Names | None]:
    """The classes the mix's request classes name (memoised), and the raw attribute and capacity keys the
    measure reads (None: a class's reads cannot be named, so the slices must stay whole)."""
    named = {a.device_class for d, _p in mix.classes for r in d.requests for a in r.alternatives} - {ANY_GPU}
    kept = {k: p for k, p in classes.items() if k in named}
    prefix = driver + "/"
    attrs = {"type", prefix + "type"}
    for d, _p in mix.classes:
        for c in d.constraints:
            attrs.add(c.attribute)
            if c.attribute.startswith(prefix):
                attrs.add(c.attribute[len(prefix):])
    caps: set[str] = set()
    for p in kept.values():
        if p is None:
            continue
        names = read_names(p, driver)
        if names is None:
            return dict(kept), None
        attrs.update(names[0])
        caps.update(names[1])
    return memoised(kept, driver), (tuple(sorted(attrs)), tuple(sorted(caps)))


def slim_slices(slices: Iterable[Obj], names: _Names) -> list[Obj]:
    """Copies of the slices whose devices carry only the ``names`` attributes and capacities (plus their name
    and taints); everything else of the slice is the original's (shared, not copied)."""
    attr_keys, cap_keys = names
    out = []
    for s in slices:
        spec = s.get("spec") or {}
        devices = []
        for dev in spec.get("devices") or []:
            attrs = dev.get("attributes") or {}
            caps = dev.get("capacity") or {}
            slim: Obj = {"name": dev.get("name"),
                         "attributes": {k: attrs[k] for k in attr_keys if k in attrs}}
            if cap_keys:
                slim["capacity"] = {k: caps[k] for k in cap_keys if k in caps}
            if dev.get("taints"):
                slim["taints"] = dev["taints"]
            devices.append(slim)
        out.append({**s, "spec": {**spec, "devices": devices}})
    return out
