"""Node CPU and memory as kube-scheduler's NodeResourcesFit sees them: allocatable minus the requests of
the bound, non-terminated pods. Pure: the scorer's cache and the inventory's fetch feed objects in.

A pod's request follows ``k8s.io/component-helpers/resource.PodRequests`` (v1.37.2) for CPU and
memory: the sum over containers; each init container's request plus the restartable (sidecar) init
containers before it, the maximum of those taken against that sum (sidecars also add to the sum);
pod-level ``spec.resources.requests`` replaces the container figure where set (PodLevelResources);
``spec.overhead`` is added. Quantities round up, as Go's ``MilliValue``/``Value`` do. Not modelled:
resources that DRA claims grant to containers as node-allocatable (``addDRANodeAllocatableClaimResources``)
and in-place resize's status figures (simulated and freshly bound pods have none).

Pods in phase Succeeded or Failed free their requests (the scheduler drops terminal pods from its cache);
a pod being deleted still holds them until it is gone, as in the scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from topodra.quantities import parse_quantity

Obj = dict[str, Any]
TERMINAL_PHASES = ("Succeeded", "Failed")


@dataclass(frozen=True, slots=True)
class PodRecord:
    """What the fleet keeps of a pod: where it is bound (``""``: not yet), its CPU and memory request,
    and its pod group (``spec.schedulingGroup.podGroupName``, ``""`` when none; gang scoring reads it)."""

    namespace: str
    name: str
    node: str
    cpu_milli: int
    memory_bytes: int
    pod_group: str = ""


@dataclass(frozen=True, slots=True)
class HostRoom:
    """A node's allocatable and free CPU (millicores) and memory (bytes)."""

    cpu_alloc: int
    memory_alloc: int
    cpu_free: int
    memory_free: int


def _quantity(value: Any, scale: int) -> int:
    """A quantity string times ``scale``, rounded up; 0 for a missing or malformed value."""
    try:
        q = parse_quantity(str(value)) * scale
    except ValueError:
        return 0
    return int(q.to_integral_value(rounding="ROUND_CEILING")) if q > 0 else 0


def _requests(res: Mapping[str, Any] | None) -> tuple[int, int]:
    req = (res or {}).get("requests") or {}
    return _quantity(req.get("cpu"), 1000) if "cpu" in req else 0, \
        _quantity(req.get("memory"), 1) if "memory" in req else 0


def pod_requests(pod: Obj) -> tuple[int, int]:
    """(CPU millicores, memory bytes) the pod requests, by kube-scheduler's rule (module docstring)."""
    spec = pod.get("spec") or {}
    cpu = mem = 0
    for c in spec.get("containers") or []:
        c_cpu, c_mem = _requests(c.get("resources"))
        cpu, mem = cpu + c_cpu, mem + c_mem
    side_cpu = side_mem = init_cpu = init_mem = 0
    for c in spec.get("initContainers") or []:
        c_cpu, c_mem = _requests(c.get("resources"))
        if c.get("restartPolicy") == "Always":  # a sidecar: runs beside the app containers
            cpu, mem = cpu + c_cpu, mem + c_mem
            side_cpu, side_mem = side_cpu + c_cpu, side_mem + c_mem
            use_cpu, use_mem = side_cpu, side_mem
        else:
            use_cpu, use_mem = c_cpu + side_cpu, c_mem + side_mem
        init_cpu, init_mem = max(init_cpu, use_cpu), max(init_mem, use_mem)
    cpu, mem = max(cpu, init_cpu), max(mem, init_mem)
    pod_level = ((spec.get("resources") or {}).get("requests")) or {}
    if "cpu" in pod_level:
        cpu = _quantity(pod_level["cpu"], 1000)
    if "memory" in pod_level:
        mem = _quantity(pod_level["memory"], 1)
    overhead = spec.get("overhead") or {}
    cpu += _quantity(overhead.get("cpu"), 1000) if "cpu" in overhead else 0
    mem += _quantity(overhead.get("memory"), 1) if "memory" in overhead else 0
    return cpu, mem


def pod_record(pod: Obj) -> PodRecord:
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    cpu, mem = pod_requests(pod)
    group = str(((spec.get("schedulingGroup") or {}).get("podGroupName")) or "")
    return PodRecord(namespace=str(meta.get("namespace") or "default"), name=str(meta.get("name", "")),
                     node=str(spec.get("nodeName") or ""), cpu_milli=cpu, memory_bytes=mem, pod_group=group)


def counts(pod: Obj) -> bool:
    """Whether the pod holds node resources: not in a terminal phase."""
    return ((pod.get("status") or {}).get("phase")) not in TERMINAL_PHASES


def node_allocatable(node: Obj) -> tuple[int, int] | None:
    """(CPU millicores, memory bytes) of ``status.allocatable``; None when the node reports neither."""
    alloc = ((node.get("status") or {}).get("allocatable")) or {}
    if "cpu" not in alloc and "memory" not in alloc:
        return None
    return _quantity(alloc.get("cpu"), 1000), _quantity(alloc.get("memory"), 1)


class HostResources:
    """Bound pods' requests summed per node, against each node's allocatable. Not thread-safe (the
    scorer's cache holds its lock). Only non-terminal pods are kept: a terminal one is dropped."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], PodRecord] = {}
        self.allocatable: dict[str, tuple[int, int]] = {}
        self._requested: dict[str, list[int]] = {}

    def _add(self, rec: PodRecord, sign: int) -> None:
        if not rec.node:
            return
        got = self._requested.setdefault(rec.node, [0, 0])
        got[0] += sign * rec.cpu_milli
        got[1] += sign * rec.memory_bytes
        if got == [0, 0] and sign < 0:
            del self._requested[rec.node]

    def set_pod(self, pod: Obj) -> None:
        rec = pod_record(pod)
        self.delete_pod(rec.namespace, rec.name)
        if counts(pod):
            self.pods[(rec.namespace, rec.name)] = rec
            self._add(rec, 1)

    def delete_pod(self, namespace: str, name: str) -> None:
        old = self.pods.pop((namespace, name), None)
        if old is not None:
            self._add(old, -1)

    def set_node(self, node: Obj) -> None:
        name = str((node.get("metadata") or {}).get("name", ""))
        alloc = node_allocatable(node)
        if alloc is None:
            self.allocatable.pop(name, None)
        else:
            self.allocatable[name] = alloc

    def delete_node(self, name: str) -> None:
        self.allocatable.pop(name, None)

    def replace_pods(self, pods: Iterable[Obj]) -> None:
        self.pods.clear()
        self._requested.clear()
        for p in pods:
            self.set_pod(p)

    def replace_nodes(self, nodes: Iterable[Obj]) -> None:
        self.allocatable.clear()
        for n in nodes:
            self.set_node(n)

    def requested(self, node: str) -> tuple[int, int]:
        got = self._requested.get(node)
        return (got[0], got[1]) if got else (0, 0)

    def room(self, node: str) -> HostRoom | None:
        """The node's allocatable and free CPU and memory; None when its allocatable is unknown."""
        alloc = self.allocatable.get(node)
        if alloc is None:
            return None
        cpu, mem = self.requested(node)
        return HostRoom(cpu_alloc=alloc[0], memory_alloc=alloc[1], cpu_free=alloc[0] - cpu,
                        memory_free=alloc[1] - mem)

    def pods_on(self, node: str) -> list[PodRecord]:
        return [r for r in self.pods.values() if r.node == node]


# --------------------------------------------------------------------------- stranding by CPU or memory


@dataclass(frozen=True, slots=True)
class Share:
    """CPU millicores and memory bytes one GPU of a job class comes with (0: that resource is not asked)."""

    cpu_milli: float
    memory_bytes: float

    @classmethod
    def of(cls, cpu_milli: int, memory_bytes: int, gpus: int) -> Share | None:
        """The pod's own requests divided by its GPUs; None for a pod without GPUs."""
        if gpus <= 0:
            return None
        return cls(cpu_milli / gpus, memory_bytes / gpus)


def host_gpu_limit(cpu_free: int, memory_free: int, share: Share, k: int) -> tuple[int, int]:
    """How many of a class's GPUs (``k`` per placement) the free CPU and the free memory each leave room
    for: (GPUs by CPU, GPUs by memory), whole placements only; a very large number where not asked."""
    big = 1 << 40

    def by(free: int, per_gpu: float) -> int:
        if per_gpu <= 0:
            return big
        return k * max(0, math.floor(free / (per_gpu * k) + 1e-9)) if k > 0 else big

    return by(cpu_free, share.cpu_milli), by(memory_free, share.memory_bytes)


def stranded_by_host(free_gpus: int, usable_by_gpus: int, cpu_free: int, memory_free: int, share: Share,
                     k: int) -> tuple[int, int]:
    """Of the GPUs the class could use by the devices alone (``usable_by_gpus``), how many CPU and how many
    memory leave unusable: (by CPU, by memory), each counted against its own limit."""
    by_cpu, by_mem = host_gpu_limit(cpu_free, memory_free, share, k)
    usable = min(usable_by_gpus, free_gpus)
    return max(0, usable - by_cpu), max(0, usable - by_mem)
