"""Reading an inventory picture back: each device's cell shows its state's colour (``free``, ``tainted``,
``idle`` -- allocated, its claim idle -- or ``allocated:<namespace>``) (the unit test on a
hand-built view and the cluster test on a real scheduler's allocations check the same way)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from topodra.clusterview.model import ClusterView


def _rgb(hex_colour: str) -> tuple[float, float, float]:
    return tuple(int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5))  # type: ignore[return-value]


def check_pixels(view: ClusterView, path: Path, expected: dict[tuple[str, str], str]) -> Any:
    """Render, read the PNG back and compare each device's cell centre with its state's colour."""
    import matplotlib.image as mpimg

    from topodra.clusterview.picture import FREE_COLOUR, IDLE_COLOUR, TAINTED_COLOUR, render_png

    pic = render_png(view, path)
    img = mpimg.imread(path)
    assert img.shape[:2] == (pic.height, pic.width)
    assert set(pic.cells) == set(expected)
    for (node, dev), (x, y) in pic.cells.items():
        state, _, ns = expected[(node, dev)].partition(":")
        want = {"free": FREE_COLOUR, "tainted": TAINTED_COLOUR, "idle": IDLE_COLOUR}.get(state) or pic.colours[ns]
        got = img[round(y), round(x), :3]
        assert max(abs(g - w) for g, w in zip(got, _rgb(want), strict=True)) < 0.02, (node, dev, state, got, want)
    return pic
