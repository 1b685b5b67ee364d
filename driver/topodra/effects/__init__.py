"""The GPU side effects of a prepare, one module each, walked in order by ``DeviceState`` (see ``base``)."""

from __future__ import annotations

import os

from topodra.effects.base import GpuEffect, Recovered
from topodra.effects.mig import MigEffect
from topodra.effects.migjournal import MigJournal
from topodra.effects.mps import MpsEffect
from topodra.effects.timeslice import TimeSliceEffect, TimeSliceIntents
from topodra.sharing.computemode import ComputeModeControl
from topodra.sharing.instances import MigInstances
from topodra.sharing.mps import MpsDaemons
from topodra.sharing.timeslice import TimeSliceControl

__all__ = ["GpuEffect", "MigEffect", "MpsEffect", "Recovered", "TimeSliceEffect", "standard"]


def standard(state_dir: str | os.PathLike[str], *, mig: MigInstances | None = None,
             timeslice: TimeSliceControl | None = None, mps: MpsDaemons | None = None,
             driver_root: str | os.PathLike[str] | None = None,
             compute_mode: ComputeModeControl | None = None) -> tuple[GpuEffect, ...]:
    """The effects in their order: MIG instances first (the spec and MPS need their UUIDs), then time-slice
    levels, then MPS daemons.  ``mig``/``timeslice`` None: claims needing them fail; ``mps`` defaults to
    daemons under ``state_dir`` with the binary from ``driver_root`` (None: mock hardware, PATH only) and
    ``compute_mode`` setting EXCLUSIVE_PROCESS on the GPUs they serve whole."""
    daemons = mps if mps is not None else MpsDaemons(state_dir, driver_root=driver_root, compute_mode=compute_mode)
    return MigEffect(mig, MigJournal(state_dir)), TimeSliceEffect(timeslice, TimeSliceIntents(state_dir)), \
        MpsEffect(daemons)
