"""The scorer and reservations (issue 33): toleration-aware availability and the steering term.

Real discovery output of mock DGX H100 nodes (8 GPUs, one NVLink domain each; testkit.views) in a
ClusterState fed as the watch would; reservation DeviceTaintRules as the controller writes them (one per
node, selecting the node's pool, value = the ClaimProfile's uid). Both request paths (per state and per node)
must give the same answers. No API server.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from testkit.views import gpus, hold, state

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.fleet.domains import LEAF_GROUP, SCALABLE_UNIT
from topodra.fleet.fgd import DEFAULT_PRIOR
from topodra.fleet.state import ClusterState
from topodra.placement.cache import apply_event
from topodra.placement.score import STEER_PENALTY
from topodra.placement.server import Placement
from topodra.reservations import (
    HINT_EFFECT,
    HOLD_EFFECT,
    MANAGED_LABEL,
    MANAGED_VALUE,
    PROFILE_NAME_LABEL,
    PROFILE_NS_LABEL,
    RESERVATION_TAINT_KEY,
    UID_LABEL,
    toleration,
)

Obj = dict[str, Any]
NS = "ns"
UID = "6f1c2a3e-0000-4000-8000-00000000a001"  # the reserving ClaimProfile's uid
OTHER = "6f1c2a3e-0000-4000-8000-00000000b002"
EXISTS_ALL = {"operator": "Exists"}  # no key: tolerates every taint


def rule(node: str, uid: str = UID, effect: str = HOLD_EFFECT) -> Obj:
    """A reservation rule as the controller writes it (CONTRACT.md)."""
    return {"metadata": {"name": f"rsv-{node}", "labels": {
        MANAGED_LABEL: MANAGED_VALUE, PROFILE_NS_LABEL: NS, PROFILE_NAME_LABEL: "big", UID_LABEL: uid}},
        "spec": {"deviceSelector": {"driver": DRIVER, "pool": node},
                 "taint": {"key": RESERVATION_TAINT_KEY, "value": uid, "effect": effect}}}


def tolerating(count: int, *tolerations: Obj, nvlink: bool = False) -> Obj:
    spec = gpus(count, nvlink=nvlink)
    spec["devices"]["requests"][0]["exactly"]["tolerations"] = list(tolerations)
    return spec


def with_templates(st: ClusterState) -> ClusterState:
    for name, spec in {"one": gpus(1), "eight": gpus(8, nvlink=True),
                       "mine-one": tolerating(1, toleration(UID)),
                       "mine-eight": tolerating(8, toleration(UID), nvlink=True),
                       "all-eight": tolerating(8, EXISTS_ALL, nvlink=True),
                       "all-one": tolerating(1, EXISTS_ALL)}.items():
        st.set_template({"metadata": {"name": name, "namespace": NS}, "spec": {"spec": spec}})
    return st


def pod(template: str, name: str = "p", group: str | None = None) -> Obj:
    spec: Obj = {"resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template}], "containers": []}
    if group:
        spec["schedulingGroup"] = {"podGroupName": group}
    return {"metadata": {"name": name, "namespace": NS}, "spec": spec, "status": {}}


class _Cache:
    def __init__(self, st: ClusterState) -> None:
        self.state = st
        self.lock = threading.Lock()

    def synced(self) -> bool:
        return True


def placement(st: ClusterState, by_state: bool = True) -> Placement:
    return Placement(_Cache(st), DEFAULT_PRIOR, 20, by_state=by_state)  # type: ignore[arg-type]


def scores(p: Placement, template: str, names: list[str], group: str | None = None) -> dict[str, int]:
    return {h["Host"]: h["Score"] for h in p.prioritize({"Pod": pod(template, group=group), "NodeNames": names})}


def reserved_a() -> ClusterState:
    """``a`` held for UID (whole node), ``b`` with one GPU in use: 7 free."""
    st = with_templates(state({"a": "dgx-h100", "b": "dgx-h100"}))
    hold(st, "b", ["gpu-0"])
    st.set_taint_rule(rule("a"))
    return st


@pytest.mark.parametrize("by_state", [True, False])
def test_a_reserved_node_is_unavailable_to_an_ordinary_pod_and_free_for_the_reserving_one(by_state: bool) -> None:
    p = placement(reserved_a(), by_state)
    assert scores(p, "one", ["a", "b"]) == {"a": 0, "b": 10}  # every device of a is held: no fit there
    assert scores(p, "eight", ["a", "b"]) == {"a": 0, "b": 0}  # b has 7: the 8-GPU job fits nowhere
    assert scores(p, "mine-eight", ["a", "b"]) == {"a": 10, "b": 0}  # its reservation is free for it
    # FGD alone prefers b (the tighter fit), but the reservation is where the reserving job's pods go.
    assert scores(p, "mine-one", ["a", "b"]) == {"a": 10, "b": 1}


@pytest.mark.parametrize("by_state", [True, False])
def test_an_exists_toleration_with_an_empty_key_tolerates_the_reservation(by_state: bool) -> None:
    p = placement(reserved_a(), by_state)
    assert scores(p, "all-eight", ["a", "b"]) == {"a": 10, "b": 0}


def test_a_toleration_of_another_uid_does_not() -> None:
    st = reserved_a()
    st.set_template({"metadata": {"name": "theirs", "namespace": NS},
                     "spec": {"spec": tolerating(1, toleration(OTHER))}})
    assert scores(placement(st), "theirs", ["a", "b"]) == {"a": 0, "b": 10}


def hinted_a() -> ClusterState:
    """``a`` and ``b`` empty and equal; ``a`` hinted (effect None) as the next reservation of UID."""
    st = with_templates(state({"a": "dgx-h100", "b": "dgx-h100"}))
    st.set_taint_rule(rule("a", effect=HINT_EFFECT))
    return st


@pytest.mark.parametrize("by_state", [True, False])
def test_a_hint_lowers_the_score_of_an_ordinary_pod_and_raises_the_owners_preference(by_state: bool) -> None:
    st = with_templates(state({"a": "dgx-h100", "b": "dgx-h100"}))
    p = placement(st, by_state)
    assert scores(p, "one", ["a", "b"]) == {"a": 10, "b": 10}  # the control: equal nodes
    st.set_taint_rule(rule("a", effect=HINT_EFFECT))
    assert scores(p, "one", ["a", "b"]) == {"a": 10 - STEER_PENALTY, "b": 10}  # the small job goes elsewhere
    assert scores(p, "mine-one", ["a", "b"]) == {"a": 10, "b": 1}  # the reserving job's pod: its domain first
    assert scores(p, "eight", ["a", "b"]) == {"a": 10 - STEER_PENALTY, "b": 10}  # a hint is free: it still fits
    st.delete_taint_rule("rsv-a")
    assert scores(p, "one", ["a", "b"]) == {"a": 10, "b": 10}


def test_a_hint_never_filters_when_the_hinted_node_is_the_only_fit() -> None:
    st = hinted_a()
    hold(st, "b", [f"gpu-{i}" for i in range(8)])
    assert scores(placement(st), "one", ["a", "b"]) == {"a": 10 - STEER_PENALTY, "b": 0}


def test_no_penalty_where_the_hinted_devices_are_all_in_use() -> None:
    st = with_templates(state({"a": "dgx-h100", "b": "dgx-h100"}))
    hint = rule("a", effect=HINT_EFFECT)
    hint["spec"]["deviceSelector"]["device"] = "gpu-7"  # one device hinted
    st.set_taint_rule(hint)
    p = placement(st)
    assert scores(p, "one", ["a", "b"]) == {"a": 10 - STEER_PENALTY, "b": 10}
    hold(st, "a", ["gpu-7"])
    hold(st, "b", ["gpu-7"])
    assert scores(p, "one", ["a", "b"]) == {"a": 10, "b": 10}  # nothing hinted is free: nothing to steer from


def test_cached_state_does_not_leak_between_tolerating_and_ordinary_pods() -> None:
    """One long-lived Placement answers alternating pods exactly as a fresh one does for each."""
    st = reserved_a()
    st.set_taint_rule(rule("c", effect=HINT_EFFECT))  # no such node: selects nothing
    p = placement(st)
    order = ["mine-eight", "one", "eight", "mine-one", "one", "all-eight", "mine-eight", "eight", "all-one", "one"]
    for template in order:
        assert scores(p, template, ["a", "b"]) == scores(placement(st), template, ["a", "b"]), template
    view = st.node_view("a")
    assert view is not None and len(st.unavailable_indices(view)) == len(view.devices)  # still held for others
    # the node's own entry in the state table is the ordinary state, whatever the tolerating pods met
    assert p.states.states.states[p.states.states.of["a"]].used == st.unavailable_indices(view)


def test_a_deleted_reservation_frees_the_node_for_everyone() -> None:
    st = reserved_a()
    p = placement(st)
    assert scores(p, "mine-eight", ["a", "b"]) == {"a": 10, "b": 0}
    assert scores(p, "one", ["a", "b"])["a"] == 0
    st.delete_taint_rule("rsv-a")
    assert scores(p, "one", ["a", "b"]) == {"a": 1, "b": 10}  # FGD again: b is the tighter fit
    assert scores(p, "mine-eight", ["a", "b"]) == {"a": 10, "b": 0}


def test_an_ordinary_pod_never_meets_the_toleration_path() -> None:
    """The hot path: no tolerations, no override sets; the taint index is not even built."""
    st = reserved_a()
    scores(placement(st), "one", ["a", "b"])
    assert st._taint_nodes is None
    assert st.tolerated_unavailable(()) == {}


def test_tolerated_unavailable_names_only_the_nodes_that_differ() -> None:
    st = reserved_a()
    tol = ((("topodra.io/reservation", "Equal", UID, "NoSchedule"),),)
    got = st.tolerated_unavailable(tol)
    assert set(got) == {"a"} and got["a"] == frozenset()
    assert st.tolerated_unavailable(((("topodra.io/reservation", "Equal", OTHER, "NoSchedule"),),)) == {}
    assert st.tolerated_unavailable(((("other-key", "Exists", "", ""),),)) == {}


# --------------------------------------------------------------------------- gangs

LEAVES = {"a1": "la", "a2": "la", "b1": "lb", "b2": "lb"}


def fabric() -> ClusterState:
    st = with_templates(state({n: "dgx-h100" for n in LEAVES}))
    st.replace("nodes", [{"metadata": {"name": n, "labels": {LEAF_GROUP: leaf, SCALABLE_UNIT: "su1"}}}
                         for n, leaf in LEAVES.items()])
    for group in ("job", "big"):
        apply_event(st, "podgroups", "ADDED", {"metadata": {"name": group, "namespace": NS},
                                               "spec": {"schedulingPolicy": {"gang": {"minCount": 2}}}})
    return st


@pytest.mark.parametrize("by_state", [True, False])
def test_a_gang_goes_to_the_domain_reserved_for_it(by_state: bool) -> None:
    st = fabric()
    p = placement(st, by_state)
    scores(p, "mine-eight", list(LEAVES), group="big")
    assert p.gangs.last is not None and (p.gangs.last.value, p.gangs.last.why) == ("la", "tightest")  # control
    p.gangs.intents.clear()
    for n in ("b1", "b2"):
        st.set_taint_rule(rule(n))
    got = scores(p, "mine-eight", list(LEAVES), group="big")
    assert p.gangs.last is not None and (p.gangs.last.value, p.gangs.last.why) == ("lb", "reserved")
    assert min(got["b1"], got["b2"]) > max(got["a1"], got["a2"]), got


@pytest.mark.parametrize("by_state", [True, False])
def test_another_gang_avoids_the_hinted_domain(by_state: bool) -> None:
    st = fabric()
    for n in ("a1", "a2"):
        st.set_taint_rule(rule(n, effect=HINT_EFFECT))
    p = placement(st, by_state)
    got = scores(p, "eight", list(LEAVES), group="job")
    assert p.gangs.last is not None and (p.gangs.last.value, p.gangs.last.why) == ("lb", "tightest")
    assert min(got["b1"], got["b2"]) > max(got["a1"], got["a2"]), got
    got = scores(p, "mine-eight", list(LEAVES), group="big")  # the job the hint is for goes there
    assert p.gangs.last is not None and (p.gangs.last.value, p.gangs.last.why) == ("la", "reserved")
    assert min(got["a1"], got["a2"]) > max(got["b1"], got["b2"]), got


def test_the_reserved_domain_is_not_chosen_while_it_cannot_hold_the_job() -> None:
    st = fabric()
    for n in ("b1", "b2"):
        st.set_taint_rule(rule(n))
    hold(st, "b2", ["gpu-0"])  # still draining: one pod of the 2 fits in lb
    p = placement(st)
    scores(p, "mine-eight", list(LEAVES), group="big")
    assert p.gangs.last is not None and (p.gangs.last.value, p.gangs.last.why) == ("la", "tightest")
