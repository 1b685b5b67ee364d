"""GPU memory as consumable capacity (KEP-5075): one GPU, several claims, each taking the memory it asks for.

Opt-in per node (``shareGpuMemory: true`` in the hardware config).  Such a node
publishes each whole GPU (MIG off) with ``allowMultipleAllocations: true`` and a
``memory`` capacity whose request policy is: default and minimum 1Gi, step
1Gi.  The scheduler then lets claims share the GPU until its memory is used up;
each allocation carries a ``shareID`` and its ``consumedCapacity``.  The device's
``type`` becomes ``gpu-shared`` so whole-GPU classes (``type == "gpu"``) never
hand out a share by surprise.

Prepare passes each share its limit as ``TOPODRA_DEVICE_<NAME>_MEMORY_LIMIT``.
Without MPS nothing enforces it: the limit is advisory (docs/sharing.md).
"""

from __future__ import annotations

from collections.abc import Mapping

from topodra.devices import Device, string_attr

SHARED_TYPE = "gpu-shared"
MEMORY_POLICY: dict[str, str] = {"default": "1Gi", "min": "1Gi", "step": "1Gi"}


def shared(gpu: Device) -> Device:
    """The whole GPU published for sharing by memory (pure)."""
    if gpu.kind != "gpu" or "memory" not in gpu.capacity:
        raise ValueError(f"{gpu.name} is not a GPU with a memory capacity")
    if gpu.consumes_counters:
        raise ValueError(f"{gpu.name} is MIG-partitioned; its memory cannot also be shared")
    return gpu.model_copy(update={
        "attributes": {**gpu.attributes, "type": string_attr(SHARED_TYPE)},
        "allow_multiple_allocations": True,
        "capacity_policies": {"memory": dict(MEMORY_POLICY)},
    })


def limit_env(env_fragment: str, consumed: Mapping[str, str]) -> list[str]:
    """Container variables telling one share its limits (advisory without MPS)."""
    mem = consumed.get("memory")
    return [f"TOPODRA_DEVICE_{env_fragment}_MEMORY_LIMIT={mem}"] if mem else []
