"""topodra's health source and MIG instances driving the real pynvml against the C stand-in.

Health (XID events, a lost GPU) is checked at the level every fix keeps: an observation names the device
and the signal.  Tests named after an issue-19 finding failed against NVML's documented semantics on the
code before the fix.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from testkit.standin import driver_tree, run_py

from topodra.hardware.mockprofile import build_tree, load_profile

NODE = "standin-node"


def _tree_and_sysfs(tmp_path: Path, profile: str) -> tuple[Path, Path]:
    tree = driver_tree(tmp_path / "root", profile, node=NODE)
    sysfs = tmp_path / "sysfs"
    build_tree(load_profile(profile), frozenset()).materialize(str(sysfs))
    return tree, sysfs


DISCOVER = """
import os
from topodra.hardware import load_backend
FAULTS = TREE + "/usr/lib/x86_64-linux-gnu/nvml-standin-faults.json"
def faults(data):
    with open(FAULTS + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(FAULTS + ".tmp", FAULTS)
SYSFS = {sysfs!r}
backend = load_backend("nvml", {node!r}, sysfs_root=SYSFS, nvidia_driver_root=TREE)
devices = backend.discover()
"""


def _discovered(sysfs: Path, code: str) -> str:
    """Child code: discover this node through the stand-in, then run ``code``."""
    return DISCOVER.format(node=NODE, sysfs=str(sysfs)) + textwrap.dedent(code)


def test_health_source_sees_xid_events_and_a_lost_gpu(tmp_path: Path) -> None:
    tree, sysfs = _tree_and_sysfs(tmp_path, "dgx-h100")
    got = run_py(tree, _discovered(sysfs, """
        from topodra.hardware.sysfs import Sysfs
        from topodra.health.sources import NodeHealthSource
        src = NodeHealthSource(pynvml, Sysfs(SYSFS), devices)
        src.open()
        uuid = next(d.uuid for d in devices if d.name == "gpu-2")
        faults({"events": [{"gpu": uuid, "type": "xid", "data": 79}]})
        seen = [[o.device, o.kind, o.detail] for o in src.wait_events(5.0)]
        before = [[o.device, o.kind] for o in src.poll() if o.kind == "gpu-lost"]
        faults({"gpus": {"2": {"lost": True}}})
        lost = [[o.device, o.kind] for o in src.poll() if o.kind == "gpu-lost"]
        src.close()
        out({"seen": seen, "before": before, "lost": lost})
    """))
    assert ["gpu-2", "xid", "79"] in got["seen"]
    assert got["before"] == [] and got["lost"] == [["gpu-2", "gpu-lost"]]


def test_event_wait_on_a_lost_gpu_still_takes_its_timeout(tmp_path: Path) -> None:
    tree, sysfs = _tree_and_sysfs(tmp_path, "dgx-h100")
    waited = run_py(tree, _discovered(sysfs, """
        from topodra.hardware.sysfs import Sysfs
        from topodra.health.sources import NodeHealthSource
        src = NodeHealthSource(pynvml, Sysfs(SYSFS), devices)
        src.open()
        faults({"gpus": {"2": {"lost": True}}})
        t0 = time.monotonic()
        src.wait_events(2.0)
        out(time.monotonic() - t0)
    """))
    assert waited >= 1.5  # the rest of the timeout is waited out, not spun through


def test_mig_instances_create_and_destroy_through_nvml(tmp_path: Path) -> None:
    tree, sysfs = _tree_and_sysfs(tmp_path, "dgx-a100-80gb-mig")
    got = run_py(tree, _discovered(sysfs, """
        from topodra.sharing.instances import MigError, MigInstances
        from topodra.sharing.mig import MigPlacement
        parent = next(d.uuid for d in devices if d.kind == "gpu")
        mig = MigInstances(pynvml, proc_root=TREE + "/proc")
        p = MigPlacement(parent_uuid=parent, profile="1g.10gb", profile_id=19, start=3, size=1, compute_slices=1)
        try:
            inst = mig.create(p)
        except MigError as e:
            out({"error": str(e)})
        else:
            nodes = mig.cap_device_nodes(inst, 0)
            existing = [[i.gpu_instance, i.compute_instance] for i in mig.existing([parent])]
            out({"inst": [inst.gpu_instance, inst.compute_instance, inst.uuid.startswith("MIG-")], "nodes": nodes,
                 "existing": existing, "destroyed": mig.destroy(inst), "again": mig.destroy(inst),
                 "after": mig.existing([parent])})
    """))
    # 1g at 3:1 is GPU instance 14 on A100/H100 (`nvidia-smi mig -lgi`); minors 3 + 9 * 14 (+ 0 + 1).
    assert got == {"inst": [14, 0, True], "nodes": ["/dev/nvidia-caps/nvidia-cap129", "/dev/nvidia-caps/nvidia-cap130"],
                   "existing": [[14, 0]], "destroyed": True, "again": False, "after": []}  # fmt: skip


def test_mig_destroy_when_mig_is_off_counts_as_gone(tmp_path: Path) -> None:
    tree, sysfs = _tree_and_sysfs(tmp_path, "dgx-h100")
    got = run_py(tree, _discovered(sysfs, """
        from topodra.sharing.instances import MigError, MigInstance, MigInstances
        parent = devices[0].uuid
        mig = MigInstances(pynvml, proc_root=TREE + "/proc")
        try:
            out(mig.destroy(MigInstance(parent_uuid=parent, gpu_instance=10, compute_instance=0)))
        except MigError as e:
            out(str(e))
    """))
    assert got is False


def test_mig_capability_files_come_and_go_with_instances(tmp_path: Path) -> None:
    tree, _ = _tree_and_sysfs(tmp_path, "dgx-a100-80gb-mig")
    caps = tree / "proc/driver/nvidia/capabilities"
    got = run_py(tree, """
        import os
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(1)
        gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, place(2, 1))  # 1g.10gb at slice 2: GI 13
        info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, CI_1, 0)
        ci = pynvml.nvmlGpuInstanceCreateComputeInstance(gi, info.id)
        base = TREE + "/proc/driver/nvidia/capabilities/gpu1/mig/gi13"
        made = [open(base + "/access").read(), open(base + "/ci0/access").read()]
        pynvml.nvmlComputeInstanceDestroy(ci)
        pynvml.nvmlGpuInstanceDestroy(gi)
        out({"made": made, "left": os.path.exists(base)})
    """)
    # Minors as /proc/driver/nvidia-caps/mig-minors numbers them: 3 + 135 * gpu + 9 * gi (+ ci + 1).
    assert got == {"made": ["DeviceFileMinor: 255\nDeviceFileMode: 292\nDeviceFileModify: 1\n",
                            "DeviceFileMinor: 256\nDeviceFileMode: 292\nDeviceFileModify: 1\n"], "left": False}
    assert (caps / "mig/config").read_text().startswith("DeviceFileMinor: 1\n")
    minors = (tree / "proc/driver/nvidia-caps/mig-minors").read_text().splitlines()
    assert "gpu1/gi13/access 255" in minors and "gpu1/gi13/ci0/access 256" in minors
