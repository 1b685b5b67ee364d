"""Issue 13, part 1: DRA-backed extended resources (KEP-5004) on topodra's DeviceClasses.

A pod that asks ``gpu.topodra.io/gpu: 2`` (or ``gpu.topodra.io/h100: 3``) as an ordinary resource gets
real DRA devices: the real kube-scheduler creates a ResourceClaim for it and allocates devices of the
class that names the resource.  Proven here on simulated nodes (allocation, model pinning, ResourceQuota,
the device-plugin rule) and on the real node, where our kubelet plugin prepares the claim and the
container sees exactly what a claim-template pod sees.

Split by tier; the rest: tests/node/test_extended_resource_node.py, tests/unit/deviceclasses/test_extended_resource.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_scheduling_topology import Scenario, one, scenario_maker
from testkit.extres import ext_claim, ext_pod
from testkit.handle import ClusterHandle, wait_for

from topodra.apipaths import claim_path, node_path
from topodra.kube import KubeError

Obj = dict[str, Any]
GPU = "gpu.topodra.io/gpu"
SEEN_LABEL = "test.topodra.io/seen"  # a later write to the Node than its status: see the device-plugin test


# --- simulated nodes, real scheduler ------------------------------------------------------------


def wait_ext_allocated(s: Scenario, pod_name: str, timeout: float = 60) -> tuple[str, Obj, list[Obj]]:
    """(node, claim, attributes of allocated devices) for an extended-resource pod."""
    claim: Obj = wait_for(lambda: ext_claim(s.kube, s.ns, pod_name), timeout,
                          f"extended-resource claim of {pod_name} allocated")
    node = s.get_pod(pod_name)["spec"]["nodeName"]
    return node, claim, s.devices(claim["status"]["allocation"]["devices"]["results"])


@pytest.fixture
def scenarios(cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    yield from scenario_maker(cluster)


@pytest.mark.cluster
def test_pod_asking_two_gpus_gets_two_dra_devices(scenarios: Callable[..., Scenario]) -> None:
    s = scenarios([("h200", "dgx-h200", 1), ("h100", "dgx-h100", 1)], "ext")
    s.create(ext_pod("any", {GPU: 2}, s.nodes()))
    node, claim, devs = wait_ext_allocated(s, "any")
    assert len(devs) == 2 and {d["_pool"] for d in devs} == {node}
    assert {d["type"] for d in devs} == {"gpu"}
    # The scheduler's claim: annotated as an extended-resource claim, owned by the pod, class of the name.
    assert claim["metadata"]["annotations"].get("resource.kubernetes.io/extended-resource-claim") == "true"
    assert [r["kind"] for r in claim["metadata"]["ownerReferences"]] == ["Pod"]
    reqs = claim["spec"]["devices"]["requests"]
    assert [(r["exactly"]["deviceClassName"], r["exactly"]["count"]) for r in reqs] == [("gpu.topodra.io", 2)]
    mappings = s.get_pod("any")["status"]["extendedResourceClaimStatus"]["requestMappings"]
    assert [(m["containerName"], m["resourceName"]) for m in mappings] == [("main", GPU)]

    # A per-model name pins the model: 3 H100s land on the H100 node, even with the H200 node free.
    s.create(ext_pod("h100", {"gpu.topodra.io/h100": 3}, s.nodes()))
    node, _claim, devs = wait_ext_allocated(s, "h100")
    assert node in s.nodes("h100") and len(devs) == 3
    assert one(d["model"] for d in devs) == "H100-SXM5-80GB"

    # More than any node has left stays Pending: 8 - 3 - (2 if "any" took H100s) < 6 on the H100 node.
    s.create(ext_pod("too-many", {"gpu.topodra.io/h100": 6}, s.nodes()))
    msg = wait_for(lambda: next((c.get("message") for c in s.conditions("too-many")
                                 if c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"), None),
                   60, "too-many Unschedulable")
    assert not s.get_pod("too-many")["spec"].get("nodeName"), msg


@pytest.mark.cluster
def test_resource_quota_on_the_extended_resource(scenarios: Callable[..., Scenario]) -> None:
    """``requests.gpu.topodra.io/gpu`` limits extended-resource pods and claims of the class alike."""
    s = scenarios([("h100", "dgx-h100", 1)], "extq")
    s.create({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpus"},
              "spec": {"hard": {f"requests.{GPU}": "3"}}})

    def used() -> str | None:
        q = s.kube.get(f"/api/v1/namespaces/{s.ns}/resourcequotas/gpus") or {}
        return str(((q.get("status") or {}).get("used") or {}).get(f"requests.{GPU}")) \
            if (q.get("status") or {}).get("hard") else None

    wait_for(lambda: used() == "0", 30, "quota status computed")
    s.create(ext_pod("a", {GPU: 2}, s.nodes()))
    wait_ext_allocated(s, "a")
    with pytest.raises(KubeError) as err:
        s.create(ext_pod("b", {GPU: 2}, s.nodes()))
    assert err.value.status == 403 and "exceeded quota" in str(err.value), err.value

    # A claim of the same class counts toward the same name: 1 more fits, then the next claim is refused.
    s.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "one"},
              "spec": {"spec": {"devices": {"requests": [
                  {"name": "gpus", "exactly": {"deviceClassName": "gpu.topodra.io", "count": 1}}]}}}})
    s.pod("c", "one", s.nodes())
    s.wait_allocated("c")
    wait_for(lambda: used() == "3", 30, "quota used = 2 (extended) + 1 (claim)")
    with pytest.raises(KubeError) as err:
        s.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "d"},
                  "spec": {"devices": {"requests": [
                      {"name": "gpus", "exactly": {"deviceClassName": "gpu.topodra.io", "count": 1}}]}}})
    assert err.value.status == 403 and "exceeded quota" in str(err.value), err.value


@pytest.mark.cluster
def test_device_plugin_resource_on_a_node_wins_over_dra(scenarios: Callable[..., Scenario]) -> None:
    """A node that advertises the name in allocatable (a device plugin) serves it from there, not from DRA.

    The stand-in: the node's status says ``gpu.topodra.io/gpu: 8`` as a device plugin would.  The
    scheduler then charges the node's allocatable and makes no claim, so the GPUs our driver publishes
    on that node are a second, separate pool: the double-count the admin guide's rule forbids.
    """
    s = scenarios([("dp", "dgx-h100", 1)], "extdp")
    node = s.nodes("dp")[0]
    s.kube.request("PATCH", node_path(node) + "/status",
                   {"status": {"capacity": {GPU: "8"}, "allocatable": {GPU: "8"}}},
                   content_type="application/merge-patch+json")
    # The scheduler learns of the new allocatable from its Node informer, which may lag under load. A later write
    # to the same Node (a label) reaches that informer after the status write, so a pod that may only go where
    # the label is set proves, by being bound, that the scheduler's Node holds the allocatable: from that first
    # pod on, every pod must be served from allocatable (one DRA claim, even once, fails the test).
    seen = f"s{s.run}"
    s.kube.request("PATCH", node_path(node), {"metadata": {"labels": {SEEN_LABEL: seen}}},
                   content_type="application/merge-patch+json")
    for k, count in enumerate((2, 1, 1, 1)):
        name = f"dp-{k}"
        s.create(ext_pod(name, {GPU: count}, [seen], node_label=SEEN_LABEL))
        wait_for(lambda n=name: s.get_pod(n)["spec"].get("nodeName") == node,  # type: ignore[misc]
                 60, f"pod {name} bound to the device-plugin node")
        st = s.get_pod(name).get("status") or {}
        assert not st.get("extendedResourceClaimStatus"), f"the scheduler made a DRA claim on {node}: {st}"
    assert not [c for c in s.kube.list(claim_path(s.ns))], "no DRA claim for a device-plugin node"
    # ...while a claim on the same node still gets DRA devices: both pools hand out the same GPUs.
    s.hold_first_gpu(node, "claim-pod")
