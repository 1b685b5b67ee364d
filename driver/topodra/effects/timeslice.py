"""Time slicing: the GPU's time-slice level, set while a prepared claim asks for a non-default one.

The level belongs to the whole GPU, so this effect's state is a function of the checkpoint: every GPU
has the level its prepared claims ask for, else Default.  Apply, undo and recovery all set the levels
``sharing.timeslice.desired_levels`` gives for some set of claims; the hardware call is its ``apply``.

A real host's tool cannot read a level back (``NvidiaSmiTimeSlice.get_timeslice`` is None), so recovery cannot
see a level that a killed prepare set before its checkpoint write, or that a killed unprepare did not set back
after its own.  The intent file (``TimeSliceIntents``) names each GPU that apply may have changed, written
before the change and cleared once the GPU is back at Default: recovery sets those that no entry wants back
to Default, and leaves every other GPU (an admin's level) alone.  Found by the GPU-effect crash campaign
(``bench/reliability/gpueffects.py``; docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from topodra.atomicfile import remove, remove_stale_temps, write_atomic
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


class TimeSliceIntents:
    """``<state_dir>/timeslice-intents.json``: the GPUs whose level this plugin may have moved off Default and not
    yet set back (see the module).  One owner, ``TimeSliceEffect``, under the node lock; read again on every call
    (a second plugin process may share the directory).  Unreadable: logged and taken as empty (a level may then
    stay, as before this file existed; nothing of an admin's is ever reset)."""

    FILE_NAME = "timeslice-intents.json"

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.path = Path(state_dir) / self.FILE_NAME

    def clean_temps(self) -> list[Path]:
        """Remove temp files of a write a kill cut short (at start, under the node lock)."""
        return remove_stale_temps(self.path.parent, self.FILE_NAME)

    def gpus(self) -> set[str]:
        try:
            raw = json.loads(self.path.read_bytes())
            return {str(u) for u in raw["gpus"]}
        except FileNotFoundError:
            return set()
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.error("cannot read the time-slice intent file %s (levels a crash left stay): %s", self.path, e)
            return set()

    def record(self, gpus: Iterable[str]) -> None:
        """Before setting a level: on disk when this returns (OSError: the level must not be set)."""
        old = self.gpus()
        if not set(gpus) <= old:
            self._write(old | set(gpus))

    def settle(self, gpus: Iterable[str]) -> None:
        """Make the file name exactly ``gpus``; never raises (a stale GPU is set to what entries want, again)."""
        want = set(gpus)
        try:
            if self.gpus() != want:
                self._write(want)
        except OSError as e:
            log.error("cannot update the time-slice intent file %s: %s", self.path, e)

    def _write(self, gpus: set[str]) -> None:
        if not gpus:
            remove(self.path)
            return
        write_atomic(self.path, json.dumps({"version": 1, "gpus": sorted(gpus)}).encode(), mode=0o600, sync="data")


class TimeSliceEffect:
    """``control`` None: this node cannot set levels, so claims asking a non-default one fail.  ``intents``:
    the intent file (None: recovery resets only levels it can read, enough where the control reads them)."""

    name = "timeslice"
    crash_point: str | None = None

    def __init__(self, control: TimeSliceControl | None, intents: TimeSliceIntents | None = None) -> None:
        self.control = control
        self.intents = intents

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

    def _settle(self, data: CheckpointData, devices: Devices, gpus: set[str]) -> None:
        """After ``gpus`` were set to what ``data`` wants: those now at Default leave the intent file."""
        if self.intents is not None and gpus:
            wanted = {u for u, _level in uses(data, devices)}
            self.intents.settle(self.intents.gpus() - (gpus - wanted))

    def apply(self, entry: ClaimEntry, applied: CheckpointData, devices: Devices) -> ClaimEntry:
        gpus = gpus_of(entry, devices)
        if self.intents is not None and self.control is not None:
            try:
                self.intents.record(gpus)
            except OSError as e:
                raise ClaimError(f"claim {entry.ref}: cannot write the time-slice intent file "
                                 f"{self.intents.path}: {e}") from e
        try:
            self._set(applied.with_claim(entry), devices, gpus)
        except TimeSliceError as e:
            with contextlib.suppress(TimeSliceError):  # what it set goes back; a failure is recovery's
                self._set(applied, devices, gpus)
                self._settle(applied, devices, gpus)
            raise ClaimError(f"claim {entry.ref}: {e}") from e
        return entry

    def undo(self, entries: Sequence[ClaimEntry], final: CheckpointData, devices: Devices) -> None:
        gpus = set().union(*(gpus_of(e, devices) for e in entries)) if entries else set()
        try:
            self._set(final, devices, gpus)
        except TimeSliceError as e:
            log.error("cannot set time-slice levels back (the next start retries): %s", e)
            return
        self._settle(final, devices, gpus)

    def release_blocker(self, entry: ClaimEntry) -> str | None:
        return None

    def remove_strays(self, data: CheckpointData, devices: Devices) -> list[str]:
        """Nothing of its own to tear down first: ``recover`` sets every level to what ``data`` asks."""
        return []

    def recover(self, data: CheckpointData, devices: Devices) -> Recovered:
        """Levels set by a prepare that crashed before its checkpoint write, or left by a crashed unprepare,
        go back: on the GPUs of the intent file always, elsewhere where the level can be read (a GPU whose
        level cannot be read, should be Default and is in no intent is left alone: an admin's, or nobody's)."""
        gpus = {d.uuid for d in devices.values() if d.kind == "gpu" and d.uuid}
        if self.intents is not None:
            self.intents.clean_temps()
        intended = self.intents.gpus() if self.intents is not None else set()
        stray = sorted(u for u in intended - {u for u, _level in uses(data, devices)} if u in gpus)
        try:
            self._set(data, devices, gpus - intended, unknown_default=False)
            self._set(data, devices, gpus & intended)  # set even where unreadable: this plugin moved them
        except TimeSliceError as e:
            log.error("cannot reconcile GPU time-slice levels: %s", e)
            return Recovered(data)
        if self.intents is not None:
            self.intents.settle((intended - gpus) | {u for u, _level in uses(data, devices)})
        return Recovered(data, stray=stray)
