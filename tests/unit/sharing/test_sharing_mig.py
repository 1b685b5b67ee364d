"""MIG as partitionable devices: fake NVML MIG semantics, discovery, counters, and the real apiserver's validation.

Split by tier; the rest: tests/cluster/test_sharing_mig_cluster.py.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pynvml
import pytest

from topodra.hardware import load_backend
from topodra.hardware.mock import FakeHandle, FakeNvml, MockHardware
from topodra.hardware.mockmig import mig_uuid
from topodra.hardware.mockprofile import load_profile
from topodra.sharing.mig import COMPUTE_COUNTER, placement_of
from topodra.slices import build_slices

DRIVER = "gpu.topodra.io"


def _nvml(profile: str = "dgx-a100-80gb-mig", state: Path | None = None) -> FakeNvml:
    p = load_profile(profile)
    hw = MockHardware(p, "mig-node", frozenset(), p.fabric, mig_state_file=None if state is None else str(state))
    hw.nvml.nvmlInit()
    return hw.nvml


def _place(start: int, size: int) -> Any:
    return ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(start, size))


def _code(e: pytest.ExceptionInfo[pynvml.NVMLError]) -> int:
    return int(e.value.value)


# -- fake NVML ------------------------------------------------------------------------------------


def test_profiles_and_placements_answer_like_nvml() -> None:
    n = _nvml()
    h = n.nvmlDeviceGetHandleByIndex(0)
    assert list(n.nvmlDeviceGetMigMode(h)) == [1, 1]
    info = n.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
    assert (info.id, info.sliceCount, info.name) == (9, 3, "MIG 3g.40gb")
    count = ctypes.c_uint(0)
    n.nvmlDeviceGetGpuInstancePossiblePlacements(h, 19, None, ctypes.byref(count))
    assert count.value == 7
    small = (pynvml.c_nvmlGpuInstancePlacement_t * 2)()
    with pytest.raises(pynvml.NVMLError) as e:
        n.nvmlDeviceGetGpuInstancePossiblePlacements(h, 19, small, ctypes.byref(ctypes.c_uint(2)))
    assert _code(e) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    with pytest.raises(pynvml.NVMLError) as e:
        n.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_6_SLICE)
    assert _code(e) == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_create_destroy_with_nvml_error_semantics() -> None:
    n = _nvml()
    h = n.nvmlDeviceGetHandleByIndex(2)
    gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, _place(4, 4))  # 3g.40gb at 4
    with pytest.raises(pynvml.NVMLError) as e:  # occupied placement: overlaps slices 4-7
        n.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, _place(5, 1))
    assert _code(e) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    with pytest.raises(pynvml.NVMLError) as e:  # a placement the profile does not offer
        n.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, _place(2, 4))
    assert _code(e) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    gi2 = n.nvmlDeviceCreateGpuInstanceWithPlacement(h, 5, _place(0, 4))  # 4g.40gb at 0: 3 + 4 = 7 slices
    assert n.nvmlGpuInstanceGetInfo(gi2).placement.start == 0
    n.nvmlGpuInstanceDestroy(gi2)
    n.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, _place(0, 1))
    n.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, _place(1, 1))
    n.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, _place(2, 1))
    n.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, _place(3, 1))
    with pytest.raises(pynvml.NVMLError) as e:  # a free placement, but 3 + 4 x 1 compute slices are all used
        n.nvmlDeviceCreateGpuInstanceWithPlacement(h, 15, _place(0, 2))
    assert _code(e) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    def ci_id(index: int) -> int:  # NVML takes the profile's id, not its index (issue 19, finding 21)
        info = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, index, 0)
        assert info.id != index
        return int(info.id)

    ci = n.nvmlGpuInstanceCreateComputeInstance(gi, ci_id(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE))
    with pytest.raises(pynvml.NVMLError) as e:
        n.nvmlGpuInstanceCreateComputeInstance(gi, ci_id(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE))
    assert _code(e) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    with pytest.raises(pynvml.NVMLError) as e:  # a GPU instance with a compute instance is in use
        n.nvmlGpuInstanceDestroy(gi)
    assert _code(e) == pynvml.NVML_ERROR_IN_USE
    uuids = {n.nvmlDeviceGetUUID(n.nvmlDeviceGetMigDeviceHandleByIndex(h, i)) for i in range(1)}
    assert uuids == {mig_uuid(str(n.facts.gpus[2].uuid), gi.gi, ci.ci)}
    with pytest.raises(pynvml.NVMLError) as e:
        n.nvmlDeviceGetMigDeviceHandleByIndex(h, 1)
    assert _code(e) == pynvml.NVML_ERROR_NOT_FOUND
    n.nvmlComputeInstanceDestroy(ci)
    n.nvmlGpuInstanceDestroy(gi)
    with pytest.raises(pynvml.NVMLError) as e:
        n.nvmlGpuInstanceDestroy(gi)
    assert _code(e) == pynvml.NVML_ERROR_NOT_FOUND


def test_mig_disabled_gpu_refuses_instances() -> None:
    n = _nvml("dgx-a100-80gb")
    h = n.nvmlDeviceGetHandleByIndex(0)
    assert list(n.nvmlDeviceGetMigMode(h)) == [0, 0]
    with pytest.raises(pynvml.NVMLError) as e:
        n.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, _place(0, 1))
    assert _code(e) == pynvml.NVML_ERROR_NOT_SUPPORTED
    with pytest.raises(pynvml.NVMLError) as e:
        n.nvmlDeviceGetGpuInstanceProfileInfo(h, 0)
    assert _code(e) == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_instances_outlive_the_process_through_the_state_file(tmp_path: Path) -> None:
    state = tmp_path / "mig.json"
    a = _nvml(state=state)
    gi = a.nvmlDeviceCreateGpuInstanceWithPlacement(FakeHandle(1), 19, _place(3, 1))
    b = _nvml(state=state)  # another process of the same node
    assert [x.start for x in b.mig_instances()[str(b.facts.gpus[1].uuid)]] == [3]
    b.nvmlGpuInstanceDestroy(gi)
    assert a.mig_instances() == {}


# -- discovery and publishing ---------------------------------------------------------------------


def test_mig_off_gpu_is_published_whole_exactly_as_before() -> None:
    devs = load_backend("mock:dgx-a100-80gb", "n1").discover()
    assert [d.kind for d in devs].count("gpu") == 8 and not any(d.kind == "mig" for d in devs)
    assert not any(d.shared_counters or d.consumes_counters for d in devs)
    out = build_slices(DRIVER, "n1", None, devs, 1)
    assert len(out) == 1 and "sharedCounters" not in out[0]["spec"]


def test_mig_on_publishes_counters_and_one_device_per_placement() -> None:
    devs = load_backend("mock:dgx-a100-80gb-mig", "n1").discover()
    by = {d.name: d for d in devs}
    migs = [d for d in devs if d.kind == "mig" and d.attributes["parentDevice"].value == "gpu-3"]
    # 7 x 1g.10gb, 4 x 1g.20gb, 3 x 2g.20gb, 2 x 3g.40gb, 1 x 4g.40gb, 1 x 7g.80gb
    assert len(migs) == 18
    whole = by["gpu-3"]
    cset = whole.shared_counters["gpu-3-mig"]
    assert cset[COMPUTE_COUNTER] == "7" and sum(k.startswith("memory-slice-") for k in cset) == 8
    assert whole.consumes_counters == whole.shared_counters
    s = by["gpu-3-mig-3g-40gb-4"]
    assert s.consumes_counters["gpu-3-mig"] == {
        "memory-slice-4": "1", "memory-slice-5": "1", "memory-slice-6": "1", "memory-slice-7": "1",
        COMPUTE_COUNTER: "3"}
    a = s.attributes
    assert a["profile"].value == "3g.40gb" and a["parentUUID"].value == whole.uuid
    assert a["type"].value == "mig" and "uuid" not in a and "resource.kubernetes.io/pciBusID" not in a
    for k in ("resource.kubernetes.io/pcieRoot", "numaNode", "nvlinkDomain", "rail"):
        assert a[k] == whole.attributes[k], k
    assert s.capacity == {"memory": "40192Mi", "multiprocessors": "42"}
    p = placement_of(s)
    ci_3g = pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE
    assert (p.profile_id, p.start, p.size, p.ci_profile_index) == (9, 4, 4, ci_3g)
    with pytest.raises(ValueError, match="not a MIG placement"):
        placement_of(whole)


def test_slices_keep_counters_apart_and_respect_limits() -> None:
    devs = load_backend("mock:dgx-h100-mig", "n1").discover()
    out = build_slices(DRIVER, "n1", None, devs, 1)
    counters = [s for s in out if "sharedCounters" in s["spec"]]
    assert len(counters) == 1 and len(counters[0]["spec"]["sharedCounters"]) == 8
    assert "devices" not in counters[0]["spec"]
    rest = [s for s in out if "devices" in s["spec"]]
    assert all(len(s["spec"]["devices"]) <= 64 for s in rest)
    assert sum(len(s["spec"]["devices"]) for s in rest) == len(devs) == 8 * 19 + 8
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in out} == {len(out)}


def test_class_generator_learns_mig_and_shared_classes_from_slices() -> None:
    from topodra import classcatalog as dc

    published = build_slices(DRIVER, "n1", None, load_backend("mock:dgx-a100-80gb-mig", "n1").discover(), 1)
    assert dc.mig_sizes(published, DRIVER) == {1, 2, 3, 4, 7}
    assert not dc.shared_gpus_published(published, DRIVER)
    names = [o["metadata"]["name"] for o in dc.classes_for_models(["A100-SXM4-80GB"], mig_sizes={1, 3})]
    assert "gpu-mig-1g" in names and "gpu-mig-3g" in names and "gpu-mig-2g" not in names
    assert "gpu-shared-memory" not in names
    shared = build_slices(DRIVER, "n2", None, load_backend("mock:l4", "n2", overrides={"shareGpuMemory": True})
                          .discover(), 1)
    assert dc.shared_gpus_published(shared, DRIVER)
    assert "gpu-shared-memory" in [o["metadata"]["name"] for o in dc.classes_for_models(["L4"], with_shared=True)]


def test_slices_of_a_tainted_gpu_carry_its_taint() -> None:
    from topodra.health.policy import XID_KEY, DeviceTaint, Effect
    from topodra.slices import published_taints

    devs = load_backend("mock:dgx-a100-80gb-mig", "n1").discover()
    xid = DeviceTaint(XID_KEY, "79", Effect.NO_EXECUTE, 1_700_000_000)
    out = build_slices(DRIVER, "n1", None, devs, 1, {"gpu-3": [xid]})
    tainted = sorted(d["name"] for s in out for d in s["spec"].get("devices") or [] if d.get("taints"))
    assert tainted == sorted(["gpu-3", *(d.name for d in devs if d.name.startswith("gpu-3-mig-"))])
    assert published_taints(out) == {"gpu-3": [xid]}, "slice taints are derived, never adopted as their own"
