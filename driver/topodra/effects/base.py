"""What one kind of GPU side effect of a prepare owns: its check, apply, undo, CDI edits and recovery.

``DeviceState`` knows no MIG, time slicing or MPS: it walks one ordered tuple of effects.  Each effect
changes node state that the CDI spec and checkpoint entry of a claim then describe, so the order of the
tuple is the order of apply (a later effect may use what an earlier one made: MPS serves MIG UUIDs), and
undo runs in reverse.  The checkpoint write is the commit point: prepare applies every effect before it,
unprepare undoes them after it.  So the checkpoint never records state that does not exist; what a crash
leaves beyond it (state no entry records) is what ``recover`` removes at the next start.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from topodra.checkpoint import CheckpointData, CheckpointDevice, ClaimEntry
from topodra.claims import ClaimRef
from topodra.devices import Device
from topodra.sharing.config import Sharing

Devices = Mapping[str, Device]
Mount = tuple[str, str]  # (host path, container path), bind-mounted read-write


@dataclass(frozen=True)
class Recovered:
    """What one effect's start-up reconcile did: the (possibly updated) checkpoint data, and for logs."""

    data: CheckpointData
    stray: list[str] = field(default_factory=list)   # state no entry records, removed
    remade: list[str] = field(default_factory=list)  # claim UIDs whose recorded state was gone and is made again


class GpuEffect(Protocol):
    """One kind of node state a claim's sharing or device kind asks for (``topodra.effects.*``).

    Errors that fail one claim are ``ClaimError`` with the full answer for the kubelet.
    """

    name: str
    # TOPODRA_CRASH_POINT reached after this effect's pass over a batch that uses it (None: no point).
    crash_point: str | None

    def check(self, ref: ClaimRef, dev: Device, sharing: Sharing | None, working: CheckpointData,
              devices: Devices, node: str) -> None:
        """Refuse a config this device or node cannot honour, before anything changes (no IO).

        ``working``: the prepared claims plus those planned before this one in the batch."""

    def device_edits(self, d: CheckpointDevice, dev: Device) -> tuple[Device, tuple[str, ...]]:
        """The device as its CDI edits should show it, and extra KEY=VALUE env for it."""

    def claim_edits(self, entry: ClaimEntry) -> tuple[list[str], list[Mount]]:
        """Claim-wide CDI env and mounts."""

    def used_by(self, entry: ClaimEntry, devices: Devices) -> bool:
        """Whether ``apply`` has anything to do for this claim (checked before it is called)."""

    def apply(self, entry: ClaimEntry, applied: CheckpointData, devices: Devices) -> ClaimEntry:
        """Make the claim's state; the entry, updated with what it records.  ``applied``: the claims whose
        state exists now.  On failure raise ``ClaimError`` having left nothing of its own behind."""

    def undo(self, entries: Sequence[ClaimEntry], final: CheckpointData, devices: Devices) -> None:
        """Remove the state of ``entries`` (they are not, or no longer, in ``final``); never raises:
        a failure is logged and what is left no entry records, so recovery removes it."""

    def release_blocker(self, entry: ClaimEntry) -> str | None:
        """Why this plugin could not undo the claim (then unprepare keeps it), or None."""

    def remove_strays(self, data: CheckpointData, devices: Devices) -> list[str]:
        """At start, remove what this effect made that no entry of ``data`` records (what a crash left); what
        went, for logs.  Called in reverse effect order, as undo is: a later effect's state may hold an earlier
        one's in use (an MPS server on a MIG compute instance makes NVML refuse its destroy with IN_USE), so
        it goes first.  Never raises: a failure is logged, and the next start tries again."""

    def recover(self, data: CheckpointData, devices: Devices) -> Recovered:
        """At start, after every effect's ``remove_strays``: re-make what an entry records and is gone (after a
        reboot), in effect order (a later effect uses what an earlier one re-made).  Never raises."""


def sharing_of(entry: ClaimEntry, strategy: str) -> list[CheckpointDevice]:
    """The claim's devices whose sharing config uses ``strategy``."""
    return [d for d in entry.devices if d.sharing is not None and d.sharing.strategy == strategy]


@runtime_checkable
class OutsideLock(Protocol):
    """The half of an effect that talks to the API server, so runs after the node lock is released (the MPS
    daemon pods).  ``DeviceState`` calls it for the claims a prepare answered and after every unprepare."""

    @property
    def outside_lock(self) -> bool:
        """Whether this effect has such a half in this configuration (else it is never called)."""

    def after_prepare(self, entries: Sequence[ClaimEntry], devices: Devices) -> dict[str, str]:
        """Finish the prepared ``entries``; claim UID -> error for those that are not ready (they stay prepared;
        the kubelet's retry comes back here)."""

    def after_unprepare(self) -> dict[str, str]:
        """Remove what the undone claims left to it; claim UID -> error for what is still there."""

    def sweep(self, recorded: Callable[[], Collection[str]], force: bool) -> list[str]:
        """Remove what the effect made for claims ``recorded()`` (the checkpoint's UIDs, read after the effect's
        own listing) no longer has, which no ``after_unprepare`` will remove (this process never knew of it, or
        a stop failed).  ``force``: sweep now (plugin start, a failed unprepare); else only if the effect itself
        saw a failure.  The claim UIDs whose leftovers went; errors are logged and the next call tries again."""
