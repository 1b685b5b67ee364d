"""The telemetry calls of the C NVML stand-in through the real pynvml binding (driver trees by absolute path).

Each rule is nvml.h's (go-nvml v0.13.4-1 pkg/nvml/nvml.h, quoted in hack/nvml-standin/telemetry.inc); the values
come from the scenario in the faults file, as tests and the node tier drive them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.standin import driver_tree, run_py, write_faults

GIB = 1 << 30
BUSY = {"utilGpu": 97, "utilMemory": 41, "memoryUsed": 30 * GIB, "powerMw": 612345, "temperatureC": 71,
        "smClockMhz": 1755, "pcieTxKBps": 2000, "pcieRxKBps": 25000, "nvlinkTxKiBps": 1_000_000,
        "nvlinkRxKiBps": 500_000, "smActivity": 80.0, "tensorActivity": 55.5, "graphicsActivity": 90.0,
        "eccCorrected": 3, "eccUncorrected": 1}


@pytest.fixture(scope="module")
def h100(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return driver_tree(tmp_path_factory.mktemp("h100"), "dgx-h100")


@pytest.fixture(scope="module")
def l4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return driver_tree(tmp_path_factory.mktemp("l4"), "l4")


def test_busy_scenario_reads_through_pynvml(h100: Path) -> None:
    write_faults(h100, {"gpus": {"0": {"telemetry": BUSY}}})
    got = run_py(h100, """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        u = pynvml.nvmlDeviceGetUtilizationRates(h)
        m = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        m1 = pynvml.nvmlDeviceGetMemoryInfo(h)
        idle = pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(1))
        out({"util": [u.gpu, u.memory], "used": m.used, "free": m.free, "total": m.total, "v1": [m1.used, m1.free],
             "power": pynvml.nvmlDeviceGetPowerUsage(h),
             "temp": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
             "sm": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
             "mem_clock": err(pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_MEM),
             "pcie": [pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES),
                      pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES)],
             "bad_counter": err(pynvml.nvmlDeviceGetPcieThroughput, h, 7),
             "ecc": [pynvml.nvmlDeviceGetTotalEccErrors(h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                                        pynvml.NVML_VOLATILE_ECC),
                     pynvml.nvmlDeviceGetTotalEccErrors(h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                        pynvml.NVML_AGGREGATE_ECC)],
             "idle_util": [idle.gpu, idle.memory]})
    """)
    total = got["total"]
    assert got["util"] == [97, 41] and got["idle_util"] == [0, 0]
    assert (got["used"], got["free"]) == (30 * GIB, total - 30 * GIB) and got["v1"] == [30 * GIB, total - 30 * GIB]
    assert (got["power"], got["temp"], got["sm"]) == (612345, 71, 1755)
    assert got["mem_clock"] == "NotSupported"  # "if the device cannot report the specified clock"
    assert got["pcie"] == [2000, 25000] and got["bad_counter"] == "InvalidArgument"
    assert got["ecc"] == [3, 1]


def test_gpm_and_nvlink_counters_follow_the_scenario_over_time(h100: Path) -> None:
    write_faults(h100, {"gpus": {"0": {"telemetry": BUSY}}})
    got = run_py(h100, """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        sup = pynvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice
        TX, RX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
        fields = [(TX, 0xFFFFFFFF), (RX, 0xFFFFFFFF), (TX, 99)]
        a, b = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
        pynvml.nvmlGpmSampleGet(h, a)
        v0 = pynvml.nvmlDeviceGetFieldValues(h, fields)
        t0 = time.monotonic()
        time.sleep(0.3)
        pynvml.nvmlGpmSampleGet(h, b)
        v1 = pynvml.nvmlDeviceGetFieldValues(h, fields)
        dt = time.monotonic() - t0
        mg = pynvml.c_nvmlGpmMetricsGet_t()
        mg.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = 4
        mg.sample1, mg.sample2 = a, b
        for k, mid in enumerate([pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL, pynvml.NVML_GPM_METRIC_SM_UTIL,
                                 pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL]):
            mg.metrics[k].metricId = mid
        pynvml.nvmlGpmMetricsGet(mg)
        bad = pynvml.c_nvmlGpmMetricsGet_t()
        bad.version = 7
        bad.numMetrics = 1
        bad.sample1, bad.sample2 = a, b
        out({"sup": sup, "metrics": [[mg.metrics[k].nvmlReturn, round(mg.metrics[k].value, 3)] for k in range(4)],
             "tx_kib_s": (v1[0].value.ullVal - v0[0].value.ullVal) / dt,
             "rx_kib_s": (v1[1].value.ullVal - v0[1].value.ullVal) / dt,
             "rets": [v1[0].nvmlReturn, v1[1].nvmlReturn, v1[2].nvmlReturn],
             "version": err(pynvml.nvmlGpmMetricsGet, bad)})
    """)
    assert got["sup"] == 1
    assert got["metrics"][:3] == [[0, 90.0], [0, 80.0], [0, 55.5]]  # percent, "0.0 - 100.0"
    assert got["metrics"][3][0] == 3  # a metric the stand-in does not model: NOT_SUPPORTED in its nvmlReturn
    assert got["rets"] == [0, 0, 2]  # link 99 does not exist: INVALID_ARGUMENT for that value only
    assert got["tx_kib_s"] == pytest.approx(1_000_000, rel=0.1) and got["rx_kib_s"] == pytest.approx(500_000, rel=0.1)
    assert got["version"] == "ArgumentVersionMismatch"


def test_ada_pcie_card_has_no_gpm_and_no_nvlink(l4: Path) -> None:
    got = run_py(l4, """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        s = pynvml.nvmlGpmSampleAlloc()
        v = pynvml.nvmlDeviceGetFieldValues(h, [(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0xFFFFFFFF)])
        out({"sup": pynvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice, "get": err(pynvml.nvmlGpmSampleGet, h, s),
             "nvlink": v[0].nvmlReturn, "util": pynvml.nvmlDeviceGetUtilizationRates(h).gpu})
    """)
    # nvmlGpmQueryDeviceSupport answers (SUCCESS, not supported); sampling is "For Hopper or newer" only.
    assert got == {"sup": 0, "get": "NotSupported", "nvlink": 3, "util": 0}


def test_lost_gpu_and_missing_sensor(h100: Path) -> None:
    write_faults(h100, {})
    got = run_py(h100, """
        import os
        pynvml.nvmlInit()
        h0, h1 = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
        faults = os.path.join(os.path.dirname(str(LIB)), "nvml-standin-faults.json")
        with open(faults + ".tmp", "w") as f:  # the GPU falls off the bus after the handles were taken
            json.dump({"gpus": {"0": {"lost": True}, "1": {"telemetry": {"unsupported": ["power", "ecc"]}}}}, f)
        os.replace(faults + ".tmp", faults)
        s = pynvml.nvmlGpmSampleAlloc()
        out({"lost": [err(pynvml.nvmlDeviceGetUtilizationRates, h0), err(pynvml.nvmlDeviceGetPowerUsage, h0),
                      err(pynvml.nvmlGpmSampleGet, h0, s), err(pynvml.nvmlDeviceGetPcieThroughput, h0, 0),
                      err(pynvml.nvmlDeviceGetTotalEccErrors, h0, 0, 0)],
             "gpu1": [err(pynvml.nvmlDeviceGetPowerUsage, h1), err(pynvml.nvmlDeviceGetTotalEccErrors, h1, 0, 0),
                      err(pynvml.nvmlDeviceGetTemperature, h1, 0)]})
    """)
    assert got["lost"] == ["GpuIsLost"] * 5
    assert got["gpu1"] == ["NotSupported", "NotSupported", "ok"]


def test_mig_enabled_gpu_has_no_utilization(tmp_path: Path) -> None:
    tree = driver_tree(tmp_path / "mig", "dgx-h100-mig")
    got = run_py(tree, """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        out({"mig": pynvml.nvmlDeviceGetMigMode(h)[0], "util": err(pynvml.nvmlDeviceGetUtilizationRates, h)})
    """)
    # nvml.h: "On MIG-enabled GPUs, querying device utilization rates is not currently supported."
    assert got == {"mig": 1, "util": "NotSupported"}


MIG_CHILD = """
import os
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
def make(pid, start, size):  # a GPU instance with its one compute instance; its MIG device handle
    gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, pid, place(start, size))
    info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, CI_1 if size == 1 else CI_2, 0)
    pynvml.nvmlGpuInstanceCreateComputeInstance(gi, info.id)
    return pynvml.nvmlGpuInstanceGetInfo(gi).id
small, big = make(19, 3, 1), make(14, 4, 2)  # 1g.10gb, 2g.20gb
migs = {}
for k in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(h)):
    try:
        m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
    except pynvml.NVMLError:
        continue
    migs[pynvml.nvmlDeviceGetGpuInstanceId(m)] = m
faults = os.path.join(os.path.dirname(str(LIB)), "nvml-standin-faults.json")
GIB = 1 << 30
with open(faults + ".tmp", "w") as f:
    json.dump({"gpus": {"0": {"telemetry": {"mig": {str(small): {"memoryUsed": 3 * GIB, "smActivity": 60.0,
                                                               "tensorActivity": 20.0, "graphicsActivity": 70.0},
                                                    str(big): {"memoryUsed": 999 * GIB}}}}}}, f)
os.replace(faults + ".tmp", faults)
def gpm(sample):  # two samples 0.3 s apart, their three metrics in percent
    a, b = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    sample(a); time.sleep(0.3); sample(b)
    mg = pynvml.c_nvmlGpmMetricsGet_t()
    mg.version, mg.numMetrics, mg.sample1, mg.sample2 = pynvml.NVML_GPM_METRICS_GET_VERSION, 3, a, b
    for k, mid in enumerate([pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL, pynvml.NVML_GPM_METRIC_SM_UTIL,
                             pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL]):
        mg.metrics[k].metricId = mid
    pynvml.nvmlGpmMetricsGet(mg)
    return [round(mg.metrics[k].value, 1) for k in range(3)]
ms, mb = migs[small], migs[big]
r = {"mem_small": [pynvml.nvmlDeviceGetMemoryInfo(ms, version=pynvml.nvmlMemory_v2).used,
                   pynvml.nvmlDeviceGetMemoryInfo(ms, version=pynvml.nvmlMemory_v2).total >> 20],
     "mem_big": [pynvml.nvmlDeviceGetMemoryInfo(mb).used >> 20, pynvml.nvmlDeviceGetMemoryInfo(mb).total >> 20],
     "mem_parent": pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).used >> 20,
     "util_mig": err(pynvml.nvmlDeviceGetUtilizationRates, ms),
     "power_mig": err(pynvml.nvmlDeviceGetPowerUsage, ms),
     "gpm_support_mig": pynvml.nvmlGpmQueryDeviceSupport(ms).isSupportedDevice,
     "gpm_mig_handle": gpm(lambda s: pynvml.nvmlGpmSampleGet(ms, s)),
     "gpm_by_id": gpm(lambda s: pynvml.nvmlGpmMigSampleGet(h, small, s)),
     "gpm_idle": gpm(lambda s: pynvml.nvmlGpmMigSampleGet(h, big, s))}
s1, s2 = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
r["no_instance"] = err(pynvml.nvmlGpmMigSampleGet, h, 13, s1)
r["mig_handle_as_gpu"] = err(pynvml.nvmlGpmMigSampleGet, ms, small, s1)
pynvml.nvmlGpmMigSampleGet(h, small, s1); time.sleep(0.15); pynvml.nvmlGpmMigSampleGet(h, big, s2)
mixed = pynvml.c_nvmlGpmMetricsGet_t()
mixed.version, mixed.numMetrics, mixed.sample1, mixed.sample2 = pynvml.NVML_GPM_METRICS_GET_VERSION, 1, s1, s2
mixed.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
r["mixed"] = err(pynvml.nvmlGpmMetricsGet, mixed)
os.seteuid(65534)  # nvml.h: the parent's aggregate "only if the caller has appropriate privileges"
r["parent_unprivileged"] = err(pynvml.nvmlDeviceGetMemoryInfo, h)
os.seteuid(0)
faults_lost = {"gpus": {"0": {"lost": True}}}
with open(faults + ".tmp", "w") as f:
    json.dump(faults_lost, f)
os.replace(faults + ".tmp", faults)
r["lost"] = [err(pynvml.nvmlGpmMigSampleGet, h, small, s1), err(pynvml.nvmlDeviceGetMemoryInfo, ms),
             err(pynvml.nvmlGpmSampleGet, ms, s1)]
out(r)
"""


def test_mig_per_instance_memory_and_gpm(tmp_path: Path) -> None:
    """nvml.h: memory info is per instance on a MIG device handle ("Per-instance information can be queried by
    using specific MIG device handles") and the aggregate on the GPU's; GPM samples a GPU instance through its MIG
    device handle (nvmlGpmSampleGet: "supports the device handle and MIG device handle") or the GPU and the
    instance id (nvmlGpmMigSampleGet); utilisation is not supported with MIG on; a lost GPU answers GPU_IS_LOST."""
    tree = driver_tree(tmp_path / "mig", "dgx-h100-mig")
    got = run_py(tree, MIG_CHILD)
    assert got["mem_small"] == [3 << 30, 9856]  # 1g.10gb: the instance's own total (the H100 profile's MiB)
    assert got["mem_big"] == [got["mem_big"][1], got["mem_big"][1]]  # more than it has: clamped to its total
    assert got["mem_parent"] == 3 * 1024 + got["mem_big"][1]  # the aggregate of the instances
    assert got["util_mig"] == "NotSupported" and got["power_mig"] == "NotSupported"
    assert got["gpm_support_mig"] == 1
    assert got["gpm_mig_handle"] == pytest.approx([70.0, 60.0, 20.0], abs=0.5)
    assert got["gpm_by_id"] == pytest.approx([70.0, 60.0, 20.0], abs=0.5)
    assert got["gpm_idle"] == [0.0, 0.0, 0.0]  # an instance the scenario leaves out reads idle
    assert got["no_instance"] == "NotFound" and got["mig_handle_as_gpu"] == "NotSupported"
    assert got["mixed"] == "InvalidArgument"  # samples of two GPU instances
    assert got["parent_unprivileged"] == "NoPermission"
    assert got["lost"] == ["GpuIsLost"] * 3


def test_gpm_per_instance_needs_mig_on_and_hopper(h100: Path, tmp_path: Path) -> None:
    write_faults(h100, {})
    off = run_py(h100, """
        pynvml.nvmlInit()
        s = pynvml.nvmlGpmSampleAlloc()
        out(err(pynvml.nvmlGpmMigSampleGet, pynvml.nvmlDeviceGetHandleByIndex(0), 1, s))
    """)
    a100 = run_py(driver_tree(tmp_path / "a100", "dgx-a100-80gb-mig"), """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, place(0, 1))
        s = pynvml.nvmlGpmSampleAlloc()
        out(err(pynvml.nvmlGpmMigSampleGet, h, pynvml.nvmlGpuInstanceGetInfo(gi).id, s))
    """)
    assert off == "NotSupported"  # MIG off: no GPU instance to sample
    assert a100 == "NotSupported"  # "For Hopper or newer fully supported devices"
