"""The fleet as the scorer and the inventory read it: devices per node, claims, what is unavailable.

Everything here is plain data built from API objects (JSON dicts) with no I/O, so
the scoring rule can be tested on hand-built views and the cache only has to feed
objects in.  A device is unavailable when an allocated claim holds it or a blocking
taint (its slice's or a DeviceTaintRule's, see ``fleet.taints``) keeps it from ordinary
claims.  Three ideas keep ``prioritize`` cheap:

* a claim's spec is parsed once into a hashable ``Demand`` (``fleet.demand``);
* each device's DeviceClass membership is worked out when its slice or a class
  changes (through the classes' ``topodra.io/match`` annotation, the same
  predicate our generated CEL says), never per request;
* each node gets a *shape* id: nodes whose devices look the same to every class
  and constraint (same memberships, same pattern of equal attribute values) share
  it, so results computed for one node are reused for all nodes in the same state.
  Taints are not part of the shape: they enter through the unavailable set, as allocations do.

Tolerations (issue 33): ``unavailable_indices`` is what a claim without tolerations meets (cached per node);
a pod whose claims tolerate some blocking taint present (a reservation's, ``topodra.reservations``) gets,
for the few nodes where that changes anything, its own sets from ``tolerated_unavailable`` (never cached in
the ordinary table, so nothing leaks between pods). ``reservation_marks`` says which devices a
reservation rule holds (``NoSchedule``) or hints (``None``) for which ClaimProfile uid.

Derived caches outside this class (``fleet.nodestates``) follow it through its change journal
(``changed_since``): every update names the nodes whose scoring inputs it changed, or "all".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any, Protocol

from topodra.fleet.allocations import allocated_keys
from topodra.fleet.cel import Selector, qualified_capacity, recognise
from topodra.fleet.demand import Demand, DemandError, demand_gpus, parse_demand
from topodra.fleet.hostres import HostResources, PodRecord, counts, pod_record
from topodra.fleet.pods import Pods
from topodra.fleet.pools import newest_slices
from topodra.fleet.shares import ObservedShares
from topodra.fleet.taints import (
    BLOCKING_EFFECTS,
    Taint,
    Tolerance,
    blocking_tuples,
    rule_matches,
    rule_taint,
    taint_tuple,
    tolerated,
)
from topodra.reservations import HINT_EFFECT, HOLD_EFFECT, RESERVATION_TAINT_KEY

Obj = dict[str, Any]
DeviceKey = tuple[str, str]  # (pool, device) of the scorer's driver
JOURNAL_MAX = 65_536  # changed node names kept for ``changed_since``; a reader further behind rebuilds
_NO_CLASSES: frozenset[str] = frozenset()
_HASHABLE = (str, int, bool, float)  # attribute values used as they are in shape keys (others: their repr)


# --------------------------------------------------------------------------- devices and nodes


@dataclass(frozen=True, slots=True)
class DeviceView:
    key: DeviceKey
    gpu: bool  # a full GPU of the driver: what fragmentation counts
    classes: frozenset[str]  # DeviceClasses (with a match annotation) that select it
    attrs: Mapping[str, Any]  # fully qualified attribute name -> plain value
    capacity: Mapping[str, Decimal] = field(default_factory=dict)  # fully qualified name -> value
    driver: str = ""
    tainted: bool = False  # a NoSchedule/NoExecute taint in its own slice (DeviceTaintRules: ClusterState)
    taints: tuple[Taint, ...] = ()  # those blocking taints of its slice (what a toleration must tolerate)


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    devices: tuple[DeviceView, ...]  # in the allocator's order: pools, slices by name, slice order
    shape: int  # equal for nodes whose devices behave the same for every class and constraint
    index: Mapping[DeviceKey, int] = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        return sum(1 for d in self.devices if d.gpu)


def qualified_attributes(device: Obj, driver: str) -> dict[str, Any]:
    """Attribute values keyed by fully qualified name (unqualified names belong to the driver)."""
    out: dict[str, Any] = {}
    for key, val in (device.get("attributes") or {}).items():
        if isinstance(val, dict) and val:
            out[key if "/" in key else f"{driver}/{key}"] = next(iter(val.values()))
    return out


class DevicePredicate(Protocol):
    def matches(self, device: dict[str, Any], driver: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class CelClass:
    """A DeviceClass without our annotation whose CEL selectors are all in ``fleet.cel``'s subset."""

    selectors: tuple[Selector, ...]

    def matches(self, device: dict[str, Any], driver: str) -> bool:
        attrs = qualified_attributes(device, driver)
        caps = qualified_capacity(device, driver)
        return all(s.matches(driver, attrs, caps) for s in self.selectors)


def class_matcher(obj: Obj) -> DevicePredicate | None:
    """The predicate of a DeviceClass: its ``topodra.io/match`` annotation, else its CEL selectors when
    the scorer can evaluate every one of them; None (matches nothing) for any other class.

    ``topodra.selectors`` (pydantic, ~0.1 s to import) is imported here, on the first class parsed: the
    inventory parses only the classes its request mix names, none without claims."""
    from topodra.selectors import MATCH_ANNOTATION, DeviceMatch

    text = ((obj.get("metadata") or {}).get("annotations") or {}).get(MATCH_ANNOTATION)
    if text:
        try:
            return DeviceMatch.from_annotation(text)
        except ValueError:
            return None
    selectors = []
    for sel in (obj.get("spec") or {}).get("selectors") or []:
        expr = ((sel or {}).get("cel") or {}).get("expression")
        got = recognise(expr) if isinstance(expr, str) else None
        if got is None:
            return None
        selectors.append(got)
    return CelClass(tuple(selectors))


def _shape_key(devices: Iterable[DeviceView]) -> tuple[Any, ...]:
    """Canonical form: attribute values replaced by their first-occurrence index within the node."""
    seen: dict[str, dict[Any, int]] = {}
    out = []
    for d in devices:
        canon = []
        attrs = d.attrs
        for name in sorted(attrs):
            ids = seen.get(name)
            if ids is None:
                ids = seen[name] = {}
            v = attrs[name]
            hv = v if isinstance(v, _HASHABLE) else repr(v)
            canon.append((name, ids.setdefault(hv, len(ids))))
        out.append((d.gpu, tuple(sorted(d.classes)) if d.classes else (), tuple(canon)))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Mark:
    """Devices of one node that a reservation rule (``topodra.reservations``) holds or hints for a profile."""

    uid: str  # the reserving ClaimProfile's uid (the taint's value)
    effect: str  # HOLD_EFFECT (held: only its claims may take them) or HINT_EFFECT (the scorer steers)
    devices: frozenset[int]  # indices into the node's view


# --------------------------------------------------------------------------- claims


@dataclass(frozen=True, slots=True)
class ClaimInfo:
    uid: str
    created: str
    demand: Demand | None  # None: unreadable spec (ignored)
    allocated: tuple[DeviceKey, ...]  # devices of our driver in status.allocation
    is_allocated: bool


def _claim_info(obj: Obj, driver: str) -> ClaimInfo:
    meta = obj.get("metadata") or {}
    try:
        demand: Demand | None = parse_demand(obj.get("spec") or {})
    except DemandError:
        demand = None
    return ClaimInfo(uid=str(meta.get("uid", "")), created=str(meta.get("creationTimestamp", "")),
                     demand=demand, allocated=allocated_keys(obj, driver),
                     is_allocated=(obj.get("status") or {}).get("allocation") is not None)


def _key(obj: Obj) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


# --------------------------------------------------------------------------- the whole view


class ClusterState:
    """The watched objects and what is derived from them. Not thread-safe: the cache holds a lock.

    ``window`` bounds how many recent claims the request mix is learned from.
    """

    def __init__(self, driver: str, window: int = 200) -> None:
        if window < 0:
            raise ValueError("window must be >= 0")
        self.driver = driver
        self.window = window
        self.slices: dict[str, Obj] = {}
        self.classes: dict[str, DevicePredicate | None] = {}
        self.nodes: set[str] = set()
        self.node_labels: dict[str, dict[str, str]] = {}  # fabric domains of gangs (fleet.domains)
        self.pods = Pods()  # gang siblings and PodGroups (fleet.pods)
        self.claims: dict[tuple[str, str], ClaimInfo] = {}
        self.templates: dict[tuple[str, str], Demand | None] = {}
        self.recent: OrderedDict[str, tuple[str, Demand]] = OrderedDict()  # uid -> (created, demand)
        self.mix_version = 0  # bumped whenever ``recent`` changes (lets callers reuse a mix)
        self._mix: tuple[int, dict[Demand, int]] | None = None
        # ``recent`` by demand: its uids there with their arrival numbers, oldest first (observed_mix's counts
        # and order without walking the window on every new claim).
        self._recent_by_demand: dict[Demand, dict[str, int]] = {}
        self._recent_seq = 0
        self._interned: dict[Demand, Demand] = {}  # one object per distinct demand: dict hits by identity
        self.used: dict[DeviceKey, int] = {}  # allocated devices -> how many claims hold them
        self.taint_rules: dict[str, Obj] = {}  # DeviceTaintRules with an effect, by name
        self._slices_by_node: dict[str, set[str]] = {}
        self._pool_node: dict[str, str] = {}
        self._used_by_node: dict[str, frozenset[int]] = {}
        # ``unavailable_for`` per node and tolerance (backfill pods share a few tolerances: one per window bucket),
        # dropped with the node's ``_used_by_node`` entry.
        self._tolerated_by_node: dict[str, dict[Tolerance, frozenset[int]]] = {}
        # Derived from slices and rules only (never claims): blocking taint -> nodes where some device may carry
        # it, and each node's reservation marks. Dropped whenever a slice, a class or a rule changes.
        self._taint_nodes: dict[Taint, set[str]] | None = None
        self._marks: dict[str, tuple[Mark, ...]] | None = None
        # Blocking rules by the pool their selector names ("" for none: any pool), so a device asks only the
        # rules that can select it (a reservation names one pool per rule: O(rules of its node), not O(rules)).
        self._blocking_by_pool: dict[str, list[Obj]] | None = None
        self._views: dict[str, NodeView] = {}
        self._shapes: dict[tuple[Any, ...], int] = {}
        self.hosts = HostResources()  # nodes' allocatable CPU/memory and bound pods' requests
        # CPU and memory per GPU that bound GPU pods of each size asked for (fleet.shares; issue 34)
        self.shares = ObservedShares(window)
        # Nodes whose view, unavailable devices, labels or free CPU/memory changed, in order; change
        # number ``_journal_base + k`` is ``_journal[k]``. "Everything changed" empties it past the base.
        self._journal: list[str] = []
        self._journal_base = 0

    # ----- change journal

    @property
    def changes(self) -> int:
        """The number of the latest change: pass it to ``changed_since`` later."""
        return self._journal_base + len(self._journal)

    def changed_since(self, mark: int) -> list[str] | None:
        """Nodes whose scoring inputs changed after change ``mark`` (repeats possible), or None when
        that is not known any more (everything may have changed: rebuild)."""
        if mark < self._journal_base or mark > self.changes:
            return None
        return self._journal[mark - self._journal_base:]

    def _touch(self, node: str) -> None:
        self._journal.append(node)
        if len(self._journal) > JOURNAL_MAX:
            drop = len(self._journal) // 2
            del self._journal[:drop]
            self._journal_base += drop

    def _touch_all(self) -> None:
        self._journal_base += len(self._journal) + 1
        self._journal.clear()

    def _forget_used(self) -> None:
        """Every node's unavailable set may have changed (a taint rule, a relist of claims)."""
        self._drop_all_used()
        self._touch_all()

    def _drop_used(self, node: str) -> None:
        self._used_by_node.pop(node, None)
        self._tolerated_by_node.pop(node, None)

    def _drop_all_used(self) -> None:
        self._used_by_node.clear()
        self._tolerated_by_node.clear()

    def _forget_rules(self) -> None:
        self._forget_used()
        self._forget_taint_index()

    # ----- updates

    def set_slice(self, obj: Obj) -> None:
        name = str((obj.get("metadata") or {}).get("name", ""))
        spec = obj.get("spec") or {}
        self.delete_slice(name)
        node = spec.get("nodeName")
        if spec.get("driver") != self.driver or not node:
            return  # another driver's, or not node-local: nothing this scorer places
        self.slices[name] = obj
        self._slices_by_node.setdefault(str(node), set()).add(name)
        self._forget_taint_index()
        self._pool_node[str((spec.get("pool") or {}).get("name", ""))] = str(node)
        self._forget_view(str(node))

    def delete_slice(self, name: str) -> None:
        old = self.slices.pop(name, None)
        if old is not None:
            node = str(old["spec"]["nodeName"])
            self._slices_by_node.get(node, set()).discard(name)
            self._forget_view(node)
            self._forget_taint_index()

    def _forget_view(self, node: str) -> None:
        self._views.pop(node, None)
        self._drop_used(node)
        self._touch(node)

    def _forget_views(self) -> None:
        self._views.clear()
        self._drop_all_used()
        self._forget_taint_index()
        self._touch_all()

    def _forget_taint_index(self) -> None:
        self._taint_nodes = None
        self._marks = None
        self._blocking_by_pool = None

    def _claim_touched(self, info: ClaimInfo) -> None:
        for pool, _dev in info.allocated:
            node = self._pool_node.get(pool)
            if node is not None:
                self._drop_used(node)
                self._touch(node)

    def set_taint_rule(self, obj: Obj) -> None:
        """A DeviceTaintRule (any driver's: its selector decides); one without an effect taints nothing."""
        name = _key(obj)[1]
        old = self.taint_rules.pop(name, None)
        if rule_taint(obj) is not None:
            self.taint_rules[name] = obj
        self._rule_changed(old, obj)

    def delete_taint_rule(self, name: str) -> None:
        old = self.taint_rules.pop(name, None)
        if old is not None:
            self._rule_changed(old, None)

    def _rule_changed(self, old: Obj | None, new: Obj | None) -> None:
        """Forget what a rule change may have changed: a rule naming a pool (a reservation's: one node) changes
        only that node's unavailable devices; one without a pool may select devices on any node. Reservation
        rules come and go every pass (holds, hints, backfill windows): dropping every node's table for each was
        the scorer's cost with reservations (docs/placement.md)."""
        nodes: set[str] = set()
        for r in (old, new):
            if r is None:
                continue
            if not ((r.get("spec") or {}).get("deviceSelector") or {}).get("pool"):
                self._forget_rules()
                return
            nodes.update(self._rule_nodes(r))
        self._forget_taint_index()
        for node in nodes:
            self._drop_used(node)
            self._touch(node)

    def set_class(self, obj: Obj) -> None:
        self.classes[_key(obj)[1]] = class_matcher(obj)
        self._forget_views()

    def delete_class(self, name: str) -> None:
        self.classes.pop(name, None)
        self._forget_views()

    def set_node(self, obj: Obj) -> None:
        self.nodes.add(_key(obj)[1])
        self.node_labels[_key(obj)[1]] = {str(k): str(v) for k, v in
                                          ((obj.get("metadata") or {}).get("labels") or {}).items()}
        self.hosts.set_node(obj)
        self._touch(_key(obj)[1])

    def delete_node(self, name: str) -> None:
        self.nodes.discard(name)
        self.node_labels.pop(name, None)
        self.hosts.delete_node(name)
        self._touch(name)

    def set_pod(self, obj: Obj) -> None:
        """One Pod watch feeds both pod views: gang membership (``pods``) and CPU/memory held (``hosts``)."""
        self.pods.set_pod(obj)
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace") or "default"), str(meta.get("name", "")))
        old = self.hosts.pods.get(key)
        self.hosts.set_pod(obj)
        new = self.hosts.pods.get(key)
        self._pod_moved(old, new)
        if new is not None and new.node:
            self._observe_share(obj, new)

    def observe_shares(self, pods: Iterable[Obj]) -> None:
        """Count the bound, non-terminal GPU pods of a list in ``shares`` (oldest first, so the window keeps the
        newest): a relist, or the inventory's one-shot read, learns what the watch would have. Pods whose claims
        are not known yet are left for their next event."""
        def created(pod: Obj) -> str:
            return str((pod.get("metadata") or {}).get("creationTimestamp") or "")

        for pod in sorted(pods, key=created):
            rec = pod_record(pod)
            if rec.node and counts(pod):
                self._observe_share(pod, rec)

    def _observe_share(self, pod: Obj, rec: PodRecord) -> None:
        """Count a bound pod's per-GPU CPU and memory in ``shares`` once, when all its claims are known."""
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if not uid or self.shares.seen(uid):
            return
        gpus = self.pod_gpus(pod)
        if gpus:
            self.shares.add(uid, gpus, rec.cpu_milli, rec.memory_bytes)

    def pod_gpus(self, pod: Obj) -> int:
        """GPUs of the driver the pod's claims ask for, allocated or not (``demand_gpus`` of each); 0 when a
        claim is unknown or its size is not (allocationMode All, an unreadable spec)."""
        ns = str((pod.get("metadata") or {}).get("namespace") or "default")
        generated = {s.get("name"): s.get("resourceClaimName")
                     for s in ((pod.get("status") or {}).get("resourceClaimStatuses") or [])}
        total = 0
        for ref in (pod.get("spec") or {}).get("resourceClaims") or []:
            name = ref.get("resourceClaimName") or generated.get(ref.get("name"))
            info = self.claims.get((ns, str(name))) if name else None
            if info is None or info.demand is None:
                return 0
            k = demand_gpus(info.demand)
            if not k:
                return 0
            total += k
        return total

    def delete_pod(self, namespace: str, name: str) -> None:
        self.pods.delete_pod(namespace, name)
        old = self.hosts.pods.get((namespace, name))
        self.hosts.delete_pod(namespace, name)
        self._pod_moved(old, None)

    def _pod_moved(self, old: PodRecord | None, new: PodRecord | None) -> None:
        """The nodes whose free CPU/memory a pod update changed."""
        if old == new:
            return
        for rec in (old, new):
            if rec is not None and rec.node:
                self._touch(rec.node)

    def set_claim(self, obj: Obj) -> None:
        key = _key(obj)
        self.delete_claim(*key, forget=False)
        info = self._intern(_claim_info(obj, self.driver))
        self.claims[key] = info
        for k in info.allocated:
            self.used[k] = self.used.get(k, 0) + 1
        self._claim_touched(info)
        if info.demand is not None and info.uid and info.uid not in self.recent and self.window:
            self.recent[info.uid] = (info.created, info.demand)
            self._recent_seq += 1
            self._recent_by_demand.setdefault(info.demand, {})[info.uid] = self._recent_seq
            self.mix_version += 1
            while len(self.recent) > self.window:
                self._recent_drop(next(iter(self.recent)))

    def _recent_drop(self, uid: str) -> bool:
        """Take a claim out of the learned window; False when it was not there."""
        got = self.recent.pop(uid, None)
        if got is None:
            return False
        uids = self._recent_by_demand[got[1]]
        del uids[uid]
        if not uids:
            del self._recent_by_demand[got[1]]
        return True

    def _index_recent(self) -> None:
        self._recent_by_demand.clear()
        for uid, (_created, demand) in self.recent.items():
            self._recent_seq += 1
            self._recent_by_demand.setdefault(demand, {})[uid] = self._recent_seq

    def _intern(self, info: ClaimInfo) -> ClaimInfo:
        if info.demand is None:
            return info
        if len(self._interned) > 10_000:
            self._interned.clear()
        demand = self._interned.setdefault(info.demand, info.demand)
        return info if demand is info.demand else replace(info, demand=demand)

    def delete_claim(self, namespace: str, name: str, forget: bool = False) -> None:
        """Drop a claim's devices from use. It stays in the mix (history) unless ``forget``."""
        info = self.claims.pop((namespace, name), None)
        if info is None:
            return
        for k in info.allocated:
            n = self.used.get(k, 0) - 1
            if n > 0:
                self.used[k] = n
            else:
                self.used.pop(k, None)
        self._claim_touched(info)
        if forget and self._recent_drop(info.uid):
            self.mix_version += 1

    def set_template(self, obj: Obj) -> None:
        try:
            demand: Demand | None = parse_demand(((obj.get("spec") or {}).get("spec")) or {})
        except DemandError:
            demand = None
        self.templates[_key(obj)] = demand

    def delete_template(self, namespace: str, name: str) -> None:
        self.templates.pop((namespace, name), None)

    def replace(self, kind: str, objs: Iterable[Obj]) -> None:
        """A fresh list of one kind (after a relist) replaces everything known of that kind."""
        items = list(objs)
        if kind == "slices":
            self.slices.clear()
            self._slices_by_node.clear()
            self._pool_node.clear()
            self._forget_views()
            for o in items:
                self.set_slice(o)
        elif kind == "classes":
            self.classes.clear()
            for o in items:
                self.set_class(o)
            self._forget_views()
        elif kind == "nodes":
            self.nodes = set()
            self.node_labels = {}
            for o in items:
                self.set_node(o)
            self.hosts.replace_nodes(items)
            self._touch_all()
        elif kind == "pods":
            self.pods.replace_pods(items)
            self.hosts.replace_pods(items)
            self.observe_shares(items)
            self._touch_all()
        elif kind == "podgroups":
            self.pods.replace_groups(items)
        elif kind == "claims":
            self.claims.clear()
            self.used.clear()
            self._forget_used()
            history = dict(self.recent)
            self.recent.clear()
            self._index_recent()
            for o in sorted(items, key=lambda o: str((o.get("metadata") or {}).get("creationTimestamp", ""))):
                self.set_claim(o)
            # Claims deleted while we were not watching still count as history, oldest first.
            merged = sorted({**history, **self.recent}.items(), key=lambda kv: kv[1][0])
            self.recent = OrderedDict(merged[-self.window:] if self.window else [])
            self._index_recent()
            self.mix_version += 1
        elif kind == "templates":
            self.templates.clear()
            for o in items:
                self.set_template(o)
        elif kind == "taintrules":
            self.taint_rules.clear()
            for o in items:
                self.set_taint_rule(o)
            self._forget_rules()
        else:
            raise ValueError(f"unknown kind {kind!r}")

    # ----- queries

    def node_view(self, node: str) -> NodeView | None:
        """The node's devices (None when it publishes none of ours); built once per change.

        Written for speed (the inventory builds 2,048 of these, 32,768 devices, per run): the predicates
        that can match are listed once per call, a device without taints or capacity skips their parsing,
        and one slice's newest-generation check is skipped. Same views as the plain loop (unit tested)."""
        view = self._views.get(node)
        if view is not None:
            return view
        names = self._slices_by_node.get(node)
        if not names:
            return None
        if len(names) == 1:  # a pool's one slice is its newest generation
            current = [self.slices[n] for n in names]
        else:
            current = newest_slices(self.slices[n] for n in names)
            current.sort(key=lambda s: (str(s["spec"]["pool"].get("name", "")), str(s["metadata"]["name"])))
        driver = self.driver
        prefix = driver + "/"
        type_key = prefix + "type"
        preds = [(name, m) for name, m in self.classes.items() if m is not None]
        devices = []
        for s in current:
            pool = str(s["spec"]["pool"].get("name", ""))
            for dev in s["spec"].get("devices") or []:
                attrs = {}  # qualified_attributes, inline
                for key, val in (dev.get("attributes") or {}).items():
                    if isinstance(val, dict) and val:
                        attrs[key if "/" in key else prefix + key] = next(iter(val.values()))
                classes = frozenset([name for name, m in preds if m.matches(dev, driver)]) if preds else _NO_CLASSES
                taints = blocking_tuples(dev["taints"]) if dev.get("taints") else ()
                devices.append(DeviceView((pool, str(dev.get("name", ""))), attrs.get(type_key) == "gpu", classes,
                                          attrs, qualified_capacity(dev, driver) if dev.get("capacity") else {},
                                          driver, bool(taints), taints))
        shape = self._shapes.setdefault(_shape_key(devices), len(self._shapes))
        view = NodeView(name=node, devices=tuple(devices), shape=shape,
                        index={d.key: i for i, d in enumerate(devices)})
        self._views[node] = view
        return view

    def nodes_with_devices(self) -> list[str]:
        """Nodes with at least one slice of the driver (``node_view`` is not None for exactly these)."""
        return [node for node, names in self._slices_by_node.items() if names]

    def warm_views(self) -> int:
        """Build every node's view now (after a relist) rather than in the next ``prioritize`` call."""
        return sum(1 for node in list(self._slices_by_node) if self.node_view(node) is not None)

    def unavailable_indices(self, view: NodeView) -> frozenset[int]:
        """Indices of the node's devices no ordinary claim can get: held by an allocated claim, or
        blocked by a NoSchedule/NoExecute taint (the slice's or a DeviceTaintRule's). Cached until a
        claim there, the node's slices or any rule change."""
        got = self._used_by_node.get(view.name)
        if got is None:
            used = self.used
            if self.taint_rules:
                got = frozenset([i for i, d in enumerate(view.devices) if d.key in used or d.tainted
                                 or self._ruled_out(d.key)])
            else:  # no rule to ask (the common case; 32,768 devices at 2,048 nodes)
                got = frozenset([i for i, d in enumerate(view.devices) if d.key in used or d.tainted])
            self._used_by_node[view.name] = got
        return got

    def _blocking_rules(self) -> dict[str, list[Obj]]:
        if self._blocking_by_pool is None:
            out: dict[str, list[Obj]] = {}
            for r in self.taint_rules.values():
                if (rule_taint(r) or {}).get("effect") in BLOCKING_EFFECTS:
                    pool = str(((r.get("spec") or {}).get("deviceSelector") or {}).get("pool") or "")
                    out.setdefault(pool, []).append(r)
            self._blocking_by_pool = out
        return self._blocking_by_pool

    def _ruled_out(self, key: DeviceKey) -> bool:
        by_pool = self._blocking_rules()
        return any(rule_matches(r, self.driver, key[0], key[1])
                   for r in (*by_pool.get(key[0], ()), *by_pool.get("", ())))

    # ----- tolerations and reservations (issue 33)

    def _rule_nodes(self, rule: Obj) -> list[str]:
        """Nodes on which a rule may select devices of the driver (topodra's pool is the node's name)."""
        sel = (rule.get("spec") or {}).get("deviceSelector") or {}
        if sel.get("driver") and sel["driver"] != self.driver:
            return []
        if sel.get("pool"):
            node = self._pool_node.get(str(sel["pool"]))
            return [node] if node is not None else []
        return self.nodes_with_devices()

    def taint_nodes(self) -> dict[Taint, set[str]]:
        """Every blocking taint present (slices' and rules') -> the nodes where a device may carry it. Built
        when first asked after a slice, class or rule change: only pods with tolerations ask."""
        if self._taint_nodes is None:
            out: dict[Taint, set[str]] = {}
            for node in self.nodes_with_devices():
                view = self.node_view(node)
                for d in view.devices if view is not None else ():
                    for t in d.taints:
                        out.setdefault(t, set()).add(node)
            for r in self.taint_rules.values():
                rt = rule_taint(r)
                if rt is not None and rt.get("effect") in BLOCKING_EFFECTS:
                    out.setdefault(taint_tuple(rt), set()).update(self._rule_nodes(r))
            self._taint_nodes = out
        return self._taint_nodes

    def unavailable_for(self, view: NodeView, tolerance: Tolerance) -> frozenset[int]:
        """``unavailable_indices`` as a pod with these tolerations meets it: held by an allocated claim, or
        carrying a blocking taint that not every alternative of the pod tolerates (``fleet.taints.tolerated``).
        Equal to ``unavailable_indices`` for an empty tolerance. Cached per node and tolerance until a claim
        there, the node's slices or a rule that may select its devices change (as ``unavailable_indices``)."""
        mine = self._tolerated_by_node.setdefault(view.name, {})
        got = mine.get(tolerance)
        if got is None:
            got = mine[tolerance] = self._unavailable_for(view, tolerance)
        return got

    def _unavailable_for(self, view: NodeView, tolerance: Tolerance) -> frozenset[int]:
        used = self.used
        pools = {d.key[0] for d in view.devices}
        by_pool = self._blocking_rules()
        rules = []
        for r in [r for pool in (*sorted(pools), "") for r in by_pool.get(pool, ())]:
            t = rule_taint(r)
            if t is not None:
                rules.append((taint_tuple(t), r))
        out = []
        for i, d in enumerate(view.devices):
            if d.key in used or any(not tolerated(t, tolerance) for t in d.taints) or any(
                    not tolerated(t, tolerance) and rule_matches(r, self.driver, d.key[0], d.key[1]) for t, r in rules):
                out.append(i)
        return frozenset(out)

    def tolerated_unavailable(self, tolerance: Tolerance) -> dict[str, frozenset[int]]:
        """For a pod with these tolerations: the nodes whose unavailable devices differ from the ordinary
        ones, with the pod's own set (``unavailable_for``); empty when it tolerates no blocking taint present
        (then the ordinary per-state tables serve it unchanged)."""
        if not tolerance:
            return {}
        nodes: set[str] = set()
        for t, where in self.taint_nodes().items():
            if tolerated(t, tolerance):
                nodes |= where
        out = {}
        for node in nodes:
            view = self.node_view(node)
            if view is None:
                continue
            got = self.unavailable_for(view, tolerance)
            if got != self.unavailable_indices(view):
                out[node] = got
        return out

    def reservation_marks(self) -> dict[str, tuple[Mark, ...]]:
        """Node -> the devices reservation rules (key ``RESERVATION_TAINT_KEY``, effect ``NoSchedule`` or
        ``None``) select there, per rule; empty without such rules (checked first: no cost then)."""
        if self._marks is None:
            out: dict[str, list[Mark]] = {}
            for r in self.taint_rules.values():
                t = rule_taint(r)
                if t is None or t.get("key") != RESERVATION_TAINT_KEY or t.get("effect") not in (HOLD_EFFECT,
                                                                                                HINT_EFFECT):
                    continue
                for node in self._rule_nodes(r):
                    view = self.node_view(node)
                    if view is None:
                        continue
                    idx = frozenset(i for i, d in enumerate(view.devices)
                                    if rule_matches(r, self.driver, d.key[0], d.key[1]))
                    if idx:
                        out.setdefault(node, []).append(Mark(str(t.get("value") or ""), str(t["effect"]), idx))
            self._marks = {n: tuple(ms) for n, ms in out.items()}
        return self._marks

    def pod_demands(self, pod: Obj) -> list[Demand]:
        """The pod's claims still to be allocated, from the cache (never the API).

        A claim named in the pod, or generated from a template (its name is in the pod's
        status), is looked up among watched claims; when the generated claim is not seen yet,
        the template's spec stands in for it. Allocated claims are skipped (their devices are
        already in use); unknown or unreadable claims are ignored.
        """
        meta = pod.get("metadata") or {}
        ns = str(meta.get("namespace") or "default")
        generated = {s.get("name"): s.get("resourceClaimName")
                     for s in ((pod.get("status") or {}).get("resourceClaimStatuses") or [])}
        out: list[Demand] = []
        for ref in (pod.get("spec") or {}).get("resourceClaims") or []:
            info: ClaimInfo | None = None
            demand: Demand | None = None
            if ref.get("resourceClaimName"):
                info = self.claims.get((ns, str(ref["resourceClaimName"])))
            elif ref.get("resourceClaimTemplateName"):
                if ref.get("name") in generated and not generated[ref.get("name")]:
                    continue  # the claim controller decided no claim is needed
                gen = generated.get(ref.get("name"))
                info = self.claims.get((ns, str(gen))) if gen else None
                if info is None:
                    demand = self.templates.get((ns, str(ref["resourceClaimTemplateName"])))
            if info is not None:
                if info.is_allocated:
                    continue
                demand = info.demand
            if demand is not None:
                out.append(demand)
        return out

    def observed_mix(self) -> dict[Demand, int]:
        """How often each demand occurred among the last ``window`` claims, in the order of first occurrence
        there (counted once per change, from the window's index by demand: ~10 demands, not 200 claims)."""
        if self._mix is None or self._mix[0] != self.mix_version:
            by_age = sorted(self._recent_by_demand.items(), key=lambda kv: next(iter(kv[1].values())))
            self._mix = (self.mix_version, {d: len(uids) for d, uids in by_age})
        return dict(self._mix[1])

    def sizes(self) -> dict[str, int]:
        return {"slices": len(self.slices), "nodes": len(self.nodes), "claims": len(self.claims),
                "templates": len(self.templates), "device_classes": len(self.classes),
                "taint_rules": len(self.taint_rules), "pods": len(self.hosts.pods),
                "used_devices": len(self.used), "recent_claims": len(self.recent),
                "node_views": len(self._views), "shapes": len(self._shapes)}

