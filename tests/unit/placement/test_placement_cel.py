"""The scorer evaluates the CEL selectors it recognises (claim requests and foreign DeviceClasses),
and says which ones it ignores."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from testkit.views import claim, gpus, hold, node_slices, pod, state

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.fleet.cel import qualified_capacity, recognise
from topodra.fleet.demand import parse_demand
from topodra.fleet.fgd import DEFAULT_PRIOR, make_mix
from topodra.fleet.state import class_matcher
from topodra.placement.score import Scorer
from topodra.selectors import DeviceMatch

A = f'device.attributes["{DRIVER}"]'
C = f'device.capacity["{DRIVER}"]'


def h100_gpu() -> dict[str, Any]:
    dev: dict[str, Any] = node_slices("n", "dgx-h100")[0]["spec"]["devices"][0]
    return dev


def check(expr: str, dev: dict[str, Any] | None = None) -> bool:
    sel = recognise(expr)
    assert sel is not None, expr
    dev = dev or h100_gpu()
    from topodra.fleet.state import qualified_attributes
    return sel.matches(DRIVER, qualified_attributes(dev, DRIVER), qualified_capacity(dev, DRIVER))


@pytest.mark.parametrize("expr,want", [
    (f'{A}.model == "H100-SXM5-80GB"', True),
    (f'{A}.model != "H100-SXM5-80GB"', False),
    (f'{A}["model"] == "H100-SXM5-80GB"', True),
    (f'{A}.model in ["A100-SXM4-80GB", "H100-SXM5-80GB"]', True),
    (f'{A}.model in ["A100-SXM4-80GB"]', False),
    (f'{A}.nvlinkDomainSize >= 8 && {A}.migCapable == true', True),
    (f'{A}.nvlinkDomainSize > 8', False),
    (f'{C}.memory.compareTo(quantity("80Gi")) >= 0', False),  # 81559Mi < 80Gi (81920Mi)
    (f'{C}.memory.compareTo(quantity("79Gi")) >= 0', True),
    (f'{A}.cudaComputeCapability.compareTo(semver("9.0.0")) >= 0', True),
    (f'{A}.cudaComputeCapability.compareTo(semver("10.0.0")) >= 0', False),
    (f'has({A}.rail) && ({A}.rail == 0)', True),
    (f'has({A}.nosuch)', False),
    (f'{A}.nosuch == "x"', False),  # absent: the scheduler's runtime error is "no match"
    (f'{A}.model == 3', False),
    (f'{A}.model != 3', True),
    (f'device.driver == "{DRIVER}"', True),
    ('device.driver == "other.example.com"', False),
])
def test_recognised_selectors_evaluate_like_cel(expr: str, want: bool) -> None:
    assert check(expr) is want


@pytest.mark.parametrize("expr", [
    f'{A}.model == "a" || {A}.model == "b"',
    f'!({A}.migCapable)',
    f'{A}.model.startsWith("H100")',
    f'{A}.rail == 0 ? true : false',
    f'{A}.model > "A"',  # ordering on strings: not in the subset
    f'{C}.memory.compareTo(semver("1.0.0")) >= 0',
    'true',
    '',
])
def test_anything_else_is_not_recognised(expr: str) -> None:
    assert recognise(expr) is None


def test_device_match_cel_round_trips_through_the_recogniser() -> None:
    dev = h100_gpu()
    for m in (DeviceMatch(type="gpu"), DeviceMatch(type="gpu", models=("H100-SXM5-80GB",)),
              DeviceMatch(type="gpu", minMemory="40Gi", minComputeCapability="8.0.0"),
              DeviceMatch(type="gpu", minMemory="100Gi"), DeviceMatch(type="nic")):
        assert check(m.to_cel(DRIVER), dev) is m.matches(dev, DRIVER), m


def test_capacity_is_read_as_quantities() -> None:
    assert qualified_capacity(h100_gpu(), DRIVER) == {f"{DRIVER}/memory": Decimal(81559 * 2**20)}


def _with_selector(spec: dict[str, Any], expr: str) -> dict[str, Any]:
    spec["devices"]["requests"][0]["exactly"]["selectors"] = [{"cel": {"expression": expr}}]
    return spec


def test_claim_selectors_are_parsed_and_unknown_ones_counted() -> None:
    d = parse_demand(_with_selector(gpus(1), f'{A}.rail == 3'))
    alt = d.requests[0].alternatives[0]
    assert len(alt.selectors) == 1 and alt.ignored_selectors == 0 and d.has_selectors
    d2 = parse_demand(_with_selector(gpus(1), f'{A}.model.startsWith("H")'))
    assert d2.requests[0].alternatives[0].selectors == () and d2.requests[0].alternatives[0].ignored_selectors == 1
    assert d.without_selectors() == parse_demand(gpus(1))


def test_claim_selector_steers_the_prediction_per_node_not_per_shape() -> None:
    # Two identical DGX-H100 nodes share a shape; one has GPU rail 0 used. A claim for a GPU on
    # rail 0 only fits the other -- even though memoised results are shared per shape.
    st = state({"a": "dgx-h100", "b": "dgx-h100"})
    hold(st, "a", ["gpu-0"])
    va, vb = st.node_view("a"), st.node_view("b")
    assert va is not None and vb is not None and va.shape == vb.shape
    mix = make_mix(DEFAULT_PRIOR, 20, {}, DRIVER)
    rail0 = parse_demand(_with_selector(gpus(1), f'{A}.rail == 0'))
    cands = [("a", va, st.unavailable_indices(va)), ("b", vb, st.unavailable_indices(vb))]
    got = dict(Scorer().score(cands, [rail0], mix))
    assert got == {"a": 0, "b": 10}
    # Without the selector the started node packs better.
    plain = parse_demand(gpus(1))
    got = dict(Scorer().score(cands, [plain], mix))
    assert got == {"a": 10, "b": 1}
    # A selector on a per-node value (the NVLink domain names the node) on two free nodes: same
    # shape, same devices in use -- only the selector mask keeps the memo from sharing the result.
    free = state({"a": "dgx-h100", "b": "dgx-h100"})
    fa, fb = free.node_view("a"), free.node_view("b")
    assert fa is not None and fb is not None and fa.shape == fb.shape
    dom_b = fb.devices[0].attrs[f"{DRIVER}/nvlinkDomain"]
    pin = parse_demand(_with_selector(gpus(1), f'{A}.nvlinkDomain == "{dom_b}"'))
    got = dict(Scorer().score([("a", fa, frozenset()), ("b", fb, frozenset())], [pin], mix))
    assert got == {"a": 0, "b": 10}


def test_foreign_device_class_with_recognised_cel_is_evaluated() -> None:
    foreign = {"metadata": {"name": "h100-by-cel"}, "spec": {"selectors": [
        {"cel": {"expression": f'device.driver == "{DRIVER}" && {A}.model == "H100-SXM5-80GB"'}}]}}
    opaque = {"metadata": {"name": "opaque"}, "spec": {"selectors": [
        {"cel": {"expression": f'{A}.model.startsWith("H100")'}}]}}
    m = class_matcher(foreign)
    assert m is not None and m.matches(h100_gpu(), DRIVER)
    assert class_matcher(opaque) is None
    st = state({"h100": "dgx-h100", "a100": "dgx-a100-80gb"})
    st.set_class(foreign)
    st.set_class(opaque)
    st.set_claim(claim("want", gpus(2, "h100-by-cel")))
    demands = st.pod_demands(pod([{"name": "g", "resourceClaimName": "want"}]))
    cands = [(n, st.node_view(n), frozenset[int]()) for n in ("h100", "a100")]
    got = dict(Scorer().score(cands, demands, make_mix(DEFAULT_PRIOR, 20, {}, DRIVER)))
    assert got == {"h100": 10, "a100": 0}
    st.set_claim(claim("opaque", gpus(1, "opaque")))
    demands = st.pod_demands(pod([{"name": "g", "resourceClaimName": "opaque"}]))
    assert dict(Scorer().score(cands, demands, make_mix(DEFAULT_PRIOR, 20, {}, DRIVER))) == {"h100": 0, "a100": 0}
