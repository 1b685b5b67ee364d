"""The fabric a SimulatedCluster file declares (``topodra.fabricfile``): per group or once per file, nested tiers,
clear errors; and the two fabric cluster files the scorer, the bench and the scale work reuse.

Split by tier; the rest: tests/unit/nodelabels/test_fabric_labels.py, tests/cluster/test_fabric_labels_cluster.py.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml
from testkit.paths import REPO

from topodra.nodelabels import LEAF_GROUP, SCALABLE_UNIT, SPINE_GROUP
from topodra.simulate import SimulatedCluster, load_cluster, plan

GPUS = {"dgx-a100-80gb": 8, "dgx-h100": 8, "dgx-h200": 8, "hgx-b200": 8}


def members(nodes: list[Any], key: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for n in nodes:
        if key in n.labels:
            out[n.labels[key]].append(n.name)
    return dict(out)


def test_enterprise_400_keeps_its_nodes_and_mix_and_gains_leaf_groups_inside_each_su() -> None:
    nodes = plan(load_cluster(REPO / "hack/clusters/enterprise-400.yaml"))
    assert len(nodes) == 50 and sum(GPUS[n.labels["topodra.io/profile"]] for n in nodes) == 400
    assert Counter(n.labels["topodra.io/profile"] for n in nodes) == {"dgx-a100-80gb": 16, "dgx-h100": 24,
                                                                      "dgx-h200": 10}
    # The node names other tests and benches use are unchanged.
    assert {"a100-su1-3", "h100-su1-0", "h100-su2-7", "h200-su2-9"} <= {n.name for n in nodes}
    assert Counter(n.labels[SCALABLE_UNIT] for n in nodes) == {"su1": 25, "su2": 25}
    leaves = members(nodes, LEAF_GROUP)
    assert {k: len(v) for k, v in leaves.items()} == {"su1-leaf1": 8, "su1-leaf2": 8, "su1-leaf3": 9,
                                                      "su2-leaf1": 8, "su2-leaf2": 7, "su2-leaf3": 10}
    assert leaves["su1-leaf2"] == [f"a100-su1-{i}" for i in range(8, 16)]
    assert leaves["su2-leaf2"] == [f"h100-su2-{i}" for i in range(8, 15)]
    assert all(n.labels[SCALABLE_UNIT] == n.labels[LEAF_GROUP].split("-")[0] for n in nodes)
    assert not members(nodes, SPINE_GROUP)  # one core: no spine-group tier on a small cluster


def test_superpod_4096_is_16_sus_of_32_nodes_in_4_spine_groups_with_mixed_models() -> None:
    nodes = plan(load_cluster(REPO / "hack/clusters/superpod-4096.yaml"))
    assert len(nodes) == 512 and sum(GPUS[n.labels["topodra.io/profile"]] for n in nodes) == 4096
    sus, leaves, spines = (members(nodes, k) for k in (SCALABLE_UNIT, LEAF_GROUP, SPINE_GROUP))
    assert len(sus) == 16 and {len(v) for v in sus.values()} == {32}
    assert len(leaves) == 64 and {len(v) for v in leaves.values()} == {8}
    assert len(spines) == 4 and {len(v) for v in spines.values()} == {128}
    by_name = {n.name: n for n in nodes}
    for su, names in sus.items():  # each SU one hardware generation, in one spine group
        assert len({by_name[m].labels["topodra.io/profile"] for m in names}) == 1, su
        assert len({by_name[m].labels[SPINE_GROUP] for m in names}) == 1, su
    assert Counter(n.labels["topodra.io/profile"] for n in nodes) == {"dgx-a100-80gb": 128, "dgx-h100": 192,
                                                                      "dgx-h200": 128, "hgx-b200": 64}
    assert by_name["sp-h100-0"].labels[SCALABLE_UNIT] == "su5" and by_name["sp-b200-63"].labels == {
        "topodra.io/profile": "hgx-b200", SCALABLE_UNIT: "su16", LEAF_GROUP: "su16-leaf4", SPINE_GROUP: "sg4"}


def test_old_files_without_a_fabric_stay_valid() -> None:
    for f in ("mixed-8.yaml", "nvl72-rack.yaml"):
        assert all(LEAF_GROUP not in n.labels for n in plan(load_cluster(REPO / "hack/clusters" / f)))
    old = SimulatedCluster.model_validate({"groups": [
        {"namePrefix": "a-", "count": 2, "profile": "l4", "labels": {SCALABLE_UNIT: "su1"}}]})
    assert [n.labels[SCALABLE_UNIT] for n in plan(old)] == ["su1", "su1"]


def test_group_fabric_numbers_leaf_groups_across_the_groups_of_one_unit() -> None:
    c = SimulatedCluster.model_validate({"groups": [
        {"namePrefix": "a-", "count": 5, "profile": "l4",
         "fabric": {"scalableUnit": "u", "leafGroupSize": 2, "spineGroup": "s"}},
        {"namePrefix": "b-", "count": 2, "profile": "l4",
         "fabric": {"scalableUnit": "u", "leafGroupSize": 4, "spineGroup": "s"}},
        {"namePrefix": "c-", "count": 1, "profile": "l4", "fabric": {"leafGroup": "lone"}}]})
    got = {n.name: (n.labels.get(LEAF_GROUP), n.labels.get(SCALABLE_UNIT), n.labels.get(SPINE_GROUP))
           for n in plan(c)}
    assert got == {"a-0": ("u-leaf1", "u", "s"), "a-1": ("u-leaf1", "u", "s"), "a-2": ("u-leaf2", "u", "s"),
                   "a-3": ("u-leaf2", "u", "s"), "a-4": ("u-leaf3", "u", "s"),
                   "b-0": ("u-leaf4", "u", "s"), "b-1": ("u-leaf4", "u", "s"), "c-0": ("lone", None, None)}


def test_file_fabric_without_units_numbers_leaf_groups_over_the_whole_file() -> None:
    c = SimulatedCluster.model_validate({"fabric": {"leafGroupSize": 3}, "groups": [
        {"namePrefix": "a-", "count": 2, "profile": "l4"}, {"namePrefix": "b-", "count": 2, "profile": "l4"}]})
    assert [n.labels[LEAF_GROUP] for n in plan(c)] == ["leaf1", "leaf1", "leaf1", "leaf2"]


L4 = {"namePrefix": "a-", "count": 4, "profile": "l4"}


@pytest.mark.parametrize(("bad", "message"), [
    ({"fabric": {"leafGroupSize": 8, "scalableUnitSize": 12}, "groups": [L4]},
     r"scalableUnitSize \(12\) must be a multiple of leafGroupSize \(8\)"),
    ({"fabric": {"scalableUnitSize": 32, "spineGroupSize": 48}, "groups": [L4]},
     r"spineGroupSize \(48\) must be a multiple of scalableUnitSize \(32\)"),
    ({"fabric": {}, "groups": [L4]}, "give at least one of leafGroupSize"),
    ({"fabric": {"leafGroupSize": 0}, "groups": [L4]}, "greater than or equal to 1"),
    ({"fabric": {"leafGroupSize": 2}, "groups": [{**L4, "fabric": {"scalableUnit": "u"}}]},
     "once for the file or per group, not both"),
    ({"groups": [{**L4, "fabric": {"leafGroupSize": 2}}]}, "leafGroupSize needs scalableUnit"),
    ({"groups": [{**L4, "fabric": {"scalableUnit": "u", "leafGroup": "l", "leafGroupSize": 2}}]},
     "leafGroup .* or leafGroupSize .*, not both"),
    ({"groups": [{**L4, "fabric": {}}]}, "fabric: empty"),
    ({"groups": [{**L4, "fabric": {"scalableUnit": "su 1"}}]}, "pattern"),
    ({"groups": [{**L4, "fabric": {"scalableUnit": "u", "leafGroups": 2}}]}, "Extra inputs are not permitted"),
    ({"groups": [{**L4, "labels": {SCALABLE_UNIT: "u"}, "fabric": {"scalableUnit": "u"}}]},
     r"group a-: \['topodra.io/scalable-unit'\] set both in labels and by fabric"),
    ({"groups": [{**L4, "fabric": {"scalableUnit": "u1", "leafGroup": "l"}},
                 {**L4, "namePrefix": "b-", "fabric": {"scalableUnit": "u2", "leafGroup": "l"}}]},
     r"do not nest: topodra.io/leaf-group=l spans topodra.io/scalable-unit \['u1', 'u2'\]"),
    ({"groups": [{**L4, "labels": {SCALABLE_UNIT: "u", SPINE_GROUP: "s1"}},
                 {**L4, "namePrefix": "b-", "labels": {SCALABLE_UNIT: "u", SPINE_GROUP: "s2"}}]},
     r"topodra.io/scalable-unit=u spans topodra.io/spine-group \['s1', 's2'\]"),
])
def test_bad_fabric_declarations_are_refused_clearly(tmp_path: Path, bad: dict[str, Any], message: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match=message) as e:
        load_cluster(f)
    assert f"invalid cluster file {f}" in str(e.value)
