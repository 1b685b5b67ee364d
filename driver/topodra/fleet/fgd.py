"""Fragmentation (FGD, Weng et al., USENIX ATC'23) of a node's free GPUs for whole-GPU requests. Pure.

``unusable(n, m)``: free GPUs on node n that request class m cannot use: pack m onto n's available
devices again and again (the allocator emulation) until it no longer fits; the free GPUs left over are
m's fragments (wrong model, too few in one NVLink domain, ...). A half-used 8-GPU domain leaves 4
fragments for an 8-GPU class; a whole free server leaves none. ``F_n = sum_m p_m * unusable(n, m)``
over the expected request mix (a prior mixed with the claims seen).

The placement scorer minimises the change of F_n; the inventory prints F_n. Both call
``Fragmentation`` on the same views with the same unavailable devices (allocated or blocking-tainted,
``ClusterState.unavailable_indices``), so the printed number is the optimised one.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from topodra.fleet.allocator import free_gpus, place
from topodra.fleet.demand import ANY_GPU, Alternative, Constraint, Demand, Request
from topodra.fleet.packing import PackPlan, pack_plan, packed_unusable
from topodra.fleet.state import NodeView

DEFAULT_PRIOR = {1: 0.6, 2: 0.1, 4: 0.1, 8: 0.2}


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


@functools.lru_cache(maxsize=256)
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
        # Fragments are memoised per node shape (see selector_mask); tolerations do not change how a class packs
        # (the ordinary view of the node is what the mix's future claims meet).
        demand = demand.without_selectors()
        if demand.has_tolerations:
            demand = demand.without_tolerations()
        weights[demand] = weights.get(demand, 0.0) + n
    total = sum(weights.values())
    if total <= 0:
        return Mix(classes=())
    return Mix(classes=tuple((d, w / total) for d, w in weights.items()))


def unusable(view: NodeView, used: frozenset[int], demand: Demand) -> int:
    """F_n(m): free GPUs left after packing request class ``demand`` onto the node as often as it fits."""
    plan = pack_plan(view, demand)  # the common shape in closed form (fleet.packing)
    if plan is not None:
        return packed_unusable(plan, used)
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


class Fragmentation:
    """F_n with memoised fragments per (packing plan, unavailable devices).

    A class's packing plan on a node (``fleet.packing.pack_plan``) depends on the node's shape only, and many classes
    have the same plan on a shape (on an H200 node, 1 GPU of any model, of ``gpu.topodra.io`` and of the
    fallback chain h200/h100/a100 pack alike), so fragments are computed once per distinct plan and set
    of unavailable devices, and shared across classes and shapes (issue 22: 12 classes, 4 plans per shape
    at 2,048 nodes). Classes the closed form does not cover, or with selectors, keep one memo per (shape,
    class). The memo is keyed by what determines the result, so it stays valid across cluster changes; it
    is dropped wholesale when it grows large.
    """

    def __init__(self, max_entries: int = 200_000) -> None:
        self._unusable: dict[tuple[int, frozenset[int]], int] = {}  # (plan id, unavailable) -> fragments
        self._ids: dict[Demand, int] = {}  # demands hash recursively: look them up once per call
        self._plans: dict[tuple[int, int], tuple[int, PackPlan | None]] = {}  # (shape, class id) -> plan id, plan
        self._plan_ids: dict[PackPlan, int] = {}
        self._max = max_entries
        self.generation = 0  # bumped when the memo (and with it the demand ids) is dropped

    def _reset(self) -> None:
        self._unusable.clear()
        self._ids.clear()
        self._plans.clear()
        self._plan_ids.clear()
        self.generation += 1

    def _trim(self) -> None:
        if len(self._unusable) > self._max:
            self._reset()

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
        """F_n = sum_m p_m * unusable(n, m); ``used``: the node's unavailable device indices."""
        total = 0.0
        for i, demand, p in classes if classes is not None else self._classes(mix):
            total += p * self.unusable_of(view, used, i, demand)
        return total

    def plan_of(self, view: NodeView, i: int, demand: Demand) -> tuple[int, PackPlan | None]:
        """(plan id, plan) of class ``i`` on the view's shape; plan None: ``unusable`` itself, memoised
        under an id of its own (a negative one) per (shape, class)."""
        key = (view.shape, i)
        got = self._plans.get(key)
        if got is None:
            plan = None if demand.has_selectors else pack_plan(view, demand)
            if plan is None:
                got = (-1 - len(self._plans), None)
            else:
                got = (self._plan_ids.setdefault(plan, len(self._plan_ids)), plan)
            self._plans[key] = got
        return got

    def unusable_of(self, view: NodeView, used: frozenset[int], i: int, demand: Demand) -> int:
        """``unusable(view, used, demand)``, memoised; ``i``: the demand's id from ``_classes``."""
        pid, plan = self.plan_of(view, i, demand)
        key = (pid, used)
        u = self._unusable.get(key)
        if u is None:
            u = self._unusable[key] = packed_unusable(plan, used) if plan is not None else unusable(view, used, demand)
        return u
