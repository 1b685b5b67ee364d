"""A claim's checkpoint entry and CDI spec, planned against local devices and holders (no node state changes).

Planning is where a claim is refused before anything happens: an unknown device, a device another
claim holds without sharing, a sharing config an effect cannot honour.  The spec is derived from the
entry alone, with each GPU effect contributing its edits, so prepare, an idempotent repeat and
start-up recovery build it the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from topodra import cdi
from topodra.checkpoint import PREPARE_COMPLETED, Access, CheckpointData, CheckpointDevice, ClaimEntry
from topodra.claims import (
    AllocatedClaim,
    ClaimError,
    ClaimRef,
    FetchedClaim,
    UnavailableClaim,
    allocated_devices,
    held_by,
)
from topodra.devices import Device
from topodra.effects.base import GpuEffect
from topodra.hostdriver import HostDriver
from topodra.sharing import timeslice

log = logging.getLogger(__name__)

Planned = tuple[ClaimRef, ClaimEntry, dict[str, Any]]  # a new claim of the batch, its entry, its CDI spec


@dataclass(frozen=True)
class PreparedDevice:
    request_names: list[str]
    pool_name: str
    device_name: str
    cdi_device_ids: list[str]
    share_id: str | None = None


@dataclass(frozen=True)
class PrepareResult:
    devices: list[PreparedDevice] = field(default_factory=list)
    error: str = ""


def prepared_devices(entry: ClaimEntry) -> list[PreparedDevice]:
    """The answer for a prepared claim, from its entry (so a repeat answers exactly as the first time)."""
    return [PreparedDevice(request_names=list(d.request_names), pool_name=d.pool_name,
                           device_name=d.device_name, cdi_device_ids=list(d.cdi_device_ids),
                           share_id=d.share_id) for d in entry.devices]


def refuse(results: dict[str, PrepareResult], ref: ClaimRef, error: Exception, node: str) -> None:
    """One claim of the batch fails (the others go on): log why, answer the kubelet with the error."""
    log.warning("node %s: cannot prepare claim %s: %s", node, ref, error)
    results[ref.uid] = PrepareResult([], str(error))


def conflicts(new_access: Access, holder_access: Access) -> bool:
    if "admin" in (new_access, holder_access):
        return False  # admin access observes devices; it never takes them
    return not (new_access == "shared" and holder_access == "shared")


def holders(working: CheckpointData) -> dict[str, list[tuple[str, Access]]]:
    """Device name → (claim, access) of every prepared (or planned) claim using it."""
    out: dict[str, list[tuple[str, Access]]] = {}
    for entry in working.claims.values():
        for d in entry.devices:
            out.setdefault(d.device_name, []).append((entry.ref, d.access))
    return out


def users_of(data: CheckpointData, names: set[str]) -> list[tuple[str, list[str]]]:
    """(claim, the devices of ``names`` it uses) for every prepared claim using any."""
    out = []
    for entry in data.claims.values():
        gone = sorted({d.device_name for d in entry.devices} & names)
        if gone:
            out.append((entry.ref, gone))
    return out


def plan_batch(claims: Sequence[FetchedClaim], data: CheckpointData, devices: Mapping[str, Device],
               nvidia_ids: Callable[[], Mapping[str, str]], effects: Sequence[GpuEffect], driver_name: str,
               node: str, results: dict[str, PrepareResult], host: HostDriver | None = None,
               ) -> tuple[list[Planned], list[ClaimEntry]]:
    """(the batch's new claims, planned; the prepared entries asked for again).  UID clashes, unavailable
    and refused claims are answered in ``results``; each claim is checked against those planned before it."""
    ids: Mapping[str, str] | None = None  # read only when a new claim needs them
    working = data
    fresh: list[Planned] = []
    repeats: list[ClaimEntry] = []
    for c in claims:
        existing = data.claims.get(c.ref.uid)
        if existing is not None and (existing.namespace, existing.name) != (c.ref.namespace, c.ref.name):
            results[c.ref.uid] = PrepareResult([], f"claim {c.ref}: UID {c.ref.uid} is prepared on node "
                                                   f"{node} as claim {existing.ref}; not answered")
        elif existing is not None and isinstance(c, AllocatedClaim) and allocated_devices(c, node) != held_by(existing):
            # Only after a lost unprepare (a power loss undid its rename) and a new allocation of the same claim:
            # never answer the old devices. The cleanup pass releases the old entry; the kubelet retries.
            results[c.ref.uid] = PrepareResult([], f"claim {c.ref}: prepared on node {node} with other devices "
                                                   "than it is allocated now (an unprepare lost in a reboot); "
                                                   "the claim cleanup releases the old preparation, then retry")
        elif existing is not None:
            repeats.append(existing)
        elif isinstance(c, UnavailableClaim):
            results[c.ref.uid] = PrepareResult([], c.error)
        else:
            try:
                ids = nvidia_ids() if ids is None else ids
                entry, spec = plan(c, working, devices, ids, effects, driver_name, node, host)
            except (ClaimError, cdi.CDISpecInvalid) as e:
                refuse(results, c.ref, e, node)
                continue
            working = working.with_claim(entry)
            fresh.append((c.ref, entry, spec))
    return fresh, repeats


def plan(c: AllocatedClaim, working: CheckpointData, devices: Mapping[str, Device], nvidia_ids: Mapping[str, str],
         effects: Sequence[GpuEffect], driver_name: str, node: str,
         host: HostDriver | None = None) -> tuple[ClaimEntry, dict[str, Any]]:
    """The claim's entry (``PrepareCompleted``: it is written only once its effects exist) and valid CDI
    spec; ``ClaimError``/``cdi.CDISpecInvalid`` refuse it.  ``working``: prepared claims plus those
    planned before it in the batch."""
    held = holders(working)
    mine: dict[str, list[Access]] = {}
    entry_devices: list[CheckpointDevice] = []
    for a in c.devices:
        dev = devices.get(a.device)
        if dev is None:
            raise ClaimError(f"claim {c.ref}: device {a.device} is unknown on node {node}")
        for holder, access in held.get(a.device, []):
            if conflicts(a.access, access):
                raise ClaimError(f"claim {c.ref}: device {a.device} on node {node} is already in "
                                 f"use by claim {holder} ({access}); this allocation is {a.access}")
        if any(conflicts(a.access, m) for m in mine.get(a.device, [])):
            raise ClaimError(f"claim {c.ref}: device {a.device} is allocated twice in this claim "
                             "without sharing")
        mine.setdefault(a.device, []).append(a.access)
        for effect in effects:
            effect.check(c.ref, dev, a.sharing, working, devices, node)
        ids = [cdi.qualified_id(driver_name, cdi.device_name(c.ref.uid, a.device, a.share_id))]
        if a.device in nvidia_ids:
            ids.append(nvidia_ids[a.device])
        entry_devices.append(CheckpointDevice(
            request_names=[a.request] if a.request else [], pool_name=node, device_name=a.device,
            cdi_device_ids=ids, share_id=a.share_id, access=a.access, consumed_capacity=dict(a.consumed),
            sharing=a.sharing))
    entry = ClaimEntry(uid=c.ref.uid, namespace=c.ref.namespace, name=c.ref.name, state=PREPARE_COMPLETED,
                       devices=entry_devices)
    return entry, spec_for(entry, devices, effects, driver_name, node, host)


def spec_for(entry: ClaimEntry, devices: Mapping[str, Device], effects: Sequence[GpuEffect], driver_name: str,
             node: str, host: HostDriver | None = None) -> dict[str, Any]:
    """The claim's valid CDI spec from current device facts (device nodes may move on reboot) and what its
    entry records; ``ClaimError`` when a device is gone, ``cdi.CDISpecInvalid`` when the result breaks CDI."""
    sds = []
    for d in entry.devices:
        dev = devices.get(d.device_name)
        if dev is None:
            raise ClaimError(f"claim {entry.ref}: device {d.device_name} is no longer present on node "
                             f"{node}; cannot re-create its CDI spec")
        extra = timeslice.sharing_env(cdi.env_fragment(dev.name), d.sharing)
        for effect in effects:
            dev, more = effect.device_edits(d, dev)
            extra += more
        sds.append(cdi.SpecDevice(dev, d.share_id, d.consumed_capacity, extra))
    env: list[str] = []
    mounts: list[tuple[str, str]] = []
    for effect in effects:
        more_env, more_mounts = effect.claim_edits(entry)
        env += more_env
        mounts += more_mounts
    return cdi.valid_spec(driver_name, entry.uid, sds, env, mounts, host)


@dataclass(frozen=True)
class Planner:
    """What planning needs of the node, fixed for the plugin's life: the effects, the names, the host driver."""

    effects: tuple[GpuEffect, ...]
    driver_name: str
    node: str
    host: HostDriver | None = None

    def batch(self, claims: Sequence[FetchedClaim], data: CheckpointData, devices: Mapping[str, Device],
              nvidia_ids: Callable[[], Mapping[str, str]], results: dict[str, PrepareResult],
              ) -> tuple[list[Planned], list[ClaimEntry]]:
        return plan_batch(claims, data, devices, nvidia_ids, self.effects, self.driver_name, self.node, results,
                          self.host)

    def spec(self, entry: ClaimEntry, devices: Mapping[str, Device]) -> dict[str, Any]:
        return spec_for(entry, devices, self.effects, self.driver_name, self.node, self.host)
