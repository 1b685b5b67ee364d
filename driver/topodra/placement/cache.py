"""Keeps the scorer's ClusterState current: one list + watch loop per kind, no API call per request.

Each informer lists its kind (remembering the list's resourceVersion), replaces what the
state knows of that kind, then watches from that version, resuming from the last event's
version when the server ends a watch.  A 410 Gone (the version fell out of the
apiserver's window) relists at once; other errors relist after a capped backoff.
Bookmarks only move the resume version forward.

Pods and PodGroups are watched for gangs (``fleet.pods``: where a gang's siblings are, its size); the
PodGroup API is optional like the DeviceTaintRule API (served only with the GenericWorkload gate).

DeviceTaintRules are watched too (a blocking rule makes a device unavailable, ``fleet.taints``). Their
API is optional: where it is not served (404) or not granted (403), the kind counts as listed with no
rules and is retried every ``OPTIONAL_RETRY`` seconds, so the scorer still becomes ready.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from topodra.apipaths import (
    claim_path,
    device_class_path,
    device_taint_rule_path,
    node_path,
    pod_path,
    podgroup_path,
    slices_path,
    template_path,
)
from topodra.fleet.state import ClusterState
from topodra.kube import Kube, KubeError, Obj

log = logging.getLogger(__name__)

KINDS = ("slices", "classes", "nodes", "claims", "templates", "taintrules", "pods", "podgroups")
OPTIONAL_RETRY = 60.0  # seconds between tries of an optional kind's API that was missing or forbidden


@dataclass(frozen=True)
class Source:
    kind: str
    path: str
    field_selector: str | None = None
    optional: bool = False  # 403/404 on list: no objects of this kind (older clusters, narrower RBAC)


def sources(driver: str) -> list[Source]:
    return [
        Source("slices", slices_path(), f"spec.driver={driver}"),
        Source("classes", device_class_path()),
        Source("nodes", node_path()),
        Source("claims", claim_path()),
        Source("templates", template_path()),
        Source("taintrules", device_taint_rule_path(), optional=True),
        pods_source(),  # CPU/memory held (fleet.hostres) and a gang's siblings (fleet.pods)
        Source("podgroups", podgroup_path(), optional=True),  # absent without the GenericWorkload gate
    ]


def pods_source() -> Source:
    """Every pod (bound ones hold node CPU and memory; unbound ones carry their pod group). Terminal
    pods are filtered by the server: they hold nothing (``fleet.hostres``)."""
    return Source("pods", pod_path(), "status.phase!=Succeeded,status.phase!=Failed")


def settle_heap() -> None:
    """After a relist the listed objects are long-lived: move everything alive now out of the cyclic
    collector's sight (``gc.freeze``, O(1)). Else a full collection walks them all in the middle of some
    ``prioritize`` call: 260 ms at 2,048 nodes, the whole of the scorer's p99 there (issue 22). Frozen
    objects are still freed by reference counting when a later relist or event drops them."""
    gc.freeze()


def apply_event(state: ClusterState, kind: str, event_type: str, obj: Obj) -> None:
    """One watch event into the state (pure function of state and event)."""
    meta = obj.get("metadata") or {}
    name, ns = str(meta.get("name", "")), str(meta.get("namespace", ""))
    deleted = event_type == "DELETED"
    if kind == "slices":
        state.delete_slice(name) if deleted else state.set_slice(obj)
    elif kind == "classes":
        state.delete_class(name) if deleted else state.set_class(obj)
    elif kind == "nodes":
        state.delete_node(name) if deleted else state.set_node(obj)
    elif kind == "claims":
        state.delete_claim(ns, name) if deleted else state.set_claim(obj)
    elif kind == "templates":
        state.delete_template(ns, name) if deleted else state.set_template(obj)
    elif kind == "taintrules":
        state.delete_taint_rule(name) if deleted else state.set_taint_rule(obj)
    elif kind == "pods":
        state.delete_pod(ns or "default", name) if deleted else state.set_pod(obj)
    elif kind == "podgroups":
        state.pods.delete_group(ns or "default", name) if deleted else state.pods.set_group(obj)
    else:
        raise ValueError(f"unknown kind {kind!r}")


class Cache:
    """The watched state behind one lock, fed by one thread per kind."""

    def __init__(self, kube: Kube, state: ClusterState, watch_timeout: int = 300,
                 on_relist: Callable[[str], None] | None = None) -> None:
        self.kube = kube
        self.state = state
        self.lock = threading.Lock()
        self.watch_timeout = watch_timeout
        self.stop = threading.Event()
        self._synced = {k: threading.Event() for k in KINDS}
        self._threads: list[threading.Thread] = []
        self._on_relist = on_relist
        self.events = 0

    def start(self) -> None:
        for src in sources(self.state.driver):
            t = threading.Thread(target=self._run, args=(src,), name=f"watch-{src.kind}", daemon=True)
            t.start()
            self._threads.append(t)

    def synced(self) -> bool:
        return all(e.is_set() for e in self._synced.values())

    def wait_synced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(e.wait(max(0.0, deadline - time.monotonic())) for e in self._synced.values())

    def close(self) -> None:
        self.stop.set()

    def _run(self, src: Source) -> None:
        backoff = 1.0
        while not self.stop.is_set():
            try:
                items, version = self.kube.list_snapshot(src.path, src.field_selector)
                with self.lock:
                    self.state.replace(src.kind, items)
                    if src.kind in ("slices", "classes"):
                        self.state.warm_views()  # the first prioritize call would build them all
                settle_heap()
                self._synced[src.kind].set()
                if self._on_relist:
                    self._on_relist(src.kind)
                log.info("listed %d %s at resourceVersion %s", len(items), src.kind, version)
                while not self.stop.is_set():
                    for event in self.kube.watch(src.path, version, self.watch_timeout, src.field_selector):
                        obj = event.get("object") or {}
                        version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                        if event.get("type") == "BOOKMARK":
                            continue
                        with self.lock:
                            apply_event(self.state, src.kind, str(event.get("type")), obj)
                            self.events += 1
                        if self.stop.is_set():
                            return
                    backoff = 1.0
            except KubeError as e:
                if src.optional and e.status in (403, 404):
                    with self.lock:
                        self.state.replace(src.kind, [])
                    if not self._synced[src.kind].is_set():
                        log.info("%s: API not available (%s); counting none, retrying every %.0fs",
                                 src.kind, e.status, OPTIONAL_RETRY)
                    self._synced[src.kind].set()
                    self.stop.wait(OPTIONAL_RETRY)
                    continue
                if e.status == 410:
                    log.info("%s: resourceVersion expired (410 Gone); relisting", src.kind)
                    continue
                log.warning("%s: list/watch failed (%s); retrying in %.0fs", src.kind, e, backoff)
                self.stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
