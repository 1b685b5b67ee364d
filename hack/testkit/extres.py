"""Pods that ask for DRA-backed extended resources (KEP-5004) and the claim the scheduler makes for them;
the simulated-node tests (tests/cluster) and the real-node test (tests/node) build and read them alike."""

from __future__ import annotations

from typing import Any

from topodra.apipaths import claim_path, pod_path
from topodra.kube import Kube

Obj = dict[str, Any]


def ext_pod(name: str, resources: dict[str, int], nodes: list[str], *, node_label: str = "kubernetes.io/hostname",
            script: str = "true", host_network: bool = False) -> Obj:
    """A pod asking for extended resources (requests == limits), allowed only on ``nodes``."""
    qty = {k: str(v) for k, v in resources.items()}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "hostNetwork": host_network,
                     "automountServiceAccountToken": False,
                     "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                         "nodeSelectorTerms": [{"matchExpressions": [
                             {"key": node_label, "operator": "In", "values": sorted(nodes)}]}]}}},
                     "containers": [{"name": "main", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                                     "command": ["sh", "-c", script],
                                     "resources": {"requests": qty, "limits": qty}}]}}


def ext_claim(kube: Kube, ns: str, pod_name: str) -> Obj | None:
    """The claim the scheduler made for the pod's extended resources, once allocated."""
    pod = kube.get(pod_path(ns, pod_name)) or {}
    st = (pod.get("status") or {}).get("extendedResourceClaimStatus") or {}
    name = st.get("resourceClaimName")
    claim = kube.get(claim_path(ns, name)) if name else None
    if claim and (claim.get("status") or {}).get("allocation") and pod["spec"].get("nodeName"):
        return claim
    return None
