"""Real pod shapes for ``bench/placement``: the Alibaba trace's own CPU and memory requests, its CPU-only
tasks, and the metrics that see node CPU and memory (pure).

``trace_jobs`` reads ``openb_pod_list_default.csv`` or ``openb_pod_list_multigpu50.csv``:

* every task becomes a job with the trace's ``cpu_milli`` and ``memory_mib`` as its pod's requests;
  tasks with ``num_gpu == 0`` (13% of the default list) become pods without claims;
* arrival and duration come from ``creation_time``/``deletion_time``. The multigpu50 list has no time
  columns: its tasks named like default-list tasks are those tasks (same rows) and take their times; each
  of its extra multi-GPU tasks takes the creation time of a default-list task and the duration of a
  default-list task of the same GPU count, both drawn with a generator seeded by the task's name, so the
  stream is the same on every run (an assumption of this benchmark, not in the trace);
* arrivals are scaled as in ``model.alibaba_jobs`` (offered GPU load ``load`` on the cluster's GPUs,
  durations trimmed at their 90th percentile for that count only).

CPU-only nodes (issue 34): ``cpu_node_group`` reads ``openb_node_list_all_node.csv`` (the trace's 1,523 nodes, 310
of them without GPUs) and gives a cluster of G GPU servers round(G * 310 / 1,213) CPU-only nodes with the trace's
CPU-only shapes in their proportions (largest remainder), e.g. 4 for 16 servers: 2x 32 CPUs/256Gi, 96/512Gi, 96/384Gi.

Node CPU and memory: ``stranded_split`` counts a node's free GPUs as stranded when no waiting GPU job's
pod fits there by GPU type, count, CPU and memory; of those, the ones where some waiting pod would fit by
GPUs but none by CPU are *stranded by CPU*, likewise by memory.
"""

from __future__ import annotations

import csv
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.placement import model as pm

MIB = 1 << 20
DEFAULT_LIST = "openb_pod_list_default.csv"
# The server the trace's 8-GPU tasks ran on: 549 of the 1,213 nodes of openb_node_list_gpu_node.csv (model G2,
# 8 GPUs, 96000 cpu_milli, 393216 memory_mib): 12 CPUs and 48Gi per GPU, against a DGX H100's 28 and 256Gi.
TRACE_NODE = ("96", "384Gi")


@dataclass(frozen=True)
class Task:
    name: str
    created: float
    duration: float
    gpus: int
    cpu_milli: int
    memory_mib: int


def _rows(path: Path) -> list[dict[str, str]]:
    try:
        with path.open(newline="") as f:
            return list(csv.DictReader(f))
    except OSError as e:
        raise pm.WorkloadError(f"cannot read trace {path}: {e}") from None


def read_tasks(path: str | Path) -> list[Task]:
    """Every task of an openb pod list with a time span, CPU-only tasks included (module docstring)."""
    p = Path(path)
    rows = _rows(p)
    need = {"name", "num_gpu", "cpu_milli", "memory_mib"}
    if not rows or not need <= set(rows[0]):
        raise pm.WorkloadError(f"{p} is not an openb pod list (needs columns {sorted(need)})")
    timed = "creation_time" in rows[0] and "deletion_time" in rows[0]
    times: dict[str, tuple[float, float]] = {}
    by_size: dict[int, list[float]] = {}
    if not timed:
        ref = p.with_name(DEFAULT_LIST)
        if not ref.exists():
            raise pm.WorkloadError(f"{p} has no creation/deletion times and {ref} (to take them from) is missing")
        for t in read_tasks(ref):
            times[t.name] = (t.created, t.duration)
            by_size.setdefault(t.gpus, []).append(t.duration)
    out: list[Task] = []
    for n, row in enumerate(rows, start=2):
        try:
            gpus, cpu, mem = int(row["num_gpu"]), int(row["cpu_milli"]), int(row["memory_mib"])
            if timed:
                if not row["deletion_time"]:
                    continue
                created, deleted = float(row["creation_time"]), float(row["deletion_time"])
                if deleted <= created:
                    continue
                span = (created, deleted - created)
            elif row["name"] in times:
                span = times[row["name"]]
            else:
                rng = random.Random(row["name"])
                donors = by_size.get(gpus)
                if not donors:
                    raise pm.WorkloadError(f"{p}:{n}: no default-list task of {gpus} GPUs to take a duration from")
                span = (rng.choice([c for c, _d in times.values()]), rng.choice(donors))
        except ValueError as e:
            raise pm.WorkloadError(f"{p}:{n}: bad number: {e}") from None
        if gpus not in (0, 1, 2, 4, 8):
            raise pm.WorkloadError(f"{p}:{n}: {gpus} GPUs is not a size the benchmark maps (0, 1, 2, 4, 8)")
        if cpu < 0 or mem < 0:
            raise pm.WorkloadError(f"{p}:{n}: negative CPU or memory request")
        out.append(Task(row["name"], span[0], span[1], gpus, cpu, mem))
    return out


def trace_jobs(path: str | Path, limit: int, capacity_gpus: int, load: float = 1.0, skip: int = 0) -> list[pm.Job]:
    """``limit`` tasks after ``skip`` in arrival order as jobs with their own requests (module docstring)."""
    tasks = sorted(read_tasks(path), key=lambda t: (t.created, t.name))[skip:skip + limit]
    if not tasks:
        raise pm.WorkloadError(f"{path}: no task left after skipping {skip}")
    t0 = tasks[0].created
    span = max(tasks[-1].created - t0, 1.0)
    gpu_tasks = [t for t in tasks if t.gpus]
    cap = pm.percentile([t.duration for t in gpu_tasks], pm.TRIM_PERCENTILE) if gpu_tasks else 0.0
    demand = sum(t.gpus * min(t.duration, cap) for t in gpu_tasks)
    scale = demand / (load * capacity_gpus * span) if demand > 0 else 1.0
    return [pm.Job(id=i, arrival=round((t.created - t0) * scale, 3), duration=t.duration, gpus=t.gpus,
                   prefs="any", cpu_milli=t.cpu_milli, memory_mib=t.memory_mib)
            for i, t in enumerate(tasks)]


# --------------------------------------------------------------------------- CPU-only nodes


def cpu_node_group(path: str | Path, gpu_servers: int) -> list[tuple[str, str]]:
    """(CPUs, memory) of the CPU-only nodes beside ``gpu_servers`` GPU servers, in the trace's proportion of
    CPU-only to GPU nodes and its CPU-only shapes, most common first (module docstring)."""
    p = Path(path)
    rows = _rows(p)
    need = {"cpu_milli", "memory_mib", "gpu"}
    if not rows or not need <= set(rows[0]):
        raise pm.WorkloadError(f"{p} is not an openb node list (needs columns {sorted(need)})")
    shapes: dict[tuple[int, int], int] = {}
    gpu_nodes = 0
    for n, row in enumerate(rows, start=2):
        try:
            gpus, cpu, mem = int(row["gpu"]), int(row["cpu_milli"]), int(row["memory_mib"])
        except ValueError as e:
            raise pm.WorkloadError(f"{p}:{n}: bad number: {e}") from None
        if gpus > 0:
            gpu_nodes += 1
        elif cpu > 0 and mem > 0:
            shapes[(cpu, mem)] = shapes.get((cpu, mem), 0) + 1
    cpu_nodes = sum(shapes.values())
    if not gpu_nodes or not cpu_nodes:
        raise pm.WorkloadError(f"{p}: needs both GPU and CPU-only nodes ({gpu_nodes} and {cpu_nodes} found)")
    want = round(gpu_servers * cpu_nodes / gpu_nodes)
    ranked = sorted(shapes.items(), key=lambda kv: (-kv[1], kv[0]))
    exact = [(shape, want * count / cpu_nodes) for shape, count in ranked]
    counts = {shape: int(x) for shape, x in exact}
    left = want - sum(counts.values())
    for shape, _x in sorted(exact, key=lambda sx: -(sx[1] - int(sx[1])))[:left]:
        counts[shape] += 1
    out: list[tuple[str, str]] = []
    for (cpu, mem), _count in ranked:
        out += [(f"{cpu}m", f"{mem}Mi")] * counts[(cpu, mem)]
    return out


# --------------------------------------------------------------------------- node CPU and memory


def pod_cpu_milli(job: pm.Job) -> int:
    """One pod's CPU request: the trace's, else the DGX share of its GPUs."""
    return job.cpu_milli if job.cpu_milli is not None else pm.CPU_PER_GPU * 1000 * job.per_pod


def pod_memory_bytes(job: pm.Job) -> int:
    return job.memory_mib * MIB if job.memory_mib is not None else pm.MEM_GI_PER_GPU * 1024 * MIB * job.per_pod


def host_used(placements: Mapping[str, pm.Placement], jobs_by_pod: Mapping[str, pm.Job]) -> dict[str, tuple[int, int]]:
    """Per node, the CPU (millicores) and memory (bytes) the bound pods request."""
    out: dict[str, tuple[int, int]] = {}
    for pod, p in placements.items():
        job = jobs_by_pod.get(pod)
        if job is None:
            continue
        cpu, mem = out.get(p.node, (0, 0))
        out[p.node] = (cpu + pod_cpu_milli(job), mem + pod_memory_bytes(job))
    return out


def host_free(inv: pm.NodeCapacity, used: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    return {n: (a[0] - used.get(n, (0, 0))[0], a[1] - used.get(n, (0, 0))[1]) for n, a in inv.host.items()}


@dataclass(frozen=True)
class Stranded:
    total: int
    by_cpu: int
    by_memory: int


def stranded_split(inv: pm.NodeCapacity, free: Mapping[str, int], waiting: Sequence[pm.Job], policy: str,
                   room: Mapping[str, tuple[int, int]]) -> Stranded:
    """Free GPUs on nodes where no waiting GPU job's pod fits by type, count, CPU and memory; and of those,
    the GPUs where some pod would fit by GPUs alone but none by CPU (``by_cpu``) or none by memory."""
    needs = {(pm.acceptable_models(j, policy, inv), j.per_pod, pod_cpu_milli(j), pod_memory_bytes(j))
             for j in waiting if j.gpus > 0}
    if not needs:
        return Stranded(0, 0, 0)
    total = by_cpu = by_mem = 0
    for node, n_free in free.items():
        if not n_free:
            continue
        model = inv.node_model(node)
        cpu_free, mem_free = room.get(node, (1 << 62, 1 << 62))
        by_gpus = [(c, m) for models, k, c, m in needs if model in models and n_free >= k]
        if any(c <= cpu_free and m <= mem_free for c, m in by_gpus):
            continue
        total += n_free
        if by_gpus and not any(c <= cpu_free for c, _m in by_gpus):
            by_cpu += n_free
        if by_gpus and not any(m <= mem_free for _c, m in by_gpus):
            by_mem += n_free
    return Stranded(total, by_cpu, by_mem)


def cpu_only_on_gpu_nodes(placements: Mapping[str, pm.Placement], jobs_by_pod: Mapping[str, pm.Job],
                          inv: pm.NodeCapacity) -> int:
    """Bound pods without GPUs on nodes that have GPUs (every node of the benchmark's clusters has)."""
    gpu_nodes = set(inv.su)
    return sum(1 for pod, p in placements.items()
               if (j := jobs_by_pod.get(pod)) is not None and j.gpus == 0 and p.node in gpu_nodes)


def with_host(snap: pm.Snapshot, inv: pm.NodeCapacity, placements: Mapping[str, pm.Placement],
              jobs_by_pod: Mapping[str, pm.Job], waiting: Sequence[pm.Job], policy: str) -> pm.Snapshot:
    """The snapshot with stranding recounted against node CPU and memory (``stranded_split``)."""
    if not inv.host:
        return snap
    room = host_free(inv, host_used(placements, jobs_by_pod))
    st = stranded_split(inv, snap.free_per_node, waiting, policy, room)
    return replace(snap, stranded=st.total, stranded_cpu=st.by_cpu, stranded_memory=st.by_memory,
                   cpu_only_on_gpu_nodes=cpu_only_on_gpu_nodes(placements, jobs_by_pod, inv))


def parse_allocatable(text: str) -> tuple[str, str]:
    """``"96,384Gi"`` -> ("96", "384Gi") for ``--node-allocatable``; a clear error for anything else."""
    from topodra.selectors import parse_quantity

    parts = [x.strip() for x in text.split(",")]
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"--node-allocatable must be CPUS,MEMORY (e.g. 96,384Gi), got {text!r}")
    for what, value in zip(("CPUs", "memory"), parts, strict=True):
        try:
            ok = parse_quantity(value) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"--node-allocatable: {what} {value!r} is not a positive Kubernetes quantity")
    return parts[0], parts[1]


def node_allocatable(nodes: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, tuple[int, int]]:
    """(CPU millicores, memory bytes) of ``status.allocatable`` of the named nodes, as the scheduler reads them."""
    from topodra.fleet.hostres import node_allocatable as alloc_of

    wanted = set(names)
    out = {}
    for n in nodes:
        name = str((n.get("metadata") or {}).get("name"))
        got = alloc_of(dict(n))
        if name in wanted and got is not None:
            out[name] = got
    return out
