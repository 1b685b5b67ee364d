"""Leader election for the controller: the official client's algorithm on a Lease, through our one API client.

The election itself (acquire, renew every retry period, give up after the renew
deadline, judge expiry by when *this* process last saw the record change so
clock skew between replicas does not matter) is
``kubernetes.leaderelection.LeaderElection``.  Only its lock is ours:
``KubeLeaseLock`` reads and writes the ``coordination.k8s.io/v1`` Lease through
``topodra.kube.Kube``, the controller's one API client (the library's own
``LeaseLock`` would open a second client, configured from global state).  The
library lacks two things, added here in the lock: releasing the Lease on a clean
stop, so a standby takes over at once instead of after the lease duration, and
stopping: a released lock refuses writes, so the library's renew thread (which
has no stop) cannot take the Lease back.

kopf peering was not chosen: it needs its own cluster-wide CRDs in every install
and only pauses handlers, while a Lease is the Kubernetes-native lock and lets a
standby replica not start kopf at all.  A leader that cannot renew within the
deadline stops its operator and exits; its supervisor restarts it as a standby.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from topodra.apipaths import lease_path
from topodra.kube import Kube, KubeError

log = logging.getLogger(__name__)

Obj = dict[str, Any]


def wire_time(record_time: str) -> str:
    """The library's record time (``str()`` of a naive local datetime) as a Lease MicroTime (UTC)."""
    return datetime.fromisoformat(record_time).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def record_time(wire: str) -> str:
    """A Lease MicroTime in the library's record format (inverse of ``wire_time``)."""
    return str(datetime.fromisoformat(wire.replace("Z", "+00:00")).astimezone().replace(tzinfo=None))


@dataclass(frozen=True)
class Record:
    """The library's election record (same attribute names as ``LeaderElectionRecord``, compared by ``__dict__``).

    An empty holder is reported as None: the library then acquires at once, which is what a released
    Lease means (client-go treats an empty holder the same way).
    """

    holder_identity: str | None
    lease_duration: str | None
    acquire_time: str | None
    renew_time: str | None


def record_from_lease(lease: Obj) -> Record:
    spec = lease.get("spec") or {}
    duration = spec.get("leaseDurationSeconds")
    acquire, renew = spec.get("acquireTime"), spec.get("renewTime")
    return Record(holder_identity=spec.get("holderIdentity") or None,
                  lease_duration=str(duration) if duration else None,
                  acquire_time=record_time(acquire) if acquire else None,
                  renew_time=record_time(renew) if renew else None)


def lease_object(namespace: str, name: str, record: Any, existing: Obj | None) -> Obj:
    """The Lease to write for ``record``; ``leaseTransitions`` counts changes of holder."""
    spec = dict((existing or {}).get("spec") or {})
    previous = spec.get("holderIdentity") or ""
    if existing is None:
        spec["leaseTransitions"] = 0
    elif previous != record.holder_identity:
        spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
    spec.update(holderIdentity=record.holder_identity, leaseDurationSeconds=int(record.lease_duration),
                acquireTime=wire_time(record.acquire_time), renewTime=wire_time(record.renew_time))
    meta: Obj = {"name": name, "namespace": namespace}
    if existing is not None:
        meta["resourceVersion"] = existing["metadata"]["resourceVersion"]
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}


@dataclass(frozen=True)
class LockError:
    """What the library reads from a failed ``get``: the HTTP code in a JSON ``body``, and a ``reason``."""

    code: int
    reason: str

    @property
    def body(self) -> str:
        return json.dumps({"code": self.code})


class KubeLeaseLock:
    """The lock interface ``kubernetes.leaderelection`` drives (get/create/update), on a Lease via ``Kube``."""

    def __init__(self, kube: Kube, namespace: str, name: str, identity: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self._lease: Obj | None = None  # last Lease read or written: its resourceVersion guards the next write
        self._write = threading.Lock()
        self._released = False

    def get(self, name: str, namespace: str) -> tuple[bool, Record | LockError]:
        try:
            lease = self.kube.get(lease_path(namespace, name))
        except KubeError as e:
            log.warning("leader election: reading lease %s/%s: %s", namespace, name, e)
            return False, LockError(e.status, e.reason)
        if lease is None:
            return False, LockError(404, "NotFound")
        self._lease = lease
        return True, record_from_lease(lease)

    def create(self, name: str, namespace: str, election_record: Any) -> bool:
        return self._write_lease(name, namespace, election_record, create=True)

    def update(self, name: str, namespace: str, updated_record: Any) -> bool:
        return self._write_lease(name, namespace, updated_record, create=False)

    def _write_lease(self, name: str, namespace: str, record: Any, create: bool) -> bool:
        with self._write:
            if self._released or (not create and self._lease is None):
                return False
            body = lease_object(namespace, name, record, None if create else self._lease)
            try:
                if create:
                    self._lease = self.kube.create(lease_path(namespace), body)
                else:
                    self._lease = self.kube.replace(lease_path(namespace, name), body)
            except KubeError as e:  # a conflict means another replica wrote first
                log.log(logging.DEBUG if e.conflict else logging.WARNING,
                        "leader election: writing lease %s/%s: %s", namespace, name, e)
                return False
            return True

    def release(self) -> None:
        """Stop writing for good, and give the Lease up if we hold it so a standby takes over at once."""
        with self._write:
            self._released = True
        path = lease_path(self.namespace, self.name)
        try:
            lease = self.kube.get(path)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            lease["spec"]["holderIdentity"] = ""
            lease["spec"]["leaseDurationSeconds"] = 1
            self.kube.replace(path, lease)
            log.info("leader election: released lease %s/%s", self.namespace, self.name)
        except KubeError as e:
            log.warning("leader election: could not release lease %s/%s: %s", self.namespace, self.name, e)

    @property
    def released(self) -> bool:
        return self._released


@dataclass
class LeaderElector:
    """Runs ``kubernetes.leaderelection`` in a daemon thread; defaults match client-go's (15 s / 10 s / 2 s)."""

    kube: Kube
    namespace: str
    name: str
    identity: str
    lease_duration_s: int = 15
    renew_deadline_s: int = 10
    retry_period_s: int = 2

    def __post_init__(self) -> None:
        self.lock = KubeLeaseLock(self.kube, self.namespace, self.name, self.identity)

    def start(self, on_lost: Callable[[], None]) -> threading.Event:
        """Start campaigning; the returned event is set once we lead.  ``on_lost`` runs if renewal fails."""
        from kubernetes.leaderelection import electionconfig, leaderelection

        # The library logs every retry at INFO (every 2 s on a standby); we log the transitions ourselves.
        logging.getLogger("leaderelection").setLevel(logging.WARNING)
        leading = threading.Event()

        def started() -> None:
            log.info("leader election: %s now holds lease %s/%s", self.identity, self.namespace, self.name)
            leading.set()

        def stopped() -> None:
            if not self.lock.released:
                log.error("leader election: %s lost lease %s/%s", self.identity, self.namespace, self.name)
                on_lost()

        config = electionconfig.Config(self.lock, lease_duration=self.lease_duration_s,
                                       renew_deadline=self.renew_deadline_s, retry_period=self.retry_period_s,
                                       onstarted_leading=started, onstopped_leading=stopped)
        log.info("leader election: %s waiting for lease %s/%s", self.identity, self.namespace, self.name)
        threading.Thread(target=leaderelection.LeaderElection(config).run, name="leader-election",
                         daemon=True).start()
        return leading

    def release(self) -> None:
        self.lock.release()
