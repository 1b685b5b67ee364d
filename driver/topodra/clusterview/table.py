"""The inventory as text: a table per node, a summary per GPU model, pending claims by reason. Pure."""

from __future__ import annotations

from topodra.clusterview.hostcols import cpu_text, memory_text, stranded_text
from topodra.clusterview.model import FREE, ClusterView, NodeRow, RailCount
from topodra.clusterview.usage import duration_text

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
    use = view.usage_reported  # columns only where a plugin writes telemetry summaries
    rows = [["NODE", "MODEL", "GPUS FREE", "NVLINK FREE/GPUS", rail_header(view.nodes), "TAINTED",
             *(["CPU FREE", "MEMORY FREE", "STRANDED BY CPU/MEM"] if host else []),
             *(["ACTIVITY", "GPU MEMORY", "IDLE"] if use else [])]]
    for n in view.nodes:
        domains = " ".join(f"{d.label}:{d.free}/{d.total}" for d in n.domains) or "-"
        h = n.host
        rows.append([n.name + ("" if n.schedulable else " (unschedulable)"), n.model or "-",
                     f"{n.count(FREE)}/{len(n.gpus)}", domains, rails_text(n.rails),
                     tainted_text(n),
                     *(([cpu_text(h), memory_text(h), stranded_text(h)] if h else ["-", "-", "-"]) if host else []),
                     *([share_text(n.activity), share_text(n.memory_used),
                        str(sum(1 for g in n.gpus if g.idle))] if use else [])])
    return _grid(rows)


def share_text(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def namespace_table(view: ClusterView) -> list[str]:
    """GPU-hours allocated against active per namespace (from the claims' telemetry summaries)."""
    rows = [["NAMESPACE", "GPUS", "REPORTING", "GPU-H ALLOCATED", "GPU-H ACTIVE", "ACTIVE"]]
    for ns in view.namespaces:
        rows.append([ns.namespace, str(ns.gpus), str(ns.gpus_reporting), f"{ns.gpu_hours_allocated:.2f}",
                     f"{ns.gpu_hours_active:.2f}", share_text(ns.active_share)])
    return _grid(rows)


def idle_lines(view: ClusterView) -> list[str]:
    if not view.idle_claims:
        return ["No idle claims."]
    out = [f"Idle claims ({len(view.idle_claims)}, {view.idle_gpus} GPUs), longest idle first:"]
    rows = [["NAMESPACE", "CLAIM", "PODS", "GPUS", "IDLE FOR", "NODES"]]
    for c in view.idle_claims:
        rows.append([c.namespace, c.claim, ",".join(c.pods) or "-", str(c.gpus), duration_text(c.idle_seconds),
                     ",".join(c.nodes)])
    return out + ["  " + line for line in _grid(rows)]


USAGE_NOTE = ("Activity, memory, GPU-hours and idle claims: from the summary and the Idle condition the kubelet plugin "
              "writes into each claim's status.devices (docs/telemetry.md); figures are as of each summary "
              "(written on change, at most every 5 min per claim, refreshed every 30 min by default); GPU-hours "
              "count the claims that exist now.")


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
              "", *pending_lines(view),
              *(["", *namespace_table(view), "", *idle_lines(view), USAGE_NOTE] if view.usage_reported else [])]
    return "\n".join(lines) + "\n"

