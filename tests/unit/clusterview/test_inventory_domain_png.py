"""The aggregated ``--png`` at issue 22's scale: 2,048 simulated nodes (16,384 GPUs, 64 scalable units, four
models) built in process from ``hack/clusters/superpod-16k.yaml``. The picture's size is bounded by the
domains, not the nodes, and every bar segment shows its state's colour where the renderer says it drew it."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

from testkit.paths import REPO
from testkit.simsources import cluster_sources

from topodra.clusterview.domainpicture import COLOURS, counts, render_domains_png
from topodra.clusterview.model import ClusterView, build_view


@functools.cache
def superpod() -> ClusterView:
    return build_view(cluster_sources(REPO / "hack/clusters/superpod-16k.yaml", fill=0.5))


def _rgb(hex_colour: str) -> tuple[float, ...]:
    return tuple(int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5))


def test_2048_nodes_draw_one_bar_per_scalable_unit_within_bounds(tmp_path: Path) -> None:
    import matplotlib.image as mpimg

    view = superpod()
    assert len(view.nodes) == 2048 and view.total == 16384
    pic = render_domains_png(view, tmp_path / "su.png")
    # 64 SUs of one model each: 64 bars, every GPU in exactly one segment of one bar.
    assert len(pic.cells) == 64 and {c.nodes for c in pic.cells} == {32}
    assert sorted(c.domain for c in pic.cells) == [f"su{i:02d}" for i in range(64)]
    # Sections by model (the file rotates H100, H200, A100, B200 per SU), domains in order within each.
    assert [c.domain for c in pic.cells][:3] == ["su02", "su06", "su10"] and pic.cells[0].model.startswith("A100")
    assert sum(sum(counts(c).values()) for c in pic.cells) == 16384
    assert {c.model for c in pic.cells} == {m.model for m in view.models}
    assert sum(c.stranded for c in pic.cells) > 0 and sum(c.unschedulable for c in pic.cells) > 0
    # Bounded by the 64 rows (the per-node picture was 650 x 12,551 px at 512 nodes).
    assert pic.width <= 1200 and pic.height <= 1800, (pic.width, pic.height)
    img = mpimg.imread(tmp_path / "su.png")
    assert img.shape[:2] == (pic.height, pic.width)
    drawn = {seg for (_d, _m, seg) in pic.segments}
    assert drawn == set(COLOURS)  # each state occurs somewhere in this load
    rows = sorted({round(y) for _x, y in pic.segments.values()})
    assert len(rows) == 64 and min(b - a for a, b in itertools.pairwise(rows)) >= 18
    for (dom, model, seg), (x, y) in pic.segments.items():
        got = img[round(y), round(x), :3]
        want = _rgb(COLOURS[seg])
        assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 0.02, (dom, model, seg, got)


def test_by_spine_group_one_bar_per_model_of_each_group(tmp_path: Path) -> None:
    pic = render_domains_png(superpod(), tmp_path / "sp.png", "spine-group")
    # 8 spine groups of 8 SUs, each SU one of four models in turn: 8 x 4 bars of 2 SUs (64 nodes) each.
    assert len(pic.cells) == 32 and {c.nodes for c in pic.cells} == {64} and {c.total for c in pic.cells} == {512}
    assert pic.height < render_domains_png(superpod(), tmp_path / "su.png").height
