"""The controller's watched facts (controller/facts.py) give the Snapshot a fresh list would, follow events,
and build nothing when nothing changed. The API is scripted (testkit.scripted): no server is involved."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_controller_availability import CLASSES, hgx, prof, slice_
from testkit.scripted import ScriptedKube

from topodra.controller.availability import PublishedDevice, Snapshot, make_snapshot, profile_availability
from topodra.controller.facts import HOLDING_PODS, WatchedFacts
from topodra.controller.operator import HOLDING_PODS as OPERATOR_HOLDING_PODS
from topodra.informer import gc_paused
from topodra.kube import KubeError, Obj

D = "gpu.topodra.io"
V1 = "/apis/resource.k8s.io/v1"
SLICES, CLAIMS, CLASSES_PATH = f"{V1}/resourceslices", f"{V1}/resourceclaims", f"{V1}/deviceclasses"
NODES, RULES, PODS = "/api/v1/nodes", f"{V1}/devicetaintrules", "/api/v1/pods"


def named_claim(name: str, *held: tuple[str, str]) -> Obj:
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": "20"},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpus", "driver": D, "pool": p, "device": d} for p, d in held]}}}}


def node(name: str, ready: bool = True, cordoned: bool = False, labels: dict[str, str] | None = None,
         heartbeat: str = "t0") -> Obj:
    return {"metadata": {"name": name, "labels": labels or {"topodra.io/su": "su0"}},
            "spec": {"unschedulable": cordoned},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                       "lastHeartbeatTime": heartbeat}],
                       "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110"}}}


RULE = {"metadata": {"name": "drain"}, "spec": {"deviceSelector": {"pool": "b", "device": "gpu-7"},
                                                "taint": {"key": "k", "effect": "NoSchedule"}}}
OLD = slice_("a", hgx("a")["spec"]["devices"][:2], generation=0)  # an older generation of pool a: not counted
SLICE_OBJS = [hgx("a"), OLD, hgx("b", "H100-SXM5-80GB", "81559Mi"), hgx("c")]
CLAIM_OBJS = [named_claim("c1", ("a", "gpu-0"), ("a", "gpu-1")), named_claim("c2", ("c", "gpu-3"))]
NODE_OBJS = [node("a"), node("b"), node("c", cordoned=True)]


def script(**over: list[Any]) -> dict[str, list[Any]]:
    base: dict[str, list[Any]] = {
        SLICES: [("list", SLICE_OBJS, "5")], CLAIMS: [("list", CLAIM_OBJS, "5")],
        CLASSES_PATH: [("list", CLASSES, "5")], NODES: [("list", NODE_OBJS, "5")], RULES: [("list", [RULE], "5")]}
    base.update(over)
    return base


def facts_on(kube: ScriptedKube, sync_wait: float = 10.0) -> WatchedFacts:
    f = WatchedFacts(kube, D, sync_wait=sync_wait)
    f.start()
    return f


def until(cond: Callable[[], bool]) -> bool:
    tick = threading.Event()
    for _ in range(400):
        if cond():
            return True
        tick.wait(0.025)
    return cond()


PROFILES = [prof([{"deviceClassName": "gpu-h200", "count": 8}, {"deviceClassName": "gpu-h100", "count": 8}],
                 {"nvlink": "Required"}),
            prof([{"deviceClassName": "gpu.topodra.io", "count": 1}]),
            prof([{"deviceClassName": "gpu-h100", "count": 2}], {"nic": "RailAligned"})]


def statuses(snap: Any) -> list[Any]:
    return [profile_availability(p, snap, driver=D) for p in PROFILES]


def test_watched_snapshot_equals_a_listed_one() -> None:
    kube = ScriptedKube(script())
    f = facts_on(kube)
    try:
        snap = f.get()
        assert not isinstance(snap, str), snap
        listed = make_snapshot(SLICE_OBJS, CLAIM_OBJS, CLASSES, D, NODE_OBJS, [RULE])
        assert snap.devices == listed.devices  # same devices, order, attributes and taint verdicts
        assert snap.allocated == listed.allocated
        assert snap.unavailable_nodes == listed.unavailable_nodes == {"c"}
        assert snap.node_labels == listed.node_labels
        assert snap.classes == listed.classes
        got = statuses(snap)
        assert got == statuses(listed)
        # h200 on a and c: a has 2 held, c one held and cordoned -> no node fits 8; h100 on b: gpu-7 ruled out.
        assert [(s.devices_total, s.devices_free, s.nodes_fit) for s in got[0]] == [(16, 13, 0), (8, 7, 0)]
    finally:
        f.close()
        kube.idle.set()


class Gated(ScriptedKube):
    """Each path's watch starts only once the test opens its gate: events arrive when the test says."""

    def __init__(self, script: dict[str, list[Any]]) -> None:
        super().__init__(script)
        self.gates: dict[str, threading.Event] = {}

    def gate(self, path: str) -> threading.Event:
        return self.gates.setdefault(path, threading.Event())

    def watch(self, path: str, resource_version: str, timeout_seconds: int = 300,
              field_selector: str | None = None) -> Iterator[Obj]:
        self.gate(path).wait()
        yield from super().watch(path, resource_version, timeout_seconds, field_selector)


def test_events_update_the_snapshot_and_an_unchanged_pass_builds_nothing() -> None:
    freed = {"type": "DELETED", "object": CLAIM_OBJS[0]}
    gone = {"type": "DELETED", "object": hgx("b", "H100-SXM5-80GB", "81559Mi")}
    kube = Gated(script(**{CLAIMS: [("list", CLAIM_OBJS, "5"), ("watch", [freed])],
                           SLICES: [("list", SLICE_OBJS, "5"), ("watch", [gone])]}))
    f = facts_on(kube)
    try:
        first = _snap(f)
        assert f.get() is first and f.builds == 1  # no event: the same snapshot, nothing rebuilt
        assert len(first.matching(_match("gpu-h200"), D)) == 16
        kube.gate(CLAIMS).set()
        assert until(lambda: ("a", "gpu-0") not in _snap(f).allocated)
        second = _snap(f)
        assert second.matched is first.matched  # a claim event keeps the devices and what each class matched
        assert statuses(second)[0][0].devices_free == 15
        kube.gate(SLICES).set()
        assert until(lambda: all(d.pool != "b" for d in _snap(f).devices))
        third = _snap(f)
        assert third.matched is not first.matched  # devices changed: matched again
        assert [s.devices_total for s in statuses(third)[0]] == [16, 0]
    finally:
        f.close()
        for g in kube.gates.values():
            g.set()
        kube.idle.set()


def test_a_slice_event_matches_only_that_slices_devices_again(monkeypatch: pytest.MonkeyPatch) -> None:
    changed = hgx("c")
    changed["spec"]["devices"][0]["taints"] = [{"key": "k", "effect": "NoExecute"}]
    kube = Gated(script(**{SLICES: [("list", SLICE_OBJS, "5"), ("watch", [{"type": "MODIFIED", "object": changed}])]}))
    f = facts_on(kube)
    calls: list[str] = []
    real = PublishedDevice.matches

    def counted(self: PublishedDevice, match: Any, driver: str) -> bool:
        calls.append(self.pool)
        return real(self, match, driver)

    monkeypatch.setattr(PublishedDevice, "matches", counted)
    try:
        h200 = _match("gpu-h200")
        before = _snap(f).matching(h200, D)
        assert len(calls) == len(_snap(f).devices)  # the first pass tests every device once
        seen = f.versions()[1]
        kube.gate(SLICES).set()
        assert until(lambda: f.versions()[1] != seen)
        calls.clear()
        after = _snap(f).matching(h200, D)
        assert calls == ["c"] * 16  # a's and b's slices are not matched again
        assert after == tuple(d for d in _snap(f).devices if real(d, h200, D))
        assert next(d.blocked for d in after if d.pool == "c")  # the event's taint counts ...
        assert not next(d.blocked for d in before if d.pool == "c")  # ... and was not there before
    finally:
        f.close()
        for g in kube.gates.values():
            g.set()
        kube.idle.set()


def _match(cls: str) -> Any:
    from topodra.controller.availability import class_match

    m, why = class_match(next(c for c in CLASSES if c["metadata"]["name"] == cls))
    assert m is not None, why
    return m


def _snap(f: WatchedFacts) -> Snapshot:
    s = f.get()
    assert not isinstance(s, str), s
    return s


def test_a_node_heartbeat_builds_no_snapshot() -> None:
    beat = {"type": "MODIFIED", "object": node("b", heartbeat="t1")}
    kube = Gated(script(**{NODES: [("list", NODE_OBJS, "5"), ("watch", [beat])]}))
    f = facts_on(kube)
    try:
        first = _snap(f)
        kube.gate(NODES).set()
        assert until(lambda: f.informer.events == 1)  # the heartbeat is applied ...
        assert _snap(f) is first and f.builds == 1  # ... and readiness and labels are as before: nothing rebuilt
    finally:
        f.close()
        kube.idle.set()


def test_a_cordon_takes_the_node_out_of_fit() -> None:
    cordon = {"type": "MODIFIED", "object": node("b", cordoned=True, heartbeat="t2")}
    kube = ScriptedKube(script(**{NODES: [("list", NODE_OBJS, "5"), ("watch", [cordon])]}))
    f = facts_on(kube)
    try:
        assert until(lambda: "b" in _snap(f).unavailable_nodes)
    finally:
        f.close()
        kube.idle.set()


class Forbidding(ScriptedKube):
    """Lists of some paths answer ``status`` (403: no grant, 404: API not served)."""

    def __init__(self, script: dict[str, list[Any]], refuse: dict[str, int]) -> None:
        super().__init__(script)
        self.refuse = refuse

    def list_snapshot(self, path: str, field_selector: str | None = None) -> tuple[tuple[Obj, ...], str]:
        if path in self.refuse:
            self.calls.append(("list", path))
            raise KubeError(self.refuse[path], "Forbidden", f"cannot list {path}")
        return super().list_snapshot(path, field_selector)


def test_without_nodes_or_rule_api_every_node_counts_and_only_slice_taints() -> None:
    kube = Forbidding(script(), {NODES: 403, RULES: 404})
    f = facts_on(kube)
    try:
        snap = _snap(f)
        assert snap.unavailable_nodes == frozenset() and snap.node_labels == {}
        assert statuses(snap) == statuses(make_snapshot(SLICE_OBJS, CLAIM_OBJS, CLASSES, D))
    finally:
        f.close()
        kube.idle.set()


def test_unreadable_claims_are_reported_not_guessed() -> None:
    kube = Forbidding(script(), {CLAIMS: 403})
    f = facts_on(kube, sync_wait=0.5)
    try:
        got = f.get()
        assert isinstance(got, str)
        assert got.startswith("cannot read cluster state: claims not listed yet")
        assert until(lambda: "403" in str(f.get()))  # the list's error is named once it failed
    finally:
        f.close()
        kube.idle.set()


def pod(name: str, node_name: str, cpu: str) -> Obj:
    return {"metadata": {"name": name, "namespace": "ns"},
            "spec": {"nodeName": node_name, "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}]},
            "status": {"phase": "Running"}}


def test_pods_are_watched_only_once_a_pass_asks_for_host_resources() -> None:
    assert HOLDING_PODS == OPERATOR_HOLDING_PODS
    kube = ScriptedKube(script(**{PODS: [("list", [pod("p", "a", "60")], "5")]}))
    f = facts_on(kube)
    try:
        plain = _snap(f)
        assert plain.host is None
        assert not any(path == PODS for _op, path in kube.calls)
        with_host = f.get(host=True)
        assert not isinstance(with_host, str) and with_host.host is not None and not with_host.host_error
        assert with_host.devices is plain.devices
        room_a, room_b = with_host.host.room("a"), with_host.host.room("b")
        assert room_a is not None and room_b is not None
        assert (room_a.cpu_free, room_b.cpu_free) == (4000, 64000)  # 60 of a's 64 CPUs held
    finally:
        f.close()
        kube.idle.set()


def test_passes_in_several_threads_start_one_pod_watch() -> None:
    kube = ScriptedKube(script(**{PODS: [("list", [pod("p", "a", "60")], "5")]}))
    f = facts_on(kube)
    try:
        _snap(f)
        got: list[Any] = []
        threads = [threading.Thread(target=lambda: got.append(f.get(host=True))) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert len(got) == 8 and all(not isinstance(g, str) and g.host is not None for g in got)
        assert [c for c in kube.calls if c[1] == PODS][:1] == [("list", PODS)]
        assert sum(1 for c in kube.calls if c == ("list", PODS)) == 1
    finally:
        f.close()
        kube.idle.set()


def test_unlistable_pods_leave_the_snapshot_without_a_host_view() -> None:
    kube = Forbidding(script(), {PODS: 403})
    f = facts_on(kube, sync_wait=0.5)
    try:
        got = f.get(host=True)
        assert not isinstance(got, str)
        assert got.host is None and got.host_error.startswith("cannot list pods (pods not listed yet")
    finally:
        f.close()
        kube.idle.set()


def test_gc_paused_restores_the_collector_after_overlapping_pauses() -> None:
    assert gc.isenabled()
    outer = gc_paused()
    outer.__enter__()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the outer pause still runs
    outer.__exit__(None, None, None)
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # disabled before: stays so
    finally:
        gc.enable()


class _ClosingKube(ScriptedKube):
    def __init__(self, script: dict[str, list[Any]]) -> None:
        super().__init__(script)
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_close_closes_the_client_it_owns_once_and_never_a_shared_one() -> None:
    """The controller makes a second client for its watches alone (issue 31: it was never closed)."""
    owned, shared = _ClosingKube(script()), _ClosingKube(script())
    mine = WatchedFacts(owned, D, owns_client=True)
    theirs = WatchedFacts(shared, D)
    for f in (mine, theirs):
        f.close()
        f.close()
    assert (owned.closed, shared.closed) == (1, 0)
    assert mine.informer.stop.is_set() and theirs.informer.stop.is_set()
