"""Fabric tiers as node labels (``topodra.fabric``): Topograph's labels first, then --hardware-config, then the
simulated cluster file; foreign keys are read, never written or removed.

Split by tier; the rest: tests/cluster/test_fabric_labels_cluster.py, tests/unit/slices/test_fabric_cluster_files.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from testkit.nodes import devices, node

from topodra.fabric import TOPOGRAPH_NVLINK_DOMAIN, TOPOGRAPH_V05, TOPOGRAPH_V1, fabric_labels
from topodra.nodelabels import (
    GPU_COUNT,
    GPU_MODEL,
    LEAF_GROUP,
    MANAGED,
    NVLINK_CLIQUE,
    PREFIX,
    RAIL_GROUP,
    SCALABLE_UNIT,
    SPINE_GROUP,
    label_patch,
)
from topodra.plugin import config as plugin_config
from topodra.plugin.config import ConfigError
from topodra.plugin.nodelabel import node_patch, wanted_labels
from topodra.simulate import with_fabric

V1 = {"fabric.topograph.run/tier-0": "leaf-a7", "fabric.topograph.run/tier-1": "spine-3",
      "fabric.topograph.run/tier-2": "core-1"}
V05 = {"network.topology.nvidia.com/leaf": "old-leaf", "network.topology.nvidia.com/spine": "old-spine",
       "network.topology.nvidia.com/core": "old-core"}
CONFIG = {LEAF_GROUP: "cfg-leaf", SCALABLE_UNIT: "cfg-su", SPINE_GROUP: "cfg-sg"}
FILE = {LEAF_GROUP: "file-leaf", SCALABLE_UNIT: "file-su", SPINE_GROUP: "file-sg"}


def test_topograph_v1_tiers_map_finest_first_and_win_over_every_other_source() -> None:
    f = fabric_labels(V1, hardware_config=CONFIG, cluster_file=FILE)
    assert f.labels == {LEAF_GROUP: "leaf-a7", SCALABLE_UNIT: "spine-3", SPINE_GROUP: "core-1"}
    assert f.sources == {LEAF_GROUP: "fabric.topograph.run/tier-0", SCALABLE_UNIT: "fabric.topograph.run/tier-1",
                         SPINE_GROUP: "fabric.topograph.run/tier-2"}


def test_topograph_v05_keys_are_read_and_v1_wins_when_both_are_left_on_a_node() -> None:
    assert fabric_labels(V05).labels == {LEAF_GROUP: "old-leaf", SCALABLE_UNIT: "old-spine", SPINE_GROUP: "old-core"}
    # An upgrade to v1.0 writes tier-N and may leave the old keys behind: the new ones count.
    mixed = fabric_labels({**V05, "fabric.topograph.run/tier-0": "new-leaf"})
    assert mixed.labels == {LEAF_GROUP: "new-leaf", SCALABLE_UNIT: "old-spine", SPINE_GROUP: "old-core"}
    assert mixed.sources[SCALABLE_UNIT] == "network.topology.nvidia.com/spine"
    assert set(TOPOGRAPH_V1) == set(TOPOGRAPH_V05) == {LEAF_GROUP, SCALABLE_UNIT, SPINE_GROUP}


def test_precedence_is_per_key() -> None:
    # Topograph found only two tiers (it writes only the tiers it discovered): the third comes from the config.
    f = fabric_labels({"fabric.topograph.run/tier-0": "l1", "fabric.topograph.run/tier-1": "s1"},
                      hardware_config={SPINE_GROUP: "cfg sg"}, cluster_file=FILE)
    assert f.labels == {LEAF_GROUP: "l1", SCALABLE_UNIT: "s1", SPINE_GROUP: "cfg-sg"}
    assert f.sources[SPINE_GROUP] == "hardware-config"
    g = fabric_labels({}, hardware_config={LEAF_GROUP: "x"}, cluster_file=FILE)
    assert g.labels == {LEAF_GROUP: "x", SCALABLE_UNIT: "file-su", SPINE_GROUP: "file-sg"}
    assert g.sources == {LEAF_GROUP: "hardware-config", SCALABLE_UNIT: "cluster-file", SPINE_GROUP: "cluster-file"}
    # An empty Topograph value names no switch: the next source counts.
    assert fabric_labels({"fabric.topograph.run/tier-1": ""}, cluster_file=FILE).labels[SCALABLE_UNIT] == "file-su"


def test_ownership_config_owns_every_tier_topograph_only_its_own_and_nothing_else() -> None:
    assert fabric_labels({}, hardware_config={}).owned == {LEAF_GROUP, SCALABLE_UNIT, SPINE_GROUP}
    assert fabric_labels({"fabric.topograph.run/tier-1": "s"}).owned == {SCALABLE_UNIT}
    assert fabric_labels({}, cluster_file=FILE).owned == frozenset()


def test_the_plugin_mirrors_topograph_and_its_patch_never_holds_a_foreign_key() -> None:
    current = {**V1, **V05, "accelerator.topograph.run/domain": "nvl-9", "team": "a",
               GPU_COUNT: "8", GPU_MODEL: "H100-SXM5-80GB", SCALABLE_UNIT: "hand-set"}
    wanted = wanted_labels(devices(), {"scalable_unit": "cfg-su", "rail_group": "rg-1"}, current)
    patch = node_patch(node(current), wanted)
    assert patch == {"metadata": {"labels": {LEAF_GROUP: "leaf-a7", SCALABLE_UNIT: "spine-3",
                                             SPINE_GROUP: "core-1", RAIL_GROUP: "rg-1"}}}
    assert all(k.startswith(PREFIX) for k in patch["metadata"]["labels"])
    # Topograph moved the node to another leaf: the next sync follows it and still only writes our key.
    moved = {**current, **patch["metadata"]["labels"], "fabric.topograph.run/tier-0": "leaf-b2"}
    again = node_patch(node(moved), wanted_labels(devices(), {"scalable_unit": "cfg-su", "rail_group": "rg-1"}, moved))
    assert again == {"metadata": {"labels": {LEAF_GROUP: "leaf-b2"}}}
    # The wanted labels never hold a foreign key, and label_patch refuses one outright.
    assert set(wanted.labels) <= set(MANAGED)
    with pytest.raises(ValueError, match="not a topodra node label"):
        label_patch(current, {"fabric.topograph.run/tier-0": "x"}, MANAGED)


def test_a_removed_topograph_tier_falls_back_to_the_config_or_is_left_when_there_is_none() -> None:
    mirrored = {"fabric.topograph.run/tier-0": "leaf-a7", LEAF_GROUP: "leaf-a7", GPU_COUNT: "8",
                GPU_MODEL: "H100-SXM5-80GB"}
    gone = {k: v for k, v in mirrored.items() if k != "fabric.topograph.run/tier-0"}
    assert node_patch(node(gone), wanted_labels(devices(), {"leaf_group": "cfg-leaf"}, gone)) == {
        "metadata": {"labels": {LEAF_GROUP: "cfg-leaf"}}}
    assert node_patch(node(gone), wanted_labels(devices(), {}, gone)) == {"metadata": {"labels": {LEAF_GROUP: None}}}
    # Without a --hardware-config the plugin cannot tell its old mirror from a label set by hand: it stays.
    assert node_patch(node(gone), wanted_labels(devices(), None, gone)) is None
    # While Topograph gives it, the tier is owned even without a config file.
    stale = {**mirrored, LEAF_GROUP: "leaf-old"}
    assert node_patch(node(stale), wanted_labels(devices(), None, stale)) == {
        "metadata": {"labels": {LEAF_GROUP: "leaf-a7"}}}


def test_topograph_nvlink_domain_is_not_mirrored_into_the_discovered_clique() -> None:
    labels = {TOPOGRAPH_NVLINK_DOMAIN[0]: "nmx-1234", TOPOGRAPH_NVLINK_DOMAIN[1]: "old-acc"}
    hgx = wanted_labels(devices(), None, labels).labels
    assert NVLINK_CLIQUE not in hgx  # NVLink inside the node: no clique, whatever Topograph says
    tray = wanted_labels(devices("gb200-nvl72"), None, labels).labels
    assert tray[NVLINK_CLIQUE] != "nmx-1234" and "." in tray[NVLINK_CLIQUE]  # <clusterUUID>.<cliqueId>


def cfg_with(tmp_path: Path, text: str) -> plugin_config.PluginConfig:
    (tmp_path / "hw.yaml").write_text(text)
    return plugin_config.from_args(argparse.Namespace(), {"NODE_NAME": "n",
                                                         "TOPODRA_HARDWARE_CONFIG": str(tmp_path / "hw.yaml")})


def test_hardware_config_gives_all_three_tiers_and_rail_group(tmp_path: Path) -> None:
    cfg = cfg_with(tmp_path, "leafGroup: su1-leaf2\nscalableUnit: su1\nspineGroup: sg 1\nrailGroup: rg-a\n"
                             "rails: {mlx5_0: 0}\n")
    topo = cfg.topology_labels()
    assert topo == {"leaf_group": "su1-leaf2", "scalable_unit": "su1", "spine_group": "sg 1", "rail_group": "rg-a"}
    assert cfg.hardware_overrides() == {"rails": {"mlx5_0": 0}}  # tiers are labels, not discovery overrides
    assert wanted_labels(devices(), topo).labels[SPINE_GROUP] == "sg-1"


@pytest.mark.parametrize(("text", "message"), [
    ("leafGroup: '///'\n", r"leafGroup: cannot make a label value of '///'"),
    ("spineGroup: [a, b]\n", r"spineGroup must be a non-empty string"),
    ("scalableUnit: ''\n", r"scalableUnit must be a non-empty string"),
    ("spineGroup: true\n", r"spineGroup must be a non-empty string"),
])
def test_a_bad_hardware_config_tier_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        cfg_with(tmp_path, text).topology_labels()
    assert str(tmp_path / "hw.yaml") in str(e.value)


def test_a_bad_configured_name_names_its_source_and_key() -> None:
    with pytest.raises(ValueError, match=r"hardware-config topodra.io/leaf-group: cannot make a label value"):
        fabric_labels({}, hardware_config={LEAF_GROUP: "///"})
    with pytest.raises(ValueError, match=r"cluster-file topodra.io/spine-group"):
        fabric_labels({}, cluster_file={SPINE_GROUP: "..."})
    # Topograph already gives the key: the bad fallback is never consulted.
    assert fabric_labels(V1, hardware_config={LEAF_GROUP: "///"}).labels[LEAF_GROUP] == "leaf-a7"


def test_simulate_takes_topograph_from_the_node_and_otherwise_the_file() -> None:
    file_labels = {"topodra.io/profile": "dgx-h100", SCALABLE_UNIT: "su1", LEAF_GROUP: "su1-leaf1"}
    assert with_fabric({}, file_labels) == file_labels
    on_node = {"fabric.topograph.run/tier-0": "ib-leaf-17", "team": "x"}
    got = with_fabric(on_node, file_labels)
    assert got == {**file_labels, LEAF_GROUP: "ib-leaf-17"}  # the unit stays the file's: Topograph gave none
    assert "fabric.topograph.run/tier-0" not in got and "team" not in got  # foreign keys are only read
    # A file may simulate a Topograph-labelled cluster: its own foreign labels are mirrored too.
    sim = with_fabric({}, {**file_labels, "network.topology.nvidia.com/spine": "sp-2"})
    assert sim[SCALABLE_UNIT] == "sp-2" and sim["network.topology.nvidia.com/spine"] == "sp-2"
