"""Multi-node jobs in ``bench/run placement``: policies (e) and (f), the fabric cluster, and the gang metrics. Pure.

Policies for jobs of more than 8 GPUs (``Job.pods`` pods of 8 GPUs, one per server):

* (c) today's rendering: every pod of the job has a required pod affinity to its siblings on
  ``topodra.io/scalable-unit``; no gang, so a first pod can bind and hold its server while the rest wait.
* (e) a PodGroup per job (``scheduling.k8s.io/v1beta1``, gang ``minCount`` = pods) with the topology
  constraint ``topodra.io/scalable-unit`` (TopologyAwareWorkloadScheduling; one key only in 1.37):
  all pods bind in one unit or none does.
* (f) (e) plus ``topodra placement-scorer``: inside the unit the scheduler tries, the scorer steers the
  gang into one leaf group that holds it (``placement.gang``), and ranks nodes by FGD.

Metrics added to a run (``GangTracker``), over the arrival window like the others:

* ``partial_gpu_hours``: GPU-hours held by the bound pods of jobs not all of whose pods are bound.
* ``unplaced``: jobs never placed (the run ends when nothing runs and nothing arrives: a deadlock).
* ``in_one_leaf`` / ``in_one_su``: multi-node jobs whose pods share one leaf group / one unit;
  ``leaf_possible``: of those, the jobs for which some leaf group had enough whole free servers of a
  listed type at the step they arrived (other jobs' devices counted as the scheduler left them, the job's
  own as free); ``in_leaf_when_possible``: the share of those placed in one leaf group.
* ``goodput_fabric``: goodput with the leaf/spine model: the busbw of ``model.job_busbw`` (NIC-bound across
  nodes), x ``SPINE_FACTOR`` when the pods span leaf groups of one unit (one spine hop, 8-11% per arXiv
  2307.12169), x ``SPINE_FACTOR``^2 across units (up to the spine tier and down again), then
  ``model.slowdown``'s formula. Assumed figures, stated here and in docs/placement.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.placement import model as pm

LEAF_LABEL = "topodra.io/leaf-group"
SPINE_LABEL = "topodra.io/spine-group"
GANG_POLICIES = frozenset({"e", "f", "g"})
PODGROUPS = "/apis/scheduling.k8s.io/v1beta1"
TOPOLOGY_KEY = pm.SU_LABEL
SPINE_FACTOR = 0.9
# Gang policies: a PodGroup that does not fit is retried every backoff period (1 s here) forever, so "idle"
# is "nothing scheduled for this long" (over two retry rounds), not "empty queues" (main.SchedulerState).
GANG_SETTLE = 2.5
# Synthetic multi-node stream (``--multinode``): sizes up to 64 GPUs (8 servers).
SIZES = ((1, 0.3), (2, 0.12), (4, 0.12), (8, 0.2), (16, 0.12), (32, 0.09), (64, 0.05))
PREFS = (("h200>h100>a100", 0.35), ("h200>h100", 0.25), ("mem80", 0.3), ("h200", 0.1))
# Adversarial stream (``--adversarial``, issue 33): a steady flow of 1- and 2-GPU jobs and one 64-GPU job.
ADVERSARIAL_SIZES = ((1, 0.6), (2, 0.4))
BIG_JOB_GPUS = 64
ADVERSARIAL_PREFS = (("h200>h100>a100", 0.4), ("h200>h100", 0.3), ("mem80", 0.3))  # all take an H100
BIG_JOB_PREFS = "h200>h100"
BIG_JOB_AT = 0.5  # it arrives with the small job at this fraction of the stream (the cluster full by then)


def features(policies: Iterable[str]) -> list[str]:
    """The harness features a matrix needs: the gang gates for (e) and (f)."""
    from testkit.cluster import TOPOLOGY_SCHEDULING, WORKLOAD_API

    return [WORKLOAD_API, TOPOLOGY_SCHEDULING] if GANG_POLICIES & set(policies) else []


def adversarial_jobs(spec: pm.SyntheticSpec, seed: int) -> list[pm.Job]:
    """``spec.jobs - 1`` small jobs (``ADVERSARIAL_SIZES``, ``ADVERSARIAL_PREFS``: every one accepts an H100;
    arrival rate for ``spec.load`` of them alone, burst included) and one 64-GPU job (``BIG_JOB_PREFS``, the
    median duration), arriving with the small job at ``BIG_JOB_AT`` of the stream; its id is the last. The big
    job's GPUs come on top of the load. Meant for ``bench/placement/fabric-adversarial.yaml``."""
    if spec.jobs < 2:
        raise pm.WorkloadError("an adversarial stream needs at least 2 jobs (small ones and the 64-GPU one)")
    small = pm.synthetic_jobs(dataclasses.replace(spec, jobs=spec.jobs - 1, sizes=ADVERSARIAL_SIZES,
                                                  prefs=ADVERSARIAL_PREFS), seed)
    at = small[int(BIG_JOB_AT * len(small))].arrival
    big = pm.Job(id=len(small), arrival=at, duration=spec.median_duration, gpus=BIG_JOB_GPUS, prefs=BIG_JOB_PREFS)
    return [*small, big]


def group_name(job: pm.Job) -> str:
    return f"j{job.id:05d}"


def podgroup_for(job: pm.Job, policy: str, run: str) -> dict[str, Any] | None:
    """The job's PodGroup under (e)/(f); None for single-pod jobs and the other policies."""
    if policy not in GANG_POLICIES or job.pods == 1:
        return None
    return {"apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup",
            "metadata": {"name": group_name(job), "labels": {pm.JOB_LABEL: str(job.id), pm.RUN_LABEL: run}},
            "spec": {"schedulingPolicy": {"gang": {"minCount": job.pods}},
                     "schedulingConstraints": {"topology": [{"key": TOPOLOGY_KEY}]}}}


def gang_pod(pod: dict[str, Any], job: pm.Job, policy: str) -> dict[str, Any]:
    """Under (e)/(f) a multi-pod job's pod joins its PodGroup instead of carrying pod affinity."""
    if policy in GANG_POLICIES and job.pods > 1:
        pod["spec"].pop("affinity", None)
        pod["spec"]["schedulingGroup"] = {"podGroupName": group_name(job)}
    return pod


def fabric_of(nodes: Iterable[Any]) -> dict[str, dict[str, str]]:
    """node -> {leaf, su} from the simulated nodes' labels (``SimNode.labels``)."""
    return {n.name: {"leaf": n.labels.get(LEAF_LABEL, ""), "su": n.labels.get(pm.SU_LABEL, "")} for n in nodes}


def fabric_busbw(inv: pm.NodeCapacity, fabric: Mapping[str, Mapping[str, str]],
                 placements: Sequence[pm.Placement]) -> float:
    """busbw of a multi-node job under the leaf/spine model (see the module docstring)."""
    models = [inv.gpus[(p.node, d)].model for p in placements for d in p.devices]
    intra = min(pm.intra_busbw(m) for m in models)
    if len({p.node for p in placements}) == 1:
        return intra
    bw = min([intra] + [len(p.devices) * inv.busbw_nic[p.node] * 0.9 for p in placements])
    sus = {fabric.get(p.node, {}).get("su", "") for p in placements}
    leaves = {fabric.get(p.node, {}).get("leaf", "") for p in placements}
    if len(sus) > 1:
        return bw * SPINE_FACTOR ** 2
    return bw * SPINE_FACTOR if len(leaves) > 1 else bw


def fabric_slowdown(job: pm.Job, inv: pm.NodeCapacity, fabric: Mapping[str, Mapping[str, str]],
                    placements: Sequence[pm.Placement]) -> float:
    if job.gpus <= 1:  # one GPU, or a CPU-only task (no devices): nothing to communicate
        return 1.0
    ideal = pm.ideal_busbw(job, inv, len(placements))
    return 1.0 + pm.COMM_SHARE * max(ideal / fabric_busbw(inv, fabric, placements) - 1.0, 0.0)


def leaf_could_hold(job: pm.Job, inv: pm.NodeCapacity, fabric: Mapping[str, Mapping[str, str]],
                    free: Mapping[str, int]) -> bool:
    """Some leaf group has ``job.pods`` nodes with ``job.per_pod`` free GPUs of a listed type."""
    models = pm.listed_models(job, inv)
    per_leaf: dict[str, int] = {}
    for node, n in free.items():
        if n >= job.per_pod and inv.node_model(node) in models:
            leaf = fabric.get(node, {}).get("leaf", "")
            per_leaf[leaf] = per_leaf.get(leaf, 0) + 1
    return any(c >= job.pods for leaf, c in per_leaf.items() if leaf)


@dataclass
class GangTracker:
    """Per-step observations of one replay that the base metrics do not make."""

    inv: pm.NodeCapacity
    fabric: Mapping[str, Mapping[str, str]]
    series: list[tuple[float, int, float]] = field(default_factory=list)  # (t, partial GPUs, goodput_fabric)
    leaf_possible: dict[int, bool] = field(default_factory=dict)  # multi-node job -> a leaf could hold it

    def observe(self, clock: pm.VirtualClock, arrived: Sequence[pm.Job],
                placements: Mapping[str, pm.Placement], used: set[tuple[str, str]]) -> None:
        partial = 0
        for job in clock.waiting():
            ps = [placements[n] for n in job.pod_names() if n in placements]
            partial += sum(len(p.devices) for p in ps)
        good = sum(s.job.gpus / fabric_slowdown(s.job, self.inv, self.fabric, s.placements)
                   for s in clock.running())
        self.series.append((clock.now, partial, good))
        for job in arrived:
            if job.pods > 1:
                own = {(p.node, d) for n in job.pod_names() if n in placements for p in [placements[n]]
                       for d in p.devices}
                free = pm.free_by_node(self.inv, used - own)
                self.leaf_possible[job.id] = leaf_could_hold(job, self.inv, self.fabric, free)

    def metrics(self, clock: pm.VirtualClock) -> dict[str, Any]:
        states = list(clock.states.values())
        t0 = min(s.job.arrival for s in states)
        t1 = clock.last_arrival
        snaps = [_Point(t, partial, good) for t, partial, good in self.series]
        partial_avg = pm.time_average(snaps, "partial", t0, t1)  # type: ignore[arg-type]
        multi = [s for s in states if s.job.pods > 1 and s.start is not None]
        leaf = [s for s in multi if len({self.fabric.get(p.node, {}).get("leaf") for p in s.placements}) == 1]
        su = [s for s in multi if len({self.fabric.get(p.node, {}).get("su") for p in s.placements}) == 1]
        possible = [s for s in multi if self.leaf_possible.get(s.job.id)]
        leaf_ids = {s.job.id for s in leaf}
        in_leaf_possible = [s for s in possible if s.job.id in leaf_ids]
        return {
            "partial_gpus": partial_avg,
            "partial_gpu_hours": partial_avg * (t1 - t0) / 3600,
            "goodput_fabric": pm.time_average(snaps, "good", t0, t1) / self.inv.total(),  # type: ignore[arg-type]
            "multi_node_placed": len(multi),
            "multi_node_unplaced": sum(1 for s in states if s.job.pods > 1 and s.start is None),
            "in_one_leaf": len(leaf) / len(multi) if multi else math.nan,
            "in_one_su": len(su) / len(multi) if multi else math.nan,
            "leaf_possible": len(possible),
            "in_leaf_when_possible": len(in_leaf_possible) / len(possible) if possible else math.nan,
            "wait_p95_s_1to8": pm.percentile([s.start - s.job.arrival for s in states
                                              if s.start is not None and 0 < s.job.gpus <= 8], 95),
        }


@dataclass(frozen=True)
class _Point:
    """A step value in the shape ``model.time_average`` reads (``t`` and named attributes)."""

    t: float
    partial: int
    good: float


TABLE_ROWS = [("utilisation", "GPU utilisation", 3), ("goodput", "goodput (model, rails)", 3),
              ("goodput_fabric", "goodput (leaf/spine model)", 3),
              ("partial_gpu_hours", "GPU-hours held by partial jobs", 0),
              ("unplaced", "jobs never placed", 1), ("multi_node_unplaced", "multi-node jobs never placed", 1),
              ("in_one_leaf", "multi-node jobs in one leaf group", 3), ("in_one_su", "multi-node jobs in one SU", 3),
              ("in_leaf_when_possible", "in one leaf when one could hold it", 3),
              ("stranded_gpus", "stranded GPUs (mean)", 1),
              ("wait_p95_s.8", "8-GPU wait p95 (s)", 0), ("wait_p95_s.16", "16-GPU wait p95 (s)", 0),
              ("wait_p95_s.32", "32-GPU wait p95 (s)", 0), ("wait_p95_s.64", "64-GPU wait p95 (s)", 0),
              ("wait_p95_s_1to8", "1-8 GPU wait p95 (s)", 0),
              ("type_violations", "type violations (jobs)", 1),
              ("reservation_idle_gpu_hours", "GPU-hours held idle by reservations", 0),
              ("backfilled_gpu_hours", "GPU-hours backfilled on held nodes", 0),
              ("reservations_made", "reservations made", 1), ("reservations_expired", "reservations expired", 1),
              ("reservations_leaked", "reservations_leaked", 1),
              ("wait64_before_hold_s", "64-GPU jobs: mean wait before their first hold (s)", 0),
              ("wait64_held_s", "64-GPU jobs: mean wait from that hold to their start (s)", 0),
              ("jobs64_never_held", "64-GPU jobs that started without a hold", 1),
              ("big_job_wait_s", "adversarial: 64-GPU job's wait (s)", 0),
              ("big_job_started_in_window", "adversarial: 64-GPU job started in the window", 2),
              ("big_job_bound_s", "adversarial: its bound, 2 x afterWaiting + longest remaining (s)", 0),
              ("scheduler_pods_per_s", "scheduler pods/s (attempt time)", 1),
              ("scorer_p99_ms", "prioritize p99 (ms)", 2), ("scorer_cpu_p99_ms", "prioritize CPU p99 (ms)", 2)]


def paired(runs: Sequence[Mapping[str, Any]], base: str, other: str,
           keys: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per metric, the 95% interval of ``other - base`` over the seeds both policies ran (paired by seed:
    the same stream), from a result file's ``runs``."""
    by = {(r["policy"], int(r["seed"])): pm.flatten(r["metrics"]) for r in runs}
    seeds = sorted({s for p, s in by if p == base} & {s for p, s in by if p == other})
    return {k: pm.interval([by[(other, s)].get(k, math.nan) - by[(base, s)].get(k, math.nan) for s in seeds])
            for k in keys}
