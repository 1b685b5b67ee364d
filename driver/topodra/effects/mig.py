"""MIG placement devices: a GPU and compute instance per allocated slice, made at prepare.

The instance exists only from prepare to unprepare; its MIG UUID and capability device nodes go into the
claim's CDI spec, and the checkpoint entry records it (``CheckpointDevice.mig``).  It comes first in the
effect order: the spec and an MPS daemon need its UUID.  Hardware calls are ``sharing.instances``'s; the
intent journal (``migjournal``) is what lets recovery tell topodra's unrecorded instances from others'.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

from topodra.checkpoint import CheckpointData, CheckpointDevice, ClaimEntry
from topodra.claims import ClaimError, ClaimRef
from topodra.devices import Device
from topodra.effects.base import Devices, Mount, Recovered
from topodra.effects.migjournal import MigJournal
from topodra.sharing.config import Sharing
from topodra.sharing.instances import MigError, MigInstance, MigInstances, PlacementKey, placement_key
from topodra.sharing.mig import placement_of

log = logging.getLogger(__name__)


class MigEffect:
    """``instances`` None: this plugin has no NVML access, so claims on MIG devices fail.  ``journal``: the
    intent journal in the plugin's state directory."""

    name = "mig"
    crash_point: str | None = "after-mig-created"  # instances of the batch made, no spec or checkpoint yet

    def __init__(self, instances: MigInstances | None, journal: MigJournal) -> None:
        self.instances = instances
        self.journal = journal

    def check(self, ref: ClaimRef, dev: Device, sharing: Sharing | None, working: CheckpointData,
              devices: Devices, node: str) -> None:
        return  # whether an instance fits is NVML's answer, at apply

    def device_edits(self, d: CheckpointDevice, dev: Device) -> tuple[Device, tuple[str, ...]]:
        if d.mig is None:
            return dev, ()
        caps = self._caps(dev, d.mig)
        return dev.model_copy(update={"uuid": d.mig.uuid, "device_nodes": (*dev.device_nodes, *caps),
                                      "device_node_modes": {**dev.device_node_modes, **caps}}), ()

    def _caps(self, dev: Device, inst: MigInstance) -> dict[str, int]:
        """The instance's capability nodes and their modes, to go after the parent's ``/dev/nvidiaN`` (this
        host's GPUs only; mock hardware has none)."""
        if not dev.device_nodes:
            return {}
        if self.instances is None:
            raise ClaimError(f"device {dev.name}: no NVML access to find its MIG capability device nodes")
        try:
            minor = int(str(dev.attributes["parentDevice"].value).removeprefix("gpu-"))
            return self.instances.cap_device_node_modes(inst, minor)
        except (KeyError, ValueError, MigError) as e:
            raise ClaimError(f"device {dev.name}: {e}") from e

    def claim_edits(self, entry: ClaimEntry) -> tuple[list[str], list[Mount]]:
        return [], []

    def used_by(self, entry: ClaimEntry, devices: Devices) -> bool:
        return any(devices[d.device_name].kind == "mig" for d in entry.devices if d.device_name in devices)

    def apply(self, entry: ClaimEntry, applied: CheckpointData, devices: Devices) -> ClaimEntry:
        """The entry with an instance created and recorded for each MIG device; on failure none is left.

        The placements go into the journal first (one write per claim), so an instance a crash leaves
        unrecorded is known at the next start as topodra's; they stay there until ``undo`` destroys the
        instance, which covers a crash between unprepare's checkpoint write and the undo too."""
        mig = [d for d in entry.devices if devices[d.device_name].kind == "mig"]
        if not mig:
            return entry
        if self.instances is None:
            raise ClaimError(f"claim {entry.ref}: {mig[0].device_name} is a MIG device, but this plugin has "
                             "no NVML access to create MIG instances")
        try:
            placements = {d.device_name: placement_of(devices[d.device_name]) for d in mig}
        except ValueError as e:
            raise ClaimError(f"claim {entry.ref}: {e}") from e
        try:
            self.journal.record(placement_key(p) for p in placements.values())
        except OSError as e:
            raise ClaimError(f"claim {entry.ref}: cannot write the MIG intent journal {self.journal.path}: {e}") \
                from e
        out: list[CheckpointDevice] = []
        made: list[MigInstance] = []
        left: list[PlacementKey] = []  # placements a failed create may still hold an instance at
        try:
            for d in entry.devices:
                p = placements.get(d.device_name)
                if p is None:
                    out.append(d)
                    continue
                try:
                    inst = self.instances.create(p)
                except MigError as e:
                    if e.left_behind:
                        left.append(placement_key(p))
                    raise ClaimError(f"claim {entry.ref}: {d.device_name}: {e}") from e
                made.append(inst)
                out.append(d.model_copy(update={"mig": inst}))
        except ClaimError:
            gone = self._destroy(made)
            # Keep what may still exist: a half-made instance, one whose destroy failed, and (never expected:
            # the scheduler allocates a placement once) a placement another prepared claim's instance holds.
            keep = {*left, *(i.placement_key for i in made if i not in gone),
                    *(d.mig.placement_key for e in applied.claims.values() for d in e.devices if d.mig is not None)}
            self.journal.forget(k for k in map(placement_key, placements.values()) if k not in keep)
            raise
        return entry.model_copy(update={"devices": out})

    def undo(self, entries: Sequence[ClaimEntry], final: CheckpointData, devices: Devices) -> None:
        gone = self._destroy([m for e in entries for m in e.mig_instances])
        self.journal.forget(i.placement_key for i in gone)

    def _destroy(self, instances: Sequence[MigInstance]) -> list[MigInstance]:
        """Those destroyed or already gone; a failure is logged (recovery retries if the intent stays)."""
        if self.instances is None:
            return []
        gone: list[MigInstance] = []
        for inst in instances:
            try:
                self.instances.destroy(inst)  # already gone (e.g. after a reboot) is fine
            except MigError as e:
                log.error("%s", e)
                continue
            gone.append(inst)
        return gone

    def release_blocker(self, entry: ClaimEntry) -> str | None:
        if entry.mig_instances and self.instances is None:
            return f"claim {entry.ref}: has MIG instances, but this plugin has no NVML access to destroy them"
        return None

    @staticmethod
    def _recorded(data: CheckpointData) -> list[MigInstance]:
        return [d.mig for e in data.claims.values() for d in e.devices if d.mig is not None]

    def _parents(self, recorded: Sequence[MigInstance], intents: Collection[PlacementKey],
                 devices: Devices) -> list[str]:
        return sorted({str(d.attributes["parentUUID"].value) for d in devices.values()
                       if d.kind == "mig" and "parentUUID" in d.attributes}
                      | {r.parent_uuid for r in recorded} | {k[0] for k in intents})

    def remove_strays(self, data: CheckpointData, devices: Devices) -> list[str]:
        """Destroy instances topodra made (journalled) that no entry records; leave everyone else's.  Last of
        all effects, after the MPS daemons that may run on them are stopped."""
        if self.instances is None:
            return []
        recorded, intents = self._recorded(data), self.journal.keys()
        parents = self._parents(recorded, intents, devices)
        if not parents:
            return []
        try:
            stray, _foreign = self.instances.reconcile(parents, recorded, intents)
        except Exception as e:  # NVML failed (any NVMLError): prepared claims keep working; next start retries
            log.error("cannot reconcile MIG instances: %s", e)
            return []
        return [f"{i.parent_uuid}/{i.gpu_instance}" for i in stray]

    def recover(self, data: CheckpointData, devices: Devices) -> Recovered:
        """Re-create recorded instances that are gone; settle the journal once no stray is left."""
        self.journal.clean_temps()  # a kill mid-write leaves one (found by the GPU-effect crash campaign)
        if self.instances is None:
            return Recovered(data)
        recorded, intents = self._recorded(data), self.journal.keys()
        parents = self._parents(recorded, intents, devices)
        if not parents:
            return Recovered(data)
        try:
            existing = self.instances.existing(parents)
        except Exception as e:  # NVML failed (any NVMLError): prepared claims keep working; next start retries
            log.error("cannot list MIG instances: %s", e)
            return Recovered(data)
        present = {i.key for i in existing}
        keep, mine = {r.key for r in recorded}, set(intents)
        left = [i for i in existing if i.key not in keep and i.placement_key in mine]
        if left:  # remove_strays failed: their intents stay, so the next start destroys them
            log.error("MIG instances no entry records are still there (the next start retries): %s",
                      [f"{i.parent_uuid}/{i.gpu_instance}" for i in left])
            return Recovered(data)
        # Settled: the journal now holds exactly the recorded instances that exist (those of a checkpoint
        # written before the journal existed join it, so their unprepare is covered too).
        self.journal.settle({r.placement_key for r in recorded if r.key in present and min(r.start, r.profile_id) >= 0})
        remade: list[str] = []
        for entry in list(data.claims.values()):
            if not any(d.mig is not None and d.mig.key not in present for d in entry.devices):
                continue
            stripped = entry.model_copy(update={"devices": [d.model_copy(update={"mig": None})
                                                            for d in entry.devices]})  # fmt: skip
            try:
                fresh = self.apply(stripped, data, devices)
                self._destroy([m for m in entry.mig_instances if m.key in present])
            except (ClaimError, KeyError) as e:
                log.error("claim %s: its MIG instance is gone and cannot be re-created: %s", entry.ref, e)
                continue
            data = data.with_claim(fresh)
            remade.append(entry.uid)
        return Recovered(data, [], remade)
