"""Start-up recovery's rules: what the effects reconcile, which specs are written again, when the
checkpoint is saved, and how the outcome is reported.  ``DeviceState.recover`` does the IO under the lock.

After a crash, node state may hold more than the checkpoint records (a prepare died before its write, an
unprepare after it), never less, except after a reboot, when what the entries record is gone and is
made again.  Each effect's ``recover`` handles both directions for its kind of state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from topodra.checkpoint import CheckpointData
from topodra.devices import Device
from topodra.effects.base import GpuEffect, Recovered

log = logging.getLogger(__name__)


def read_boot_id(path: str) -> str:
    """This boot's ID ("" when unreadable: reboot detection is then off, and the recorded ID is kept)."""
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        log.warning("cannot read boot ID from %s (%s); reboot detection is off", path, e)
        return ""


@dataclass(frozen=True)
class RecoveryReport:
    """What startup recovery did, for logs and tests."""

    rebooted: bool = False
    rolled_back: list[str] = field(default_factory=list)
    recreated: list[str] = field(default_factory=list)
    unrecoverable: dict[str, str] = field(default_factory=dict)
    orphan_specs: list[str] = field(default_factory=list)  # kept: only after a quarantined checkpoint
    orphans_removed: list[str] = field(default_factory=list)
    quarantined: str | None = None
    stray: dict[str, list[str]] = field(default_factory=dict)   # effect name → state no entry recorded, removed
    remade: dict[str, list[str]] = field(default_factory=dict)  # effect name → claims whose state was made again

    @property
    def mig_destroyed(self) -> list[str]:
        """``<GPU UUID>/<GI>`` of MIG instances nothing recorded."""
        return self.stray.get("mig", [])

    @property
    def mig_recreated(self) -> list[str]:
        """Claim UIDs whose recorded MIG instance was made again."""
        return self.remade.get("mig", [])


def reconcile(effects: Sequence[GpuEffect], data: CheckpointData, devices: Mapping[str, Device]
              ) -> tuple[CheckpointData, dict[str, Recovered]]:
    """Tear down what no entry records in reverse effect order, as unprepare does (an MPS server still on a
    stray MIG instance would make NVML refuse its destroy: nvml.h, nvmlComputeInstanceDestroy, "NVML_ERROR_IN_USE
    ... if processes (e.g. CUDA application) are active on the compute instance"); then each effect's recover in
    order (a later one sees what an earlier one re-made: MPS the new MIG UUID)."""
    stray = {effect.name: effect.remove_strays(data, devices) for effect in reversed(effects)}
    done: dict[str, Recovered] = {}
    for effect in effects:
        r = effect.recover(data, devices)
        data = r.data
        done[effect.name] = replace(r, stray=stray[effect.name] + r.stray)
    return data, done


def specs_to_write(before: CheckpointData, after: CheckpointData, rebooted: bool,
                   spec_exists: Callable[[str], bool]) -> list[str]:
    """Claims whose spec is written again: all after a reboot, those whose entry recovery changed (a
    re-made MIG instance has a new UUID), and those whose spec is missing (specs are not fsynced)."""
    return [uid for uid, entry in after.claims.items()
            if rebooted or before.claims.get(uid) != entry or not spec_exists(uid)]


def must_save(loaded: CheckpointData | None, after: CheckpointData, before: CheckpointData, rolled_back: bool,
              boot_id: str) -> bool:
    """Whether recovery writes the checkpoint: it changed, or it records another boot (no file: nothing to say)."""
    if loaded is None:
        return False
    return rolled_back or after != before or bool(boot_id and loaded.boot_id != boot_id)


def log_report(node: str, cdi_root: object, r: RecoveryReport) -> None:
    if r.quarantined:
        log.warning("node %s: corrupt checkpoint moved to %s; started empty", node, r.quarantined)
    if r.rebooted:
        log.warning("node %s: boot ID changed (node rebooted); re-created CDI specs of %d prepared "
                    "claims", node, len(r.recreated))
    elif r.recreated:
        log.warning("node %s: re-created missing CDI specs for claims %s", node, r.recreated)
    if r.rolled_back:
        log.warning("node %s: rolled back interrupted prepares of claims %s", node, r.rolled_back)
    if r.mig_destroyed:
        log.warning("node %s: destroyed MIG instances no prepared claim records: %s", node, r.mig_destroyed)
    if r.mig_recreated:
        log.warning("node %s: re-created lost MIG instances of claims %s", node, r.mig_recreated)
    for uid, why in r.unrecoverable.items():
        log.error("node %s: claim %s: %s", node, uid, why)
    if r.orphans_removed:
        log.warning("node %s: removed CDI specs of claims %s left by a prepare that crashed before its "
                    "checkpoint write (the kubelet got no answer for them)", node, r.orphans_removed)
    if r.orphan_specs:
        log.warning("node %s: CDI specs for claims %s in %s have no checkpoint entry; left in place "
                    "(remove them once no pod uses those claims)", node, r.orphan_specs, cdi_root)
