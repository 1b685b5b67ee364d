"""Availability of ClaimProfile alternatives from slices, claims and classes."""

from __future__ import annotations

from typing import Any

from topodra.classcatalog import catalog, to_device_class
from topodra.controller.availability import make_snapshot, profile_availability
from topodra.controller.profile import ClaimProfile

D = "gpu.topodra.io"


def gpu(name: str, model: str, memory: str, cc: str, nvlink: str, numa: int, rail: int,
        taints: list[dict[str, str]] | None = None) -> dict[str, Any]:
    dev: dict[str, Any] = {
        "name": name,
        "attributes": {"type": {"string": "gpu"}, "model": {"string": model},
                       "cudaComputeCapability": {"version": cc}, "nvlinkDomain": {"string": nvlink},
                       "rail": {"int": rail}, "resource.kubernetes.io/numaNode": {"int": numa}},
        "capacity": {"memory": {"value": memory}},
    }
    if taints:
        dev["taints"] = taints
    return dev


def nic(name: str, rail: int) -> dict[str, Any]:
    return {"name": name, "attributes": {"type": {"string": "nic"}, "rail": {"int": rail}}}


def slice_(node: str, devices: list[dict[str, Any]], generation: int = 1, driver: str = D) -> dict[str, Any]:
    return {"metadata": {"name": f"{node}-{generation}"},
            "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "generation": generation,
                                                                   "resourceSliceCount": 1},
                     "devices": devices}}


def claim(*held: tuple[str, str], driver: str = D) -> dict[str, Any]:
    return {"status": {"allocation": {"devices": {"results": [
        {"request": "gpus", "driver": driver, "pool": p, "device": d} for p, d in held]}}}}


def hgx(node: str, model: str = "H200-SXM5-141GB", memory: str = "143771Mi", cc: str = "9.0.0",
        nics: bool = True) -> dict[str, Any]:
    devs = [gpu(f"gpu-{i}", model, memory, cc, node, i // 4, i) for i in range(8)]
    if nics:
        devs += [nic(f"nic-{i}", i) for i in range(8)]
    return slice_(node, devs)


CLASSES = [to_device_class(s) for s in catalog()] + [
    {"metadata": {"name": "foreign"}, "spec": {"selectors": [{"cel": {"expression": "true"}}]}}]


def prof(alternatives: list[dict[str, Any]], topology: dict[str, str] | None = None) -> ClaimProfile:
    return ClaimProfile.from_api({"metadata": {"name": "p", "namespace": "ns"},
                                  "spec": {"alternatives": alternatives, "topology": topology or {}}})


def table(p: ClaimProfile, slices: list[dict[str, Any]], claims: list[dict[str, Any]] | None = None
          ) -> list[tuple[str, bool, int | None, int | None, int | None]]:
    snap = make_snapshot(slices, claims or [], CLASSES)
    return [(a.name, a.known, a.devices_total, a.devices_free, a.nodes_fit) for a in profile_availability(p, snap)]


def test_counts_per_alternative() -> None:
    slices = [hgx("a"), hgx("b", "H100-SXM5-80GB", "81559Mi"), hgx("c", "H100-SXM5-80GB", "81559Mi")]
    claims = [claim(("b", "gpu-0"), ("b", "gpu-1"))]
    p = prof([{"deviceClassName": "gpu-h200", "count": 8}, {"deviceClassName": "gpu-h100", "count": 8},
              {"deviceClassName": "gpu-a100-80gb", "count": 8}, {"name": "mem", "deviceClassName": "gpu-mem-80gi",
                                                                  "count": 8}])
    assert table(p, slices, claims) == [
        ("h200", True, 8, 8, 1),
        ("h100", True, 16, 14, 1),
        ("a100-80gb", True, 0, 0, 0),
        ("mem", True, 24, 22, 2),  # H100 SXM5 reports 81559Mi; the 80gi tier still counts it
    ]


def test_required_numa_groups_by_numa_node() -> None:
    slices = [hgx("a")]
    claims = [claim(("a", "gpu-0"))]  # numa 0 keeps 3 free GPUs, numa 1 keeps 4
    assert table(prof([{"deviceClassName": "gpu-h200", "count": 4}], {"numa": "Required"}), slices, claims) == [
        ("h200", True, 8, 7, 1)]
    claims.append(claim(("a", "gpu-7")))
    assert table(prof([{"deviceClassName": "gpu-h200", "count": 4}], {"numa": "Required"}), slices, claims) == [
        ("h200", True, 8, 6, 0)]
    # Preferred never reduces the fit: there is an unconstrained fallback
    assert table(prof([{"deviceClassName": "gpu-h200", "count": 4}], {"numa": "Preferred"}), slices, claims) == [
        ("h200", True, 8, 6, 1)]


def test_required_nvlink_needs_one_domain() -> None:
    devs = [gpu(f"gpu-{i}", "H100-NVL-94GB", "95830Mi", "9.0.0", f"n/nvl-{i // 2}", 0, i) for i in range(4)]
    p2 = prof([{"deviceClassName": "gpu-h100", "count": 2}], {"nvlink": "Required"})
    p3 = prof([{"deviceClassName": "gpu-h100", "count": 3}], {"nvlink": "Required"})
    assert table(p2, [slice_("n", devs)]) == [("h100", True, 4, 4, 1)]
    assert table(p3, [slice_("n", devs)]) == [("h100", True, 4, 4, 0)]
    assert table(p2, [slice_("n", devs)], [claim(("n", "gpu-0"), ("n", "gpu-2"))]) == [("h100", True, 4, 2, 0)]


def test_only_newest_pool_generation_and_own_driver_count() -> None:
    old = slice_("a", [gpu(f"old-{i}", "H200-SXM5-141GB", "143771Mi", "9.0.0", "a", 0, 0) for i in range(8)], 1)
    new = slice_("a", [gpu("gpu-0", "H200-SXM5-141GB", "143771Mi", "9.0.0", "a", 0, 0)], 2)
    other = slice_("z", [gpu("gpu-0", "H200-SXM5-141GB", "143771Mi", "9.0.0", "z", 0, 0)], driver="other.io")
    assert table(prof([{"deviceClassName": "gpu-h200"}]), [old, new, other]) == [("h200", True, 1, 1, 1)]


def test_tainted_devices_are_not_free() -> None:
    devs = [gpu("gpu-0", "L4", "23034Mi", "8.9.0", "x", 0, 0, taints=[{"key": f"{D}/xid", "effect": "NoSchedule"}]),
            gpu("gpu-1", "L4", "23034Mi", "8.9.0", "x", 0, 0, taints=[{"key": "info", "effect": "None"}])]
    assert table(prof([{"deviceClassName": "gpu-l4"}]), [slice_("x", devs)]) == [("l4", True, 2, 1, 1)]


def test_foreign_and_missing_classes_are_unknown() -> None:
    p = prof([{"deviceClassName": "foreign"}, {"deviceClassName": "gpu-nope"}, {"deviceClassName": "gpu-h200"}])
    snap = make_snapshot([hgx("a")], [], CLASSES)
    out = profile_availability(p, snap)
    assert [(a.name, a.known) for a in out] == [("foreign", False), ("nope", False), ("h200", True)]
    assert "not a topodra class" in out[0].message
    assert out[1].message == "DeviceClass not found"
    assert out[0].to_api() == {"name": "foreign", "deviceClassName": "foreign", "count": 1, "known": False}
    assert out[2].to_api() == {"name": "h200", "deviceClassName": "gpu-h200", "count": 1, "known": True,
                               "devicesTotal": 8, "devicesFree": 8, "nodesFit": 1}


def test_architecture_and_memory_classes() -> None:
    slices = [hgx("a"), hgx("b", "A100-SXM4-40GB", "40960Mi", "8.0.0", nics=False),
              hgx("c", "B200-SXM6-180GB", "183359Mi", "10.0.0", nics=False)]
    p = prof([{"deviceClassName": "gpu-hopper-plus", "count": 8}, {"deviceClassName": "gpu-ampere-plus", "count": 8},
              {"deviceClassName": "gpu-mem-140gi", "count": 8}, {"deviceClassName": "gpu-blackwell-plus",
                                                                  "count": 8}])
    assert [(n, t, f) for n, _, t, _, f in table(p, slices)] == [
        ("hopper-plus", 16, 2), ("ampere-plus", 24, 3), ("mem-140gi", 16, 2), ("blackwell-plus", 8, 1)]


def test_rail_aligned_needs_free_nics_on_the_gpus_rails() -> None:
    p = prof([{"deviceClassName": "gpu-h200", "count": 2}], {"nic": "RailAligned"})
    assert table(p, [hgx("a")]) == [("h200", True, 8, 8, 1)]
    # no NICs published -> nothing fits
    assert table(p, [hgx("a", nics=False)]) == [("h200", True, 8, 8, 0)]
    # all NICs but one taken -> only one pair left, two are needed
    taken = [("a", f"nic-{i}") for i in range(7)]
    assert table(p, [hgx("a")], [claim(*taken)]) == [("h200", True, 8, 8, 0)]
    assert table(prof([{"deviceClassName": "gpu-h200"}], {"nic": "RailAligned"}), [hgx("a")],
                 [claim(*taken)]) == [("h200", True, 8, 8, 1)]


def test_mock_nodes_from_discovery() -> None:
    """Availability over slices built from the discovery helper's mock profiles (real attribute names)."""
    from topodra.hardware import load_backend
    from topodra.slices import build_slices

    slices = []
    for node, profile in (("nvl-1", "h100-nvl"), ("dgx-1", "dgx-h100"), ("l4-1", "l4")):
        devices = load_backend(f"mock:{profile}", node).discover()
        slices += build_slices(D, node, f"uid-{node}", devices, 1)
    pair = prof([{"deviceClassName": "gpu-h100", "count": 2}], {"nvlink": "Required"})
    assert table(pair, slices) == [("h100", True, 16, 16, 2)]
    triple = prof([{"deviceClassName": "gpu-h100", "count": 3}], {"nvlink": "Required"})
    assert table(triple, slices) == [("h100", True, 16, 16, 1)]  # NVL pairs are too small; the DGX fits
    numa8 = prof([{"deviceClassName": "gpu.topodra.io", "count": 8}], {"numa": "Required"})
    assert table(numa8, slices)[0][4] == 0
    rail = prof([{"deviceClassName": "gpu-h100", "count": 8}], {"nic": "RailAligned", "nvlink": "Required"})
    assert table(rail, slices) == [("h100", True, 16, 16, 1)]  # DGX H100: 8 GPUs, 8 rails, 8 NICs
    l4 = prof([{"deviceClassName": "gpu-l4", "count": 1}], {"nic": "RailAligned"})
    assert table(l4, slices) == [("l4", True, 4, 4, 0)]  # the L4 box has no compute NICs


def test_why_not_explains_each_kind_of_misfit() -> None:
    from topodra.controller.availability import why_not

    plain = prof([{"deviceClassName": "gpu-h200", "count": 8}])
    assert why_not(plain, "gpu-h200", 8, 0, 0) == "no published device matches DeviceClass gpu-h200"
    assert why_not(plain, "gpu-h200", 8, 16, 3) == "3 of 16 devices free, 8 needed"
    nvl = prof([{"deviceClassName": "gpu-h100", "count": 8}], {"nvlink": "Required", "numa": "Required"})
    assert why_not(nvl, "gpu-h100", 8, 32, 16) == (
        "16 of 32 devices free, but no node has 8 free in one NVLink domain, on one NUMA node")
    rail = prof([{"deviceClassName": "gpu-h100", "count": 2}], {"nic": "RailAligned"})
    assert why_not(rail, "gpu-h100", 2, 8, 4).endswith("no node has 2 free each with a free NIC on its rail")


def test_cordoned_tainted_and_notready_nodes_do_not_fit() -> None:
    def node(name: str, ready: bool = True, taint: str | None = None, cordon: bool = False) -> dict[str, Any]:
        spec: dict[str, Any] = {"unschedulable": cordon}
        if taint:
            spec["taints"] = [{"key": "k", "effect": taint}]
        return {"metadata": {"name": name}, "spec": spec,
                "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}

    p = prof([{"deviceClassName": "gpu-h200", "count": 8}])
    slices = [hgx(n) for n in ("ok", "cordoned", "tainted", "soft", "down")]
    nodes = [node("ok"), node("cordoned", cordon=True), node("tainted", taint="NoSchedule"),
             node("soft", taint="PreferNoSchedule"), node("down", ready=False)]
    snap = make_snapshot(slices, [], CLASSES, nodes=nodes)
    (status,) = profile_availability(p, snap)
    assert status.devices_free == 40  # devices stay free; only the fit count honours the nodes
    assert status.nodes_fit == 2  # "ok" and "soft" (PreferNoSchedule does not block)
