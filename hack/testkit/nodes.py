"""Node objects and label patches as the node-label tests write and read them (pure checks, the real
apiserver's admission policy, the real node)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from testkit.handle import ClusterHandle

from topodra.apipaths import node_path
from topodra.devices import Device
from topodra.hardware import load_backend
from topodra.nodelabels import SCALABLE_UNIT

Obj = dict[str, Any]


def devices(profile: str = "dgx-h100", **overrides: Any) -> tuple[Device, ...]:
    """A mock profile's discovered devices on node ``n``."""
    return tuple(load_backend(f"mock:{profile}", "n", overrides=overrides or None).discover())


def node(labels: Mapping[str, str]) -> Obj:
    return {"metadata": {"name": "n", "labels": dict(labels)}}


def label(key: str, value: str | None) -> Obj:
    """A merge patch setting (or, with None, removing) one label."""
    return {"metadata": {"labels": {key: value}}}


def labels_of(cluster: ClusterHandle, name: str) -> dict[str, str]:
    got = cluster.kube.get(node_path(name))
    return dict(((got or {}).get("metadata") or {}).get("labels") or {})


def pod(name: str, ns: str, node_selector: Obj | None = None, affinity_to: str | None = None) -> Obj:
    """A pod of an 8-GPU claim on enterprise-400's nodes, optionally by node selector or pod affinity."""
    spec: Obj = {"restartPolicy": "Never",
                 "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "eight"}],
                 "containers": [{"name": "main", "image": "localhost/busybox:1.35", "command": ["true"],
                                 "resources": {"claims": [{"name": "gpus"}]}}],
                 # Only enterprise-400's nodes (they carry a scalable unit); other tests' nodes stay out.
                 "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                     "nodeSelectorTerms": [{"matchExpressions": [
                         {"key": SCALABLE_UNIT, "operator": "In", "values": ["su1", "su2"]}]}]}}}}
    labels = {}
    if node_selector:
        spec["nodeSelector"] = node_selector
    if affinity_to:
        labels["job"] = affinity_to
        spec["affinity"]["podAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {"job": affinity_to}}, "topologyKey": SCALABLE_UNIT}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": spec}
