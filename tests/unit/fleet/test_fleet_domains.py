"""The domain rule for gangs (``fleet.domains``) and the pod/PodGroup records it reads (``fleet.pods``).

Views are built from the real discovery output of mock DGX profiles (testkit.views); no API server.
"""

from __future__ import annotations

from typing import Any

import pytest
from testkit.views import gpus, hold, state

from topodra.fleet.allocator import Rank, place_ranked
from topodra.fleet.demand import parse_demand
from topodra.fleet.domains import (
    LEAF_GROUP,
    SCALABLE_UNIT,
    Candidate,
    Choice,
    choose,
    domain_key,
    fits,
    in_domain_scores,
)
from topodra.fleet.pods import Pods, pod_group_record, pod_record
from topodra.fleet.state import ClusterState, NodeView

LEAVES = {"a1": "la", "a2": "la", "a3": "la", "b1": "lb", "b2": "lb", "b3": "lb"}


def fabric(profile: str = "dgx-h100") -> ClusterState:
    st = state({n: profile for n in LEAVES})
    st.replace("nodes", [{"metadata": {"name": n, "labels": {LEAF_GROUP: leaf, SCALABLE_UNIT: "su1"}}}
                         for n, leaf in LEAVES.items()])
    return st


def cands(st: ClusterState, names: list[str] | None = None) -> list[Candidate]:
    out: list[Candidate] = []
    for n in names or list(LEAVES):
        v = st.node_view(n)
        out.append((n, v, st.unavailable_indices(v) if v else frozenset()))
    return out


def placer(spec: dict[str, Any]) -> Any:
    demands = [parse_demand(spec)]

    def place(view: NodeView, used: frozenset[int]) -> tuple[frozenset[int], Rank] | None:
        return place_ranked(view, used, demands)
    return place


EIGHT = placer(gpus(8, nvlink=True))


def test_domain_key_prefers_the_podgroup_then_the_finest_fabric_label() -> None:
    rack = "example.com/rack"
    labels = {"n1": {SCALABLE_UNIT: "su1", LEAF_GROUP: "l1", rack: "r1"},
              "n2": {SCALABLE_UNIT: "su1", LEAF_GROUP: "l2", rack: "r2"},
              "n3": {SCALABLE_UNIT: "su2", LEAF_GROUP: "l3", rack: "r2"}}
    assert domain_key(rack, labels, ["n1", "n2"]) == rack
    assert domain_key(None, labels, ["n1", "n2", "n3"]) == LEAF_GROUP
    # one unit offered (a topology-aware placement): its leaf groups are what is left to choose
    assert domain_key(SCALABLE_UNIT, labels, ["n1", "n2"]) == LEAF_GROUP
    assert domain_key(SCALABLE_UNIT, labels, ["n2", "n3"]) == SCALABLE_UNIT
    assert domain_key(LEAF_GROUP, labels, ["n1"]) is None
    assert domain_key(None, {"n4": {}, "n5": {}}, ["n4", "n5"]) is None


def test_a_job_that_fits_the_partly_used_leaf_group_goes_there_not_into_the_empty_one() -> None:
    st = fabric()
    hold(st, "a1", ["gpu-0"])  # la: 7 + 8 + 8 free, room for two 8-GPU pods; lb: three whole servers
    got = choose(cands(st), st.node_labels, LEAF_GROUP, EIGHT, need=2)
    assert got is not None and (got.value, got.why) == ("la", "tightest")
    domains = fits(cands(st), st.node_labels, LEAF_GROUP, EIGHT, need=2)
    assert (domains["la"].pods, domains["la"].free_gpus) == (2, 23)
    assert (domains["lb"].pods, domains["lb"].free_gpus) == (3, 24)


def test_a_job_too_big_for_the_partly_used_group_takes_the_one_that_holds_it() -> None:
    st = fabric()
    hold(st, "a1", ["gpu-0"])
    got = choose(cands(st), st.node_labels, LEAF_GROUP, EIGHT, need=3)
    assert got is not None and got.value == "lb"


def test_no_domain_holds_the_job_no_preference() -> None:
    st = fabric()
    assert choose(cands(st), st.node_labels, LEAF_GROUP, EIGHT, need=4) is None


def test_small_jobs_pack_into_the_fuller_domain() -> None:
    st = fabric()
    four = placer(gpus(4, nvlink=True))
    hold(st, "a1", ["gpu-0", "gpu-1"])  # la takes five 4-GPU pods, lb six
    domains = fits(cands(st), st.node_labels, LEAF_GROUP, four, need=2)
    assert (domains["la"].pods, domains["lb"].pods) == (5, 6)
    got = choose(cands(st), st.node_labels, LEAF_GROUP, four, need=2)
    assert got is not None and got.value == "la"
    hold(st, "b1", ["gpu-0", "gpu-1", "gpu-2", "gpu-3"])  # now five each: lb has fewer free GPUs (20 vs 22)
    domains = fits(cands(st), st.node_labels, LEAF_GROUP, four, need=2)
    assert (domains["la"].pods, domains["lb"].pods) == (5, 5)
    assert (domains["la"].free_gpus, domains["lb"].free_gpus) == (22, 20)
    got = choose(cands(st), st.node_labels, LEAF_GROUP, four, need=2)
    assert got is not None and got.value == "lb"


def test_siblings_decide_over_fit_and_intent() -> None:
    st = fabric()
    hold(st, "a1", ["gpu-0"])
    got = choose(cands(st), st.node_labels, LEAF_GROUP, EIGHT, need=1, sibling_nodes=["b2"], intent="la")
    assert got is not None and (got.value, got.why) == ("lb", "siblings")
    # the sibling's node need not be a candidate (it is full now); most siblings win
    got = choose(cands(st, ["a2", "b1"]), st.node_labels, LEAF_GROUP, EIGHT, need=1,
                 sibling_nodes=["a1", "b2", "b3"])
    assert got is not None and got.value == "lb"


def test_intent_holds_while_its_domain_still_takes_a_pod() -> None:
    st = fabric()
    hold(st, "b1", ["gpu-0"])  # tightest would be lb
    got = choose(cands(st), st.node_labels, LEAF_GROUP, EIGHT, need=2, intent="la")
    assert got is not None and (got.value, got.why) == ("la", "intent")
    for n in ("a1", "a2", "a3"):
        hold(st, n, ["gpu-7"])  # la can no longer take an 8-GPU pod: the intent is dropped
    got = choose(cands(st), st.node_labels, LEAF_GROUP, EIGHT, need=2, intent="la")
    assert got is not None and (got.value, got.why) == ("lb", "tightest")


def test_first_choice_domain_beats_a_tighter_second_choice_domain() -> None:
    st = state({"h1": "dgx-h200", "h2": "dgx-h200", "h3": "dgx-h200", "g1": "dgx-h100", "g2": "dgx-h100"})
    st.replace("nodes", [{"metadata": {"name": n, "labels": {LEAF_GROUP: "l-" + n[0]}}}
                         for n in ("h1", "h2", "h3", "g1", "g2")])
    spec = {"devices": {"requests": [{"name": "gpus", "firstAvailable": [
        {"name": "h200", "deviceClassName": "gpu-h200", "allocationMode": "ExactCount", "count": 8},
        {"name": "h100", "deviceClassName": "gpu-h100", "allocationMode": "ExactCount", "count": 8}]}]}}
    names = ["h1", "h2", "h3", "g1", "g2"]
    got = choose(cands(st, names), st.node_labels, LEAF_GROUP, placer(spec), need=2)
    assert got is not None and got.value == "l-h"


def test_in_domain_scores_keep_the_node_order_inside_and_put_the_rest_below() -> None:
    labels = {"a": {LEAF_GROUP: "x"}, "b": {LEAF_GROUP: "x"}, "c": {LEAF_GROUP: "y"}, "d": {LEAF_GROUP: "y"}}
    from topodra.fleet.domains import Choice
    out = in_domain_scores([("a", 3), ("b", 10), ("c", 10), ("d", 0)], [("a", 1), ("b", 10)], labels,
                           Choice(LEAF_GROUP, "x", "tightest"))
    assert out == [("a", 2), ("b", 10), ("c", 1), ("d", 0)]


# --- records -------------------------------------------------------------------------------------------

def test_pod_records_bound_nominated_and_finished() -> None:
    pods = Pods()
    pods.set_pod({"metadata": {"name": "p0", "namespace": "ns"},
                  "spec": {"schedulingGroup": {"podGroupName": "g"}, "nodeName": "n1"}, "status": {"phase": "Pending"}})
    pods.set_pod({"metadata": {"name": "p1", "namespace": "ns"}, "spec": {"schedulingGroup": {"podGroupName": "g"}},
                  "status": {"nominatedNodeName": "n2"}})
    pods.set_pod({"metadata": {"name": "p2", "namespace": "ns"}, "spec": {"schedulingGroup": {"podGroupName": "g"},
                  "nodeName": "n3"}, "status": {"phase": "Succeeded"}})
    pods.set_pod({"metadata": {"name": "solo", "namespace": "ns"}, "spec": {"nodeName": "n4"}})
    sib = pods.siblings("ns", "g", exclude="p9")
    assert [(s.name, s.node, s.bound) for s in sib] == [("p0", "n1", True), ("p1", "n2", False)]
    assert [s.name for s in pods.siblings("ns", "g", exclude="p0")] == ["p1"]
    pods.delete_pod("ns", "p0")
    pods.delete_pod("ns", "p1")
    assert pods.siblings("ns", "g") == []
    assert pod_record({"metadata": {"name": "x"}}).namespace == "default"


@pytest.mark.parametrize(("spec", "expect"), [
    ({"schedulingPolicy": {"gang": {"minCount": 4}},
      "schedulingConstraints": {"topology": [{"key": LEAF_GROUP}]}}, (4, LEAF_GROUP)),
    ({"schedulingPolicy": {"basic": {}}}, (1, None)),
    ({"schedulingPolicy": {"gang": {"minCount": "many"}}}, (1, None)),
    ({}, (1, None)),
])
def test_pod_group_records(spec: dict[str, Any], expect: tuple[int, str | None]) -> None:
    rec = pod_group_record({"metadata": {"name": "g", "namespace": "ns"}, "spec": spec})
    assert (rec.min_count, rec.topology_key) == expect


def test_the_domain_reserved_for_the_job_comes_after_siblings_and_before_the_tightest() -> None:
    st = fabric()
    hold(st, "a1", ["gpu-0"])  # la is the tightest for 2 whole servers; lb is the job's reservation
    labels = st.node_labels
    assert choose(cands(st), labels, LEAF_GROUP, EIGHT, 2) == Choice(LEAF_GROUP, "la", "tightest")
    assert choose(cands(st), labels, LEAF_GROUP, EIGHT, 2, owned={"b2"}) == Choice(LEAF_GROUP, "lb", "reserved")
    assert choose(cands(st), labels, LEAF_GROUP, EIGHT, 2, ["a2"], owned={"b2"}) == Choice(LEAF_GROUP, "la",
                                                                                         "siblings")
    assert choose(cands(st), labels, LEAF_GROUP, EIGHT, 2, intent="la", owned={"b2"}) == Choice(LEAF_GROUP, "lb",
                                                                                              "reserved")
    assert choose(cands(st), labels, LEAF_GROUP, EIGHT, 4, owned={"b2"}) is None  # lb cannot hold 4: no whole domain


def test_a_hinted_domain_comes_last_among_the_tightest_but_before_a_worse_rank_or_no_fit() -> None:
    st = fabric()
    hold(st, "a1", ["gpu-0"])
    labels = st.node_labels
    assert choose(cands(st), labels, LEAF_GROUP, EIGHT, 2, foreign={"a2"}) == Choice(LEAF_GROUP, "lb", "tightest")
    assert choose(cands(st), labels, LEAF_GROUP, EIGHT, 3, foreign={"b1"}) == Choice(LEAF_GROUP, "lb", "tightest")
