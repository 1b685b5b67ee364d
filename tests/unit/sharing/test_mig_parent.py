"""A MIG-enabled GPU is not a whole GPU to the GPU classes (issue 19, finding 5).

With MIG mode on CUDA sees no device on the whole GPU, so its whole device is published as
``type: gpu-mig-parent``: it keeps owning and consuming the counter set (so it and its slices still exclude
each other for any class that does select it), and no GPU class of the catalog, nor a committed DeviceClass's
match, selects it.  The same GPU with MIG off is still every GPU class's device.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from testkit.paths import REPO

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra import classcatalog
from topodra.hardware import load_backend
from topodra.selectors import DeviceMatch
from topodra.sharing import memory
from topodra.sharing.mig import MIG_PARENT_TYPE
from topodra.slices import build_slices


def published(profile: str) -> dict[str, dict[str, Any]]:
    out = build_slices(DRIVER, "n1", None, load_backend(f"mock:{profile}", "n1").discover(), 1)
    return {d["name"]: d for s in out for d in s["spec"].get("devices") or []}


def committed_matches() -> dict[str, DeviceMatch]:
    """Every committed DeviceClass's predicate (its ``topodra.io/match``), by class name."""
    out = {}
    for f in sorted((REPO / "deviceclasses").glob("*.yaml")):
        obj = yaml.safe_load(f.read_text())
        match = obj["metadata"].get("annotations", {}).get("topodra.io/match")
        if match:
            out[obj["metadata"]["name"]] = DeviceMatch.model_validate(json.loads(match))
    return out


def test_the_whole_device_of_a_mig_gpu_is_a_mig_parent_with_every_counter() -> None:
    devs = load_backend("mock:dgx-a100-80gb-mig", "n1").discover()
    whole = [d for d in devs if d.kind == "gpu"]
    assert len(whole) == 8
    for d in whole:
        assert d.attributes["type"].value == MIG_PARENT_TYPE
        (cset,) = d.shared_counters
        assert d.consumes_counters == d.shared_counters, "still excludes every slice of its GPU"
        slices = [m for m in devs if m.kind == "mig" and m.attributes["parentDevice"].value == d.name]
        assert slices and all(m.attributes["type"].value == "mig" for m in slices)
        assert all(set(m.consumes_counters) == {cset} for m in slices)
        assert all(set(m.consumes_counters[cset]) <= set(d.shared_counters[cset]) for m in slices)


def test_no_gpu_class_selects_a_mig_enabled_gpu_but_all_still_select_it_with_mig_off() -> None:
    mig_on, mig_off = published("dgx-a100-80gb-mig"), published("dgx-a100-80gb")
    classes = {**{s.name: s.match for s in classcatalog.catalog(DRIVER)}, **committed_matches()}
    gpu_classes = {n: m for n, m in classes.items() if m.type == "gpu"}
    assert {"gpu.topodra.io", "gpu-a100-80gb", "gpu-ampere-plus", "gpu-mem-80gi"} <= set(gpu_classes)
    for name, match in gpu_classes.items():
        assert not match.matches(mig_on["gpu-0"], DRIVER), name
    # Positive control: the same A100 with MIG off is picked by the classes that fit it.
    for name in ("gpu.topodra.io", "gpu-a100-80gb", "gpu-ampere-plus", "gpu-mem-80gi"):
        assert gpu_classes[name].matches(mig_off["gpu-0"], DRIVER), name
    # Slices are still what the MIG classes hand out, and nothing selects the parent by accident.
    assert classes["gpu-mig-1g"].matches(mig_on["gpu-0-mig-1g-10gb-0"], DRIVER)
    assert not any(m.matches(mig_on["gpu-0"], DRIVER) for m in classes.values())


def test_models_of_mig_only_nodes_give_no_whole_gpu_classes() -> None:
    """The class generator offers model classes only for GPUs a claim could get whole."""
    out = build_slices(DRIVER, "n1", None, load_backend("mock:dgx-a100-80gb-mig", "n1").discover(), 1)
    models, _nic = classcatalog.inventory(out, DRIVER)
    assert models == set()


def test_a_mig_parent_is_never_shared_by_memory() -> None:
    gpu = next(d for d in load_backend("mock:dgx-a100-80gb-mig", "n1", overrides={"shareGpuMemory": True}).discover()
               if d.kind == "gpu")
    assert gpu.attributes["type"].value == MIG_PARENT_TYPE and not gpu.allow_multiple_allocations
    with pytest.raises(ValueError, match="MIG-partitioned"):
        memory.shared(gpu)


def test_the_inventory_view_names_the_same_mig_parent_type() -> None:
    from topodra.clusterview import model

    assert model.MIG_PARENT_TYPE == MIG_PARENT_TYPE
