"""Fragmentation-gradient scoring (FGD, Weng et al., USENIX ATC'23) for whole GPUs. Pure.

The allocator emulation (``fleet.allocator``) and the measure F_n (``fleet.fgd``) belong to the
fleet model, shared with the inventory; this module turns them into the extender's 0..10 scores.

For a pod and a candidate node n:

1. ``place``: which devices the pod's claims would take on n.  This follows the
   scheduler's allocator -- requests in order, ``firstAvailable`` subrequests in
   order, devices first-fit in slice order, ``matchAttribute`` constraints held,
   backtracking -- so the prediction is the device set the scheduler will pick.
2. ``unusable(n, m)``: free GPUs on n that request class m cannot use: pack m onto
   n's available devices (neither allocated nor blocked by a NoSchedule/NoExecute
   taint, ``fleet.taints``) again and again (same ``place``) until it no longer fits; the
   free GPUs left over are m's fragments (wrong model, too few in one NVLink domain,
   ...).  A half-used 8-GPU domain leaves 4 fragments for an 8-GPU class; a whole
   free server leaves none.
3. ``F_n = sum_m p_m * unusable(n, m)`` over the expected request mix, and the pod
   goes where ``delta_n = F_n(after) - F_n(before)`` is smallest.  Ties (and only
   ties, by a 1e-4 weight) go to the node left with fewer free GPUs (best fit).

The claim's own preference comes first: ``place`` also says which ``firstAvailable``
alternative each request would get on n (its *rank*, 0 = first choice), and ranks
compare lexicographically before fragmentation.  Only the nodes of the best rank any
candidate offers are scored by ``delta_n``: ``1 + 9 * (c_max - c_n) / (c_max - c_min)``
rounded (the best node 10, the worst of them 1; 10 for all when the costs are equal).
Every node that fits only with a worse rank gets 1, so packing never pulls a job onto
its 2nd choice while its 1st is placeable elsewhere. 0 where the claims do not fit in
our view: a low score, never a veto.  Results are memoised per (node shape, unavailable devices, ...),
so 500 nodes in a few distinct states cost a few placements, not 500.

Reservations (issue 33) enter twice: a pod's tolerations decide which devices are unavailable to it
(``ClusterState.tolerated_unavailable``), and ``steered`` adds the steering term on top of the 0..10 scores
(another job's hinted nodes ``STEER_PENALTY`` lower, the reserving job's own nodes first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from topodra.fleet.allocator import Rank, free_gpus, place_ranked, selector_mask
from topodra.fleet.demand import Demand
from topodra.fleet.fgd import Fragmentation, Mix
from topodra.fleet.hostfrag import HostFit, class_gpus, host_fragmentation
from topodra.fleet.hostres import Share
from topodra.fleet.packing import PlacePlan, place_plan, placed
from topodra.fleet.reserve import Steer
from topodra.fleet.state import NodeView

MAX_SCORE = 10
BEST_FIT_WEIGHT = 1e-4
_MISSING: Any = object()


class Scorer(Fragmentation):
    """Scores candidate nodes; memoises placements (and, as ``Fragmentation``, fragments) per node
    shape and unavailable devices.

    The caches are keyed by what determines the result (shape id, devices in use, demand), so
    they stay valid across cluster changes; they are dropped wholesale when they grow large.
    """

    def __init__(self, max_entries: int = 200_000) -> None:
        super().__init__(max_entries)
        self._place: dict[tuple[int, bytes, frozenset[int], tuple[Demand, ...]],
                          tuple[frozenset[int], Rank] | None] = {}
        # Per (shape, demands) without selectors: the closed form's groups (fleet.packing), or None.
        self._place_plans: dict[tuple[int, tuple[Demand, ...]], PlacePlan | None] = {}

    def _trim(self) -> None:
        if len(self._place) + len(self._unusable) > self._max:
            self._place.clear()
            self._place_plans.clear()
            self._reset()

    def placement(self, view: NodeView, used: frozenset[int], demands: tuple[Demand, ...],
                  mask: bytes | None = None) -> tuple[frozenset[int], Rank] | None:
        key = (view.shape, selector_mask(view, demands) if mask is None else mask, used, demands)
        got: tuple[frozenset[int], Rank] | None = self._place.get(key, _MISSING)
        if got is _MISSING:
            # Without selectors one claim of the common shape has a closed form per shape (fleet.packing).
            pkey = (view.shape, demands)
            if pkey not in self._place_plans:
                self._place_plans[pkey] = (None if any(d.has_selectors for d in demands)
                                           else place_plan(view, demands))
            plan = self._place_plans[pkey]
            got = self._place[key] = placed(plan, used) if plan is not None else place_ranked(view, used, demands)
        return got

    def cost(self, view: NodeView, used: frozenset[int], demands: tuple[Demand, ...], mix: Mix,
             classes: list[tuple[int, Demand, float]] | None = None,
             mask: bytes | None = None, host: HostFit | None = None) -> tuple[Rank, float] | None:
        """(rank of the alternatives taken, delta F of placing the pod here plus the best-fit
        tie-break), or None when it does not fit (devices, or with ``host`` the node's CPU/memory)."""
        if host is not None and not host.fits():
            return None
        got = self.placement(view, used, demands, mask)
        if got is None:
            return None
        after, rank = got
        classes = classes if classes is not None else self._classes(mix)
        if host is not None:
            delta = self.host_delta(view, used, after, classes, host)
        else:
            delta = self.fragmentation(view, after, mix, classes) - self.fragmentation(view, used, mix, classes)
        return rank, delta + BEST_FIT_WEIGHT * free_gpus(view, after)

    def host_delta(self, view: NodeView, used: frozenset[int], after: frozenset[int],
                   classes: list[tuple[int, Demand, float]], host: HostFit) -> float:
        """delta F with the node's free CPU and memory before and after the pod (``fleet.hostfrag``)."""
        shares = host.class_shares([class_gpus(d) for _i, d, _p in classes])
        before = host_fragmentation(self, view, used, classes, host.cpu_free, host.memory_free, shares)
        return host_fragmentation(self, view, after, classes, host.cpu_free - host.pod_cpu,
                                  host.memory_free - host.pod_memory, shares) - before

    def score(self, candidates: Sequence[tuple[str, NodeView | None, frozenset[int]]],
              demands: Sequence[Demand], mix: Mix,
              hosts: Sequence[HostFit | None] | None = None) -> list[tuple[str, int]]:
        """(node, 0..10) for each candidate, in the order given; ``hosts``: per candidate its free CPU and
        memory for this pod (CPU/memory-aware FGD), None for GPU-only scoring."""
        self._trim()
        if not demands:
            return [(name, 0) for name, _v, _u in candidates]  # nothing of ours: no opinion
        key = tuple(demands)
        classes = self._classes(mix)
        memo: dict[tuple[int, bytes, frozenset[int], tuple[int, int, Share | None] | None],
                   tuple[Rank, float] | None] = {}
        costs: list[tuple[Rank, float] | None] = []
        with_selectors = any(d.has_selectors for d in key)
        for c, (_name, view, used) in enumerate(candidates):
            if view is None:
                costs.append(None)
                continue
            host = hosts[c] if hosts is not None else None
            mask = selector_mask(view, key) if with_selectors else b""
            k = (view.shape, mask, used, host.key() if host is not None else None)
            if k not in memo:
                memo[k] = self.cost(view, used, key, mix, classes, mask, host)
            costs.append(memo[k])
        fitting = [c for c in costs if c is not None]
        if not fitting:
            return [(name, 0) for name, _v, _u in candidates]
        best = min(rank for rank, _c in fitting)
        top = [c for rank, c in fitting if rank == best]
        lo, hi = min(top), max(top)
        out = []
        for (name, _v, _u), rc in zip(candidates, costs, strict=True):
            if rc is None:
                out.append((name, 0))
            elif rc[0] != best:
                out.append((name, 1))  # fits, but only with a less preferred alternative
            elif hi - lo < 1e-12:
                out.append((name, MAX_SCORE))
            else:
                out.append((name, 1 + round((MAX_SCORE - 1) * (hi - rc[1]) / (hi - lo))))
        return out


# Reservations (issue 33): points taken off a fitting node's 0..10 score where the pod would eat into another job's
# hinted reservation (never below 1, so a fitting node stays above one where the claims do not fit: the scorer
# never filters).
STEER_PENALTY = 5


def steered(scores: Sequence[tuple[str, int]], steer: Steer,
            rescore: Callable[[list[str]], Sequence[tuple[str, int]]]) -> list[tuple[str, int]]:
    """The reservation steering term (``fleet.reserve``) on the node rule's ``scores`` (candidate order kept):

    * **the reserving job's pods** (``steer.owned``, nodes with free devices held or hinted for a ClaimProfile
      the pod owns): when one of them fits, they are ranked among themselves (``rescore``: the node rule over
      those nodes alone) and lifted to 2..10, every other fitting node gets 1: the reservation is where its
      pods go, FGD decides among its nodes (``fleet.domains.in_domain_scores``' rule, one level down);
    * **every other pod**: ``score - STEER_PENALTY`` (at least 1) on fitting nodes with free devices hinted for
      a reservation it does not own (``steer.foreign``): small jobs go elsewhere when they can, unless FGD prefers
      the hinted node by more than the penalty.
    """
    if not steer:
        return list(scores)
    mine = [n for n, s in scores if s > 0 and n in steer.owned]
    if mine:
        inside = dict(rescore(mine))
        return [(n, 0 if s <= 0 else 2 + round(8 * (max(1, inside.get(n, 1)) - 1) / 9) if n in steer.owned else 1)
                for n, s in scores]
    return [(n, max(1, s - STEER_PENALTY) if s > 0 and n in steer.foreign else s) for n, s in scores]
