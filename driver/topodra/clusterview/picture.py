"""The inventory as a PNG (matplotlib): one row per node, one cell per GPU, a rail strip of NICs.

Cells are free (light green), tainted (red), allocated-but-idle (yellow: the claim carries the ``Idle``
condition the kubelet plugin writes, docs/telemetry.md) or allocated, coloured by the claim's namespace
(allocated *and* tainted: the namespace or idle colour with a red border). A node's GPUs are grouped by
NVLink domain (a gap between domains); nodes sharing a multi-node NVLink domain (NVL72) are
adjacent under one shaded band labelled with the domain. Each node's compute NICs follow in
rail order. The cluster summary is the title.

Sizes are fixed in inches per cell, so the picture grows with the cluster and stays legible
(50 nodes x 8 GPUs, an 18-tray NVL72 rack). ``render_png`` returns where each device's cell
centre landed in the image, so a test can read the pixels back.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from topodra.clusterview.hostcols import HostCols, cpu_text, memory_text
from topodra.clusterview.model import ALLOCATED, FREE, RESERVED, TAINTED, Cell, ClusterView, NodeRow, domain_label
from topodra.clusterview.table import summary_line, unschedulable_text

FREE_COLOUR = "#b7e4c7"
TAINTED_COLOUR = "#d62828"
IDLE_COLOUR = "#ffea00"  # allocated, idle: no namespace colour is yellow
OTHER_COLOUR = "#4d4d4d"  # namespaces beyond the palette
UNSCHEDULABLE_MARK = "(x) unschedulable node: its free GPUs take no claim now"
# Namespaces, in order of GPUs held; no green, red or yellow, so they never read as free, tainted or idle.
PALETTE = ("#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7b4173", "#393b79",
           "#a55194", "#ce6dbd", "#7f7f7f", "#6baed6")
BAND_COLOUR = "#e8eef7"
EDGE_COLOUR = "#555555"
MIN_WIDTH_IN = 6.5
CHAR_IN_PER_PT = 0.0082  # average glyph width of DejaVu Sans, inches per point (bold: +10%)

CELL_IN = 0.24  # one GPU column, inches
ROW_IN = 0.24  # one node row, inches
CELL = 0.84  # filled share of a column / row
DOMAIN_GAP = 0.5  # columns between NVLink domains of one node
NIC_GAP = 1.2  # columns between the GPUs and the NIC strip
NIC_STEP = 0.75  # columns per NIC in the strip
DPI = 100


@dataclass(frozen=True)
class Picture:
    """What was drawn: image size and each cell's centre in pixels (x right, y down from the top left)."""

    path: str
    width: int
    height: int
    cells: dict[tuple[str, str], tuple[float, float]]  # (node, device) -> centre
    colours: dict[str, str]  # legend: "free", "tainted", namespaces -> hex colour
    host_labels: dict[str, str] = field(default_factory=dict)  # node -> its CPU/memory text, as drawn


STRANDED_COLOUR = "#b5179e"  # the CPU/memory text of a node whose free GPUs they strand
HOST_IN = 2.3  # room right of the NICs for "CPU 20/224  mem 148/2048Gi  7 GPUs stranded by CPU"


def host_label(h: HostCols) -> str:
    """A node's free CPU and memory, and the GPUs they strand, as the picture writes it."""
    text = f"CPU {cpu_text(h)}  mem {memory_text(h)}"
    parts = [f"{n} by {what}" for n, what in ((h.gpus_stranded_cpu, "CPU"), (h.gpus_stranded_memory, "memory")) if n]
    return text + (f"  stranded: {', '.join(parts)}" if parts else "")


def namespace_colours(view: ClusterView) -> dict[str, str]:
    """Namespace -> colour, the namespaces holding most devices first; the rest share OTHER_COLOUR."""
    held = Counter(c.namespace for n in view.nodes for c in (*n.gpus, *n.nics) if c.state == ALLOCATED)
    ordered = sorted(held, key=lambda ns: (-held[ns], ns or ""))
    return {str(ns): PALETTE[i] if i < len(PALETTE) else OTHER_COLOUR for i, ns in enumerate(ordered)}


def cell_colour(cell: Cell, ns_colours: dict[str, str]) -> str:
    if cell.state == FREE:
        return FREE_COLOUR
    if cell.state == TAINTED or cell.state == RESERVED:  # a reservation is drawn as the taint it is
        return TAINTED_COLOUR
    if cell.idle:
        return IDLE_COLOUR
    return ns_colours.get(str(cell.namespace), OTHER_COLOUR)


def blocked(cell: Cell) -> bool:
    """A NoSchedule/NoExecute taint on the device (shown as a red border on an allocated cell)."""
    return any(t.endswith((":NoSchedule", ":NoExecute")) for t in cell.taints)


def _shared_domains(view: ClusterView) -> dict[str, int]:
    """NVLink domains that span nodes (multi-node NVLink) -> GPUs published in them."""
    nodes_of: dict[str, set[str]] = {}
    gpus: Counter[str] = Counter()
    for n in view.nodes:
        for g in n.gpus:
            if g.domain:
                nodes_of.setdefault(g.domain, set()).add(n.name)
                gpus[g.domain] += 1
    return {d: gpus[d] for d, ns in nodes_of.items() if len(ns) > 1}


def row_order(view: ClusterView) -> list[tuple[NodeRow, str | None]]:
    """Nodes with their multi-node domain (if any), those of one domain adjacent."""
    shared = _shared_domains(view)
    keyed = []
    for i, n in enumerate(view.nodes):
        dom = next((g.domain for g in n.gpus if g.domain in shared), None)
        keyed.append(((dom or "", i), n, dom))
    keyed.sort(key=lambda k: k[0])
    return [(n, dom) for _k, n, dom in keyed]


def _gpu_columns(node: NodeRow) -> list[tuple[Cell, float]]:
    """Each GPU with its column; a gap between NVLink domains."""
    out: list[tuple[Cell, float]] = []
    x = 0.0
    prev: object = object()
    for g in node.gpus:
        if out and g.domain != prev:
            x += DOMAIN_GAP
        out.append((g, x))
        prev = g.domain
        x += 1.0
    return out


def _square(x: float, y: float, size: float) -> list[tuple[float, float]]:
    return [(x, y), (x + size, y), (x + size, y + size), (x, y + size)]


def title_lines(view: ClusterView) -> list[str]:
    lines = ["topodra inventory: " + summary_line(view)]
    for m in view.models:
        lines.append(f"{m.model}: {m.free}/{m.total} free on {m.nodes} nodes"
                     f"{unschedulable_text(m.free_unschedulable, m.unschedulable_nodes)}; "
                     f"largest claim now {m.largest.count} "
                     f"(NVLink {m.largest.nvlink}, rail-aligned {m.largest.rail_aligned}); "
                     f"{m.nvlink_domains_free}/{m.nvlink_domains} NVLink domains free; "
                     f"fragmented {m.fragmentation:.1f} ({m.fragmentation_ratio:.0%})")
    return lines


def preload() -> None:
    """Import what ``render_png`` needs (most of a first render's time), e.g. in the ``--watch`` worker."""
    try:  # the object API without pyplot: no global figure state, no GUI backend, fewer imports
        import matplotlib.backends.backend_agg
        import matplotlib.collections
        import matplotlib.figure
        import matplotlib.patches  # noqa: F401
    except ImportError:
        raise RuntimeError("--png needs matplotlib: pip install 'topodra[png]'") from None


def render_png(view: ClusterView, path: str | Path, dpi: int = DPI) -> Picture:
    """Draw the view into ``path`` (PNG). Needs matplotlib (``pip install 'topodra[png]'``)."""
    preload()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    rows = row_order(view)
    ns_colours = namespace_colours(view)
    shared = _shared_domains(view)
    columns = {n.name: _gpu_columns(n) for n, _d in rows}
    gpu_width = max((cols[-1][1] + 1.0 for cols in columns.values() if cols), default=1.0)
    rails = sorted({r.rail for n, _d in rows for r in n.rails if r.rail is not None})
    max_nics = max((len(n.nics) for n, _d in rows), default=0)
    nic_slots = max(len(rails), max_nics)
    nic_x0 = gpu_width + NIC_GAP
    width_units = nic_x0 + nic_slots * NIC_STEP + (0.5 if nic_slots else 0.0)
    band_label_in = 1.9 if shared else 0.0
    # Room for the longest label as drawn, " (x)" of unschedulable nodes included.
    name_in = 0.15 + 0.065 * max((len(n.name) + (0 if n.schedulable else 4) for n, _d in rows), default=4)
    axes_w_in = width_units * CELL_IN
    axes_h_in = max(len(rows), 1) * ROW_IN
    host_in = HOST_IN if any(n.host is not None for n, _d in rows) else 0.0
    fig_w = max(name_in + axes_w_in + band_label_in + host_in + 0.3, MIN_WIDTH_IN)
    titles = [(line, size, i == 0) for i, text in enumerate(title_lines(view))
              for size in (9.0 if i == 0 else 7.5,)
              for line in textwrap.wrap(text, max(20, int((fig_w - 0.2) / (size * CHAR_IN_PER_PT * (1.1 if i == 0
                                                                                                    else 1.0)))),
                                        subsequent_indent="    ")]
    legend: dict[str, str] = {"free": FREE_COLOUR, "tainted": TAINTED_COLOUR}
    if any(g.idle for n, _d in rows for g in n.gpus):
        legend["allocated, idle"] = IDLE_COLOUR
    legend.update({f"ns {ns}": c for ns, c in ns_colours.items() if c != OTHER_COLOUR})
    if OTHER_COLOUR in ns_colours.values():
        legend["other namespaces"] = OTHER_COLOUR
    # The "(x)" behind a node's name is explained in the legend too (it has no colour of its own).
    marks = [UNSCHEDULABLE_MARK] if any(not n.schedulable for n in view.nodes) else []
    legend_cols = max(1, min(len(legend) + len(marks), int(fig_w / 1.3)))
    legend_rows = -(-(len(legend) + len(marks)) // legend_cols)
    title_in = sum(0.2 if big else 0.16 for _t, _s, big in titles)
    top_in = 0.1 + title_in + 0.2 * legend_rows + 0.45
    bottom_in = 0.2
    fig_h = top_in + axes_h_in + bottom_in

    fig = Figure(figsize=(fig_w, fig_h), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((name_in / fig_w, bottom_in / fig_h, axes_w_in / fig_w, axes_h_in / fig_h))
    ax.set_xlim(0, width_units)
    ax.set_ylim(max(len(rows), 1), 0)
    ax.axis("off")
    pad = (1 - CELL) / 2
    centres: dict[tuple[str, str], tuple[float, float]] = {}
    boxes: list[list[tuple[float, float]]] = []  # corners: one PolyCollection draws every cell
    faces: list[str] = []
    edges: list[str] = []

    # Bands behind the nodes of one multi-node NVLink domain.
    start = 0
    for i in range(len(rows) + 1):
        if i == len(rows) or rows[i][1] != rows[start][1]:
            dom = rows[start][1] if rows else None
            if dom is not None:
                ax.add_patch(Rectangle((-0.2, start), width_units + 0.2, i - start, facecolor=BAND_COLOUR,
                                       edgecolor="#9fb3d1", linewidth=0.8, zorder=0))
                free = sum(1 for n, _d in rows[start:i] for g in n.gpus if g.domain == dom and g.state == FREE)
                ax.text(width_units + 0.3, (start + i) / 2, f"NVLink {domain_label(dom)}\n"
                        f"{shared[dom]} GPUs, {free} free", va="center", ha="left", fontsize=7)
            start = i

    host_x = width_units + 0.3 + band_label_in / CELL_IN
    host_labels: dict[str, str] = {}
    for y, (node, _dom) in enumerate(rows):
        if node.host is not None:
            host_labels[node.name] = host_label(node.host)
            ax.text(host_x, y + 0.5, host_labels[node.name], ha="left", va="center", fontsize=5.5,
                    color=STRANDED_COLOUR if node.host.stranded else "#444444")
        ax.text(-0.3, y + 0.5, node.name + ("" if node.schedulable else " (x)"), ha="right", va="center",
                fontsize=7, color="black" if node.schedulable else "#888888")
        for cell, x in columns[node.name]:
            boxes.append(_square(x + pad, y + pad, CELL))
            faces.append(cell_colour(cell, ns_colours))
            edges.append(TAINTED_COLOUR if cell.state == ALLOCATED and blocked(cell) else EDGE_COLOUR)
            centres[(node.name, cell.name)] = (x + 0.5, y + 0.5)
        for k, nic in enumerate(node.nics):
            slot = rails.index(nic.rail) if nic.rail in rails and len(rails) >= len(node.nics) else k
            x = nic_x0 + slot * NIC_STEP
            size = NIC_STEP * CELL
            boxes.append(_square(x + (NIC_STEP - size) / 2, y + 0.5 - size / 2, size))
            faces.append(cell_colour(nic, ns_colours))
            edges.append(EDGE_COLOUR)
            centres[(node.name, nic.name)] = (x + NIC_STEP / 2, y + 0.5)
    ax.add_collection(PolyCollection(boxes, facecolors=faces, edgecolors=edges, linewidths=0.6, zorder=2))

    ax.text(0, -0.3, "GPUs", fontsize=7, va="bottom")
    if nic_slots:
        ax.text(nic_x0, -0.55, "NICs by rail", fontsize=7, va="bottom")
        for k, r in enumerate(rails):
            ax.text(nic_x0 + k * NIC_STEP + NIC_STEP / 2, -0.05, str(r), fontsize=5.5, ha="center",
                    va="bottom", color="#444444")

    y_in = 0.1
    for line, size, big in titles:
        fig.text(0.1 / fig_w, 1 - y_in / fig_h, line, fontsize=size, fontweight="bold" if big else "normal",
                 va="top", ha="left")
        y_in += 0.2 if big else 0.16
    fig.legend(handles=[*(Patch(facecolor=c, edgecolor=EDGE_COLOUR, label=k) for k, c in legend.items()),
                        *(Patch(facecolor="none", edgecolor="none", label=m) for m in marks)],
               loc="upper left", bbox_to_anchor=(0.05 / fig_w, 1 - (y_in + 0.05) / fig_h),
               ncol=legend_cols, fontsize=7, frameon=False, handlelength=1.2, columnspacing=1.2,
               borderaxespad=0.0)

    width_px, height_px = (round(v) for v in fig.get_size_inches() * dpi)
    # One transform of all centres: a call per cell costs ~40 us, 35 ms for enterprise-400's 860 devices.
    pixels: dict[tuple[str, str], tuple[float, float]] = {}
    if centres:
        points = ax.transData.transform(list(centres.values()))
        pixels = {key: (float(px), float(height_px - py)) for key, (px, py) in zip(centres, points, strict=True)}
    fig.savefig(str(path), dpi=dpi, format="png")
    return Picture(path=str(path), width=int(width_px), height=int(height_px), cells=pixels,
                   colours={**{"free": FREE_COLOUR, "tainted": TAINTED_COLOUR, "idle": IDLE_COLOUR}, **ns_colours},
                   host_labels=host_labels)

