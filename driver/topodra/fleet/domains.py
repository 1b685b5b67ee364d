"""Which fabric domain a gang's pod should go to: FGD one level up. Pure.

A multi-node job runs at the speed of its slowest link, so all of its pods belong in one leaf group
(else one scalable unit). The node rule (``fleet.fgd``) cannot see that: it scores one pod on one
node. The domain rule, for a pod of a gang whose remaining ``need`` pods (``minCount`` minus the
siblings already bound or nominated) have to land in one domain of label ``key``:

1. **Siblings first.** A domain already holding siblings is the job's domain (the most siblings win).
2. **Else the domain reserved for the job** (issue 33, ``fleet.reserve``): a domain with candidate nodes
   that hold devices reserved or hinted for a ClaimProfile the pod's claims own, when it holds the whole
   job (``need`` pods); of several, the tightest (as in 3).
3. **Else the domain chosen for the gang a moment ago** (``intent``): kube-scheduler evaluates a gang's
   pods one after the other in one cycle and binds none of them before all fit, so the 2nd pod's call
   sees no sibling yet; the scorer remembers the domain it steered the 1st pod into.
4. **Else the tightest domain that holds the whole job**: among the domains where ``need`` pods fit
   (each candidate node counted as often as the pod's claims fit on it, first-fit emulation), the
   one with the best ``firstAvailable`` rank for the ``need``-th pod, then one without another job's
   reservation hint (``foreign`` nodes), then the fewest pods it could take, then the fewest free GPUs.
   So a small job fills a partly used leaf group and never breaks an empty one that a bigger job could
   use later, the node rule's packing carried to the domain, and leaves the next reservation's domain be.

The label (``domain_key``) is the PodGroup's topology key, or, where the candidates all share one of its
domains (the scheduler's topology-aware cycle offers one domain at a time), the finest fabric label that
still splits them. No domain holds the job: no preference. Nodes without the label belong to no domain.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass

from topodra.fleet.allocator import Rank, free_gpus
from topodra.fleet.state import NodeView

# Node labels of the fabric tiers, finest first (tier 0 = the leaf switch group).
LEAF_GROUP = "topodra.io/leaf-group"
SCALABLE_UNIT = "topodra.io/scalable-unit"
SPINE_GROUP = "topodra.io/spine-group"
FABRIC_KEYS = (LEAF_GROUP, SCALABLE_UNIT, SPINE_GROUP)

Place = Callable[[NodeView, frozenset[int]], "tuple[frozenset[int], Rank] | None"]
Candidate = tuple[str, "NodeView | None", frozenset[int]]


@dataclass(frozen=True)
class DomainFit:
    value: str
    pods: int  # how many of the pod's copies fit (capped at the pods wanted + 1)
    rank: Rank  # the firstAvailable rank the need-th copy would get (worst of the best ``need``)
    free_gpus: int


@dataclass(frozen=True)
class Choice:
    key: str
    value: str
    why: str  # "siblings", "reserved", "intent" or "tightest"


def domain_key(group_key: str | None, labels: Mapping[str, Mapping[str, str]], nodes: Sequence[str]) -> str | None:
    """The label whose domains the candidates are split by: the PodGroup's topology key when they
    span several of its domains, else the finest fabric key that splits them. Inside one placement of
    the scheduler's topology-aware cycle (every candidate in one scalable unit) that is the leaf group:
    "one leaf group, else one unit". None when no key splits them (nothing to choose)."""
    def splits(key: str) -> bool:
        return len({labels.get(n, {}).get(key) for n in nodes} - {None}) > 1

    for key in ([group_key] if group_key else []) + list(FABRIC_KEYS):
        if splits(key):
            return key
    return None


def copies(view: NodeView, used: frozenset[int], place: Place, limit: int) -> list[Rank]:
    """Ranks of the pod's copies that fit on the node one after the other (at most ``limit``)."""
    ranks: list[Rank] = []
    while len(ranks) < limit:
        got = place(view, used)
        if got is None or got[0] == used:
            break  # does not fit (or takes nothing: one copy is all that counts)
        used, rank = got
        ranks.append(rank)
    return ranks


def fits(candidates: Sequence[Candidate], labels: Mapping[str, Mapping[str, str]], key: str,
         place: Place, need: int) -> dict[str, DomainFit]:
    """Per domain value: how many copies of the pod its candidate nodes hold, and at what rank."""
    ranks: dict[str, list[Rank]] = {}
    free: dict[str, int] = {}
    for name, view, used in candidates:
        value = labels.get(name, {}).get(key)
        if value is None or view is None:
            continue
        ranks.setdefault(value, []).extend(copies(view, used, place, need + 1))
        free[value] = free.get(value, 0) + free_gpus(view, used)
    out = {}
    for value, rs in ranks.items():
        rs.sort()
        rank = rs[need - 1] if len(rs) >= need else (rs[-1] if rs else ())
        out[value] = DomainFit(value=value, pods=len(rs), rank=rank, free_gpus=free[value])
    return out


def choose(candidates: Sequence[Candidate], labels: Mapping[str, Mapping[str, str]], key: str,
           place: Place, need: int, sibling_nodes: Sequence[str] = (),
           intent: str | None = None, owned: Set[str] = frozenset(),
           foreign: Set[str] = frozenset()) -> Choice | None:
    """The domain (value of ``key``) the pod should go to, or None for no preference. ``owned``/``foreign``:
    nodes holding free devices reserved for the pod's job / hinted for another (``fleet.reserve.Steer``)."""
    here = [labels.get(n, {}).get(key) for n in sibling_nodes]
    counted = {v: here.count(v) for v in here if v is not None}
    if counted:
        best = max(sorted(counted), key=lambda v: counted[v])
        return Choice(key, best, "siblings")
    need = max(1, need)
    domains = fits(candidates, labels, key, place, need)
    whole = [d for d in domains.values() if d.pods >= need]
    if owned:
        mine = {labels.get(n, {}).get(key) for n in owned}
        reserved = [d for d in whole if d.value in mine]
        if reserved:
            top = min(reserved, key=lambda d: (d.rank, d.pods, d.free_gpus, d.value))
            return Choice(key, top.value, "reserved")
    if intent is not None and domains.get(intent, DomainFit(intent, 0, (), 0)).pods >= 1:
        return Choice(key, intent, "intent")
    if not whole:
        return None
    hinted = {labels.get(n, {}).get(key) for n in foreign} if foreign else set()
    best_fit = min(whole, key=lambda d: (d.rank, d.value in hinted, d.pods, d.free_gpus, d.value))
    return Choice(key, best_fit.value, "tightest")


def in_domain_scores(node_scores: Sequence[tuple[str, int]], inside: Sequence[tuple[str, int]],
                     labels: Mapping[str, Mapping[str, str]], choice: Choice) -> list[tuple[str, int]]:
    """Combine: nodes of the chosen domain keep their node-rule order, ranked among themselves
    (``inside``: 1..10 over the domain's nodes only) and lifted to 2..10; every other node that fits
    gets 1, a node where the claims do not fit 0. Candidate order is kept."""
    within = dict(inside)
    out = []
    for name, s in node_scores:
        if s <= 0:
            out.append((name, 0))
        elif labels.get(name, {}).get(choice.key) == choice.value:
            out.append((name, 2 + round(8 * (max(1, within.get(name, 1)) - 1) / 9)))
        else:
            out.append((name, 1))
    return out
