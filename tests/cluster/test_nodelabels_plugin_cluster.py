"""The kubelet plugin labelling its own Node (``topodra.plugin.nodelabel``) and the admission policy that
keeps it to that Node and to ``topodra.io/`` labels.

Pure: what is wanted, the merge patch, the backoff, the admin's topology from --hardware-config.
Real apiserver: ``NodeLabeler`` retries while its Node is missing and labels it once it exists, follows a
device change, removes only its own stale labels; the chart's policy, with a real pod-bound token, lets the
plugin label its own node and denies another node, a foreign label and a Node spec change with clear messages.

Split by tier; the rest: tests/node/test_nodelabels_plugin_node.py, tests/unit/nodelabels/test_nodelabels_plugin.py.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import gen_manifests
import pytest
import yaml
from testkit.handle import ClusterHandle, wait_for
from testkit.nodes import devices, label, labels_of

from topodra.apipaths import node_path
from topodra.nodelabels import GPU_COUNT, GPU_MODEL, MANAGED, NVLINK_CLIQUE, RAIL_GROUP, SCALABLE_UNIT
from topodra.plugin.nodelabel import LabelError, NodeLabeler

Obj = dict[str, Any]


# --------------------------------------------------------------------------- the real apiserver


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


# --------------------------------------------------------------------------- the chart, rendered by the pinned helm


def test_admission_policy_allows_exactly_the_labels_the_plugin_manages() -> None:
    """The policy's key list and nodelabels.MANAGED must not drift apart (the chart cannot import Python)."""
    text = gen_manifests.render(["controller.enabled=false"], namespace="topodra-system")
    [vap] = [o for o, _ in gen_manifests.split(text)
             if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"].endswith("-own-node-labels")]
    [keys] = [v["expression"] for v in vap["spec"]["variables"] if v["name"] == "managedKeys"]
    assert sorted(json.loads(keys)) == sorted(MANAGED)


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
