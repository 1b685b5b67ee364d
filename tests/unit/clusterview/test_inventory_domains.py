"""``topodra inventory`` by fabric domain: which domain a node is in, the (domain, model) cells, the
``--domain`` / ``--node`` selection and its error. The expected numbers are worked out by hand from the
scenario below, never taken from the code under test."""

from __future__ import annotations

from typing import Any

import pytest
from testkit.views import claim, device_classes, gpus, node_slices

from topodra.clusterview import main as cvmain
from topodra.clusterview.domains import (
    GROUP_BY,
    UnknownName,
    domain_cells,
    domain_of,
    fabric_of,
    name_pool,
    select_nodes,
)
from topodra.clusterview.model import Largest, Sources, build_view
from topodra.simulate import fake_node, fake_node_status

Obj = dict[str, Any]
SU, LEAF, SPINE = "topodra.io/scalable-unit", "topodra.io/leaf-group", "topodra.io/spine-group"


def node(name: str, labels: dict[str, str], cordoned: bool = False) -> Obj:
    obj = {**fake_node(name, labels), **fake_node_status(name, cpu="224", memory="2Ti")}
    if cordoned:
        obj["spec"] = {"unschedulable": True}
    return obj


def hog(name: str, node_name: str, cpu: str) -> Obj:
    return {"metadata": {"name": name, "namespace": "batch"}, "status": {"phase": "Running"},
            "spec": {"nodeName": node_name, "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}]}}


def scenario() -> Sources:
    """Six DGX nodes (224 CPUs, 2 TiB, 8 GPUs each: a GPU's share is 28 CPUs).

    su1 / H100: h100-su1-0 (leaf su1-l0): 4 GPUs held, gpu-7 tainted NoSchedule -> 3 free;
                h100-su1-1 (leaf su1-l1): a pod holds 210 CPUs, so 14 are left: all 8 free GPUs stranded.
    su1 / A100: a100-su1-0 (no leaf group): cordoned, 8 free on an unschedulable node.
    spare-0, spare-1: no fabric labels (name pool ``spare``), H100, all free.
    tg-0: only Topograph's tier-1 label (su9) and a stale topodra one (su8): Topograph wins.
    """
    names = {"h100-su1-0": "dgx-h100", "h100-su1-1": "dgx-h100", "a100-su1-0": "dgx-a100-80gb",
             "spare-0": "dgx-h100", "spare-1": "dgx-h100", "tg-0": "dgx-h100"}
    slices = {n: node_slices(n, p) for n, p in names.items()}
    for d in slices["h100-su1-0"][0]["spec"]["devices"]:
        if d["name"] == "gpu-7":
            d["taints"] = [{"key": "topodra.io/xid", "value": "79", "effect": "NoSchedule"}]
    nodes = (node("h100-su1-0", {SU: "su1", LEAF: "su1-l0", SPINE: "sp0"}),
             node("h100-su1-1", {SU: "su1", LEAF: "su1-l1", SPINE: "sp0"}),
             node("a100-su1-0", {SU: "su1"}, cordoned=True),
             node("spare-0", {}), node("spare-1", {}),
             node("tg-0", {"fabric.topograph.run/tier-1": "su9", SU: "su8"}))
    held = claim("train", gpus(4), namespace="team-a",
                 allocated=[("h100-su1-0", f"gpu-{i}") for i in range(4)])
    return Sources(slices=tuple(s for v in slices.values() for s in v), claims=(held,), classes=device_classes(),
                   nodes=nodes, pods=(hog("hog", "h100-su1-1", "210"),))


def test_name_pool_drops_the_trailing_index() -> None:
    assert name_pool("a100-su1-12") == "a100-su1"
    assert name_pool("gb200-tray-3") == "gb200-tray"
    assert name_pool("node7") == "node"
    assert name_pool("worker") == "worker"
    assert name_pool("42") == "42"


def test_fabric_reads_topograph_before_topodra_keys() -> None:
    assert fabric_of({"fabric.topograph.run/tier-0": "l7", LEAF: "old", SU: "su2"}) == {LEAF: "l7", SU: "su2"}
    assert fabric_of({"network.topology.nvidia.com/spine": "s3"}) == {SU: "s3"}
    assert fabric_of({SU: "", "fabric.topograph.run/tier-2": ""}) == {}
    assert fabric_of(None) == {}


def test_domain_falls_back_to_other_tiers_then_the_name_pool() -> None:
    both = {LEAF: "su1-l0", SU: "su1", SPINE: "sp0"}
    assert domain_of("n-0", both) == "su1"
    assert domain_of("n-0", both, "leaf-group") == "su1-l0"
    assert domain_of("n-0", both, "spine-group") == "sp0"
    assert domain_of("n-0", both, "pool") == "n"
    assert domain_of("n-0", {SPINE: "sp0"}) == "sp0"  # no SU: the finest tier it has
    assert domain_of("n-0", {SU: "su1"}, "leaf-group") == "su1"
    assert domain_of("rack4-node-9", {}) == "rack4-node"


def test_cells_count_each_gpu_once_by_domain_and_model() -> None:
    cells = domain_cells(build_view(scenario()).nodes)
    got = [(c.domain, c.model, c.nodes, c.total, c.free, c.allocated, c.tainted, c.stranded, c.unschedulable,
            c.usable, c.largest) for c in cells]
    assert got == [
        ("spare", "H100-SXM5-80GB", 2, 16, 16, 0, 0, 0, 0, 16, Largest(8, 8, 8)),
        ("su1", "A100-SXM4-80GB", 1, 8, 8, 0, 0, 0, 8, 0, Largest(0, 0, 0)),
        # Stranded GPUs still count as placeable in "largest": that column counts devices (docs/inventory.md).
        ("su1", "H100-SXM5-80GB", 2, 16, 11, 4, 1, 8, 0, 3, Largest(8, 8, 8)),
        ("su9", "H100-SXM5-80GB", 1, 8, 8, 0, 0, 0, 0, 8, Largest(8, 8, 8)),
    ]
    assert sum(c.total for c in cells) == 48


def test_cells_by_leaf_group_fall_back_to_the_scalable_unit() -> None:
    cells = domain_cells(build_view(scenario()).nodes, "leaf-group")
    assert [(c.domain, c.model, c.total, c.free) for c in cells] == [
        ("spare", "H100-SXM5-80GB", 16, 16), ("su1", "A100-SXM4-80GB", 8, 8),
        ("su1-l0", "H100-SXM5-80GB", 8, 3), ("su1-l1", "H100-SXM5-80GB", 8, 8), ("su9", "H100-SXM5-80GB", 8, 8)]


def fabric_map() -> dict[str, dict[str, str]]:
    return {n.name: n.fabric for n in build_view(scenario()).nodes}


def test_select_by_any_tier_or_pool_and_by_node() -> None:
    f = fabric_map()
    assert select_nodes(f) is None
    assert select_nodes(f, domain="su1") == {"h100-su1-0", "h100-su1-1", "a100-su1-0"}
    assert select_nodes(f, domain="su1-l1") == {"h100-su1-1"}
    assert select_nodes(f, domain="sp0") == {"h100-su1-0", "h100-su1-1"}
    assert select_nodes(f, domain="spare") == {"spare-0", "spare-1"}
    assert select_nodes(f, domain="su9") == {"tg-0"}
    assert select_nodes(f, node="spare-1") == {"spare-1"}
    assert select_nodes(f, domain="su1", node="a100-su1-0") == {"a100-su1-0"}


def test_unknown_names_list_close_matches_or_what_exists() -> None:
    f = fabric_map()
    with pytest.raises(UnknownName, match=r"no fabric domain 'su01' with GPUs of ours; did you mean su1\b"):
        select_nodes(f, domain="su01")
    with pytest.raises(UnknownName, match=r"no fabric domain 'zzz' .*known: sp0, spare, su1, su1-l0, su1-l1, su9$"):
        select_nodes(f, domain="zzz")
    with pytest.raises(UnknownName, match=r"no node 'spare-7' .*did you mean spare-0, spare-1\?"):
        select_nodes(f, node="spare-7")
    with pytest.raises(UnknownName, match=r"no node 'spare-0' in fabric domain 'su9' with GPUs of ours; known: tg-0$"):
        select_nodes(f, domain="su9", node="spare-0")
    with pytest.raises(UnknownName, match="the cluster has none"):
        select_nodes({}, node="x")


def test_nodes_filter_of_a_domain_sums_only_its_nodes() -> None:
    src = scenario()
    view = build_view(src, nodes=select_nodes(fabric_map(), domain="su1"))
    assert [n.name for n in view.nodes] == ["a100-su1-0", "h100-su1-0", "h100-su1-1"]
    assert {m.model: (m.total, m.free) for m in view.models} == {"A100-SXM4-80GB": (8, 8),
                                                                  "H100-SXM5-80GB": (16, 11)}
    assert view.to_dict()["nodes"][1]["fabric"] == {LEAF: "su1-l0", SU: "su1", SPINE: "sp0"}


def test_cli_choices_match_the_module() -> None:
    assert tuple(GROUP_BY) == cvmain.GROUP_BY
    assert cvmain.DEFAULT_GROUP_BY == "scalable-unit"


@pytest.mark.parametrize(("nodes", "picture", "drill", "kind"), [
    (50, "auto", False, "nodes"), (64, "auto", False, "nodes"), (65, "auto", False, "domains"),
    (300, "auto", True, "nodes"), (3, "domains", False, "domains"), (300, "nodes", False, "nodes")])
def test_auto_picture_is_per_node_for_small_views_and_drill_downs(nodes: int, picture: str, drill: bool,
                                                                  kind: str) -> None:
    view = build_view(Sources())
    view = type(view)(driver=view.driver, nodes=tuple(build_view(scenario()).nodes[:1]) * nodes, models=(),
                      pending=(), pending_groups=())
    assert cvmain.picture_kind(view, picture, drill) == kind
