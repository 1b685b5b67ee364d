"""The scorer's request path for a gang's pod (``placement.gang``, wired into ``Placement.prioritize``).

Real discovery output of mock DGX profiles (testkit.views) in a ClusterState fed as the watch would;
pods and PodGroups go in through ``cache.apply_event``. No API server.
"""

from __future__ import annotations

from typing import Any

from testkit.views import gpus, hold, state

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.fleet.domains import LEAF_GROUP, SCALABLE_UNIT
from topodra.fleet.fgd import DEFAULT_PRIOR, make_mix
from topodra.fleet.state import ClusterState
from topodra.placement.cache import apply_event
from topodra.placement.gang import INTENT_TTL, Gangs
from topodra.placement.score import Scorer
from topodra.placement.server import Placement

LEAVES = {"a1": "la", "a2": "la", "a3": "la", "b1": "lb", "b2": "lb", "b3": "lb"}
NS = "ns"


def fabric() -> ClusterState:
    st = state({n: "dgx-h100" for n in LEAVES})
    st.replace("nodes", [{"metadata": {"name": n, "labels": {LEAF_GROUP: leaf, SCALABLE_UNIT: "su1"}}}
                         for n, leaf in LEAVES.items()])
    st.set_template({"metadata": {"name": "eight", "namespace": NS}, "spec": {"spec": gpus(8, nvlink=True)}})
    return st


def gang_pod(name: str, group: str | None = "job", node: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "eight"}],
                            "containers": []}
    if group:
        spec["schedulingGroup"] = {"podGroupName": group}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "namespace": NS}, "spec": spec, "status": {}}


def podgroup(name: str, min_count: int, key: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"schedulingPolicy": {"gang": {"minCount": min_count}}}
    if key:
        spec["schedulingConstraints"] = {"topology": [{"key": key}]}
    return {"metadata": {"name": name, "namespace": NS}, "spec": spec}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def score(st: ClusterState, gangs: Gangs, pod: dict[str, Any], names: list[str] | None = None) -> dict[str, int]:
    cands = []
    for n in names or list(LEAVES):
        v = st.node_view(n)
        cands.append((n, v, st.unavailable_indices(v) if v else frozenset()))
    mix = make_mix(DEFAULT_PRIOR, 20, {}, DRIVER)
    return dict(gangs.score(pod, st.pods, st.node_labels, cands, st.pod_demands(pod), mix, Scorer()))


def test_gang_pod_goes_to_the_partly_used_leaf_group_a_lone_pod_is_scored_as_before() -> None:
    st = fabric()
    hold(st, "a1", ["gpu-0"])
    apply_event(st, "podgroups", "ADDED", podgroup("job", 2))
    got = score(st, Gangs(), gang_pod("job-0"))
    assert min(got["a2"], got["a3"]) > max(got["b1"], got["b2"], got["b3"]), got
    assert got["a1"] == 0  # 7 free GPUs cannot take 8
    lone = score(st, Gangs(), gang_pod("solo", group=None))
    cands = [(n, st.node_view(n), st.unavailable_indices(st.node_view(n))) for n in LEAVES]  # type: ignore[arg-type]
    assert lone == dict(Scorer().score(cands, st.pod_demands(gang_pod("solo", None)),
                                       make_mix(DEFAULT_PRIOR, 20, {}, DRIVER)))
    # node FGD alone rates both whole leaf groups alike: the domain is what separates them
    assert lone["a2"] == lone["b1"]


def test_a_job_bigger_than_the_partly_used_group_goes_to_the_one_that_holds_it() -> None:
    st = fabric()
    hold(st, "a1", ["gpu-0"])
    apply_event(st, "podgroups", "ADDED", podgroup("job", 3))
    got = score(st, Gangs(), gang_pod("job-0"))
    assert min(got["b1"], got["b2"], got["b3"]) > max(got["a2"], got["a3"]), got


def test_the_second_pod_of_a_cycle_follows_the_first_although_no_sibling_is_visible() -> None:
    st = fabric()
    apply_event(st, "podgroups", "ADDED", podgroup("job", 2))
    hold(st, "a1", ["gpu-0"])
    clock = Clock()
    gangs = Gangs(clock)
    first = score(st, gangs, gang_pod("job-0"))
    assert gangs.last is not None and (gangs.last.value, gangs.last.why) == ("la", "tightest")
    assert first["a2"] > first["b1"]
    # The scheduler assumed job-0 on a2 (not visible to us) and filters a2 out for job-1. Meanwhile
    # another claim took a GPU in lb, which would now make lb the tighter group for a fresh job.
    hold(st, "b1", ["gpu-0", "gpu-1"])
    second = score(st, gangs, gang_pod("job-1"), ["a3", "b1", "b2", "b3"])
    assert gangs.last is not None and gangs.last.why == "intent"
    assert second["a3"] > max(second["b2"], second["b3"]), second
    # another gang of the same size is steered by fit alone
    apply_event(st, "podgroups", "ADDED", podgroup("other", 2))
    score(st, gangs, gang_pod("other-0", group="other"))
    assert gangs.last is not None and gangs.last.why == "tightest"
    # the intent expires
    clock.t += INTENT_TTL + 1
    score(st, gangs, gang_pod("job-1"), ["a3", "b1", "b2", "b3"])
    assert gangs.last is not None and gangs.last.why == "tightest"


def test_bound_siblings_pull_the_rest_of_the_gang() -> None:
    st = fabric()
    hold(st, "a1", ["gpu-0"])  # la would be the tightest for a fresh 2-pod job
    apply_event(st, "podgroups", "ADDED", podgroup("job", 3))
    apply_event(st, "pods", "ADDED", gang_pod("job-0", node="b2"))
    gangs = Gangs()
    got = score(st, gangs, gang_pod("job-1"))
    assert gangs.last is not None and (gangs.last.value, gangs.last.why) == ("lb", "siblings")
    assert min(got["b1"], got["b3"]) > max(got["a2"], got["a3"])
    apply_event(st, "pods", "DELETED", gang_pod("job-0", node="b2"))
    score(st, gangs, gang_pod("job-1"))
    assert gangs.last is not None and gangs.last.why == "intent"  # remembered from the last call


def test_one_placement_of_a_topology_aware_cycle_is_ranked_by_node_fgd_only() -> None:
    st = fabric()
    hold(st, "a1", ["gpu-0"])
    apply_event(st, "podgroups", "ADDED", podgroup("job", 2, LEAF_GROUP))
    gangs = Gangs()
    got = score(st, gangs, gang_pod("job-0"), ["b1", "b2", "b3"])
    assert gangs.last is None and set(got.values()) == {10}


def test_inside_the_unit_the_scheduler_offers_the_gang_gets_one_leaf_group() -> None:
    st = fabric()  # every node in su1
    hold(st, "a1", ["gpu-0"])
    apply_event(st, "podgroups", "ADDED", podgroup("job", 2, SCALABLE_UNIT))
    gangs = Gangs()
    got = score(st, gangs, gang_pod("job-0"))
    assert gangs.last is not None and (gangs.last.key, gangs.last.value) == (LEAF_GROUP, "la")
    assert min(got["a2"], got["a3"]) > max(got["b1"], got["b2"], got["b3"])


def test_the_podgroup_key_is_used_when_it_is_not_a_fabric_label() -> None:
    st = fabric()
    rack = "example.com/rack"
    st.replace("nodes", [{"metadata": {"name": n, "labels": {rack: "r1" if n in ("a1", "b1") else "r2"}}}
                         for n in LEAVES])
    hold(st, "a1", ["gpu-0"])
    hold(st, "b1", ["gpu-0"])  # r1 holds no 8-GPU pod at all
    apply_event(st, "podgroups", "ADDED", podgroup("job", 2, rack))
    gangs = Gangs()
    score(st, gangs, gang_pod("job-0"))
    assert gangs.last is not None and (gangs.last.key, gangs.last.value) == (rack, "r2")


class _NoCache:
    def __init__(self, st: ClusterState) -> None:
        import threading
        self.state = st
        self.lock = threading.Lock()

    def synced(self) -> bool:
        return True


def test_prioritize_uses_the_gang_rule() -> None:
    st = fabric()
    hold(st, "a1", ["gpu-0"])
    apply_event(st, "podgroups", "ADDED", podgroup("job", 2))
    p = Placement(_NoCache(st), DEFAULT_PRIOR, 20)  # type: ignore[arg-type]
    out = {h["Host"]: h["Score"] for h in p.prioritize({"Pod": gang_pod("job-0"), "NodeNames": list(LEAVES)})}
    assert min(out["a2"], out["a3"]) > max(out["b1"], out["b2"], out["b3"]), out
