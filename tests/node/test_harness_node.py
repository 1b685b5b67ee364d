"""The local cluster is real: API validation, controller-manager, quota, and a real kubelet running a pod.

Split by tier; the rest: tests/cluster/test_harness.py.
"""

from __future__ import annotations

import pytest
from testkit.handle import ClusterHandle, wait_for

pytestmark = pytest.mark.cluster


@pytest.mark.node
def test_busybox_pod_runs_on_real_node(node_cluster: ClusterHandle) -> None:
    ns = node_cluster.namespace("pod")
    node_cluster.kube.create(f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hello"},
        "spec": {"hostNetwork": True, "restartPolicy": "Never", "nodeName": node_cluster.node_name,
                 "automountServiceAccountToken": False,
                 "containers": [{"name": "c", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                                 "command": ["sh", "-c", "echo hello from $(cat /proc/1/comm)"]}]}})
    wait_for(lambda: (node_cluster.kube.get(f"/api/v1/namespaces/{ns}/pods/hello") or {})
             .get("status", {}).get("phase") == "Succeeded", 120, "pod to succeed")
    out = node_cluster.kubectl("logs", "-n", ns, "hello")
    assert out.strip().startswith("hello from")
