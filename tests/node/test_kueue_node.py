"""Issue 13 end to end on the real node: real Kueue admits a Kueue-mode job, the real scheduler allocates
the extended resource's DRA devices, the real kubelet runs it and our plugin prepares the devices.

The plugin labels its own Node (``topodra.io/gpu-model``), which is what the per-model ResourceFlavor
selects; the ClusterQueue has no H200 quota, so Kueue falls back to the H100 flavor of the mock node.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from test_extended_resource_node import ext_plugin  # noqa: F401 - the module fixture: our plugin on the real node
from testkit import kueue as localkueue
from testkit.handle import ClusterHandle, wait_for
from testkit.pluginproc import PluginProcess
from testkit.ports import free_port

from topodra.apipaths import namespace_path, node_path, pod_path
from topodra.controller import kueue as kq
from topodra.controller.profile import ClaimProfile

pytestmark = pytest.mark.node
KUEUE = "/apis/kueue.x-k8s.io/v1beta2"
H200, H100 = "H200-SXM5-141GB", "H100-SXM5-80GB"


@pytest.fixture(scope="module")
def kueue_node(node_cluster: ClusterHandle, ext_plugin: PluginProcess) -> Iterator[ClusterHandle]:  # noqa: F811
    nc = node_cluster
    wait_for(lambda: ((nc.kube.get(node_path(nc.node_name)) or {})["metadata"].get("labels") or {})
             .get("topodra.io/gpu-model") == H100, 60, "the plugin labels its node with the GPU model")
    localkueue.start(nc.lc, webhook_port=free_port(), health_port=free_port())
    try:
        yield nc
    finally:
        localkueue.stop(nc.lc)


def test_kueue_job_runs_on_the_real_node_with_prepared_devices(kueue_node: ClusterHandle) -> None:
    nc = kueue_node
    tag = uuid.uuid4().hex[:5]
    ns = nc.namespace("kqnode")
    nc.kube.merge_patch(namespace_path(ns), {"metadata": {"labels": {
        localkueue.NAMESPACE_LABEL[0]: localkueue.NAMESPACE_LABEL[1]}}})
    for m in (H200, H100):
        nc.kube.create(f"{KUEUE}/resourceflavors", kq.resource_flavor(m))
    cq = f"node-{tag}"
    nc.kube.create(f"{KUEUE}/clusterqueues", kq.cluster_queue(cq, [H200, H100], {H100: 8}))
    nc.kube.create(f"{KUEUE}/namespaces/{ns}/localqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "q"},
        "spec": {"clusterQueue": cq}})
    # As test_kueue's Teams do: a Job made before Kueue (and the apiserver's webhook namespace selector) has
    # seen the namespace label and the queues may be left alone or parked as inadmissible.
    wait_for(lambda: any(c.get("type") == "Active" and c.get("status") == "True" for c in (
        (nc.kube.get(f"{KUEUE}/namespaces/{ns}/localqueues/q") or {}).get("status") or {}).get("conditions") or []),
             30, "LocalQueue q active")
    plan = kq.plan(ClaimProfile.from_api({"metadata": {"name": "p", "namespace": ns}, "spec": {
        "queueing": "Kueue", "localQueue": "q",
        "alternatives": [{"deviceClassName": "gpu-h200", "count": 2},
                         {"deviceClassName": "gpu-h100", "count": 2}]}}), kq.catalog_class_models())
    tmpl = plan.pod_template({"spec": {
        "restartPolicy": "Never", "hostNetwork": True, "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 1, "nodeSelector": {"kubernetes.io/hostname": nc.node_name},
        "containers": [{"name": "main", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                        "command": ["sh", "-c", "env | sort"]}]}})
    try:
        nc.kube.create(f"/apis/batch/v1/namespaces/{ns}/jobs", {
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "train", "labels": dict(tmpl["metadata"]["labels"])},
            "spec": {"backoffLimit": 0, "template": tmpl}})

        def workload() -> dict[str, Any] | None:
            return next(iter(nc.kube.list(f"{KUEUE}/namespaces/{ns}/workloads")), None)

        def admitted_flavor() -> str | None:
            wl = workload() or {}
            st = wl.get("status") or {}
            if not any(c.get("type") == "Admitted" and c.get("status") == "True" for c in st.get("conditions") or []):
                return None
            return str(next(iter(st["admission"]["podSetAssignments"][0]["flavors"].values())))

        assert wait_for(admitted_flavor, 60, "job admitted") == kq.flavor_name(H100)

        def succeeded() -> bool:
            job = nc.kube.get(f"/apis/batch/v1/namespaces/{ns}/jobs/train") or {}
            st = job.get("status") or {}
            if st.get("failed"):
                raise AssertionError(nc.kubectl("describe", "pods", "-n", ns, check=False))
            return bool(st.get("succeeded"))

        wait_for(succeeded, 120, "the job's pod ran to completion on the real node")
        [pod] = list(nc.kube.list(pod_path(ns), label_selector="job-name=train"))
        assert pod["spec"]["nodeName"] == nc.node_name
        assert pod["spec"]["nodeSelector"]["topodra.io/gpu-model"] == H100, "Kueue injected the flavor's label"
        env = dict(line.split("=", 1) for line in nc.kubectl("logs", "-n", ns, pod["metadata"]["name"]).splitlines()
                   if "=" in line)
        devs = env["TOPODRA_VISIBLE_DEVICES"].split(",")
        assert len(devs) == 2
        for d in devs:
            assert env[f"TOPODRA_DEVICE_{d.upper().replace('-', '_')}_MODEL"] == H100
        # Kueue saw the job finish.
        wait_for(lambda: any(c.get("type") == "Finished" and c.get("status") == "True"
                             for c in ((workload() or {}).get("status") or {}).get("conditions") or []),
                 60, "workload Finished")
    finally:
        nc.kube.request("DELETE", f"/apis/batch/v1/namespaces/{ns}/jobs/train",
                        {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"})
        nc.kube.delete(namespace_path(ns))
        wait_for(lambda: nc.kube.get(namespace_path(ns)) is None, 120, f"namespace {ns} gone")
        nc.kube.delete(f"{KUEUE}/clusterqueues/{cq}")
