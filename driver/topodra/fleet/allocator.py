"""The scheduler's allocator, emulated on one node's view (pure).

Requests in order, ``firstAvailable`` subrequests in order, devices first-fit in slice order,
``matchAttribute`` constraints held, backtracking -- so the prediction is the device set the
scheduler will pick. The scorer uses it to predict a pod's devices; the fragmentation measure uses it
to pack request classes onto what is left.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from topodra.fleet.demand import ANY_GPU, Alternative, Demand
from topodra.fleet.state import DeviceView, NodeView

SEARCH_BUDGET = 20_000  # allocator steps per placement before we give up (then: "does not fit")
_UNSET: Any = object()


class _OutOfBudget(Exception):
    pass


def alternative_matches(alt: Alternative, d: DeviceView) -> bool:
    """Whether the device can serve the alternative: its class (any GPU for the prior) and selectors."""
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
            cands = [i for i, d in enumerate(devices) if i not in taken and alternative_matches(alt, d)]
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
