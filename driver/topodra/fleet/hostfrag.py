"""FGD with the node's CPU and memory: free GPUs a class cannot use because the node's free CPU or memory
cannot hold that class's per-GPU share count as fragments too. Pure.

The *job class share* is the per-GPU CPU and memory of the pod being scored (its own requests over the
GPUs its claims ask for, ``Share.of``): the scorer asks "if more jobs shaped like this one come, which
free GPUs could they not use?". A class of k GPUs per placement then needs k times that share per
placement, and on a node with free CPU c and memory r it can take at most
min(floor(c / (k * cpu_share)), floor(r / (k * mem_share))) placements, whatever the devices allow:

    F_n(m) = free GPUs - min(free GPUs - unusable_gpu(n, m), k * that many placements)

With no share (a pod without requests) or an unknown allocatable this is plain FGD (``fleet.fgd``).

Issue 34 (``--host-resources mix``): one share for every class made breaking a whole server free for a CPU-heavy
pod (an 8-GPU class at 24 CPUs per GPU fits no 96-CPU server, so its fragments there do not change). With
``HostJob.observed`` each class is judged with its own share instead (``fleet.shares.share_for``: the pod's own
for its own size, what the cluster's pods of size k asked for otherwise), so a whole server with the CPU an
8-GPU pod asks for has no 8-GPU fragments until a pod breaks it, and a pod without GPUs is scored by the GPUs
its CPU and memory strand (``capped_by_class``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from topodra.fleet.allocator import free_gpus
from topodra.fleet.demand import Demand, demand_gpus
from topodra.fleet.fgd import Fragmentation
from topodra.fleet.hostres import Share, host_gpu_limit
from topodra.fleet.shares import Shares, share_for
from topodra.fleet.state import NodeView

class_gpus = demand_gpus  # GPUs one placement of a request class takes (``fleet.demand.demand_gpus``)


@dataclass(frozen=True, slots=True)
class HostFit:
    """What the scorer knows of a candidate's host resources for one pod."""

    cpu_free: int  # millicores free now (allocatable - bound pods' requests)
    memory_free: int  # bytes
    pod_cpu: int  # the scored pod's own request
    pod_memory: int
    share: Share | None  # per-GPU share of the scored pod's class; None: not asked
    # Issue 34 (``--host-resources mix``) on the per-node path (CEL selectors, ``by_state`` off): the pod's
    # ``HostJob`` with the learned shares, and the node's allocatable per GPU for sizes not seen yet; each
    # class is then capped with its own share (``class_shares``), as ``placement.bystate`` does per state.
    job: HostJob | None = None
    fair: Share | None = None

    def fits(self) -> bool:
        return self.pod_cpu <= self.cpu_free and self.pod_memory <= self.memory_free

    def key(self) -> tuple[int, int, Share | None]:
        return self.cpu_free, self.memory_free, self.fair

    def class_shares(self, ks: Sequence[int]) -> tuple[Share | None, ...]:
        """The share each class (``ks``: GPUs per placement) is capped with on this node."""
        if self.job is None:
            return tuple(self.share for _k in ks)
        return self.job.class_shares(ks, self.fair)


@dataclass(frozen=True, slots=True)
class HostJob:
    """The scored pod's side of ``HostFit``: the same for every candidate of one call (hashable: it keys
    the scorer's per-state cache, ``placement.bystate``)."""

    pod_cpu: int  # millicores
    pod_memory: int  # bytes
    share: Share | None  # per-GPU share of the pod's class; None: not asked (or a pod without GPUs)
    # Issue 34: per pod size, the share the cluster's GPU pods asked for (``fleet.shares``); non-empty: each
    # class is capped with its own share (``class_shares``), not the pod's alone. ``gpus``: the pod's GPUs.
    observed: Shares = ()
    gpus: int = 0
    per_class: bool = False  # judge each class with its own share (``--host-resources mix``)

    def class_shares(self, ks: Sequence[int], fair: Share | None = None) -> tuple[Share | None, ...]:
        """The share each class (``ks``: GPUs per placement) is capped with; ``fair``: the node's allocatable per
        GPU, for sizes not seen yet."""
        if not self.per_class:
            return tuple(self.share for _k in ks)
        return tuple(share_for(k, self.gpus, self.share, self.observed, fair) for k in ks)

    def on(self, cpu_free: int, memory_free: int, fair: Share | None = None) -> HostFit:
        """The pod on a node with this much free; ``fair``: the node's allocatable per GPU (per-class only)."""
        if not self.per_class:
            return HostFit(cpu_free=cpu_free, memory_free=memory_free, pod_cpu=self.pod_cpu,
                           pod_memory=self.pod_memory, share=self.share)
        return HostFit(cpu_free=cpu_free, memory_free=memory_free, pod_cpu=self.pod_cpu, pod_memory=self.pod_memory,
                       share=self.share, job=self, fair=fair)


def capped_unusable(free: int, unusable_gpu: int, k: int, cpu_free: int, memory_free: int,
                    share: Share | None) -> int:
    """``unusable`` of one class once the node's free CPU and memory cap its placements."""
    if share is None or k <= 0:
        return unusable_gpu
    by_cpu, by_mem = host_gpu_limit(cpu_free, memory_free, share, k)
    usable = min(free - unusable_gpu, by_cpu, by_mem)
    return free - max(0, usable)


def capped_vector(free: int, unusable_gpu: Sequence[int], ks: Sequence[int], cpu_free: int, memory_free: int,
                  share: Share | None) -> tuple[int, ...]:
    """``capped_unusable`` of several classes at once (``ks``: each one's GPUs per placement); the host
    limits are worked out once per distinct ``k``."""
    if share is None:
        return tuple(unusable_gpu)
    limits: dict[int, int] = {}
    out = []
    for u, k in zip(unusable_gpu, ks, strict=True):
        if k <= 0:
            out.append(u)
            continue
        lim = limits.get(k)
        if lim is None:
            lim = limits[k] = min(host_gpu_limit(cpu_free, memory_free, share, k))
        out.append(free - max(0, min(free - u, lim)))
    return tuple(out)


def host_fragmentation(frag: Fragmentation, view: NodeView, used: frozenset[int],
                       classes: list[tuple[int, Demand, float]], cpu_free: int, memory_free: int,
                       shares: Sequence[Share | None]) -> float:
    """F_n = sum_m p_m * capped_unusable(n, m) on the memoised GPU-only fragments; ``shares``: per class (in
    ``classes``' order) the share it is capped with (``HostFit.class_shares``)."""
    free = free_gpus(view, used)
    total = 0.0
    for (i, demand, p), share in zip(classes, shares, strict=True):
        u = frag.unusable_of(view, used, i, demand)
        total += p * capped_unusable(free, u, class_gpus(demand), cpu_free, memory_free, share)
    return total


def capped_by_class(free: int, unusable_gpu: Sequence[int], ks: Sequence[int], cpu_free: int, memory_free: int,
                    shares: Sequence[Share | None]) -> tuple[int, ...]:
    """``capped_unusable`` of several classes, each with its own share (None: that class by GPUs only)."""
    limits: dict[tuple[int, Share], int] = {}
    out = []
    for u, k, share in zip(unusable_gpu, ks, shares, strict=True):
        if share is None or k <= 0:
            out.append(u)
            continue
        lim = limits.get((k, share))
        if lim is None:
            lim = limits[(k, share)] = min(host_gpu_limit(cpu_free, memory_free, share, k))
        out.append(free - max(0, min(free - u, lim)))
    return tuple(out)


SharePlan = tuple[tuple[tuple[int, Share], ...], tuple[int, ...]]  # distinct (k, share) groups; per class its group


def share_plan(ks: Sequence[int], shares: Sequence[Share | None]) -> SharePlan:
    """``capped_by_class``'s grouping worked out once: the distinct (GPUs per placement, share) pairs, and per class
    the index of its pair (-1: the class is not capped)."""
    groups: list[tuple[int, Share]] = []
    index: dict[tuple[int, Share], int] = {}
    of_class = []
    for k, share in zip(ks, shares, strict=True):
        if share is None or k <= 0:
            of_class.append(-1)
            continue
        g = index.get((k, share))
        if g is None:
            g = index[(k, share)] = len(groups)
            groups.append((k, share))
        of_class.append(g)
    return tuple(groups), tuple(of_class)


def capped_by_plan(free: int, unusable_gpu: Sequence[int], cpu_free: int, memory_free: int,
                   plan: SharePlan) -> tuple[int, ...]:
    """``capped_by_class`` with the grouping of ``share_plan`` (same result; one host limit per group)."""
    groups, of_class = plan
    limits = [min(host_gpu_limit(cpu_free, memory_free, share, k)) for k, share in groups]
    return tuple(u if g < 0 else free - max(0, min(free - u, limits[g]))
                 for u, g in zip(unusable_gpu, of_class, strict=True))
