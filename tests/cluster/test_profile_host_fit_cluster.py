"""Issue 21: a ClaimProfile's nodesFit counts the nodes' free CPU and memory, against the real apiserver and
kube-scheduler and the real controller process.

Two simulated DGX H100 nodes (224 CPUs, 2Ti, all 8 GPUs free). The profile asks for 8 GPUs in one NVLink domain
and states its pods' requests (``podRequests: {cpu: 96, memory: 128Gi}``). A CPU-only pod bound to ``hog`` takes
204 CPUs: ``hog`` keeps its 8 free GPUs but not the CPUs, so the controller stops counting it in ``nodesFit``
and says so in ``nodesShortOfCpu`` and ``status.message``; the real scheduler agrees (a pod of the profile pinned
to ``hog`` stays Pending with NodeResourcesFit's "Insufficient cpu"). Once the CPU pod is gone, ``hog`` counts
again. Counts are read relative to the first status, so nodes other tests of the session left do not matter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_scheduling_topology import Scenario, scenario_maker
from testkit.controllerproc import controller_process
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO

from topodra.apipaths import pod_path, profile_path, template_path
from topodra.kube import KubeError

pytestmark = pytest.mark.cluster

Obj = dict[str, Any]
LOG_DIR = REPO / ".run" / "hostfit-test-logs"
PROFILE = "train"
SHORT = "too little free CPU"


@pytest.fixture
def scenarios(cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    cluster.install_claimprofile_crd()
    yield from scenario_maker(cluster)


@contextlib.contextmanager
def controller(sc: Scenario) -> Iterator[None]:
    """The real controller process, watching only the scenario's namespace, refreshing every 2 s."""
    with controller_process(sc.cluster.kubeconfig, sc.ns, "hostfit", LOG_DIR / f"{sc.ns}.log"):
        yield


def status(sc: Scenario) -> Obj:
    return dict((sc.kube.get(profile_path(sc.ns, PROFILE)) or {}).get("status") or {})


def wait_status(sc: Scenario, ok: Callable[[Obj, Obj], bool], what: str) -> tuple[Obj, Obj]:
    """(status, its one alternative) once ``ok`` holds for them."""
    def ready() -> tuple[Obj, Obj] | None:
        st = status(sc)
        alts = st.get("alternatives") or []
        return (st, alts[0]) if len(alts) == 1 and ok(st, alts[0]) else None
    try:
        got: tuple[Obj, Obj] = wait_for(ready, 60, what)
    except AssertionError as e:
        raise AssertionError(f"{e}; status: {status(sc)}") from None
    return got


def gpu_pod(template: str) -> Obj:
    """A pod of the profile, requesting what the profile says its pods request."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {}, "spec": {
        "restartPolicy": "Never", "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template}],
        "containers": [{"name": "main", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                        "command": ["true"], "resources": {"requests": {"cpu": "96", "memory": "128Gi"},
                                                           "claims": [{"name": "gpus"}]}}]}}


def force_delete(sc: Scenario, name: str) -> None:
    """Pods bound to kubelet-less nodes never finish a graceful delete."""
    sc.kube.request("DELETE", pod_path(sc.ns, name), {"apiVersion": "v1", "kind": "DeleteOptions",
                                                      "gracePeriodSeconds": 0})
    wait_for(lambda: sc.kube.get(pod_path(sc.ns, name)) is None, 30, f"pod {name} gone")


def test_a_node_whose_cpus_are_held_is_not_counted_until_they_are_free(
        scenarios: Callable[..., Scenario]) -> None:
    s = scenarios([("hog", "dgx-h100", 1), ("roomy", "dgx-h100", 1)], "hostfit")
    hog = s.nodes("hog")[0]
    node = s.kube.get(f"/api/v1/nodes/{hog}") or {}
    assert (node["status"]["allocatable"]["cpu"], node["status"]["allocatable"]["memory"]) == ("224", "2Ti")
    with controller(s):
        s.kube.create(profile_path(s.ns), {
            "apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile", "metadata": {"name": PROFILE},
            "spec": {"alternatives": [{"deviceClassName": "gpu-h100", "count": 8}],
                     "topology": {"nvlink": "Required"}, "podRequests": {"cpu": "96", "memory": "128Gi"}}})
        # Both nodes have 8 free GPUs and the CPUs: both count (and any node of other tests, as it is).
        _st, first = wait_status(s, lambda st, a: "nodesShortOfCpu" in a and a.get("nodesFit", 0) >= 2,
                                 "the profile's status counts both nodes, with the CPU/memory fields")
        fit, short = first["nodesFit"], first["nodesShortOfCpu"]
        assert s.kube.get(template_path(s.ns, PROFILE)) is not None

        s.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cpu-hog"}, "spec": {
            "nodeName": hog, "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                            "command": ["true"], "resources": {"requests": {"cpu": "204", "memory": "64Gi"}}}]}})
        st, alt = wait_status(s, lambda st, a: a.get("nodesShortOfCpu") == short + 1,
                              "the controller sees the CPU pod's requests")
        assert alt["nodesFit"] == fit - 1, alt
        assert alt["devicesFree"] == first["devicesFree"], alt  # the GPUs are still free: only the CPU is gone
        assert alt["nodesShortOfMemory"] == first["nodesShortOfMemory"], alt
        assert SHORT in st["message"] and "for a pod of cpu 96, memory 128Gi" in st["message"], st["message"]

        # The scheduler refuses that node for the profile's pod for the same reason.
        s.pod("on-hog", PROFILE, [hog], gpu_pod(PROFILE))

        def refused() -> str | None:
            conds = (s.get_pod("on-hog").get("status") or {}).get("conditions") or []
            return next((str(c.get("message")) for c in conds if c.get("type") == "PodScheduled"
                         and c.get("reason") == "Unschedulable"), None)
        reason = wait_for(refused, 60, "the scheduler decides on the pod pinned to the CPU-held node")
        assert "Insufficient cpu" in reason, reason
        force_delete(s, "on-hog")

        force_delete(s, "cpu-hog")
        st, alt = wait_status(s, lambda st, a: a.get("nodesShortOfCpu") == short and a.get("nodesFit") == fit,
                              "the node counts again once the CPU pod is gone")
        assert SHORT not in st["message"], st["message"]


def test_the_crd_refuses_a_malformed_pod_request(cluster: ClusterHandle) -> None:
    cluster.install_claimprofile_crd()
    ns = cluster.namespace("hostfit-bad")
    with pytest.raises(KubeError) as err:
        cluster.kube.create(profile_path(ns), {
            "apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile", "metadata": {"name": "bad"},
            "spec": {"alternatives": [{"deviceClassName": "gpu-h100"}], "podRequests": {"cpu": "lots"}}})
    assert err.value.status == 422 and "spec.podRequests.cpu" in err.value.message, err.value.message
