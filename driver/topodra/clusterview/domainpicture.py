"""The inventory as a PNG at scale (matplotlib): one bar per (fabric domain, GPU model).

One row per node stops being a picture past a few dozen nodes (512 nodes drew 650 x 12,551 px). Here each
row is a ``clusterview.domains`` cell, a bar as long as its GPUs (the longest bar a fixed width), split into
free GPUs a claim can get now (green), free ones stranded by the node's CPU or memory (magenta), free ones
on unschedulable nodes (grey), tainted (red) and allocated (blue). Left of the bar the domain, model and
node count; right of it the free GPUs and the largest claim placeable now. Rows of one domain share a
shaded band. So the picture grows with the number of domains, not nodes: 64 scalable units of 2,048 nodes
fit in about 1,000 x 1,600 px. ``--domain NAME`` / ``--node NAME`` draw the per-node picture
(``clusterview.picture``) of what they select.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

from topodra.clusterview.domains import DEFAULT_GROUP_BY, DomainCell, domain_cells
from topodra.clusterview.model import ClusterView, ModelSummary, natural_key
from topodra.clusterview.picture import CHAR_IN_PER_PT, EDGE_COLOUR, FREE_COLOUR, TAINTED_COLOUR, preload
from topodra.clusterview.table import summary_line

# Segment order along a bar, and colours: green / magenta / grey never read as allocated blue or tainted red.
SEGMENTS = ("usable", "stranded", "unschedulable", "tainted", "allocated")
COLOURS = {"usable": FREE_COLOUR, "stranded": "#b5179e", "unschedulable": "#bdbdbd",
           "tainted": TAINTED_COLOUR, "allocated": "#1f77b4"}
LEGEND = {"usable": "free (a claim can get it now)", "stranded": "free, stranded by the node's CPU/memory",
          "unschedulable": "free on unschedulable nodes", "tainted": "tainted", "allocated": "allocated"}
BAND_COLOURS = ("#ffffff", "#eef2f8")  # alternate domains
ROW_IN = 0.2  # one cell's row, inches
BAR_H = 0.72  # bar's share of the row
BAR_IN = 4.5  # the longest bar, inches
FONT = 6.5  # row labels, points
DPI = 100
GROUP_TEXT = {"scalable-unit": "scalable unit", "leaf-group": "leaf group", "spine-group": "spine group",
              "pool": "node-name pool"}


@dataclass(frozen=True)
class DomainPicture:
    """What was drawn: image size, and the centre in pixels of each bar segment that has GPUs."""

    path: str
    width: int
    height: int
    cells: tuple[DomainCell, ...]
    segments: dict[tuple[str, str, str], tuple[float, float]]  # (domain, model, segment) -> centre
    colours: dict[str, str]  # segment -> hex colour


def counts(cell: DomainCell) -> dict[str, int]:
    """GPUs per segment; they add up to ``cell.total``."""
    return {"usable": cell.usable, "stranded": cell.stranded, "unschedulable": cell.unschedulable,
            "tainted": cell.tainted, "allocated": cell.allocated}


def left_label(cell: DomainCell) -> str:
    """The domain and its node count (the model is the section's)."""
    return f"{cell.domain} ({cell.nodes})"


def right_label(cell: DomainCell) -> str:
    text = f"{cell.free}/{cell.total}"
    if cell.stranded or cell.unschedulable:
        text += f", {cell.usable} usable"
    return text + f", largest {cell.largest.count}"


def section_label(m: ModelSummary) -> str:
    """A model's section header: its free GPUs, largest claim placeable now and fragmentation."""
    return (f"{m.model}: {m.free}/{m.total} free on {m.nodes} nodes; largest claim now {m.largest.count}; "
            f"fragmented {m.fragmentation:.1f} ({m.fragmentation_ratio:.0%})")


def render_domains_png(view: ClusterView, path: str | Path, group_by: str = DEFAULT_GROUP_BY,
                       dpi: int = DPI) -> DomainPicture:
    """Draw the view by fabric domain into ``path`` (PNG). Needs matplotlib (``pip install 'topodra[png]'``).

    Matplotlib's Agg renders text glyph by glyph (~0.1 ms each here), so labels are short: the model heads
    its section, a row names its domain and node count, and the columns are explained once above them.
    """
    preload()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    cells = sorted(domain_cells(view.nodes, group_by), key=lambda c: (c.model, natural_key(c.domain)))
    summaries = {m.model: m for m in view.models}
    lines: list[DomainCell | str] = []  # a section header (model) or a cell, top to bottom
    for c in cells:
        if not lines or (isinstance(lines[-1], DomainCell) and lines[-1].model != c.model):
            lines.append(c.model)
        lines.append(c)
    rows = max(len(lines), 1)
    longest = max((c.total for c in cells), default=1) or 1
    char_in = FONT * CHAR_IN_PER_PT
    left_in = 0.25 + char_in * max((len(left_label(c)) for c in cells), default=10)
    right_in = 0.25 + char_in * max((len(right_label(c)) for c in cells), default=10)
    section_in = 0.3 + (FONT + 0.5) * CHAR_IN_PER_PT * 1.1 * max((len(section_label(m)) for m in view.models),
                                                                  default=0)
    fig_w = math.ceil(max(left_in + BAR_IN + right_in + 0.2, section_in, 6.5) * dpi) / dpi  # whole pixels
    domains = len({c.domain for c in cells})
    heading = (f"By {GROUP_TEXT.get(group_by, group_by)} and GPU model: {domains} "
               f"domain{'' if domains == 1 else 's'}, {len(view.nodes)} nodes. Left: domain (nodes); right: free/GPUs, "
               "usable now where some are stranded or unschedulable, the largest claim placeable now. "
               "topodra inventory --domain NAME draws a domain's nodes, --node NAME one node's GPUs.")
    texts = ["topodra inventory: " + summary_line(view), heading]
    titles = [(line, size, i == 0) for i, text in enumerate(texts)
              for size in (9.0 if i == 0 else 7.0,)
              for line in textwrap.wrap(text, max(20, int((fig_w - 0.2) / (size * CHAR_IN_PER_PT * (1.1 if i == 0
                                                                                                    else 1.0)))),
                                        subsequent_indent="    ")]
    legend_cols = max(1, min(len(SEGMENTS), int(fig_w / 2.0)))
    legend_rows = -(-len(SEGMENTS) // legend_cols)
    title_in = sum(0.2 if big else 0.15 for _t, _s, big in titles)
    top_in = 0.1 + title_in + 0.2 * legend_rows + 0.15
    bottom_in = 0.15
    axes_h_in = rows * ROW_IN
    fig_h = math.ceil((top_in + axes_h_in + bottom_in) * dpi) / dpi

    fig = Figure(figsize=(fig_w, fig_h), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((left_in / fig_w, bottom_in / fig_h, BAR_IN / fig_w, axes_h_in / fig_h))
    per_in = longest / BAR_IN  # GPUs per inch along x
    ax.set_xlim(0, longest)
    ax.set_ylim(rows, 0)
    ax.axis("off")

    boxes: list[list[tuple[float, float]]] = []
    faces: list[str] = []
    centres: dict[tuple[str, str, str], tuple[float, float]] = {}
    left, right = -(left_in - 0.05) * per_in, longest + (right_in - 0.05) * per_in
    for y, line in enumerate(lines):  # zebra bands: the eye follows a row from its label to its numbers
        if isinstance(line, DomainCell) and y % 2:
            boxes.append([(left, y), (right, y), (right, y + 1), (left, y + 1)])
            faces.append(BAND_COLOURS[1])
    bands = len(boxes)
    pad = (1 - BAR_H) / 2
    for y, line in enumerate(lines):
        if not isinstance(line, DomainCell):
            m = summaries.get(line)
            ax.text(left, y + 0.6, section_label(m) if m else line, ha="left", va="center", fontsize=FONT + 0.5,
                    fontweight="bold")
            continue
        cell = line
        x = 0.0
        for seg, k in counts(cell).items():
            if k <= 0:
                continue
            boxes.append([(x, y + pad), (x + k, y + pad), (x + k, y + 1 - pad), (x, y + 1 - pad)])
            faces.append(COLOURS[seg])
            centres[(cell.domain, cell.model, seg)] = (x + k / 2, y + 0.5)
            x += k
        ax.text(-0.1 * per_in, y + 0.5, left_label(cell), ha="right", va="center", fontsize=FONT)
        ax.text(cell.total + 0.1 * per_in, y + 0.5, right_label(cell), ha="left", va="center", fontsize=FONT,
                color="#333333")
    ax.add_collection(PolyCollection(boxes, facecolors=faces, edgecolors=["none"] * bands +
                                     [EDGE_COLOUR] * (len(boxes) - bands), linewidths=0.4, zorder=1,
                                     clip_on=False))
    if not cells:
        ax.text(0, 0.5, f"No GPUs of {view.driver} on any node", va="center", fontsize=FONT)

    y_in = 0.1
    for text, size, big in titles:
        fig.text(0.1 / fig_w, 1 - y_in / fig_h, text, fontsize=size, fontweight="bold" if big else "normal",
                 va="top", ha="left")
        y_in += 0.2 if big else 0.15
    fig.legend(handles=[Patch(facecolor=COLOURS[s], edgecolor=EDGE_COLOUR, label=LEGEND[s]) for s in SEGMENTS],
               loc="upper left", bbox_to_anchor=(0.05 / fig_w, 1 - (y_in + 0.03) / fig_h), ncol=legend_cols,
               fontsize=7, frameon=False, handlelength=1.2, columnspacing=1.2, borderaxespad=0.0)

    width_px, height_px = (round(v) for v in fig.get_size_inches() * dpi)
    pixels: dict[tuple[str, str, str], tuple[float, float]] = {}
    if centres:
        points = ax.transData.transform(list(centres.values()))
        pixels = {key: (float(px), float(height_px - py)) for key, (px, py) in zip(centres, points, strict=True)}
    fig.savefig(str(path), dpi=dpi, format="png")
    return DomainPicture(path=str(path), width=int(width_px), height=int(height_px), cells=tuple(cells),
                         segments=pixels, colours=dict(COLOURS))
