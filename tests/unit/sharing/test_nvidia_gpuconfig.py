"""NVIDIA's GpuConfig/MigDeviceConfig (resource.nvidia.com/v1beta1) as another spelling of topodra's (issue 35).

Field list from that driver's Go types (api/nvidia.com/resource/v1beta1 sharing.go, gpuconfig.go, migconfig.go),
not its examples.  The translation must give exactly the config topodra's own spelling gives, so the same
validation and the same effects apply; what topodra cannot honour is refused with NVIDIA's field path.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from topodra.claims import ClaimError, ClaimRef, allocated_claim
from topodra.hardware import load_backend
from topodra.sharing.config import API_VERSION, ConfigError, Mps, Sharing, TimeSlicing, parse, resolve
from topodra.sharing.nvidiaconfig import API_VERSION as NV

DRIVER = "gpu.topodra.io"


def nv(sharing: Any = None, kind: str = "GpuConfig", **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"apiVersion": NV, "kind": kind, **extra}
    if sharing is not None:
        out["sharing"] = sharing
    return out


@pytest.mark.parametrize("interval", ["Default", "Short", "Medium", "Long"])
def test_time_slicing_translates_to_topodras(interval: str) -> None:
    ours = parse({"apiVersion": API_VERSION, "kind": "GpuConfig",
                  "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}})
    theirs = parse(nv({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}))
    assert theirs == ours
    assert theirs.sharing == Sharing(strategy="TimeSlicing", timeSlicing=TimeSlicing(interval=interval))  # type: ignore[arg-type]


def test_mps_translates_to_topodras() -> None:
    theirs = parse(nv({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50,
                                                        "defaultPinnedDeviceMemoryLimit": "10Gi", "multiUser": False}}))
    assert theirs.sharing == Sharing(strategy="MPS", mps=Mps(defaultActiveThreadPercentage=50,
                                                             defaultPinnedDeviceMemoryLimit="10Gi"))
    assert theirs.sharing.mps is not None and theirs.sharing.mps.pinned_limit_bytes() == 10 * 2**30
    as_bytes = parse(nv({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": 2**30}}))
    assert as_bytes.sharing is not None and as_bytes.sharing.mps == Mps(defaultPinnedDeviceMemoryLimit=str(2**30))


def test_defaults_as_nvidia_normalizes_them() -> None:
    # GpuConfig.Normalize: TimeSlicing without a config gets interval Default; MPS without one an empty one.
    ts = parse(nv({"strategy": "TimeSlicing"})).sharing
    assert ts is not None and ts.interval == "Default"
    m = parse(nv({"strategy": "MPS"})).sharing
    assert m is not None and m.strategy == "MPS" and (m.mps or Mps()) == Mps()
    assert parse(nv()).sharing is None  # no sharing: exclusive, as NVIDIA's DefaultGpuConfig


def test_mig_device_config() -> None:
    m = parse(nv({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 30}}, kind="MigDeviceConfig"))
    assert m.sharing == Sharing(strategy="MPS", mps=Mps(defaultActiveThreadPercentage=30))
    # MigDeviceSharing.GetTimeSlicingConfig returns none: time slicing on a MIG slice sets nothing, there or here.
    assert parse(nv({"strategy": "TimeSlicing"}, kind="MigDeviceConfig")).sharing is None


@pytest.mark.parametrize(("params", "needles"), [
    (nv({"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"0": "5Gi"}}}),
     ["sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit", "per-device"]),
    (nv({"strategy": "MPS", "mpsConfig": {"multiUser": True}}), ["sharing.mpsConfig.multiUser"]),
    (nv({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Forever"}}),
     ["sharing.timeSlicingConfig.interval"]),
    (nv({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long", "quantum": 3}}),
     ["sharing.timeSlicingConfig.quantum", "Extra inputs"]),
    (nv({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}), ["sharing.timeSlicing"]),
    (nv({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 101}}),
     ["sharing.mpsConfig.defaultActiveThreadPercentage"]),
    (nv({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "lots"}}),
     ["sharing.mpsConfig.defaultPinnedDeviceMemoryLimit"]),
    (nv({"strategy": "TimeSlicing", "mpsConfig": {}}), ["timeSlicingConfig block, not mpsConfig"]),
    (nv({"strategy": "Magic"}), ["sharing.strategy"]),
    (nv({"strategy": "TimeSlicing", "timeSlicingConfig": {}}, kind="MigDeviceConfig"),
     ["MigDeviceConfig", "sharing.timeSlicingConfig", "Extra inputs"]),
    (nv(kind="VfioDeviceConfig"), ["VfioDeviceConfig", "VFIO"]),
    (nv(kind="ComputeDomainChannelConfig"), ["ComputeDomain"]),
    (nv(kind="GpuConfg"), ["kind", "GpuConfg"]),
    (nv(metadata={"name": "x"}), ["metadata", "Extra inputs"]),
])
def test_refusals_name_the_field(params: Any, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        parse(params)
    for n in needles:
        assert n in str(e.value), str(e.value)
    assert NV in str(e.value)


def test_claim_with_nvidia_config_is_refused_before_anything_is_prepared() -> None:
    """The refusal surfaces as the claim's error, naming the claim, the entry and the field."""
    bad = nv({"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"0": "5Gi"}}})
    configs = [{"source": "FromClaim", "requests": ["gpus"], "opaque": {"driver": DRIVER, "parameters": bad}}]
    with pytest.raises(ConfigError, match=r"config entry 0 \(FromClaim\).*defaultPerDevicePinnedMemoryLimit"):
        resolve(configs, DRIVER, ["gpus"])
    claim = {"metadata": {"uid": "u1", "namespace": "ns", "name": "c"}, "status": {"allocation": {"devices": {
        "results": [{"request": "gpus", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"}],
        "config": configs}}}}
    with pytest.raises(ClaimError, match="defaultPerDevicePinnedMemoryLimit"):
        allocated_claim(ClaimRef(uid="u1", namespace="ns", name="c"), claim, DRIVER, "node-a", "node-a")


def test_class_and_claim_configs_mix_spellings() -> None:
    """A topodra class config and an NVIDIA claim config resolve as two configs of ours: the claim's wins."""
    ours = {"apiVersion": API_VERSION, "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Short"}}}
    theirs = nv({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})
    got = resolve([{"source": "FromClass", "opaque": {"driver": DRIVER, "parameters": ours}},
                   {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": theirs}}], DRIVER, ["gpu"])
    assert got["gpu"] is not None and got["gpu"].interval == "Long"
    # a config left under NVIDIA's driver name is another driver's: skipped, as any other driver's
    assert resolve([{"source": "FromClaim", "opaque": {"driver": "gpu.nvidia.com", "parameters": theirs}}],
                   DRIVER, ["gpu"]) == {"gpu": None}


# -- the shipped NVIDIA-shaped examples (deploy/examples/nvidia; the node tier runs them) -----------------------

EXAMPLES = Path(__file__).resolve().parents[3] / "deploy/examples/nvidia"


def _template(name: str) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]
    return dict(doc)


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_examples_keep_nvidias_config_and_use_published_names(name: str) -> None:
    """Only class and driver renamed: NVIDIA's apiVersion stays, every attribute the CEL or a constraint names is
    published (on the mock A100 GPUs or MIG devices), every class exists."""
    devices = _template(name)["spec"]["spec"]["devices"]
    for c in devices.get("config") or []:
        assert c["opaque"]["driver"] == DRIVER and c["opaque"]["parameters"]["apiVersion"] == NV
        if name.startswith("unsupported-"):
            with pytest.raises(ConfigError, match="defaultPerDevicePinnedMemoryLimit"):
                parse(c["opaque"]["parameters"])
        else:
            assert parse(c["opaque"]["parameters"]).sharing is not None
    published = {k for spec in ("mock:dgx-a100-80gb", "mock:dgx-a100-80gb-mig")
                 for d in load_backend(spec, "node-a").discover() for k in d.attributes}
    text = (EXAMPLES / name).read_text()
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "gpu.nvidia.com" not in body and "mig.nvidia.com" not in body  # renamed
    used = set(re.findall(r"attributes\['gpu\.topodra\.io'\]\.(\w+)", text))
    used |= {c["matchAttribute"].removeprefix(f"{DRIVER}/") for c in devices.get("constraints") or []}
    assert used <= published, used - published
    for r in devices["requests"]:
        assert (REPO_CLASSES / f"{r['exactly']['deviceClassName']}.yaml").exists()


REPO_CLASSES = EXAMPLES.parents[2] / "deviceclasses"
