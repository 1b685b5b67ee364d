"""Discovery against NVML's and Linux's documented behaviour, where the fake used to agree with topodra instead.

Findings of /work/shared/reference/real-gpu.md (issue 19): #6 NVLink version enum, #16 one lost GPU,
#17 hidden NVSwitches, #18 rails and down ports, #19 SR-IOV VFs, #24 MIG in captures, #25 PCI domains.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pynvml
import pytest

from topodra.devices import Device
from topodra.hardware import load_backend
from topodra.hardware.base import DiscoveryConfig
from topodra.hardware.mock import nvml_error
from topodra.hardware.nvml import NVLINK_GENERATION, nvlink_generation
from topodra.hardware.pairing import assign_rails, select_compute_nics
from topodra.hardware.replay import ReplayFixture, capture_nvml, capture_sysfs, replay_backend


def attrs(d: Device) -> dict[str, Any]:
    return {k: v.value for k, v in d.attributes.items()}


def gpus(devs: list[Device]) -> list[Device]:
    return [d for d in devs if d.kind == "gpu"]


# ---------------- #6: nvmlDeviceGetNvLinkVersion answers nvmlNvlinkVersion_t


def test_the_fake_answers_the_nvml_enum_not_the_generation() -> None:
    """pynvml's constants: NVML_NVLINK_VERSION_3_1 = 5 (A100), _4_0 = 6 (H100), _5_0 = 7 (B200)."""
    expected = {"dgx-a100-80gb": pynvml.NVML_NVLINK_VERSION_3_1, "dgx-h100": pynvml.NVML_NVLINK_VERSION_4_0,
                "hgx-b200": pynvml.NVML_NVLINK_VERSION_5_0}
    for profile, enum in expected.items():
        backend = load_backend(f"mock:{profile}", "n1")
        n = backend.nvml
        n.nvmlInit()
        try:
            assert n.nvmlDeviceGetNvLinkVersion(n.nvmlDeviceGetHandleByIndex(0), 0) == enum, profile
        finally:
            n.nvmlShutdown()


def test_the_fake_answers_placements_whatever_the_mig_mode() -> None:
    """nvml.h, nvmlDeviceGetGpuInstancePossiblePlacements_v2: "This API only returns all the possible placements
    for the given profile regardless of whether MIG is enabled or not", NOT_SUPPORTED "If device doesn't support
    MIG"; the profile info still wants MIG on.  The C stand-in answers the same (test_nvml_standin.py)."""
    import ctypes

    got: dict[str, Any] = {}
    for profile in ("dgx-h100", "l40s"):
        n = load_backend(f"mock:{profile}", "n1").nvml
        n.nvmlInit()
        try:
            h = n.nvmlDeviceGetHandleByIndex(0)
            arr = (pynvml.c_nvmlGpuInstancePlacement_t * 16)()
            count = ctypes.c_uint(16)
            try:
                n.nvmlDeviceGetGpuInstancePossiblePlacements(h, 9, arr, ctypes.byref(count))
                got[profile] = [[arr[i].start, arr[i].size] for i in range(count.value)]
            except pynvml.NVMLError as e:
                got[profile] = type(e).__name__
            with pytest.raises(pynvml.NVMLError_NotSupported):
                n.nvmlDeviceGetGpuInstanceProfileInfo(h, 2)
        finally:
            n.nvmlShutdown()
    assert got == {"dgx-h100": [[0, 4], [4, 4]], "l40s": "NVMLError_NotSupported"}


@pytest.mark.parametrize(("profile", "generation"), [("dgx-a100-80gb", 3), ("dgx-h100", 4), ("dgx-h200", 4),
                                                     ("hgx-b200", 5), ("gb200-nvl72", 5)])
def test_nvlink_version_attribute_is_the_generation(profile: str, generation: int) -> None:
    devs = gpus(load_backend(f"mock:{profile}", "n1").discover())
    assert {attrs(d)["nvlinkVersion"] for d in devs} == {generation}


def test_a_generation_selector_no_longer_matches_an_a100() -> None:
    """``nvlinkVersion >= 4`` means Hopper-class NVLink: an A100 (enum 5 = NVLink 3.1) must not match."""
    a100_backend = load_backend("mock:dgx-a100-80gb", "n1")
    a100_backend.nvml.nvmlDeviceGetNvLinkVersion = lambda h, link: pynvml.NVML_NVLINK_VERSION_3_1  # real A100
    h100_backend = load_backend("mock:dgx-h100", "n1")
    h100_backend.nvml.nvmlDeviceGetNvLinkVersion = lambda h, link: pynvml.NVML_NVLINK_VERSION_4_0  # real H100
    a100 = attrs(gpus(a100_backend.discover())[0])
    h100 = attrs(gpus(h100_backend.discover())[0])
    assert (a100["nvlinkVersion"], h100["nvlinkVersion"]) == (3, 4)


def test_enum_mapping_and_unknown_values(caplog: pytest.LogCaptureFixture) -> None:
    assert {e: nvlink_generation(e) for e in range(1, 9)} == NVLINK_GENERATION
    assert nvlink_generation(pynvml.NVML_NVLINK_VERSION_INVALID) is None
    backend = load_backend("mock:dgx-h100", "n1")
    backend.nvml.nvmlDeviceGetNvLinkVersion = lambda h, link: 42
    with caplog.at_level(logging.WARNING):
        devs = gpus(backend.discover())
    assert all("nvlinkVersion" not in attrs(d) and "nvlinkDomain" in attrs(d) for d in devs)
    assert "unknown NVLink version enum 42" in caplog.text


# ---------------- #16 / #25: one bad GPU never fails the node


def _information(root: Path, bdf: str, uuid: str, minor: int) -> None:
    """What the NVIDIA kernel driver writes at /proc/driver/nvidia/gpus/<bdf>/information (subset)."""
    d = root / "proc" / "driver" / "nvidia" / "gpus" / bdf
    d.mkdir(parents=True, exist_ok=True)
    (d / "information").write_text(f"Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 0\nGPU UUID: \t {uuid}\n"
                                   f"Bus Location: \t {bdf}\nDevice Minor: \t {minor}\n")


def test_a_gpu_lost_at_start_is_published_tainted_and_the_others_normally(tmp_path: Path) -> None:
    faults = tmp_path / "faults.json"
    backend = load_backend("mock:dgx-h100", "n1", sysfs_root=str(tmp_path / "hw"),
                           overrides={"faultsFile": str(faults)})
    healthy = {d.name: d for d in backend.discover()}
    lost_uuid, lost_bdf = healthy["gpu-3"].uuid, str(attrs(healthy["gpu-3"])["resource.kubernetes.io/pciBusID"])
    faults.write_text('{"gpus": {"3": {"lost": true}}}')
    # A fresh plugin (no previous discovery in this process): the driver's procfs still names the GPU.
    fresh = load_backend("mock:dgx-h100", "n1", sysfs_root=str(tmp_path / "hw"),
                         overrides={"faultsFile": str(faults)})
    _information(tmp_path / "hw", lost_bdf, lost_uuid, 3)
    devs = {d.name: d for d in fresh.discover()}
    assert set(devs) == set(healthy)
    lost = devs["gpu-3"]
    assert "GPU is lost" in lost.lost
    assert lost.uuid == lost_uuid and attrs(lost)["resource.kubernetes.io/pciBusID"] == lost_bdf
    assert "model" not in attrs(lost)  # no class selecting by model can hand it out
    assert [n for n, d in devs.items() if d.lost] == ["gpu-3"]
    # The others are published as before (their NVLink domain now counts the 7 GPUs that answer).
    assert all(devs[n].uuid == healthy[n].uuid and attrs(devs[n]).get("model") == attrs(healthy[n]).get("model")
               for n in healthy if n != "gpu-3")


def test_a_lost_gpu_nothing_can_name_is_left_out_not_fatal(caplog: pytest.LogCaptureFixture,
                                                            tmp_path: Path) -> None:
    faults = tmp_path / "faults.json"
    faults.write_text('{"gpus": {"0": {"lost": true}, "5": {"lost": true}}}')
    backend = load_backend("mock:dgx-h100", "n1", sysfs_root=str(tmp_path / "hw"),
                           overrides={"faultsFile": str(faults)})
    with caplog.at_level(logging.ERROR):
        devs = backend.discover()
    assert [d.name for d in gpus(devs)] == ["gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-6", "gpu-7"]
    assert len([d for d in devs if d.kind == "nic"]) == 8
    assert "not published" in caplog.text


def test_lost_at_run_time_keeps_its_full_device(tmp_path: Path) -> None:
    faults = tmp_path / "faults.json"
    backend = load_backend("mock:dgx-h100", "n1", sysfs_root=str(tmp_path / "hw"),
                           overrides={"faultsFile": str(faults)})
    before = {d.name: d for d in backend.discover()}
    faults.write_text('{"gpus": {"6": {"lost": true}}}')
    after = {d.name: d for d in backend.discover()}
    assert after["gpu-6"].lost and after["gpu-6"].model_copy(update={"lost": ""}) == before["gpu-6"]
    faults.write_text("{}")
    assert {d.name: d for d in backend.discover()} == before  # back: not lost any more


def test_a_pci_domain_beyond_16_bits_skips_that_gpu_only(caplog: pytest.LogCaptureFixture) -> None:
    backend = load_backend("mock:dgx-h100", "n1")
    real = backend.nvml.nvmlDeviceGetPciInfo

    def pci(h: Any) -> Any:
        s = real(h)
        if h.index == 2:
            s.busId = b"00010000:52:00.0"  # a Hyper-V style domain
        return s

    backend.nvml.nvmlDeviceGetPciInfo = pci
    with caplog.at_level(logging.ERROR):
        devs = gpus(backend.discover())
    assert [d.name for d in devs] == ["gpu-0", "gpu-1", "gpu-3", "gpu-4", "gpu-5", "gpu-6", "gpu-7"]
    assert "does not fit the 4-digit Kubernetes format" in caplog.text


def test_init_and_count_still_fail_the_node() -> None:
    """Without NVML or a GPU count there is no trustworthy inventory at all: that stays fatal."""
    from topodra.hardware import DiscoveryError

    backend = load_backend("mock:l4", "n1")

    def fail(*_: Any) -> Any:
        raise nvml_error("DriverNotLoaded")

    backend.nvml.nvmlDeviceGetCount = fail
    with pytest.raises(DiscoveryError, match="GPU count"):
        backend.discover()


# ---------------- #17: NVSwitches hidden from the OS (VMs)


def test_links_to_switches_nvml_cannot_name_still_form_one_domain() -> None:
    backend = load_backend("mock:dgx-h100", "vm-1")
    n = backend.nvml

    def hidden(*_: Any) -> Any:
        raise nvml_error("NotSupported")

    n.nvmlDeviceGetNvLinkRemotePciInfo = hidden
    n.nvmlDeviceGetNvLinkRemoteDeviceType = lambda h, link: pynvml.NVML_NVLINK_DEVICE_TYPE_UNKNOWN
    devs = gpus(backend.discover())
    domains = {attrs(d).get("nvlinkDomain") for d in devs}
    assert len(domains) == 1 and None not in domains
    assert {attrs(d)["nvlinkDomainSize"] for d in devs} == {8}
    assert {attrs(d)["nvlinkLinks"] for d in devs} == {18}


def test_a_zero_remote_address_is_a_hidden_switch_too() -> None:
    backend = load_backend("mock:dgx-h100", "vm-2")
    real = backend.nvml.nvmlDeviceGetNvLinkRemotePciInfo

    def zero(h: Any, link: int) -> Any:
        s = real(h, link)
        s.busId = b"00000000:00:00.0"
        return s

    backend.nvml.nvmlDeviceGetNvLinkRemotePciInfo = zero
    devs = gpus(backend.discover())
    assert len({attrs(d).get("nvlinkDomain") for d in devs} - {None}) == 1


# ---------------- #18 / #19: NIC selection and rails from sysfs


def _port(root: Path, rdma: str, state: str, rate: str) -> None:
    port = root / "sys" / "class" / "infiniband" / rdma / "ports" / "1"
    (port / "state").write_text(state + "\n")
    (port / "rate").write_text(rate + "\n")


def _rails(devs: list[Device]) -> dict[str, int]:
    return {str(attrs(d)["rdmaDevice"]): int(attrs(d)["rail"]) for d in devs if d.kind == "nic"}


def test_a_port_down_at_discovery_keeps_its_nic_and_every_rail(tmp_path: Path) -> None:
    root = tmp_path / "hw"
    backend = load_backend("mock:dgx-h100", "n1", sysfs_root=str(root))
    before = _rails(backend.discover())
    assert len(before) == 8
    first = min(before, key=before.__getitem__)
    _port(root, first, "1: DOWN", "10 Gb/sec (4X SDR)")  # what a down IB port reports as its rate
    assert _rails(backend.discover()) == before


def test_an_active_slow_port_is_still_excluded(tmp_path: Path) -> None:
    root = tmp_path / "hw"
    backend = load_backend("mock:dgx-h100", "n1", sysfs_root=str(root))
    before = _rails(backend.discover())
    slow = min(before, key=before.__getitem__)
    _port(root, slow, "4: ACTIVE", "25 Gb/sec (1X EDR)")
    assert slow not in _rails(backend.discover())


def _add_vf(root: Path, pf_rdma: str, vf_rdma: str, vf_bdf: str) -> None:
    """An mlx5 SR-IOV VF: its own PCI function (with ``physfn``) and RDMA device reporting the PF's GUID."""
    ib = root / "sys" / "class" / "infiniband"
    pf_dev = Path(os.path.realpath(ib / pf_rdma / "device"))
    vf_dev = pf_dev.parent / vf_bdf
    vf_dev.mkdir()
    for f in ("numa_node", "local_cpulist", "vendor", "class"):
        (vf_dev / f).write_text((pf_dev / f).read_text())
    (vf_dev / "physfn").symlink_to(pf_dev)
    (root / "sys" / "bus" / "pci" / "devices" / vf_bdf).symlink_to(vf_dev)
    vf_ib = vf_dev / "infiniband" / vf_rdma
    (vf_ib / "ports" / "1").mkdir(parents=True)
    (vf_ib / "device").symlink_to(vf_dev)
    pf_ib = Path(os.path.realpath(ib / pf_rdma))
    (vf_ib / "sys_image_guid").write_text((pf_ib / "sys_image_guid").read_text())
    (vf_ib / "node_guid").write_text("b8ce:f603:00aa:0001\n")
    for f in ("rate", "state", "link_layer"):
        if (pf_ib / "ports" / "1" / f).exists():
            (vf_ib / "ports" / "1" / f).write_text((pf_ib / "ports" / "1" / f).read_text())
    (ib / vf_rdma).symlink_to(vf_ib)


def test_sriov_vfs_do_not_exclude_their_pf(tmp_path: Path) -> None:
    root = tmp_path / "hw"
    backend = load_backend("mock:dgx-h100", "n1", sysfs_root=str(root))
    before = _rails(backend.discover())
    pf = min(before, key=before.__getitem__)
    pf_bdf = os.path.basename(os.path.realpath(root / "sys" / "class" / "infiniband" / pf / "device"))
    domain, bus, _ = pf_bdf.split(":")
    _add_vf(root, pf, "mlx5_vf0", f"{domain}:{bus}:00.2")
    nics = backend.sysfs.rdma_nics()
    assert [n.virtual_function for n in nics if n.name == "mlx5_vf0"] == [True]
    assert _rails(backend.discover()) == before  # the PF stays a compute NIC, the VF is none


def test_select_compute_nics_rules_are_pure() -> None:
    backend = load_backend("mock:dgx-h100", "n1")
    nics = backend.sysfs.rdma_nics()
    compute = select_compute_nics(nics, DiscoveryConfig())
    assert assign_rails(compute, {}) == {n.name: i for i, n in enumerate(compute)}


# ---------------- #24: captures record MIG profiles and placements


def test_capture_records_mig_profiles_and_replays_the_same_devices(tmp_path: Path) -> None:
    mock = load_backend("mock:dgx-a100-80gb-mig", "mig-node")
    facts = capture_nvml(mock.nvml)
    assert all(g.migProfiles for g in facts.gpus)
    assert facts.gpus[0].migProfiles == sorted(mock.nvml.facts.gpus[0].migProfiles, key=lambda p: p.index)
    bdfs = [str(attrs(d)["resource.kubernetes.io/pciBusID"]) for d in gpus(mock.discover())]
    fx = ReplayFixture(synthetic=True, description="capture of the mock", node="mig-node", nvml=facts,
                       sysfs=capture_sysfs(mock.sysfs.root, bdfs))
    replayed = replay_backend(fx, "mig-node", config=DiscoveryConfig()).discover()
    assert [d.name for d in replayed] == [d.name for d in mock.discover()]
    assert any(d.kind == "mig" for d in replayed)


def test_capture_of_a_node_with_a_lost_gpu_records_it_and_replays_the_rest(tmp_path: Path) -> None:
    faults = tmp_path / "faults.json"
    faults.write_text('{"gpus": {"1": {"lost": true}}}')
    mock = load_backend("mock:dgx-h100", "cap-node", sysfs_root=str(tmp_path / "hw"),
                        overrides={"faultsFile": str(faults)})
    facts = capture_nvml(mock.nvml)
    assert facts.gpus[1].uuid == facts.gpus[1].pci and getattr(facts.gpus[1].uuid, "error", "") == "GpuIsLost"
    bdfs = mock.sysfs.nvidia_gpus()
    fx = ReplayFixture(synthetic=True, description="capture with a lost GPU", node="cap-node", nvml=facts,
                       sysfs=capture_sysfs(mock.sysfs.root, bdfs))
    names = [d.name for d in gpus(replay_backend(fx, "cap-node", config=DiscoveryConfig()).discover())]
    assert names == ["gpu-0", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-6", "gpu-7"]
