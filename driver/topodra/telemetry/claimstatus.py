"""Say where Kubernetes users look that a claim is idle: a condition on the claim's per-device status and an
Event on its pods. Written on change only (and once after a restart when the API disagrees), never per sample.

``ResourceClaim.status.devices[]`` (``AllocatedDeviceStatus``, keyed by driver, pool, device and shareID) takes
``conditions`` from the driver that allocated the device. Kubernetes v1.37.2: the field's gate
``DRAResourceClaimDeviceStatus`` is GA and locked on (pkg/features/kube_features.go:1530); the status
strategy drops entries of deallocated devices (pkg/registry/resource/resourceclaim/strategy.go:200,
``dropDeallocatedStatusDevices``) and, with ``DRAResourceClaimGranularStatusAuthorization`` (beta, on), asks
for ``resourceclaims/driver`` with verb ``associated-node:<verb>`` (a service account bound to the claim's
node) or ``arbitrary-node:<verb>``, resourceName = the driver (strategy.go:215-223,
pkg/registry/resource/utils.go:150); validation wants each entry to be an allocated device and its conditions
to be valid metav1.Conditions (pkg/apis/resource/validation/validation.go:1806).

The write is a server-side apply of this node's devices only, under its own field manager
(``FIELD_MANAGER``): the list's map keys let other managers (another driver, a network driver's
``networkData``) keep their entries, and entries this manager stops applying are removed by the apply itself.
The per-device summary in ``data`` (``telemetry.summary``) is applied under a second manager
(``SUMMARY_FIELD_MANAGER``): each apply of one manager carries only its own fields, so a summary write never
removes the condition and a condition write never removes the summary.
"""

from __future__ import annotations

import logging
import time
import uuid as uuidlib
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from topodra.apipaths import claim_path
from topodra.claims import HeldDevice
from topodra.kube import Kube, KubeError

log = logging.getLogger(__name__)

CONDITION_TYPE = "Idle"
FIELD_MANAGER = "topodra-telemetry"
SUMMARY_FIELD_MANAGER = "topodra-telemetry-summary"
REASON_IDLE = "BelowThresholds"
REASON_ACTIVE = "Active"
EVENT_IDLE = "GPUClaimIdle"
EVENT_ACTIVE = "GPUClaimActive"
EVENT_COMPONENT = "topodra-kubelet-plugin"


def _stamp(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(idle: bool, now: float, message: str) -> dict[str, Any]:
    return {"type": CONDITION_TYPE, "status": "True" if idle else "False",
            "reason": REASON_IDLE if idle else REASON_ACTIVE, "message": message[:1024],
            "lastTransitionTime": _stamp(now)}


def status_apply(namespace: str, name: str, uid: str, driver: str, devices: Iterable[HeldDevice],
                 cond: Mapping[str, Any]) -> dict[str, Any]:
    """The apply configuration: this driver's ``devices`` of the claim, each with ``cond`` (pure)."""
    entries = []
    for pool, device, share in sorted(devices, key=lambda d: (d[0], d[1], d[2] or "")):
        e: dict[str, Any] = {"driver": driver, "pool": pool, "device": device, "conditions": [dict(cond)]}
        if share:
            e["shareID"] = share
        entries.append(e)
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": uid}, "status": {"devices": entries}}


def written_idle(claim: Mapping[str, Any], driver: str, pool: str) -> bool | None:
    """The ``Idle`` condition the claim carries now on this driver's devices of ``pool``: True/False when every such
    entry agrees, None when there is none (or they disagree: then it is written again)."""
    seen = set()
    for d in (claim.get("status") or {}).get("devices") or []:
        if d.get("driver") != driver or d.get("pool") != pool:
            continue
        for c in d.get("conditions") or []:
            if c.get("type") == CONDITION_TYPE:
                seen.add(c.get("status") == "True")
    return seen.pop() if len(seen) == 1 else None


def pod_event(namespace: str, pod: str, node: str, reason: str, message: str, now: float,
              event_type: str = "Normal") -> dict[str, Any]:
    """A core/v1 Event about ``pod`` (what ``kubectl describe pod`` and ``kubectl get events`` show)."""
    stamp = _stamp(now)
    return {"apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{pod}.{uuidlib.uuid4().hex[:16]}", "namespace": namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": pod},
            "reason": reason, "message": message[:1024], "type": event_type,
            "source": {"component": EVENT_COMPONENT, "host": node}, "reportingComponent": EVENT_COMPONENT,
            "reportingInstance": node, "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1}


class ClaimStatusWriter:
    """The API side: one apply per changed claim and one Event per pod; errors raise ``KubeError``."""

    def __init__(self, kube: Kube, driver: str, node: str, clock: Any = time.time) -> None:
        self.kube = kube
        self.driver = driver
        self.node = node
        self._clock = clock

    def apply_summary(self, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        """Apply a claim's per-device summaries (``telemetry.summary.summary_apply``), no Event."""
        self.kube.request("PATCH", claim_path(namespace, name) + "/status", dict(body),
                          query={"fieldManager": SUMMARY_FIELD_MANAGER, "force": "true"},
                          content_type="application/apply-patch+yaml")

    def write(self, namespace: str, name: str, uid: str, devices: Sequence[HeldDevice], idle: bool,
              pods: Sequence[str], message: str) -> None:
        now = self._clock()
        body = status_apply(namespace, name, uid, self.driver, devices, condition(idle, now, message))
        self.kube.request("PATCH", claim_path(namespace, name) + "/status", body,
                          query={"fieldManager": FIELD_MANAGER, "force": "true"},
                          content_type="application/apply-patch+yaml")
        reason = EVENT_IDLE if idle else EVENT_ACTIVE
        for pod in pods:
            try:
                self.kube.create(f"/api/v1/namespaces/{namespace}/events",
                                 pod_event(namespace, pod, self.node, reason, message, now,
                                           "Warning" if idle else "Normal"))
            except KubeError as e:  # the condition is written; an Event is best effort
                log.warning("telemetry: cannot record event %s on pod %s/%s: %s", reason, namespace, pod, e)
