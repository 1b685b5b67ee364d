"""Mock profiles (Python ``FakeNvml``) and the C NVML stand-in answer the telemetry calls alike.

The same scenario file drives both; ``GpuReader`` reads each the production way (the stand-in through the real
pynvml binding in a child process) and must get the same reading, missing series and failures included.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from testkit.standin import driver_tree, lib_dir, run_py

from topodra.hardware import load_backend
from topodra.hardware.mockprofile import build_tree, load_profile

GIB = 1 << 30
FAULTS = {"gpus": {
    "0": {"telemetry": {"utilGpu": 88, "utilMemory": 30, "memoryUsed": 12 * GIB, "powerMw": 500000,
                        "temperatureC": 66, "smClockMhz": 1700, "pcieTxKBps": 100, "pcieRxKBps": 900,
                        "nvlinkTxKiBps": 1000000, "smActivity": 60.0, "tensorActivity": 20.0,
                        "graphicsActivity": 70.0, "eccCorrected": 2}},
    "1": {"telemetry": {"unsupported": ["power", "gpm"]}},
    "2": {"lost": True}}}

READ = """
def read_all(nvml, uuids):
    from topodra.telemetry.gpureads import GpuReader
    nvml.nvmlInit()
    readers = [GpuReader(nvml, u) for u in uuids]
    for r in readers:
        r.read()
    time.sleep(0.3)
    out = []
    for r in readers:
        g = r.read()
        d = {k: v for k, v in vars(g).items() if k not in ("nvlink_tx_bytes", "nvlink_rx_bytes")}
        for k in ("graphics_active", "sm_active", "tensor_active"):
            d[k] = None if d[k] is None else round(d[k], 2)
        d["nvlink"] = None if g.nvlink_tx_bytes is None else g.nvlink_tx_bytes > 0
        d["unsupported"] = sorted(set(d["unsupported"]))
        d["errors"] = sorted(map(list, d["errors"]))
        out.append(d)
    return out
"""


def _reads(nvml: Any, uuids: list[str]) -> list[dict[str, Any]]:
    scope: dict[str, Any] = {"time": time}
    exec(READ, scope)  # the same function the child runs
    result: list[dict[str, Any]] = scope["read_all"](nvml, uuids)
    return result


def test_fake_nvml_and_the_c_standin_give_the_same_readings(tmp_path: Path) -> None:
    tree = driver_tree(tmp_path / "root", "dgx-h100", node="n1")
    (lib_dir(tree) / "nvml-standin-faults.json").write_text("{}")
    faults = tmp_path / "faults.json"
    faults.write_text("{}")
    be = load_backend("mock:dgx-h100", "n1", overrides={"faultsFile": str(faults)})
    uuids = [str(d.attributes["uuid"].value) for d in be.discover() if d.kind == "gpu"][:3]
    faults.write_text(json.dumps(FAULTS))
    fake = _reads(be.nvml, uuids)
    (lib_dir(tree) / "nvml-standin-faults.json").write_text(json.dumps(FAULTS))
    real = run_py(tree, READ + f"\nout(read_all(pynvml, {uuids!r}))")
    assert fake == real
    busy, partial, lost = fake
    assert (busy["util_gpu"], busy["memory_used"], busy["power_watts"], busy["sm_active"]) == (0.88, 12 * GIB, 500.0,
                                                                                            pytest.approx(0.6))
    assert busy["nvlink"] is True and busy["errors"] == []
    assert partial["power_watts"] is None and partial["sm_active"] is None
    assert {"nvmlDeviceGetPowerUsage", "gpm"} <= set(partial["unsupported"])
    assert lost["lost"] is True and lost["util_gpu"] is None


MIG_READ = """
def read_mig(nvml, devices, scenario):
    import os
    from topodra.sharing.instances import MigInstances
    from topodra.sharing.mig import placement_of
    from topodra.telemetry.gpureads import MigReader
    (dev,) = [d for d in devices if d.kind == "mig" and d.attributes["parentDevice"].value == "gpu-0"
              and d.attributes["profile"].value == "1g.10gb" and d.attributes["placementStart"].value == 4]
    made = MigInstances(nvml)
    inst = made.create(placement_of(dev))
    made.close()
    scenario({"gpus": {"0": {"telemetry": {"mig": {str(inst.gpu_instance): {"memoryUsed": 3 << 30, "smActivity": 40.0,
                                                                            "tensorActivity": 10.0}}}}}})
    nvml.nvmlInit()
    r = MigReader(nvml, inst.uuid, inst.parent_uuid, inst.gpu_instance)
    r.read()
    time.sleep(0.3)
    g = r.read()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    parent_used = nvml.nvmlDeviceGetMemoryInfo(h).used
    s = nvml.nvmlGpmSampleAlloc()
    errs = []
    for call in (lambda: nvml.nvmlGpmMigSampleGet(h, 13, s), lambda: nvml.nvmlGpmMigSampleGet(r.handle, 1, s)):
        try:
            call()
            errs.append("ok")
        except nvml.NVMLError as e:
            errs.append(type(e).__name__.removeprefix("NVMLError_"))
    return {"gi": inst.gpu_instance, "used": g.memory_used, "total": g.memory_total, "index": r.index,
            "sm": round(g.sm_active, 2), "tensor": round(g.tensor_active, 2), "util": g.util_gpu,
            "errors": g.errors, "parent_used": parent_used, "errs": errs}
"""


def _sysfs(tmp_path: Path, profile: str) -> Path:
    out = tmp_path / "sysfs"
    build_tree(load_profile(profile), frozenset()).materialize(str(out))
    return out


def test_mig_instances_read_alike(tmp_path: Path) -> None:
    """A MIG device's per-instance figures (MigReader: memory on its handle, GPM of its GPU instance) and the
    parent's aggregate memory, the same from FakeNvml and the stand-in."""
    tree = driver_tree(tmp_path / "root", "dgx-h100-mig", node="n1")
    faults = tmp_path / "faults.json"
    faults.write_text("{}")
    be = load_backend("mock:dgx-h100-mig", "n1", overrides={"faultsFile": str(faults),
                                                            "migStateFile": str(tmp_path / "mig.json")})
    scope: dict[str, Any] = {"time": time}
    exec(MIG_READ, scope)
    fake = scope["read_mig"](be.nvml, be.discover(), lambda d: faults.write_text(json.dumps(d)))
    real = run_py(tree, MIG_READ + """
import os
from topodra.hardware import load_backend
FAULTS = os.path.join(os.path.dirname(str(LIB)), "nvml-standin-faults.json")
def scenario(d):
    open(FAULTS + ".tmp", "w").write(json.dumps(d))
    os.replace(FAULTS + ".tmp", FAULTS)
be = load_backend("nvml", "n1", sysfs_root=os.environ["SYSFS"], nvidia_driver_root=TREE)
out(read_mig(pynvml, be.discover(), scenario))
""", env={"SYSFS": str(_sysfs(tmp_path, "dgx-h100-mig"))})
    # GPU-instance ids are NVML's choice: FakeNvml numbers them in creation order, the stand-in as real GPUs do
    assert {k: v for k, v in fake.items() if k != "gi"} == {k: v for k, v in real.items() if k != "gi"}
    assert (fake["used"], fake["sm"], fake["tensor"], fake["util"]) == (3 << 30, 0.4, 0.1, None)
    assert fake["parent_used"] == 3 << 30 and fake["index"] == 0 and fake["errors"] == []
    assert fake["errs"] == ["NotFound", "NotSupported"]
