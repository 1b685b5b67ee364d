"""Time slicing: the GPU's time-slice level, set while a prepared claim asks for a non-default one.

The level belongs to the whole GPU, so this effect's state is a function of the checkpoint: every GPU
has the level its prepared claims ask for, else Default.  Apply, undo and recovery all set the levels
``sharing.timeslice.desired_levels`` gives for some set of claims; the hardware call is its ``apply``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

from topodra.checkpoint import CheckpointData, CheckpointDevice, ClaimEntry
from topodra.claims import ClaimError, ClaimRef
from topodra.devices import Device
from topodra.effects.base import Devices, Mount, Recovered
from topodra.sharing import timeslice
from topodra.sharing.config import TIMESLICE_LEVEL, Sharing
from topodra.sharing.timeslice import TimeSliceControl, TimeSliceError

log = logging.getLogger(__name__)

_INTERVAL_NAME = {v: k for k, v in TIMESLICE_LEVEL.items()}


def uses(data: CheckpointData, devices: Devices) -> list[tuple[str, int]]:
    """(GPU UUID, level) of every prepared device with a non-default TimeSlicing config (pure)."""
    out = []
    for e in data.claims.values():
        for d in e.devices:
            dev = devices.get(d.device_name)
            level = timeslice.level_of(d.sharing)
            if dev is not None and dev.uuid and level != timeslice.DEFAULT_LEVEL:
                out.append((dev.uuid, level))
    return out


def gpus_of(entry: ClaimEntry, devices: Devices) -> set[str]:
    """The UUIDs of the GPUs this claim asks a non-default level of."""
    return {devices[d.device_name].uuid for d in entry.devices
            if d.device_name in devices and devices[d.device_name].uuid
            and timeslice.level_of(d.sharing) != timeslice.DEFAULT_LEVEL}


class TimeSliceEffect:
    """``control`` None: this node cannot set levels, so claims asking a non-default one fail."""

    name = "timeslice"
    crash_point: str | None = None

    def __init__(self, control: TimeSliceControl | None) -> None:
        self.control = control

    def check(self, ref: ClaimRef, dev: Device, sharing: Sharing | None, working: CheckpointData,
              devices: Devices, node: str) -> None:
        if sharing is None or sharing.strategy != "TimeSlicing":
            return
        if dev.kind != "gpu":
            raise ClaimError(f"claim {ref}: device {dev.name} is a {dev.kind} device; time slicing is a property of a "
                             "whole GPU (a MIG slice has its own compute and needs none)")
        level = timeslice.level_of(sharing)
        if level == timeslice.DEFAULT_LEVEL:
            return
        if self.control is None:
            raise ClaimError(f"claim {ref}: device {dev.name}: node {node} cannot set time-slice levels")
        held = timeslice.conflict(uses(working, devices), dev.uuid, level)
        if held is not None:
            raise ClaimError(f"claim {ref}: device {dev.name} already runs with time-slice interval "
                             f"{_INTERVAL_NAME[held]} for another prepared claim; this claim asks for "
                             f"{sharing.interval} (one GPU has one interval)")

    def device_edits(self, d: CheckpointDevice, dev: Device) -> tuple[Device, tuple[str, ...]]:
        return dev, ()

    def claim_edits(self, entry: ClaimEntry) -> tuple[list[str], list[Mount]]:
        return [], []

    def used_by(self, entry: ClaimEntry, devices: Devices) -> bool:
        return bool(gpus_of(entry, devices))

    def _set(self, data: CheckpointData, devices: Devices, gpus: set[str], *, unknown_default: bool = True) -> None:
        """Bring the level of ``gpus`` in line with ``data``; TimeSliceError on failure."""
        if self.control is None or not gpus:
            return
        levels = timeslice.desired_levels(uses(data, devices), gpus)
        timeslice.apply(self.control, {u: v for u, v in levels.items() if u in gpus}, unknown_default=unknown_default)

    def apply(self, entry: ClaimEntry, applied: CheckpointData, devices: Devices) -> ClaimEntry:
        gpus = gpus_of(entry, devices)
        try:
            self._set(applied.with_claim(entry), devices, gpus)
        except TimeSliceError as e:
            with contextlib.suppress(TimeSliceError):  # what it set goes back; a failure is recovery's
                self._set(applied, devices, gpus)
            raise ClaimError(f"claim {entry.ref}: {e}") from e
        return entry

    def undo(self, entries: Sequence[ClaimEntry], final: CheckpointData, devices: Devices) -> None:
        gpus = set().union(*(gpus_of(e, devices) for e in entries)) if entries else set()
        try:
            self._set(final, devices, gpus)
        except TimeSliceError as e:
            log.error("cannot set time-slice levels back (the next start retries): %s", e)

    def release_blocker(self, entry: ClaimEntry) -> str | None:
        return None

    def remove_strays(self, data: CheckpointData, devices: Devices) -> list[str]:
        """Nothing of its own to tear down first: ``recover`` sets every level to what ``data`` asks."""
        return []

    def recover(self, data: CheckpointData, devices: Devices) -> Recovered:
        """Levels set by a prepare that crashed before its checkpoint write, or left by a crashed unprepare,
        go back; a GPU whose level cannot be read and should be Default is left alone."""
        try:
            self._set(data, devices, {d.uuid for d in devices.values() if d.kind == "gpu" and d.uuid},
                      unknown_default=False)
        except TimeSliceError as e:
            log.error("cannot reconcile GPU time-slice levels: %s", e)
        return Recovered(data)
