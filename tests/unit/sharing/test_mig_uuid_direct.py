"""Finding 22's rest: a new MIG device's UUID without walking every MIG device of the parent.

NVIDIA's DRA driver reads it from ``nvmlComputeInstanceGetInfo(ci).device`` (the walk took up to 10 s under load
there); nvml.h documents that field as the parent device, which is what the fake and the C stand-in answer.
``MigInstances`` takes the direct handle when NVML says it is the MIG device of exactly the new GI/CI and walks
otherwise.  ``DirectInfo`` stands in for an NVML whose compute-instance info carries the MIG device handle.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from test_sharing_prepare import hardware

from topodra.hardware.mock import FakeNvml
from topodra.hardware.mockmig import FakeMigDeviceHandle
from topodra.sharing.instances import MigInstances
from topodra.sharing.mig import placement_of

WALK = ("nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetMigDeviceHandleByIndex")


class DirectInfo:
    """Forwards to the fake; compute-instance info names the MIG device (``ci_offset`` shifts its CI id, to
    stand for a handle of another instance); counts the walk's calls."""

    def __init__(self, nvml: FakeNvml, direct: bool, ci_offset: int = 0) -> None:
        self._nvml, self.direct, self.ci_offset = nvml, direct, ci_offset
        self.calls: Counter[str] = Counter()

    def nvmlComputeInstanceGetInfo(self, ci: Any) -> Any:
        info = self._nvml.nvmlComputeInstanceGetInfo(ci)
        if not self.direct:
            return info
        return dataclasses.replace(info, device=FakeMigDeviceHandle(ci.index, ci.gi, ci.ci + self.ci_offset))

    def __getattr__(self, name: str) -> Any:
        if name in WALK:
            self.calls[name] += 1
        return getattr(self._nvml, name)


def walked_uuid(nvml: FakeNvml, parent_uuid: str, gi: int | None, ci: int | None) -> str:
    assert gi is not None and ci is not None
    h = nvml.nvmlDeviceGetHandleByUUID(parent_uuid)
    return nvml.nvmlDeviceGetUUID(FakeMigDeviceHandle(h.index, gi, ci))


def test_the_direct_handle_gives_the_uuid_without_a_walk(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    spy = DirectInfo(nvml, direct=True)
    by_name = {d.name: d for d in devices}
    a = MigInstances(spy).create(placement_of(by_name["gpu-2-mig-1g-10gb-0"]))
    assert a.uuid.startswith("MIG-") and a.uuid == walked_uuid(nvml, a.parent_uuid, a.gpu_instance,
                                                              a.compute_instance)
    assert sum(spy.calls.values()) == 0, spy.calls


def test_the_parent_handle_nvml_documents_falls_back_to_the_walk(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    spy = DirectInfo(nvml, direct=False)
    by_name = {d.name: d for d in devices}
    a = MigInstances(spy).create(placement_of(by_name["gpu-2-mig-1g-10gb-0"]))
    assert a.uuid == walked_uuid(nvml, a.parent_uuid, a.gpu_instance, a.compute_instance)
    assert spy.calls["nvmlDeviceGetMigDeviceHandleByIndex"] >= 1


def test_a_handle_of_another_instance_is_not_trusted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    devices, nvml = hardware(tmp_path)
    spy = DirectInfo(nvml, direct=True, ci_offset=1)
    by_name = {d.name: d for d in devices}
    with caplog.at_level(logging.WARNING, logger="topodra.sharing.instances"):
        a = MigInstances(spy).create(placement_of(by_name["gpu-2-mig-1g-10gb-0"]))
    assert a.uuid == walked_uuid(nvml, a.parent_uuid, a.gpu_instance, a.compute_instance)
    assert spy.calls["nvmlDeviceGetMigDeviceHandleByIndex"] >= 1
    assert any("walking the MIG devices instead" in r.getMessage() for r in caplog.records), caplog.text
