"""A positive signal that kube-scheduler's ResourceSlice informer holds every slice write made before a call.

Slice writes (a driver's taints, say) reach the scheduler through its informer, which may lag under load; a
test that then asserts "the scheduler refused" cannot tell a lagging informer from a scheduler that ignores the
write, and a test that retries until the first refusal passes a scheduler that honours it only some of the
time. An informer delivers one kind's watch events in resourceVersion order (client-go's reflector follows one
watch stream), so once the scheduler allocates a device that exists only in a slice written *after* the write
in question, it has that write too. The marker: a kubelet-less Node, a slice of a driver of its own there, a
claim for that device and a pod pinned to the node; the pod never runs (no kubelet), and everything goes away
before the call returns.
"""

from __future__ import annotations

import uuid
from typing import Any

from testkit.handle import wait_for

from topodra.apipaths import claim_path, node_path, pod_path, slices_path
from topodra.kube import Kube, KubeError
from topodra.simulate import ensure_node

MARKER_DRIVER = "marker.test.topodra.io"
DEVICE_CLASSES = "/apis/resource.k8s.io/v1/deviceclasses"


def scheduler_has_seen_slices(kube: Kube, namespace: str, timeout: float = 60) -> None:
    """Return once kube-scheduler's slice informer holds every ResourceSlice write made before this call."""
    run = uuid.uuid4().hex[:8]
    node = f"slice-marker-{run}"
    if kube.get(f"{DEVICE_CLASSES}/{MARKER_DRIVER}") is None:
        kube.create(DEVICE_CLASSES, {
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": MARKER_DRIVER},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{MARKER_DRIVER}"'}}]}})
    ensure_node(kube, node, {}, allocatable=("1", "1Gi"))
    try:
        kube.create(slices_path(), {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": node},
            "spec": {"driver": MARKER_DRIVER, "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "marker"}]}})
        kube.create(claim_path(namespace), {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": node},
            "spec": {"devices": {"requests": [{"name": "m", "exactly": {"deviceClassName": MARKER_DRIVER}}]}}})
        kube.create(pod_path(namespace), {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": node},
            "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
                     "tolerations": [{"operator": "Exists"}],  # a kubelet-less node turns not-ready
                     "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                         "nodeSelectorTerms": [{"matchFields": [
                             {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}},
                     "resourceClaims": [{"name": "m", "resourceClaimName": node}],
                     "containers": [{"name": "main", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                                     "command": ["true"], "resources": {"claims": [{"name": "m"}]}}]}})

        def allocated() -> bool:
            claim: dict[str, Any] = kube.get(claim_path(namespace, node)) or {}
            return bool((claim.get("status") or {}).get("allocation"))

        wait_for(allocated, timeout, f"kube-scheduler allocated the marker device of slice {node}")
    finally:
        # A pod bound to a kubelet-less node never finishes a graceful delete: force it.
        try:
            kube.request("DELETE", pod_path(namespace, node),
                         {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        except KubeError as e:
            if e.status != 404:
                raise
        kube.delete(claim_path(namespace, node))
        kube.delete(slices_path(node))
        kube.delete(node_path(node))
