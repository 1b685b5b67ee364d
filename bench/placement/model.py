"""The pure half of ``bench/placement``: workloads, policies as API objects, the virtual clock, metrics.

Nothing here talks to a cluster: ``main.py`` feeds it what it read from the API
(ResourceSlices, pods, claims) and writes what it returns.  That keeps every number the benchmark
reports reproducible from its inputs and unit-testable (``tests/test_placement_bench.py``).

Vocabulary: a *job* arrives at a virtual time, asks for 1/2/4/8 GPUs in one pod or 16 GPUs as two
8-GPU pods that must share a scalable unit, lists acceptable GPU types in preference order, and runs
for ``duration`` virtual seconds once all its pods are bound.  A *policy* decides how the job is
expressed to the scheduler (see ``POLICIES``).
"""

from __future__ import annotations

import csv
import math
import random
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DRIVER = "gpu.topodra.io"
GENERIC_CLASS = "gpu.topodra.io"
EXTENDED_CLASS = "bench-gpu-count.topodra.io"
EXTENDED_RESOURCE = "topodra.io/gpu"
SU_LABEL = "topodra.io/scalable-unit"
JOB_LABEL = "bench.topodra.io/job"
RUN_LABEL = "bench.topodra.io/run"
NVLINK_ATTR = f"{DRIVER}/nvlinkDomain"
CLAIM_NAME = "gpus"  # the pod's claim entry and the request name the ClaimProfile renderer uses

# Per-GPU CPU and memory of a DGX server (12 CPU, 96Gi per GPU): the pod shape issue 15 measured.
CPU_PER_GPU = 12
MEM_GI_PER_GPU = 96

POLICIES: dict[str, str] = {
    "a": "count-only extended resource (KEP-5004), NodeResourcesFit MostAllocated on it",
    "b": "strict single-type claims (first choice only, exactly)",
    "c": "topodra ClaimProfile: firstAvailable fallback + nvlink Required",
    "d": "(c) + topodra placement scorer (scheduler extender)",
    "e": "(c), multi-node jobs as a PodGroup gang with a scalable-unit topology constraint (bench/placement/gang.py)",
    "f": "(e) + topodra placement scorer (gang-aware: one leaf group inside the unit)",
    "dr": "(d') (d) with the scorer counting node CPU and memory (--host-resources on)",
    "dh": "(d) with the scorer's --host-resources mix: each request class judged with the CPU and memory per GPU "
          "its size's pods ask for (whole servers count), pods without claims scored by the GPUs they strand",
    "g": "(f) + reservations for waiting multi-node and 8-GPU jobs (the controller's planner; "
         "bench/placement/reserve.py), backfill of 1-4 GPU jobs by their duration",
}
# policy -> the scorer's --host-resources
SCORER_POLICIES = {"d": "off", "dr": "on", "dh": "mix", "f": "off", "g": "off"}

# Preference lists: name -> DeviceClass names, in order (classes from topodra's catalog).
PREFERENCES: dict[str, tuple[str, ...]] = {
    "h200>h100>a100": ("gpu-h200", "gpu-h100", "gpu-a100-80gb"),
    "h200>h100": ("gpu-h200", "gpu-h100"),
    "mem80": ("gpu-mem-80gi",),
    "h200": ("gpu-h200",),
    "any": (GENERIC_CLASS,),
}


class WorkloadError(ValueError):
    """Bad workload input (trace file, parameters); the message says what and where."""


# --------------------------------------------------------------------------- jobs


@dataclass(frozen=True)
class Job:
    id: int
    arrival: float
    duration: float
    gpus: int  # 0: a CPU-only task (a pod without claims)
    prefs: str  # key of PREFERENCES
    cpu_milli: int | None = None  # the pod's own requests (trace shapes, ``shapes.py``); None: the DGX share
    memory_mib: int | None = None

    @property
    def pods(self) -> int:
        """More than 8 GPUs = 8-GPU pods, one per server (16 -> 2, 32 -> 4, 64 -> 8); else one pod."""
        return -(-self.gpus // 8) if self.gpus > 8 else 1

    @property
    def per_pod(self) -> int:
        return self.gpus // self.pods

    @property
    def classes(self) -> tuple[str, ...]:
        return PREFERENCES[self.prefs]

    def pod_names(self) -> list[str]:
        return [f"j{self.id:05d}-{k}" for k in range(self.pods)]


@dataclass(frozen=True)
class SyntheticSpec:
    """The seeded synthetic stream: Poisson arrivals, lognormal durations, a burst of higher load."""

    jobs: int = 500
    capacity_gpus: int = 400
    load: float = 1.0
    burst_load: float = 1.5
    burst: tuple[float, float] = (0.4, 0.6)  # fraction of the jobs (by index) arriving at burst_load
    median_duration: float = 3600.0
    sigma: float = 1.0
    sizes: tuple[tuple[int, float], ...] = ((1, 0.35), (2, 0.2), (4, 0.15), (8, 0.22), (16, 0.08))
    prefs: tuple[tuple[str, float], ...] = (("h200>h100>a100", 0.4), ("h200>h100", 0.25), ("mem80", 0.25),
                                            ("h200", 0.1))

    def mean_gpu_seconds(self) -> float:
        mean_size = sum(s * w for s, w in self.sizes) / sum(w for _s, w in self.sizes)
        return mean_size * self.median_duration * math.exp(self.sigma ** 2 / 2)


def synthetic_jobs(spec: SyntheticSpec, seed: int) -> list[Job]:
    """Arrival rate lambda = load * capacity / E[gpus * duration]; the burst multiplies the load."""
    if spec.jobs < 1 or spec.load <= 0 or spec.burst_load <= 0 or spec.capacity_gpus < 1:
        raise WorkloadError("jobs, load, burst load and capacity must be positive")
    rng = random.Random(seed)
    sizes, size_w = zip(*spec.sizes, strict=True)
    prefs, pref_w = zip(*spec.prefs, strict=True)
    unknown = [p for p in prefs if p not in PREFERENCES]
    if unknown:
        raise WorkloadError(f"unknown preference lists {unknown}; known: {sorted(PREFERENCES)}")
    base_rate = spec.capacity_gpus / spec.mean_gpu_seconds()
    lo, hi = int(spec.burst[0] * spec.jobs), int(spec.burst[1] * spec.jobs)
    t = 0.0
    out = []
    for i in range(spec.jobs):
        load = spec.burst_load if lo <= i < hi else spec.load
        t += rng.expovariate(base_rate * load) if i else 0.0
        dur = rng.lognormvariate(math.log(spec.median_duration), spec.sigma)
        out.append(Job(id=i, arrival=round(t, 3), duration=round(max(dur, 1.0), 3),
                       gpus=rng.choices(sizes, size_w)[0], prefs=rng.choices(prefs, pref_w)[0]))
    return out


def alibaba_jobs(path: str | Path, limit: int, capacity_gpus: int, load: float = 1.0,
                 fractional: str = "round-up", skip: int = 0) -> list[Job]:
    """Jobs from the Alibaba GPU trace v2023 (openb_pod_list_*.csv), in its arrival order.

    Sizes and durations are the trace's (deletion_time - creation_time; tasks with none are
    skipped, as are CPU-only tasks). Fractional-GPU tasks become 1-GPU jobs (``round-up``) or are
    dropped (``skip``). The trace lists no GPU type for its tasks (gpu_spec is empty), so every job
    accepts any GPU. Arrival times keep their order and relative spacing but are scaled so the
    offered load on ``capacity_gpus`` is ``load``, durations counted up to their 90th percentile
    (``TRIM_PERCENTILE``; the trace's cluster is 1,213 nodes).
    """
    if fractional not in ("round-up", "skip"):
        raise WorkloadError(f"fractional must be round-up or skip, got {fractional!r}")
    p = Path(path)
    try:
        with p.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise WorkloadError(f"cannot read trace {p}: {e}") from None
    need = {"num_gpu", "gpu_milli", "creation_time", "deletion_time"}
    if not rows or not need <= set(rows[0]):
        raise WorkloadError(f"{p} is not an openb pod list (needs columns {sorted(need)})")
    raw: list[tuple[float, float, int]] = []
    for n, row in enumerate(rows, start=2):
        try:
            num = int(row["num_gpu"])
            milli = int(row["gpu_milli"] or 0)
            created = float(row["creation_time"])
            deleted = float(row["deletion_time"]) if row["deletion_time"] else None
        except ValueError as e:
            raise WorkloadError(f"{p}:{n}: bad number: {e}") from None
        if num <= 0 or deleted is None or deleted <= created:
            continue
        if num == 1 and milli < 1000 and fractional == "skip":
            continue
        if num not in (1, 2, 4, 8):
            raise WorkloadError(f"{p}:{n}: {num} GPUs is not a size the benchmark maps (1, 2, 4, 8)")
        raw.append((created, deleted - created, num))
    raw.sort(key=lambda r: r[0])
    raw = raw[skip:skip + limit]
    if not raw:
        raise WorkloadError(f"{p}: no GPU task left after skipping {skip}")
    t0 = raw[0][0]
    span = max(raw[-1][0] - t0, 1.0)
    cap = percentile([float(d) for _c, d, _g in raw], TRIM_PERCENTILE)
    demand = sum(g * min(float(d), cap) for _c, d, g in raw)
    scale = demand / (load * capacity_gpus * span)  # arrival gaps * scale -> offered load == load
    return [Job(id=i, arrival=round((c - t0) * scale, 3), duration=float(d), gpus=g, prefs="any")
            for i, (c, d, g) in enumerate(raw)]


# The trace has tasks that run for weeks: with whole durations, one of them would count as most of a
# window's offered load and the rest would arrive too sparsely to fill the cluster. The load that
# sets the arrival spacing counts durations only up to this percentile (the replay runs them whole).
TRIM_PERCENTILE = 90.0


def offered_load(jobs: Sequence[Job], capacity_gpus: int) -> float:
    """GPU-seconds asked for, over the GPU-seconds of the arrival window."""
    if len(jobs) < 2:
        return 0.0
    span = jobs[-1].arrival - jobs[0].arrival
    return sum(j.gpus * j.duration for j in jobs) / (capacity_gpus * span) if span > 0 else math.inf


# --------------------------------------------------------------------------- policies as API objects


def extended_device_class() -> dict[str, Any]:
    """Policy (a): every topodra GPU, requestable as the count-only extended resource (KEP-5004)."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": EXTENDED_CLASS, "labels": {"app.kubernetes.io/part-of": "topodra-bench"}},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}" && '
                                                          f'device.attributes["{DRIVER}"].type == "gpu"'}}],
                     "extendedResourceName": EXTENDED_RESOURCE}}


SCHEDULER_CLIENT = {"qps": 500, "burst": 1000}


def scheduler_config(policy: str, client: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The KubeSchedulerConfiguration for a policy (all share the queue and client settings).

    Backoff is 1 s for every policy so a requeued pod is retried at once in wall time; the
    virtual clock does not advance while the scheduler works, so this changes no result. The
    scheduler's API client gets ``SCHEDULER_CLIENT`` (default 50 qps / 100 burst): every DRA pod
    costs it at least two writes (claim status, binding), so the default caps it near 25 pods/s.
    """
    profile: dict[str, Any] = {"schedulerName": "default-scheduler"}
    if policy == "a":
        profile["pluginConfig"] = [{"name": "NodeResourcesFit", "args": {"scoringStrategy": {
            "type": "MostAllocated", "resources": [{"name": EXTENDED_RESOURCE, "weight": 1}]}}}]
    return {"apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
            "clientConnection": dict(SCHEDULER_CLIENT if client is None else client),
            "podInitialBackoffSeconds": 1, "podMaxBackoffSeconds": 1, "profiles": [profile]}


def claim_spec_for(job: Job, policy: str) -> dict[str, Any] | None:
    """The ResourceClaim spec of one of the job's pods (None for the count-only policy)."""
    if policy == "a":
        return None
    if policy == "b":
        return {"devices": {"requests": [{"name": CLAIM_NAME, "exactly": {
            "deviceClassName": job.classes[0], "allocationMode": "ExactCount", "count": job.per_pod}}]}}
    if policy in ("c", "d", "dr", "dh", "e", "f", "g"):
        from topodra.controller.profile import ClaimProfile
        from topodra.controller.render import claim_spec

        profile = ClaimProfile.from_api({
            "metadata": {"name": f"j{job.id}", "namespace": "bench"},
            "spec": {"alternatives": [{"deviceClassName": c, "count": job.per_pod} for c in job.classes],
                     "topology": {"nvlink": "Required"}}})
        return claim_spec(profile, driver=DRIVER)
    raise ValueError(f"unknown policy {policy!r}; known: {sorted(POLICIES)}")


def alternative_names(job: Job) -> list[str]:
    """Subrequest names as the ClaimProfile renderer derives them (``gpu-h200`` -> ``h200``)."""
    from topodra.controller.profile import Alternative

    return [Alternative(deviceClassName=c).effective_name for c in job.classes]


def pod_for(job: Job, index: int, policy: str, run: str, node_selector: Mapping[str, str]) -> dict[str, Any]:
    """One pod of a job. A 16-GPU job's two pods require one scalable unit (pod affinity on the job)."""
    name = job.pod_names()[index]
    cpu = f"{job.cpu_milli}m" if job.cpu_milli is not None else str(CPU_PER_GPU * job.per_pod)
    mem = f"{job.memory_mib}Mi" if job.memory_mib is not None else f"{MEM_GI_PER_GPU * job.per_pod}Gi"
    res: dict[str, Any] = {"requests": {"cpu": cpu, "memory": mem}}
    spec: dict[str, Any] = {
        "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
        "nodeSelector": dict(node_selector),
        "containers": [{"name": "main", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                        "command": ["true"], "resources": res}]}
    if job.gpus > 0 and policy == "a":  # a CPU-only task (gpus == 0) gets neither GPU resource nor claim
        res["requests"][EXTENDED_RESOURCE] = str(job.per_pod)
        res["limits"] = {EXTENDED_RESOURCE: str(job.per_pod)}
    elif job.gpus > 0:
        spec["resourceClaims"] = [{"name": CLAIM_NAME, "resourceClaimName": name}]
        res["claims"] = [{"name": CLAIM_NAME}]
    if job.pods > 1:
        spec["affinity"] = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {JOB_LABEL: str(job.id), RUN_LABEL: run}},
            "topologyKey": SU_LABEL}]}}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {JOB_LABEL: str(job.id), RUN_LABEL: run}}, "spec": spec}


def claim_for(job: Job, index: int, policy: str, run: str) -> dict[str, Any] | None:
    spec = claim_spec_for(job, policy) if job.gpus else None
    if spec is None:
        return None
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": job.pod_names()[index], "labels": {JOB_LABEL: str(job.id), RUN_LABEL: run}},
            "spec": spec}


# --------------------------------------------------------------------------- inventory


@dataclass(frozen=True)
class Gpu:
    node: str
    name: str
    model: str
    nvlink: str
    rail: int | None


@dataclass
class NodeCapacity:
    """The GPUs of the benchmark's nodes (from their ResourceSlices) and what each class accepts."""

    gpus: dict[tuple[str, str], Gpu]
    su: dict[str, str]  # node -> scalable unit
    accepts: dict[str, frozenset[str]]  # class -> models it selects
    busbw_nic: dict[str, float]  # node -> per-NIC all-reduce GB/s
    host: dict[str, tuple[int, int]] = field(default_factory=dict)  # node -> allocatable (CPU milli, memory bytes)

    @property
    def nodes(self) -> list[str]:
        return sorted(self.su)

    def total(self) -> int:
        return len(self.gpus)

    def node_model(self, node: str) -> str:
        return next(g.model for g in self.gpus.values() if g.node == node)

    def per_node(self) -> dict[str, list[Gpu]]:
        out: dict[str, list[Gpu]] = {n: [] for n in self.su}
        for g in self.gpus.values():
            out[g.node].append(g)
        return out


NIC_BUSBW_GBS = {400: 48.0, 200: 24.0}  # NCCL busbw per NDR / HDR NIC (placement.md)


def inventory_from_slices(slices: Iterable[Mapping[str, Any]], node_su: Mapping[str, str],
                          class_matches: Mapping[str, Any]) -> NodeCapacity:
    """GPUs of the nodes in ``node_su`` from their slices; ``class_matches``: class -> DeviceMatch."""
    gpus: dict[tuple[str, str], Gpu] = {}
    nic_rate: dict[str, int] = {}
    accepts: dict[str, set[str]] = {c: set() for c in class_matches}
    for sl in slices:
        spec = sl.get("spec") or {}
        node = str(spec.get("nodeName"))
        if spec.get("driver") != DRIVER or node not in node_su:
            continue
        for dev in spec.get("devices") or []:
            attrs = {k.removeprefix(DRIVER + "/"): next(iter(v.values()), None)
                     for k, v in (dev.get("attributes") or {}).items() if isinstance(v, dict)}
            if attrs.get("type") == "nic":
                nic_rate[node] = int(attrs.get("linkRate") or 0)
            if attrs.get("type") != "gpu":
                continue
            model = str(attrs.get("model"))
            rail = attrs.get("rail")
            gpus[(node, dev["name"])] = Gpu(node, dev["name"], model, str(attrs.get("nvlinkDomain")),
                                            int(rail) if rail is not None else None)
            for cls, match in class_matches.items():
                if match.matches(dev, DRIVER):
                    accepts[cls].add(model)
    missing = sorted(set(node_su) - {g.node for g in gpus.values()})
    if missing:
        raise ValueError(f"no GPUs published for nodes {missing[:5]}")
    return NodeCapacity(gpus=gpus, su=dict(node_su), accepts={c: frozenset(m) for c, m in accepts.items()},
                     busbw_nic={n: NIC_BUSBW_GBS.get(nic_rate.get(n, 0), 0.0) for n in node_su})


# --------------------------------------------------------------------------- allocation reading


@dataclass(frozen=True)
class Placement:
    """Where one pod of a job landed: node, devices, and the subrequest the allocator chose."""

    node: str
    devices: tuple[str, ...]
    subrequest: str | None


def placement_from(pod: Mapping[str, Any], claim: Mapping[str, Any] | None) -> Placement | None:
    """A bound pod with an allocated claim -> Placement; None while not placed."""
    node = (pod.get("spec") or {}).get("nodeName")
    alloc = ((claim or {}).get("status") or {}).get("allocation")
    if node and claim is None and not gpu_pod(pod):
        return Placement(node=node, devices=(), subrequest=None)  # a CPU-only task, bound
    if not node or not alloc:
        return None
    results = [r for r in alloc["devices"]["results"] if r.get("driver") == DRIVER]
    subs = {r["request"].split("/", 1)[1] for r in results if "/" in r.get("request", "")}
    return Placement(node=node, devices=tuple(sorted(r["device"] for r in results)),
                     subrequest=next(iter(subs)) if len(subs) == 1 else None)


def gpu_pod(pod: Mapping[str, Any]) -> bool:
    """Whether the pod asks for GPUs (a claim, or the count-only extended resource)."""
    spec = pod.get("spec") or {}
    return bool(spec.get("resourceClaims")) or any(
        EXTENDED_RESOURCE in ((c.get("resources") or {}).get("requests") or {}) for c in spec.get("containers") or [])


# --------------------------------------------------------------------------- virtual clock


@dataclass
class JobState:
    job: Job
    submitted: bool = False
    start: float | None = None
    end: float | None = None
    placements: list[Placement] = field(default_factory=list)
    completed: bool = False


class VirtualClock:
    """Event bookkeeping: which arrivals and completions are due, when jobs start and end.

    The runner asks ``next_time()``, submits ``due_arrivals(t)``, deletes ``due_completions(t)``,
    waits for the scheduler, then reports the jobs it found fully placed with ``started``.
    ``tick`` > 0 groups every event within ``tick`` virtual seconds of the step into that step.
    """

    def __init__(self, jobs: Sequence[Job], tick: float = 0.0) -> None:
        if tick < 0:
            raise ValueError("tick must be >= 0")
        self.tick = tick
        self.states = {j.id: JobState(j) for j in sorted(jobs, key=lambda j: (j.arrival, j.id))}
        self._arrivals = [j.id for j in sorted(jobs, key=lambda j: (j.arrival, j.id))]
        self._next_arrival = 0
        self.now = 0.0

    @property
    def last_arrival(self) -> float:
        return max((s.job.arrival for s in self.states.values()), default=0.0)

    def next_time(self) -> float | None:
        """The next event's virtual time (arrival or completion), None when nothing is left."""
        cands = []
        if self._next_arrival < len(self._arrivals):
            cands.append(self.states[self._arrivals[self._next_arrival]].job.arrival)
        cands += [s.end for s in self.states.values() if s.end is not None and not s.completed]
        return min(cands) if cands else None

    def advance(self, t: float) -> float:
        if t < self.now:
            raise ValueError(f"virtual time cannot go back ({t} < {self.now})")
        self.now = t
        return t

    def due_arrivals(self) -> list[Job]:
        out = []
        horizon = self.now + self.tick
        while self._next_arrival < len(self._arrivals):
            st = self.states[self._arrivals[self._next_arrival]]
            if st.job.arrival > horizon:
                break
            st.submitted = True
            out.append(st.job)
            self._next_arrival += 1
        return out

    def due_completions(self) -> list[Job]:
        horizon = self.now + self.tick
        out = [s.job for s in self.states.values()
               if s.end is not None and not s.completed and s.end <= horizon]
        for j in out:
            self.states[j.id].completed = True
        return sorted(out, key=lambda j: j.id)

    def started(self, job_id: int, placements: Sequence[Placement]) -> None:
        st = self.states[job_id]
        if st.start is not None:
            return
        # With tick > 0 a job may be submitted a little before its arrival time: it starts no earlier.
        st.start = max(self.now, st.job.arrival)
        st.end = st.start + st.job.duration
        st.placements = list(placements)

    def waiting(self) -> list[Job]:
        return [s.job for s in self.states.values() if s.submitted and s.start is None]

    def running(self) -> list[JobState]:
        return [s for s in self.states.values() if s.start is not None and not s.completed]

    def all_arrived(self) -> bool:
        return self._next_arrival >= len(self._arrivals)

    def all_started(self) -> bool:
        return self.all_arrived() and all(s.start is not None for s in self.states.values())


# --------------------------------------------------------------------------- metrics


def acceptable_models(job: Job, policy: str, inv: NodeCapacity) -> frozenset[str]:
    """Models the scheduler may give the job under the policy (count-only accepts any GPU)."""
    if policy == "a":
        return frozenset(g.model for g in inv.gpus.values())
    classes = job.classes[:1] if policy == "b" else job.classes
    return frozenset().union(*(inv.accepts.get(c, frozenset()) for c in classes))


def listed_models(job: Job, inv: NodeCapacity) -> frozenset[str]:
    """Models the job listed (its whole preference list): anything else is a type violation."""
    return frozenset().union(*(inv.accepts.get(c, frozenset()) for c in job.classes))


def free_by_node(inv: NodeCapacity, used: set[tuple[str, str]]) -> dict[str, int]:
    out = {n: 0 for n in inv.su}
    for key, g in inv.gpus.items():
        if key not in used:
            out[g.node] += 1
    return out


def stranded_gpus(inv: NodeCapacity, free: Mapping[str, int], waiting: Sequence[Job], policy: str) -> int:
    """Free GPUs on nodes where no waiting job's pod fits (type and count); 0 when nobody waits."""
    if not any(j.gpus for j in waiting):
        return 0
    needs = {(acceptable_models(j, policy, inv), j.per_pod) for j in waiting if j.gpus}
    stranded = 0
    for node, n_free in free.items():
        model = inv.node_model(node)
        if n_free and not any(model in models and n_free >= per_pod for models, per_pod in needs):
            stranded += n_free
    return stranded


def job_classes(jobs: Sequence[Job]) -> dict[tuple[str, int], float]:
    """FGD task classes (preference list, GPUs per pod) with their popularity in the stream."""
    c = Counter((j.prefs, j.per_pod) for j in jobs if j.gpus)
    total = sum(c.values())
    return {k: v / total for k, v in c.items()} if total else {}


def fgd_fragmentation(inv: NodeCapacity, free: Mapping[str, int], mix: Mapping[tuple[str, int], float],
                      policy: str) -> float:
    """FGD's cluster fragmentation for whole-GPU tasks: sum over nodes and task classes m of
    p_m * (free GPUs of the node if m cannot run there, else 0) (Weng et al., ATC'23)."""
    total = 0.0
    models_of = {prefs: acceptable_models(Job(0, 0, 1, 1, prefs), policy, inv) for prefs, _n in mix}
    for node, n_free in free.items():
        if not n_free:
            continue
        model = inv.node_model(node)
        for (prefs, per_pod), p in mix.items():
            if model not in models_of[prefs] or n_free < per_pod:
                total += p * n_free
    return total


# Intra-node NCCL all-reduce bus bandwidth, 8 GPUs on NVSwitch (GB/s; placement.md and its sources).
INTRA_BUSBW_GBS = {"H200": 475.0, "H100": 370.0, "A100": 232.0}
COMM_SHARE = 0.2  # assumed share of a step spent in collective communication
CROSS_SU_FACTOR = 0.9  # a communicator crossing the spine / rails: ~8-11% slower (arXiv 2307.12169)


def intra_busbw(model: str) -> float:
    for stem, bw in INTRA_BUSBW_GBS.items():
        if model.startswith(stem):
            return bw
    raise ValueError(f"no bandwidth figure for GPU model {model!r}")


def job_busbw(inv: NodeCapacity, placements: Sequence[Placement]) -> float:
    """busbw of a placed job: intra-node figure on one node, else min(intra, k * B_nic * 0.9)
    (k GPUs per node), times CROSS_SU_FACTOR when its pods are not rail-aligned in one unit."""
    models = [inv.gpus[(p.node, d)].model for p in placements for d in p.devices]
    intra = min(intra_busbw(m) for m in models)
    if len({p.node for p in placements}) == 1:
        return intra
    bw = min([intra] + [len(p.devices) * inv.busbw_nic[p.node] * 0.9 for p in placements])
    return bw if rail_aligned(inv, placements) else bw * CROSS_SU_FACTOR


def ideal_busbw(job: Job, inv: NodeCapacity, nodes_per_job: int) -> float:
    """The job's best case: its fastest listed model, placed in one NVSwitch domain / one unit."""
    best = max((intra_busbw(m) for m in listed_models(job, inv)), default=0.0)
    if nodes_per_job == 1:
        return best
    nic = max(inv.busbw_nic.values())
    return min(best, job.per_pod * nic * 0.9)


def slowdown(job: Job, inv: NodeCapacity, placements: Sequence[Placement]) -> float:
    """1 + f * (busbw_ideal / busbw - 1); single-GPU (and CPU-only) jobs do not communicate."""
    if job.gpus <= 1:
        return 1.0
    ideal = ideal_busbw(job, inv, len(placements))
    return 1.0 + COMM_SHARE * max(ideal / job_busbw(inv, placements) - 1.0, 0.0)


def rail_aligned(inv: NodeCapacity, placements: Sequence[Placement]) -> bool:
    """A multi-node job is rail-aligned when its pods share a scalable unit and a rail set."""
    if len({inv.su[p.node] for p in placements}) > 1:
        return False
    rails = [sorted(inv.gpus[(p.node, d)].rail or 0 for d in p.devices) for p in placements]
    return all(r == rails[0] for r in rails)


def nvlink_local(inv: NodeCapacity, placement: Placement) -> bool:
    return len({inv.gpus[(placement.node, d)].nvlink for d in placement.devices}) == 1


def subrequest_rank(job: Job, placements: Sequence[Placement]) -> int | None:
    """The alternative the allocator chose, from the allocation's subrequest name (``gpus/h100``);
    None when a claim has no subrequest (``exactly`` requests, extended resources)."""
    names = alternative_names(job)
    ranks = [names.index(p.subrequest) for p in placements if p.subrequest in names]
    return max(ranks) if ranks and len(ranks) == len(placements) else None


def choice_rank(job: Job, inv: NodeCapacity, placements: Sequence[Placement]) -> int | None:
    """0 for the first listed type, 1 for the second ...; None when a GPU is of no listed type."""
    worst = 0
    for p in placements:
        for d in p.devices:
            model = inv.gpus[(p.node, d)].model
            rank = next((i for i, c in enumerate(job.classes) if model in inv.accepts.get(c, ())), None)
            if rank is None:
                return None
            worst = max(worst, rank)
    return worst


@dataclass(frozen=True)
class Snapshot:
    """The cluster at one virtual time, after the scheduler went idle."""

    t: float
    used: int
    stranded: int
    fgd: float
    goodput: float  # GPU-equivalents of useful work (running jobs' GPUs / slowdown)
    waiting: int
    waiting_gpus: int
    free_per_node: dict[str, int]
    stranded_cpu: int = 0  # of ``stranded``: GPUs no waiting pod can use for lack of node CPU (shapes.py)
    stranded_memory: int = 0
    cpu_only_on_gpu_nodes: int = 0  # bound pods without GPUs on GPU nodes
    whole_free: int = 0  # servers with all of at least WHOLE_SERVER GPUs free (an 8-GPU job's server)


def snapshot(t: float, inv: NodeCapacity, used: set[tuple[str, str]], clock: VirtualClock,
             mix: Mapping[tuple[str, int], float], policy: str) -> Snapshot:
    free = free_by_node(inv, used)
    waiting = clock.waiting()
    good = sum(s.job.gpus / slowdown(s.job, inv, s.placements) for s in clock.running())
    return Snapshot(t=t, used=len(used), stranded=stranded_gpus(inv, free, waiting, policy),
                    fgd=fgd_fragmentation(inv, free, mix, policy), goodput=good, waiting=len(waiting),
                    waiting_gpus=sum(j.gpus for j in waiting), free_per_node=free,
                    whole_free=whole_free_servers(free))


WHOLE_SERVER = 8  # GPUs of the largest single-node job: a server with this many free can take it


def whole_free_servers(free: Mapping[str, int]) -> int:
    """Servers with at least ``WHOLE_SERVER`` free GPUs (every GPU node of the benchmark's clusters has 8)."""
    return sum(1 for f in free.values() if f >= WHOLE_SERVER)


def time_average(snaps: Sequence[Snapshot], attr: str, t0: float, t1: float) -> float:
    """Mean of a step function (value of snapshot i holds until snapshot i+1) over [t0, t1]."""
    if t1 <= t0 or not snaps:
        return 0.0
    total = 0.0
    for i, s in enumerate(snaps):
        a = max(s.t, t0)
        b = min(snaps[i + 1].t if i + 1 < len(snaps) else t1, t1)
        if b > a:
            total += float(getattr(s, attr)) * (b - a)
    return total / (t1 - t0)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_metrics(clock: VirtualClock, snaps: Sequence[Snapshot], inv: NodeCapacity) -> dict[str, Any]:
    """Everything one run reports, integrated over the arrival window [first, last arrival]."""
    states = list(clock.states.values())
    t0 = min(s.job.arrival for s in states)
    t1 = clock.last_arrival
    cap = inv.total()
    placed = [s for s in states if s.start is not None]
    waits: dict[str, list[float]] = {}
    for s in placed:
        assert s.start is not None
        waits.setdefault(str(s.job.gpus), []).append(s.start - s.job.arrival)
    ranks: Counter[str] = Counter()
    violations = mismatches = 0
    multi_gpu_pods = nvl_local = multi_node = aligned = 0
    for s in placed:
        if not s.job.gpus:
            continue  # a CPU-only task chooses no GPU type
        rank = choice_rank(s.job, inv, s.placements)
        chosen = subrequest_rank(s.job, s.placements)
        if chosen is not None and chosen != rank:
            mismatches += 1  # the subrequest named a class the device's model does not belong to
        if rank is None:
            violations += 1
            ranks["violation"] += 1
        else:
            ranks[str(rank + 1)] += 1
        for p in s.placements:
            if len(p.devices) > 1:
                multi_gpu_pods += 1
                nvl_local += nvlink_local(inv, p)
        if len(s.placements) > 1:
            multi_node += 1
            aligned += rail_aligned(inv, s.placements)
    stranded_while_waiting = [s for s in snaps if s.waiting]
    return {
        "jobs": len(states), "placed": len(placed), "unplaced": len(states) - len(placed),
        "window_s": [t0, t1],
        "utilisation": time_average(snaps, "used", t0, t1) / cap,
        "stranded_gpus": time_average(snaps, "stranded", t0, t1),
        "stranded_gpu_hours": time_average(snaps, "stranded", t0, t1) * (t1 - t0) / 3600,
        "stranded_gpus_cpu": time_average(snaps, "stranded_cpu", t0, t1),
        "stranded_gpus_memory": time_average(snaps, "stranded_memory", t0, t1),
        "cpu_only_pods_on_gpu_nodes": time_average(snaps, "cpu_only_on_gpu_nodes", t0, t1),
        "cpu_only_jobs": sum(1 for s in states if not s.job.gpus),
        "servers_8_free": time_average(snaps, "whole_free", t0, t1),
        "stranded_share_while_waiting": (statistics.fmean(s.stranded / cap for s in stranded_while_waiting)
                                         if stranded_while_waiting else 0.0),
        "fgd_fragmentation": time_average(snaps, "fgd", t0, t1) / cap,
        "goodput": time_average(snaps, "goodput", t0, t1) / cap,
        "wait_mean_s_all": wait_mean_all(states, clock.now),
        "waiting_at_end": sum(1 for s in states if s.submitted and s.start is None),
        "wait_p50_s": {k: percentile(v, 50) for k, v in sorted(waits.items(), key=lambda kv: int(kv[0]))},
        "wait_p95_s": {k: percentile(v, 95) for k, v in sorted(waits.items(), key=lambda kv: int(kv[0]))},
        "wait_p95_s_all": waits_all_p95(states, clock.now),
        "choice": dict(sorted(ranks.items())),
        "type_violations": violations,
        "subrequest_mismatches": mismatches,
        "nvlink_locality": nvl_local / multi_gpu_pods if multi_gpu_pods else 1.0,
        "rail_alignment": aligned / multi_node if multi_node else math.nan,
        "multi_node_jobs": multi_node,
    }


def waits_all_p95(states: Sequence[JobState], end: float) -> dict[str, float]:
    """Per job size, the p95 wait of every job that arrived, one still waiting counted up to ``end`` (a job
    that never started would not show in ``wait_p95_s``)."""
    waits: dict[str, list[float]] = {}
    for s in states:
        if s.start is not None or s.submitted:
            w = (s.start if s.start is not None else max(end, s.job.arrival)) - s.job.arrival
            waits.setdefault(str(s.job.gpus), []).append(w)
    return {k: percentile(v, 95) for k, v in sorted(waits.items(), key=lambda kv: int(kv[0]))}


def wait_mean_all(states: Sequence[JobState], end: float) -> float:
    """Mean wait of every GPU job that arrived, a job still waiting counted up to ``end`` (the replay's last
    step): the percentiles above see placed jobs only, so a policy that leaves more jobs waiting would look
    better there."""
    waits = [(s.start if s.start is not None else max(end, s.job.arrival)) - s.job.arrival
             for s in states if s.job.gpus and (s.submitted or s.start is not None)]
    return statistics.fmean(waits) if waits else 0.0


# --------------------------------------------------------------------------- statistics over seeds

# Two-sided 95% Student t quantiles by degrees of freedom (n - 1).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t95(df: int) -> float:
    if df < 1:
        return math.nan
    keys = sorted(_T95)
    return _T95[max(k for k in keys if k <= df)] if df < 30 else 1.96


def interval(values: Sequence[float]) -> dict[str, float]:
    """Mean and 95% confidence interval (Student t) of per-seed values, NaNs dropped."""
    xs = [v for v in values if not math.isnan(v)]
    if not xs:
        return {"mean": math.nan, "lo": math.nan, "hi": math.nan, "n": 0}
    m = statistics.fmean(xs)
    half = t95(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan
    return {"mean": m, "lo": m - half, "hi": m + half, "n": len(xs)}


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Nested numeric metrics -> {"wait_p95_s.8": ...} for aggregation."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


def aggregate(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Per metric, the interval over runs (seeds)."""
    flat = [flatten(r) for r in runs]
    keys = sorted({k for f in flat for k in f})
    return {k: interval([f.get(k, math.nan) for f in flat]) for k in keys}
