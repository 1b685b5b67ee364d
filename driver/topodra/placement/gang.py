"""The request path for a pod of a gang: pick the fabric domain (``fleet.domains``), rank nodes inside it by FGD.

kube-scheduler 1.37 (``GenericWorkload``) schedules a PodGroup's pods in one cycle, one pod after the
other (``podGroupSchedulingDefaultAlgorithm``), assuming each in its snapshot and binding none until
``minCount`` fit; each pod's ``prioritize`` call carries only that pod and the nodes that passed the
filters. So the siblings of the first pods are invisible to the scorer during the cycle: it keeps the
domain it chose for a gang (its *intent*) for ``INTENT_TTL`` seconds and steers the next siblings to
it; once siblings are bound (or nominated), the watch shows them and they decide.

With ``TopologyAwareWorkloadScheduling`` the scheduler also tries each domain of the PodGroup's
topology key as its own *placement* (the candidates of a call are then one domain's nodes) and picks
among the feasible placements with its PlacementScore plugins (NodeResourcesFit's MostAllocated on CPU
and memory, PodGroupPodsCount), which do not ask extenders. So the scorer cannot pick the unit there; it
picks the finest fabric domain inside the unit offered (``fleet.domains.domain_key``: with a
scalable-unit constraint, the leaf group) and ranks nodes inside it. See docs/placement.md, "Gangs".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from topodra.fleet.allocator import Rank
from topodra.fleet.demand import Demand
from topodra.fleet.domains import Candidate, Choice, choose, domain_key, in_domain_scores
from topodra.fleet.fgd import Mix
from topodra.fleet.hostfrag import HostFit
from topodra.fleet.pods import Pods, pod_group_name
from topodra.fleet.reserve import NO_STEER, Steer
from topodra.fleet.state import NodeView
from topodra.placement.score import Scorer, steered

INTENT_TTL = 30.0  # seconds: far longer than one gang cycle, short enough to forget a failed one
MAX_INTENTS = 10_000

Obj = dict[str, Any]
NodeRule = Callable[[Sequence[Candidate]], list[tuple[str, int]]]  # candidates -> (node, 0..10), in order


class Gangs:
    """Gang-aware scoring; owns the intents (gang -> chosen domain). Callers hold the cache lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.intents: dict[tuple[str, str], tuple[Choice, float]] = {}
        self.last: Choice | None = None  # the most recent decision (tests, debugging)

    def _intent(self, gang: tuple[str, str], key: str) -> str | None:
        got = self.intents.get(gang)
        if got is None:
            return None
        choice, until = got
        if until < self.clock() or choice.key != key:
            del self.intents[gang]
            return None
        return choice.value

    def _remember(self, gang: tuple[str, str], choice: Choice) -> None:
        if len(self.intents) >= MAX_INTENTS:
            now = self.clock()
            self.intents = {g: v for g, v in self.intents.items() if v[1] >= now}
            if len(self.intents) >= MAX_INTENTS:
                self.intents.clear()
        self.intents[gang] = (choice, self.clock() + INTENT_TTL)

    def score(self, pod: Obj, pods: Pods, labels: dict[str, dict[str, str]],
              candidates: Sequence[Candidate], demands: Sequence[Demand], mix: Mix,
              scorer: Scorer, hosts: Sequence[HostFit | None] | None = None,
              rule: NodeRule | None = None, steer: Steer = NO_STEER) -> list[tuple[str, int]]:
        """(node, 0..10) per candidate: the node rule alone when the pod is in no gang, no domain
        label is known, or the candidates already share one domain. ``hosts``: per candidate its free CPU
        and memory for this pod (the scorer's CPU/memory-aware rule), or None. ``rule``: the node rule over
        some candidates when the caller has a faster one than ``scorer.score`` (``placement.bystate``).
        ``steer``: the pod's reservation steering (``fleet.reserve``): the node rule's steering term, and the
        domain reserved for the pod's job first."""
        if rule is None:
            host_of = dict(zip((c[0] for c in candidates), hosts, strict=True)) if hosts is not None else None

            def by_node(cs: Sequence[Candidate]) -> list[tuple[str, int]]:
                cs_hosts = [host_of[c[0]] for c in cs] if host_of is not None else None
                return scorer.score(cs, demands, mix, cs_hosts)

            rule = by_node
        if steer:
            plain = rule

            def with_steering(cs: Sequence[Candidate]) -> list[tuple[str, int]]:
                return steered(plain(cs), steer, lambda ns: plain([c for c in cs if c[0] in ns]))

            rule = with_steering
        node_scores = rule(candidates)
        self.last = None
        group = pod_group_name(pod)
        if not group or not demands:
            return node_scores
        meta = pod.get("metadata") or {}
        ns, name = str(meta.get("namespace") or "default"), str(meta.get("name") or "")
        record = pods.group(ns, group)
        names = [c[0] for c in candidates]
        key = domain_key(record.topology_key if record else None, labels, names)
        if key is None:
            return node_scores  # the candidates share every domain: nothing to choose
        siblings = pods.siblings(ns, group, exclude=name)
        placed = [s.node for s in siblings if s.node]
        size = max(record.min_count if record else 1, len(siblings) + 1)
        need = max(1, size - len(placed))
        key_demands = tuple(demands)

        def place(view: NodeView, used: frozenset[int]) -> tuple[frozenset[int], Rank] | None:
            return scorer.placement(view, used, key_demands)

        gang = (ns, group)
        choice = choose(candidates, labels, key, place, need, placed, self._intent(gang, key), steer.owned,
                        steer.foreign)
        if choice is None:
            return node_scores
        self._remember(gang, choice)
        self.last = choice
        inside = [c for c in candidates if labels.get(c[0], {}).get(key) == choice.value]
        return in_domain_scores(node_scores, rule(inside), labels, choice)
