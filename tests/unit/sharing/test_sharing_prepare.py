"""Prepare/unprepare of MIG placement devices: instances created, recorded, destroyed, reconciled after crashes."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pynvml
import pytest
import yaml
from testkit.rigs import run_child

from topodra import checkpoint, effects
from topodra.claims import AllocatedClaim, AllocatedDevice, ClaimRef
from topodra.devices import Device
from topodra.effects.migjournal import MigJournal
from topodra.hardware import load_backend
from topodra.hardware.mock import FakeNvml
from topodra.hardware.mockmig import mig_uuid
from topodra.inventory import Inventory
from topodra.sharing.instances import MigInstances, placement_key
from topodra.sharing.mig import placement_of
from topodra.state import CRASH_EXIT_CODE, DeviceState

DRIVER = "gpu.topodra.io"
NODE = "mig-node"
PROFILE = "mock:dgx-a100-80gb-mig"


def hardware(tmp_path: Path) -> tuple[list[Device], FakeNvml]:
    """The node's devices and its fake NVML; MIG instances live in a file, as on a GPU they outlive processes."""
    backend = load_backend(PROFILE, NODE, overrides={"migStateFile": str(tmp_path / "mig.json")})
    return backend.discover(), backend.nvml


def state(tmp_path: Path, devices: list[Device], nvml: FakeNvml) -> DeviceState:
    boot = tmp_path / "boot_id"
    if not boot.exists():
        boot.write_text("boot-1\n")
    return DeviceState(DRIVER, NODE, Inventory(devices), tmp_path / "cdi", tmp_path / "state", boot_id_path=str(boot),
                       nvidia_spec_dirs=[], gpu_effects=effects.standard(tmp_path / "state", mig=MigInstances(nvml)))


def claim(uid: str, *devices: str) -> AllocatedClaim:
    return AllocatedClaim(ref=ClaimRef(namespace="ns", uid=uid, name=f"c-{uid}"),
                          devices=tuple(AllocatedDevice(request="gpus", device=d, share_id=None, access="exclusive")
                                        for d in devices))


def spec_env(tmp_path: Path, uid: str) -> list[str]:
    (path,) = (tmp_path / "cdi").glob(f"*{uid}*")
    spec = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    return list(spec["containerEdits"]["env"])


def test_prepare_creates_the_instance_and_unprepare_destroys_it(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    st = state(tmp_path, devices, nvml)
    res = st.prepare([claim("u1", "gpu-2-mig-3g-40gb-4"), claim("u2", "gpu-2-mig-1g-10gb-0")])
    assert res["u1"].error == "" and res["u2"].error == ""
    gpu2 = str(nvml.facts.gpus[2].uuid)
    gis = nvml.mig_instances()[gpu2]
    assert sorted((g.profileId, g.start, len(g.computeInstances)) for g in gis) == [(9, 4, 1), (19, 0, 1)]
    entry = checkpoint.load(tmp_path / "state" / checkpoint.FILE_NAME).claims["u1"]  # type: ignore[union-attr]
    rec = entry.devices[0].mig
    assert rec is not None and (rec.profile_id, rec.start) == (9, 4)
    assert rec.uuid == mig_uuid(gpu2, rec.gpu_instance, 0)
    # The container sees its MIG device and nothing else.
    env = spec_env(tmp_path, "u1")
    assert f"TOPODRA_VISIBLE_UUIDS={rec.uuid}" in env and gpu2 not in " ".join(env)
    assert st.unprepare([ClaimRef("ns", "u1", "c-u1")]) == {"u1": ""}
    assert [(g.profileId, g.start) for g in nvml.mig_instances()[gpu2]] == [(19, 0)]
    assert st.unprepare([ClaimRef("ns", "u2", "c-u2"), ClaimRef("ns", "u1", "c-u1")]) == {"u2": "", "u1": ""}
    assert nvml.mig_instances() == {}


def test_failed_create_changes_nothing(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    st = state(tmp_path, devices, nvml)
    assert st.prepare([claim("a", "gpu-0-mig-4g-40gb-0")])["a"].error == ""
    before = nvml.mig_instances()
    # An overlapping placement (the scheduler would not allocate it; an out-of-band instance could cause it).
    res = st.prepare([claim("b", "gpu-0-mig-1g-10gb-5", "gpu-0-mig-3g-40gb-0")])
    assert "cannot create MIG 3g.40gb instance at memory slice 0" in res["b"].error
    assert f"code {pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES}" in res["b"].error, res["b"].error
    assert nvml.mig_instances() == before, "the 1g.10gb created before the failing 3g.40gb must be destroyed"
    assert not list((tmp_path / "cdi").glob("*claim_b.*"))
    assert "b" not in checkpoint.load(tmp_path / "state" / checkpoint.FILE_NAME).claims  # type: ignore[union-attr]


def test_restart_destroys_instances_no_claim_records(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    st = state(tmp_path, devices, nvml)
    assert st.prepare([claim("keep", "gpu-1-mig-2g-20gb-2")])["keep"].error == ""
    # An instance made by a prepare that died before its checkpoint write (its intent journalled first).
    p = placement_of(next(d for d in devices if d.name == "gpu-1-mig-1g-10gb-0"))
    MigJournal(tmp_path / "state").record([placement_key(p)])
    stray = MigInstances(nvml).create(p)
    report = state(tmp_path, devices, nvml).last_recovery
    assert report.mig_destroyed == [f"{stray.parent_uuid}/{stray.gpu_instance}"]
    assert [(g.profileId, g.start) for g in nvml.mig_instances()[stray.parent_uuid]] == [(14, 2)]


def test_reboot_recreates_recorded_instances(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    st = state(tmp_path, devices, nvml)
    assert st.prepare([claim("r", "gpu-5-mig-1g-20gb-6")])["r"].error == ""
    (tmp_path / "mig.json").unlink()  # a reboot: the GPU lost its instances
    (tmp_path / "boot_id").write_text("boot-2\n")
    report = state(tmp_path, devices, nvml).last_recovery
    assert report.mig_recreated == ["r"]
    gis = nvml.mig_instances()[str(nvml.facts.gpus[5].uuid)]
    assert [(g.profileId, g.start) for g in gis] == [(15, 6)]
    rec = checkpoint.load(tmp_path / "state" / checkpoint.FILE_NAME).claims["r"].devices[0].mig  # type: ignore[union-attr]
    assert rec is not None and f"TOPODRA_VISIBLE_UUIDS={rec.uuid}" in spec_env(tmp_path, "r")


CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from test_sharing_prepare import claim, hardware, state
    tmp = Path({tmp!r})
    devices, nvml = hardware(tmp)
    st = state(tmp, devices, nvml)
    st.prepare([claim("k", "gpu-3-mig-3g-40gb-0", "gpu-3-mig-1g-10gb-4")])
""")


@pytest.mark.parametrize("point", ["after-mig-created", "after-cdi-written"])
def test_kill_during_instance_creation_leaks_nothing(tmp_path: Path, point: str) -> None:
    """The process dies (exit 137, as from kill -9) with instances created and not recorded; restart cleans up."""
    r = run_child(CHILD.format(tmp=str(tmp_path)), point, cwd=Path(__file__).parent)
    assert r.returncode == CRASH_EXIT_CODE, r.stderr
    devices, nvml = hardware(tmp_path)
    assert len(nvml.mig_instances()[str(nvml.facts.gpus[3].uuid)]) == 2, "the child created both instances"
    st = state(tmp_path, devices, nvml)
    assert len(st.last_recovery.mig_destroyed) == 2
    assert nvml.mig_instances() == {}
    assert not list((tmp_path / "cdi").glob("*"))
    # The kubelet retries: the claim is prepared afresh.
    assert st.prepare([claim("k", "gpu-3-mig-3g-40gb-0", "gpu-3-mig-1g-10gb-4")])["k"].error == ""
    assert len(nvml.mig_instances()[str(nvml.facts.gpus[3].uuid)]) == 2


def on_this_host(devices: list[Device], gpu: str) -> list[Device]:
    """The devices as if ``gpu`` were this host's (it then has /dev/nvidia<minor>, and so do its slices)."""
    node = f"/dev/nvidia{gpu.removeprefix('gpu-')}"
    return [d.model_copy(update={"device_nodes": (node,)}) if d.name == gpu or d.name.startswith(gpu + "-mig-")
            else d for d in devices]


def test_host_gpus_give_containers_the_mig_capability_nodes(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    devices = on_this_host(devices, "gpu-2")
    proc = tmp_path / "proc"
    gi = proc / "driver/nvidia/capabilities/gpu2/mig/gi1"
    (gi / "ci0").mkdir(parents=True)
    (gi / "access").write_text("DeviceFileMinor: 30\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    (gi / "ci0" / "access").write_text("DeviceFileMinor: 31\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    st = DeviceState(DRIVER, NODE, Inventory(devices), tmp_path / "cdi", tmp_path / "state",
                     boot_id_path=str(tmp_path / "boot"), nvidia_spec_dirs=[],
                     gpu_effects=effects.standard(tmp_path / "state", mig=MigInstances(nvml, proc_root=str(proc))))
    assert st.prepare([claim("h", "gpu-2-mig-2g-20gb-0")])["h"].error == ""
    (path,) = (tmp_path / "cdi").glob("*claim_h.*")
    spec = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    nodes = [n["path"] for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes", [])]
    assert nodes == ["/dev/nvidia2", "/dev/nvidia-caps/nvidia-cap30", "/dev/nvidia-caps/nvidia-cap31"]
    # A second instance (GI 2) has no capability files here: the claim fails and its instance is destroyed.
    res = st.prepare([claim("x", "gpu-2-mig-1g-10gb-4")])
    assert "cannot read MIG capability" in res["x"].error
    assert [(g.profileId, g.start) for g in nvml.mig_instances()[str(nvml.facts.gpus[2].uuid)]] == [(14, 0)]
