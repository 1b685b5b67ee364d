"""The fleet model's pure pieces: newest slices, holders, device taints and DeviceTaintRules, node
schedulability, and the unavailable set the scorer and the inventory read (allocated or blocking-tainted).

Slices are the real slice builder's output on mock profiles (tests/placement_views.py); expected values
are written down from the objects built here.
"""

from __future__ import annotations

from typing import Any

from testkit.views import claim, gpus, node_slices, state

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.fleet.allocations import allocated_keys, holders
from topodra.fleet.nodes import node_schedulable, why_unschedulable
from topodra.fleet.pools import newest_slices
from topodra.fleet.taints import blocking, device_taints, rule_matches, rule_taint, taint_text

Obj = dict[str, Any]


def rule(name: str, effect: str | None, **selector: str) -> Obj:
    taint = {"key": "topodra.io/maintenance"} | ({"effect": effect} if effect else {})
    return {"metadata": {"name": name}, "spec": {"deviceSelector": selector, "taint": taint}}


def slice_obj(name: str, pool: str, generation: int, node: str | None = "n", driver: str = DRIVER) -> Obj:
    spec: Obj = {"driver": driver, "pool": {"name": pool, "generation": generation}, "devices": []}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name}, "spec": spec}


def names(slices: list[Obj]) -> list[str]:
    return [s["metadata"]["name"] for s in slices]


def test_newest_slices_keep_the_newest_generation_per_pool() -> None:
    got = [slice_obj("p1-g1", "p1", 1), slice_obj("p1-g2", "p1", 2), slice_obj("p1-g2b", "p1", 2),
           slice_obj("p2-g5", "p2", 5), slice_obj("other", "p3", 9, driver="other.example.com"),
           slice_obj("net", "p4", 1, node=None)]
    assert names(newest_slices(got, DRIVER)) == ["p1-g2", "p1-g2b", "p2-g5", "net"]
    assert names(newest_slices(got, DRIVER, node_local=True)) == ["p1-g2", "p1-g2b", "p2-g5"]
    assert names(newest_slices(got)) == ["p1-g2", "p1-g2b", "p2-g5", "other", "net"]


def test_holders_name_the_claim_of_each_device_of_the_driver_only() -> None:
    c = claim("train", gpus(2), namespace="team", allocated=[("n", "gpu-0"), ("n", "gpu-1")])
    c["status"]["allocation"]["devices"]["results"].append(
        {"request": "x", "driver": "other.example.com", "pool": "n", "device": "gpu-9"})
    pending = claim("waiting", gpus(1), namespace="team")
    assert allocated_keys(c, DRIVER) == (("n", "gpu-0"), ("n", "gpu-1"))
    assert allocated_keys(pending, DRIVER) == ()
    assert holders([c, pending], DRIVER) == {("n", "gpu-0"): ("team", "train"), ("n", "gpu-1"): ("team", "train")}


def test_rule_selectors_and_which_effects_block() -> None:
    assert rule_matches(rule("all", "NoSchedule"), DRIVER, "p", "gpu-0")  # empty selector: every device
    assert rule_matches(rule("pool", "NoSchedule", driver=DRIVER, pool="p"), DRIVER, "p", "gpu-3")
    assert not rule_matches(rule("pool", "NoSchedule", pool="q"), DRIVER, "p", "gpu-3")
    assert not rule_matches(rule("drv", "NoSchedule", driver="other.example.com"), DRIVER, "p", "gpu-3")
    assert not rule_matches(rule("dev", "NoSchedule", device="gpu-1"), DRIVER, "p", "gpu-3")
    assert rule_taint(rule("none", None)) is None
    dev = {"name": "gpu-3", "taints": [{"key": "topodra.io/xid", "value": "79", "effect": "None"}]}
    rules = [rule("drain", "NoExecute", pool="p", device="gpu-3"), rule("noeffect", None), rule("q", "NoSchedule",
                                                                                                  pool="q")]
    got = device_taints(dev, rules, DRIVER, "p")
    assert [taint_text(t) for t in got] == ["topodra.io/xid=79:None", "topodra.io/maintenance:NoExecute"]
    assert blocking(got) and not blocking(got[:1])
    assert blocking([{"key": "k", "effect": "NoSchedule"}]) and not blocking([])


def test_why_a_node_takes_no_pods() -> None:
    ready = {"type": "Ready", "status": "True"}
    assert why_unschedulable({"spec": {}, "status": {"conditions": [ready]}}) == ""
    assert node_schedulable({"spec": {}, "status": {"conditions": [ready]}})
    assert why_unschedulable({"spec": {"unschedulable": True}, "status": {"conditions": [ready]}}) == "cordoned"
    assert why_unschedulable({"spec": {}, "status": {"conditions": [{"type": "Ready", "status": "False"}]}}) == \
        "not Ready"
    tainted = {"spec": {"taints": [{"key": "a", "effect": "PreferNoSchedule"}, {"key": "b", "effect": "NoExecute"}]},
               "status": {"conditions": [ready]}}
    assert why_unschedulable(tainted) == "tainted b:NoExecute" and not node_schedulable(tainted)


def keys(st: Any, node: str) -> list[tuple[str, str]]:
    view = st.node_view(node)
    return sorted(view.devices[i].key for i in st.unavailable_indices(view))


def test_unavailable_is_allocated_or_blocking_tainted_and_follows_rule_events() -> None:
    st = state({"a": "dgx-h100", "b": "dgx-h100"})
    sl = node_slices("a", "dgx-h100")
    for s in sl:
        for d in s["spec"]["devices"]:
            if d["name"] == "gpu-5":
                d["taints"] = [{"key": "topodra.io/xid", "value": "79", "effect": "NoSchedule"}]
            if d["name"] == "gpu-6":
                d["taints"] = [{"key": "topodra.io/info", "effect": "None"}]
    for s in sl:
        st.set_slice(s)
    st.set_claim(claim("hold", gpus(1), allocated=[("a", "gpu-0")]))
    assert keys(st, "a") == [("a", "gpu-0"), ("a", "gpu-5")]
    assert keys(st, "b") == []
    st.set_taint_rule(rule("drain-b", "NoExecute", driver=DRIVER, pool="b", device="gpu-7"))
    st.set_taint_rule(rule("informational", "None", pool="b"))
    st.set_taint_rule(rule("other-driver", "NoSchedule", driver="other.example.com"))
    assert keys(st, "b") == [("b", "gpu-7")]
    assert keys(st, "a") == [("a", "gpu-0"), ("a", "gpu-5")]
    st.set_taint_rule(rule("drain-b", "NoSchedule", driver=DRIVER, pool="b", device="gpu-6"))  # modified
    assert keys(st, "b") == [("b", "gpu-6")]
    st.delete_taint_rule("drain-b")
    assert keys(st, "b") == []
    st.replace("taintrules", [rule("all-of-a", "NoSchedule", pool="a")])
    view = st.node_view("a")
    assert view is not None and len(keys(st, "a")) == len(view.devices)
    assert st.sizes()["taint_rules"] == 1
    st.replace("taintrules", [])
    assert keys(st, "a") == [("a", "gpu-0"), ("a", "gpu-5")]


def test_a_rule_naming_a_pool_touches_only_its_node_one_without_touches_all() -> None:
    """Reservation rules name one pool (a node): their churn must not make the scorer rebuild every node."""
    st = state({"a": "dgx-h100", "b": "dgx-h100"})
    for node in ("a", "b"):
        for s in node_slices(node, "dgx-h100"):
            st.set_slice(s)
    assert keys(st, "a") == [] and keys(st, "b") == []  # both nodes' tables built
    mark = st.changes
    st.set_taint_rule(rule("hold-b", "NoSchedule", driver=DRIVER, pool="b"))
    assert st.changed_since(mark) == ["b"]
    view = st.node_view("b")
    assert view is not None and len(keys(st, "b")) == len(view.devices) and keys(st, "a") == []
    mark = st.changes
    st.delete_taint_rule("hold-b")
    assert st.changed_since(mark) == ["b"] and keys(st, "b") == []
    mark = st.changes
    st.set_taint_rule(rule("everywhere", "NoSchedule", driver=DRIVER, device="gpu-1"))
    assert st.changed_since(mark) is None  # no pool: every node may have changed
    assert keys(st, "a") == [("a", "gpu-1")] and keys(st, "b") == [("b", "gpu-1")]


def test_unavailable_for_a_tolerance_follows_claims_and_rules_of_its_node() -> None:
    """``unavailable_for`` is cached per node and tolerance; a claim or a rule there must drop it."""
    from topodra import reservations as vocab
    from topodra.fleet.taints import toleration_tuple
    st = state({"a": "dgx-h100", "b": "dgx-h100"})
    for node in ("a", "b"):
        for s in node_slices(node, "dgx-h100"):
            st.set_slice(s)
    hold = {"metadata": {"name": "hold-a"}, "spec": {"deviceSelector": {"driver": DRIVER, "pool": "a"}, "taint": {
        "key": vocab.RESERVATION_TAINT_KEY, "value": "u", "effect": "NoSchedule"}}}
    st.set_taint_rule(hold)
    backfill = (tuple(toleration_tuple(t) for t in vocab.backfill_tolerations(3600)),)
    reserving = (tuple(toleration_tuple(t) for t in (vocab.toleration("u"), vocab.window_toleration())),)
    view = st.node_view("a")
    assert view is not None

    def mine(tol: Any) -> list[tuple[str, str]]:
        return sorted(view.devices[i].key for i in st.unavailable_for(view, tol))
    assert mine(reserving) == [] and len(mine(backfill)) == 0  # no window rule yet: the hold alone is tolerated
    st.set_taint_rule({"metadata": {"name": "win-a"}, "spec": {"deviceSelector": {"driver": DRIVER, "pool": "a"},
                                                             "taint": {"key": vocab.BACKFILL_WINDOW_KEY,
                                                                       "value": "30m", "effect": "NoSchedule"}}})
    assert mine(reserving) == [] and len(mine(backfill)) == len(view.devices)  # 30m < 1h: closed to it
    st.set_claim(claim("c", gpus(1), allocated=[("a", "gpu-0")]))
    assert mine(reserving) == [("a", "gpu-0")]
    st.delete_taint_rule("win-a")
    assert mine(backfill) == [("a", "gpu-0")]
