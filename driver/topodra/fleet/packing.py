"""The allocator emulation in closed form for the common claim shape, precomputed per node shape. Pure.

The common shape: one request whose alternatives take ``k`` devices each, under ``matchAttribute``
constraints that cover the whole request (or none). A placement then takes k devices from one *group* of
devices with equal constrained values, and which devices form the groups depends only on the devices'
classes, GPU flags and pattern of equal attribute values, i.e. on the node's shape (``fleet.state``), as
long as the claim has no selectors (they test values). So the groups are worked out once per (shape,
class) as a plan, and every node state of that shape is a few set lookups away from the answer:

* ``packed_unusable``: FGD's fragments (``fleet.fgd.unusable``): packing the class over and over fills
  floor(free members / k) placements per group, lowest devices first, alternative after alternative;
* ``placed``: where the scheduler's allocator (``fleet.allocator.place_ranked``) puts one such claim:
  the first alternative with a group of at least k free devices; of those groups the one whose first free
  device comes first (first fit with backtracking picks exactly that device, then the next k-1 of its
  group).

Both equal the search (``tests/unit/fleet/test_fleet_packing.py`` compares them on random states). Hand-written
for speed (issue 22): at 2,048 nodes a ``prioritize`` call that met ~40 new states spent 25-45 µs per state in
``place_ranked`` and ~16 µs per class in the grouping (instrumented offline runs at load 7); with plans 6-12 µs
per placement and ~5 µs per class, memo lookups included.
"""

from __future__ import annotations

from typing import Any

from topodra.fleet.allocator import Rank, alternative_matches
from topodra.fleet.demand import Alternative, Demand
from topodra.fleet.state import NodeView

_UNSET: Any = object()
Groups = tuple[tuple[int, ...], ...]  # device indices with equal constrained values, each in index order
# Fragments: per alternative that matches a device, (k, its groups); then the node's GPU indices.
PackPlan = tuple[tuple[tuple[int, Groups], ...], tuple[int, ...]]
# Placement: per alternative, (its index, k, its groups); empty groups where nothing matches.
PlacePlan = tuple[tuple[int, int, Groups], ...]


def _covered(demand: Demand) -> list[list[str]] | None:
    """Per alternative of the demand's one request, the attributes its devices must share; None when the
    demand is not of the common shape (more requests, allocationMode All, a constraint on only some
    subrequests)."""
    if len(demand.requests) != 1:
        return None
    req = demand.requests[0]
    out = []
    for alt in req.alternatives:
        if alt.count == 0:
            return None
        attrs = [c.attribute for c in demand.constraints if c.applies(req.name, alt.name)]
        if len(attrs) != len(demand.constraints):
            return None
        out.append(attrs)
    return out


def _groups(view: NodeView, alt: Alternative, attrs: list[str]) -> Groups:
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, d in enumerate(view.devices):
        if not alternative_matches(alt, d):
            continue
        key = tuple(d.attrs.get(a, _UNSET) for a in attrs)
        if _UNSET in key:
            continue  # a device without the constrained attribute can join no placement
        groups.setdefault(key, []).append(i)
    return tuple(map(tuple, groups.values()))


def pack_plan(view: NodeView, demand: Demand) -> PackPlan | None:
    """``packed_unusable``'s view of the node, or None when the demand is not of the common shape. The
    same for every node of the view's shape when the demand has no selectors."""
    covered = _covered(demand)
    if covered is None:
        return None
    steps = []
    for alt, attrs in zip(demand.requests[0].alternatives, covered, strict=True):
        groups = _groups(view, alt, attrs)
        if groups:
            steps.append((alt.count, groups))
    return tuple(steps), tuple(i for i, d in enumerate(view.devices) if d.gpu)


def packed_unusable(plan: PackPlan, used: frozenset[int]) -> int:
    """Free GPUs left after packing the class onto the node as often as it fits (``fleet.fgd.unusable``)."""
    steps, gpus = plan
    taken = set(used)
    for k, groups in steps:
        for group in groups:
            members = [i for i in group if i not in taken]
            n = len(members) // k * k
            if n:
                taken.update(members[:n])
    return sum(1 for i in gpus if i not in taken)


def place_plan(view: NodeView, demands: tuple[Demand, ...]) -> PlacePlan | None:
    """``placed``'s view of the node for a pod with one claim of the common shape, else None."""
    if len(demands) != 1:
        return None
    covered = _covered(demands[0])
    if covered is None:
        return None
    return tuple((ai, alt.count, _groups(view, alt, attrs))
                 for ai, (alt, attrs) in enumerate(zip(demands[0].requests[0].alternatives, covered, strict=True)))


def placed(plan: PlacePlan, used: frozenset[int]) -> tuple[frozenset[int], Rank] | None:
    """``place_ranked(view, used, demands)`` for the plan's node and demands."""
    for ai, k, groups in plan:
        best: list[int] | None = None
        for group in groups:
            members = [i for i in group if i not in used]
            if len(members) >= k and (best is None or members[0] < best[0]):
                best = members
        if best is not None:
            return used.union(best[:k]), (ai,)
    return None
