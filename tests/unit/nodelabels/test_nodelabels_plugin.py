"""The kubelet plugin labelling its own Node (``topodra.plugin.nodelabel``) and the admission policy that
keeps it to that Node and to ``topodra.io/`` labels.

Pure: what is wanted, the merge patch, the backoff, the admin's topology from --hardware-config.
Real apiserver: ``NodeLabeler`` retries while its Node is missing and labels it once it exists, follows a
device change, removes only its own stale labels; the chart's policy, with a real pod-bound token, lets the
plugin label its own node and denies another node, a foreign label and a Node spec change with clear messages.

Split by tier; the rest: tests/cluster/test_nodelabels_plugin_cluster.py, tests/node/test_nodelabels_plugin_node.py.
"""

from __future__ import annotations

import argparse
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from testkit.nodes import devices, node

from topodra.hardware import load_backend
from topodra.nodelabels import GPU_COUNT, GPU_MODEL, NVLINK_CLIQUE, RAIL_GROUP, SCALABLE_UNIT
from topodra.plugin import config as plugin_config
from topodra.plugin.config import ConfigError
from topodra.plugin.nodelabel import backoff, node_patch, wanted_labels

Obj = dict[str, Any]


# --------------------------------------------------------------------------- pure


def test_patch_sets_discovered_labels_and_leaves_others_alone() -> None:
    wanted = wanted_labels(devices(), None)
    assert wanted.labels == {GPU_COUNT: "8", GPU_MODEL: "H100-SXM5-80GB"}
    current = {"kubernetes.io/hostname": "n", "team": "a", GPU_COUNT: "7", NVLINK_CLIQUE: "u.1",
               SCALABLE_UNIT: "su1", "topodra.io/kubelet-plugin": "true"}
    patch = node_patch(node(current), wanted)
    # Count fixed, model added, stale clique removed; the hand-set unit, our plugin selector and others stay.
    assert patch == {"metadata": {"labels": {GPU_COUNT: "8", GPU_MODEL: "H100-SXM5-80GB", NVLINK_CLIQUE: None}}}
    assert node_patch(node({**wanted.labels, NVLINK_CLIQUE: "u.1"}), wanted) == {
        "metadata": {"labels": {NVLINK_CLIQUE: None}}}
    assert node_patch(node({"team": "a", **wanted.labels}), wanted) is None
    assert node_patch({"metadata": {"name": "n"}}, wanted) == {"metadata": {"labels": dict(wanted.labels)}}


def test_admin_topology_is_owned_only_when_configured() -> None:
    current = {GPU_COUNT: "8", GPU_MODEL: "H100-SXM5-80GB", SCALABLE_UNIT: "su1", RAIL_GROUP: "rg-a"}
    with_unit = wanted_labels(devices(), {"scalable_unit": "su 2"})
    assert node_patch(node(current), with_unit) == {"metadata": {"labels": {SCALABLE_UNIT: "su-2",
                                                                            RAIL_GROUP: None}}}
    # A config file without the keys: the plugin owns them and removes what it no longer configures.
    assert node_patch(node(current), wanted_labels(devices(), {})) == {
        "metadata": {"labels": {SCALABLE_UNIT: None, RAIL_GROUP: None}}}
    with pytest.raises(ValueError, match="label value"):
        wanted_labels(devices(), {"scalable_unit": "///"})


def test_a_gpu_lost_and_a_fabric_change_follow_discovery() -> None:
    assert wanted_labels(devices(hideGpus=[2]), None).labels[GPU_COUNT] == "7"
    tray = wanted_labels(devices("gb200-nvl72"), None).labels
    assert tray[GPU_MODEL] == "GB200" and tray[GPU_COUNT] == "4" and "." in tray[NVLINK_CLIQUE]
    moved = wanted_labels(devices("gb200-nvl72", cliqueId=9), None)
    assert node_patch(node(tray), moved) == {"metadata": {"labels": {NVLINK_CLIQUE: moved.labels[NVLINK_CLIQUE]}}}


def test_backoff_doubles_to_a_cap_with_bounded_jitter() -> None:
    assert [backoff(n, jitter=0) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert backoff(40, jitter=0) == 300.0
    assert all(0.8 * 4 <= backoff(3) <= 4 for _ in range(100))


def cfg_with(tmp_path: Path, text: str | None, **env: str) -> plugin_config.PluginConfig:
    if text is not None:
        (tmp_path / "hw.yaml").write_text(text)
        env["TOPODRA_HARDWARE_CONFIG"] = str(tmp_path / "hw.yaml")
    return plugin_config.from_args(argparse.Namespace(), {"NODE_NAME": "n", **env})


def test_topology_comes_from_the_hardware_config_and_is_not_a_discovery_override(tmp_path: Path) -> None:
    cfg = cfg_with(tmp_path, "scalableUnit: su1\nrailGroup: 3\nrails: {mlx5_0: 1}\n")
    assert cfg.topology_labels() == {"scalable_unit": "su1", "rail_group": "3"}
    assert cfg.hardware_overrides() == {"rails": {"mlx5_0": 1}}
    load_backend("mock:dgx-h100", "n", overrides=cfg.hardware_overrides())  # discovery accepts what is left
    assert cfg.node_labels is True
    assert cfg_with(tmp_path, None).topology_labels() is None
    assert cfg_with(tmp_path, None, TOPODRA_NODE_LABELS="false").node_labels is False
    with pytest.raises(ConfigError, match="scalableUnit must be a non-empty string"):
        cfg_with(tmp_path, "scalableUnit: {a: 1}\n").topology_labels()
    with pytest.raises(ConfigError, match="TOPODRA_NODE_LABELS"):
        cfg_with(tmp_path, None, TOPODRA_NODE_LABELS="maybe")


# --------------------------------------------------------------------------- metrics address, readiness


def test_metrics_address_is_an_ip_and_defaults_to_loopback(tmp_path: Path) -> None:
    from topodra.plugin import metrics

    assert cfg_with(tmp_path, None).metrics_address == "127.0.0.1"
    assert cfg_with(tmp_path, None, TOPODRA_METRICS_ADDRESS="0:0::1").metrics_address == "::1"
    with pytest.raises(ConfigError, match=r"--metrics-address .*not an IP address"):
        cfg_with(tmp_path, None, TOPODRA_METRICS_ADDRESS="example.com")
    server = metrics.serve(0, "127.0.0.2")  # another loopback address: the one given is the one bound
    try:
        assert server.server_address[0] == "127.0.0.2"
        with urllib.request.urlopen(f"http://127.0.0.2:{server.server_port}/metrics", timeout=10) as r:
            assert b"topodra_plugin_node_labels_synced" in r.read()
    finally:
        server.shutdown()
        server.server_close()
