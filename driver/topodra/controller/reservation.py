"""Which waiting jobs hold a reservation, on which nodes, until when (pure; issue 33).

A job is one ClaimProfile's waiting work: a multi-node profile's gang (its pods not yet bound), or a
whole-server profile's oldest pending pod. The operator side (``controller/reserve.py``) reads the cluster,
builds a ``Job`` per profile whose reservation is on (the nodes that could run it, each with its free devices of
the job's class and the running pods holding the others), calls ``plan`` with ``now`` and writes the result as
DeviceTaintRules (``topodra.reservations``) and ``status.reservation``.

The rules, in order (Slurm-like: the job's reservation sits at its earliest start):

* waiting: pods of the job exist and are pending; waiting since the oldest pending pod's creationTimestamp.
* eligible: waited at least ``after_s``, and not cooling down: a hold of this same wait that ran out
  (``expired_at``) makes the job wait ``cooldown_s`` before it may reserve again (the nodes it held go back to
  everyone meanwhile, and the next hold is planned from the cluster as it is then).
* a hold lasts while the job waits, until ``max_hold_s`` after it was made, and, when its expected start is
  known, until ``grace_s`` after that start (the pods it waited for ended or were killed at their deadline, so
  the job should have bound; something else keeps it, and holding longer only idles GPUs). It is released when
  the job binds (no pending pod left), when its profile is gone (no Job: nothing is kept), or when one of those
  times passes. A kept hold whose nodes can no longer hold the job (a node gone) is dropped and planned again.
  The expected start a hold keeps is the earliest it was ever given (``Existing.expected_start``, recomputed
  each pass): deadlines only move ends earlier.
* at most ``max_reservations`` holds at once; existing holds first, then the oldest eligible jobs.
* the domain (the job's fabric level; a whole-server job: each node is its own domain) where the job can start
  soonest, narrower first: when the profile lists narrower levels before the one its gang got (``sameDomain``,
  e.g. leafGroup before scalableUnit), the soonest domain of the narrowest such level is taken if it starts at
  most ``narrower_within_s`` after the soonest domain of the job's own level, else the next level, else the
  job's own. A narrow-only hold must wait until a whole narrow domain drains (measured: hours for a 64-GPU job
  whose leaf has 8-10 servers, issue 33 session 11); a hold across the gang's own level starts it on the nodes
  that drain soonest and costs only a spine hop. Ranked within a level by: the earliest expected start
  (unknown counts as never), then the fewest running pods to wait for, then the most free GPUs on the nodes it
  takes, then the name. Inside a domain, the job's pods go on the slots that free soonest (a node's k-th slot
  frees when the pods it waits for there end, in deadline order), so only the nodes that drain soonest are
  reserved (the rest of the domain stays usable: fewer GPUs held idle).
* expected start: when the last pod waited for ends, if every one of them declares ``activeDeadlineSeconds``
  (``startTime`` + deadline); ``now`` when none must end; else unknown (None).
* one hint (effect None): the domain the oldest waiting job without a hold would get now.
* planning past earlier holds (Slurm's backfill reserves each job at its earliest start given the reservations
  of the jobs before it): a node held for a job planned earlier in the pass is never held again, but when that
  job's runtime bound is known (``Job.runtime_s``: every pending pod declares ``activeDeadlineSeconds``) and so is
  its expected start, a later job counts the node as freeing at that start + runtime (its devices kept by the hold,
  ``NodeState.reserved``, with the node's own). The later job holds only the other nodes it needs (``Place.nodes``;
  the ones it counts on are ``Place.after``), from now, so small pods do not settle there while the earlier job
  runs. Without a known runtime the earlier job's nodes are out of the later job's plan, as before: a job whose
  model's servers are all held or too few besides (issue 33 session 13: a 64-GPU job of the one model with 10
  servers behind a 32-GPU job's hold of 4) got no hold, and 1- and 2-GPU pods of 4-6 hours settled on the servers
  it needed meanwhile.

Capacity, how many of the job's pods a set of devices holds (Required placement, one node), is the caller's
``capacity`` function: the operator passes ``gang.pods_on_node`` (the fleet model's view), tests a count.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

HELD: Final = "Held"
HINT: Final = "Hint"
EXPIRED: Final = "Expired"
State = Literal["Held", "Hint"]

Capacity = Callable[[Sequence[Any]], int]


@dataclass(frozen=True)
class RunningPod:
    """A running pod holding some of the job's kind of devices on one node."""

    name: str  # namespace/name
    devices: tuple[Any, ...]  # the devices of the job's class it holds there
    end: float | None  # startTime + activeDeadlineSeconds (epoch seconds); None: no deadline declared


@dataclass(frozen=True)
class NodeState:
    """One node the job could run on (schedulable, publishing devices of the job's class)."""

    name: str
    domain: str | None  # the node's value of the job's level key; None: in no domain of that level
    free: tuple[Any, ...]  # free devices of the job's class: unallocated, no blocking taint but the job's own
    running: tuple[RunningPod, ...] = ()
    narrower: tuple[str | None, ...] = ()  # its values of the narrower levels the job prefers, narrowest first
    reserved: tuple[Any, ...] = ()  # devices of the job's class free but kept by another job's hold (not in free)


@dataclass(frozen=True)
class Existing:
    """The reservation the job has now (read back from its DeviceTaintRules)."""

    state: State
    nodes: tuple[str, ...]
    domain: str
    since: float
    expected_start: float | None = None  # the earliest expected start the hold was given (None: unknown)
    narrowed: int | None = None  # the narrower level it holds (Place.narrowed)


@dataclass(frozen=True)
class Job:
    namespace: str
    name: str
    uid: str
    pods: int  # pods still to place (0: the job is not waiting)
    waiting_since: float | None  # None: not waiting
    after_s: float
    max_hold_s: float
    nodes: tuple[NodeState, ...]
    capacity: Capacity = field(compare=False)
    existing: Existing | None = None
    expired_at: float | None = None  # when a hold of this wait ran out (status.reservation Expired, same wait)
    cooldown_s: float = 1800.0  # after an expired hold, how long the job waits before it may reserve again
    grace_s: float = 900.0  # a hold with a known expected start ends this long after it
    narrower_within_s: float = 1800.0  # a narrower level is taken if it starts at most this much later
    runtime_s: float | None = None  # how long its pods run at most once bound (activeDeadlineSeconds); None: unknown

    def __post_init__(self) -> None:
        if self.runtime_s is not None and not self.runtime_s > 0:
            raise ValueError(f"job {self.namespace}/{self.name}: a runtime bound must be positive "
                             f"(got {self.runtime_s})")
        if self.narrower_within_s < 0:
            raise ValueError(f"job {self.namespace}/{self.name}: narrowerWithin must not be negative "
                             f"(got {self.narrower_within_s})")
        if not self.uid:
            raise ValueError(f"job {self.namespace}/{self.name}: a reservation needs the profile's uid")
        if self.pods < 0 or self.after_s < 0 or self.max_hold_s <= 0 or self.cooldown_s < 0 or self.grace_s < 0:
            raise ValueError(f"job {self.namespace}/{self.name}: pods, afterWaiting, cool-down and grace must not be "
                             f"negative and maxHold must be positive (got {self.pods}, {self.after_s}, "
                             f"{self.cooldown_s}, {self.grace_s}, {self.max_hold_s})")

    @property
    def waiting(self) -> bool:
        return self.waiting_since is not None and self.pods > 0

    def cooling(self, now: float) -> bool:
        """Whether an expired hold of this wait is too recent for a new one."""
        return self.expired_at is not None and now - self.expired_at < self.cooldown_s


@dataclass(frozen=True)
class Place:
    """Where a job fits soonest in one domain: the nodes it takes and what it waits for there."""

    domain: str
    nodes: tuple[str, ...]
    waits: tuple[str, ...]  # running pods that must end first
    expected_start: float | None
    gpus_free: int  # free devices of the job's class on those nodes now (held idle while reserved)
    narrowed: int | None = None  # index of the narrower level taken (NodeState.narrower); None: the job's own
    after: tuple[str, ...] = ()  # nodes it counts on that an earlier job holds now (free at that job's end)


@dataclass(frozen=True)
class Reservation:
    namespace: str
    name: str
    uid: str
    state: State
    place: Place
    since: float
    waiting_since: float


@dataclass(frozen=True)
class Plan:
    reservations: tuple[Reservation, ...]
    expired: tuple[Job, ...]  # holds released this pass because max_hold_s or expected start + grace passed
    notes: dict[str, str]  # uid -> why the job holds nothing (shown in its status)

    def of(self, uid: str) -> Reservation | None:
        return next((r for r in self.reservations if r.uid == uid), None)


def _slots(node: NodeState, capacity: Capacity) -> list[tuple[int, float, int, tuple[str, ...]]]:
    """(pods waited for, when they end (inf: unknown), k, their names) of the k-th job pod this node can take.

    Running pods are waited for in the order they end: declared deadlines first, earliest first, then the
    undeclared ones holding the most devices. A slot's end is -inf when it is free now."""
    order = sorted(node.running, key=lambda p: (p.end is None, p.end or 0.0, -len(p.devices), p.name))
    out: list[tuple[int, float, int, tuple[str, ...]]] = []
    devices = list(node.free)
    end = -math.inf
    got = capacity(devices)
    for k in range(1, got + 1):
        out.append((0, end, k, ()))
    for i, pod in enumerate(order, start=1):
        devices.extend(pod.devices)
        end = max(end, pod.end if pod.end is not None else math.inf)
        now_got = capacity(devices)
        names = tuple(p.name for p in order[:i])
        for k in range(got + 1, now_got + 1):
            out.append((i, end, k, names))
        got = max(got, now_got)
    return out


def place_in(domain: str, nodes: Sequence[NodeState], pods: int, capacity: Capacity, now: float,
             later: Mapping[str, float] | None = None) -> Place | None:
    """The nodes of one domain that take ``pods`` job pods soonest, or None when the domain cannot hold them.

    Slots are taken in the order they free (end first; among unknown ends, fewest pods to wait for), so the job's
    N-th pod starts as early as the domain allows and only the nodes that drain soonest are reserved. A node in
    ``later`` (held for an earlier job that ends then) offers its free and reserved devices from that time on, and
    is counted on (``Place.after``), never held."""
    later = later or {}
    slots = []
    for node in nodes:
        at = later.get(node.name)
        if at is None:
            slots += [(w, end, node.name, k, names) for (w, end, k, names) in _slots(node, capacity)]
        else:
            pooled = replace(node, free=(*node.free, *node.reserved))
            slots += [(w, max(end, at), node.name, k, names) for (w, end, k, names) in _slots(pooled, capacity)]
    if len(slots) < pods:
        return None
    slots.sort(key=lambda s: (s[1], s[0], s[2], s[3]))
    taken = slots[:pods]
    per_node: dict[str, tuple[str, ...]] = {}
    ends: list[float] = []
    for _w, end, name, _k, names in taken:
        if len(names) >= len(per_node.get(name, ())):
            per_node[name] = names
        if end > -math.inf:  # a slot free now ends at -inf; any other waits for pods or an earlier job
            ends.append(end)
    chosen = tuple(sorted(n for n in per_node if n not in later))
    after = tuple(sorted(n for n in per_node if n in later))
    waits = tuple(sorted({n for names in per_node.values() for n in names}))
    last = max(ends, default=now)
    expected = None if math.isinf(last) else max(last, now)
    free = sum(len(n.free) for n in nodes if n.name in chosen)
    return Place(domain, chosen, waits, expected, free, after=after)


def _rank(p: Place) -> tuple[float, int, int, str]:
    """Earliest expected start (unknown: never), then fewest pods to wait for, most free GPUs, name."""
    return (p.expected_start if p.expected_start is not None else math.inf, len(p.waits), -p.gpus_free, p.domain)


def hold_ends(ex: Existing, expected_start: float | None, max_hold_s: float, grace_s: float) -> float:
    """When a hold made at ``ex.since`` runs out: maxHold after it, or ``grace_s`` after its expected start."""
    end = ex.since + max_hold_s
    return end if expected_start is None else min(end, expected_start + grace_s)


def _earliest(a: float | None, b: float | None) -> float | None:
    known = [t for t in (a, b) if t is not None]
    return min(known) if known else None


def _domain_of(n: NodeState, level: int | None) -> str | None:
    return n.domain if level is None else (n.narrower[level] if level < len(n.narrower) else None)


def _best(job: Job, now: float, excluded: frozenset[str], level: int | None,
          later: Mapping[str, float]) -> Place | None:
    """The soonest place in one level's domains (``level``: index into ``NodeState.narrower``; None: own)."""
    by_domain: dict[str, list[NodeState]] = defaultdict(list)
    for n in job.nodes:
        if n.name in excluded:
            continue
        d = _domain_of(n, level)
        if d is not None:
            by_domain[d].append(n)
    places = [p for d, nodes in by_domain.items()
              if (p := place_in(d, nodes, job.pods, job.capacity, now, later)) and p.nodes]
    best = min(places, key=_rank, default=None)
    return best if best is None or level is None else replace(best, narrowed=level)


def choose_place(job: Job, now: float, excluded: frozenset[str] = frozenset(),
                 later: Mapping[str, float] | None = None) -> Place | None:
    """The domain that holds the job soonest, and the nodes it needs there (None: no domain can); a narrower
    level's domain when it starts at most ``job.narrower_within_s`` later (see the module). ``later``: nodes held
    for earlier jobs whose end is known, and that end (counted on, never held; a place made only of them is none:
    there would be nothing to hold; disjoint from ``excluded``)."""
    later = later or {}
    own = _best(job, now, excluded, None, later)
    depth = max((len(n.narrower) for n in job.nodes), default=0)
    limit = math.inf if own is None or own.expected_start is None else own.expected_start + job.narrower_within_s
    for level in range(depth):
        narrow = _best(job, now, excluded, level, later)
        if narrow is None:
            continue
        start = math.inf if narrow.expected_start is None else narrow.expected_start
        if start <= limit:
            return narrow
    return own


def plan(jobs: Sequence[Job], now: float, max_reservations: int) -> Plan:
    """Holds to keep, holds to make and the hint, from every job whose reservation is on (see the module)."""
    if max_reservations < 0:
        raise ValueError(f"max_reservations must not be negative (got {max_reservations})")
    uids = [j.uid for j in jobs]
    if len(set(uids)) != len(uids):
        raise ValueError("two jobs share a uid")
    notes: dict[str, str] = {}
    expired: list[Job] = []
    kept: list[Reservation] = []
    # Nodes held for a job planned earlier in this pass: its end unknown (excluded) or known (later, -> that end).
    # Disjoint: each node is held for one job.
    excluded: set[str] = set()
    later: dict[str, float] = {}

    def hold(r: Reservation, job: Job) -> None:
        start = r.place.expected_start
        for n in r.place.nodes:
            if job.runtime_s is None or start is None:
                excluded.add(n)
            else:
                later[n] = start + job.runtime_s
    oldest = sorted(jobs, key=lambda j: (j.waiting_since if j.waiting_since is not None else math.inf,
                                         j.namespace, j.name))
    for job in oldest:
        ex = job.existing
        if ex is None or ex.state != HELD or not job.waiting or job.waiting_since is None:
            continue
        mine = [n for n in job.nodes if n.name in ex.nodes
                or (n.name in later and _domain_of(n, ex.narrowed) == ex.domain)]
        place = place_in(ex.domain, mine, job.pods, job.capacity, now, later)
        start = _earliest(ex.expected_start, place.expected_start if place is not None else None)
        if now >= hold_ends(ex, start, job.max_hold_s, job.grace_s):
            expired.append(job)
            capped = start is None or ex.since + job.max_hold_s <= start + job.grace_s
            why = f"maxHold {int(job.max_hold_s)}s" if capped else f"{int(job.grace_s)}s past its expected start"
            notes[job.uid] = f"released after holding {int(now - ex.since)}s ({why})"
            continue
        if len(kept) >= max_reservations:
            notes[job.uid] = f"released: at most {max_reservations} reservation(s) hold at once"
            continue
        if place is None or not place.nodes:
            notes[job.uid] = "released: the reserved nodes can no longer hold the job; planning again"
            continue
        place = Place(place.domain, place.nodes, place.waits, start, place.gpus_free, ex.narrowed, place.after)
        kept.append(Reservation(job.namespace, job.name, job.uid, HELD, place, ex.since, job.waiting_since))
        hold(kept[-1], job)
    gone = {j.uid for j in expired}
    made: list[Reservation] = []
    for job in oldest:
        if not job.waiting or job.waiting_since is None or any(r.uid == job.uid for r in kept):
            continue
        if job.uid in gone:
            continue
        if job.cooling(now):
            assert job.expired_at is not None
            left = int(job.expired_at + job.cooldown_s - now)
            notes[job.uid] = f"its reservation ran out; may reserve again in {left}s (cool-down {int(job.cooldown_s)}s)"
            continue
        waited = now - job.waiting_since
        if waited < job.after_s:
            notes[job.uid] = f"waiting {int(waited)}s of {int(job.after_s)}s before it may reserve"
            continue
        if len(kept) + len(made) >= max_reservations:
            notes[job.uid] = f"eligible, but {max_reservations} reservation(s) already hold (oldest first)"
            continue
        place = choose_place(job, now, frozenset(excluded), later)
        if place is None:
            notes[job.uid] = ("eligible, but no domain can hold the whole job even when its running pods end"
                              + (" and the holds of jobs before it with a known runtime end" if later else ""))
            continue
        made.append(Reservation(job.namespace, job.name, job.uid, HELD, place, now, job.waiting_since))
        hold(made[-1], job)
    holding = {r.uid for r in (*kept, *made)}
    hint: list[Reservation] = []
    for job in oldest:
        if (not job.waiting or job.waiting_since is None or job.uid in holding or job.cooling(now)
                or job.uid in gone):
            continue
        place = choose_place(job, now, frozenset(excluded), later)
        if place is None:
            continue
        ex = job.existing
        since = ex.since if ex is not None and ex.state == HINT and ex.nodes == place.nodes else now
        hint.append(Reservation(job.namespace, job.name, job.uid, HINT, place, since, job.waiting_since))
        break
    return Plan(tuple([*kept, *made, *hint]), tuple(expired), notes)
