"""Leader election on a ``coordination.k8s.io/v1`` Lease, so two controller replicas are safe.

Chosen over kopf peering because peering needs its own cluster-wide CRDs and
only pauses handlers; a Lease is the Kubernetes-native lock and lets the
standby replica not even start kopf.  Expiry is judged against when *this*
process last saw the record change (as client-go does), so clock skew between
replicas does not matter.  A leader that cannot renew within the deadline
stops its operator and exits; its supervisor restarts it as a standby.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import quote

from topodra.kube import Kube, KubeError

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Action = Literal["create", "acquire", "renew", "wait"]


def lease_path(namespace: str, name: str | None = None) -> str:
    base = f"/apis/coordination.k8s.io/v1/namespaces/{quote(namespace)}/leases"
    return f"{base}/{quote(name)}" if name else base


def micro_time(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def decide(lease: Obj | None, identity: str, seen_for_s: float) -> Action:
    """What to do with the Lease as it is now.

    ``seen_for_s`` is how long this process has seen the same holder record
    unchanged; past ``leaseDurationSeconds`` the holder is presumed dead.
    """
    if lease is None:
        return "create"
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity") or ""
    if holder == identity:
        return "renew"
    if not holder:
        return "acquire"
    duration = int(spec.get("leaseDurationSeconds") or 15)
    return "acquire" if seen_for_s > duration else "wait"


def lease_object(namespace: str, name: str, identity: str, duration_s: int, now: datetime,
                 existing: Obj | None, action: Action) -> Obj:
    """The Lease to write for ``create``/``acquire``/``renew``."""
    spec = dict((existing or {}).get("spec") or {})
    stamp = micro_time(now)
    if action in ("create", "acquire"):
        spec["acquireTime"] = stamp
        if action == "acquire":
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        else:
            spec["leaseTransitions"] = 0
    spec.update(holderIdentity=identity, leaseDurationSeconds=duration_s, renewTime=stamp)
    meta: Obj = {"name": name, "namespace": namespace}
    if existing is not None:
        meta["resourceVersion"] = existing["metadata"]["resourceVersion"]
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}


@dataclass
class LeaseElector:
    """Acquire, renew and release one Lease."""

    kube: Kube
    namespace: str
    name: str
    identity: str
    duration_s: int = 15
    renew_period_s: float = 5.0
    retry_period_s: float = 2.0
    clock: Callable[[], float] = time.monotonic
    _record: tuple[str, str] | None = field(default=None, init=False)
    _record_seen_at: float = field(default=0.0, init=False)

    def _seen_for(self, lease: Obj | None) -> float:
        spec = (lease or {}).get("spec") or {}
        record = (str(spec.get("holderIdentity") or ""), str(spec.get("renewTime") or ""))
        now = self.clock()
        if record != self._record:
            self._record, self._record_seen_at = record, now
        return now - self._record_seen_at

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True while we hold the Lease.  Write conflicts mean someone else won."""
        try:
            lease = self.kube.get(lease_path(self.namespace, self.name))
            action = decide(lease, self.identity, self._seen_for(lease))
            if action == "wait":
                return False
            body = lease_object(self.namespace, self.name, self.identity, self.duration_s,
                                datetime.now(UTC), lease, action)
            if action == "create":
                self.kube.create(lease_path(self.namespace), body)
            else:
                self.kube.replace(lease_path(self.namespace, self.name), body)
            if action != "renew":
                log.info("leader election: %s now holds lease %s/%s", self.identity, self.namespace,
                         self.name)
            return True
        except KubeError as e:
            level = logging.DEBUG if e.conflict else logging.WARNING
            log.log(level, "leader election: lease %s/%s: %s", self.namespace, self.name, e)
            return False

    def wait_until_leader(self, stop: threading.Event) -> bool:
        """Block until we hold the Lease (True) or ``stop`` is set (False)."""
        log.info("leader election: %s waiting for lease %s/%s", self.identity, self.namespace, self.name)
        while not stop.is_set():
            if self.try_acquire_or_renew():
                return True
            stop.wait(self.retry_period_s)
        return False

    def keep_renewing(self, stop: threading.Event, on_lost: Callable[[], None]) -> None:
        """Renew until ``stop``; call ``on_lost`` once renewals fail for 2/3 of the lease duration."""
        last_ok = self.clock()
        deadline = self.duration_s * 2 / 3
        while not stop.wait(self.renew_period_s):
            if self.try_acquire_or_renew():
                last_ok = self.clock()
            elif self.clock() - last_ok > deadline:
                log.error("leader election: %s lost lease %s/%s", self.identity, self.namespace, self.name)
                on_lost()
                return

    def release(self) -> None:
        """Give the Lease up on clean shutdown so a standby takes over at once."""
        try:
            lease = self.kube.get(lease_path(self.namespace, self.name))
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            lease["spec"]["holderIdentity"] = ""
            lease["spec"]["leaseDurationSeconds"] = 1
            self.kube.replace(lease_path(self.namespace, self.name), lease)
            log.info("leader election: released lease %s/%s", self.namespace, self.name)
        except KubeError as e:
            log.warning("leader election: could not release lease %s/%s: %s", self.namespace, self.name, e)
