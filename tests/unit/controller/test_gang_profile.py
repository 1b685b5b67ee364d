"""Multi-node ClaimProfiles: validation, the whole-gang choice of alternative and level, the PodGroup."""

from __future__ import annotations

from typing import Any

import pytest

from topodra.classcatalog import catalog, to_device_class
from topodra.controller import gang
from topodra.controller.availability import make_snapshot
from topodra.controller.profile import ClaimProfile, ProfileError
from topodra.controller.render import render_template

D = "gpu.topodra.io"
CLASSES = [to_device_class(s) for s in catalog()]
H200 = ("H200-SXM5-141GB", "143771Mi")
H100 = ("H100-SXM5-80GB", "81559Mi")


def hgx(node: str, model: tuple[str, str] = H100, gpus: int = 8) -> dict[str, Any]:
    devs = [{"name": f"gpu-{i}",
             "attributes": {"type": {"string": "gpu"}, "model": {"string": model[0]},
                            "cudaComputeCapability": {"version": "9.0.0"}, "nvlinkDomain": {"string": node},
                            "rail": {"int": i}, "resource.kubernetes.io/numaNode": {"int": i // 4}},
             "capacity": {"memory": {"value": model[1]}}} for i in range(gpus)]
    devs += [{"name": f"nic-{i}", "attributes": {"type": {"string": "nic"}, "rail": {"int": i}}} for i in range(8)]
    return {"metadata": {"name": node}, "spec": {"driver": D, "nodeName": node,
                                                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                                                 "devices": devs}}


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {f"topodra.io/{k.replace('_', '-')}": v
                                                  for k, v in labels.items()}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def held(node_name: str, n: int = 8) -> dict[str, Any]:
    return {"status": {"allocation": {"devices": {"results": [
        {"request": "gpus", "driver": D, "pool": node_name, "device": f"gpu-{i}"} for i in range(n)]}}}}


def prof(spec: dict[str, Any]) -> ClaimProfile:
    return ClaimProfile.from_api({"metadata": {"name": "train", "namespace": "ns", "uid": "u1"}, "spec": spec})


GANG: dict[str, Any] = {
    "alternatives": [{"deviceClassName": "gpu-h200", "count": 8}, {"deviceClassName": "gpu-h100", "count": 8}],
    "topology": {"nvlink": "Required"}, "pods": 4, "acrossNodes": {"sameDomain": ["leafGroup", "scalableUnit"]}}


# --- validation ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "needle"), [
    ({**GANG, "pods": 1}, "spec.pods: Input should be greater than or equal to 2"),
    ({k: v for k, v in GANG.items() if k != "pods"}, "acrossNodes needs pods"),
    ({**GANG, "acrossNodes": {"sameDomain": []}}, "spec.acrossNodes.sameDomain: Tuple should have at least 1 item"),
    ({**GANG, "acrossNodes": {"sameDomain": ["rack"]}}, "'rack' is neither one of ['leafGroup'"),
    ({**GANG, "acrossNodes": {"sameDomain": ["leafGroup", "topodra.io/leaf-group"]}},
     "levels must be distinct, ['topodra.io/leaf-group'] repeat"),
    ({**GANG, "acrossNodes": {"sameDomain": ["leafGroup"], "preferred": True}}, "Extra inputs are not permitted"),
    ({**GANG, "queueing": "Kueue", "localQueue": "q"}, "cannot be combined with queueing Kueue"),
])
def test_bad_gang_specs_are_refused_with_the_field(spec: dict[str, Any], needle: str) -> None:
    with pytest.raises(ProfileError) as err:
        prof(spec)
    assert needle in str(err.value), str(err.value)


def test_foreign_label_keys_are_levels() -> None:
    p = prof({**GANG, "acrossNodes": {"sameDomain": ["fabric.topograph.run/tier-0", "scalableUnit"]}})
    assert p.spec.across_nodes is not None
    assert p.spec.across_nodes.keys == ("fabric.topograph.run/tier-0", "topodra.io/scalable-unit")


# --- the choice -----------------------------------------------------------------------------------------------

def fabric(free_h200: int = 4, h100_leaf: dict[str, int] | None = None,
           claims: list[dict[str, Any]] | None = None) -> Any:
    """H200 nodes in leaf l0 of su1; H100 nodes per leaf group (leaf -> count), leaves l1..l2 in su1, l3.. in su2."""
    slices, nodes = [], []
    for i in range(free_h200):
        slices.append(hgx(f"h200-{i}", H200))
        nodes.append(node(f"h200-{i}", leaf_group="l0", scalable_unit="su1"))
    for leaf, count in (h100_leaf or {}).items():
        su = "su1" if leaf in ("l1", "l2") else "su2"
        for i in range(count):
            slices.append(hgx(f"h100-{leaf}-{i}"))
            nodes.append(node(f"h100-{leaf}-{i}", leaf_group=leaf, scalable_unit=su))
    return make_snapshot(slices, claims or [], CLASSES, D, nodes)


def pick(spec: dict[str, Any], snap: Any) -> gang.Choice:
    return gang.choose(prof(spec), snap, driver=D, nic_class="nic.topodra.io")


def test_first_alternative_in_the_narrowest_level_that_holds_the_whole_job() -> None:
    c = pick(GANG, fabric(free_h200=4, h100_leaf={"l1": 4}))
    assert (c.alternative, c.level, c.key, c.fits, c.domains) == ("h200", "leafGroup", "topodra.io/leaf-group",
                                                                 True, 1)


def test_three_free_h200_nodes_send_the_whole_gang_to_h100() -> None:
    c = pick(GANG, fabric(free_h200=3, h100_leaf={"l1": 4}))
    assert (c.alternative, c.level, c.fits) == ("h100", "leafGroup", True)


def test_no_leaf_group_holds_it_so_one_scalable_unit() -> None:
    # 2 + 2 H100 nodes in two leaf groups of su1, 3 in su2: only su1 holds 4 pods.
    c = pick({**GANG, "alternatives": [GANG["alternatives"][1]]}, fabric(0, {"l1": 2, "l2": 2, "l3": 3}))
    assert (c.alternative, c.level, c.fits, c.domains) == ("h100", "scalableUnit", True, 1)
    assert "su1" in c.message and "preferred but too small now: h100 in one leafGroup: at most 3 of 4" in c.message


def test_allocated_devices_do_not_count() -> None:
    snap = fabric(0, {"l1": 4}, claims=[held("h100-l1-0", 1)])  # one GPU gone: that node no longer takes 8
    c = pick({**GANG, "alternatives": [GANG["alternatives"][1]]}, snap)
    assert (c.fits, c.alternative, c.level) == (False, "h100", "scalableUnit")
    assert "h100 in one leafGroup: at most 3 of 4" in c.message


def test_nothing_fits_renders_the_first_alternative_with_the_widest_level() -> None:
    c = pick(GANG, fabric(free_h200=2, h100_leaf={"l1": 1, "l3": 2}))
    assert (c.alternative, c.level, c.fits) == ("h200", "scalableUnit", False)
    assert "nothing holds the whole job now" in c.message and "re-evaluating" in c.message


def test_topology_first_prefers_the_leaf_group_over_the_type() -> None:
    snap = make_snapshot([hgx(f"h200-{i}", H200) for i in range(4)] + [hgx(f"h100-l1-{i}") for i in range(4)], [],
                         CLASSES, D, [node(f"h200-{i}", leaf_group=f"x{i}", scalable_unit="su1") for i in range(4)]
                         + [node(f"h100-l1-{i}", leaf_group="l1", scalable_unit="su1") for i in range(4)])
    alt_first = pick(GANG, snap)
    topo_first = pick({**GANG, "topology": {"nvlink": "Required", "order": "TopologyFirst"}}, snap)
    assert (alt_first.alternative, alt_first.level) == ("h200", "scalableUnit")
    assert (topo_first.alternative, topo_first.level) == ("h100", "leafGroup")


def test_nodes_without_the_label_are_in_no_domain() -> None:
    snap = make_snapshot([hgx(f"n{i}") for i in range(4)], [], CLASSES, D, [node(f"n{i}") for i in range(4)])
    c = pick({**GANG, "alternatives": [GANG["alternatives"][1]]}, snap)
    assert c.fits is False
    no_level = pick({k: v for k, v in GANG.items() if k != "acrossNodes"} | {"alternatives": [GANG["alternatives"][1]]},
                    snap)
    assert (no_level.fits, no_level.level, no_level.key) == (True, None, None)


def test_a_node_with_sixteen_gpus_takes_two_pods() -> None:
    spec = {**GANG, "alternatives": [GANG["alternatives"][1]], "topology": {}}
    snap = make_snapshot([hgx("big", gpus=16), hgx("small")], [], CLASSES, D,
                         [node("big", leaf_group="l1"), node("small", leaf_group="l1")])
    assert pick({**spec, "pods": 3}, snap).fits is True
    assert pick({**spec, "pods": 4}, snap).fits is False


def test_rail_aligned_pairs_each_nic_once() -> None:
    spec = {**GANG, "alternatives": [{"deviceClassName": "gpu-h100", "count": 4}],
            "topology": {"nic": "RailAligned"}, "pods": 2}
    snap = make_snapshot([hgx("n0")], [], CLASSES, D, [node("n0", leaf_group="l1")])
    assert pick(spec, snap).fits is True  # 8 GPUs, 8 NICs on 8 rails: two 4-GPU claims
    assert pick({**spec, "pods": 3}, snap).fits is False


# --- rendering -------------------------------------------------------------------------------------------------

def test_template_asks_every_pod_for_the_chosen_type_only() -> None:
    p = gang.restricted(prof(GANG), "h100")
    req = render_template(p)["spec"]["spec"]["devices"]["requests"]
    assert req == [{"name": "gpus", "exactly": {"deviceClassName": "gpu-h100", "allocationMode": "ExactCount",
                                                "count": 8}}]
    with pytest.raises(ValueError, match="no alternative 'a100'"):
        gang.restricted(prof(GANG), "a100")


def test_podgroup_has_min_count_and_one_key() -> None:
    p = prof(GANG)
    pg = gang.render_podgroup(p, gang.Choice("h100", "scalableUnit", True))
    assert pg["apiVersion"] == "scheduling.k8s.io/v1beta1" and pg["metadata"]["name"] == "train"
    assert pg["spec"] == {"schedulingPolicy": {"gang": {"minCount": 4}},
                          "schedulingConstraints": {"topology": [{"key": "topodra.io/scalable-unit"}]}}
    assert pg["metadata"]["ownerReferences"][0]["uid"] == "u1"
    assert gang.recorded_choice(pg, p) == gang.Choice("h100", "scalableUnit", None, fixed=True)
    plain = gang.render_podgroup(p, gang.Choice("h100", None, True))
    assert "schedulingConstraints" not in plain["spec"]
    assert gang.recorded_choice(plain, p) is None  # the profile has levels: an unconstrained group is not its own


def test_status_names_the_domain_the_bound_pods_got() -> None:
    snap = fabric(0, {"l1": 4})
    pods = [{"metadata": {"name": f"w{i}"}, "spec": {"schedulingGroup": {"podGroupName": "train"},
                                                     **({"nodeName": f"h100-l1-{i}"} if i < 3 else {})},
             "status": {"phase": "Pending"}} for i in range(4)]
    pods.append({"metadata": {"name": "other"}, "spec": {"schedulingGroup": {"podGroupName": "x"}}})
    mine = gang.members(pods, "train")
    st = gang.gang_status(prof(GANG), gang.Choice("h100", "leafGroup", True, 1), mine, snap, "")
    assert (st["alternative"], st["deviceClassName"], st["level"], st["topologyKey"]) == (
        "h100", "gpu-h100", "leafGroup", "topodra.io/leaf-group")
    assert (st["podsCreated"], st["podsBound"], st["domain"], st["fitsNow"]) == (4, 3, "l1", True)
