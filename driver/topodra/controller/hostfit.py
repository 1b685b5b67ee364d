"""Does one pod of a profile fit a node's free CPU and memory?  (pure)

A node with 8 free GPUs whose CPUs other pods hold takes no 8-GPU job: kube-scheduler's NodeResourcesFit
refuses it before DRA is asked.  So ``nodesFit`` and the gang's domain choice count a node only when its free
CPU and memory hold the pod, where the profile says what the pod asks for:

* ``spec.podRequests`` (cpu, memory): the pod's requests as the scheduler sums them;
* ``spec.alignCpus``: the pod must request ``cpusPerGpu x count`` CPUs (``status.cpuAlignment.podCpuRequest``),
  so that is its CPU when ``podRequests.cpu`` is not given (the profile refuses a different one).

The node side is not modelled here: it is ``fleet.hostres.HostResources`` (allocatable minus the requests of the
bound, non-terminal pods), the same view the placement scorer uses, and the single-pod test is the scorer's
``fleet.hostfrag.HostFit.fits``.  A node whose allocatable is unknown (not listed, e.g. no RBAC to list nodes)
is not judged: it counts as the GPUs alone say, as the scorer treats it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from topodra.controller.cpualign import cpus_per_claim
from topodra.controller.profile import ClaimProfile
from topodra.fleet.hostfrag import HostFit
from topodra.fleet.hostres import HostResources
from topodra.selectors import parse_quantity


@dataclass(frozen=True)
class PodShape:
    """CPU millicores and memory bytes one pod of the profile requests (0: not stated)."""

    cpu_milli: int
    memory_bytes: int

    def describe(self) -> str:
        """``cpu 64, memory 512Gi`` in the units a user wrote, for status messages."""
        parts = []
        if self.cpu_milli:
            cpu = self.cpu_milli / 1000
            parts.append(f"cpu {int(cpu) if cpu == int(cpu) else cpu:g}")
        if self.memory_bytes:
            gib = self.memory_bytes / 2**30
            parts.append(f"memory {gib:g}Gi" if gib >= 1 else f"memory {self.memory_bytes}")
        return ", ".join(parts)


def _ceil(value: str, scale: int) -> int:
    return math.ceil(parse_quantity(value) * scale)


def pod_shape(profile: ClaimProfile) -> PodShape | None:
    """What one pod of the profile asks of its node; None when the profile states neither CPU nor memory."""
    spec = profile.spec
    req = spec.pod_requests
    cpu = _ceil(req.cpu, 1000) if req is not None and req.cpu is not None else 0
    mem = _ceil(req.memory, 1) if req is not None and req.memory is not None else 0
    if not cpu and spec.align_cpus is not None:
        cpu = cpus_per_claim(profile) * 1000
    return PodShape(cpu, mem) if cpu or mem else None


@dataclass(frozen=True)
class HostVerdict:
    """One node against one pod shape."""

    known: bool  # the node's allocatable is known (False: not judged, counts as fitting)
    short_cpu: bool  # its free CPU cannot hold one pod
    short_memory: bool
    pods_by_cpu: int | None  # how many such pods its free CPU holds at once; None: not limited (not asked, unknown)
    pods_by_memory: int | None

    @property
    def fits(self) -> bool:
        return not (self.short_cpu or self.short_memory)

    @property
    def pods(self) -> int | None:
        """How many such pods the free CPU and memory hold together; None: no limit known."""
        limits = [n for n in (self.pods_by_cpu, self.pods_by_memory) if n is not None]
        return min(limits) if limits else None


def verdict(host: HostResources, node: str, shape: PodShape) -> HostVerdict:
    """Whether the node's free CPU and memory hold one pod of ``shape``, and how many at once."""
    room = host.room(node)
    if room is None:
        return HostVerdict(False, False, False, None, None)
    fit = HostFit(cpu_free=room.cpu_free, memory_free=room.memory_free, pod_cpu=shape.cpu_milli,
                  pod_memory=shape.memory_bytes, share=None)
    return HostVerdict(
        True, shape.cpu_milli > fit.cpu_free, shape.memory_bytes > fit.memory_free,
        max(0, room.cpu_free) // shape.cpu_milli if shape.cpu_milli else None,
        max(0, room.memory_free) // shape.memory_bytes if shape.memory_bytes else None)


def short_note(nodes: int, short_cpu: int, short_memory: int, shape: PodShape, what: str) -> str:
    """``2 node(s) have 8 free GPUs but too little free CPU (2) / memory (1) for a pod of cpu 64``; '' if none.

    ``nodes``: nodes short of either; a node short of both counts in both ``short_cpu`` and ``short_memory``."""
    if not nodes:
        return ""
    kinds = [f"{name} ({n})" for name, n in (("CPU", short_cpu), ("memory", short_memory)) if n]
    return f"{nodes} node(s) have {what} but too little free {' / '.join(kinds)} for a pod of {shape.describe()}"


def fewer_note(nodes: int, short_cpu: int, short_memory: int, shape: PodShape) -> str:
    """The gang's form: ``1 node(s) hold fewer pods of cpu 100 than their free devices: too little free CPU (1)``."""
    if not nodes:
        return ""
    kinds = [f"{name} ({n})" for name, n in (("CPU", short_cpu), ("memory", short_memory)) if n]
    return (f"{nodes} node(s) hold fewer pods of {shape.describe()} than their free devices would: too little free "
            f"{' / '.join(kinds)}")
