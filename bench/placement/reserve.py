"""Policy (g) of ``bench/run placement --multinode``: (f) plus reservations for waiting big jobs (issue 33). Pure.

The benchmark plays topodra's controller for reservations, with the controller's own parts: at every step of the
virtual clock, once the scheduler went idle and the bound pods were read, it builds the pure planner's ``Job``
(``topodra.controller.reservation``) for each waiting job that reserves, calls ``reservation.plan`` with the
virtual ``now``, and writes the plan as DeviceTaintRules rendered by ``topodra.controller.reserve.wanted_rules``
(labels and taint of ``topodra.reservations``). The jobs' claims carry ``reservations.toleration(uid)`` from the
start (``topodra.controller.render.with_tolerations``, as the controller renders a reserving profile's template).
Nothing here decides where to reserve: one planner, the controller's.

Which jobs reserve: multi-node jobs (a gang; domain = the scalable unit, the level of its PodGroup's topology
constraint, with the leaf group, ``topodra.io/leaf-group``, the level the (f) scorer steers a gang into, as the
narrower level it prefers: a leaf is held when it starts the job at most ``Settings.narrower_within_s`` later
than the unit's soonest nodes, as the controller does for ``sameDomain: [leafGroup, scalableUnit]``; session 10
held leaves only, which ``--reserve-narrower-within inf`` repeats except where no leaf can hold the job) and
8-GPU whole-server jobs (domain = the node). Each gets a per-job uid
(``job_uid``: a UUID from the replay's run id and the job id), the taint value and the toleration's.

What the planner is told, from the benchmark's own view:

* waiting since: the job's arrival (virtual seconds), as the controller takes the oldest pending pod's creation;
* free devices per node: GPUs of a model the job lists, not allocated, and not on a node another job holds
  (those are ``reserved``: the planner counts them free once that job ends, when its runtime is known);
* its runtime bound: its true duration under ``Settings.deadlines == "true"`` (the same best case as the running
  pods' ends: as if the gang's pods declared ``activeDeadlineSeconds``), else unknown;
* running pods per node: every bound pod with its GPUs, ending at its job's **true virtual end** when
  ``Settings.deadlines`` is ``"true"`` (the default: as if every pod declared ``activeDeadlineSeconds`` equal to its
  real duration, a best case, since users' deadlines are upper bounds) or with no end (``"none"``: the planner then
  ranks by pods to wait for and free GPUs, and has no expected start);
* existing holds: what the previous step's plan wrote, with its virtual ``since`` and expected start (the
  controller reads its rules' creationTimestamp and expected-start annotation);
* expired: when a job's hold ran out (``max_hold_s``, or ``grace_s`` past its expected start); the planner lets
  it reserve again after ``cooldown_s``.

Backfill (``Settings.backfill``, on by default): every job that does not reserve (1-4 GPUs) is a backfill job.
Its claim carries ``reservations.backfill_tolerations(duration)`` (its true duration is its runtime bound, as
the planner is told true ends) and its pod ``activeDeadlineSeconds`` = the duration rounded up; a job longer
than the largest window gets neither. The rules include each held node's backfill window
(``reserve.wanted_rules``), with ``window_margin_s`` = the step length (``--tick``): the rules are rewritten once
per step, and a pod binds at the latest one step after a window was written. With ``deadlines == "none"`` every
window is closed (no expected start), so nothing backfills.

Metrics (``Reserver.metrics``, over the arrival window like the others):

* ``reservation_idle_gpu_hours``: GPU-hours of held nodes' GPUs that were free while held (the cost);
* ``reservations_made`` / ``reservations_expired``: holds made (a job's hold moved to other nodes counts again)
  and holds that ran out (maxHold or expected start + grace);
* ``backfilled_gpu_hours``: GPU-hours of backfill jobs' pods on held nodes (bound after the hold was made);
* ``wait64_before_hold_s`` / ``wait64_held_s`` / ``jobs64_never_held``: of the 64-GPU jobs, the mean time from
  arrival to their first hold and from it to their start, and how many never held (they started without one);
* ``reservations_leaked``: the benchmark's DeviceTaintRules still in the API when the replay ended whose job is
  not waiting any more (counted by the runner before it deletes them; ``leaked``);
* adversarial stream (one 64-GPU job, ``gang.adversarial_jobs``): ``big_job_wait_s`` (NaN: never started),
  ``big_job_started``, ``big_job_started_in_window`` (before the last arrival), and under (g) ``big_job_bound_s``,
  the issue's bound: 2 x ``after_s`` + the longest remaining time of the pods its first hold waited for.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.placement import model as pm

from topodra.controller import reservation as rsv
from topodra.controller.render import with_backfill, with_tolerations
from topodra.controller.reserve import rule_uid, wanted_rules
from topodra.reservations import HOLD_EFFECT, PROFILE_NS_LABEL, WINDOW_LADDER

RESERVING_POLICIES = frozenset({"g"})
_UID_NAMESPACE = uuid.UUID("8f0e4c52-3b9a-4c43-9a57-33a7c3d5e0a1")  # fixed: the same run and job give one uid
DEADLINES = ("true", "none")
BIG_GPUS = 64


@dataclass(frozen=True)
class Settings:
    """The reservation parameters of (g); the defaults are ``topodra controller``'s (``ControllerConfig``)."""

    after_s: float = 900.0  # afterWaiting, virtual seconds
    max_hold_s: float = 86400.0  # maxHold
    max_reservations: int = 2
    deadlines: str = "true"  # "true": running pods end at their true virtual end; "none": no deadline
    grace_s: float = 900.0  # a hold ends this long after its expected start
    cooldown_s: float = 1800.0  # after an expired hold, before the same wait may reserve again
    backfill: bool = True  # small jobs tolerate held devices whose window fits their duration
    window_margin_s: float = 900.0  # the step length: how late a window can be rewritten
    whole_server: bool = False  # 8-GPU whole-server jobs reserve too (else they backfill like smaller ones)
    narrower_within_s: float = 1800.0  # a leaf is held if it starts at most this much later than the unit
    min_gpus: int = 16  # multi-node jobs of at least this many GPUs reserve (their profiles carry reservation)

    def __post_init__(self) -> None:
        if (self.after_s < 0 or self.max_hold_s <= 0 or self.max_reservations < 0 or self.grace_s < 0
                or self.cooldown_s < 0 or self.window_margin_s < 0 or self.narrower_within_s < 0):
            raise ValueError(f"reservation settings: afterWaiting must not be negative, maxHold must be positive and "
                             f"max reservations not negative (got {self.after_s}, {self.max_hold_s}, "
                             f"{self.max_reservations})")
        if self.deadlines not in DEADLINES:
            raise ValueError(f"reservation deadlines must be one of {DEADLINES}, got {self.deadlines!r}")


def reserves(job: pm.Job, settings: Settings | None = None) -> bool:
    """Multi-node jobs of at least ``settings.min_gpus`` reserve; 8-GPU whole-server jobs too when
    ``settings.whole_server`` (else they backfill); smaller ones never do (nor do they backfill: a gang has no
    runtime bound in this stream)."""
    s = settings or Settings()
    return (job.pods > 1 and job.gpus >= s.min_gpus) or (s.whole_server and job.gpus == 8)


def backfills(job: pm.Job, settings: Settings) -> bool:
    """A backfill job: one pod that does not reserve, uses GPUs, and fits the largest window (a gang never
    backfills: its pods would all need the window)."""
    return (settings.backfill and job.gpus > 0 and job.pods == 1 and not reserves(job, settings)
            and job.duration <= WINDOW_LADDER[-1][1])


def deadline_s(job: pm.Job) -> int:
    """A backfill pod's ``activeDeadlineSeconds``: its true duration, rounded up."""
    return max(1, math.ceil(job.duration))


def backfilling(spec: dict[str, Any], job: pm.Job) -> dict[str, Any]:
    """A claim spec whose every request tolerates held devices whose backfill window fits ``job``'s duration."""
    devices = dict(spec["devices"])
    devices["requests"] = with_backfill(list(devices["requests"]), deadline_s(job))
    return {**spec, "devices": devices}


def job_uid(run: str, job_id: int) -> str:
    """The job's reservation uid (taint value, 36 characters like a profile's metadata.uid)."""
    return str(uuid.uuid5(_UID_NAMESPACE, f"{run}/{job_id}"))


def tolerating(spec: dict[str, Any], uid: str) -> dict[str, Any]:
    """A claim spec whose every request and subrequest tolerates the job's reservation (the controller's rendering)."""
    devices = dict(spec["devices"])
    devices["requests"] = with_tolerations(list(devices["requests"]), uid)
    return {**spec, "devices": devices}


def _capacity(per_pod: int) -> rsv.Capacity:
    def capacity(devices: Sequence[Any]) -> int:
        return len(devices) // per_pod  # one model per node, one NVLink domain per DGX: count only
    return capacity


def planner_job(job: pm.Job, run: str, ns: str, inv: pm.NodeCapacity, fabric: Mapping[str, Mapping[str, str]],
                used: set[tuple[str, str]], pods_on: Mapping[str, Sequence[tuple[str, tuple[str, ...], float | None]]],
                held_by: Mapping[str, str], settings: Settings, existing: rsv.Existing | None,
                expired_at: float | None) -> rsv.Job:
    """The planner's view of one waiting job (module docstring). ``pods_on``: node -> (pod, its GPUs there, its
    end); ``held_by``: node -> the uid holding it now."""
    uid = job_uid(run, job.id)
    models = pm.listed_models(job, inv)
    per_node = inv.per_node()
    nodes: list[rsv.NodeState] = []
    for node in inv.nodes:
        gpus = per_node.get(node, [])
        if not gpus or gpus[0].model not in models:
            continue
        holder = held_by.get(node)
        unused = tuple(sorted(g.name for g in gpus if (node, g.name) not in used))
        free, reserved = ((), unused) if holder not in (None, uid) else (unused, ())
        where = fabric.get(node, {})
        domain = node if job.pods == 1 else (where.get("su") or None)
        narrower = () if job.pods == 1 else (where.get("leaf") or None,)
        running = tuple(rsv.RunningPod(name, devs, end) for name, devs, end in pods_on.get(node, ()))
        nodes.append(rsv.NodeState(node, domain, free, running, narrower, reserved))
    runtime = job.duration if settings.deadlines == "true" else None
    return rsv.Job(ns, f"j{job.id:05d}", uid, job.pods, job.arrival, settings.after_s, settings.max_hold_s,
                   tuple(nodes), _capacity(job.per_pod), existing, expired_at, settings.cooldown_s, settings.grace_s,
                   settings.narrower_within_s, runtime)


def pods_by_node(clock: pm.VirtualClock, placements: Mapping[str, pm.Placement], jobs_by_pod: Mapping[str, pm.Job],
                 deadlines: str) -> dict[str, list[tuple[str, tuple[str, ...], float | None]]]:
    """node -> (pod, its GPUs, when it ends) of every bound pod; the end is its job's virtual end under
    ``deadlines == "true"``, else None (no deadline declared)."""
    out: dict[str, list[tuple[str, tuple[str, ...], float | None]]] = {}
    for name, p in sorted(placements.items()):
        if not p.devices:
            continue
        job = jobs_by_pod.get(name)
        end = clock.states[job.id].end if job is not None and deadlines == "true" else None
        out.setdefault(p.node, []).append((name, p.devices, end))
    return out


def leaked(rules: Iterable[Mapping[str, Any]], ns: str, waiting_uids: set[str]) -> int:
    """Rules of this replay (``ns``) still in the API whose job is not waiting: a reservation outliving its job."""
    return sum(1 for r in rules
               if ((r.get("metadata") or {}).get("labels") or {}).get(PROFILE_NS_LABEL) == ns
               and rule_uid(dict(r)) not in waiting_uids)


@dataclass
class Reserver:
    """The benchmark's reservation controller for one replay: plans, the rules it wants, and the metrics."""

    settings: Settings
    run: str
    ns: str
    inv: pm.NodeCapacity
    fabric: Mapping[str, Mapping[str, str]]
    driver: str = pm.DRIVER
    existing: dict[str, rsv.Existing] = field(default_factory=dict)
    expired: dict[str, float] = field(default_factory=dict)  # uid -> when its last hold ran out
    made: int = 0
    expired_count: int = 0
    series: list[tuple[float, int]] = field(default_factory=list)  # (t, held GPUs free)
    backfill_series: list[tuple[float, int]] = field(default_factory=list)  # (t, held GPUs used by backfill)
    first_hold: dict[int, tuple[float, float]] = field(default_factory=dict)  # job id -> (since, longest remaining)
    rules_leaked: int = 0
    # job id -> [virtual t, what the planner said] each time it changed: a hold or hint (nodes, domain, expected
    # start) or the plan's note (why no hold). For diagnosis (the run's ``holds``); not a metric.
    timeline: dict[int, list[list[Any]]] = field(default_factory=dict)

    def step(self, clock: pm.VirtualClock, placements: Mapping[str, pm.Placement], used: set[tuple[str, str]],
             jobs_by_pod: Mapping[str, pm.Job]) -> tuple[rsv.Plan, dict[str, dict[str, Any]]]:
        """Plan at ``clock.now``; returns the plan and the rules it wants (name -> DeviceTaintRule)."""
        now = clock.now
        pods_on = pods_by_node(clock, placements, jobs_by_pod, self.settings.deadlines)
        held_by = {n: uid for uid, ex in self.existing.items() if ex.state == rsv.HELD for n in ex.nodes}
        waiting = [j for j in clock.waiting() if reserves(j, self.settings)]
        jobs = [planner_job(j, self.run, self.ns, self.inv, self.fabric, used, pods_on, held_by, self.settings,
                            self.existing.get(job_uid(self.run, j.id)), self.expired.get(job_uid(self.run, j.id)))
                for j in waiting]
        result = rsv.plan(jobs, now, self.settings.max_reservations)
        by_uid = {job_uid(self.run, j.id): j for j in waiting}
        ends = {name: end for plist in pods_on.values() for name, _d, end in plist}
        for r in result.reservations:
            if r.state != rsv.HELD:
                continue
            old = self.existing.get(r.uid)
            if old is None or old.state != rsv.HELD or old.nodes != r.place.nodes:
                self.made += 1
            job = by_uid[r.uid]
            if job.id not in self.first_hold:
                rest = [(e - now) for w in r.place.waits if (e := ends.get(w)) is not None]
                unknown = any(ends.get(w) is None for w in r.place.waits)
                self.first_hold[job.id] = (now, math.inf if unknown else max(rest, default=0.0))
        self._record(now, waiting, result)
        self.expired.update({j.uid: now for j in result.expired})
        self.expired_count += len(result.expired)
        self.existing = {r.uid: rsv.Existing(r.state, r.place.nodes, r.place.domain, r.since, r.place.expected_start,
                                             r.place.narrowed)
                         for r in result.reservations}
        return result, wanted_rules(result, self.driver, now, self.settings.window_margin_s)

    def _record(self, now: float, waiting: Sequence[pm.Job], result: rsv.Plan) -> None:
        by_uid = {r.uid: r for r in result.reservations}
        for job in waiting:
            uid = job_uid(self.run, job.id)
            r = by_uid.get(uid)
            if r is not None:
                start = r.place.expected_start
                said = (f"{r.state} {len(r.place.nodes)} nodes in {r.place.domain}"
                        f"{' (narrowed)' if r.place.narrowed is not None else ''}"
                        f"{f' and counts on {len(r.place.after)} held for earlier jobs' if r.place.after else ''}"
                        f", expected start "
                        f"{'unknown' if start is None else round(start)}")
            else:
                said = result.notes.get(uid, "no hold, no note")
            seen = self.timeline.setdefault(job.id, [])
            if not seen or seen[-1][1] != said:
                seen.append([round(now), said])

    def held_nodes(self) -> set[str]:
        return {n for ex in self.existing.values() if ex.state == rsv.HELD for n in ex.nodes}

    def observe(self, t: float, used: set[tuple[str, str]], clock: pm.VirtualClock | None = None,
                placements: Mapping[str, pm.Placement] | None = None,
                jobs_by_pod: Mapping[str, pm.Job] | None = None) -> None:
        """GPUs free on held nodes now (held idle until the next step), and GPUs of backfill jobs on held nodes."""
        held = self.held_nodes()
        idle = sum(1 for (node, dev) in self.inv.gpus if node in held and (node, dev) not in used)
        self.series.append((t, idle))
        since = {n: ex.since for ex in self.existing.values() if ex.state == rsv.HELD for n in ex.nodes}
        filled = 0
        for name, p in (placements or {}).items():
            job = (jobs_by_pod or {}).get(name)
            if clock is None or job is None or p.node not in since or not backfills(job, self.settings):
                continue
            start = clock.states[job.id].start
            if start is not None and start > since[p.node]:  # bound after the step that made the hold
                filled += len(p.devices)
        self.backfill_series.append((t, filled))

    def metrics(self, clock: pm.VirtualClock) -> dict[str, Any]:
        states = list(clock.states.values())
        t0 = min(s.job.arrival for s in states)
        t1 = clock.last_arrival
        snaps = [_Idle(t, n) for t, n in self.series]
        idle = pm.time_average(snaps, "idle", t0, t1)  # type: ignore[arg-type]
        fills = [_Idle(t, n) for t, n in self.backfill_series]
        filled = pm.time_average(fills, "idle", t0, t1)  # type: ignore[arg-type]
        out: dict[str, Any] = {"reservation_idle_gpus": idle, "reservation_idle_gpu_hours": idle * (t1 - t0) / 3600,
                               "backfilled_gpu_hours": filled * (t1 - t0) / 3600 if self.backfill_series else 0.0,
                               "reservations_made": self.made, "reservations_expired": self.expired_count,
                               "reservations_leaked": self.rules_leaked}
        # Where the 64-GPU jobs' waits go: before their first hold (afterWaiting, no free slot, or no domain),
        # and from that hold to their start (the held nodes draining); means over the jobs that held.
        held64 = [(s, self.first_hold[s.job.id][0]) for s in states
                  if s.job.gpus == BIG_GPUS and s.job.id in self.first_hold and s.start is not None]
        out["wait64_before_hold_s"] = (sum(h - s.job.arrival for s, h in held64) / len(held64)) if held64 else math.nan
        out["wait64_held_s"] = (sum(max(0.0, (s.start or h) - h) for s, h in held64) / len(held64)
                                if held64 else math.nan)
        out["jobs64_never_held"] = sum(1 for s in states if s.job.gpus == BIG_GPUS and s.job.id not in self.first_hold)
        big = [s for s in states if s.job.gpus == BIG_GPUS]
        if len(big) == 1 and big[0].job.id in self.first_hold:
            _since, rest = self.first_hold[big[0].job.id]
            out["big_job_bound_s"] = 2 * self.settings.after_s + rest
        return out


def big_job_metrics(clock: pm.VirtualClock) -> dict[str, Any]:
    """The 64-GPU job of an adversarial stream (exactly one such job; else nothing): its wait, whether it started."""
    big = [s for s in clock.states.values() if s.job.gpus == BIG_GPUS]
    if len(big) != 1:
        return {}
    s = big[0]
    started = s.start is not None
    return {"big_job_wait_s": (s.start - s.job.arrival) if s.start is not None else math.nan,
            "big_job_started": int(started),
            "big_job_started_in_window": int(s.start is not None and s.start <= clock.last_arrival)}


def hold_rules(rules: Iterable[Mapping[str, Any]]) -> int:
    return sum(1 for r in rules if ((r.get("spec") or {}).get("taint") or {}).get("effect") == HOLD_EFFECT)


@dataclass(frozen=True)
class _Idle:
    t: float
    idle: int
