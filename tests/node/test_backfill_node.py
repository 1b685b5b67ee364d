"""The kubelet plugin's backfill check on the real node (issue 33): a backfill claim is prepared only for a pod
whose ``activeDeadlineSeconds`` fits the claim's runtime bound.

A backfill claim tolerates held devices only where the backfill window is at least its bound
(``reservations.backfill_tolerations``, what the controller renders for ``spec.backfill.maxRuntime``). What keeps
its pod from running into the reservation it borrowed from is its deadline, so the plugin refuses to prepare it
for a pod without one, or with a longer one (``ClaimFetcher._backfill_refusal``). Here the real scheduler
allocates the claims, the real kubelet asks the plugin to prepare them, and containerd runs the pod that fits.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_plugin_e2e import (  # noqa: F401 - fixtures
    R,
    boot_id_file,
    delete_pod,
    hardware_config,
    our_specs,
    plugin,
    pod_claim,
    wait_phase,
)
from testkit.handle import ClusterHandle, wait_for
from testkit.pluginproc import DRIVER, PluginProcess

from topodra import reservations

pytestmark = pytest.mark.node
BOUND_S = 3600  # the claim's runtime bound: windows of 1h and longer


def backfill_template(nc: ClusterHandle, ns: str) -> None:
    nc.kube.create(f"{R}/namespaces/{ns}/resourceclaimtemplates", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "backfill"},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": 1,
                                         "tolerations": reservations.backfill_tolerations(BOUND_S)}}]}}}})


def backfill_pod(nc: ClusterHandle, ns: str, name: str, deadline: int | None) -> None:
    spec: dict[str, Any] = {
        "hostNetwork": True, "restartPolicy": "Never", "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 1,
        "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "backfill"}],
        "containers": [{"name": "c", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                        "command": ["sh", "-c", "echo ran; sleep 3600"], "resources": {"claims": [{"name": "gpus"}]}}]}
    if deadline is not None:
        spec["activeDeadlineSeconds"] = deadline
    nc.kube.create(f"/api/v1/namespaces/{ns}/pods", {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                                                     "spec": spec})


def refusal(nc: ClusterHandle, ns: str, name: str) -> str | None:
    """The plugin's refusal as the kubelet reported it in one of the pod's Events, once it did."""
    for ev in nc.kube.list(f"/api/v1/namespaces/{ns}/events", field_selector=f"involvedObject.name={name}"):
        msg = str(ev.get("message", ""))
        if "is a backfill claim" in msg:
            return msg
    return None


def test_a_backfill_claim_is_prepared_only_for_a_pod_whose_deadline_fits_its_bound(
        node_cluster: ClusterHandle, plugin: PluginProcess) -> None:  # noqa: F811
    nc = node_cluster
    ns = nc.namespace("backfill")
    backfill_template(nc, ns)
    before = our_specs()
    pods = {"none": None, "long": 2 * BOUND_S, "fits": BOUND_S - 600}
    try:
        for name, deadline in pods.items():
            backfill_pod(nc, ns, name, deadline)
        for name in pods:
            claim = pod_claim(nc, ns, name)  # the real scheduler allocated each one on this node
            assert claim["status"]["allocation"]["devices"]["results"][0]["pool"] == nc.node_name
        wait_phase(nc, ns, "fits", "Running")
        none = wait_for(lambda: refusal(nc, ns, "none"), 90, "the kubelet's event with the plugin's refusal (none)")
        assert "must declare activeDeadlineSeconds <= 3600 (it declares none)" in none
        long = wait_for(lambda: refusal(nc, ns, "long"), 90, "the kubelet's event with the plugin's refusal (long)")
        assert "must declare activeDeadlineSeconds <= 3600 (it declares 7200)" in long
        # Refused pods never start, and only the pod that fits got a CDI spec.
        phases = {n: (nc.kube.get(f"/api/v1/namespaces/{ns}/pods/{n}") or {}).get("status", {}).get("phase")
                  for n in ("none", "long")}
        assert phases == {"none": "Pending", "long": "Pending"}
        assert len(our_specs() - before) == 1
        assert refusal(nc, ns, "fits") is None
    finally:
        # A refused pod keeps its allocated claim while the kubelet retries prepare: deleted before the next test
        # (kube-controller-manager then releases the generated claims).
        for name in pods:
            delete_pod(nc, ns, name)
