"""The controller's cluster facts, kept current by watches instead of re-listed for every pass.

``operator.SnapshotCache`` lists slices, claims, classes, nodes and DeviceTaintRules every ``ttl``: at
2,048 nodes that decodes ~24 MiB of JSON and parses every device's attributes again for each pass (2.33 s
CPU of a pass, issue 22). Here one ``topodra.informer`` (the scorer's list + watch loop) keeps them: each
object is parsed once, when it is listed or its event arrives (a slice's devices with their attributes, a
claim's allocated devices, a node's schedulability and labels), and a pass builds its ``Snapshot`` from
the parsed facts, only when something changed since the previous pass built one.

Bound pods (free CPU and memory, ``controller/hostfit.py``) are watched only from the first pass of a
profile that states its pods' requests: the pod list is the biggest one, clusters without such profiles
never pay for it. ``get`` has ``SnapshotCache.get``'s contract (a Snapshot, or why it cannot be read).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from topodra.apipaths import claim_path, device_class_path, device_taint_rule_path, node_path, pod_path, slices_path
from topodra.controller.availability import PublishedDevice, Snapshot, host_resources
from topodra.fleet.allocations import DeviceKey, allocated_keys
from topodra.fleet.hostres import HostResources
from topodra.fleet.nodes import node_schedulable
from topodra.fleet.pools import pool_of
from topodra.fleet.taints import blocking, rule_matches, rule_taint
from topodra.informer import Informer, Source, settle_heap
from topodra.kube import Kube, Obj
from topodra.selectors import DeviceMatch, domain_attributes

log = logging.getLogger(__name__)

MatchSource = Callable[[DeviceMatch, str], tuple[PublishedDevice, ...]]
BASE_KINDS = ("slices", "claims", "classes", "nodes", "taintrules")
# Pods that hold node CPU and memory: bound and not finished (operator.HOLDING_PODS, the same selector).
HOLDING_PODS = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"


def base_sources(driver: str) -> list[Source]:
    return [
        Source("slices", slices_path(), f"spec.driver={driver}"),
        Source("claims", claim_path()),
        Source("classes", device_class_path()),
        # Without node access every node counts as schedulable; without the DeviceTaintRule API (or its
        # grant) only slice taints count: as SnapshotCache did when those lists failed.
        Source("nodes", node_path(), optional=True),
        Source("taintrules", device_taint_rule_path(), optional=True),
    ]


@dataclass(frozen=True, slots=True)
class SliceFacts:
    """One slice of the driver, parsed: its pool, generation and devices (blocked by the slice's own taints)."""

    pool: str
    generation: int
    devices: tuple[PublishedDevice, ...]
    # (driver, class predicate) -> indices of the devices it selects: kept while the slice is unchanged.
    matched: dict[tuple[str, DeviceMatch], tuple[int, ...]] = field(default_factory=dict, compare=False)

    def matching(self, match: DeviceMatch, driver: str) -> tuple[int, ...]:
        got = self.matched.get((driver, match))
        if got is None:
            got = self.matched[(driver, match)] = tuple(
                i for i, d in enumerate(self.devices) if d.matches(match, driver))
        return got


def slice_facts(obj: Obj, driver: str) -> SliceFacts:
    spec = obj.get("spec") or {}
    pool, generation = pool_of(obj)
    node = str(spec.get("nodeName") or pool)
    return SliceFacts(pool, generation, tuple(
        PublishedDevice(node=node, pool=pool, name=str(dev.get("name", "")), raw=dev,
                        attrs=domain_attributes(dev, driver), blocked=blocking(dev.get("taints") or []))
        for dev in spec.get("devices") or []))


def _name(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def _key(obj: Obj) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name", ""))


class WatchedFacts:
    """Slices, claims, classes, nodes, DeviceTaintRules (and bound pods, once asked for) of one driver,
    watched; ``get`` returns the Snapshot of what is known now (rebuilt only after a change).

    ``sync_wait``: how long a pass waits for a kind's first list (the first pass after start, or the
    first one that asks for pods) before it reports the state as unreadable.
    """

    def __init__(self, kube: Kube, driver: str, watch_timeout: int = 300, sync_wait: float = 30.0,
                 owns_client: bool = False) -> None:
        self.driver = driver
        # ``owns_client``: the client was made for these watches alone (the controller's), so ``close`` closes
        # it too; a client shared with others is theirs to close.
        self._kube, self._owns_client = kube, owns_client
        self.sync_wait = sync_wait
        self._slices: dict[str, SliceFacts] = {}
        self._claims: dict[tuple[str, str], tuple[DeviceKey, ...]] = {}
        self._classes: dict[str, Obj] = {}
        self._nodes: dict[str, Obj] = {}
        self._node_facts: dict[str, tuple[bool, dict[str, str]]] = {}  # name -> (schedulable, labels)
        self._rules: dict[str, Obj] = {}  # rules with an effect
        self._pods: dict[tuple[str, str], Obj] = {}
        self._version = 0  # bumped by every change of a base kind
        self._devices_version = 0  # bumped by every change of slices or rules (what ``devices`` is built of)
        # (version, devices, how to match them slice by slice, the snapshot's match memo)
        self._devices: tuple[int, tuple[PublishedDevice, ...], MatchSource, dict[Any, Any]] | None = None
        self._pods_version = 0  # bumped by every change of pods or nodes (free CPU/memory)
        self._snapshot: tuple[int, Snapshot] | None = None
        self._host: tuple[int, HostResources] | None = None
        self.builds = 0  # snapshots built (a pass after no change builds none)
        self._adding = threading.Lock()
        self.informer = Informer(kube, base_sources(driver), self._replace, self._apply,
                                 watch_timeout=watch_timeout, after_relist=lambda _kind: settle_heap())

    # ----- lifecycle

    def start(self) -> None:
        self.informer.start()

    def close(self) -> None:
        """Stop watching; close the client when it is ours (its pooled connections go with it)."""
        self.informer.close()
        if self._owns_client:
            self._owns_client = False
            self._kube.close()

    def wait_synced(self, timeout: float) -> bool:
        return self.informer.wait_synced(timeout, BASE_KINDS)

    # ----- the informer's callbacks (under its lock)

    def _replace(self, kind: str, items: Sequence[Obj]) -> None:
        if kind == "slices":
            self._slices = {_name(o): slice_facts(o, self.driver) for o in items}
            self._devices_version += 1
        elif kind == "claims":
            self._claims = {}
            for o in items:
                self._set_claim(o)
        elif kind == "classes":
            self._classes = {_name(o): o for o in items}
        elif kind == "nodes":
            self._nodes = {_name(o): o for o in items}
            self._node_facts = {n: _node_facts(o) for n, o in self._nodes.items()}
            self._pods_version += 1
        elif kind == "taintrules":
            self._rules = {_name(o): o for o in items if rule_taint(o) is not None}
            self._devices_version += 1
        elif kind == "pods":
            self._pods = {_key(o): o for o in items}
            self._pods_version += 1
            return
        else:
            raise ValueError(f"unknown kind {kind!r}")
        self._version += 1

    def _apply(self, kind: str, event_type: str, obj: Obj) -> None:
        deleted = event_type == "DELETED"
        name = _name(obj)
        if kind == "slices":
            if deleted:
                self._slices.pop(name, None)
            else:
                self._slices[name] = slice_facts(obj, self.driver)
            self._devices_version += 1
        elif kind == "claims":
            if deleted:
                self._claims.pop(_key(obj), None)
            else:
                self._set_claim(obj)
        elif kind == "classes":
            if deleted:
                self._classes.pop(name, None)
            else:
                self._classes[name] = obj
        elif kind == "nodes":
            self._pods_version += 1
            if deleted:
                self._nodes.pop(name, None)
                self._node_facts.pop(name, None)
            else:
                facts = _node_facts(obj)
                self._nodes[name] = obj
                if self._node_facts.get(name) == facts:
                    return  # a status heartbeat: nothing availability reads changed
                self._node_facts[name] = facts
        elif kind == "taintrules":
            self._rules.pop(name, None)
            if not deleted and rule_taint(obj) is not None:
                self._rules[name] = obj
            self._devices_version += 1
        elif kind == "pods":
            if deleted:
                self._pods.pop(_key(obj), None)
            else:
                self._pods[_key(obj)] = obj
            self._pods_version += 1
            return
        else:
            raise ValueError(f"unknown kind {kind!r}")
        self._version += 1

    def _set_claim(self, obj: Obj) -> None:
        held = allocated_keys(obj, self.driver)
        if held:
            self._claims[_key(obj)] = held
        else:
            self._claims.pop(_key(obj), None)

    # ----- reads

    def versions(self) -> tuple[int, int]:
        """(changes of any base kind, changes of slices or rules): a reader can tell that an event arrived."""
        with self.informer.lock:
            return self._version, self._devices_version

    def get(self, kube: Kube | None = None, host: bool = False) -> Snapshot | str:
        """A snapshot, or why the cluster state cannot be read (``SnapshotCache.get``'s contract).

        ``kube`` is not used (the watches have their own client); it keeps the two caches interchangeable.
        ``host``: with the free CPU and memory of each node; the first such call starts the pod watch."""
        if not self.wait_synced(self.sync_wait):
            return f"cannot read cluster state: {self._not_listed(BASE_KINDS)}"
        with self.informer.lock:
            snap = self._build()
        if not host:
            return snap
        with self._adding:  # passes run in several threads: the first one starts the watch
            if not self.informer.watches("pods"):
                self.informer.add(Source("pods", pod_path(), HOLDING_PODS))
        if not self.informer.wait_synced(self.sync_wait, ["pods"]):
            why = f"cannot list pods ({self._not_listed(['pods'])}); free CPU and memory are not counted"
            return replace(snap, host_error=why)
        with self.informer.lock:
            return replace(snap, host=self._build_host(), pods=tuple(self._pods.values()))

    def _not_listed(self, kinds: Sequence[str]) -> str:
        missing = [k for k in kinds if not self.informer.synced([k])]
        errors = [f"{k}: {self.informer.errors[k]}" for k in missing if k in self.informer.errors]
        return f"{', '.join(missing)} not listed yet" + (f" ({'; '.join(errors)})" if errors else "")

    def _build(self) -> Snapshot:
        if self._snapshot is not None and self._snapshot[0] == self._version:
            return self._snapshot[1]
        if self._devices is None or self._devices[0] != self._devices_version:
            self._devices = (self._devices_version, *self._published(), {})
        _v, devices, source, matched = self._devices
        allocated = frozenset(k for held in self._claims.values() for k in held)
        snap = Snapshot(
            devices=devices, allocated=allocated, classes=dict(self._classes),
            unavailable_nodes=frozenset(n for n, (ok, _labels) in self._node_facts.items() if not ok),
            node_labels={n: dict(labels) for n, (_ok, labels) in self._node_facts.items()}, matched=matched,
            match_source=source, rules=tuple(self._rules.values()), claim_devices=dict(self._claims))
        self._snapshot = (self._version, snap)
        self.builds += 1
        return snap

    def _published(self) -> tuple[tuple[PublishedDevice, ...], MatchSource]:
        """The newest generation's devices of each pool, in list order, blocked by slice or rule taints
        (``availability.published_devices`` of the same objects), and how to find those a class selects from
        what each slice's devices matched before (a slice event re-matches only that slice's devices)."""
        newest: dict[str, int] = {}
        for s in self._slices.values():
            newest[s.pool] = max(newest.get(s.pool, -1), s.generation)
        devices: list[PublishedDevice] = []
        spans: list[tuple[SliceFacts, int]] = []  # each counted slice and where its devices start
        for name in sorted(self._slices):  # the order a list returns them in
            s = self._slices[name]
            if s.generation == newest[s.pool]:
                spans.append((s, len(devices)))
                devices.extend(s.devices)
        if self._rules:
            rules = [r for r in self._rules.values() if blocking([rule_taint(r) or {}])]
            devices = [replace(d, blocked=True) if not d.blocked and any(
                rule_matches(r, self.driver, d.pool, d.name) for r in rules) else d for d in devices]
        out = tuple(devices)

        def source(match: DeviceMatch, driver: str) -> tuple[PublishedDevice, ...]:
            return tuple(out[start + i] for s, start in spans for i in s.matching(match, driver))

        return out, source

    def _build_host(self) -> HostResources:
        if self._host is None or self._host[0] != self._pods_version:
            self._host = (self._pods_version, host_resources(self._nodes.values(), self._pods.values()))
        return self._host[1]


def _node_facts(node: Obj) -> tuple[bool, dict[str, str]]:
    labels: dict[str, Any] = (node.get("metadata") or {}).get("labels") or {}
    return node_schedulable(node), dict(labels)
