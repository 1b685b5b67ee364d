"""The kubelet plugin labelling its own Node (``topodra.plugin.nodelabel``) and the admission policy that
keeps it to that Node and to ``topodra.io/`` labels.

Pure: what is wanted, the merge patch, the backoff, the admin's topology from --hardware-config.
Real apiserver: ``NodeLabeler`` retries while its Node is missing and labels it once it exists, follows a
device change, removes only its own stale labels; the chart's policy, with a real pod-bound token, lets the
plugin label its own node and denies another node, a foreign label and a Node spec change with clear messages.

Split by tier; the rest: tests/cluster/test_nodelabels_plugin_cluster.py,
tests/unit/nodelabels/test_nodelabels_plugin.py.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from testkit.handle import ClusterHandle, wait_for
from testkit.nodes import labels_of

from topodra.apipaths import node_path
from topodra.nodelabels import GPU_COUNT, GPU_MODEL, NVLINK_CLIQUE, RAIL_GROUP, SCALABLE_UNIT

Obj = dict[str, Any]


# --------------------------------------------------------------------------- the real node


@pytest.mark.node
def test_plugin_labels_the_real_node_and_follows_hardware_changes(node_cluster: ClusterHandle,
                                                                   tmp_path: Path) -> None:
    """The plugin process on the real node (kubelet registered): labels appear, follow a GPU falling off the
    bus and the admin's scalable unit in --hardware-config (SIGHUP), and a foreign label is never touched."""
    from testkit.pluginproc import PluginProcess

    nc = node_cluster
    name = nc.node_name
    hw = tmp_path / "hardware.yaml"
    hw.write_text("scalableUnit: su-e2e\n")
    nc.kube.merge_patch(node_path(name), {"metadata": {"labels": {"team": "e2e", RAIL_GROUP: "stale"}}})
    proc = PluginProcess(nc.kubeconfig, name, nc.lc.logs / "topodra-plugin-nodelabels.log",
                         extra_env={"TOPODRA_HARDWARE_CONFIG": str(hw)})

    def synced(want: dict[str, str | None]) -> dict[str, str] | None:
        have = labels_of(nc, name)
        return have if all(have.get(k) == v for k, v in want.items()) else None

    try:
        proc.start()
        wait_for(lambda: synced({GPU_COUNT: "8", GPU_MODEL: "H100-SXM5-80GB", SCALABLE_UNIT: "su-e2e",
                                 RAIL_GROUP: None, "team": "e2e"}), 60, "labels on the real node")
        # The gauge is set after the PATCH returned: a moment after the labels are visible.
        wait_for(lambda: proc.metric("topodra_plugin_node_labels_synced") == 1.0, 30, "node_labels_synced 1")
        assert proc.metric("topodra_plugin_node_label_failures_total") == 0.0
        assert proc.proc is not None
        hw.write_text("hideGpus: [5]\nrailGroup: rg-1\n")
        proc.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: synced({GPU_COUNT: "7", RAIL_GROUP: "rg-1", SCALABLE_UNIT: None, "team": "e2e"}), 60,
                 "labels after a GPU fell off and the admin moved the node")
        assert proc.stop() == 0, proc.tail()
        # Off: a stopped plugin leaves its labels (they describe the hardware, not the process).
        assert synced({GPU_COUNT: "7", RAIL_GROUP: "rg-1"})
    finally:
        proc.stop()
        nc.kube.merge_patch(node_path(name), {"metadata": {"labels": {
            "team": None, GPU_COUNT: None, GPU_MODEL: None, NVLINK_CLIQUE: None, SCALABLE_UNIT: None,
            RAIL_GROUP: None}}})
