"""The kubelet plugin labelling its own Node (``topodra.plugin.nodelabel``) and the admission policy that
keeps it to that Node and to ``topodra.io/`` labels.

Pure: what is wanted, the merge patch, the backoff, the admin's topology from --hardware-config.
Real apiserver: ``NodeLabeler`` retries while its Node is missing and labels it once it exists, follows a
device change, removes only its own stale labels; the chart's policy, with a real pod-bound token, lets the
plugin label its own node and denies another node, a foreign label and a Node spec change with clear messages.
"""

from __future__ import annotations

import argparse
import json
import signal
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gen_manifests
import pytest
import yaml
from conftest import ClusterHandle, wait_for

from topodra.apipaths import node_path
from topodra.hardware import load_backend
from topodra.nodelabels import GPU_COUNT, GPU_MODEL, MANAGED, NVLINK_CLIQUE, RAIL_GROUP, SCALABLE_UNIT
from topodra.plugin import config as plugin_config
from topodra.plugin.config import ConfigError
from topodra.plugin.nodelabel import LabelError, NodeLabeler, backoff, node_patch, wanted_labels

Obj = dict[str, Any]


def devices(profile: str = "dgx-h100", **overrides: Any) -> Any:
    return tuple(load_backend(f"mock:{profile}", "n", overrides=overrides or None).discover())


def node(labels: Mapping[str, str]) -> Obj:
    return {"metadata": {"name": "n", "labels": dict(labels)}}


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


# --------------------------------------------------------------------------- the real apiserver


def labels_of(cluster: ClusterHandle, name: str) -> dict[str, str]:
    got = cluster.kube.get(node_path(name))
    return dict(((got or {}).get("metadata") or {}).get("labels") or {})


@pytest.mark.cluster
def test_labeler_retries_until_its_node_exists_then_keeps_labels_in_sync(cluster: ClusterHandle) -> None:
    name = f"lbl-{uuid.uuid4().hex[:6]}"
    results: list[bool] = []
    labeler = NodeLabeler(cluster.kube, name, {"scalable_unit": "su7"}, on_result=results.append,
                          resync_seconds=0.5, backoff_base=0.05, backoff_cap=0.2)
    labeler.devices_changed(devices())
    with pytest.raises(LabelError, match=f"node {name} does not exist"):
        labeler.sync()
    labeler.start()
    try:
        wait_for(lambda: results.count(False) >= 3 and labeler.failures >= 3, 30, "retries while the Node is missing")
        assert True not in results
        cluster.fake_nodes([name], {"team": "a", NVLINK_CLIQUE: "stale.1", RAIL_GROUP: "rg-old"})

        def synced(want: dict[str, str]) -> dict[str, str] | None:
            have = labels_of(cluster, name)
            return have if all(have.get(k) == v for k, v in want.items()) else None

        want = {GPU_COUNT: "8", GPU_MODEL: "H100-SXM5-80GB", SCALABLE_UNIT: "su7", "team": "a"}
        have = wait_for(lambda: synced(want), 30, "labels once the Node exists")
        # The admin's rail group is ours (the plugin has a topology) and no longer configured: removed.
        assert NVLINK_CLIQUE not in have and RAIL_GROUP not in have, have
        # The labeler records the result after its PATCH returned, so a moment after the labels are visible.
        wait_for(lambda: results[-1] is True and labeler.failures == 0, 30, "the labeler to record its success")
        labeler.devices_changed(devices(hideGpus=[0, 1]))  # two GPUs fell off the bus
        wait_for(lambda: synced({GPU_COUNT: "6", "team": "a"}), 30, "gpu-count following the devices")
        labeler.topology_changed({"scalable_unit": "su8", "rail_group": "r2"})
        wait_for(lambda: synced({SCALABLE_UNIT: "su8", RAIL_GROUP: "r2"}), 30, "the admin's new topology")
        cluster.kube.merge_patch(node_path(name), {"metadata": {"labels": {GPU_COUNT: "99", "team": "b"}}})
        wait_for(lambda: synced({GPU_COUNT: "6", "team": "b"}), 30, "a resync repairing an edit by someone else")
    finally:
        labeler.stop()
        cluster.kube.delete(node_path(name))


MERGE = "application/merge-patch+json"


def label(key: str, value: str | None) -> Obj:
    return {"metadata": {"labels": {key: value}}}


def test_admission_policy_allows_exactly_the_labels_the_plugin_manages() -> None:
    """The policy's key list and nodelabels.MANAGED must not drift apart (the chart cannot import Python)."""
    text = gen_manifests.render(["controller.enabled=false"], namespace="topodra-system")
    [vap] = [o for o, _ in gen_manifests.split(text)
             if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"].endswith("-own-node-labels")]
    [keys] = [v["expression"] for v in vap["spec"]["variables"] if v["name"] == "managedKeys"]
    assert sorted(json.loads(keys)) == sorted(MANAGED)


@pytest.mark.cluster
def test_admission_policy_keeps_the_plugin_to_its_own_nodes_topodra_labels(cluster: ClusterHandle) -> None:
    """The chart's RBAC + policies for a throwaway ServiceAccount; writes with a real pod-bound token."""
    nc = cluster
    ns = nc.namespace("vapn")
    sa = f"vapn-plugin-{uuid.uuid4().hex[:6]}"
    here, there = f"vapn-a-{uuid.uuid4().hex[:5]}", f"vapn-b-{uuid.uuid4().hex[:5]}"
    text = gen_manifests.render([f"serviceAccounts.plugin={sa}", "controller.enabled=false",
                                 "plugin.hardware=mock:dgx-h100"], namespace=ns)
    objs = [o for o, _ in gen_manifests.split(text)
            if o["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                             "ValidatingAdmissionPolicyBinding")]
    assert sum(o["metadata"]["name"].endswith("-own-node-labels") for o in objs) == 2
    nc.kubectl("apply", "-n", ns, "-f", "-", input="\n---\n".join(yaml.safe_dump(o) for o in objs))
    try:
        nc.fake_nodes([here, there], {"team": "a"})
        bound = nc.pod_bound_token(ns, sa, here)
        unbound = nc.kubectl("create", "token", sa, "-n", ns, "--duration=1h").strip()

        def denied() -> Obj | None:  # the apiserver loads new policies asynchronously
            code, body = nc.as_token(bound, "PATCH", node_path(there), label(GPU_COUNT, "8"), MERGE)
            if code == 200:
                nc.kube.merge_patch(node_path(there), label(GPU_COUNT, None))
                return None
            assert code == 403, (code, body.get("message"))
            return body
        body = wait_for(denied, 60, "the ValidatingAdmissionPolicy to deny labelling another node")
        print(f"\ndenial shown to the plugin labelling node {there} from node {here}:\n  {body['message']}")
        assert f"on node '{here}' may only label that node, not '{there}'" in body["message"]
        assert GPU_COUNT not in labels_of(nc, there)

        code, body = nc.as_token(bound, "PATCH", node_path(here), label(GPU_COUNT, "8"), MERGE)
        assert code == 200, body
        assert labels_of(nc, here)[GPU_COUNT] == "8"
        code, body = nc.as_token(bound, "PATCH", node_path(here), label(GPU_COUNT, None), MERGE)
        assert code == 200 and GPU_COUNT not in labels_of(nc, here), body

        for patch, message in (
                (label("team", "b"), "may only change the topodra.io/ labels it manages ("),
                (label("team", "b"), "not: team"),
                (label("topodra.io/kubelet-plugin", "false"), "not: topodra.io/kubelet-plugin"),
                (label("team", None), "not: team"),
                (label("node-role.kubernetes.io/gpu", ""), "not: node-role.kubernetes.io/gpu"),
                ({"spec": {"unschedulable": True}}, "not its spec (taints, unschedulable)"),
                ({"metadata": {"annotations": {"x": "y"}}}, "annotations")):
            code, body = nc.as_token(bound, "PATCH", node_path(here), patch, MERGE)
            assert code == 403 and message in body["message"], (patch, code, body.get("message"))
        assert labels_of(nc, here)["team"] == "a"
        assert not (nc.kube.get(node_path(here)) or {}).get("spec", {}).get("unschedulable")

        code, body = nc.as_token(unbound, "PATCH", node_path(here), label(GPU_COUNT, "8"), MERGE)
        assert code == 403 and "no node association found" in body["message"], body
    finally:
        for o in objs:
            if "namespace" not in o["metadata"]:
                nc.kubectl("delete", o["kind"].lower(), o["metadata"]["name"], "--ignore-not-found", check=False)
        nc.kube.request("DELETE", f"/api/v1/namespaces/{ns}/pods/plugin", {"gracePeriodSeconds": 0})
        for n in (here, there):
            nc.kube.delete(node_path(n))
        nc.kube.delete(f"/api/v1/namespaces/{ns}")


# --------------------------------------------------------------------------- the real node


@pytest.mark.node
def test_plugin_labels_the_real_node_and_follows_hardware_changes(node_cluster: ClusterHandle,
                                                                   tmp_path: Path) -> None:
    """The plugin process on the real node (kubelet registered): labels appear, follow a GPU falling off the
    bus and the admin's scalable unit in --hardware-config (SIGHUP), and a foreign label is never touched."""
    from pluginproc import PluginProcess

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


def test_chart_metrics_address_and_readiness() -> None:
    def plugin_container(*values: str) -> Obj:
        objs = [o for o, _ in gen_manifests.split(gen_manifests.render(list(values)))]
        (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
        (c,) = ds["spec"]["template"]["spec"]["containers"]
        return dict(c)

    def address(c: Obj) -> Obj:
        return next(e for e in c["env"] if e["name"] == "TOPODRA_METRICS_ADDRESS")

    c = plugin_container()
    assert address(c) == {"name": "TOPODRA_METRICS_ADDRESS", "value": "127.0.0.1"}  # safe default
    assert c["readinessProbe"]["exec"]["command"] == c["livenessProbe"]["exec"]["command"]
    pod_ip = {"name": "TOPODRA_METRICS_ADDRESS", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert address(plugin_container("plugin.metricsAddress=podIP")) == pod_ip
    assert address(plugin_container("metrics.service=true")) == pod_ip  # a Service must reach it
    assert address(plugin_container("metrics.service=true", "plugin.metricsAddress=0.0.0.0"))["value"] == "0.0.0.0"
    with pytest.raises(SystemExit, match="metricsAddress"):
        gen_manifests.render(["plugin.metricsAddress=example.com"])
