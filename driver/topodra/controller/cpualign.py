"""``alignCpus``: a profile's GPUs (and rail NICs) and dra-driver-cpu's CPUs on the same NUMA nodes (pure).

Why groups: the structured allocator's ``matchAttribute`` (k8s.io/dynamic-resource-allocation v0.37.2,
``structured/internal/*/allocator_*.go``, ``matchAttributeConstraint.add``) keeps the value of the first device
it admits and refuses every later device of the listed requests that has another value (or lacks the attribute).
One constraint over "8 GPUs + 64 CPUs" therefore needs all of them on one NUMA node, and no DGX has that (4 GPUs per
socket). So the GPUs are asked for in groups of ``gpusPerNumaNode``; each group gets its own GPU request(s), its
rail NICs, one ``dra.cpu`` request for ``cpusPerGpu`` x group size CPUs, and one ``matchAttribute`` of its own.

dra-driver-cpu's grouped mode publishes one device per NUMA node with ``allowMultipleAllocations`` and the
consumable capacity ``dra.cpu/cpu``; the allocator does not mark such a device in use (``allocateDevice``) and
checks every share against its capacity including the shares of the claim being allocated
(``CmpRequestOverCapacity``), so two groups landing on one NUMA node both draw from the same device, correctly.

Which attribute the constraint names is the cluster's choice (``CpuOptions.numa_attribute``): dra-driver-cpu
main publishes the standard ``resource.kubernetes.io/numaNode``, v0.2.0 only ``dra.cpu/numaNodeID`` and
``dra.net/numaNode`` (then topodra's plugin must publish ``dra.net/numaNode`` too: ``--numa-alias``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from topodra.controller.profile import ClaimProfile
from topodra.cpudriver import CAPACITY as CPU_CAPACITY
from topodra.cpudriver import DRIVER as CPU_DRIVER
from topodra.cpudriver import LEGACY_NUMA, STANDARD_NUMA

__all__ = ["LEGACY_NUMA", "STANDARD_NUMA", "CpuOptions", "apply", "cpus_per_claim", "group_sizes"]

Obj = dict[str, Any]
GPU_REQUEST = "gpus"  # render.REQUEST; repeated here so render can import this module


@dataclass(frozen=True)
class CpuOptions:
    """Where the CPUs come from: the DeviceClass, its capacity name, the NUMA attribute every driver shares."""

    device_class: str = CPU_DRIVER
    capacity: str = CPU_CAPACITY
    numa_attribute: str = STANDARD_NUMA


DEFAULT_CPU = CpuOptions()


def group_sizes(profile: ClaimProfile) -> tuple[int, int]:
    """(number of NUMA groups, GPUs per group) of an alignCpus profile (validated: the size divides the count)."""
    align = profile.spec.align_cpus
    assert align is not None
    count = profile.spec.alternatives[0].count
    per = align.gpus_per_numa_node or count
    return count // per, per


def cpus_per_claim(profile: ClaimProfile) -> int:
    """CPUs one claim asks for, which the pod's ``resources.requests.cpu`` must repeat (dra-driver-cpu)."""
    align = profile.spec.align_cpus
    assert align is not None
    return align.cpus_per_gpu * profile.spec.alternatives[0].count


def _cpu_request(name: str, cpus: int, opts: CpuOptions) -> Obj:
    return {"name": name, "exactly": {"deviceClassName": opts.device_class, "allocationMode": "ExactCount",
                                      "count": 1, "capacity": {"requests": {opts.capacity: str(cpus)}}}}


def _split_gpu_request(request: Obj, groups: int, per: int) -> list[Obj]:
    """The single ``gpus`` request (exactly or firstAvailable) as ``groups`` requests of ``per`` GPUs each."""
    out = []
    for g in range(groups):
        part = copy.deepcopy(request)
        part["name"] = f"{GPU_REQUEST}-{g}"
        if "exactly" in part:
            part["exactly"]["count"] = per
        for sub in part.get("firstAvailable") or []:
            sub["count"] = per
        out.append(part)
    return out


def apply(profile: ClaimProfile, requests: list[Obj], constraints: list[Obj], driver: str,
          opts: CpuOptions | None) -> tuple[list[Obj], list[Obj]]:
    """Add the CPU requests and per-NUMA-group constraints to the GPU/NIC requests render built.

    ``opts`` None: no CPU driver and the admin allowed falling back; the GPU template stays as without alignCpus.
    """
    if profile.spec.align_cpus is None or opts is None:
        return requests, constraints
    groups, per = group_sizes(profile)
    requests, constraints = copy.deepcopy(requests), copy.deepcopy(constraints)
    if profile.spec.topology.nic == "RailAligned":  # render made gpu-<i> + nic-<i> for every GPU
        members = [[n for i in range(g * per, (g + 1) * per) for n in (f"gpu-{i}", f"nic-{i}")]
                   for g in range(groups)]
    elif groups == 1:
        members = [[GPU_REQUEST]]
    else:
        (single,) = requests
        requests = _split_gpu_request(single, groups, per)
        names = [r["name"] for r in requests]
        members = [[n] for n in names]
        # Constraints on "gpus" (Required nvlink; Required numa is refused with groups) now cover every group;
        # one model across the groups, as one request had.
        for c in constraints:
            c["requests"] = [n for r in c["requests"] for n in (names if r == GPU_REQUEST else [r])]
        constraints.append({"requests": list(names), "matchAttribute": f"{driver}/model"})
    cpu_names = ["cpus"] if groups == 1 else [f"cpus-{g}" for g in range(groups)]
    cpus = profile.spec.align_cpus.cpus_per_gpu * per
    for g, name in enumerate(cpu_names):
        requests.append(_cpu_request(name, cpus, opts))
        constraints.append({"requests": [*members[g], name], "matchAttribute": opts.numa_attribute})
    return requests, constraints
