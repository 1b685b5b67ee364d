"""A ResourceClaim as prepare needs it: checked once, reduced to what this node uses.

The gRPC layer reads each claim from the API server (before any lock) and runs
``allocated_claim`` on it once: UID, allocation, driver and node are checked and
subrequest names stripped here, so ``DeviceState`` receives only plain, valid
values and does local work.  Everything in this module is pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from topodra.checkpoint import Access, ClaimEntry
from topodra.sharing.config import ConfigError, Sharing, resolve


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it: enough to unprepare, and to fetch it for prepare."""

    namespace: str
    uid: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


@dataclass(frozen=True)
class AllocatedDevice:
    """One allocation result of our driver: a device of this node and how it may be shared."""

    request: str  # main request name (``gpus/h100`` arrives as ``gpus``); "" if the API sent none
    device: str
    share_id: str | None
    access: Access
    consumed: tuple[tuple[str, str], ...] = ()  # consumedCapacity of a shared allocation: (name, quantity)
    sharing: Sharing | None = None  # the GpuConfig sharing that applies to its request (topodra.sharing.config)


@dataclass(frozen=True)
class AllocatedClaim:
    """A claim that passed every check that needs only its API object."""

    ref: ClaimRef
    devices: tuple[AllocatedDevice, ...]


@dataclass(frozen=True)
class UnavailableClaim:
    """A claim whose API object could not be read or used; ``error`` names the claim and why.

    Prepare still answers it from the checkpoint when it is already prepared (the kubelet may
    repeat prepare after the object is gone), and with ``error`` otherwise.
    """

    ref: ClaimRef
    error: str


FetchedClaim = AllocatedClaim | UnavailableClaim


class ClaimError(Exception):
    """A claim cannot be prepared; the message names the claim and the reason."""


# Kubernetes' own rules for the names the kubelet sends (a namespace is a DNS-1123 label, a claim name a
# DNS-1123 subdomain); a UID is an apiserver-made UUID, allowed here as any short [A-Za-z0-9._-] word.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_UID = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,126}[A-Za-z0-9])?")
SHOWN_CHARS = 80  # how much of a bad value an error quotes


def shown(value: str) -> str:
    """``value`` quoted for an error message, cut to ``SHOWN_CHARS`` (requests may carry megabytes)."""
    if len(value) <= SHOWN_CHARS:
        return repr(value)
    return f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"


def ref_problem(namespace: str, uid: str, name: str) -> str | None:
    """Why a claim reference from the kubelet cannot be a real ResourceClaim (pure); None when it can.

    The UID also names the claim's CDI spec file, so this is what keeps ``/``, ``..`` and NUL out of paths.
    """
    problems = []
    if not _UID.fullmatch(uid) or ".." in uid:
        problems.append(f"uid {shown(uid)} is not a Kubernetes UID")
    if not _DNS_LABEL.fullmatch(namespace):
        problems.append(f"namespace {shown(namespace)} is not a DNS-1123 label")
    if len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
        problems.append(f"name {shown(name)} is not a DNS-1123 subdomain")
    return "; ".join(problems) or None


def base_request_name(request: str) -> str:
    """``gpus/h100`` → ``gpus``: pods can reference only main request names."""
    return request.split("/", 1)[0]


def access_of(result: dict[str, Any]) -> Access:
    """How an allocation result may overlap others on the same device."""
    if result.get("adminAccess"):
        return "admin"
    if result.get("shareID") or result.get("consumedCapacity"):
        return "shared"
    return "exclusive"


HeldDevice = tuple[str, str, str | None]
"""(pool, device, shareID) of one device a checkpoint entry holds, as its allocation result names it."""


def result_device(result: dict[str, Any]) -> HeldDevice:
    """(pool, device, shareID) of one allocation result."""
    share = result.get("shareID")
    return str(result.get("pool", "")), str(result.get("device", "")), str(share) if share else None


def allocated_claim(ref: ClaimRef, obj: dict[str, Any] | None, driver_name: str, pool_name: str,
                    node_name: str) -> AllocatedClaim:
    """Check a fetched ResourceClaim (None: not found) against ``ref``, our driver and this node."""
    if obj is None:
        raise ClaimError(f"claim {ref}: ResourceClaim not found")
    api_uid = (obj.get("metadata") or {}).get("uid")
    if api_uid != ref.uid:
        raise ClaimError(f"claim {ref}: ResourceClaim was replaced (the API has UID {api_uid})")
    allocation = (obj.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"claim {ref}: ResourceClaim is not allocated")
    results = (allocation.get("devices") or {}).get("results") or []
    ours = [r for r in results if r.get("driver") == driver_name]
    if not ours:
        others = sorted({str(r.get("driver")) for r in results})
        raise ClaimError(f"claim {ref}: no devices allocated from driver {driver_name} "
                         f"(allocated drivers: {others or 'none'})")
    try:
        sharing = resolve((allocation.get("devices") or {}).get("config") or [], driver_name,
                          [str(r.get("request", "")) for r in ours])
    except ConfigError as e:
        raise ClaimError(f"claim {ref}: {e}") from None
    devices: list[AllocatedDevice] = []
    for r in ours:
        pool, name, share_id = result_device(r)
        if pool != pool_name:
            raise ClaimError(f"claim {ref}: device {pool}/{name} is from pool {pool}, but this is node "
                             f"{node_name} (pool {pool_name}); the claim is for another node")
        consumed = tuple(sorted((str(k), str(v)) for k, v in (r.get("consumedCapacity") or {}).items()))
        devices.append(AllocatedDevice(request=base_request_name(str(r.get("request", ""))), device=name,
                                       share_id=share_id, access=access_of(r),
                                       consumed=consumed, sharing=sharing[str(r.get("request", ""))]))
    return AllocatedClaim(ref, tuple(devices))




def held_by(entry: ClaimEntry) -> frozenset[HeldDevice]:
    """What a checkpoint entry holds."""
    return frozenset((d.pool_name, d.device_name, d.share_id) for d in entry.devices)


def allocated_devices(claim: AllocatedClaim, pool_name: str) -> frozenset[HeldDevice]:
    """What a checked claim's allocation names (all of this node's pool)."""
    return frozenset((pool_name, d.device, d.share_id) for d in claim.devices)


def release_reason(ref: ClaimRef, obj: dict[str, Any] | None, held: frozenset[HeldDevice],
                   driver_name: str) -> str | None:
    """Why a prepared claim no longer needs the devices it holds on this node (pure); None while it may.

    ``obj``: its ResourceClaim now (None: not found); ``held``: what its checkpoint entry holds.
    Deleted or replaced (a UID is never reused) is final. So is an allocation that no longer names
    exactly these devices of our driver: the kube-controller-manager's resourceclaim controller
    clears ``status.allocation`` once the claim's last consumer is done or gone (a pod in a terminal
    phase, deleted and never scheduled, or no longer in the API, which short of a forced deletion
    happens only after the kubelet stopped its containers: Kubernetes v1.37.2
    ``pkg/controller/resourceclaim/controller.go``, ``syncClaim`` and ``isPodDone``), so no container
    of the claim runs, and the scheduler may give the devices to another claim; a new allocation of
    the same claim is a new preparation. Such an entry is what an unprepare whose checkpoint rename a
    power loss undid leaves behind (docs/prepare.md, *Durability*).
    """
    if obj is None:
        return "its ResourceClaim was deleted"
    api_uid = (obj.get("metadata") or {}).get("uid")
    if api_uid != ref.uid:
        return f"its ResourceClaim was replaced (the API has UID {api_uid})"
    allocation = (obj.get("status") or {}).get("allocation")
    if not allocation:
        return "its ResourceClaim is no longer allocated"
    now = frozenset(result_device(r) for r in (allocation.get("devices") or {}).get("results") or []
                    if r.get("driver") == driver_name)
    if now != held:
        return "its ResourceClaim is allocated other devices now"
    return None
