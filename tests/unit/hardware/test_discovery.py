"""Discovery: mock profiles through the real NVML backend, pairing, NVLink domains, error handling."""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from testkit.paths import REPO

from topodra.devices import Device
from topodra.hardware import DiscoveryError, NvmlBackend, load_backend
from topodra.hardware.mock import FakeNvml, MockHardware, nvml_error
from topodra.hardware.mockprofile import load_profile, profile_names
from topodra.hardware.sysfs import Sysfs

STD = "resource.kubernetes.io/"
GPU_REQUIRED = {
    "type", "uuid", "productName", "model", "brand", "architecture", "cudaComputeCapability", "driverVersion",
    "cudaDriverVersion", "migCapable", "minor", "index", STD + "pciBusID", STD + "pcieRoot", STD + "numaNode",
    "numaNode", "cpuSocket",
}  # fmt: skip
NIC_REQUIRED = {
    "type",
    "rail",
    "rdmaDevice",
    "netdev",
    "linkRate",
    STD + "pciBusID",
    STD + "pcieRoot",
    STD + "numaNode",
}

# profile -> (gpus, model, architecture, cc, migCapable, memory, nvlink domain sizes, compute NICs)
EXPECTED: dict[str, tuple[int, str, str, str, bool, str, set[int] | None, int]] = {
    "dgx-a100-80gb": (8, "A100-SXM4-80GB", "Ampere", "8.0.0", True, "80Gi", {8}, 8),
    "dgx-a100-80gb-mig": (8, "A100-SXM4-80GB", "Ampere", "8.0.0", True, "80Gi", {8}, 8),
    "dgx-h100": (8, "H100-SXM5-80GB", "Hopper", "9.0.0", True, "81559Mi", {8}, 8),
    "dgx-h100-mig": (8, "H100-SXM5-80GB", "Hopper", "9.0.0", True, "81559Mi", {8}, 8),
    "dgx-h200": (8, "H200-SXM5-141GB", "Hopper", "9.0.0", True, "143771Mi", {8}, 8),
    "hgx-b200": (8, "B200-SXM6-180GB", "Blackwell", "10.0.0", True, "183359Mi", {8}, 8),
    "gb200-nvl72": (4, "GB200", "Blackwell", "10.0.0", True, "189471Mi", {72}, 4),
    "h100-nvl": (8, "H100-NVL-94GB", "Hopper", "9.0.0", True, "95830Mi", {2}, 4),
    "l40s": (8, "L40S", "Ada Lovelace", "8.9.0", False, "46068Mi", None, 4),
    "l4": (4, "L4", "Ada Lovelace", "8.9.0", False, "23034Mi", None, 0),
}


def attrs(d: Device) -> dict[str, Any]:
    return {k: v.value for k, v in d.attributes.items()}


def split(devs: list[Device]) -> tuple[list[Device], list[Device]]:
    return [d for d in devs if d.kind == "gpu"], [d for d in devs if d.kind == "nic"]


def discover(spec: str, node: str = "node-a", **kw: Any) -> list[Device]:
    return load_backend(spec, node, **kw).discover()


def test_all_profiles_are_covered() -> None:
    assert sorted(EXPECTED) == profile_names()


@pytest.mark.parametrize("profile", sorted(EXPECTED))
def test_profile_attributes(profile: str) -> None:
    n_gpu, model, arch, cc, mig, memory, sizes, n_nic = EXPECTED[profile]
    devs = discover(f"mock:{profile}")
    gpus, nics = split(devs)
    assert [d.name for d in gpus] == [f"gpu-{i}" for i in range(n_gpu)]
    assert [d.name for d in nics] == [f"nic-{i}" for i in range(n_nic)]
    for d in gpus:
        a = attrs(d)
        assert set(a) >= GPU_REQUIRED, GPU_REQUIRED - set(a)
        whole = "gpu-mig-parent" if profile.endswith("-mig") else "gpu"  # MIG on: not a GPU class's device
        assert (a["type"], a["model"], a["architecture"], a["cudaComputeCapability"]) == (whole, model, arch, cc)
        assert a["migCapable"] is mig
        assert a["uuid"] == d.uuid and d.uuid.startswith("GPU-")
        assert d.capacity == {"memory": memory}
        assert d.device_nodes == ()  # mock GPUs have no /dev/nvidiaN on this host
        assert len(d.attributes) + len(d.capacity) <= 32
        if sizes is None:
            assert "nvlinkDomain" not in a and "nvlinkDomainSize" not in a
        else:
            assert a["nvlinkDomainSize"] in sizes
        if n_nic:
            assert {"rail", "nicName", "nicDistance"} <= set(a)
        else:
            assert not {"rail", "nicName", "nicDistance"} & set(a)
    for d in nics:
        a = attrs(d)
        assert set(a) >= NIC_REQUIRED, NIC_REQUIRED - set(a)
        assert d.device_nodes == ()
        assert a["type"] == "nic" and a["linkRate"] >= 100
    # compute NICs carry distinct rails 0..n-1
    assert sorted(attrs(d)["rail"] for d in nics) == list(range(n_nic))


def test_dgx_h100_gpu_i_pairs_with_nic_i_on_rail_i() -> None:
    gpus, nics = split(discover("mock:dgx-h100"))
    assert [attrs(n)["rdmaDevice"] for n in nics] == [
        "mlx5_0",
        "mlx5_3",
        "mlx5_4",
        "mlx5_5",
        "mlx5_6",
        "mlx5_9",
        "mlx5_10",
        "mlx5_11",
    ]  # fmt: skip  (storage adapters mlx5_1/2/7/8 excluded)
    for i, (g, n) in enumerate(zip(gpus, nics, strict=True)):
        ga, na = attrs(g), attrs(n)
        assert ga["nicName"] == na["rdmaDevice"]
        assert ga["rail"] == na["rail"] == i
        assert ga["nicDistance"] == "PXB"
        assert ga[STD + "pcieRoot"] == na[STD + "pcieRoot"]
        assert ga["pcieSwitch"] == na["pcieSwitch"]
        assert ga["numaNode"] == na["numaNode"] == (0 if i < 4 else 1)
        assert ga["cpuSocket"] == (0 if i < 4 else 1)
    domains = {attrs(g)["nvlinkDomain"] for g in gpus}
    assert len(domains) == 1
    (domain,) = domains
    assert domain.startswith("node-a/nvl-") and len(domain) <= 64


def test_dgx_a100_pairs_within_switch_complex_and_nps4_numa() -> None:
    gpus, _ = split(discover("mock:dgx-a100-80gb"))
    assert [attrs(g)["nicName"] for g in gpus] == [
        "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9",
    ]  # fmt: skip
    assert [attrs(g)["numaNode"] for g in gpus] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert [attrs(g)["cpuSocket"] for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert attrs(gpus[0])["driverVersion"] == "535.161.8"  # "535.161.08" normalized to semver
    assert attrs(gpus[0])["cudaDriverVersion"] == "12.2.0"


def test_h100_nvl_has_four_bridged_pair_domains() -> None:
    gpus, nics = split(discover("mock:h100-nvl"))
    domains = [attrs(g)["nvlinkDomain"] for g in gpus]
    assert len(set(domains)) == 4
    assert all(c == 2 for c in Counter(domains).values())
    assert domains[0::2] == domains[1::2]  # pairs (0,1), (2,3), ...
    assert {attrs(g)["nvlinkDomainSize"] for g in gpus} == {2}
    # each pair shares one NIC on its PCIe switch
    assert [attrs(g)["rail"] for g in gpus] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert {attrs(g)["nicDistance"] for g in gpus} == {"PIX"}
    assert len(nics) == 4


@pytest.mark.parametrize("profile", ["l40s", "l4"])
def test_pcie_only_gpus_have_no_nvlink_and_no_mig(profile: str) -> None:
    for g in split(discover(f"mock:{profile}"))[0]:
        a = attrs(g)
        assert "nvlinkDomain" not in a and "nvlinkLinks" not in a
        assert a["migCapable"] is False


def test_gb200_rack_of_18_trays_is_one_nvlink_domain() -> None:
    domains: set[str] = set()
    n = 0
    for tray in range(18):
        gpus, _ = split(discover("mock:gb200-nvl72", f"rack1-tray{tray}"))
        n += len(gpus)
        domains |= {attrs(g)["nvlinkDomain"] for g in gpus}
        # GPUs on NVLink-C2C: pair by Grace socket and order; one NIC per GPU
        assert [attrs(g)["nicName"] for g in gpus] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
        assert [attrs(g)["rail"] for g in gpus] == [0, 1, 2, 3]
        assert {attrs(g)["nvlinkDomainSize"] for g in gpus} == {72}
    assert n == 72
    assert domains == {"7c1f3a52-9d0e-4b6a-8f21-5e4d3c2b1a09.32766"}
    other_rack = {
        attrs(g)["nvlinkDomain"]
        for g in split(discover("mock:gb200-nvl72", "rack2-tray0", overrides={"clusterUUID": "1" * 32}))[0]
    }
    other_clique = {
        attrs(g)["nvlinkDomain"]
        for g in split(discover("mock:gb200-nvl72", "rack1-tray0", overrides={"cliqueId": 7}))[0]
    }
    assert other_rack == {"11111111-1111-1111-1111-111111111111.32766"}
    assert other_clique == {"7c1f3a52-9d0e-4b6a-8f21-5e4d3c2b1a09.7"}


def test_gb200_pairs_by_socket_when_numa_is_unknown(tmp_path: Any) -> None:
    backend = load_backend("mock:gb200-nvl72", "t0", sysfs_root=str(tmp_path))
    for bdf in ("0008:01:00.0", "0009:01:00.0", "0018:01:00.0", "0019:01:00.0"):
        dev = os.path.realpath(tmp_path / "sys/bus/pci/devices" / bdf)
        with open(os.path.join(dev, "numa_node"), "w") as f:
            f.write("-1\n")
    gpus, _ = split(backend.discover())
    assert [attrs(g)["nicName"] for g in gpus] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert {attrs(g)["nicDistance"] for g in gpus} == {"NODE"}  # same socket, different host bridge
    assert all("numaNode" not in attrs(g) and STD + "numaNode" not in attrs(g) for g in gpus)


def test_single_node_fabric_does_not_make_a_multi_node_domain() -> None:
    for profile in ("dgx-h200", "hgx-b200"):
        gpus, _ = split(discover(f"mock:{profile}", "n9"))
        assert {attrs(g)["nvlinkDomain"] for g in gpus} == {attrs(gpus[0])["nvlinkDomain"]}
        assert attrs(gpus[0])["nvlinkDomain"].startswith("n9/nvl-")


def test_determinism_and_per_node_identity() -> None:
    a1, a2 = discover("mock:dgx-h100", "n1"), discover("mock:dgx-h100", "n1")
    b = discover("mock:dgx-h100", "n2")
    assert a1 == a2
    assert [d.uuid for d in a1 if d.kind == "gpu"] != [d.uuid for d in b if d.kind == "gpu"]
    assert len({d.uuid for d in a1 + b if d.kind == "gpu"}) == 16
    assert attrs(a1[0])["nvlinkDomain"] != attrs(b[0])["nvlinkDomain"]


def test_long_node_name_keeps_domain_within_64_chars() -> None:
    node = "n" * 200
    g = split(discover("mock:dgx-h100", node))[0][0]
    assert len(attrs(g)["nvlinkDomain"]) == 64


def test_hidden_gpu_and_rediscovery() -> None:
    gpus, _ = split(discover("mock:dgx-h100", overrides={"hideGpus": [3]}))
    assert [g.name for g in gpus] == ["gpu-0", "gpu-1", "gpu-2", "gpu-4", "gpu-5", "gpu-6", "gpu-7"]
    assert {attrs(g)["nvlinkDomainSize"] for g in gpus} == {7}
    backend = load_backend("mock:dgx-h100", "node-a")
    before = backend.discover()
    assert isinstance(backend.nvml, FakeNvml) and isinstance(backend.nvml.hardware, MockHardware)
    backend.nvml.hardware.hide_gpus([5])
    after = backend.discover()
    assert len(after) == len(before) - 1 and "gpu-5" not in {d.name for d in after}
    backend.nvml.hardware.hide_gpus([])
    assert backend.discover() == before


def test_hidden_bridge_peer_leaves_partner_without_domain() -> None:
    gpus, _ = split(discover("mock:h100-nvl", overrides={"hideGpus": [1]}))
    a0 = attrs(gpus[0])
    assert gpus[0].name == "gpu-0" and "nvlinkDomain" not in a0
    assert len({attrs(g)["nvlinkDomain"] for g in gpus[1:]}) == 3


def test_rail_and_nic_overrides() -> None:
    gpus, nics = split(discover("mock:dgx-h100", overrides={"rails": {"mlx5_0": 7, "mlx5_11": 0}}))
    assert attrs(gpus[0])["rail"] == 7 and attrs(gpus[7])["rail"] == 0
    assert attrs(nics[0])["rail"] == 7
    _, nics = split(discover("mock:dgx-h100", overrides={"excludeNics": ["mlx5_0", "ibp64s0"]}))
    assert [attrs(n)["rdmaDevice"] for n in nics][:2] == ["mlx5_4", "mlx5_5"]
    _, nics = split(discover("mock:dgx-h100", overrides={"computeNics": ["mlx5_1", "0000:aa:00.0"]}))
    assert [attrs(n)["rdmaDevice"] for n in nics] == ["mlx5_1", "mlx5_7"]
    _, nics = split(discover("mock:l4", overrides={"minNicRateGbps": 10, "excludeMultiPort": False}))
    assert len(nics) == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"spec": "gpu:magic"}, "unknown hardware spec"),
        ({"spec": "mock:dgx-h9000"}, "unknown mock profile"),
        ({"spec": "nvml", "overrides": {"hideGpus": [1]}}, "mock hardware only"),
        ({"spec": "mock:dgx-h100", "overrides": {"hideGpus": [8]}}, "no GPU slot"),
        ({"spec": "mock:dgx-h100", "overrides": {"hideGpu": [1]}}, "hideGpu"),
        ({"spec": "mock:dgx-h100", "overrides": {"rails": {"mlx5_0": -1}}}, "rail indexes"),
        ({"spec": "mock:gb200-nvl72", "overrides": {"clusterUUID": "rack-1"}}, "UUID"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs: dict[str, Any], match: str) -> None:
    spec = kwargs.pop("spec")
    with pytest.raises(ValueError, match=match):
        load_backend(spec, "n1", **kwargs)


def test_real_nvml_without_driver_is_a_discovery_error() -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # a GPU host: discovery must work instead
        pynvml.nvmlShutdown()
        assert split(load_backend("nvml", "host").discover())[0]
        return
    # The library is looked up under the driver root (/) before nvmlInit; either step names the failure.
    with pytest.raises(DiscoveryError, match=r"NVML initialisation failed|libnvidia-ml\.so\.1 not found under"):
        load_backend("nvml", "host").discover()


# -- real backend error handling with a faked pynvml ------------------------------------------------


def _raising(name: str) -> Any:
    def fn(*_: Any) -> Any:
        raise nvml_error(name)

    return fn


@pytest.mark.parametrize("error", ["NotSupported", "FunctionNotFound", "Unknown", "GpuIsLost"])
@pytest.mark.parametrize(
    ("fn", "attr"),
    [
        ("nvmlDeviceGetBrand", "brand"),
        ("nvmlDeviceGetMinorNumber", "minor"),
        ("nvmlDeviceGetCudaComputeCapability", "cudaComputeCapability"),
        ("nvmlDeviceGetNvLinkState", "nvlinkDomain"),
        ("nvmlSystemGetDriverVersion", "driverVersion"),
    ],
)
def test_optional_nvml_failures_omit_the_attribute(
    fn: str, attr: str, error: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend = load_backend("mock:dgx-h100", "n1")
    setattr(backend.nvml, fn, _raising(error))
    with caplog.at_level(logging.DEBUG, logger="topodra.hardware"):
        gpus, nics = split(backend.discover())
    assert len(gpus) == 8 and len(nics) == 8
    assert all(attr not in attrs(g) for g in gpus)
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING and "n1" in r.getMessage()]
    if error in ("NotSupported", "FunctionNotFound"):
        assert not warned
    else:
        assert warned, "an unexpected NVML error must be logged as a warning naming the node"
    if fn == "nvmlDeviceGetMinorNumber":  # falls back to NVML index for naming
        assert [g.name for g in gpus] == [f"gpu-{i}" for i in range(8)]


def test_mig_not_supported_means_not_capable_but_unknown_error_means_absent() -> None:
    backend = load_backend("mock:dgx-h100", "n1")
    backend.nvml.nvmlDeviceGetMigMode = _raising("Unknown")
    assert all("migCapable" not in attrs(g) for g in split(backend.discover())[0])
    backend.nvml.nvmlDeviceGetMigMode = _raising("NotSupported")
    assert all(attrs(g)["migCapable"] is False for g in split(backend.discover())[0])


def test_older_binding_without_functions() -> None:
    backend = load_backend("mock:gb200-nvl72", "t0")
    assert isinstance(backend.nvml, FakeNvml)
    for fn in ("nvmlDeviceGetArchitecture", "nvmlSystemGetCudaDriverVersion_v2", "nvmlDeviceGetNvLinkRemoteDeviceType"):
        backend.nvml.remove(fn)
    gpus, _ = split(backend.discover())
    a = attrs(gpus[0])
    assert a["architecture"] == "Blackwell"  # from the compute capability
    assert a["cudaDriverVersion"] == "13.0.0"  # from the v1 call
    assert a["nvlinkDomain"].endswith(".32766")


@pytest.mark.parametrize("api", [1, 2])
def test_fabric_info_falls_back_to_older_struct_versions(api: int) -> None:
    backend = load_backend("mock:gb200-nvl72", "t0")
    assert isinstance(backend.nvml, FakeNvml)
    facts = backend.nvml.facts
    gpus = [g.model_copy(update={"fabric": g.fabric.model_copy(update={"api": api})}) for g in facts.gpus]
    backend.nvml.facts = facts.model_copy(update={"gpus": gpus})
    assert {attrs(g)["nvlinkDomain"] for g in split(backend.discover())[0]} == {
        "7c1f3a52-9d0e-4b6a-8f21-5e4d3c2b1a09.32766"
    }


def test_fabric_not_completed_falls_back_to_local_domain(caplog: pytest.LogCaptureFixture) -> None:
    backend = load_backend("mock:gb200-nvl72", "t0")
    assert isinstance(backend.nvml, FakeNvml)
    facts = backend.nvml.facts
    gpus = [g.model_copy(update={"fabric": g.fabric.model_copy(update={"state": 2})}) for g in facts.gpus]
    backend.nvml.facts = facts.model_copy(update={"gpus": gpus})
    with caplog.at_level(logging.WARNING):
        devs = split(backend.discover())[0]
    assert {attrs(g)["nvlinkDomain"] for g in devs} == {attrs(devs[0])["nvlinkDomain"]}
    assert attrs(devs[0])["nvlinkDomain"].startswith("t0/nvl-")
    assert attrs(devs[0])["nvlinkDomainSize"] == 4
    assert "not completed" in caplog.text


@pytest.mark.parametrize(
    "fn", ["nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetPciInfo"]
)
def test_mandatory_nvml_failures_skip_the_gpu_not_the_node(fn: str, caplog: pytest.LogCaptureFixture) -> None:
    """A GPU failing a mandatory call is left out (logged); the node's NICs are still published."""
    backend = load_backend("mock:dgx-h100", "n1")
    setattr(backend.nvml, fn, _raising("Unknown"))
    devs = backend.discover()
    assert [d.kind for d in devs] == ["nic"] * 8
    assert re.search(rf"node n1 GPU 0.*cannot read .*{fn}", caplog.text)
    assert backend.nvml.init_count == 0  # nvmlShutdown still ran


def test_count_and_init_failures_raise() -> None:
    backend = load_backend("mock:l4", "n1")
    backend.nvml.nvmlDeviceGetCount = _raising("DriverNotLoaded")
    with pytest.raises(DiscoveryError, match="GPU count"):
        backend.discover()
    backend.nvml.nvmlInit = _raising("LibraryNotFound")
    with pytest.raises(DiscoveryError, match="initialisation failed"):
        backend.discover()


# -- malformed sysfs ---------------------------------------------------------------------------------


def _gpu_dir(root: Any, bdf: str) -> str:
    return os.path.realpath(os.path.join(str(root), "sys/bus/pci/devices", bdf))


@pytest.mark.parametrize(("content", "warns"), [("-1", False), (None, False), ("banana", True)])
def test_bad_numa_node_omits_numa(tmp_path: Any, content: str | None, warns: bool, caplog: Any) -> None:
    backend = load_backend("mock:dgx-h100", "n1", sysfs_root=str(tmp_path))
    p = os.path.join(_gpu_dir(tmp_path, "0000:1b:00.0"), "numa_node")
    if content is None:
        os.remove(p)
    else:
        with open(p, "w") as f:
            f.write(content)
    with caplog.at_level(logging.WARNING):
        g0 = split(backend.discover())[0][0]
    a = attrs(g0)
    assert "numaNode" not in a and STD + "numaNode" not in a
    assert a[STD + "pcieRoot"] == "pci0000:15" and a["nicName"] == "mlx5_0"
    assert ("numa_node" in caplog.text) is warns


def test_missing_pci_device_and_bad_cpulist(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    backend = load_backend("mock:dgx-h100", "n1", sysfs_root=str(tmp_path))
    os.remove(tmp_path / "sys/bus/pci/devices/0000:1b:00.0")
    with open(os.path.join(_gpu_dir(tmp_path, "0000:43:00.0"), "local_cpulist"), "w") as f:
        f.write("7-3")
    with caplog.at_level(logging.WARNING):
        gpus, _ = split(backend.discover())
    a0, a1 = attrs(gpus[0]), attrs(gpus[1])
    assert not {STD + "pcieRoot", "numaNode", "rail", "nicName"} & set(a0)
    assert a0["nvlinkDomain"] == a1["nvlinkDomain"]  # NVML facts still published
    assert "cpuSocket" not in a1 and a1["numaNode"] == 0
    assert "0000:1b:00.0" in caplog.text and "local_cpulist" in caplog.text


def _hardware(profile: str, node: str) -> MockHardware:
    p = load_profile(profile)
    return MockHardware(p, node, frozenset(), p.fabric)


def test_no_sysfs_at_all(tmp_path: Any) -> None:
    backend = NvmlBackend("n1", nvml=_hardware("dgx-h100", "n1").nvml, sysfs=Sysfs(str(tmp_path / "empty")))
    gpus, nics = split(backend.discover())
    assert len(gpus) == 8 and nics == []
    assert all("rail" not in attrs(g) and "nvlinkDomain" in attrs(g) for g in gpus)


# -- replay ------------------------------------------------------------------------------------------

FIXTURES = str(REPO / "tests" / "fixtures" / "hardware")


def test_synthetic_h200_replay_runs_through_real_backend() -> None:
    from topodra.hardware.replay import load_fixture

    path = os.path.join(FIXTURES, "h200-single-synthetic.yaml")
    assert load_fixture(path).synthetic is True
    devs = discover(f"replay:{path}", "gpu-host")
    assert [d.name for d in devs] == ["gpu-0"]
    a = attrs(devs[0])
    assert a["model"] == "H200-SXM5-141GB" and a["architecture"] == "Hopper"
    assert a["driverVersion"] == "570.172.8" and a["cudaDriverVersion"] == "12.8.0"
    assert a[STD + "pcieRoot"] == "pci0000:15" and a["numaNode"] == 0 and a["cpuSocket"] == 0
    assert "nvlinkDomain" not in a and "rail" not in a  # links down, no NICs
    assert devs[0].capacity == {"memory": "143771Mi"}


def test_capture_then_replay_reproduces_discovery(tmp_path: Any) -> None:
    from topodra.hardware.nvml import normalize_bus_id
    from topodra.hardware.replay import ReplayFixture, capture_nvml, capture_sysfs, dump_fixture

    backend = load_backend("mock:dgx-h200", "cap", sysfs_root=str(tmp_path / "src"))
    expected = backend.discover()
    facts = capture_nvml(backend.nvml)
    assert backend.nvml.init_count == 0
    tree = capture_sysfs(str(tmp_path / "src"), [normalize_bus_id(g.pci.busId) for g in facts.gpus])  # type: ignore[union-attr]
    fx = ReplayFixture(synthetic=True, description="mock capture", node="cap", nvml=facts, sysfs=tree)
    path = tmp_path / "fx.yaml"
    path.write_text(dump_fixture(fx))
    assert load_backend(f"replay:{path}", "cap", sysfs_root=str(tmp_path / "dst")).discover() == expected


def test_cli_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    from topodra.cli import main

    assert main(["discover", "--hardware", "mock:h100-nvl", "--node-name", "n1", "--output", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in out][:2] == ["gpu-0", "gpu-1"]
    assert out[0]["attributes"]["model"] == {"string": "H100-NVL-94GB"}
    assert out[0]["capacity"]["memory"] == {"value": "95830Mi"}
    assert main(["discover", "--hardware", "mock:l4", "--node-name", "n1"]) == 0
    assert "gpu-3" in capsys.readouterr().out
    assert main(["discover", "--hardware", "mock:nope", "--node-name", "n1"]) == 1
    assert "unknown mock profile" in capsys.readouterr().err


def test_only_host_hardware_names_device_nodes() -> None:
    """The same backend on the same mock hardware: as host hardware it names /dev nodes, as mock none."""
    hw = _hardware("dgx-h100", "n1")
    as_host = NvmlBackend("n1", nvml=hw.nvml, sysfs=hw.sysfs).discover()
    as_mock = load_backend("mock:dgx-h100", "n1").discover()
    gpus, nics = split(as_host)
    assert [g.device_nodes for g in gpus] == [(f"/dev/nvidia{i}",) for i in range(8)]
    assert [n.device_nodes for n in nics] == [
        (f"/dev/infiniband/uverbs{i}",) for i in (0, 3, 4, 5, 6, 9, 10, 11)
    ]  # uverbs index = RDMA function index; storage NICs 1/2/7/8 are not compute NICs
    assert all(d.device_nodes == () for d in as_mock)
    assert [d.model_copy(update={"device_nodes": ()}) for d in as_host] == as_mock  # nothing else differs
    replay = discover(f"replay:{os.path.join(FIXTURES, 'h200-single-synthetic.yaml')}", "gpu-host")
    assert [d.device_nodes for d in replay] == [()]


def test_nodes_of_a_profile_share_one_sysfs_tree_but_not_their_changes() -> None:
    a, b = load_backend("mock:dgx-h200", "share-a"), load_backend("mock:dgx-h200", "share-b")
    assert a.sysfs.root == b.sysfs.root  # written once, read by both
    assert load_backend("mock:dgx-h100", "share-c").sysfs.root != a.sysfs.root
    before_b = b.discover()
    assert isinstance(a.nvml, FakeNvml) and a.nvml.hardware is not None
    a.nvml.hardware.hide_gpus([2])  # a GPU falls off node a's bus ...
    assert a.sysfs.root != b.sysfs.root
    assert not os.path.lexists(os.path.join(a.sysfs.root, "sys/bus/pci/devices/0000:52:00.0"))
    assert "gpu-2" not in {d.name for d in a.discover()}
    assert b.discover() == before_b  # ... and node b's hardware is untouched
    assert os.path.lexists(os.path.join(b.sysfs.root, "sys/bus/pci/devices/0000:52:00.0"))


def test_edited_profile_file_is_read_again(tmp_path: Any) -> None:
    from topodra.hardware.mockprofile import PROFILE_DIR

    path = tmp_path / "mine.yaml"
    text = Path(PROFILE_DIR, "l4.yaml").read_text(encoding="utf-8")
    path.write_text(text)
    assert split(discover(f"mock:{path}"))[0][0].capacity == {"memory": "23034Mi"}
    assert load_profile(str(path)) is load_profile(str(path))  # parsed once while unchanged
    path.write_text(text.replace("memoryMiB: 23034", "memoryMiB: 23035"))
    os.utime(path, ns=(1, 1))  # a different mtime even on a coarse clock
    assert split(discover(f"mock:{path}"))[0][0].capacity == {"memory": "23035Mi"}
