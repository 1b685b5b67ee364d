"""Reads what the inventory is built from: six lists, concurrently, nothing written.

RBAC needed: list ResourceSlices, ResourceClaims, DeviceClasses, DeviceTaintRules, Nodes, Pods.
A missing DeviceTaintRule API (older clusters) or a forbidden list of it reads as "no rules";
any other failure is an error.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from topodra.apipaths import claim_path, device_class_path, device_taint_rule_path, node_path, pod_path, slices_path
from topodra.clusterview.model import Obj, Sources
from topodra.kube import Kube, KubeError


def _list(kube: Kube, path: str, field_selector: str | None = None, label_selector: str | None = None,
          optional: bool = False) -> tuple[Obj, ...]:
    try:
        return tuple(kube.list(path, label_selector=label_selector, field_selector=field_selector))
    except KubeError as e:
        if optional and e.status in (403, 404):
            return ()
        raise


def fetch(kube: Kube, driver: str, node_selector: str | None = None) -> Sources:
    """The API objects of one view; ``node_selector`` (a label selector) limits the Nodes listed."""
    calls = {
        "slices": (slices_path(), f"spec.driver={driver}", None, False),
        "claims": (claim_path(), None, None, False),
        "classes": (device_class_path(), None, None, False),
        "nodes": (node_path(), None, node_selector, False),
        # Pending pods hold the pending claims; bound, non-terminal ones hold node CPU and memory.
        "pods": (pod_path(), "status.phase!=Succeeded,status.phase!=Failed", None, False),
        "taint_rules": (device_taint_rule_path(), None, None, True),
    }
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {k: pool.submit(_list, kube, *args) for k, args in calls.items()}
        got = {k: f.result() for k, f in futures.items()}
    return Sources(**got)
