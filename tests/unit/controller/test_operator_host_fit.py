"""The operator reads the bound pods only for profiles that state their pods' requests, outside any lock."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from test_controller_operator import CFG, PROFILES, FakeKube, add_profile, kube  # noqa: F401 - kube is a fixture
from test_profile_host_fit import hgx, node, pod

from topodra.apipaths import node_path, pod_path, slices_path
from topodra.controller.operator import HOLDING_PODS, ControllerConfig, SnapshotCache, process
from topodra.kube import KubeError

Obj = dict[str, Any]
EIGHT: Obj = {"alternatives": [{"deviceClassName": "gpu-h100", "count": 8}], "topology": {"nvlink": "Required"}}
PODS = pod_path()


def fleet(k: FakeKube, hog_cpu: str = "204") -> None:
    for name in ("hog", "roomy"):
        k.create(slices_path(), hgx(name))
        k.create(node_path(), node(name))
    k.objs[f"{PODS}/cpu-hog"] = pod("cpu-hog", "hog", cpu=hog_cpu)  # cluster-wide list path of the fake
    k.objs[f"{PODS}/waiting"] = pod("waiting", "", cpu="224")  # not bound: holds nothing


def run(k: FakeKube, spec: Obj) -> Obj:
    body = add_profile(k, spec)
    out = process(k, body, CFG, SnapshotCache(CFG))  # type: ignore[arg-type]
    assert out.ok, out
    return dict(k.objs[f"{PROFILES}/train"]["status"])


def test_a_profile_with_requests_reads_the_pods_and_reports_the_short_node(kube: FakeKube) -> None:  # noqa: F811
    fleet(kube)
    st = run(kube, {**EIGHT, "podRequests": {"cpu": "96"}})
    (alt,) = st["alternatives"]
    assert (alt["nodesFit"], alt["nodesShortOfCpu"], alt["nodesShortOfMemory"]) == (1, 1, 0)
    assert st["message"] == ("fits now: h100; h100: 1 node(s) have the 8 free device(s) in one NVLink domain but "
                             "too little free CPU (1) for a pod of cpu 96")
    assert kube.calls.count(("LIST", PODS)) == 1


def test_a_profile_without_requests_does_not_list_pods(kube: FakeKube) -> None:  # noqa: F811
    fleet(kube)
    st = run(kube, EIGHT)
    (alt,) = st["alternatives"]
    assert alt["nodesFit"] == 2 and "nodesShortOfCpu" not in alt
    assert ("LIST", PODS) not in kube.calls


class NoPods(FakeKube):
    def list(self, path: str, label_selector: str | None = None,
             field_selector: str | None = None) -> Iterator[Obj]:
        if path == PODS:
            raise KubeError(403, "Forbidden", "pods is forbidden")
        return super().list(path, label_selector, field_selector)


def test_pods_not_readable_counts_devices_and_says_so(kube: FakeKube) -> None:  # noqa: F811
    k = NoPods()
    k.objs = kube.objs
    fleet(k)
    st = run(k, {**EIGHT, "podRequests": {"cpu": "96"}})
    (alt,) = st["alternatives"]
    assert alt["nodesFit"] == 2 and "nodesShortOfCpu" not in alt
    assert st["message"].startswith("fits now: h100; cannot list pods (")
    assert st["message"].endswith("free CPU and memory are not counted")


class SlowKube:
    """Lists block until released, and record what they were asked with."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.lists: list[tuple[str, str | None]] = []

    def list(self, path: str, label_selector: str | None = None,
             field_selector: str | None = None) -> Iterator[Obj]:
        self.lists.append((path, field_selector))
        if path == slices_path():
            self.entered.set()
            assert self.release.wait(10)
        return iter(())


def test_one_read_at_a_time_and_no_lock_held_while_listing() -> None:
    cache = SnapshotCache(ControllerConfig(snapshot_ttl_s=60))
    k = SlowKube()
    got: list[Any] = []
    first = threading.Thread(target=lambda: got.append(cache.get(k, host=True)))  # type: ignore[arg-type]
    first.start()
    assert k.entered.wait(10)
    second = threading.Thread(target=lambda: got.append(cache.get(k)))  # type: ignore[arg-type]
    second.start()
    # the first caller is inside its list: the cache's lock is free (the second caller waits on an Event)
    assert cache._lock.acquire(timeout=1)
    cache._lock.release()
    k.release.set()
    first.join(10)
    second.join(10)
    assert len(got) == 2 and not any(isinstance(g, str) for g in got)
    assert [p for p, _ in k.lists].count(slices_path()) == 1  # the second caller did not read again
    assert (PODS, HOLDING_PODS) in k.lists
    # within the ttl nothing is read again, pods included
    n = len(k.lists)
    assert cache.get(k, host=True) is not None  # type: ignore[arg-type]
    assert len(k.lists) == n


class Broken(SlowKube):
    def list(self, path: str, label_selector: str | None = None,
             field_selector: str | None = None) -> Iterator[Obj]:
        self.lists.append((path, field_selector))
        raise OSError("connection reset")


def test_an_unexpected_error_propagates_and_the_next_call_reads_again() -> None:
    cache = SnapshotCache(ControllerConfig(snapshot_ttl_s=60))
    k = Broken()
    for _ in range(2):
        with pytest.raises(OSError, match="connection reset"):
            cache.get(k)  # type: ignore[arg-type]
    assert [p for p, _ in k.lists] == [slices_path(), slices_path()]
