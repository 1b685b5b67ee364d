"""The NVML rows of hack/gpu-check: ask the real driver what the review (issue 19) could only read about.

Each answer is recorded raw, as NVML gave it, with the error name where a call failed, so the JSON settles
the questions without trusting topodra's interpretation: the NvLink version enum (finding 6), remote PCI
info and device type per active link (17), fabric info through the v3 struct, field 230, the GPU recovery
action (7), MIG mode and the 1-slice GPU instance profile (3). ``probe`` takes any pynvml-shaped module,
so the same code runs against topodra's fake in the unit tests.

    python hack/gpu_check_nvml.py OUT.json [--mig-profiles OUT.tsv]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

RECOVERY_ACTION_FIELD = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION


def _call(fn: Callable[[], Any]) -> dict[str, Any]:
    """{"value": ...} or {"error": ...}: one failing call must not hide the others' answers."""
    try:
        return {"value": _plain(fn())}
    except Exception as e:  # NVMLError, AttributeError of an older binding, ctypes errors: all answers
        out: dict[str, Any] = {"error": f"{type(e).__name__}: {e}"}
        code = getattr(e, "value", None)
        if isinstance(code, int):
            out["code"] = code
        return out


def _plain(v: Any) -> Any:
    """ctypes structs and byte strings as JSON."""
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, ctypes.Array):
        return [_plain(x) for x in v]
    fields = getattr(v, "_fields_", None)
    if fields is not None:
        return {name: _plain(getattr(v, name)) for name, *_ in fields}
    return v


def _fabric_v3(nvml: Any, h: Any) -> dict[str, Any]:
    info = nvml.c_nvmlGpuFabricInfo_v3_t()
    nvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
    d: dict[str, Any] = _plain(info)
    d["clusterUuid"] = bytes(info.clusterUuid).hex()
    return d


def _field(nvml: Any, h: Any, field_id: int) -> dict[str, Any]:
    (v,) = nvml.nvmlDeviceGetFieldValues(h, [field_id])
    raw = _plain(v)
    return {"nvmlReturn": raw.get("nvmlReturn"), "valueType": raw.get("valueType"), "value": raw.get("value")}


def _remote_bus_id(nvml: Any, h: Any, link: int) -> Any:
    return nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId


def _links(nvml: Any, h: Any) -> list[dict[str, Any]]:
    links = []
    device_wide = {getattr(nvml, n, None) for n in ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND")}
    for link in range(int(nvml.NVML_NVLINK_MAX_LINKS)):
        state = _call(partial(nvml.nvmlDeviceGetNvLinkState, h, link))
        if state.get("value") != nvml.NVML_FEATURE_ENABLED:
            if "error" in state and state.get("code") != getattr(nvml, "NVML_ERROR_INVALID_ARGUMENT", None):
                links.append({"link": link, "state": state})
                if state.get("code") in device_wide:
                    break  # no NVLink on this GPU (or in this library): the other links answer the same
            continue
        links.append({
            "link": link,
            "state": state,
            "version_enum": _call(partial(nvml.nvmlDeviceGetNvLinkVersion, h, link)),
            "remote_pci_bus_id": _call(partial(_remote_bus_id, nvml, h, link)),
            "remote_device_type": _call(partial(nvml.nvmlDeviceGetNvLinkRemoteDeviceType, h, link)),
        })
    return links


def _one_slice_profile(nvml: Any, h: Any) -> dict[str, Any]:
    return _call(lambda: nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, nvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE))


def _gpm(nvml: Any, h: Any, seconds: float = 0.2) -> dict[str, Any]:
    """GPM metrics 1, 2, 5 (graphics, SM, any tensor; percent) over two samples ``seconds`` apart (nvml.h: more
    than 100 ms), each metric's own nvmlReturn kept."""
    import time

    a, b = nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()
    try:
        nvml.nvmlGpmSampleGet(h, a)
        time.sleep(seconds)
        nvml.nvmlGpmSampleGet(h, b)
        mg = nvml.c_nvmlGpmMetricsGet_t()
        mg.version, mg.numMetrics, mg.sample1, mg.sample2 = nvml.NVML_GPM_METRICS_GET_VERSION, 3, a, b
        for k, mid in enumerate((1, 2, 5)):
            mg.metrics[k].metricId = mid
        nvml.nvmlGpmMetricsGet(mg)
        return {str(mg.metrics[k].metricId): {"return": int(mg.metrics[k].nvmlReturn), "value": mg.metrics[k].value}
                for k in range(3)}
    finally:
        for s in (a, b):
            nvml.nvmlGpmSampleFree(s)


def _telemetry(nvml: Any, h: Any) -> dict[str, Any]:
    """The calls the telemetry sampler makes (docs/telemetry.md), raw: units as NVML gives them."""
    def fields() -> Any:
        vals = nvml.nvmlDeviceGetFieldValues(h, [(138, 0xFFFFFFFF), (139, 0xFFFFFFFF)])
        return [{"return": int(v.nvmlReturn), "ullVal": int(v.value.ullVal)} for v in vals]
    return {
        "utilization": _call(lambda: nvml.nvmlDeviceGetUtilizationRates(h)),
        "memory_v2": _call(lambda: nvml.nvmlDeviceGetMemoryInfo(h, version=nvml.nvmlMemory_v2)),
        "power_mw": _call(lambda: nvml.nvmlDeviceGetPowerUsage(h)),
        "temperature_c": _call(lambda: nvml.nvmlDeviceGetTemperature(h, 0)),
        "sm_clock_mhz": _call(lambda: nvml.nvmlDeviceGetClockInfo(h, 1)),
        "pcie_kbps_tx_rx": _call(lambda: [nvml.nvmlDeviceGetPcieThroughput(h, 0),
                                          nvml.nvmlDeviceGetPcieThroughput(h, 1)]),
        "ecc_volatile_corrected_uncorrected": _call(lambda: [nvml.nvmlDeviceGetTotalEccErrors(h, 0, 0),
                                                             nvml.nvmlDeviceGetTotalEccErrors(h, 1, 0)]),
        "nvlink_data_kib_fields_138_139": _call(fields),
        "gpm_support": _call(lambda: nvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice),
        "gpm_metrics": _call(lambda: _gpm(nvml, h)),
    }


def _gpu(nvml: Any, i: int, h: Any) -> dict[str, Any]:
    return {
        "index": i,
        "name": _call(lambda: nvml.nvmlDeviceGetName(h)),
        "uuid": _call(lambda: nvml.nvmlDeviceGetUUID(h)),
        "pci_bus_id": _call(lambda: nvml.nvmlDeviceGetPciInfo(h).busId),
        "minor_number": _call(lambda: nvml.nvmlDeviceGetMinorNumber(h)),
        "mig_mode": _call(lambda: nvml.nvmlDeviceGetMigMode(h)),
        "mig_1slice_profile": _one_slice_profile(nvml, h),
        "fabric_info_v3": _call(lambda: _fabric_v3(nvml, h)),
        "recovery_action_field_230": _call(lambda: _field(nvml, h, RECOVERY_ACTION_FIELD)),
        "nvlinks": _links(nvml, h),
        "telemetry": _telemetry(nvml, h),
    }


def probe(nvml: Any) -> dict[str, Any]:
    """Everything the verify rows ask, per GPU; NVML is initialised and shut down here."""
    nvml.nvmlInit()
    try:
        report: dict[str, Any] = {
            "driver_version": _call(lambda: nvml.nvmlSystemGetDriverVersion()),
            "nvml_version": _call(lambda: nvml.nvmlSystemGetNVMLVersion()),
            "cuda_driver_version": _call(lambda: nvml.nvmlSystemGetCudaDriverVersion()),
            "gpus": [],
        }
        count = nvml.nvmlDeviceGetCount()
        for i in range(count):
            got = _call(partial(nvml.nvmlDeviceGetHandleByIndex, i))
            if "error" in got:
                report["gpus"].append({"index": i, "handle": got})
                continue
            report["gpus"].append(_gpu(nvml, i, nvml.nvmlDeviceGetHandleByIndex(i)))
        return report
    finally:
        nvml.nvmlShutdown()


def mig_rows(report: dict[str, Any]) -> list[str]:
    """'index<TAB>profileId' for each GPU whose current MIG mode is on and that has a 1-slice profile."""
    rows = []
    for g in report["gpus"]:
        mode = g.get("mig_mode", {}).get("value")
        prof = g.get("mig_1slice_profile", {}).get("value")
        if isinstance(mode, list) and mode and mode[0] == 1 and isinstance(prof, dict) and "id" in prof:
            rows.append(f"{g['index']}\t{prof['id']}")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON report to write")
    ap.add_argument("--mig-profiles", help="also write index<TAB>1-slice profile id per MIG-enabled GPU")
    args = ap.parse_args(argv)
    import pynvml

    report = probe(pynvml)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, sort_keys=True)
    if args.mig_profiles:
        with open(args.mig_profiles, "w", encoding="utf-8") as f:
            f.writelines(r + "\n" for r in mig_rows(report))
    print(f"wrote {args.out}: {len(report['gpus'])} GPU(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
