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
