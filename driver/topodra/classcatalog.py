"""The topodra DeviceClass catalog (pure): every class topodra ships, and the classes worth installing for
the GPU models a cluster publishes.

Every class is built from a ``DeviceMatch`` so that its CEL selector and its ``topodra.io/match``
annotation (read by the ClaimProfile controller and the fleet model to count devices) can never disagree.
It sits below the programs because two of them need it: ``topodra deviceclasses`` writes it out, the
controller's Kueue rendering reads its model families.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from topodra import DEFAULT_DRIVER_NAME
from topodra.selectors import MATCH_ANNOTATION, DeviceMatch

KIND_LABEL = "topodra.io/class-kind"


@dataclass(frozen=True)
class ClassSpec:
    """One catalog entry: the class name, what it is for, and its predicate."""

    name: str
    kind: str  # generic | model | memory | architecture | nic | mig | shared
    description: str
    match: DeviceMatch


# Model families: class name -> the normalized `model` attribute values it covers
# (as topodra.hardware.attributes.normalize_model writes them: stem + form factor + marketing size).
MODEL_FAMILIES: dict[str, tuple[str, ...]] = {
    "gpu-h200": ("H200-SXM5-141GB", "H200-NVL-141GB"),
    "gpu-h100": ("H100-SXM5-80GB", "H100-NVL-94GB", "H100-PCIE-80GB"),
    "gpu-a100-80gb": ("A100-SXM4-80GB", "A100-PCIE-80GB"),
    "gpu-a100-40gb": ("A100-SXM4-40GB", "A100-PCIE-40GB"),
    "gpu-b200": ("B200-SXM6-180GB", "B200-SXM6-192GB"),
    "gpu-gb200": ("GB200",),
    "gpu-l40s": ("L40S",),
    "gpu-l4": ("L4",),
}

# Memory tiers.  The threshold sits ~1 GiB under the marketing size because
# NVML reports slightly less for some boards (H100 SXM5 "80GB" = 81559 MiB).
MEMORY_TIERS: dict[str, str] = {
    "gpu-mem-40gi": "39Gi",
    "gpu-mem-80gi": "79Gi",
    "gpu-mem-140gi": "139Gi",
}

# Architecture floors as CUDA compute capability (Ampere 8.0, Hopper 9.0, Blackwell 10.0).
ARCHITECTURE_FLOORS: dict[str, tuple[str, str]] = {
    "gpu-ampere-plus": ("8.0.0", "Ampere or newer (Ada, Hopper, Blackwell)"),
    "gpu-hopper-plus": ("9.0.0", "Hopper or newer (Blackwell)"),
    "gpu-blackwell-plus": ("10.0.0", "Blackwell or newer"),
}

# MIG slices by compute size (topodra.sharing.mig): gpu-mig-1g takes any 1g.* profile (1g.10gb, 1g.20gb...);
# a claim narrows it with a selector on the ``profile`` attribute.
MIG_SIZES: tuple[int, ...] = (1, 2, 3, 4, 7)

SHARED_MEMORY_CLASS = "gpu-shared-memory"  # nodes with shareGpuMemory (topodra.sharing.memory)

GENERIC_CLASS = DEFAULT_DRIVER_NAME
NIC_CLASS = "nic.topodra.io"
# Every MIG slice, any profile: the counterpart of NVIDIA's ``mig.nvidia.com`` (its claims pick the profile with
# a selector on ``profile``), so they run with the class renamed (docs/user-guide.md "Coming from NVIDIA's DRA driver").
MIG_CLASS = "mig.topodra.io"


def catalog(driver: str = DEFAULT_DRIVER_NAME) -> list[ClassSpec]:
    """Every class topodra ships, in a stable order."""
    specs = [ClassSpec(GENERIC_CLASS if driver == DEFAULT_DRIVER_NAME else driver, "generic",
                       "every full GPU published by the driver", DeviceMatch(type="gpu"))]
    for name, models in MODEL_FAMILIES.items():
        specs.append(ClassSpec(name, "model", f"GPUs of model {', '.join(models)}",
                               DeviceMatch(type="gpu", models=models)))
    for name, mem in MEMORY_TIERS.items():
        specs.append(ClassSpec(name, "memory", f"GPUs with at least {mem} of memory",
                               DeviceMatch(type="gpu", minMemory=mem)))
    for name, (cc, text) in ARCHITECTURE_FLOORS.items():
        specs.append(ClassSpec(name, "architecture", f"{text}: compute capability >= {cc}",
                               DeviceMatch(type="gpu", minComputeCapability=cc)))
    for n in MIG_SIZES:
        specs.append(ClassSpec(f"gpu-mig-{n}g", "mig", f"MIG slices with {n} compute slice(s) ({n}g.* profiles)",
                               DeviceMatch(type="mig", computeSlices=n)))
    specs.append(ClassSpec(MIG_CLASS, "mig", "every MIG slice, any profile (select one with the profile attribute)",
                           DeviceMatch(type="mig")))
    specs.append(ClassSpec(SHARED_MEMORY_CLASS, "shared",
                           "GPUs shared by memory: each claim takes the memory it requests (advisory without MPS)",
                           DeviceMatch(type="gpu-shared")))
    specs.append(ClassSpec(NIC_CLASS, "nic", "RDMA NICs published next to the GPUs (rail attribute)",
                           DeviceMatch(type="nic")))
    return specs


def extended_resource_name(spec: ClassSpec, driver: str = DEFAULT_DRIVER_NAME) -> str | None:
    """The DRA-backed extended resource (KEP-5004) a pod may request instead of a claim.

    Generic class -> ``<driver>/gpu``; model class ``gpu-h200`` -> ``<driver>/h200``.  Only these
    kinds get one: they are what quota systems (ResourceQuota, Kueue flavors) count.  Memory and
    architecture classes keep the implicit ``deviceclass.resource.kubernetes.io/<class>`` name.
    """
    if spec.kind == "generic":
        return f"{driver}/gpu"
    if spec.kind == "model":
        return f"{driver}/{spec.name.removeprefix('gpu-')}"
    return None


def to_device_class(spec: ClassSpec, driver: str = DEFAULT_DRIVER_NAME) -> dict[str, Any]:
    """A ``resource.k8s.io/v1`` DeviceClass object for one catalog entry."""
    ext = extended_resource_name(spec, driver)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {
            "name": spec.name,
            "labels": {"app.kubernetes.io/part-of": "topodra", KIND_LABEL: spec.kind},
            "annotations": {
                MATCH_ANNOTATION: spec.match.to_annotation(),
                "topodra.io/description": spec.description,
            },
        },
        "spec": {"selectors": [{"cel": {"expression": spec.match.to_cel(driver)}}],
                 **({"extendedResourceName": ext} if ext else {})},
    }


def model_class_name(model: str) -> str:
    """Class name for a model outside the catalog, e.g. ``RTX-PRO-6000`` -> ``gpu-model-rtx-pro-6000``."""
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
    return f"gpu-model-{slug}"[:63].rstrip("-")


def classes_for_models(models: Iterable[str], *, with_nic: bool = False, mig_sizes: Iterable[int] = (),
                       with_shared: bool = False, driver: str = DEFAULT_DRIVER_NAME) -> list[dict[str, Any]]:
    """DeviceClasses worth installing for a cluster whose GPUs have these models.

    Generic, memory and architecture classes always; a family class when one of
    its models is present; a single-model class for a model the catalog does not
    know; the NIC class when NICs are published; a MIG class per published slice size; the shared-memory
    class when GPUs shared by memory are published.
    """
    present = {m for m in models if m}
    sizes = set(mig_sizes)
    known = {m for ms in MODEL_FAMILIES.values() for m in ms}
    out: list[ClassSpec] = []
    for spec in catalog(driver):
        if spec.kind == "model" and not (set(spec.match.models or ()) & present):
            continue
        if spec.kind == "nic" and not with_nic:
            continue
        if spec.kind == "mig" and (not sizes if spec.match.compute_slices is None
                                   else spec.match.compute_slices not in sizes):
            continue
        if spec.kind == "shared" and not with_shared:
            continue
        out.append(spec)
    for model in sorted(present - known):
        out.append(ClassSpec(model_class_name(model), "model", f"GPUs of model {model}",
                             DeviceMatch(type="gpu", models=(model,))))
    return [to_device_class(s, driver) for s in out]


def shared_gpus_published(slices: Iterable[dict[str, Any]], driver: str) -> bool:
    """Whether ResourceSlices of ``driver`` hold GPUs shared by memory (type ``gpu-shared``)."""
    return any((dev.get("attributes") or {}).get("type", {}).get("string") == "gpu-shared"
               for sl in slices if (sl.get("spec") or {}).get("driver") == driver
               for dev in (sl.get("spec") or {}).get("devices") or [])


def _device_attributes(slices: Iterable[dict[str, Any]], driver: str) -> Iterator[dict[str, Any]]:
    """The ``attributes`` of every device in the ResourceSlices of ``driver``."""
    for sl in slices:
        spec = sl.get("spec") or {}
        if spec.get("driver") == driver:
            for dev in spec.get("devices") or []:
                yield dev.get("attributes") or {}


def mig_sizes(slices: Iterable[dict[str, Any]], driver: str) -> set[int]:
    """Compute-slice counts of the MIG placement devices in ResourceSlices of ``driver``."""
    out: set[int] = set()
    for attrs in _device_attributes(slices, driver):
        if (attrs.get("type") or {}).get("string") == "mig":
            n = (attrs.get("computeSlices") or {}).get("int")
            if isinstance(n, int):
                out.add(n)
    return out


def inventory(slices: Iterable[dict[str, Any]], driver: str) -> tuple[set[str], bool]:
    """GPU models and whether any NIC is published, from ResourceSlices of ``driver``."""
    models: set[str] = set()
    has_nic = False
    for attrs in _device_attributes(slices, driver):
        kind = (attrs.get("type") or attrs.get(f"{driver}/type") or {}).get("string")
        if kind == "nic":
            has_nic = True
        elif kind == "gpu":
            model = (attrs.get("model") or attrs.get(f"{driver}/model") or {}).get("string")
            if model:
                models.add(model)
    return models, has_nic
