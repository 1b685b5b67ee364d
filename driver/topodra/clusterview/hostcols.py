"""The inventory's CPU and memory columns: per node, allocatable and free CPU and memory (kube-scheduler's
NodeResourcesFit view, ``fleet.hostres``) beside the free GPUs, and how many free GPUs they strand.

A free GPU is *stranded by CPU* when the node's free CPU leaves it unusable for every pod size the cluster's
GPU pods run, each judged with the CPU per GPU its bound pods asked for: the shares the placement scorer learns
(``fleet.shares``, ``stranded_by_shares``; issue 34, one model). Counted in whole GPUs: with 8 free GPUs, 30
free CPUs and 1-GPU pods asking 4 CPUs each, 1 is stranded. Before any GPU pod is bound (no share learned) the
node's own per-GPU share judges (allocatable CPU / GPUs: on a DGX H100, 224 / 8 = 28 CPUs; 8 free GPUs and 30
free CPUs strand 7). Likewise for memory.

The dataclass imports nothing heavy (the renderers need only it); ``host_columns`` is called by
``build_view``, which has imported the fleet model already.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from topodra.fleet.hostres import HostRoom
    from topodra.fleet.shares import Shares


@dataclass(frozen=True)
class HostCols:
    cpu_allocatable_milli: int
    cpu_free_milli: int
    memory_allocatable_bytes: int
    memory_free_bytes: int
    gpus_stranded_cpu: int  # free GPUs the free CPU leaves no pod size able to use (module docstring)
    gpus_stranded_memory: int

    @property
    def stranded(self) -> bool:
        return bool(self.gpus_stranded_cpu or self.gpus_stranded_memory)


def host_columns(room: HostRoom | None, free_gpus: int, gpus: int, observed: Shares = ()) -> HostCols | None:
    """The node's columns; None when its allocatable is unknown or it has no GPUs of ours. ``observed``: the
    learned shares by pod size (``ClusterState.shares``)."""
    from topodra.fleet.hostres import Share
    from topodra.fleet.shares import stranded_by_shares

    if room is None or gpus <= 0:
        return None
    fair = Share(room.cpu_alloc / gpus, room.memory_alloc / gpus)
    by_cpu, by_mem = stranded_by_shares(free_gpus, room.cpu_free, room.memory_free, observed, fair)
    return HostCols(cpu_allocatable_milli=room.cpu_alloc, cpu_free_milli=room.cpu_free,
                    memory_allocatable_bytes=room.memory_alloc, memory_free_bytes=room.memory_free,
                    gpus_stranded_cpu=by_cpu, gpus_stranded_memory=by_mem)


def cpu_text(h: HostCols) -> str:
    return f"{h.cpu_free_milli / 1000:g}/{h.cpu_allocatable_milli / 1000:g}"


def memory_text(h: HostCols) -> str:
    gi = 1 << 30
    return f"{h.memory_free_bytes / gi:.0f}/{h.memory_allocatable_bytes / gi:.0f}Gi"


def stranded_text(h: HostCols) -> str:
    return f"{h.gpus_stranded_cpu}/{h.gpus_stranded_memory}" if h.stranded else "-"
