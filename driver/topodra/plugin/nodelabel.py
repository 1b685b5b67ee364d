"""The kubelet plugin keeps the ``topodra.io/`` labels of its own Node in sync with discovery.

Pure part: ``wanted_labels`` (devices + the admin's topology + the Node's current labels → labels and the
keys we own) and ``node_patch`` (the Node as it is → JSON merge patch, or None when nothing differs).  Labels
of other prefixes are never in a patch; of ours, only the owned keys are removed: the discovered ones always,
the admin's (fabric tiers, rail group) only when the plugin has a --hardware-config to take them from, so a
unit an admin set by hand with kubectl stays.  The fabric tiers follow Topograph's labels on the Node first
(``topodra.fabric``), so the Node is read before the wanted labels are known.

Effect part: ``NodeLabeler``, one thread.  The inventory subscriber only records what is wanted and wakes
the thread, so no API call runs under the inventory's or the prepare state's locks.  The thread reads the
Node and patches the difference; a failure is logged, reported (``on_result``) and retried with
exponential backoff while the plugin keeps serving.  A periodic resync repairs labels edited by others and
picks up a Topograph label that changed.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from topodra.apipaths import node_path
from topodra.devices import Device
from topodra.fabric import fabric_labels
from topodra.kube import Kube, KubeError
from topodra.nodelabels import (
    DISCOVERED,
    LEAF_GROUP,
    RAIL_GROUP,
    SCALABLE_UNIT,
    SPINE_GROUP,
    label_patch,
    node_labels,
)

log = logging.getLogger(__name__)

BACKOFF_BASE_SECONDS = 1.0
BACKOFF_CAP_SECONDS = 300.0
RESYNC_SECONDS = 600.0


# --hardware-config's tier names (as PluginConfig.topology_labels gives them) -> topodra keys.
_TIER_NAMES = {"leaf_group": LEAF_GROUP, "scalable_unit": SCALABLE_UNIT, "spine_group": SPINE_GROUP}


@dataclass(frozen=True)
class Wanted:
    """The labels this node should carry, and the topodra keys the plugin owns (may remove)."""

    labels: Mapping[str, str]
    managed: frozenset[str]


def wanted_labels(devices: Iterable[Device], topology: Mapping[str, str] | None,
                  current: Mapping[str, str] | None = None) -> Wanted:
    """Labels from discovery, ``current`` (the Node's labels: Topograph's tiers) and ``topology``
    (``leaf_group`` / ``scalable_unit`` / ``spine_group`` / ``rail_group``; None: not ours to manage).

    ValueError when an admin value cannot be a label value.
    """
    topo = topology or {}
    configured = None if topology is None else {
        key: topo[name] for name, key in _TIER_NAMES.items() if topo.get(name)}
    fabric = fabric_labels(current or {}, hardware_config=configured)
    labels = {**node_labels(devices, rail_group=topo.get("rail_group")), **fabric.labels}
    rail = frozenset({RAIL_GROUP}) if topology is not None else frozenset()
    managed = frozenset(DISCOVERED) | fabric.owned | rail
    return Wanted(labels, managed)


def node_patch(node: Mapping[str, Any], wanted: Wanted) -> dict[str, Any] | None:
    """JSON merge patch that brings ``node``'s topodra labels to ``wanted``; None when they already match."""
    current = (node.get("metadata") or {}).get("labels") or {}
    labels = label_patch(current, wanted.labels, wanted.managed)
    return {"metadata": {"labels": labels}} if labels else None


def backoff(failures: int, base: float = BACKOFF_BASE_SECONDS, cap: float = BACKOFF_CAP_SECONDS,
            jitter: float = 0.2) -> float:
    """Seconds to wait after ``failures`` failures in a row: doubling from ``base`` up to ``cap``, minus up to
    ``jitter`` of it at random so that the plugins of many nodes do not retry in step."""
    delay: float = min(cap, base * 2.0 ** max(0, failures - 1))
    return delay * (1 - jitter * random.random())


class LabelError(RuntimeError):
    """The Node could not be labelled (missing Node, API error); the labeler retries."""


class NodeLabeler:
    """Keeps one Node's topodra labels equal to what discovery and the admin's topology say."""

    def __init__(self, kube: Kube, node_name: str, topology: Mapping[str, str] | None, *,
                 on_result: Callable[[bool], None] | None = None, resync_seconds: float = RESYNC_SECONDS,
                 backoff_base: float = BACKOFF_BASE_SECONDS, backoff_cap: float = BACKOFF_CAP_SECONDS) -> None:
        self._kube = kube
        self._node = node_name
        self._on_result = on_result
        self._resync = resync_seconds
        self._backoff = (backoff_base, backoff_cap)
        self._lock = threading.Lock()  # guards the two fields below only; never held over I/O
        self._devices: tuple[Device, ...] = ()
        self._topology = dict(topology) if topology is not None else None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0  # in a row; 0 after a success

    def devices_changed(self, devices: tuple[Device, ...]) -> None:
        """Inventory subscriber: remember the devices and wake the thread (no I/O here)."""
        with self._lock:
            self._devices = devices
        self._wake.set()

    def topology_changed(self, topology: Mapping[str, str] | None) -> None:
        """The admin's topology was re-read (--hardware-config on re-discovery); sync if it differs."""
        new = dict(topology) if topology is not None else None
        with self._lock:
            if new == self._topology:
                return
            self._topology = new
        self._wake.set()

    def wanted(self, current: Mapping[str, str] | None = None) -> Wanted:
        """What this Node should carry, given its ``current`` labels (Topograph's tiers win)."""
        with self._lock:
            devices, topology = self._devices, self._topology
        return wanted_labels(devices, topology, current)

    def sync(self) -> dict[str, Any] | None:
        """One pass: read the Node, patch what differs; returns the patch sent (None: nothing to do)."""
        path = node_path(self._node)
        try:
            node = self._kube.get(path)
            if node is None:
                raise LabelError(f"node {self._node} does not exist")
            try:
                wanted = self.wanted((node.get("metadata") or {}).get("labels") or {})
            except ValueError as e:
                raise LabelError(f"cannot label node {self._node}: {e}") from e
            patch = node_patch(node, wanted)
            if patch is not None:
                self._kube.merge_patch(path, patch)
        except KubeError as e:
            raise LabelError(f"cannot label node {self._node}: {e}") from e
        if patch is not None:
            labels = patch["metadata"]["labels"]
            log.info("node labels synced node=%s set=%s removed=%s", self._node,
                     {k: v for k, v in labels.items() if v is not None} or "-",
                     sorted(k for k, v in labels.items() if v is None) or "-")
        return patch

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="node-labels", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread; an API call in flight is not waited for (the thread is a daemon, nothing to undo)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        wait: float | None = 0.0  # first pass at once
        while True:
            self._wake.wait(wait)
            if self._stopping.is_set():
                return
            self._wake.clear()
            try:
                self.sync()
            except Exception as e:  # labels are optional: never take the plugin down
                if self._stopping.is_set():  # e.g. the API client was closed under a call in flight
                    return
                self.failures += 1
                wait = backoff(self.failures, *self._backoff)
                log.warning("%s; retrying in %.1f s (failure %d in a row); the plugin keeps serving",
                            e, wait, self.failures)
                self._report(False)
            else:
                self.failures = 0
                wait = self._resync or None
                self._report(True)

    def _report(self, ok: bool) -> None:
        if self._on_result is not None:
            try:
                self._on_result(ok)
            except Exception:
                log.exception("node label result callback failed")
