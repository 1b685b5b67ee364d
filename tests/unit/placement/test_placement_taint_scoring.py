"""The scorer is taint-aware: a GPU tainted NoSchedule/NoExecute (in its slice or by a DeviceTaintRule)
is unavailable, like an allocated one, and the inventory's F_n is the scorer's on the same objects.

The same numbers as tests/cluster/test_placement_taint_aware.py: two DGX H100 nodes (one 8-GPU NVLink
domain each), 3 GPUs held on ``a`` and 2 on ``b``, prior "only 4-GPU NVLink requests", so F_n is the
usable GPUs mod 4. With ``a``'s gpu-7 tainted a 1-GPU pod belongs on ``b``; without the taint, on ``a``.
"""

from __future__ import annotations

from typing import Any

import pytest
from testkit.views import claim, device_classes, gpus, hold, node_slices, state

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.clusterview.model import Sources, build_view
from topodra.fleet.demand import parse_demand
from topodra.fleet.fgd import Fragmentation, make_mix
from topodra.fleet.state import ClusterState
from topodra.placement.score import Scorer

Obj = dict[str, Any]
PRIOR = {4: 1.0}
DRAIN_A7: Obj = {"metadata": {"name": "drain-a-7"}, "spec": {
    "deviceSelector": {"driver": DRIVER, "pool": "a", "device": "gpu-7"},
    "taint": {"key": "topodra.io/maintenance", "effect": "NoSchedule"}}}


def held() -> ClusterState:
    st = state({"a": "dgx-h100", "b": "dgx-h100"}, window=0)
    hold(st, "a", ["gpu-0", "gpu-1", "gpu-2"])
    hold(st, "b", ["gpu-0", "gpu-1"])
    return st


def scores(st: ClusterState) -> dict[str, int]:
    mix = make_mix(PRIOR, 1.0, {}, DRIVER)
    demand = parse_demand(gpus(1))
    cands = []
    for n in ("a", "b"):
        v = st.node_view(n)
        assert v is not None
        cands.append((n, v, st.unavailable_indices(v)))
    return dict(Scorer().score(cands, [demand], mix))


def test_blind_to_taints_a_would_win_the_tight_fit() -> None:
    assert scores(held()) == {"a": 10, "b": 1}  # the control: a has 5 usable, F 1 -> 0 and the tighter fit


def test_a_device_taint_rule_moves_the_pod_to_the_node_it_fragments_less() -> None:
    st = held()
    st.set_taint_rule(DRAIN_A7)
    assert scores(st) == {"a": 1, "b": 10}
    st.delete_taint_rule("drain-a-7")
    assert scores(st) == {"a": 10, "b": 1}


@pytest.mark.parametrize("effect", ["NoSchedule", "NoExecute"])
def test_a_taint_in_the_slice_counts_too(effect: str) -> None:
    st = held()
    for s in node_slices("a", "dgx-h100"):
        for d in s["spec"]["devices"]:
            if d["name"] == "gpu-7":
                d["taints"] = [{"key": "topodra.io/xid", "value": "79", "effect": effect}]
        st.set_slice(s)
    assert scores(st) == {"a": 1, "b": 10}


def test_an_informational_taint_does_not() -> None:
    st = held()
    st.set_taint_rule({**DRAIN_A7, "spec": {**DRAIN_A7["spec"], "taint": {"key": "k", "effect": "None"}}})
    assert scores(st) == {"a": 10, "b": 1}


def test_the_inventory_prints_the_fragmentation_the_scorer_optimises() -> None:
    claims = (claim("ha", gpus(3), allocated=[("a", f"gpu-{i}") for i in range(3)]),
              claim("hb", gpus(2), allocated=[("b", f"gpu-{i}") for i in range(2)]))
    src = Sources(slices=tuple(node_slices("a", "dgx-h100") + node_slices("b", "dgx-h100")), claims=claims,
                  classes=device_classes(), taint_rules=(DRAIN_A7,))
    view = build_view(src, prior=PRIOR, window=0)
    st = state({"a": "dgx-h100", "b": "dgx-h100"}, window=0)
    st.replace("claims", claims)
    st.set_taint_rule(DRAIN_A7)
    mix = make_mix(PRIOR, 20.0, {}, DRIVER)
    measure = Fragmentation()
    for row in view.nodes:
        v = st.node_view(row.name)
        assert v is not None
        assert row.fragmentation == pytest.approx(measure.fragmentation(v, st.unavailable_indices(v), mix))
    # a: 4 usable GPUs (F = 4 mod 4 = 0), b: 6 usable (F = 2). Blind to the rule, a would read 1.
    assert [n.name for n in view.nodes] == ["a", "b"]
    assert [n.fragmentation for n in view.nodes] == pytest.approx([0.0, 2.0])

