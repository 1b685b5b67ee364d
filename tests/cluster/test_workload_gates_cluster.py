"""The harness's workload gates: with them the apiserver serves Workload/PodGroup and the scheduler gangs.

Proves ``Cluster.up(features=...)`` (``hack/cluster up --workload-api --topology-scheduling``) really turns the
1.37 gates on: the beta API is served, a PodGroup's topology constraint is kept (the alpha field would be
dropped without TopologyAwareWorkloadScheduling on the apiserver), and kube-scheduler holds a gang's pods until
``minCount`` of them exist.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from testkit.cluster import ClusterError, gate_flags
from testkit.handle import ClusterHandle, wait_for

NS = "default"


def test_unknown_feature_is_refused_before_anything_starts() -> None:
    with pytest.raises(ClusterError, match="unknown harness feature"):
        gate_flags(["gang"])


def test_gate_flags_name_the_gates_and_the_beta_api() -> None:
    common, api = gate_flags(["workload-api", "topology-scheduling"])
    assert common == ["--feature-gates=GenericWorkload=true,TopologyAwareWorkloadScheduling=true"]
    assert api == [*common, "--runtime-config=scheduling.k8s.io/v1beta1=true"]
    assert gate_flags([]) == ([], [])
    # no gate, only the beta versions of resource.k8s.io (tests/cluster/test_reservation_admission_cluster.py)
    assert gate_flags(["resource-beta-apis"]) == (
        [], ["--runtime-config=resource.k8s.io/v1beta1=true,resource.k8s.io/v1beta2=true"])


def _pod(name: str, group: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS},
            "spec": {"schedulingGroup": {"podGroupName": group},
                     "containers": [{"name": "c", "image": "registry.invalid/none"}],
                     "nodeSelector": {"topodra.io/gate-test": group}}}


def _gated(c: ClusterHandle) -> float:
    total = 0.0
    for line in c.lc.scheduler_metrics().splitlines():
        if line.startswith("scheduler_pending_pods{") and 'queue="gated"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _scheduled_condition(kube: Any, path: str) -> str | None:
    p = kube.get(path) or {}
    for c in p.get("status", {}).get("conditions") or []:
        if c.get("type") == "PodScheduled":
            return f"{c.get('status')}: {c.get('message', '')}"
    return None


def test_podgroup_served_topology_kept_and_gang_held(workload_cluster: ClusterHandle) -> None:
    kube = workload_cluster.kube
    group = f"gate-{uuid.uuid4().hex[:6]}"
    pg = {"apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup",
          "metadata": {"name": group, "namespace": NS},
          "spec": {"schedulingPolicy": {"gang": {"minCount": 2}},
                   "schedulingConstraints": {"topology": [{"key": "topodra.io/leaf-group"}]}}}
    base = f"/apis/scheduling.k8s.io/v1beta1/namespaces/{NS}/podgroups"
    kube.create(base, pg)
    try:
        got = kube.get(f"{base}/{group}")
        assert got is not None
        assert got["spec"]["schedulingConstraints"]["topology"] == [{"key": "topodra.io/leaf-group"}]
        pods = f"/api/v1/namespaces/{NS}/pods"
        kube.create(pods, _pod(f"{group}-0", group))
        # One pod of two: the gang plugin's PreEnqueue keeps it out of the active queue (the scheduler
        # counts it as gated) and no scheduling attempt is made, so it gets no PodScheduled condition.
        wait_for(lambda: _gated(workload_cluster) >= 1, 60, "kube-scheduler to gate the lone gang pod")
        assert not _scheduled_condition(kube, f"{pods}/{group}-0")
        # The second pod completes minCount: both are tried (and fail, no node has the selector's label).
        kube.create(pods, _pod(f"{group}-1", group))
        for i in (0, 1):
            path = f"{pods}/{group}-{i}"
            wait_for(lambda: _scheduled_condition(kube, path), 60,  # noqa: B023 (called before the next i)
                     f"gang pod {i} to get a scheduling verdict once minCount pods exist")
    finally:
        for path in (f"/api/v1/namespaces/{NS}/pods/{group}-0", f"/api/v1/namespaces/{NS}/pods/{group}-1",
                     f"{base}/{group}"):
            kube.delete(path)
