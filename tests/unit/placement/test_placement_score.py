"""The placement scorer's pure parts: claim parsing, allocator emulation, fragments, the FGD score.

Views are hand-built from the real discovery output of mock profiles (testkit.views);
no API server is involved.
"""

from __future__ import annotations

import pytest
import yaml
from testkit.paths import REPO
from testkit.views import claim, gpus, hold, pod, state

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.fleet.allocator import place
from topodra.fleet.demand import Demand, DemandError, parse_demand
from topodra.fleet.fgd import DEFAULT_PRIOR, Mix, make_mix, parse_prior, prior_demand, unusable
from topodra.fleet.state import ClusterState
from topodra.placement.score import Scorer

NVLINK = f"{DRIVER}/nvlinkDomain"


def example_spec(name: str) -> dict[str, object]:
    docs = list(yaml.safe_load_all((REPO / "deploy" / "examples" / f"{name}.yaml").read_text()))
    (tmpl,) = [d for d in docs if d["kind"] == "ResourceClaimTemplate"]
    spec: dict[str, object] = tmpl["spec"]["spec"]
    return spec


def only(demand_spec: dict[str, object]) -> Mix:
    """A mix of one request class."""
    return Mix(classes=((parse_demand(demand_spec), 1.0),))


def scores(st: ClusterState, spec: dict[str, object], nodes: list[str], mix: Mix | None = None) -> dict[str, int]:
    mix = mix or make_mix(DEFAULT_PRIOR, 20, {}, DRIVER)
    cands = []
    for n in nodes:
        v = st.node_view(n)
        cands.append((n, v, st.unavailable_indices(v) if v else frozenset()))
    return dict(Scorer().score(cands, [parse_demand(spec)], mix))


# --- parsing -----------------------------------------------------------------------------------------

def test_example_templates_parse() -> None:
    d = parse_demand(example_spec("gpu-8-nvlink"))
    assert [(a.device_class, a.count) for r in d.requests for a in r.alternatives] == [("gpu.topodra.io", 8)]
    assert [c.attribute for c in d.constraints] == [NVLINK]
    fa = parse_demand(example_spec("gpu-first-available"))
    assert len(fa.requests[0].alternatives) > 1
    assert all(a.name.startswith(fa.requests[0].name + "/") for a in fa.requests[0].alternatives)


@pytest.mark.parametrize("spec", [
    {}, {"devices": {"requests": []}},
    {"devices": {"requests": [{"name": "x"}]}},
    {"devices": {"requests": [{"name": "x", "exactly": {"count": 1}}]}},
    {"devices": {"requests": [{"name": "x", "exactly": {"deviceClassName": "c", "count": 0}}]}},
    {"devices": {"requests": [{"name": "x", "exactly": {"deviceClassName": "c", "allocationMode": "Some"}}]}},
])
def test_unreadable_claims_are_errors(spec: dict[str, object]) -> None:
    with pytest.raises(DemandError):
        parse_demand(spec)


def test_prior_parsing() -> None:
    assert parse_prior("1:3,8:1") == {1: 0.75, 8: 0.25}
    for bad in ("", "1", "0:1", "1:-1", "1:1,1:2", "a:b", "1:0"):
        with pytest.raises(ValueError):
            parse_prior(bad)


# --- allocator emulation ----------------------------------------------------------------------------

def test_place_is_first_fit_in_slice_order() -> None:
    st = state({"a": "dgx-h100"})
    hold(st, "a", ["gpu-0", "gpu-3"])
    v = st.node_view("a")
    assert v is not None
    used = st.unavailable_indices(v)
    after = place(v, used, [parse_demand(gpus(2))])
    assert after is not None
    assert sorted(v.devices[i].key[1] for i in after - used) == ["gpu-1", "gpu-2"]
    assert place(v, used, [parse_demand(gpus(8, nvlink=True))]) is None


def test_place_keeps_nvlink_pairs_like_the_allocator() -> None:
    # H100 NVL: four bridged pairs. With gpu-0 held, a 2-GPU NVLink claim must skip gpu-1.
    st = state({"n": "h100-nvl"})
    hold(st, "n", ["gpu-0"])
    v = st.node_view("n")
    assert v is not None
    used = st.unavailable_indices(v)
    after = place(v, used, [parse_demand(gpus(2, nvlink=True))])
    assert after is not None
    took = [v.devices[i] for i in sorted(after - used)]
    assert len({d.attrs[NVLINK] for d in took}) == 1
    assert "gpu-1" not in {d.key[1] for d in took}


def test_place_respects_device_class_and_first_available() -> None:
    st = state({"h200": "dgx-h200", "h100": "dgx-h100"})
    fa = {"devices": {"requests": [{"name": "gpus", "firstAvailable": [
        {"name": "h200", "deviceClassName": "gpu-h200", "count": 8},
        {"name": "h100", "deviceClassName": "gpu-h100", "count": 8}]}],
        "constraints": [{"requests": ["gpus"], "matchAttribute": NVLINK}]}}
    hold(st, "h200", ["gpu-7"])
    for node, model in (("h200", None), ("h100", "H100-SXM5-80GB")):
        v = st.node_view(node)
        assert v is not None
        after = place(v, st.unavailable_indices(v), [parse_demand(fa)])
        if model is None:
            assert after is None  # 7 H200 free, the H100 alternative has no H100 here
        else:
            assert after is not None and {v.devices[i].attrs[f"{DRIVER}/model"] for i in after} == {model}
    v = st.node_view("h100")
    assert v is not None and place(v, frozenset(), [parse_demand(gpus(1, "gpu-a100-80gb"))]) is None


def test_rail_aligned_gpu_and_nic_pairs() -> None:
    st = state({"a": "dgx-h100"})
    v = st.node_view("a")
    assert v is not None
    after = place(v, frozenset(), [parse_demand(example_spec("gpu-1-rail-nic"))])
    assert after is not None
    devs = [v.devices[i] for i in after]
    assert sorted(d.attrs[f"{DRIVER}/type"] for d in devs) == ["gpu", "nic"]
    assert len({d.attrs[f"{DRIVER}/rail"] for d in devs}) == 1


# --- fragments ----------------------------------------------------------------------------------------

def test_half_used_domain_is_fragmented_for_8_but_a_free_server_is_not() -> None:
    st = state({"half": "dgx-h100", "free": "dgx-h100", "a100": "dgx-a100-80gb"})
    hold(st, "half", [f"gpu-{i}" for i in range(4)])
    eight = parse_demand(gpus(8, nvlink=True))
    h100_only = parse_demand(gpus(1, "gpu-h100"))

    def frag(node: str, demand: Demand) -> int:
        v = st.node_view(node)
        assert v is not None
        return unusable(v, st.unavailable_indices(v), demand)

    assert frag("half", eight) == 4
    assert frag("free", eight) == 0
    assert frag("half", prior_demand(4, DRIVER)) == 0
    assert frag("a100", h100_only) == 8  # wrong model: every free GPU is a fragment
    assert frag("a100", prior_demand(2, DRIVER)) == 0


def test_unusable_counts_leftovers_after_repeated_packing() -> None:
    st = state({"a": "dgx-h100"})
    hold(st, "a", ["gpu-0"])
    v = st.node_view("a")
    assert v is not None
    used = st.unavailable_indices(v)
    assert [unusable(v, used, prior_demand(k, DRIVER)) for k in (1, 2, 4, 8)] == [0, 1, 3, 7]


# --- scoring ------------------------------------------------------------------------------------------

def test_packs_small_jobs_onto_the_started_server() -> None:
    st = state({"a": "dgx-h100", "b": "dgx-h100", "c": "dgx-h100"})
    hold(st, "a", ["gpu-0"])
    got = scores(st, gpus(1), ["a", "b", "c"])
    assert got == {"a": 10, "b": 1, "c": 1}


def test_prefers_filling_a_partial_domain_over_breaking_a_whole_server() -> None:
    st = state({"half": "dgx-h100", "free": "dgx-h100"})
    hold(st, "half", [f"gpu-{i}" for i in range(4)])
    assert scores(st, gpus(4, nvlink=True), ["free", "half"]) == {"free": 1, "half": 10}


def test_keeps_a_4_slot_rather_than_splitting_it() -> None:
    # a: 7 free (1 used), b: 4 free. One more GPU on b would break its only 4-GPU slot;
    # on a it leaves 6 = 4 + 2. Both cost the 8-class the same.
    st = state({"a": "dgx-h100", "b": "dgx-h100"})
    hold(st, "a", ["gpu-0"])
    hold(st, "b", [f"gpu-{i}" for i in range(4)])
    assert scores(st, gpus(1), ["a", "b"]) == {"a": 10, "b": 1}


def test_mix_decides_between_nodes() -> None:
    # Pod: 2 GPUs. x has 4 free, y has 6 free (one 8-GPU domain each).
    # Only 4-GPU jobs expected: x would drop from one 4-slot to none, y keeps one -> y.
    # Only 2-GPU jobs expected: no fragments either way; best fit tie-break -> x.
    st = state({"x": "dgx-h100", "y": "dgx-h100"})
    hold(st, "x", [f"gpu-{i}" for i in range(4)])
    hold(st, "y", ["gpu-0", "gpu-1"])
    assert scores(st, gpus(2, nvlink=True), ["x", "y"], only(gpus(4, nvlink=True))) == {"x": 1, "y": 10}
    assert scores(st, gpus(2, nvlink=True), ["x", "y"], only(gpus(2, nvlink=True))) == {"x": 10, "y": 1}


def test_nodes_that_cannot_fit_or_are_unknown_get_zero_never_a_veto() -> None:
    st = state({"h100": "dgx-h100", "a100": "dgx-a100-80gb", "l4": "l4"})
    got = scores(st, gpus(2, "gpu-h100", nvlink=True), ["a100", "h100", "l4", "ghost"])
    assert got == {"a100": 0, "h100": 10, "l4": 0, "ghost": 0}
    st2 = state({"a": "dgx-h100"})
    assert Scorer().score([("a", st2.node_view("a"), frozenset())], [], make_mix(DEFAULT_PRIOR, 20, {}, DRIVER)) \
        == [("a", 0)]  # a pod with no claims of ours: no opinion


def test_learned_mix_weights_claims_with_the_prior() -> None:
    st = state({"a": "dgx-h100"}, window=3)
    for i in range(5):
        st.set_claim(claim(f"c{i}", gpus(8, nvlink=True)))
    st.set_claim(claim("foreign", gpus(1, "someone-elses-class")))
    obs = st.observed_mix()
    assert sum(obs.values()) == 3  # the window keeps the newest three
    known = frozenset(k for k, m in st.classes.items() if m is not None)
    mix = dict(make_mix({1: 1.0}, 2, obs, DRIVER, known).classes)
    assert mix[parse_demand(gpus(8, nvlink=True))] == pytest.approx(2 / 4)
    assert mix[prior_demand(1, DRIVER)] == pytest.approx(2 / 4)
    assert parse_demand(gpus(1, "someone-elses-class")) not in mix


# --- the view -----------------------------------------------------------------------------------------

def test_claim_lifecycle_moves_devices_in_and_out_of_use() -> None:
    st = state({"a": "dgx-h100"})
    st.set_claim(claim("c", gpus(1)))
    assert st.used == {}
    st.set_claim(claim("c", gpus(1), allocated=[("a", "gpu-2")]))
    v = st.node_view("a")
    assert v is not None and [v.devices[i].key for i in st.unavailable_indices(v)] == [("a", "gpu-2")]
    st.delete_claim("ns", "c")
    assert st.unavailable_indices(v) == frozenset()
    assert sum(st.observed_mix().values()) == 1  # deleted claims stay in the learned history


def test_pod_claims_resolve_from_the_cache() -> None:
    st = state({"a": "dgx-h100"})
    st.set_template({"metadata": {"name": "t8", "namespace": "ns"}, "spec": {"spec": gpus(8, nvlink=True)}})
    st.set_claim(claim("named", gpus(2)))
    st.set_claim(claim("generated", gpus(4)))
    st.set_claim(claim("done", gpus(1), allocated=[("a", "gpu-0")]))
    sizes = [a.count for d in st.pod_demands(pod([
        {"name": "n", "resourceClaimName": "named"},
        {"name": "g", "resourceClaimTemplateName": "t8"},  # status names the generated claim
        {"name": "t", "resourceClaimTemplateName": "t8"},  # claim not seen yet: the template stands in
        {"name": "d", "resourceClaimName": "done"},  # already allocated: nothing left to place
        {"name": "m", "resourceClaimName": "missing"},
    ], statuses=[{"name": "g", "resourceClaimName": "generated"}])) for r in d.requests for a in r.alternatives]
    assert sizes == [2, 4, 8]


def test_newest_pool_generation_wins_and_shapes_are_shared() -> None:
    st = state({"a": "dgx-h100", "b": "dgx-h100", "c": "dgx-a100-80gb"})
    va, vb, vc = (st.node_view(n) for n in "abc")
    assert va and vb and vc and va.shape == vb.shape != vc.shape
    old = st.slices[next(iter(st._slices_by_node["a"]))]
    newer = {**old, "metadata": {"name": "a-gen2"},
             "spec": {**old["spec"], "pool": {**old["spec"]["pool"], "generation": 2},
                      "devices": old["spec"]["devices"][:2]}}
    st.set_slice(newer)
    va2 = st.node_view("a")
    assert va2 is not None and len(va2.devices) == 2


def test_closed_form_fragments_equal_the_search() -> None:
    """``unusable``'s closed form must agree with packing by the allocator emulation, state by state."""
    import random

    from topodra.fleet.fgd import unusable_by_search

    st = state({"h100": "dgx-h100", "nvl": "h100-nvl", "a100": "dgx-a100-80gb", "l40s": "l40s"})
    fa = {"devices": {"requests": [{"name": "gpus", "firstAvailable": [
        {"name": "h100", "deviceClassName": "gpu-h100", "count": 2},
        {"name": "any", "deviceClassName": "gpu.topodra.io", "count": 2}]}],
        "constraints": [{"requests": ["gpus"], "matchAttribute": NVLINK}]}}
    classes = [prior_demand(k, DRIVER) for k in (1, 2, 4, 8)] + [
        parse_demand(gpus(3)), parse_demand(gpus(2, "gpu-h100", nvlink=True)), parse_demand(fa),
        parse_demand(example_spec("gpu-4-numa"))]
    rng = random.Random(7)
    checked = 0
    for node in ("h100", "nvl", "a100", "l40s"):
        v = st.node_view(node)
        assert v is not None
        gpu_idx = [i for i, d in enumerate(v.devices) if d.gpu]
        for _ in range(25):
            used = frozenset(rng.sample(gpu_idx, rng.randint(0, len(gpu_idx))))
            for m in classes:
                assert unusable(v, used, m) == unusable_by_search(v, used, m), (node, sorted(used), m.label())
                checked += 1
    assert checked == 4 * 25 * len(classes)


def _h200_then_h100(count: int) -> dict[str, object]:
    return {"devices": {"requests": [{"name": "gpus", "firstAvailable": [
        {"name": "h200", "deviceClassName": "gpu-h200", "count": count},
        {"name": "h100", "deviceClassName": "gpu-h100", "count": count}]}],
        "constraints": [{"requests": ["gpus"], "matchAttribute": NVLINK}]}}


def test_first_choice_outranks_packing() -> None:
    # The H100 node has one GPU left: packing alone would fill it (2nd choice) rather than break
    # the whole free H200 server (1st choice). The claim's preference comes first.
    st = state({"h200": "dgx-h200", "h100": "dgx-h100"})
    hold(st, "h100", [f"gpu-{i}" for i in range(7)])
    assert scores(st, _h200_then_h100(1), ["h200", "h100"]) == {"h200": 10, "h100": 1}
    # Without the preference (any GPU) the same state packs onto the H100 node.
    assert scores(st, gpus(1), ["h200", "h100"]) == {"h200": 1, "h100": 10}


def test_fragmentation_ranks_nodes_within_the_best_available_choice() -> None:
    # H200 servers: one started (7 free), one free -> FGD packs onto the started one; the H100
    # node only offers the 2nd choice and stays below both.
    st = state({"h200a": "dgx-h200", "h200b": "dgx-h200", "h100": "dgx-h100"})
    hold(st, "h200a", ["gpu-0"])
    hold(st, "h100", [f"gpu-{i}" for i in range(7)])
    got = scores(st, _h200_then_h100(1), ["h200a", "h200b", "h100"])
    assert got["h200a"] == 10 and got["h100"] == 1 and 1 <= got["h200b"] < 10
    # No H200 free anywhere: the 2nd choice is the best there is, and FGD ranks its nodes.
    st2 = state({"h100a": "dgx-h100", "h100b": "dgx-h100", "a100": "dgx-a100-80gb"})
    hold(st2, "h100a", ["gpu-0"])
    assert scores(st2, _h200_then_h100(1), ["h100a", "h100b", "a100"]) == {"h100a": 10, "h100b": 1, "a100": 0}


def test_place_ranked_reports_the_alternative_taken() -> None:
    from topodra.fleet.allocator import place_ranked

    st = state({"h200": "dgx-h200", "h100": "dgx-h100"})
    d = parse_demand(_h200_then_h100(2))
    for node, rank in (("h200", (0,)), ("h100", (1,))):
        v = st.node_view(node)
        assert v is not None
        got = place_ranked(v, frozenset(), [d])
        assert got is not None and got[1] == rank
    v = st.node_view("h200")
    assert v is not None
    two = place_ranked(v, frozenset(), [d, parse_demand(gpus(1))])
    assert two is not None and two[1] == (0, 0) and len(two[0]) == 3


def test_mix_is_rebuilt_only_when_claims_arrive_or_are_forgotten() -> None:
    st = state({"a": "dgx-h100"})
    v0 = st.mix_version
    st.set_claim(claim("x", gpus(2, nvlink=True)))
    st.set_claim(claim("y", gpus(2, nvlink=True)))
    assert st.mix_version == v0 + 2
    mix = st.observed_mix()
    assert list(mix.values()) == [2]
    st.set_claim(claim("x", gpus(2, nvlink=True), allocated=[("a", "gpu-0"), ("a", "gpu-1")]))  # status update
    assert st.mix_version == v0 + 2 and st.observed_mix() == mix
    # equal specs share one Demand object (memo lookups hit by identity)
    dx, dy = st.claims[("ns", "x")].demand, st.claims[("ns", "y")].demand
    assert dx is dy and hash(dx) == hash(parse_demand(gpus(2, nvlink=True)))
    st.delete_claim("ns", "y", forget=True)
    assert st.mix_version == v0 + 3 and list(st.observed_mix().values()) == [1]
    st.delete_claim("ns", "x")  # deleted, not forgotten: stays in the history
    assert st.mix_version == v0 + 3 and list(st.observed_mix().values()) == [1]


def test_views_can_be_built_ahead_of_the_first_call() -> None:
    st = state({"a": "dgx-h100", "b": "dgx-a100-80gb"})
    st.replace("nodes", [{"metadata": {"name": n}} for n in ("a", "b", "no-slices")])
    assert st.sizes()["node_views"] == 0
    assert st.warm_views() == 2
    assert st.sizes()["node_views"] == 2
    v = st.node_view("a")
    assert v is not None and st.node_view("a") is v  # built once, reused
