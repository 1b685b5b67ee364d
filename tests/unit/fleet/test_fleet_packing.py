"""``fleet.packing``'s closed forms against the allocator emulation's search, on random states of real
profiles (``testkit.views``: discovery output of mock profiles, no API server).

A plan is built once per node and reused for every unavailable set, as the scorer reuses it for every
node of the same shape, so a plan that depended on anything but the shape would show here as a mismatch.
"""

from __future__ import annotations

import random

from testkit.views import gpus, state

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.fleet.allocator import place_ranked
from topodra.fleet.demand import Demand, parse_demand
from topodra.fleet.fgd import prior_demand, unusable_by_search
from topodra.fleet.packing import pack_plan, packed_unusable, place_plan, placed
from topodra.fleet.state import DeviceView, NodeView

NVLINK = f"{DRIVER}/nvlinkDomain"
PROFILES = {"h200": "dgx-h200", "h100": "dgx-h100", "nvl": "h100-nvl", "a100": "dgx-a100-80gb",
            "b200": "hgx-b200", "l40s": "l40s"}


def _fallback(count: int, nvlink: bool, models: tuple[str, ...] = ("h200", "h100", "a100-80gb")) -> Demand:
    spec: dict[str, object] = {"requests": [{"name": "gpus", "firstAvailable": [
        {"name": m, "deviceClassName": f"gpu-{m}", "count": count} for m in models]}]}
    if nvlink:
        spec["constraints"] = [{"requests": ["gpus"], "matchAttribute": NVLINK}]
    return parse_demand({"devices": spec})


def _common() -> list[Demand]:
    """Demands of the common shape: the prior's, exact counts with and without NVLink, fallback chains."""
    out = [prior_demand(k, DRIVER) for k in (1, 2, 3, 4, 8)]
    for k in (1, 2, 3, 4, 5, 8):
        out += [parse_demand(gpus(k)), parse_demand(gpus(k, nvlink=True)), parse_demand(gpus(k, "gpu-h100")),
                _fallback(k, nvlink=k > 1), _fallback(k, nvlink=False, models=("l40s", "h100", "h200"))]
    # A constraint naming the request (not empty: "every request") covers it too.
    out.append(parse_demand({"devices": {"requests": [{"name": "g", "exactly": {
        "deviceClassName": "gpu.topodra.io", "count": 2}}], "constraints": [
        {"requests": ["g"], "matchAttribute": NVLINK}]}}))
    return out


def _uncommon() -> list[Demand]:
    """Demands the closed forms leave to the search."""
    two = parse_demand({"devices": {"requests": [
        {"name": "a", "exactly": {"deviceClassName": "gpu.topodra.io", "count": 1}},
        {"name": "b", "exactly": {"deviceClassName": "gpu.topodra.io", "count": 1}}]}})
    every = parse_demand({"devices": {"requests": [
        {"name": "a", "exactly": {"deviceClassName": "gpu.topodra.io", "allocationMode": "All"}}]}})
    some = parse_demand({"devices": {"requests": [{"name": "g", "firstAvailable": [
        {"name": "h200", "deviceClassName": "gpu-h200", "count": 2},
        {"name": "any", "deviceClassName": "gpu.topodra.io", "count": 2}]}],
        "constraints": [{"requests": ["g/h200"], "matchAttribute": NVLINK}]}})
    return [two, every, some]


def _random_used(rng: random.Random, n: int) -> frozenset[int]:
    return frozenset(i for i in range(n) if rng.random() < rng.choice((0.0, 0.2, 0.5, 0.8)))


def test_plans_cover_exactly_the_common_shape() -> None:
    st = state({"h200": "dgx-h200"})
    v = st.node_view("h200")
    assert v is not None
    for d in _common():
        assert pack_plan(v, d) is not None and place_plan(v, (d,)) is not None, d.label()
    for d in _uncommon():
        assert pack_plan(v, d) is None and place_plan(v, (d,)) is None, d.label()
    d = _common()[0]
    assert place_plan(v, (d, d)) is None  # two claims: the search


def test_closed_forms_equal_the_search_on_random_states() -> None:
    st = state(PROFILES)
    rng = random.Random(22)
    demands = _common()
    checked = fits = 0
    for node in PROFILES:
        v = st.node_view(node)
        assert v is not None
        plans = [(d, pack_plan(v, d), place_plan(v, (d,))) for d in demands]
        for _ in range(40):
            used = _random_used(rng, len(v.devices))
            for d, pack, plc in plans:
                assert pack is not None and plc is not None
                assert packed_unusable(pack, used) == unusable_by_search(v, used, d), (node, sorted(used), d.label())
                want = place_ranked(v, used, (d,))
                assert placed(plc, used) == want, (node, sorted(used), d.label())
                checked += 1
                fits += want is not None
    assert checked == len(PROFILES) * 40 * len(demands)
    assert 0 < fits < checked  # both outcomes were compared


def test_fallback_rank_counts_alternatives_that_match_nothing() -> None:
    # On an H100 server the chain h200 -> h100 -> a100 lands on its second alternative: rank (1,).
    st = state({"h100": "dgx-h100"})
    v = st.node_view("h100")
    assert v is not None
    d = _fallback(2, nvlink=True)
    plan = place_plan(v, (d,))
    assert plan is not None
    got = placed(plan, frozenset())
    assert got is not None and got[1] == (1,) and got == place_ranked(v, frozenset(), (d,))


def _mixed_view(rng: random.Random) -> NodeView:
    """A made-up node: NVLink domains interleaved in slice order, devices without the attribute, two
    models; what real profiles (contiguous domains) never show."""
    devices = []
    for i in range(rng.randint(4, 12)):
        model = rng.choice(("h100", "h200"))
        attrs: dict[str, object] = {f"{DRIVER}/type": "gpu"}
        if rng.random() < 0.85:
            attrs[NVLINK] = rng.choice(("d0", "d1", "d2"))
        devices.append(DeviceView(key=("pool", f"dev-{i}"), gpu=True, attrs=attrs, driver=DRIVER,
                                  classes=frozenset({"gpu.topodra.io", f"gpu-{model}"})))
    return NodeView(name="mixed", devices=tuple(devices), shape=0)


def test_closed_forms_equal_the_search_on_interleaved_domains() -> None:
    rng = random.Random(5)
    demands = [d for d in _common() if all(a.device_class != "gpu-l40s" for r in d.requests
                                           for a in r.alternatives)]
    checked = 0
    for _ in range(60):
        v = _mixed_view(rng)
        for d in demands:
            pack, plc = pack_plan(v, d), place_plan(v, (d,))
            assert pack is not None and plc is not None
            for _ in range(5):
                used = _random_used(rng, len(v.devices))
                assert packed_unusable(pack, used) == unusable_by_search(v, used, d), (v, sorted(used), d.label())
                assert placed(plc, used) == place_ranked(v, used, (d,)), (v, sorted(used), d.label())
                checked += 1
    assert checked == 60 * 5 * len(demands)
