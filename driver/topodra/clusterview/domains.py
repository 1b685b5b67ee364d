"""The inventory by fabric domain: which node belongs where, the per-domain and per-model cells, and the
``--domain`` / ``--node`` drill-down. Pure.

At thousands of nodes one row per node is no picture anyone reads (512 nodes were 650 x 12,551 px), so
the picture aggregates: one cell per (fabric domain, GPU model) with its free, stranded, unschedulable,
allocated and tainted GPUs. A node's domain is a fabric tier label (``topodra.fabric``: Topograph's keys
first, then topodra's own), the scalable unit unless ``group_by`` names another tier; a node without any
tier label falls back to its *name pool*, the name without its trailing index (``h100-su2-7`` ->
``h100-su2``), which is how operators name racks and purchases when nothing else says.
"""

from __future__ import annotations

import difflib
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from topodra.clusterview.model import FREE, Largest, NodeRow, natural_key, summarize_models
from topodra.fabric import TIERS, topograph_value
from topodra.nodelabels import LEAF_GROUP, SCALABLE_UNIT, SPINE_GROUP

POOL = "pool"  # the name-pool fallback, also a --group-by choice
GROUP_BY = {"scalable-unit": SCALABLE_UNIT, "leaf-group": LEAF_GROUP, "spine-group": SPINE_GROUP, POOL: POOL}
DEFAULT_GROUP_BY = "scalable-unit"
MAX_SUGGESTIONS = 5
MAX_LISTED = 12  # known names an error lists when nothing is close
_INDEX = re.compile(r"[-_.]?\d+$")


class UnknownName(ValueError):
    """A ``--domain`` or ``--node`` that names nothing in the cluster (the message lists close matches)."""


def name_pool(node: str) -> str:
    """The node's name without its trailing index: ``a100-su1-12`` -> ``a100-su1``; the name if none."""
    return _INDEX.sub("", node) or node


def fabric_of(labels: Mapping[str, str] | None) -> dict[str, str]:
    """The node's fabric tiers, topodra key -> value: a Topograph label wins over topodra's own (as
    ``topodra.fabric`` mirrors it), so the inventory reads clusters where the mirror has not run yet."""
    labels = labels or {}
    out: dict[str, str] = {}
    for key in TIERS:
        got = topograph_value(labels, key)
        value = got[1] if got is not None else labels.get(key)
        if value:
            out[key] = str(value)
    return out


def domain_of(node: str, fabric: Mapping[str, str], group_by: str = DEFAULT_GROUP_BY) -> str:
    """The domain a node is counted under: the ``group_by`` tier, else the other tiers finest first, else
    its name pool."""
    key = GROUP_BY[group_by]
    if key == POOL:
        return name_pool(node)
    for k in (key, *TIERS):
        if fabric.get(k):
            return fabric[k]
    return name_pool(node)


def node_domains(node: str, fabric: Mapping[str, str]) -> set[str]:
    """Every name ``--domain`` may select this node by: each tier's value, and its name pool when it has none."""
    return set(fabric.values()) or {name_pool(node)}


# --------------------------------------------------------------------------- drill-down


def _unknown(what: str, name: str, known: Iterable[str]) -> UnknownName:
    """``what`` (e.g. ``no node 'x'``) with the known names closest to ``name``, else the first of them."""
    names = sorted(set(known), key=natural_key)
    # The same name but for leading zeros (su3 -> su03) first, then the closest spellings.
    same = [n for n in names if natural_key(n) == natural_key(name)]
    close = same + sorted((n for n in difflib.get_close_matches(name, names, n=MAX_SUGGESTIONS, cutoff=0.6)
                           if n not in same), key=natural_key)
    close = close[:MAX_SUGGESTIONS]
    if close:
        hint = "did you mean " + ", ".join(close) + "?"
    elif not names:
        hint = "the cluster has none"
    else:
        hint = "known: " + ", ".join(names[:MAX_LISTED]) + (f", ... ({len(names)} in all)"
                                                            if len(names) > MAX_LISTED else "")
    return UnknownName(f"{what} with GPUs of ours; {hint}")


def select_nodes(fabric: Mapping[str, Mapping[str, str]], *, domain: str | None = None,
                 node: str | None = None) -> set[str] | None:
    """The nodes ``--domain`` and ``--node`` keep (None: no filter), from ``{node: its fabric tiers}`` of the
    nodes that publish our devices. Both given: the node, which must lie in the domain.

    UnknownName when a name selects nothing, listing the close matches (or the known names).
    """
    if domain is None and node is None:
        return None
    names = set(fabric)
    if domain is not None:
        of = {n: node_domains(n, f) for n, f in fabric.items()}
        names = {n for n, ds in of.items() if domain in ds}
        if not names:
            raise _unknown(f"no fabric domain {domain!r}", domain, (d for ds in of.values() for d in ds))
    if node is not None:
        if node not in names:
            where = "" if domain is None else f" in fabric domain {domain!r}"
            raise _unknown(f"no node {node!r}{where}", node, names)
        names = {node}
    return names


# --------------------------------------------------------------------------- the cells


@dataclass(frozen=True)
class DomainCell:
    """One (fabric domain, GPU model): its GPUs by state. ``free`` counts every free GPU, as the per-node
    view does; ``stranded`` and ``unschedulable`` are the free ones no claim can get now."""

    domain: str
    model: str
    nodes: int
    total: int
    free: int
    allocated: int
    tainted: int
    stranded: int  # free on schedulable nodes, that the free CPU or memory leaves unusable (clusterview.hostcols)
    unschedulable: int  # free on cordoned / not Ready / NoSchedule-tainted nodes
    largest: Largest  # the largest claim placeable now on one schedulable node of the cell
    fragmentation: float  # F_n summed over the cell's nodes (the scorer's measure)

    @property
    def usable(self) -> int:
        """Free GPUs a claim can get now."""
        return self.free - self.stranded - self.unschedulable


def _stranded_by_model(row: NodeRow) -> dict[str, int]:
    """Free GPUs the node's CPU or memory strands, per model (whole GPUs; a mixed node's go to its free
    GPUs in order). Unschedulable nodes count under ``unschedulable`` instead."""
    h = row.host
    n = max(h.gpus_stranded_cpu, h.gpus_stranded_memory) if h is not None and row.schedulable else 0
    out: dict[str, int] = defaultdict(int)
    for g in reversed(row.gpus):  # the last free GPUs are the stranded ones (any order would do)
        if n <= 0:
            break
        if g.state == FREE:
            out[g.model or "unknown"] += 1
            n -= 1
    return out


def domain_cells(rows: Iterable[NodeRow], group_by: str = DEFAULT_GROUP_BY) -> list[DomainCell]:
    """Per (domain, model), domains in natural order: what the aggregated picture draws.

    Counts, largest claim and fragmentation are ``summarize_models`` over the domain's nodes, so a cell
    says what the model line of ``topodra inventory --domain D`` says.
    """
    by_domain: dict[str, list[NodeRow]] = defaultdict(list)
    for r in rows:
        if r.gpus:
            by_domain[domain_of(r.name, r.fabric, group_by)].append(r)
    out = []
    for dom in sorted(by_domain, key=natural_key):
        members = by_domain[dom]
        stranded: dict[str, int] = defaultdict(int)
        for r in members:
            for model, k in _stranded_by_model(r).items():
                stranded[model] += k
        for m in summarize_models(members):
            out.append(DomainCell(domain=dom, model=m.model, nodes=m.nodes, total=m.total, free=m.free,
                                  allocated=m.allocated, tainted=m.tainted, stranded=stranded[m.model],
                                  unschedulable=m.free_unschedulable, largest=m.largest,
                                  fragmentation=m.fragmentation))
    return out
