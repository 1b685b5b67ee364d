"""Leader election for the controller: a small loop of our own on a ``coordination.k8s.io/v1`` Lease.

It follows client-go's algorithm, written against the Lease API itself rather than a library's
internals (the official Python client's ``leaderelection`` needs a lock object shaped like its own,
``str(datetime)`` record times and error bodies included, and can be neither stopped nor told to
release):

- a candidate reads the Lease and takes it when it is absent, released (empty holder), its own, or
  expired. Expiry is judged by when *this* process last saw the Lease change (its resourceVersion)
  on its own monotonic clock, plus the Lease's ``leaseDurationSeconds``, so clock skew between
  replicas does not matter;
- every write is a PUT carrying the resourceVersion it read (a create when there is no Lease): if
  another replica wrote first the API server answers 409 and this candidate simply retries later,
  so two replicas can never both win;
- the leader renews every retry period; if no renewal succeeded within the renew deadline it has
  lost the Lease (``on_lost``: the controller stops its operator and exits, its supervisor restarts
  it as a standby);
- a clean stop first stops the loop (no write can follow), then releases the Lease if we hold it
  (empty holder, 1 s duration), so a standby takes over at once instead of after the lease duration.

All calls go through ``topodra.kube.Kube``, the controller's one API client; times on the wire are
RFC 3339 MicroTime in UTC. kopf peering was not chosen: it needs its own cluster-wide CRDs in every
install and only pauses handlers, while a Lease is the Kubernetes-native lock and lets a standby
replica not start kopf at all.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from topodra.apipaths import lease_path
from topodra.kube import Kube, KubeError

log = logging.getLogger(__name__)

Obj = dict[str, Any]
JITTER = 1.2  # acquire retries wait retry_period * U(1, JITTER), as client-go's JitterUntil does


def microtime(t: datetime) -> str:
    """A time as a Lease MicroTime: RFC 3339 in UTC with microseconds."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_body(namespace: str, name: str, identity: str, duration_s: int, now: datetime,
               existing: Obj | None) -> Obj:
    """The Lease to write so that ``identity`` holds it from ``now``. Pure.

    Renewing keeps ``acquireTime``; taking it over (from another holder or a released Lease) sets it
    and counts one more ``leaseTransitions``. The resourceVersion read is kept: the write then fails
    with 409 if anyone wrote since."""
    spec = dict((existing or {}).get("spec") or {})
    stamp = microtime(now)
    if existing is None:
        spec["leaseTransitions"] = 0
    if spec.get("holderIdentity") != identity:
        if existing is not None:
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        spec["acquireTime"] = stamp
    spec.update(holderIdentity=identity, leaseDurationSeconds=duration_s, renewTime=stamp)
    meta: Obj = {"name": name, "namespace": namespace}
    if existing is not None:
        meta["resourceVersion"] = existing["metadata"]["resourceVersion"]
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}


def released_body(existing: Obj, now: datetime) -> Obj:
    """The Lease given up: no holder, 1 s duration (what client-go's ReleaseOnCancel writes). Pure."""
    spec = dict(existing.get("spec") or {})
    spec.update(holderIdentity="", leaseDurationSeconds=1, renewTime=microtime(now), acquireTime=microtime(now))
    return {**existing, "spec": spec}


@dataclass
class LeaderElector:
    """Campaigns for one Lease in a daemon thread; defaults match client-go's (15 s / 10 s / 2 s).

    ``monotonic`` and ``wall`` are the clocks (expiry and deadlines on the first, Lease times from the
    second); tests pass their own and drive ``try_acquire_or_renew`` step by step."""

    kube: Kube
    namespace: str
    name: str
    identity: str
    lease_duration_s: int = 15
    renew_deadline_s: float = 10
    retry_period_s: float = 2
    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    _seen_version: str | None = field(default=None, init=False)
    _seen_at: float = field(default=0.0, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError("leader election needs 0 < retry period < renew deadline < lease duration, got "
                             f"{self.retry_period_s} / {self.renew_deadline_s} / {self.lease_duration_s}")

    @property
    def path(self) -> str:
        return lease_path(self.namespace, self.name)

    def try_acquire_or_renew(self) -> bool:
        """One step: read the Lease, and write it as ours if it is free, expired or ours. True if we hold it now."""
        if self._stop.is_set():
            return False  # stopped or released: never take the Lease back
        try:
            lease = self.kube.get(self.path)
        except KubeError as e:
            log.warning("leader election: reading lease %s/%s: %s", self.namespace, self.name, e)
            return False
        now = self.monotonic()
        if lease is not None:
            version = lease["metadata"]["resourceVersion"]
            if version != self._seen_version:
                self._seen_version, self._seen_at = version, now
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            duration = int(spec.get("leaseDurationSeconds") or 0)
            if holder and holder != self.identity and now < self._seen_at + duration:
                return False  # held by another replica that renewed within its duration, as far as we saw
        body = lease_body(self.namespace, self.name, self.identity, self.lease_duration_s, self.wall(), lease)
        if self._stop.is_set():
            return False
        try:
            if lease is None:
                written = self.kube.create(lease_path(self.namespace), body)
            else:
                written = self.kube.replace(self.path, body)
        except KubeError as e:  # a conflict means another replica wrote first
            log.log(logging.DEBUG if e.conflict else logging.WARNING,
                    "leader election: writing lease %s/%s: %s", self.namespace, self.name, e)
            return False
        self._seen_version, self._seen_at = written["metadata"]["resourceVersion"], now
        return True

    def start(self, on_lost: Callable[[], None]) -> threading.Event:
        """Start campaigning; the returned event is set once we lead. ``on_lost`` runs if renewal fails."""
        leading = threading.Event()
        log.info("leader election: %s waiting for lease %s/%s", self.identity, self.namespace, self.name)
        self._thread = threading.Thread(target=self._run, args=(leading, on_lost), name="leader-election",
                                        daemon=True)
        self._thread.start()
        return leading

    def _run(self, leading: threading.Event, on_lost: Callable[[], None]) -> None:
        while not self.try_acquire_or_renew():
            if self._stop.wait(self.retry_period_s * random.uniform(1.0, JITTER)):
                return
        log.info("leader election: %s now holds lease %s/%s", self.identity, self.namespace, self.name)
        leading.set()
        renewed = self.monotonic()
        while not self._stop.wait(self.retry_period_s):
            if self.try_acquire_or_renew():
                renewed = self.monotonic()
            elif self._stop.is_set():
                return
            elif self.monotonic() - renewed >= self.renew_deadline_s:
                log.error("leader election: %s lost lease %s/%s (no renewal for %.0f s)", self.identity,
                          self.namespace, self.name, self.monotonic() - renewed)
                self._stop.set()
                on_lost()
                return

    def release(self) -> None:
        """Stop campaigning for good, then give the Lease up if we hold it so a standby takes over at once."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.renew_deadline_s)  # a write in flight finishes before we release
        for _attempt in range(3):
            try:
                lease = self.kube.get(self.path)
                if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                    return
                self.kube.replace(self.path, released_body(lease, self.wall()))
                log.info("leader election: released lease %s/%s", self.namespace, self.name)
                return
            except KubeError as e:
                if e.conflict:
                    continue  # a renewal we did not wait for, or another writer: read again
                log.warning("leader election: could not release lease %s/%s: %s", self.namespace, self.name, e)
                return
