"""``ClusterState.node_view`` and ``unavailable_indices`` (written for speed) give what the plain loops gave:
the same devices in the same order, the same shapes (which nodes share one), the same unavailable sets."""

from __future__ import annotations

import copy
from typing import Any

from testkit.views import claim, device_classes, gpus, node_slices

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.fleet.cel import qualified_capacity
from topodra.fleet.pools import newest_slices
from topodra.fleet.state import ClusterState, DeviceView, _shape_key, class_matcher, qualified_attributes
from topodra.fleet.taints import blocking, blocking_tuples, rule_matches, rule_taint

Obj = dict[str, Any]
# The mock profiles without MIG (testkit.views.node_slices renames device slices; MIG ones also publish others).
PROFILES = ("dgx-a100-80gb", "dgx-h100", "dgx-h200", "gb200-nvl72", "h100-nvl", "hgx-b200", "l4", "l40s")


def reference_devices(st: ClusterState, node: str) -> list[DeviceView]:
    """The node's devices as node_view built them before it was tuned (every slice through newest_slices,
    the helpers called per device)."""
    names = st._slices_by_node.get(node) or set()
    current = newest_slices(st.slices[n] for n in names)
    current.sort(key=lambda s: (str(s["spec"]["pool"].get("name", "")), str(s["metadata"]["name"])))
    out = []
    for s in current:
        pool = str(s["spec"]["pool"].get("name", ""))
        for dev in s["spec"].get("devices") or []:
            attrs = qualified_attributes(dev, st.driver)
            classes = frozenset(name for name, m in st.classes.items() if m is not None and m.matches(dev, st.driver))
            out.append(DeviceView(key=(pool, str(dev.get("name", ""))), gpu=attrs.get(f"{st.driver}/type") == "gpu",
                                  classes=classes, attrs=attrs, capacity=qualified_capacity(dev, st.driver),
                                  driver=st.driver, tainted=blocking(dev.get("taints") or []),
                                  taints=blocking_tuples(dev.get("taints") or [])))
    return out


def reference_unavailable(st: ClusterState, devices: list[DeviceView]) -> frozenset[int]:
    return frozenset(i for i, d in enumerate(devices) if d.key in st.used or d.tainted or any(
        rule_matches(r, st.driver, d.key[0], d.key[1]) for r in st.taint_rules.values()
        if blocking([rule_taint(r) or {}])))


def fleet() -> tuple[list[Obj], dict[str, str]]:
    """Two nodes of each profile; one node with fully qualified attribute names; one with a pool split
    over two slices and an older generation left behind; device taints of both kinds of effect."""
    nodes = {f"{p}-{i}": p for p in PROFILES for i in range(2)}
    slices = [s for n, p in nodes.items() for s in node_slices(n, p)]
    first = next(n for n, p in nodes.items() if p == "dgx-h100")
    for s in slices:
        if s["spec"]["nodeName"] == first:
            for d in s["spec"]["devices"]:
                d["attributes"] = {(k if "/" in k else f"{DRIVER}/{k}"): v for k, v in d["attributes"].items()}
    split = next(n for n, p in nodes.items() if p == "dgx-a100-80gb")
    whole = next(s for s in slices if s["spec"]["nodeName"] == split)
    old = copy.deepcopy(whole)
    old["metadata"]["name"] += "-old"
    old["spec"]["pool"]["generation"] = 0
    second = copy.deepcopy(whole)
    second["metadata"]["name"] = whole["metadata"]["name"] + "-b"
    devices = whole["spec"]["devices"]
    second["spec"]["devices"], whole["spec"]["devices"] = devices[len(devices) // 2:], devices[:len(devices) // 2]
    for s in (whole, second):
        s["spec"]["pool"]["resourceSliceCount"] = 2
    slices[slices.index(whole):slices.index(whole) + 1] = [second, old, whole]  # out of order on purpose
    taints = iter([{"key": "a", "effect": "NoSchedule"}, {"key": "b", "effect": "None"},
                   {"key": "c", "effect": "NoExecute"}])
    for s in slices[1::5]:
        t = next(taints, None)
        if t is not None:
            s["spec"]["devices"][0]["taints"] = [t]
    return slices, nodes


def test_node_views_and_unavailable_sets_are_those_of_the_plain_loops() -> None:
    slices, nodes = fleet()
    hand = {"metadata": {"name": "hand-cel"}, "spec": {"selectors": [{"cel": {"expression":
            'device.capacity["gpu.topodra.io"].memory.compareTo(quantity("40Gi")) >= 0'}}]}}
    for classes in ((), (*device_classes(), hand)):
        st = ClusterState(DRIVER)
        st.replace("classes", classes)
        st.replace("slices", slices)
        st.replace("claims", [claim("x", gpus(2), allocated=[(n, "gpu-1"), (n, "nic-0")]) for n in list(nodes)[::3]])
        for rules in ((), ({"metadata": {"name": "r"}, "spec": {"deviceSelector": {"device": "gpu-0"},
                                                                  "taint": {"key": "r", "effect": "NoSchedule"}}},)):
            st.replace("taintrules", rules)
            keys: dict[Any, set[int]] = {}
            for node in nodes:
                view = st.node_view(node)
                want = reference_devices(st, node)
                assert view is not None and list(view.devices) == want, node
                assert view.index == {d.key: i for i, d in enumerate(want)}
                assert st.unavailable_indices(view) == reference_unavailable(st, want), (node, rules)
                assert st.unavailable_for(view, ()) == st.unavailable_indices(view)  # no tolerations: the same
                assert st.unavailable_for(view, (((("", "Exists", "", "")),),)) == frozenset(
                    i for i, d in enumerate(want) if d.key in st.used)  # tolerates every taint: allocations only
                keys.setdefault(_shape_key(want), set()).add(view.shape)
            assert all(len(ids) == 1 for ids in keys.values())  # one shape per distinct key ...
            assert len({next(iter(ids)) for ids in keys.values()}) == len(keys)  # ... and no two keys share one
            assert len(keys) >= 4  # the profiles do differ: the partition is not trivial
    assert any(d.classes for d in st.node_view(next(iter(nodes))).devices)  # type: ignore[union-attr]
    assert any(d.tainted for n in nodes for d in st.node_view(n).devices)  # type: ignore[union-attr]
    assert any(d.capacity for n in nodes for d in st.node_view(n).devices)  # type: ignore[union-attr]


def test_a_class_is_parsed_without_topodra_selectors_loaded_beforehand() -> None:
    """class_matcher imports topodra.selectors itself (the fleet model no longer does at import)."""
    cls = next(c for c in device_classes() if c["metadata"]["name"] == "gpu-h100")
    m = class_matcher(cls)
    assert m is not None and type(m).__name__ == "DeviceMatch"
