"""ResourceClaims for the bench node, allocated by the real scheduler through pods pinned to the node."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from bench.prepare.common import DRIVER, NODE, BenchError, R

from topodra.apipaths import claim_path
from topodra.kube import Kube


@dataclass(frozen=True)
class Claim:
    namespace: str
    name: str
    uid: str
    devices: int

    @property
    def ref(self) -> tuple[str, str, str]:
        return (self.namespace, self.uid, self.name)


def make_claims(kube: Kube, ns: str, prefix: str, count: int, devices: int, admin: bool,
                timeout: float, *, node: str = NODE, driver: str = DRIVER, device_class: str = DRIVER,
                pools: frozenset[str] | None = None) -> list[Claim]:
    """``count`` claims of ``devices`` devices of ``device_class``, each referenced by a pod pinned to
    ``node``; returns them once the scheduler has allocated every one from ``driver``'s ``pools``
    (default: the pool named after the node)."""
    pools = pools or frozenset([node])
    exactly: dict[str, Any] = {"deviceClassName": device_class, "count": devices}
    if admin:
        exactly["adminAccess"] = True
    names = [f"{prefix}-{i}" for i in range(count)]
    for name in names:
        kube.create(f"{R}/namespaces/{ns}/resourceclaims", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": exactly}]}}})
        kube.create(f"/api/v1/namespaces/{ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, "automountServiceAccountToken": False,
                     "terminationGracePeriodSeconds": 0,
                     "resourceClaims": [{"name": "gpus", "resourceClaimName": name}],
                     "containers": [{"name": "c", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                                     "command": ["true"], "resources": {"claims": [{"name": "gpus"}]}}]}})
    deadline = time.monotonic() + timeout
    pending = set(names)
    claims: dict[str, Claim] = {}
    while pending:
        if time.monotonic() > deadline:
            raise BenchError(f"scheduler did not allocate claims {sorted(pending)} in {ns} within {timeout:.0f}s")
        for name in sorted(pending):
            obj = kube.get(claim_path(ns, name)) or {}
            alloc = (obj.get("status") or {}).get("allocation")
            if alloc:
                results = alloc["devices"]["results"]
                if len(results) != devices or any(r["pool"] not in pools or r["driver"] != driver for r in results):
                    raise BenchError(f"claim {ns}/{name} has an unexpected allocation: {results}")
                claims[name] = Claim(ns, name, obj["metadata"]["uid"], devices)
                pending.discard(name)
        if pending:
            time.sleep(0.25)
    return [claims[n] for n in names]


def release_claims(kube: Kube, claims: list[Claim], timeout: float) -> None:
    """Force-delete the pods (no kubelet will confirm), delete the claims, wait until they are gone."""
    for c in claims:
        kube.request("DELETE", f"/api/v1/namespaces/{c.namespace}/pods/{c.name}", {"gracePeriodSeconds": 0})
    for c in claims:
        kube.delete(claim_path(c.namespace, c.name))
    deadline = time.monotonic() + timeout
    for c in claims:
        while kube.get(claim_path(c.namespace, c.name)) is not None:
            if time.monotonic() > deadline:
                raise BenchError(f"claim {c.namespace}/{c.name} still exists {timeout:.0f}s after deletion")
            time.sleep(0.2)
