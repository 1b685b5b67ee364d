"""hack/gpu_check_nvml.py, the NVML rows of hack/gpu-check, run against topodra's fake NVML.

The fake is not the point (its answers are topodra's own); these tests pin that the probe records raw
answers and per-call errors, visits only active links and picks the GPUs that `nvidia-smi mig -cgi` may use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gpu_check_nvml
import pynvml
import pytest

from topodra.hardware.mock import FakeNvml, MockHardware, nvml_error
from topodra.hardware.mockprofile import load_profile


def fake(profile: str) -> FakeNvml:
    p = load_profile(profile)
    return MockHardware(p, "n1", frozenset(), p.fabric).nvml


def _state(nvml: FakeNvml, h: Any, link: int) -> int | None:
    try:
        return int(nvml.nvmlDeviceGetNvLinkState(h, link))
    except Exception:
        return None


def test_records_nvlink_enum_remote_ends_and_fabric_per_gpu() -> None:
    nvml = fake("dgx-h100")
    report = gpu_check_nvml.probe(nvml)
    assert len(report["gpus"]) == 8
    g0 = report["gpus"][0]
    assert g0["uuid"]["value"].startswith("GPU-")
    links = g0["nvlinks"]
    assert links, "a DGX H100 GPU has active NVLinks"
    nvml.nvmlInit()
    h0 = nvml.nvmlDeviceGetHandleByIndex(0)
    active = [k for k in range(pynvml.NVML_NVLINK_MAX_LINKS) if _state(nvml, h0, k) == pynvml.NVML_FEATURE_ENABLED]
    assert [link["link"] for link in links] == active
    for link in links:
        # Raw, as NVML answers: whatever the fake (or the driver) says, not a mapped generation.
        assert link["version_enum"]["value"] == nvml.nvmlDeviceGetNvLinkVersion(h0, link["link"])
        assert link["remote_pci_bus_id"]["value"] == nvml.nvmlDeviceGetNvLinkRemotePciInfo(h0, link["link"]).busId
        assert "value" in link["remote_device_type"]
    nvml.nvmlShutdown()
    fabric = g0["fabric_info_v3"]
    assert ("value" in fabric and len(fabric["value"]["clusterUuid"]) == 32) or "error" in fabric
    json.dumps(report)  # all of it is JSON


def test_a_failing_call_is_recorded_and_the_rest_still_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake("dgx-h100")

    def lost(h: Any) -> str:
        raise nvml_error("GpuIsLost")

    monkeypatch.setattr(nvml, "nvmlDeviceGetName", lost)
    g0 = gpu_check_nvml.probe(nvml)["gpus"][0]
    assert g0["name"]["error"].startswith("NVMLError") and g0["name"]["code"] == 15  # NVML_ERROR_GPU_IS_LOST
    assert "value" in g0["uuid"]
    # The fake has no nvmlDeviceGetFieldValues: recorded as an error, not a crash.
    assert "error" in g0["recovery_action_field_230"] or "value" in g0["recovery_action_field_230"]
    assert nvml.init_count == 0, "probe shuts NVML down again"


def test_mig_rows_pick_gpus_with_mig_on_and_a_1_slice_profile() -> None:
    report = {"gpus": [
        {"index": 0, "mig_mode": {"value": [1, 1]}, "mig_1slice_profile": {"value": {"id": 19, "sliceCount": 1}}},
        {"index": 1, "mig_mode": {"value": [0, 1]}, "mig_1slice_profile": {"value": {"id": 19}}},
        {"index": 2, "mig_mode": {"error": "NVMLError_NotSupported"}, "mig_1slice_profile": {"error": "x"}},
        {"index": 3, "handle": {"error": "NVMLError_GpuIsLost"}},
    ]}
    assert gpu_check_nvml.mig_rows(report) == ["0\t19"]


def test_main_writes_the_report_and_the_mig_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", fake("dgx-h100-mig"))
    out, mig = tmp_path / "nvml.json", tmp_path / "mig.tsv"
    assert gpu_check_nvml.main([str(out), "--mig-profiles", str(mig)]) == 0
    report = json.loads(out.read_text())
    rows = gpu_check_nvml.mig_rows(report)
    assert rows, "the profile has MIG-enabled GPUs"
    assert mig.read_text() == "".join(r + "\n" for r in rows)


def test_a_gpu_without_nvlink_is_one_entry_not_one_per_link(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake("l4")

    def unsupported(h: Any, link: int) -> int:
        raise nvml_error("NotSupported")

    monkeypatch.setattr(nvml, "nvmlDeviceGetNvLinkState", unsupported)
    (entry,) = gpu_check_nvml.probe(nvml)["gpus"][0]["nvlinks"]
    assert entry["link"] == 0 and entry["state"]["code"] == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_records_the_telemetry_calls_raw(tmp_path: Path) -> None:
    """The sampler's calls, in NVML's own units (docs/telemetry.md), per GPU; a Hopper GPU's GPM metrics."""
    from topodra.hardware import load_backend

    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"gpus": {"0": {"telemetry": {"utilGpu": 42, "powerMw": 123456, "pcieRxKBps": 7,
                                                               "smActivity": 50.0}}}}))
    nvml = load_backend("mock:dgx-h100", "n1", overrides={"faultsFile": str(faults)}).nvml
    t = gpu_check_nvml.probe(nvml)["gpus"][0]["telemetry"]
    assert t["utilization"]["value"] == {"gpu": 42, "memory": 0}
    assert t["power_mw"] == {"value": 123456} and t["pcie_kbps_tx_rx"] == {"value": [0, 7]}
    assert t["memory_v2"]["value"]["used"] == 0 and t["temperature_c"] == {"value": 30}
    assert [f["return"] for f in t["nvlink_data_kib_fields_138_139"]["value"]] == [0, 0]
    assert t["gpm_support"] == {"value": 1}
    assert t["gpm_metrics"]["value"]["2"]["return"] == 0
    assert t["gpm_metrics"]["value"]["2"]["value"] == pytest.approx(50.0, abs=1.0)
    json.dumps(t)
