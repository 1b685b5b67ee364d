"""hack/gpu_check_mig_uuid.py, the finding-22 row of hack/gpu-check's mig step, against topodra's fake NVML.

The fake answers the parent device in the compute instance's info, as nvml.h documents; the probe must record
that raw, next to the parent's UUID and the UUID the walk over the MIG devices finds.
"""

from __future__ import annotations

from pathlib import Path

import gpu_check_mig_uuid

from topodra.hardware import load_backend
from topodra.sharing.instances import MigInstances
from topodra.sharing.mig import placement_of


def test_records_what_the_ci_info_device_is_and_the_walked_uuid(tmp_path: Path) -> None:
    backend = load_backend("mock:dgx-a100-80gb-mig", "n1", overrides={"migStateFile": str(tmp_path / "mig.json")})
    devices, nvml = backend.discover(), backend.nvml
    by_name = {d.name: d for d in devices}
    inst = MigInstances(nvml).create(placement_of(by_name["gpu-2-mig-1g-10gb-0"]))
    assert inst.gpu_instance is not None and inst.compute_instance is not None
    nvml.nvmlInit()
    index = next(i for i in range(nvml.nvmlDeviceGetCount())
                 if nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) == inst.parent_uuid)
    report = gpu_check_mig_uuid.probe(nvml, index, inst.gpu_instance, inst.compute_instance)
    nvml.nvmlShutdown()
    assert report["walked_mig_uuid"] == inst.uuid
    assert report["parent_uuid"] == {"value": inst.parent_uuid}
    assert report["ci_info_device_is_mig"] == {"value": False}  # the fake follows nvml.h: the parent
    assert report["ci_info_device_uuid"] == {"value": inst.parent_uuid}
