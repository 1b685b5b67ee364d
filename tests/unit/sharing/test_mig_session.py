"""Finding 22: MIG operations share one NVML session and look each parent handle up once, until an error.

``Counting`` forwards every call to the fake unchanged and counts the ones this is about.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_sharing_prepare import hardware

from topodra.hardware.mock import FakeNvml
from topodra.sharing.instances import MigError, MigInstances
from topodra.sharing.mig import placement_of


class Counting:
    def __init__(self, nvml: FakeNvml) -> None:
        self._nvml = nvml
        self.inits = self.shutdowns = self.lookups = 0

    def nvmlInit(self) -> None:
        self.inits += 1
        self._nvml.nvmlInit()

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1
        self._nvml.nvmlShutdown()

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        self.lookups += 1
        return self._nvml.nvmlDeviceGetHandleByUUID(uuid)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nvml, name)


def test_one_session_and_one_lookup_per_parent_across_operations(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    spy = Counting(nvml)
    mig = MigInstances(spy)
    by_name = {d.name: d for d in devices}
    a = mig.create(placement_of(by_name["gpu-2-mig-1g-10gb-0"]))
    b = mig.create(placement_of(by_name["gpu-2-mig-1g-10gb-1"]))
    assert len(mig.existing([a.parent_uuid])) == 2
    assert mig.destroy(a) and mig.destroy(b)
    assert (spy.inits, spy.shutdowns, spy.lookups) == (1, 0, 1)
    assert nvml.init_count == 1
    mig.close()
    assert (spy.shutdowns, nvml.init_count) == (1, 0)
    mig.create(placement_of(by_name["gpu-2-mig-1g-10gb-0"]))  # a new session after close
    assert (spy.inits, spy.lookups) == (2, 2)


def test_an_error_drops_the_cached_handles(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    spy = Counting(nvml)
    mig = MigInstances(spy)
    by_name = {d.name: d for d in devices}
    mig.create(placement_of(by_name["gpu-0-mig-4g-40gb-0"]))
    with pytest.raises(MigError):
        mig.create(placement_of(by_name["gpu-0-mig-1g-10gb-0"]))  # overlaps: NVML refuses
    assert spy.lookups == 1
    mig.create(placement_of(by_name["gpu-0-mig-1g-10gb-6"]))
    assert spy.lookups == 2, "the handle is looked up again after the error"
    assert spy.inits == 1


def test_close_at_exit_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _devices, nvml = hardware(tmp_path)
    mig = MigInstances(nvml)
    mig.existing([str(nvml.facts.gpus[0].uuid)])
    nvml.nvmlShutdown()  # someone else ended NVML underneath: the session's own shutdown fails
    mig.close()
    assert any("nvmlShutdown failed" in r.getMessage() for r in caplog.records)
    mig.close()  # a second close does nothing
