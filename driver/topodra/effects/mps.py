"""MPS: one control daemon per claim with MPS devices, serving their GPUs (MIG UUIDs for slices).

Last in the effect order, since it serves the instances the MIG effect makes.  The daemon's pipe and log
directories, its tmpfs (the containers' ``/dev/shm``) and its limits are claim-wide CDI edits; the same limits
are set on the daemon, and the GPUs the claim holds whole run EXCLUSIVE_PROCESS.  Hardware calls are
``sharing.mps``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence

from topodra.checkpoint import CheckpointData, CheckpointDevice, ClaimEntry
from topodra.claims import ClaimError, ClaimRef
from topodra.devices import Device
from topodra.effects.base import Devices, Mount, Recovered, sharing_of
from topodra.sharing import mps, mpscontrol, mpssweep
from topodra.sharing.config import Mps, Sharing
from topodra.sharing.mps import MpsDaemons, MpsError

log = logging.getLogger(__name__)


class MpsEffect:
    name = "mps"
    crash_point: str | None = None

    def __init__(self, daemons: MpsDaemons) -> None:
        self.daemons = daemons
        self._sweep_due = False  # a stop or a sweep failed: the next unprepare sweeps stray daemon pods

    def check(self, ref: ClaimRef, dev: Device, sharing: Sharing | None, working: CheckpointData,
              devices: Devices, node: str) -> None:
        if sharing is not None and sharing.strategy == "MPS" and dev.kind not in ("gpu", "mig"):
            raise ClaimError(f"claim {ref}: device {dev.name} is a {dev.kind} device; MPS needs a GPU or MIG slice")

    def device_edits(self, d: CheckpointDevice, dev: Device) -> tuple[Device, tuple[str, ...]]:
        return dev, ()

    def claim_edits(self, entry: ClaimEntry) -> tuple[list[str], list[Mount]]:
        """The daemon's container env and mounts (none without MPS devices)."""
        configs: list[tuple[Mps | None, str | None]] = [
            (d.sharing.mps, d.consumed_capacity.get("memory")) for d in sharing_of(entry, "MPS") if d.sharing]
        if not configs:
            return [], []
        first = configs[0][0] or Mps()
        if any((m or Mps()) != first for m, _ in configs):
            raise ClaimError(f"claim {entry.uid}: its requests ask for different MPS settings; one claim has one "
                             "MPS daemon, so they must agree")
        pipe, logs = self.daemons.dirs(entry.uid)
        return mps.claim_env(first, [mem for _m, mem in configs]), [
            (str(pipe), mps.CONTAINER_PIPE_DIR), (str(logs), mps.CONTAINER_LOG_DIR),
            (str(self.daemons.shm_dir(entry.uid)), mps.CONTAINER_SHM_DIR)]

    @staticmethod
    def _uuids(entry: ClaimEntry, devices: Mapping[str, Device]) -> list[str]:
        """What the daemon serves: the UUIDs (MIG UUIDs for slices) of the claim's MPS devices."""
        return [d.mig.uuid if d.mig is not None else devices[d.device_name].uuid for d in sharing_of(entry, "MPS")
                if d.device_name in devices]

    @staticmethod
    def _daemon_args(entry: ClaimEntry, devices: Mapping[str, Device]) -> tuple[list[str], list[str], list[str]]:
        """(UUIDs served, daemon limit commands, GPUs to run EXCLUSIVE_PROCESS): the whole GPUs the claim holds
        alone; a GPU shared by memory takes other claims' servers, and a MIG slice's parent serves other slices."""
        mine = [d for d in sharing_of(entry, "MPS") if d.device_name in devices]
        uuids = [d.mig.uuid if d.mig is not None else devices[d.device_name].uuid for d in mine]
        first = (mine[0].sharing.mps if mine and mine[0].sharing else None) or Mps()
        pairs = list(zip(uuids, mine, strict=True))
        limits = mpscontrol.limit_commands(first, [(u, d.consumed_capacity.get("memory")) for u, d in pairs])
        exclusive = [u for u, d in pairs if d.mig is None and d.access == "exclusive"]
        return uuids, limits, exclusive

    def used_by(self, entry: ClaimEntry, devices: Devices) -> bool:
        return bool(self._uuids(entry, devices))

    def apply(self, entry: ClaimEntry, applied: CheckpointData, devices: Devices) -> ClaimEntry:
        try:
            self.daemons.start(entry.uid, *self._daemon_args(entry, devices))  # MpsError leaves nothing behind
        except MpsError as e:
            raise ClaimError(f"claim {entry.ref}: {e}") from e
        return entry

    def undo(self, entries: Sequence[ClaimEntry], final: CheckpointData, devices: Devices) -> None:
        for e in entries:
            if sharing_of(e, "MPS"):
                try:
                    self.daemons.stop(e.uid)
                except MpsError as err:  # no entry records it any more: recovery's reconcile stops it
                    log.error("%s", err)
                    self._sweep_due = True  # its pod is not doomed: only a sweep deletes it

    def release_blocker(self, entry: ClaimEntry) -> str | None:
        return None

    # ---- outside the node lock (``effects.base.OutsideLock``): the daemon pods of --mps-daemon=pod ----

    @property
    def outside_lock(self) -> bool:
        return self.daemons.pods is not None

    def after_prepare(self, entries: Sequence[ClaimEntry], devices: Devices) -> dict[str, str]:
        """Each prepared MPS claim's daemon pod made (or found) and answering, with its limits; uid -> error.
        The claim stays prepared on an error: the kubelet retries the prepare, which comes back here."""
        if self.daemons.pods is None:
            return {}
        errors: dict[str, str] = {}
        for entry in entries:
            uuids, limits, _exclusive = self._daemon_args(entry, devices)
            if not uuids:
                continue
            try:
                self.daemons.launch_pod(entry.uid, uuids, limits)
            except MpsError as e:
                log.error("claim %s: %s", entry.ref, e)
                errors[entry.uid] = f"claim {entry.ref}: {e}"
        return errors

    def after_unprepare(self) -> dict[str, str]:
        """The pods of the daemons unprepare stopped, deleted and gone; uid -> error (tried again next time)."""
        return self.daemons.delete_pods()

    def sweep(self, recorded: Callable[[], Collection[str]], force: bool) -> list[str]:
        """Delete this node's daemon pods whose claim ``recorded()`` (the checkpoint's UIDs) lacks
        (``mpssweep``): always when ``force`` (plugin start, an unprepare that failed), else only after a stop
        or an earlier sweep failed.  The claim UIDs whose pod was deleted."""
        pods = self.daemons.pods
        if pods is None or not (force or self._sweep_due):
            return []
        self._sweep_due = False
        deleted, errors = mpssweep.sweep(pods.api, pods.namespace, pods.node, recorded)
        for uid, err in errors.items():
            log.error("%s%s", f"claim {uid}: " if uid else "", err)
        if errors:
            self._sweep_due = True
        return deleted

    def remove_strays(self, data: CheckpointData, devices: Devices) -> list[str]:
        """Stop daemons no prepared claim records (first of all effects: their servers hold MIG instances)."""
        try:
            stray = self.daemons.reconcile(e.uid for e in data.claims.values() if self._uuids(e, devices))
        except MpsError as e:
            log.error("cannot stop stray MPS daemons: %s", e)
            return []
        if stray:
            log.warning("stopped MPS daemons of claims no checkpoint entry records: %s", stray)
        return stray

    def recover(self, data: CheckpointData, devices: Devices) -> Recovered:
        """Start recorded daemons that are not running (after a reboot)."""
        remade: list[str] = []
        for entry in data.claims.values():
            uuids, limits, exclusive = self._daemon_args(entry, devices)
            if not uuids:
                continue
            try:
                if not self.daemons.alive(entry.uid):  # no answer in time: MpsError, left as it is
                    self.daemons.start(entry.uid, uuids, limits, exclusive)
                    log.warning("restarted the MPS daemon of claim %s", entry.ref)
                    remade.append(entry.uid)
            except MpsError as e:
                log.error("claim %s: %s", entry.ref, e)
        return Recovered(data, [], remade)
