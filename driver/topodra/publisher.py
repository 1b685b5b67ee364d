"""Keeps a node's ResourceSlices equal to its discovered devices, continuously.

The kubelet deletes every slice of its node when it starts, admins delete
things, hardware changes: so publishing once is not enough.  A background
thread reconciles on every change of the device ``Inventory`` (it subscribes),
on every change of the node's slices (a ``SliceWatch``: list once, then watch,
as the Go ``resourceslice`` controller does) and on a resync timer that
compares against the watched slices, so an idle node costs the API server no
requests but a watch renewal every few minutes.  A pass after a failed write
lists instead: the API server, not the cache, decides what is there.  Any
write bumps the pool generation in all slices of the pool, so the scheduler
never mixes old and new slices.  Writes are rate-limited and API errors retried with exponential
backoff.  Slices are deliberately left in place on shutdown: a restarting
plugin must not make its devices vanish from the scheduler's view.  Writes go
as protobuf (``topodra.slicewire``: cheaper for the API server to decode), as
JSON when a slice has a field that form does not carry or the server answers
415 Unsupported Media Type.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from topodra import slicewire
from topodra.apipaths import node_path, slices_path
from topodra.devices import Device
from topodra.health.policy import DeviceTaint
from topodra.inventory import Inventory
from topodra.kube import Kube, KubeError
from topodra.observe import NO_OBSERVER, Observer
from topodra.slices import build_slices, same_content
from topodra.slicewatch import SliceWatch

log = logging.getLogger(__name__)


class SlicePublisher:
    """Reconciles the ResourceSlices of one (driver, node) pool."""

    def __init__(self, kube: Kube, driver_name: str, node_name: str, inventory: Inventory, *,
                 resync_seconds: float = 10.0, min_write_interval: float = 1.0,
                 max_backoff: float = 60.0, observer: Observer = NO_OBSERVER,
                 taints: Callable[[], Mapping[str, Sequence[DeviceTaint]]] | None = None,
                 slices: SliceWatch | None = None, node_uid: str | None = None, watch: bool = True) -> None:
        """Publishes ``inventory``'s devices (with ``taints()``), re-publishing whenever it changes.

        Whoever changes the taints calls ``refresh()``. ``slices``: a watch that already covers this node
        (``topodra simulate`` shares one per driver; its owner starts it and routes its events). Without one,
        ``start()`` watches the node's slices itself (``watch=False``: list on every pass, as before), and
        ``reconcile_once()`` alone lists. ``node_uid``: the Node's UID when the caller knows it (no GET).
        """
        self.taints = taints
        self.kube = kube
        self.driver_name = driver_name
        self.node_name = node_name
        self.inventory = inventory
        self.resync_seconds = resync_seconds
        self.min_write_interval = min_write_interval
        self.max_backoff = max_backoff
        self.observer = observer
        self.generation = 0
        self.passes = 0  # completed reconcile passes: lets a caller see that a resync ran (and wrote nothing)
        self._node_uid: str | None = node_uid
        self.slices = slices
        self._own_watch = slices is None and watch
        self._trust_watch = True  # False after a failed write: the next pass lists
        self._checked: tuple[Any, ...] | None = None  # what the last pass that found the pool in sync saw
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._synced = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_write = 0.0
        self._protobuf = True  # until the API server refuses it (415)
        inventory.subscribe(self._devices_changed)

    def _devices_changed(self, devices: tuple[Device, ...]) -> None:
        """``Inventory`` subscriber: the published set is stale, reconcile now."""
        self.refresh()

    def refresh(self) -> None:
        """What should be published changed (devices or taints): reconcile now."""
        self._synced.clear()
        self._wake.set()

    # ----- public API

    def poke(self) -> None:
        """The node's slices changed (a watch event): compare again; what should be published did not change."""
        self._wake.set()

    def start(self) -> None:
        if self._own_watch and self.slices is None:
            self.slices = SliceWatch(self.kube, self.driver_name, self.node_name)
            self.slices.subscribe(lambda _node: self.poke())
            self.slices.start()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"publisher-{self.node_name}", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop reconciling. Slices are left published on purpose."""
        self._stop.set()
        self._wake.set()
        if self._own_watch and self.slices is not None:
            self.slices.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def wait_synced(self, timeout: float) -> bool:
        return self._synced.wait(timeout)

    # ----- reconciliation

    def reconcile_once(self) -> bool:
        """One pass; returns True if it wrote anything. Raises KubeError on API failure."""
        version, snapshot = self.inventory.snapshot()
        devices = list(snapshot)
        taints = self.taints() if self.taints is not None else None
        if self._node_uid is None:
            node = self.kube.get(node_path(self.node_name))
            if node is None:
                raise KubeError(404, "NodeNotFound", f"node {self.node_name} does not exist (yet)")
            self._node_uid = node["metadata"]["uid"]
        existing = self._existing()
        # What this pass compares: unchanged since a pass found it in sync means in sync, without building
        # the slices again (a resync of thousands of simulated pools is then a dict compare each).
        seen = (version, sorted((k, tuple(v)) for k, v in (taints or {}).items()), self.generation,
                {n: s["metadata"].get("resourceVersion") for n, s in existing.items()})
        if seen == self._checked:
            self._mark_synced(version)
            self.passes += 1
            return False
        max_gen = max((int(s["spec"]["pool"].get("generation", 0)) for s in existing.values()), default=0)
        if self.generation == 0:
            self.generation = max_gen or 1  # adopt what a previous instance published
        desired = build_slices(self.driver_name, self.node_name, self._node_uid, devices, self.generation,
                               taints)
        in_sync = (set(existing) == {d["metadata"]["name"] for d in desired}
                   and all(same_content(existing[d["metadata"]["name"]], d) for d in desired))
        if in_sync:  # same devices and the same generation in every slice of the pool
            self._checked = (version, seen[1], self.generation, seen[3])
            self._mark_synced(version)
            self.passes += 1
            return False
        # Something differs: publish everything under a fresh generation.
        wait = self._last_write + self.min_write_interval - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self.generation = max(self.generation, max_gen) + 1
        for d in desired:  # the same slices under the new generation (building them again costs as much)
            d["spec"]["pool"]["generation"] = self.generation
        missing = [n for n in {d["metadata"]["name"] for d in desired} if n not in existing]
        self._trust_watch = False  # until every write below went through
        watched = self.slices
        for d in desired:
            name = d["metadata"]["name"]
            if name in existing:
                d["metadata"]["resourceVersion"] = existing[name]["metadata"]["resourceVersion"]
                written = self._write("PUT", slices_path(name), d)
            else:
                written = self._write("POST", slices_path(), d)
            if watched is not None:
                watched.stored(written)
        for name in set(existing) - {d["metadata"]["name"] for d in desired}:
            self.kube.delete(slices_path(name))
            if watched is not None:
                watched.removed(name)
        self._trust_watch = True
        self._last_write = time.monotonic()
        log.info("published pool %s: %d devices in %d slice(s), generation %d%s", self.node_name,
                 len(devices), len(desired), self.generation,
                 f" (re-created {sorted(missing)})" if missing and existing else "")
        self.observer.published(len(devices))
        self._mark_synced(version)
        self.passes += 1
        return True

    def _write(self, method: str, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        """POST or PUT one slice, as protobuf when it can go so; returns the server's object (JSON)."""
        if self._protobuf:
            try:
                data = slicewire.encode(obj)
            except slicewire.NotEncodable as e:
                log.debug("pool %s: slice %s goes as JSON: %s", self.node_name, obj["metadata"]["name"], e)
            else:
                try:
                    return self.kube.request(method, path, data=data, content_type=slicewire.CONTENT_TYPE)
                except KubeError as e:
                    if e.status != 415:
                        raise
                    log.warning("pool %s: the API server does not take protobuf slices (%s); sending JSON",
                                self.node_name, e)
                    self._protobuf = False
        return self.kube.request(method, path, obj)

    def _existing(self) -> dict[str, dict[str, Any]]:
        """The pool's slices by name: the watch's view when it is synced and trusted, else a list."""
        watched = self.slices
        if watched is not None and watched.synced and self._trust_watch:
            return {s["metadata"]["name"]: s for s in watched.pool(self.node_name)}
        listed = {s["metadata"]["name"]: s for s in self.kube.list(
            slices_path(), field_selector=f"spec.driver={self.driver_name},spec.nodeName={self.node_name}")}
        self._trust_watch = True
        return listed

    def _mark_synced(self, version: int) -> None:
        """Synced means the *current* device set is published, not one replaced meanwhile."""
        if self.inventory.version == version:
            self._synced.set()

    def _run(self) -> None:
        if self._own_watch and self.slices is not None:  # its list is the first pass's view: no list of ours
            self.slices.wait_synced(min(2.0, self.resync_seconds))
        backoff = 1.0
        while not self._stop.is_set():
            try:
                self.reconcile_once()
                backoff = 1.0
                timeout = self.resync_seconds
            except KubeError as e:
                log.warning("publishing ResourceSlices for node %s failed (%s); retrying in %.0fs",
                            self.node_name, e, backoff)
                timeout = backoff
                backoff = min(backoff * 2, self.max_backoff)
            except Exception:
                log.exception("unexpected error publishing ResourceSlices for node %s", self.node_name)
                timeout = backoff
                backoff = min(backoff * 2, self.max_backoff)
            self._wake.wait(timeout)
            self._wake.clear()
