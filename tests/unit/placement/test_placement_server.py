"""The placement scorer's HTTP face, its list+watch loop (scripted API), and the harness's scheduler config."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from testkit import cluster as localcluster
from testkit.scripted import ScriptedKube
from testkit.views import claim, device_classes, gpus, hold, node_slices, state

from topodra.fleet.fgd import DEFAULT_PRIOR
from topodra.fleet.state import ClusterState
from topodra.placement.cache import Cache
from topodra.placement.server import Placement, Server


def test_informer_relists_on_410_and_applies_events() -> None:
    slices = "/apis/resource.k8s.io/v1/resourceslices"
    claims = "/apis/resource.k8s.io/v1/resourceclaims"
    allocated = claim("c", gpus(1), allocated=[("a", "gpu-0")])
    allocated["metadata"]["resourceVersion"] = "12"
    kube = ScriptedKube({
        slices: [("list", [], "5"), ("gone",), ("list", node_slices("a", "dgx-h100"), "9"),
                 ("watch", [{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "11"}}}])],
        claims: [("list", [], "5"), ("watch", [{"type": "ADDED", "object": allocated}])],
        "/apis/resource.k8s.io/v1/deviceclasses": [("list", list(device_classes()), "5")],
        "/api/v1/nodes": [("list", [{"metadata": {"name": "a"}}], "5")],
        "/api/v1/pods": [("list", [], "5")],
        "/apis/resource.k8s.io/v1/resourceclaimtemplates": [("list", [], "5")],
        "/apis/resource.k8s.io/v1/devicetaintrules": [("list", [], "5")],
        "/apis/scheduling.k8s.io/v1beta1/podgroups": [("list", [], "5")],
    })
    cache = Cache(kube, ClusterState("gpu.topodra.io"))
    cache.start()
    try:
        assert cache.wait_synced(10)
        deadline = threading.Event()
        for _ in range(400):
            # The slices informer records its watch@9 call just after it applied the list of version 9.
            with cache.lock:
                view = cache.state.node_view("a")
                if view is not None and cache.state.unavailable_indices(view) and \
                        len([c for c, p in kube.calls if p == slices]) >= 4:
                    break
            deadline.wait(0.05)
        with cache.lock:
            view = cache.state.node_view("a")
            assert view is not None and len(view.devices) == 16
            assert [view.devices[i].key for i in cache.state.unavailable_indices(view)] == [("a", "gpu-0")]
        # The 410 made it list again; the watch after the bookmark resumes from the bookmark's version.
        assert [c for c, p in kube.calls if p == slices][:4] == ["list", "watch@5", "list", "watch@9"]
        for _ in range(400):
            if ("watch@11", slices) in kube.calls:
                break
            deadline.wait(0.05)
        assert ("watch@11", slices) in kube.calls
    finally:
        cache.close()
        kube.idle.set()


@pytest.fixture
def served() -> Iterator[tuple[str, Placement]]:
    st = state({"a": "dgx-h100", "b": "dgx-h100", "c": "dgx-a100-80gb"})
    hold(st, "a", ["gpu-0"])
    st.set_template({"metadata": {"name": "one", "namespace": "ns"}, "spec": {"spec": gpus(1)}})
    cache = Cache(ScriptedKube({}), st)
    placement = Placement(cache, DEFAULT_PRIOR, 20)
    server = Server(placement, "127.0.0.1", localcluster.free_port())
    server.start()
    try:
        yield f"http://127.0.0.1:{server.port}", placement
    finally:
        server.shutdown()


def post(url: str, body: bytes) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_prioritize_speaks_the_extender_protocol(served: tuple[str, Placement]) -> None:
    url, placement = served
    pod = {"metadata": {"name": "p", "namespace": "ns"},
           "spec": {"resourceClaims": [{"name": "g", "resourceClaimTemplateName": "one"}]}}
    args = {"Pod": pod, "NodeNames": ["a", "b", "c", "x"]}
    code, body = post(f"{url}/prioritize", json.dumps(args).encode())
    assert code == 200
    assert body == [{"Host": "a", "Score": 10}, {"Host": "b", "Score": 1}, {"Host": "c", "Score": 1},
                    {"Host": "x", "Score": 0}]
    # What the server sends is the objects' JSON (placement.reply builds it without them).
    assert placement.prioritize_json(args) == json.dumps(placement.prioritize(args), separators=(",", ":")).encode()
    # Go decodes field names case-insensitively; Nodes (nodeCacheCapable: false) works too.
    code, body = post(f"{url}/prioritize", json.dumps(
        {"pod": pod, "nodes": {"items": [{"metadata": {"name": "b"}}]}}).encode())
    assert code == 200 and body == [{"Host": "b", "Score": 10}]


@pytest.mark.parametrize("body", [b"not json", b"[]", json.dumps({"NodeNames": ["a"]}).encode(),
                                  json.dumps({"Pod": {}, "NodeNames": "a"}).encode()])
def test_bad_requests_are_400(served: tuple[str, Placement], body: bytes) -> None:
    code, reply = post(f"{served[0]}/prioritize", body)
    assert code == 400 and reply["error"]


def test_health_and_metrics(served: tuple[str, Placement]) -> None:
    url, _p = served
    post(f"{url}/prioritize", json.dumps({"Pod": {"metadata": {}}, "NodeNames": ["a"]}).encode())
    with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
        assert r.status == 200
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'topodra_placement_prioritize_duration_seconds_count 1.0' in text
    assert 'topodra_placement_prioritize_cpu_seconds_count 1.0' in text
    assert 'topodra_placement_cache_objects{kind="slices"} 3.0' in text
    assert 'topodra_placement_prioritize_total{result="ok"} 1.0' in text


# --- the harness's scheduler configuration (pure) -------------------------------------------------------

def test_scheduler_configuration_adds_an_ignorable_prioritize_only_extender() -> None:
    cfg = localcluster.scheduler_configuration(None, Path("/k"), "http://127.0.0.1:9417")
    assert cfg["clientConnection"] == {"kubeconfig": "/k"}
    assert cfg["leaderElection"] == {"leaderElect": False}
    (ext,) = cfg["extenders"]
    assert ext["prioritizeVerb"] == "prioritize" and "filterVerb" not in ext
    assert ext["ignorable"] is True and ext["nodeCacheCapable"] is True
    assert ext["weight"] == localcluster.SCHEDULER_EXTENDER_WEIGHT


@pytest.mark.parametrize("base", [
    {"apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
     "clientConnection": {"kubeconfig": "/elsewhere"}},
    {"apiVersion": "v1", "kind": "ConfigMap"},
])
def test_scheduler_configuration_rejects_what_the_harness_owns_or_cannot_run(base: dict[str, Any]) -> None:
    with pytest.raises(localcluster.ClusterError):
        localcluster.scheduler_configuration(base, Path("/k"))
    with pytest.raises(localcluster.ClusterError):
        localcluster.extender_stanza("127.0.0.1:9417")


def test_warm_builds_every_node_state_before_the_first_call() -> None:
    st = state({"a": "dgx-h100", "b": "dgx-h100", "c": "dgx-a100-80gb"})
    hold(st, "a", ["gpu-0"])
    placement = Placement(Cache(ScriptedKube({}), st), DEFAULT_PRIOR, 20)
    assert placement.states.states.of == {}
    placement.warm("slices")
    states = placement.states.states
    assert set(states.of) == {"a", "b", "c"} and states.of["b"] != states.of["a"]
    # the first call finds them current: nothing left to refresh
    assert st.changed_since(states._mark) == []


def test_healthz_fails_while_a_watched_kind_has_been_failing_too_long() -> None:
    """The scorer's /healthz says how fresh its cache is (issue 31: it answered 200 whatever the cache's state):
    a kind whose list fails for longer than ``stale_after`` fails /healthz and /readyz, naming the kind and the
    error, until a list works again."""
    now = [100.0]
    base: dict[str, list[Any]] = {p: [("list", [], "5")] for p in (
        "/apis/resource.k8s.io/v1/deviceclasses", "/api/v1/nodes", "/api/v1/pods",
        "/apis/resource.k8s.io/v1/resourceclaimtemplates", "/apis/resource.k8s.io/v1/devicetaintrules",
        "/apis/scheduling.k8s.io/v1beta1/podgroups", "/apis/resource.k8s.io/v1/resourceclaims")}
    slices = "/apis/resource.k8s.io/v1/resourceslices"
    kube = ScriptedKube({**base, slices: [("list", [], "5"), ("gone",), ("fail", 503), ("list", [], "9")]})
    cache = Cache(kube, ClusterState("gpu.topodra.io"))
    cache.clock = lambda: now[0]
    placement = Placement(cache, DEFAULT_PRIOR, 20, stale_after=30)
    tick = threading.Event()
    cache.start()
    try:
        assert cache.wait_synced(10)
        for _ in range(400):  # the 410 relists, and that list fails: a positive signal before any assert
            if "slices" in cache.errors:
                break
            tick.wait(0.025)
        assert "scripted failure 503" in cache.errors["slices"]
        assert placement.health() == (200, "ok\n")  # failing, but not for long yet
        now[0] += 31
        code, text = placement.health()
        assert code == 503 and text.startswith("cache stale: slices failing for 31s (") and "503" in text
        assert placement.health(ready=True)[0] == 503
        for _ in range(400):  # the retry after the backoff lists again
            if ("list", slices) in kube.calls[-3:] and "slices" not in cache.errors:
                break
            tick.wait(0.025)
        assert placement.health() == (200, "ok\n") and placement.health(ready=True) == (200, "ok\n")
    finally:
        cache.close()
        kube.idle.set()
