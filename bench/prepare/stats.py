"""Latency summaries of the prepare bench: nearest-rank percentiles, in milliseconds (pure)."""

from __future__ import annotations

import math
import statistics


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of an ascending list."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def summarize(samples_s: list[float]) -> dict[str, float | int]:
    """Latency summary in milliseconds."""
    v = sorted(x * 1000 for x in samples_s)
    if not v:
        return {"n": 0}
    return {"n": len(v), "min": round(v[0], 3), "median": round(statistics.median(v), 3),
            "mean": round(statistics.fmean(v), 3), "p90": round(percentile(v, 90), 3),
            "p99": round(percentile(v, 99), 3), "max": round(v[-1], 3)}
