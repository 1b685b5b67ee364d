"""NVIDIA DRA driver attribute names on topodra's devices (issue 35): same name, same type, where topodra has the fact.

NVIDIA's driver (kubernetes-sigs/dra-driver-nvidia-gpu) published ``index``/``minor`` on GPUs and ``parentIndex`` on
MIG devices up to v25.3 (cmd/gpu-kubelet-plugin/deviceinfo.go), and publishes ``addressingMode`` since v25.12; its
demo claims still select by ``index``.  Every device must stay within the API's 32 attributes + capacities
(k8s.io/api@v0.37.2 resource/v1/types.go:813 ResourceSliceMaxAttributesAndCapacitiesPerDevice), also with every
optional fact present and the ``--numa-alias`` copy.
"""

from __future__ import annotations

from topodra.cpudriver import with_numa_alias
from topodra.devices import MAX_ATTRIBUTES_AND_CAPACITIES, Device
from topodra.hardware import load_backend
from topodra.hardware.attributes import GpuInfo, GpuTopology, SystemInfo, architecture_name, gpu_device
from topodra.hardware.pairing import NicPairing
from topodra.hardware.sysfs import PciLocation
from topodra.sharing.memory import shared
from topodra.sharing.mig import MigProfile, partition

NVIDIA_GPU = {"type", "uuid", "productName", "brand", "architecture", "cudaComputeCapability", "driverVersion",
              "cudaDriverVersion", "minor", "index", "resource.kubernetes.io/pciBusID",
              "resource.kubernetes.io/pcieRoot", "resource.kubernetes.io/numaNode"}  # fmt: skip
NVIDIA_MIG = {"type", "parentUUID", "profile", "parentIndex", "productName", "brand", "architecture",
              "cudaComputeCapability", "driverVersion", "cudaDriverVersion", "resource.kubernetes.io/pcieRoot",
              "resource.kubernetes.io/numaNode"}  # fmt: skip


def _kinds(d: Device) -> dict[str, str]:
    return {k: next(iter(v.to_api())) for k, v in d.attributes.items()}


def test_mock_mig_node_publishes_nvidia_names_with_nvidia_types() -> None:
    devs = load_backend("mock:dgx-a100-80gb-mig", "node-a").discover()
    gpus = {d.name: d for d in devs if d.attributes["type"].value == "gpu-mig-parent"}
    migs = [d for d in devs if d.kind == "mig"]
    assert len(gpus) == 8 and migs
    for i, g in enumerate(sorted(gpus.values(), key=lambda d: int(d.attributes["index"].value))):
        assert set(g.attributes) >= NVIDIA_GPU, NVIDIA_GPU - set(g.attributes)
        assert g.attributes["index"].value == i
        kinds = _kinds(g)
        assert kinds["index"] == kinds["minor"] == "int"
        assert kinds["cudaComputeCapability"] == kinds["driverVersion"] == kinds["cudaDriverVersion"] == "version"
        assert g.attributes["architecture"].value == "Ampere" and g.attributes["brand"].value in ("Nvidia", "Tesla")
    by_uuid = {g.uuid: g for g in gpus.values()}
    for m in migs:
        assert set(m.attributes) >= NVIDIA_MIG, NVIDIA_MIG - set(m.attributes)
        parent = by_uuid[str(m.attributes["parentUUID"].value)]
        assert m.attributes["parentIndex"] == parent.attributes["index"]
        assert "index" not in m.attributes and "minor" not in m.attributes  # the parent's, not the instance's
        assert m.attributes["profile"].value in {"1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"}


def test_addressing_mode_as_nvidia_names_it() -> None:
    def dev(mode: int | None) -> Device:
        info = GpuInfo(index=2, uuid="GPU-x", product_name="NVIDIA GH200 480GB", memory_bytes=2**30 * 96,
                       bdf="0009:01:00.0", minor=5, brand=14, architecture=9, compute_capability=(9, 0),
                       mig_capable=True, nvlink_version=None, nvlink_active_links=0, addressing_mode=mode)
        return gpu_device(info, SystemInfo(None, None), GpuTopology(None, None, None, None, None), device_nodes=False)

    assert dev(2).attributes["addressingMode"].value == "ATS"
    assert dev(1).attributes["addressingMode"].value == "HMM"
    assert dev(0).attributes["addressingMode"].value == "None"
    assert "addressingMode" not in dev(None).attributes and "addressingMode" not in dev(7).attributes
    assert dev(None).attributes["index"].value == 2 and dev(None).attributes["minor"].value == 5


def test_architecture_spelled_as_nvidia_spells_it() -> None:
    assert [architecture_name(a, None) for a in (7, 8, 9, 10)] == ["Ampere", "Ada Lovelace", "Hopper", "Blackwell"]
    assert architecture_name(None, (8, 9)) == "Ada Lovelace" and architecture_name(None, (12, 0)) == "Blackwell"


def test_every_fact_present_still_fits_the_api_limit() -> None:
    """The fullest GPU (all optional facts, a NIC, NVLink, the NUMA alias), its MIG devices and its shared form."""
    loc = PciLocation(bdf="0000:1b:00.0", root="pci0000:15", bridges=("0000:15:01.0", "0000:16:00.0"),
                      numa_node=0, local_cpus=frozenset({0, 1}), cpu_socket=0)
    info = GpuInfo(index=0, uuid="GPU-full", product_name="NVIDIA H100 80GB HBM3", memory_bytes=80 * 2**30,
                   bdf="0000:1b:00.0", minor=0, brand=14, architecture=9, compute_capability=(9, 0),
                   mig_capable=True, nvlink_version=4, nvlink_active_links=18, addressing_mode=1)
    topo = GpuTopology(loc, "node-a/nvl-0123456789ab", 8, NicPairing("mlx5_0", "PIX"), 0)
    gpu = gpu_device(info, SystemInfo("580.126.20", 13000), topo, device_nodes=False)
    gpu = with_numa_alias([gpu], "dra.net/numaNode")[0]
    profiles = [MigProfile(name="1g.10gb", profile_id=19, compute_slices=1, memory_mib=9856, multiprocessors=16,
                           placements=((0, 1),))]
    for d in [gpu, shared(gpu), *partition(gpu, profiles)]:
        n = len(d.attributes) + len(d.capacity)
        assert n <= MAX_ATTRIBUTES_AND_CAPACITIES, (d.name, n)
