"""The scorer's cache watches DeviceTaintRules, and a cluster without their API still gets a ready scorer.

The API is scripted (tests/test_placement_server.py's ScriptedKube): no server is involved.
"""

from __future__ import annotations

import threading
from typing import Any

from testkit.scripted import ScriptedKube
from testkit.views import device_classes, node_slices

from topodra.fleet.state import ClusterState
from topodra.kube import KubeError, Obj
from topodra.placement.cache import Cache

V1 = "/apis/resource.k8s.io/v1"
RULE = {"metadata": {"name": "drain", "resourceVersion": "7"}, "spec": {
    "deviceSelector": {"pool": "a", "device": "gpu-3"}, "taint": {"key": "k", "effect": "NoExecute"}}}


def script(rules: list[Any]) -> dict[str, list[Any]]:
    return {f"{V1}/resourceslices": [("list", node_slices("a", "dgx-h100"), "5")],
            f"{V1}/resourceclaims": [("list", [], "5")],
            f"{V1}/deviceclasses": [("list", list(device_classes()), "5")],
            "/api/v1/nodes": [("list", [{"metadata": {"name": "a"}}], "5")],
            "/api/v1/pods": [("list", [], "5")],
            f"{V1}/resourceclaimtemplates": [("list", [], "5")],
            f"{V1}/devicetaintrules": rules,
            "/apis/scheduling.k8s.io/v1beta1/podgroups": [("list", [], "5")]}


def unavailable(cache: Cache) -> list[tuple[str, str]]:
    with cache.lock:
        view = cache.state.node_view("a")
        assert view is not None
        return [view.devices[i].key for i in cache.state.unavailable_indices(view)]


def wait_until(cache: Cache, want: list[tuple[str, str]]) -> list[tuple[str, str]]:
    tick = threading.Event()
    for _ in range(400):
        got = unavailable(cache)
        if got == want:
            return got
        tick.wait(0.05)
    return unavailable(cache)


def test_rule_events_reach_the_unavailable_set() -> None:
    deleted: Obj = {"type": "DELETED", "object": RULE}
    kube = ScriptedKube(script([("list", [RULE], "7"), ("watch", [deleted])]))
    cache = Cache(kube, ClusterState("gpu.topodra.io"))
    cache.start()
    try:
        assert cache.wait_synced(10)
        # Listed with the rule, then the watch deletes it: gpu-3 is unavailable, then available again.
        assert ("list", f"{V1}/devicetaintrules") in kube.calls
        assert wait_until(cache, []) == []
        assert ("watch@7", f"{V1}/devicetaintrules") in kube.calls
    finally:
        cache.close()
        kube.idle.set()


def test_listed_rule_makes_its_device_unavailable() -> None:
    kube = ScriptedKube(script([("list", [RULE], "7")]))
    cache = Cache(kube, ClusterState("gpu.topodra.io"))
    cache.start()
    try:
        assert cache.wait_synced(10)
        assert wait_until(cache, [("a", "gpu-3")]) == [("a", "gpu-3")]
    finally:
        cache.close()
        kube.idle.set()


class NoRulesApi(ScriptedKube):
    """A cluster that does not serve DeviceTaintRules (404), as before Kubernetes 1.37."""

    def list_snapshot(self, path: str, field_selector: str | None = None) -> tuple[tuple[Obj, ...], str]:
        if path.endswith("/devicetaintrules"):
            self.calls.append(("list", path))
            raise KubeError(404, "NotFound", "the server could not find the requested resource")
        return super().list_snapshot(path, field_selector)


def test_a_missing_rule_api_reads_as_no_rules_and_the_cache_syncs() -> None:
    kube = NoRulesApi(script([]))
    cache = Cache(kube, ClusterState("gpu.topodra.io"))
    cache.start()
    try:
        assert cache.wait_synced(10)
        assert unavailable(cache) == []
        assert [c for c in kube.calls if c[1].endswith("/devicetaintrules")] == [("list", f"{V1}/devicetaintrules")]
    finally:
        cache.close()
        kube.idle.set()
