"""Simulated clusters with dra-driver-cpu's grouped-mode slices (cluster file ``cpuDriver``)."""

from __future__ import annotations

import pytest

from topodra.simulate import SimulatedCluster, cpu_devices, plan


def cluster(release: str | None, profile: str = "dgx-h100") -> SimulatedCluster:
    data: dict[str, object] = {"groups": [{"namePrefix": "n-", "count": 1, "profile": profile}]}
    if release is not None:
        data["cpuDriver"] = release
    return SimulatedCluster.model_validate(data)


def test_cpu_driver_is_opt_in_and_names_a_known_release() -> None:
    assert cluster(None).cpu_driver is None
    assert cluster("v0.2.0").cpu_driver == "v0.2.0"
    with pytest.raises(ValueError, match="cpuDriver"):
        cluster("v0.3.0")


def test_one_device_per_numa_node_of_the_mock_profile() -> None:
    (node,) = plan(cluster("main"))
    devs = cpu_devices(node, "main")
    # DGX H100: 2x Xeon 8480C, 56 cores x 2 threads per NUMA node ('0-55,112-167', '56-111,168-223')
    assert [(d.name, d.capacity["dra.cpu/cpu"]) for d in devs] == [("cpudevnuma000", "112"), ("cpudevnuma001", "112")]
    assert {d.attributes["dra.cpu/smtEnabled"].value for d in devs} == {True}
    assert [d.attributes["resource.kubernetes.io/numaNode"].value for d in devs] == [0, 1]
    assert [d.attributes["dra.cpu/socketID"].value for d in devs] == [0, 1]
    assert all(d.allow_multiple_allocations for d in devs)


def test_grace_has_no_smt_and_v020_no_standard_attribute() -> None:
    (node,) = plan(cluster("v0.2.0", "gb200-nvl72"))
    devs = cpu_devices(node, "v0.2.0")
    assert [d.capacity["dra.cpu/cpu"] for d in devs] == ["72", "72"]
    assert {d.attributes["dra.cpu/smtEnabled"].value for d in devs} == {False}
    assert all("resource.kubernetes.io/numaNode" not in d.attributes for d in devs)
    assert [d.attributes["dra.net/numaNode"].value for d in devs] == [0, 1]
