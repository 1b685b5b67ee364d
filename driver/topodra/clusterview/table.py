"""The inventory as text: a table per node, a summary per GPU model, pending claims by reason. Pure."""

from __future__ import annotations

from topodra.clusterview.hostcols import cpu_text, memory_text, stranded_text
from topodra.clusterview.model import FREE, ClusterView, NodeRow, RailCount

MAX_LISTED = 4  # claims named per pending group before "+N more"


def _grid(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def rails_text(rails: tuple[RailCount, ...]) -> str:
    """Free NICs per rail in rail order: ``11101111`` (one digit per rail), spaced when a count exceeds 9."""
    if not rails:
        return "-"
    counts = [str(r.free) for r in rails]
    return ("" if all(len(c) == 1 for c in counts) else " ").join(counts)


def rail_header(rows: tuple[NodeRow, ...]) -> str:
    known = sorted({r.rail for n in rows for r in n.rails if r.rail is not None})
    if not known:
        return "NICS/RAIL"
    return f"NICS/RAIL {known[0]}-{known[-1]}" if len(known) > 1 else f"NICS/RAIL {known[0]}"


def node_table(view: ClusterView) -> list[str]:
    host = any(n.host is not None for n in view.nodes)  # columns only where nodes report allocatable
    rows = [["NODE", "MODEL", "GPUS FREE", "NVLINK FREE/GPUS", rail_header(view.nodes), "TAINTED",
             *(["CPU FREE", "MEMORY FREE", "STRANDED BY CPU/MEM"] if host else [])]]
    for n in view.nodes:
        domains = " ".join(f"{d.label}:{d.free}/{d.total}" for d in n.domains) or "-"
        h = n.host
        rows.append([n.name + ("" if n.schedulable else " (unschedulable)"), n.model or "-",
                     f"{n.count(FREE)}/{len(n.gpus)}", domains, rails_text(n.rails),
                     tainted_text(n),
                     *(([cpu_text(h), memory_text(h), stranded_text(h)] if h else ["-", "-", "-"]) if host else [])])
    return _grid(rows)


def tainted_text(n: NodeRow) -> str:
    """The node's tainted devices, then its reserved GPUs per profile (``reserved ns/big: 8``)."""
    parts = [",".join(n.tainted_devices)] if n.tainted_devices else []
    parts += [f"reserved {who}: {k}" for who, k in sorted(n.reserved_gpus.items())]
    return "; ".join(parts) or "-"


def model_table(view: ClusterView) -> list[str]:
    rows = [["MODEL", "NODES", "GPUS", "FREE", "ALLOCATED", "TAINTED", "LARGEST CLAIM ANY/NVLINK/RAIL",
             "FREE NVLINK DOMAINS", "FRAGMENTED", "FREE ON UNSCHEDULABLE NODES"]]
    for m in view.models:
        rows.append([m.model, str(m.nodes), str(m.total), str(m.free), str(m.allocated), str(m.tainted),
                     f"{m.largest.count}/{m.largest.nvlink}/{m.largest.rail_aligned}",
                     f"{m.nvlink_domains_free}/{m.nvlink_domains}",
                     f"{m.fragmentation:.1f} ({m.fragmentation_ratio:.0%} of free)",
                     f"{m.free_unschedulable} on {m.unschedulable_nodes} node{_s(m.unschedulable_nodes)}"
                     if m.unschedulable_nodes else "-"])
    return _grid(rows)


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def unschedulable_text(free_unschedulable: int, nodes: int) -> str:
    """`` (120 of them on 15 unschedulable nodes)`` when free GPUs sit where no claim lands now, else ``""``."""
    if not nodes:
        return ""
    return f" ({free_unschedulable} of them on {nodes} unschedulable node{_s(nodes)})"


def summary_line(view: ClusterView) -> str:
    frag = view.fragmentation
    share = f" ({frag / view.free:.0%} of free)" if view.free else ""
    aside = unschedulable_text(view.free_unschedulable, view.unschedulable_nodes)
    by_cpu, by_mem = view.stranded_by_host
    host = f"; stranded by CPU {by_cpu}, by memory {by_mem}" if by_cpu or by_mem else ""
    reserved = f" ({view.reserved} of them reserved)" if view.reserved else ""
    return (f"{view.total} GPUs: {view.free} free{aside}, {view.allocated} allocated, "
            f"{view.tainted} tainted{reserved}; fragmented {frag:.1f} GPUs{share}{host}; "
            f"{len(view.pending)} pending claims")


UNSCHEDULABLE_NOTE = ("Unschedulable: cordoned, not Ready or with a NoSchedule/NoExecute node taint; their free GPUs "
                      "count as free but take no claim now (largest claim counts schedulable nodes only).")


HOST_NOTE = ("CPU/memory free: allocatable minus the requests of bound pods (NodeResourcesFit). Stranded by CPU/MEM: "
             "free GPUs the free CPU (memory) cannot give the node's per-GPU share (allocatable / GPUs).")


def pending_lines(view: ClusterView) -> list[str]:
    if not view.pending:
        return ["No pending claims."]
    out = [f"Pending claims ({len(view.pending)}), by the scheduler's reason:"]
    for g in view.pending_groups:
        names = ", ".join(g.claims[:MAX_LISTED]) + (f", +{len(g.claims) - MAX_LISTED} more"
                                                     if len(g.claims) > MAX_LISTED else "")
        out.append(f"  {len(g.claims):>4}  {g.reason}")
        out.append(f"        {names}")
    return out


def render_table(view: ClusterView) -> str:
    """The whole text report."""
    if not view.nodes:
        lines = [f"No ResourceSlices of {view.driver} on any node (is the kubelet plugin or the simulator running?)"]
    else:
        lines = node_table(view)
    lines += ["", *model_table(view), "", "Cluster: " + summary_line(view),
              *([UNSCHEDULABLE_NOTE] if view.unschedulable_nodes else []),
              *([HOST_NOTE] if any(n.host is not None for n in view.nodes) else []),
              "Fragmented: free GPUs the next request cannot use, expected over the placement scorer's request mix (" +
              ", ".join(f"{name} {p:.0%}" for name, p in view.mix) + ").",
              "", *pending_lines(view)]
    return "\n".join(lines) + "\n"

