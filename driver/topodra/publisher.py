"""Keeps a node's ResourceSlices equal to its discovered devices, continuously.

The kubelet deletes every slice of its node when it starts, admins delete
things, hardware changes: so publishing once is not enough.  A background
thread reconciles on every change and on a resync timer.  Any write bumps the
pool generation in all slices of the pool, so the scheduler never mixes old and
new slices.  Writes are rate-limited and API errors retried with exponential
backoff.  Slices are deliberately left in place on shutdown: a restarting
plugin must not make its devices vanish from the scheduler's view.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from topodra.apipaths import slices_path
from topodra.devices import Device
from topodra.kube import Kube, KubeError
from topodra.slices import build_slices, same_content

log = logging.getLogger(__name__)


def _metrics() -> Any:
    try:
        from topodra.plugin import metrics
    except ImportError:  # the publisher also runs inside `topodra simulate`
        return None
    return metrics


class SlicePublisher:
    """Reconciles the ResourceSlices of one (driver, node) pool."""

    def __init__(self, kube: Kube, driver_name: str, node_name: str, *,
                 resync_seconds: float = 10.0, min_write_interval: float = 1.0,
                 max_backoff: float = 60.0) -> None:
        self.kube = kube
        self.driver_name = driver_name
        self.node_name = node_name
        self.resync_seconds = resync_seconds
        self.min_write_interval = min_write_interval
        self.max_backoff = max_backoff
        self.generation = 0
        self._devices: list[Device] | None = None
        self._node_uid: str | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._synced = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_write = 0.0

    # ----- public API

    def set_devices(self, devices: Sequence[Device]) -> None:
        """Replace the desired device set; republishes with a new generation if it changed."""
        with self._lock:
            new = list(devices)
            if self._devices is not None and _fingerprint(new) == _fingerprint(self._devices):
                return
            if self._devices is not None:
                log.info("devices of node %s changed (%d -> %d devices); republishing",
                         self.node_name, len(self._devices), len(new))
            self._devices = new
            self._synced.clear()
        self._wake.set()

    @property
    def devices(self) -> list[Device]:
        with self._lock:
            return list(self._devices or [])

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"publisher-{self.node_name}", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop reconciling. Slices are left published on purpose."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def wait_synced(self, timeout: float) -> bool:
        return self._synced.wait(timeout)

    def trigger(self) -> None:
        self._wake.set()

    # ----- reconciliation

    def reconcile_once(self) -> bool:
        """One pass; returns True if it wrote anything. Raises KubeError on API failure."""
        with self._lock:
            devices = self._devices
        if devices is None:
            return False
        if self._node_uid is None:
            node = self.kube.get(f"/api/v1/nodes/{self.node_name}")
            if node is None:
                raise KubeError(404, "NodeNotFound", f"node {self.node_name} does not exist (yet)")
            self._node_uid = node["metadata"]["uid"]
        existing = {s["metadata"]["name"]: s for s in self.kube.list(
            slices_path(), field_selector=f"spec.driver={self.driver_name},spec.nodeName={self.node_name}")}
        max_gen = max((int(s["spec"]["pool"].get("generation", 0)) for s in existing.values()), default=0)
        if self.generation == 0:
            self.generation = max_gen or 1  # adopt what a previous instance published
        desired = build_slices(self.driver_name, self.node_name, self._node_uid, devices, self.generation)
        in_sync = (set(existing) == {d["metadata"]["name"] for d in desired}
                   and all(same_content(existing[d["metadata"]["name"]], d) for d in desired))
        if in_sync:  # same devices and the same generation in every slice of the pool
            self._mark_synced(devices)
            return False
        # Something differs: publish everything under a fresh generation.
        wait = self._last_write + self.min_write_interval - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self.generation = max(self.generation, max_gen) + 1
        desired = build_slices(self.driver_name, self.node_name, self._node_uid, devices, self.generation)
        missing = [n for n in {d["metadata"]["name"] for d in desired} if n not in existing]
        for d in desired:
            name = d["metadata"]["name"]
            if name in existing:
                d["metadata"]["resourceVersion"] = existing[name]["metadata"]["resourceVersion"]
                self.kube.replace(slices_path(name), d)
            else:
                self.kube.create(slices_path(), d)
        for name in set(existing) - {d["metadata"]["name"] for d in desired}:
            self.kube.delete(slices_path(name))
        self._last_write = time.monotonic()
        log.info("published pool %s: %d devices in %d slice(s), generation %d%s", self.node_name,
                 len(devices), len(desired), self.generation,
                 f" (re-created {sorted(missing)})" if missing and existing else "")
        m = _metrics()
        if m is not None:
            m.PUBLISHED_DEVICES.set(len(devices))
            m.LAST_PUBLISH.set_to_current_time()
        self._mark_synced(devices)
        return True

    def _mark_synced(self, devices: list[Device]) -> None:
        """Synced means the *current* device set is published, not one replaced meanwhile."""
        with self._lock:
            if self._devices is devices:
                self._synced.set()

    def _run(self) -> None:
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


def _fingerprint(devices: Sequence[Device]) -> list[str]:
    return sorted(d.model_dump_json() for d in devices)
