"""Which candidate nodes a pod should avoid or prefer because of reservations (issue 33). Pure.

A reservation (``topodra.reservations``) is a DeviceTaintRule per node with key ``RESERVATION_TAINT_KEY`` and
the reserving ClaimProfile's uid as value: effect ``NoSchedule`` *holds* the node's devices (the scheduler gives
them only to claims tolerating that taint), effect ``None`` *hints* at the domain the next waiting job would
reserve (the scheduler ignores it). A pod *owns* a reservation when its claims tolerate the held taint of that
uid (``fleet.taints.tolerated`` of ``(key, uid, NoSchedule)``): the reserving job's claims carry
``reservations.toleration(uid)``; an ``Exists`` toleration without a key owns every reservation.

For one pod, over the nodes that have reservation marks (``ClusterState.reservation_marks``):

* ``owned``: nodes with devices held or hinted for a uid the pod owns that are free *for the pod*;
* ``foreign``: nodes with hinted devices of a uid the pod does not own that are free for it (held devices of a
  foreign uid are unavailable to it already, ``ClusterState.tolerated_unavailable``).

A backfill claim (``reservations.backfill_tolerations``) tolerates every reservation (``Exists``): it owns the
held nodes whose devices are free for it (its window fits there; steering it onto held idle GPUs is backfill),
but a hint is never its own: hinted nodes stay ``foreign`` for it, so small jobs keep out of the next domain.

``placement.score.steered`` turns these into the score's steering term; ``fleet.domains.choose`` into the gang's
domain preference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from topodra.fleet.state import Mark
from topodra.fleet.taints import Tolerance, tolerated
from topodra.reservations import HINT_EFFECT, HOLD_EFFECT, RESERVATION_TAINT_KEY


@dataclass(frozen=True, slots=True)
class Steer:
    owned: frozenset[str] = frozenset()
    foreign: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.owned or self.foreign)


NO_STEER = Steer()


def owns(uid: str, tolerance: Tolerance) -> bool:
    """Whether the pod is the reserving job of ``uid``: it tolerates that reservation's held taint."""
    return tolerated((RESERVATION_TAINT_KEY, uid, HOLD_EFFECT), tolerance)


def steering(marks: Mapping[str, tuple[Mark, ...]], tolerance: Tolerance,
             unavailable: Callable[[str], frozenset[int] | None]) -> Steer:
    """``owned`` and ``foreign`` nodes for a pod with ``tolerance``; ``unavailable(node)``: the node's devices
    the pod cannot take (None: the node publishes none)."""
    owned, foreign = set(), set()
    universal = owns("", tolerance)  # no reservation has an empty uid: this tolerance owns every one
    for node, ms in marks.items():
        used = unavailable(node)
        if used is None:
            continue
        for m in ms:
            if not (m.devices - used):
                continue  # nothing of it is free for this pod
            if m.effect == HINT_EFFECT and universal:
                foreign.add(node)
            elif owns(m.uid, tolerance):
                owned.add(node)
            elif m.effect == HINT_EFFECT:
                foreign.add(node)
    return Steer(frozenset(owned), frozenset(foreign)) if owned or foreign else NO_STEER
