"""``DeviceState.held_mig``: the MIG instances prepare made, as the telemetry sampler reads them (without the lock,
from the checkpoint): one per prepared MIG device, gone with its claim."""

from __future__ import annotations

from pathlib import Path

from testkit import rigs as rig
from testkit.rigs import claim, hardware, ref

SLICE = "gpu-2-mig-1g-10gb-0"


def test_held_mig_names_each_prepared_instance_until_unprepare(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path, "mock:dgx-a100-80gb-mig")
    st = rig.state(tmp_path, devices, nvml)
    assert st.held_mig() == {}
    assert st.prepare([claim("m", SLICE, None)])["m"].error == ""
    (parent,) = nvml.mig_instances()
    got = st.held_mig()
    assert list(got) == [SLICE]
    inst = got[SLICE]
    assert inst.parent_uuid == parent and inst.uuid.startswith("MIG-") and inst.compute_instance is not None
    assert [g.id for g in nvml.mig_instances()[parent]] == [inst.gpu_instance]
    assert st.unprepare([ref("m")]) == {"m": ""}
    assert st.held_mig() == {}
