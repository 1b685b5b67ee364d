"""``Scorer.score`` for all candidates at once, computed per node *state* (``fleet.nodestates``), not per node.

The rule is ``placement.score``'s, unchanged; only where the work happens moves. At 2,048 nodes a call
touched every node several times (its view, its unavailable set, a ``HostFit``, a memo key); now:

* per node: one dict lookup (name -> state id) and one list lookup for its score;
* per (state, pod class, set of request classes): the rank and the fragments of every request class
  before and after the pod (capped by free CPU/memory when asked), cached across calls: they depend on
  neither the mix's weights nor its order, which change with every claim that arrives;
* per call: ``F = sum_m p_m * fragments_m`` once per distinct fragment vector (a few dozen), then the same
  min/max and rounding as ``Scorer.score`` over the distinct states.

The floating-point operations are ``Scorer.cost``'s, in the same order, so the scores are identical
(``tests/unit/placement/test_placement_bystate.py`` compares both on random states). Claims with CEL
selectors (a per-node device mask) and gangs take ``Scorer.score`` itself.

A pod with tolerations (issue 33) meets other unavailable devices on the few nodes carrying a taint it tolerates:
those nodes are scored as the state with the pod's own set (``NodeStates.intern``), for this call only; entries are
per state, so they are as valid for the next pod as any other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import repeat

from topodra.fleet.allocator import Rank, free_gpus
from topodra.fleet.demand import Demand
from topodra.fleet.fgd import Mix
from topodra.fleet.hostfrag import HostJob, SharePlan, capped_by_plan, capped_vector, class_gpus, share_plan
from topodra.fleet.hostres import Share
from topodra.fleet.nodestates import NodeStates
from topodra.fleet.state import NodeView
from topodra.placement.score import BEST_FIT_WEIGHT, MAX_SCORE, Scorer

# Per state: (rank, id of the fragments before, id of the fragments after, best-fit term), None: no fit.
Entry = tuple[Rank, int, int, float] | None
JobKey = tuple[tuple[Demand, ...], HostJob | None, tuple[int, ...]]  # demands, host job, class ids (sorted)
_MISSING: Entry = ((-1,), -1, -1, 0.0)
NO_GPUS = -1  # pseudo state of a node without the driver's devices, for a pod without GPUs (issue 34)
# A pod without GPUs, between nodes it strands nothing on: a node whose GPUs are all in use still frees them
# later, so one without GPUs comes first (a tie-break below BEST_FIT_WEIGHT per free GPU).
CPU_ONLY_GPU_WEIGHT = 1e-5


class StateScorer:
    """Scores by state; shares ``scorer``'s placement and fragment memos. Callers hold the cache lock."""

    def __init__(self, scorer: Scorer, states: NodeStates, max_entries: int = 200_000) -> None:
        self.scorer = scorer
        self.states = states
        self._max = max_entries
        self._entries: dict[JobKey, dict[int, Entry]] = {}
        self._count = 0
        # Fragment vectors (class-id order) by id; the GPU-only ones by (shape, unavailable, class set); the
        # capped "before" ones by (state, share, class set): shared by every pod shape of the same share.
        self._vector_ids: dict[tuple[int, ...], int] = {}
        self._vectors: list[tuple[int, ...]] = []
        self._raw: dict[tuple[int, frozenset[int], tuple[int, ...]], tuple[int, ...]] = {}
        self._before: dict[tuple[int, Share | None, int, tuple[object, ...], tuple[int, ...]], int] = {}
        self._ks: dict[tuple[int, ...], tuple[int, ...]] = {}  # class ids -> GPUs per placement of each
        self._plans: dict[tuple[object, ...], SharePlan] = {}  # per-class shares, grouped (hostfrag.share_plan)
        self._valid_for = (-1, -1)  # (states.epoch, scorer.generation) the ids above belong to

    def _check(self) -> None:
        now = (self.states.epoch, self.scorer.generation)
        if now != self._valid_for or self._count + len(self._vectors) + len(self._raw) > self._max:
            self._entries.clear()
            self._vector_ids.clear()
            self._vectors.clear()
            self._raw.clear()
            self._before.clear()
            self._ks.clear()
            self._plans.clear()
            self._count = 0
            self._valid_for = (self.states.epoch, self.scorer.generation)

    def _vector(self, v: tuple[int, ...]) -> int:
        got = self._vector_ids.get(v)
        if got is None:
            got = self._vector_ids[v] = len(self._vectors)
            self._vectors.append(v)
        return got

    def score(self, names: Sequence[str], demands: Sequence[Demand], mix: Mix,
              job: HostJob | None, unavailable: Mapping[str, frozenset[int]] | None = None) -> list[int]:
        """0..10 per name, in order: ``Scorer.score`` for demands without CEL selectors; ``job``: the pod's
        CPU/memory for CPU/memory-aware scoring (None: GPUs only); ``unavailable``: nodes where the pod meets
        other unavailable devices than an ordinary claim (its tolerations), scored as the state with those."""
        self.scorer._trim()
        cpu_only = not demands
        if cpu_only and (job is None or not job.per_class):
            return [0] * len(names)  # nothing of ours and no per-class rule: no opinion
        self.states.sync()
        self._check()
        key = tuple(demands)
        classes = self.scorer._classes(mix)
        ps = [p for _i, _d, p in classes]
        # Fragment vectors are kept in class-id order; F sums them in the mix's order (as Scorer.cost does).
        canon = sorted(classes, key=lambda c: c[0])
        at = {c[0]: k for k, c in enumerate(canon)}
        order = [at[i] for i, _d, _p in classes]
        table = self.states.of if job is not None else self.states.gpu_of
        ids_of_classes = tuple(c[0] for c in canon)
        entries = self._entries.setdefault((key, job, ids_of_classes), {})
        ids: list[int | None] = list(map(table.get, names))  # None: the node publishes none of our devices (0)
        if cpu_only and None in ids:  # issue 34: a node without our devices strands no GPU where the pod fits
            hosts = self.states.state.hosts
            assert job is not None
            for pos, (name, s) in enumerate(zip(names, ids, strict=True)):
                if s is None:
                    room = hosts.room(name)
                    fits = room is None or (job.pod_cpu <= room.cpu_free and job.pod_memory <= room.memory_free)
                    ids[pos] = NO_GPUS if fits else None
        if unavailable:
            for pos, name in enumerate(names):
                own = unavailable.get(name)
                if own is not None:
                    ids[pos] = self.states.intern(name, own, job is not None)
        vectors = self._vectors
        frag: dict[int, float] = {}

        def weighted(vector_id: int) -> float:
            """F of one fragment vector under this call's mix, summed in the mix's order; once per vector."""
            f = frag.get(vector_id)
            if f is None:
                f, v = 0.0, vectors[vector_id]
                for p, k in zip(ps, order, strict=True):
                    f += p * v[k]
                frag[vector_id] = f
            return f

        costs: dict[int, tuple[Rank, float]] = {}
        for s in set(ids):
            if s is None:
                continue
            if s == NO_GPUS:
                costs[s] = ((), 0.0)
                continue
            e = entries.get(s, _MISSING)
            if e is _MISSING:
                e = entries[s] = self._entry(s, key, canon, ids_of_classes, job)
                self._count += 1
            if e is None:
                continue
            rank, before, after, best_fit = e
            costs[s] = (rank, (weighted(after) - weighted(before)) + best_fit)
        if not costs:
            return [0] * len(names)
        best = min(rank for rank, _c in costs.values())
        top = [c for rank, c in costs.values() if rank == best]
        lo, hi = min(top), max(top)
        scores: dict[int | None, int] = {}
        for s, (rank, c) in costs.items():
            if rank != best:
                scores[s] = 1  # fits, but only with a less preferred alternative
            elif hi - lo < 1e-12:
                scores[s] = MAX_SCORE
            else:
                scores[s] = 1 + round((MAX_SCORE - 1) * (hi - c) / (hi - lo))
        return list(map(scores.get, ids, repeat(0, len(ids))))

    def _raw_vector(self, view: NodeView, used: frozenset[int], classes: list[tuple[int, Demand, float]],
                    ids: tuple[int, ...]) -> tuple[int, ...]:
        """GPU-only fragments of each class on (shape, unavailable devices)."""
        key = (view.shape, used, ids)
        got = self._raw.get(key)
        if got is None:
            got = self._raw[key] = tuple(self.scorer.unusable_of(view, used, i, d) for i, d, _p in classes)
        return got

    def _entry(self, s: int, demands: tuple[Demand, ...], classes: list[tuple[int, Demand, float]],
               ids: tuple[int, ...], job: HostJob | None) -> Entry:
        """``Scorer.cost`` of one state with the mix weights left out (the fragment vectors instead);
        ``ids``: the classes' ids, in their (class-id) order."""
        st = self.states.states[s] if job is not None else self.states.states[self.states.gpu_rep[s]]
        view, used = st.view, st.used
        room = st.room if job is not None else None
        if room is not None and job is not None and (job.pod_cpu > room[0] or job.pod_memory > room[1]):
            return None  # HostFit.fits: the pod's own CPU or memory does not fit
        got = self.scorer.placement(view, used, demands, b"") if demands else (used, ())
        if got is None:
            return None
        after, rank = got
        free_after = free_gpus(view, after)
        raw_after = self._raw_vector(view, after, classes, ids)
        # A pod without GPUs: among nodes it strands nothing on, fewer free GPUs first, then fewer GPUs at all
        # (a node without GPUs, ``NO_GPUS``, costs 0).
        best_fit = BEST_FIT_WEIGHT * free_after + (0.0 if demands else CPU_ONLY_GPU_WEIGHT * view.gpus)
        if room is not None and job is not None and job.per_class:
            ks = self._ks.get(ids)
            if ks is None:
                ks = self._ks[ids] = tuple(class_gpus(d) for _i, d, _p in classes)
            pkey = (ids, job.share, job.gpus, job.observed, st.fair)
            plan = self._plans.get(pkey)
            if plan is None:
                plan = self._plans[pkey] = share_plan(ks, job.class_shares(ks, st.fair))
            bkey2 = (s, job.share, job.gpus, job.observed, ids)
            before = self._before.get(bkey2)
            if before is None:
                before = self._before[bkey2] = self._vector(capped_by_plan(
                    free_gpus(view, used), self._raw_vector(view, used, classes, ids), room[0], room[1], plan))
            after_id = self._vector(capped_by_plan(free_after, raw_after, room[0] - job.pod_cpu,
                                                   room[1] - job.pod_memory, plan))
            return rank, before, after_id, best_fit
        if room is not None and job is not None:
            ks = self._ks.get(ids)
            if ks is None:
                ks = self._ks[ids] = tuple(class_gpus(d) for _i, d, _p in classes)
            bkey = (s, job.share, 0, (), ids)
            before = self._before.get(bkey)
            if before is None:
                before = self._before[bkey] = self._vector(capped_vector(
                    free_gpus(view, used), self._raw_vector(view, used, classes, ids), ks, room[0], room[1],
                    job.share))
            after_id = self._vector(capped_vector(free_after, raw_after, ks, room[0] - job.pod_cpu,
                                                  room[1] - job.pod_memory, job.share))
        else:
            before = self._vector(self._raw_vector(view, used, classes, ids))
            after_id = self._vector(raw_after)
        return rank, before, after_id, best_fit
