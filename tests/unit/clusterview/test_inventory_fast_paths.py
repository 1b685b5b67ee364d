"""The inventory's fast paths give the answers of the slow ones: class membership memoised per device
signature, the fleet state fed slim slices (F_n per node against the state built from whole slices and
every class, the old way), ``plain`` against ``dataclasses.asdict``, ``-o json`` text against
``json.dumps``."""

from __future__ import annotations

import copy
import io
import json
from dataclasses import asdict
from typing import Any

import pytest
from testkit.views import claim, device_classes, gpus, node_slices

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.clusterview.fleetinput import measure_inputs, memoised, read_names, slim_slices
from topodra.clusterview.jsonout import json_text
from topodra.clusterview.main import emit
from topodra.clusterview.model import Sources, build_view, plain
from topodra.fleet.fgd import DEFAULT_PRIOR, Fragmentation, make_mix
from topodra.fleet.pools import newest_slices
from topodra.fleet.state import ClusterState, class_matcher
from topodra.hardware.mockprofile import profile_names
from topodra.simulate import SimNode, discover
from topodra.slices import build_slices

Obj = dict[str, Any]


def all_devices() -> list[Obj]:
    """Every device of every mock profile, plus copies spelling the driver's attributes fully qualified."""
    devs = [d for p in profile_names()
            for s in build_slices(DRIVER, "n", None, discover(SimNode(name="n", profile=p, labels={}, overrides={})), 1)
            for d in s["spec"].get("devices") or []]
    qualified = []
    for d in devs[::7]:
        q = copy.deepcopy(d)
        q["attributes"] = {(k if "/" in k else f"{DRIVER}/{k}"): v for k, v in q["attributes"].items()}
        q["capacity"] = {(k if "/" in k else f"{DRIVER}/{k}"): v for k, v in (q.get("capacity") or {}).items()}
        qualified.append(q)
    return devs + qualified


def test_memoised_classes_answer_as_the_predicates_on_every_profile() -> None:
    classes = {c["metadata"]["name"]: class_matcher(c) for c in device_classes()}
    hand = {"metadata": {"name": "hand-cel"}, "spec": {"selectors": [{"cel": {"expression":
            'device.attributes["gpu.topodra.io"].productName == "NVIDIA H100 80GB HBM3" && '
            'device.capacity["gpu.topodra.io"].memory.compareTo(quantity("40Gi")) >= 0'}}]}}
    classes["hand-cel"] = class_matcher(hand)
    assert all(p is not None for p in classes.values())
    memo = memoised(classes, DRIVER)
    devs = all_devices()
    hits = 0
    for d in devs:
        for name, pred in classes.items():
            assert pred is not None
            want = pred.matches(d, DRIVER)
            got = memo[name]
            assert got is not None and got.matches(d, DRIVER) == want, (name, d["name"])
            hits += want
    assert hits > len(devs)  # the classes do select devices: the comparison is not all-False


def test_class_reads_are_named_from_its_cel() -> None:
    h100 = class_matcher(next(c for c in device_classes() if c["metadata"]["name"] == "gpu-h100"))
    mem = class_matcher(next(c for c in device_classes() if c["metadata"]["name"] == "gpu-mem-80gi"))
    assert h100 is not None and mem is not None
    assert read_names(h100, DRIVER) == (("gpu.topodra.io/model", "gpu.topodra.io/type", "model", "type"), ())
    assert read_names(mem, DRIVER) == (("gpu.topodra.io/type", "type"), ("gpu.topodra.io/memory", "memory"))


def mixed_sources() -> Sources:
    """Nodes of five profiles with claims of several classes and shapes (NVLink constraints, a NIC, model
    and memory classes), a slice taint and a DeviceTaintRule: fragmentation differs from node to node."""
    nodes = {"h100-0": "dgx-h100", "h100-1": "dgx-h100", "nvl-0": "h100-nvl", "nvl-1": "h100-nvl",
             "a100-0": "dgx-a100-80gb", "b200-0": "hgx-b200", "gb-0": "gb200-nvl72"}
    slices = [s for n, p in nodes.items() for s in node_slices(n, p)]
    for d in slices[0]["spec"]["devices"]:
        if d["name"] == "gpu-3":
            d["taints"] = [{"key": "x", "effect": "NoSchedule"}]
    claims = [
        claim("a", gpus(2, "gpu-h100", nvlink=True), allocated=[("h100-0", "gpu-0"), ("h100-0", "gpu-1")]),
        claim("b", gpus(1), allocated=[("nvl-0", "gpu-0")]),
        claim("c", gpus(3, "gpu-mem-80gi"), allocated=[("a100-0", f"gpu-{i}") for i in range(3)]),
        claim("d", gpus(1, "nic.topodra.io"), allocated=[("h100-1", "nic-0")]),
        claim("e", gpus(4, "gpu-b200", nvlink=True), allocated=[("b200-0", f"gpu-{i}") for i in (1, 3, 5, 7)]),
        claim("f", gpus(2, "gpu-gb200", nvlink=True)),  # pending: still part of the mix
        claim("g", gpus(1, "gpu-h100"), allocated=[("nvl-1", "gpu-1")]),
    ]
    rule = {"metadata": {"name": "r"}, "spec": {"deviceSelector": {"driver": DRIVER, "pool": "h100-1"},
                                                 "taint": {"key": "m", "effect": "NoExecute"}}}
    rule_one = {"metadata": {"name": "r1"}, "spec": {"deviceSelector": {"pool": "b200-0", "device": "gpu-0"},
                                                     "taint": {"key": "m", "effect": "NoSchedule"}}}
    return Sources(slices=tuple(slices), claims=tuple(claims), classes=device_classes(),
                   taint_rules=(rule, rule_one))


def reference_fragmentation(src: Sources) -> dict[str, float]:
    """F_n the way build_view computed it before slim slices: whole slices, every class."""
    state = ClusterState(DRIVER, window=200)
    state.replace("classes", src.classes)
    state.replace("slices", newest_slices(src.slices, DRIVER, node_local=True))
    state.replace("claims", src.claims)
    state.replace("taintrules", src.taint_rules)
    known = frozenset(k for k, m in state.classes.items() if m is not None)
    mix = make_mix(DEFAULT_PRIOR, 20.0, state.observed_mix(), DRIVER, known)
    measure = Fragmentation()
    out = {}
    for node in sorted(state._slices_by_node):
        view = state.node_view(node)
        assert view is not None
        out[node] = measure.fragmentation(view, state.unavailable_indices(view), mix)
    return out


def test_slim_slices_keep_the_fragmentation_of_every_node() -> None:
    src = mixed_sources()
    want = reference_fragmentation(src)
    view = build_view(src)
    got = {n.name: n.fragmentation for n in view.nodes}
    assert got == pytest.approx(want, abs=1e-12)
    assert len(set(round(v, 6) for v in want.values())) >= 4  # the nodes differ: the test can fail
    # The mix names classes, so the state saw only theirs, over slim slices.
    state = ClusterState(DRIVER)
    state.replace("classes", src.classes)
    state.replace("claims", src.claims)
    mix = make_mix(DEFAULT_PRIOR, 20.0, state.observed_mix(), DRIVER, frozenset(state.classes))
    kept, reads = measure_inputs(state.classes, mix, DRIVER)
    assert set(kept) == {"gpu.topodra.io", "gpu-h100", "gpu-mem-80gi", "nic.topodra.io", "gpu-b200", "gpu-gb200"}
    assert reads is not None and f"{DRIVER}/nvlinkDomain" in reads[0] and "memory" in reads[1]
    slim = slim_slices(src.slices[:1], reads)
    assert len(slim[0]["spec"]["devices"][0]["attributes"]) < len(src.slices[0]["spec"]["devices"][0]["attributes"])
    assert slim[0]["spec"]["devices"][3]["taints"] == [{"key": "x", "effect": "NoSchedule"}]
    assert "uuid" in src.slices[0]["spec"]["devices"][0]["attributes"]  # the input is not changed


def test_plain_equals_asdict() -> None:
    view = build_view(mixed_sources())
    assert plain(view) == asdict(view)


def test_json_text_is_the_document_json_dumps_writes() -> None:
    view = build_view(mixed_sources())
    data = view.to_dict()
    text = json_text(data)
    assert json.loads(text) == json.loads(json.dumps(data, indent=2))
    lines = text.splitlines()
    # One line per device (each node's GPUs and NICs), the levels above indented as json.dumps(indent=2).
    assert sum(1 for line in lines if line.startswith('        {"name": "gpu-')) == sum(len(n.gpus) for n in view.nodes)
    assert lines[:3] == ["{", '  "driver": "gpu.topodra.io",', '  "nodes": [']
    out = io.StringIO()
    emit(view, "json", out)
    assert out.getvalue() == text
    assert json_text({"a": [], "b": {}, "c": {"d": [1, {"e": None}]}, 1: True}) == \
        json.dumps({"a": [], "b": {}, "c": {"d": [1, {"e": None}]}, 1: True}, indent=2) + "\n"


def reference_json_text(obj: Any) -> str:
    """The writer before its short cuts: json.dumps for every key, scalar and compact object."""
    from topodra.clusterview.jsonout import COMPACT_DEPTH, INDENT, _key

    out: list[str] = []

    def write(o: Any, depth: int) -> None:
        if depth >= COMPACT_DEPTH or not isinstance(o, dict | list | tuple) or not o:
            out.append(json.dumps(o))
            return
        pad = "\n" + INDENT * (depth + 1)
        if isinstance(o, dict):
            out.append("{")
            for i, (k, v) in enumerate(o.items()):
                out.append((pad if i == 0 else "," + pad) + json.dumps(k if isinstance(k, str) else _key(k)) + ": ")
                write(v, depth + 1)
            out.append("\n" + INDENT * depth + "}")
        else:
            out.append("[")
            for i, v in enumerate(o):
                out.append(pad if i == 0 else "," + pad)
                write(v, depth + 1)
            out.append("\n" + INDENT * depth + "]")

    write(obj, 0)
    return "".join(out) + "\n"


def test_json_text_short_cuts_write_what_json_dumps_writes() -> None:
    import enum

    class Level(enum.IntEnum):
        HIGH = 3

    class Name(enum.StrEnum):
        A = "a"

    odd: Any = {"s": "ünï \"q\" \\ \n\t\x00", "i": -12, "big": 2**70, "b": True, "f": False, "n": None,
                "x": 0.1, "nan": float("nan"), "inf": float("inf"), "ninf": -float("inf"), "e": 1e300,
                "lvl": Level.HIGH, "enum": Name.A, "t": (1, "2"), "empty": [{}, [], ()],
                1: {2.5: "k", None: 1, False: [True]}, "deep": [[[{"a": [1, {"b": 2}]}, "z"]]],
                "sub": {"ü": {"x": 1}, "": {"": ""}}}
    view = build_view(mixed_sources())
    for doc in (odd, [odd, [odd]], {"a": [odd, {"b": odd}]}, view.to_dict(), "top", 3, None, [], {}):
        assert json_text(doc) == reference_json_text(doc)
    with pytest.raises(TypeError):  # not serialisable: the error json.dumps gives, also below the compact depth
        json_text({"a": [[[{"x": object()}]]]})
    with pytest.raises(TypeError):
        json_text({"a": object()})
    assert json_text({"a": [[[{"x": 1}]]]}) == reference_json_text({"a": [[[{"x": 1}]]]})  # usable after an error
