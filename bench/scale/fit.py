"""How a measured curve grows with cluster size (pure): a straight-line fit and the log-log slope.

"At most linear" is judged by the exponent k of y ~ c·n^k, fitted by least squares on logarithms over the
sizes measured: k <= 1 + TOLERANCE passes. A line y = a + b·n is fitted too, and its largest residual relative
to the value says how well a straight line describes the points (a fixed cost plus a per-node cost gives
k < 1 at small sizes, which is why the exponent, not the line, is the verdict).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

TOLERANCE = 0.15


@dataclass(frozen=True)
class Growth:
    points: int
    exponent: float
    intercept: float
    slope_per_node: float
    max_rel_residual: float
    at_most_linear: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def growth(sizes: Sequence[float], values: Sequence[float], tolerance: float = TOLERANCE) -> Growth | None:
    """The fit of ``values`` over ``sizes``; None with fewer than two usable (positive) points."""
    pts = [(float(n), float(v)) for n, v in zip(sizes, values, strict=True)
           if n > 0 and v is not None and math.isfinite(v) and v > 0]
    if len(pts) < 2 or len({n for n, _ in pts}) < 2:
        return None
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    k = _slope([math.log(x) for x in xs], [math.log(y) for y in ys])
    b = _slope(xs, ys)
    a = sum(ys) / len(ys) - b * sum(xs) / len(xs)
    resid = max(abs(y - (a + b * x)) / y for x, y in pts)
    return Growth(points=len(pts), exponent=k, intercept=a, slope_per_node=b, max_rel_residual=resid,
                  at_most_linear=k <= 1 + tolerance)


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
