"""The kubelet plugin prepares a backfill claim only for pods whose activeDeadlineSeconds fits its bound (issue 33).

Backfill claims tolerate held reservations where the backfill window is a bucket >= their runtime bound
(``reservations.backfill_tolerations``); the window promises only that a pod that stops by that bound cannot
delay the reservation. ``ClaimFetcher`` (plugin/server.py) reads the claim's ``status.reservedFor`` pods and
refuses the claim (an error the kubelet reports on the pod) when one declares no deadline or a longer one.
"""

from __future__ import annotations

from typing import Any

from topodra import reservations as vocab
from topodra.claims import AllocatedClaim, ClaimRef, UnavailableClaim
from topodra.plugin.server import ClaimFetcher

DRIVER = "gpu.topodra.io"
NODE = "node-a"
UID = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
REF = ClaimRef(namespace="ml", uid=UID, name="c1")


def claim(tolerations: list[dict[str, Any]] | None, pods: tuple[str, ...] = ("p1",)) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": "gpu", "count": 1}
    if tolerations is not None:
        exactly["tolerations"] = tolerations
    return {"metadata": {"name": "c1", "namespace": "ml", "uid": UID},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": exactly}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpus", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}]}},
                       "reservedFor": [{"resource": "pods", "name": p, "uid": f"u-{p}"} for p in pods]}}


def pod(name: str, deadline: int | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main"}]}
    if deadline is not None:
        spec["activeDeadlineSeconds"] = deadline
    return {"metadata": {"name": name, "namespace": "ml"}, "spec": spec}


def fetch(obj: dict[str, Any], pods: dict[str, dict[str, Any]] | None) -> tuple[Any, list[str]]:
    read: list[str] = []

    def get_pod(ns: str, name: str) -> dict[str, Any] | None:
        read.append(f"{ns}/{name}")
        return (pods or {}).get(name)

    fetcher = ClaimFetcher(lambda ns, name: obj, DRIVER, NODE, pod_getter=get_pod if pods is not None else None)
    try:
        (got,) = fetcher.fetch([REF])
    finally:
        fetcher.close()
    return got, read


def test_a_backfill_claim_needs_a_deadline_within_its_bound_on_every_pod() -> None:
    tols = vocab.backfill_tolerations(3600)  # windows 1h and up
    assert vocab.claim_backfill_bound(claim(tols)) == 3600
    got, read = fetch(claim(tols), {"p1": pod("p1", 3600)})
    assert isinstance(got, AllocatedClaim) and read == ["ml/p1"]
    got, _ = fetch(claim(tols), {"p1": pod("p1", None)})
    assert isinstance(got, UnavailableClaim)
    assert "pod p1 must declare activeDeadlineSeconds <= 3600 (it declares none)" in got.error
    got, _ = fetch(claim(tols), {"p1": pod("p1", 3601)})
    assert isinstance(got, UnavailableClaim) and "(it declares 3601)" in got.error
    got, _ = fetch(claim(tols, pods=("p1", "p2")), {"p1": pod("p1", 60), "p2": pod("p2", None)})
    assert isinstance(got, UnavailableClaim) and "pod p2" in got.error  # every pod sharing the claim
    got, _ = fetch(claim(tols), {})
    assert isinstance(got, UnavailableClaim) and "cannot be read" in got.error
    got, _ = fetch(claim(tols, pods=()), {})
    assert isinstance(got, UnavailableClaim) and "reserved for no pod" in got.error
    got, _ = fetch(claim(tols), None)  # a plugin that cannot read pods refuses rather than trusts
    assert isinstance(got, UnavailableClaim) and "cannot read pods" in got.error


def test_other_claims_read_no_pod() -> None:
    reserving = [vocab.toleration(UID), vocab.window_toleration()]
    for tols in (None, reserving, [{"key": "other.io/x", "operator": "Exists"}]):
        obj = claim(tols)
        assert vocab.claim_backfill_bound(obj) is None
        got, read = fetch(obj, {"p1": pod("p1", None)})
        assert isinstance(got, AllocatedClaim) and read == []
