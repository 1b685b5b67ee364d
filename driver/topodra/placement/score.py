"""Fragmentation-gradient scoring (FGD, Weng et al., USENIX ATC'23) for whole GPUs. Pure.

For a pod and a candidate node n:

1. ``place``: which devices the pod's claims would take on n.  This follows the
   scheduler's allocator -- requests in order, ``firstAvailable`` subrequests in
   order, devices first-fit in slice order, ``matchAttribute`` constraints held,
   backtracking -- so the prediction is the device set the scheduler will pick.
2. ``unusable(n, m)``: free GPUs on n that request class m cannot use: pack m onto
   n's free devices again and again (same ``place``) until it no longer fits; the
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
our view: a low score, never a veto.  Results are memoised per (node shape, devices in use, ...),
so 500 nodes in a few distinct states cost a few placements, not 500.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from topodra.placement.model import (
    ANY_GPU,
    Alternative,
    Constraint,
    Demand,
    DeviceView,
    NodeView,
    Request,
)

MAX_SCORE = 10
BEST_FIT_WEIGHT = 1e-4
SEARCH_BUDGET = 20_000  # allocator steps per placement before we give up (then: "does not fit")
DEFAULT_PRIOR = {1: 0.6, 2: 0.1, 4: 0.1, 8: 0.2}
_UNSET: Any = object()


# --------------------------------------------------------------------------- the request mix


def parse_prior(text: str) -> dict[int, float]:
    """``'1:0.6,2:0.1,4:0.1,8:0.2'`` -> {GPUs: weight}, normalised; ValueError when malformed."""
    out: dict[int, float] = {}
    for part in text.split(","):
        size, sep, weight = part.strip().partition(":")
        try:
            k, w = int(size), float(weight)
        except ValueError:
            raise ValueError(f"prior entry {part.strip()!r} is not GPUS:WEIGHT (e.g. 8:0.2)") from None
        if not sep or k < 1 or w < 0 or k in out:
            raise ValueError(f"prior entry {part.strip()!r}: GPUs must be >= 1 and unique, weight >= 0")
        out[k] = w
    total = sum(out.values())
    if total <= 0:
        raise ValueError("prior weights must not all be zero")
    return {k: w / total for k, w in out.items()}


def prior_demand(gpus: int, driver: str) -> Demand:
    """A prior request class: ``gpus`` GPUs of any model, in one NVLink domain when more than one."""
    cons = (Constraint(requests=(), attribute=f"{driver}/nvlinkDomain"),) if gpus > 1 else ()
    return Demand(requests=(Request("gpus", (Alternative("gpus", ANY_GPU, gpus),)),), constraints=cons)


@dataclass(frozen=True)
class Mix:
    """Request classes with their probabilities p_m (summing to 1)."""

    classes: tuple[tuple[Demand, float], ...]


def make_mix(prior: Mapping[int, float], prior_weight: float, observed: Mapping[Demand, int],
             driver: str, known_classes: frozenset[str] | None = None) -> Mix:
    """p_m = (prior_weight * prior_m + count_m) / (prior_weight + total count).

    The prior acts as ``prior_weight`` pseudo-claims; observed claims whose classes the
    scorer cannot evaluate (foreign DeviceClasses) are left out.
    """
    weights: dict[Demand, float] = {}
    for gpus, p in prior.items():
        if p > 0 and prior_weight > 0:
            d = prior_demand(gpus, driver)
            weights[d] = weights.get(d, 0.0) + prior_weight * p
    for demand, n in observed.items():
        if known_classes is not None and not all(
                a.device_class in known_classes for r in demand.requests for a in r.alternatives):
            continue
        demand = demand.without_selectors()  # fragments are memoised per node shape (see selector_mask)
        weights[demand] = weights.get(demand, 0.0) + n
    total = sum(weights.values())
    if total <= 0:
        return Mix(classes=())
    return Mix(classes=tuple((d, w / total) for d, w in weights.items()))


# --------------------------------------------------------------------------- placement


class _OutOfBudget(Exception):
    pass


def _matches(alt: Alternative, d: DeviceView) -> bool:
    if not (d.gpu if alt.device_class == ANY_GPU else alt.device_class in d.classes):
        return False
    return all(s.matches(d.driver, d.attrs, d.capacity) for s in alt.selectors)


def selector_mask(view: NodeView, demands: Sequence[Demand]) -> bytes:
    """Which devices of the node pass each claim-level selector of the demands (empty when none).

    Node shapes ignore attribute *values*, which claim selectors may test: results memoised per
    shape are only shared between nodes with the same mask."""
    sels = [s for dm in demands for r in dm.requests for a in r.alternatives for s in a.selectors]
    if not sels:
        return b""
    return bytes(s.matches(d.driver, d.attrs, d.capacity) for s in sels for d in view.devices)


def _place_one(devices: Sequence[DeviceView], taken: set[int], demand: Demand, budget: list[int],
               ranks: list[int] | None = None) -> bool:
    """Allocate ``demand`` into ``taken`` (mutated) like the scheduler's allocator; False if it cannot.

    On success ``ranks`` (when given) gets, per request, the index of the alternative used."""
    cons = demand.constraints
    chosen = [0] * len(demand.requests)
    values: list[Any] = [_UNSET] * len(cons)

    def compatible(d: DeviceView, active: Sequence[int]) -> bool:
        for c in active:
            v = d.attrs.get(cons[c].attribute, _UNSET)
            if v is _UNSET or (values[c] is not _UNSET and values[c] != v):
                return False
        return True

    def pick(r: int, active: Sequence[int], cands: Sequence[int], start: int, need: int) -> bool:
        if need == 0:
            return request(r + 1)
        budget[0] -= 1
        if budget[0] < 0:
            raise _OutOfBudget
        for j in range(start, len(cands) - need + 1):
            i = cands[j]
            d = devices[i]
            if not compatible(d, active):
                continue
            fresh = [c for c in active if values[c] is _UNSET]
            for c in fresh:
                values[c] = d.attrs[cons[c].attribute]
            # Prune: enough compatible devices must remain after this one.
            if need == 1 or sum(1 for x in cands[j + 1:] if compatible(devices[x], active)) >= need - 1:
                taken.add(i)
                if pick(r, active, cands, j + 1, need - 1):
                    return True
                taken.discard(i)
            for c in fresh:
                values[c] = _UNSET
        return False

    def request(r: int) -> bool:
        if r == len(demand.requests):
            return True
        req = demand.requests[r]
        for ai, alt in enumerate(req.alternatives):
            chosen[r] = ai
            active = [c for c, k in enumerate(cons) if k.applies(req.name, alt.name)]
            cands = [i for i, d in enumerate(devices) if i not in taken and _matches(alt, d)]
            if alt.count == 0:  # allocationMode All: every matching device, constraints over all of them
                if not cands:
                    continue
                saved = list(values)
                ok = True
                for i in cands:
                    if not compatible(devices[i], active):
                        ok = False
                        break
                    for c in active:
                        if values[c] is _UNSET:
                            values[c] = devices[i].attrs[cons[c].attribute]
                if ok:
                    taken.update(cands)
                    if request(r + 1):
                        return True
                    taken.difference_update(cands)
                values[:] = saved
            elif len(cands) >= alt.count and pick(r, active, cands, 0, alt.count):
                return True
        return False

    ok = request(0)
    if ok and ranks is not None:
        ranks.extend(chosen)
    return ok


Rank = tuple[int, ...]  # the alternative each request of a pod's claims gets; lower is preferred


def place_ranked(view: NodeView, used: frozenset[int], demands: Sequence[Demand],
                 budget: int = SEARCH_BUDGET) -> tuple[frozenset[int], Rank] | None:
    """Devices in use after the demands are allocated on the node (claims in order) and which
    alternative each request took (0 = its first choice), or None when they do not fit."""
    taken = set(used)
    steps = [budget]
    ranks: list[int] = []
    try:
        for demand in demands:
            if not _place_one(view.devices, taken, demand, steps, ranks):
                return None
    except _OutOfBudget:
        return None
    return frozenset(taken), tuple(ranks)


def place(view: NodeView, used: frozenset[int], demands: Sequence[Demand],
          budget: int = SEARCH_BUDGET) -> frozenset[int] | None:
    """Devices in use after the demands are allocated on the node (claims in order), or None."""
    got = place_ranked(view, used, demands, budget)
    return None if got is None else got[0]


def free_gpus(view: NodeView, used: frozenset[int]) -> int:
    return sum(1 for i, d in enumerate(view.devices) if d.gpu and i not in used)


def _pack_groups(view: NodeView, used: frozenset[int], demand: Demand) -> int | None:
    """``unusable`` for the common shape in closed form, or None when the shape is not covered.

    One request whose alternatives take ``k`` devices each under constraints that cover the whole
    request: a placement takes k devices from one group of equal constrained values, so packing it
    over and over fills floor(|group| / k) placements per group, lowest devices first (first fit),
    alternative after alternative. Same result as repeated ``place``, without the search.
    """
    if len(demand.requests) != 1:
        return None
    req = demand.requests[0]
    if any(a.count == 0 for a in req.alternatives):
        return None
    free = [i for i in range(len(view.devices)) if i not in used]
    taken: set[int] = set()
    for alt in req.alternatives:
        attrs = [c.attribute for c in demand.constraints if c.applies(req.name, alt.name)]
        if len(attrs) != len(demand.constraints):
            return None  # a constraint on only some subrequests: let the search decide
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i in free:
            d = view.devices[i]
            if i in taken or not _matches(alt, d):
                continue
            key = tuple(d.attrs.get(a, _UNSET) for a in attrs)
            if _UNSET in key:
                continue
            groups.setdefault(key, []).append(i)
        for members in groups.values():
            n = len(members) // alt.count * alt.count
            taken.update(members[:n])
    return sum(1 for i in free if view.devices[i].gpu and i not in taken)


def unusable(view: NodeView, used: frozenset[int], demand: Demand) -> int:
    """F_n(m): free GPUs left after packing request class ``demand`` onto the node as often as it fits."""
    fast = _pack_groups(view, used, demand)
    if fast is not None:
        return fast
    return unusable_by_search(view, used, demand)


def unusable_by_search(view: NodeView, used: frozenset[int], demand: Demand) -> int:
    """``unusable`` by placing the class again and again with the allocator emulation."""
    current = used
    while True:
        nxt = place(view, current, (demand,))
        if nxt is None or not any(view.devices[i].gpu for i in nxt - current):
            break  # no fit, or a class that takes no GPU (it cannot strand any)
        current = nxt
    return free_gpus(view, current)


# --------------------------------------------------------------------------- scoring


class Scorer:
    """Scores candidate nodes; memoises placements and fragments per node shape and usage.

    The caches are keyed by what determines the result (shape id, devices in use, demand), so
    they stay valid across cluster changes; they are dropped wholesale when they grow large.
    """

    def __init__(self, max_entries: int = 200_000) -> None:
        self._place: dict[tuple[int, bytes, frozenset[int], tuple[Demand, ...]],
                          tuple[frozenset[int], Rank] | None] = {}
        self._unusable: dict[tuple[int, frozenset[int], int], int] = {}
        self._ids: dict[Demand, int] = {}  # demands hash recursively: look them up once per call
        self._max = max_entries

    def _trim(self) -> None:
        if len(self._place) + len(self._unusable) > self._max:
            self._place.clear()
            self._unusable.clear()
            self._ids.clear()

    def placement(self, view: NodeView, used: frozenset[int], demands: tuple[Demand, ...],
                  mask: bytes | None = None) -> tuple[frozenset[int], Rank] | None:
        key = (view.shape, selector_mask(view, demands) if mask is None else mask, used, demands)
        if key not in self._place:
            self._place[key] = place_ranked(view, used, demands)
        return self._place[key]

    def _classes(self, mix: Mix) -> list[tuple[int, Demand, float]]:
        out = []
        for demand, p in mix.classes:
            i = self._ids.get(demand)
            if i is None:
                i = self._ids[demand] = len(self._ids)
            out.append((i, demand, p))
        return out

    def fragmentation(self, view: NodeView, used: frozenset[int], mix: Mix,
                      classes: list[tuple[int, Demand, float]] | None = None) -> float:
        """F_n = sum_m p_m * unusable(n, m)."""
        total = 0.0
        for i, demand, p in classes if classes is not None else self._classes(mix):
            key = (view.shape, used, i)
            u = self._unusable.get(key)
            if u is None:
                u = self._unusable[key] = unusable(view, used, demand)
            total += p * u
        return total

    def cost(self, view: NodeView, used: frozenset[int], demands: tuple[Demand, ...], mix: Mix,
             classes: list[tuple[int, Demand, float]] | None = None,
             mask: bytes | None = None) -> tuple[Rank, float] | None:
        """(rank of the alternatives taken, delta F of placing the pod here plus the best-fit
        tie-break), or None when it does not fit."""
        got = self.placement(view, used, demands, mask)
        if got is None:
            return None
        after, rank = got
        classes = classes if classes is not None else self._classes(mix)
        delta = self.fragmentation(view, after, mix, classes) - self.fragmentation(view, used, mix, classes)
        return rank, delta + BEST_FIT_WEIGHT * free_gpus(view, after)

    def score(self, candidates: Sequence[tuple[str, NodeView | None, frozenset[int]]],
              demands: Sequence[Demand], mix: Mix) -> list[tuple[str, int]]:
        """(node, 0..10) for each candidate, in the order given."""
        self._trim()
        if not demands:
            return [(name, 0) for name, _v, _u in candidates]  # nothing of ours: no opinion
        key = tuple(demands)
        classes = self._classes(mix)
        memo: dict[tuple[int, bytes, frozenset[int]], tuple[Rank, float] | None] = {}
        costs: list[tuple[Rank, float] | None] = []
        with_selectors = any(d.has_selectors for d in key)
        for _name, view, used in candidates:
            if view is None:
                costs.append(None)
                continue
            mask = selector_mask(view, key) if with_selectors else b""
            k = (view.shape, mask, used)
            if k not in memo:
                memo[k] = self.cost(view, used, key, mix, classes, mask)
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
