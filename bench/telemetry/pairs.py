"""``bench/run telemetry_pairs RESULT_ON_A RESULT_ON_B``: prepare/unprepare p50 with sampling on against off, with
intervals (issue 32: "Prepare and unprepare p50 unchanged within the interval of a paired run with sampling on and
off").

Both files are ``bench/run prepare --compare-with`` results of topodra against the same topodra (docs/telemetry.md,
*Cost*, has the commands): in the first, side A (the bench's own plugin) samples and side B runs with
``--telemetry=false``; in the second the sides swap. That bench runs each scenario in interleaved rounds, A B then
B A, one block per side each, so load on a shared machine falls on both alike; each block has its median. Per run,
scenario and operation, d_i = median_on_i - median_off_i of round i. The two sides differ in more than sampling
(node, driver name, how the process is started), and that difference shows as a bias of the same sign in both
runs while sampling's effect changes sides with it; so the estimate pairs round i of both runs,
e_i = (d_i(run 1) + d_i(run 2)) / 2, in which the bias cancels. The interval is the sign test's for the median
effect: the order statistics [e_(k), e_(n-k+1)] with the largest k that keeps at least 95% coverage (97.9% at
n = 10, 95.9% at n = 20; ``sign_test_rank``). "Unchanged" means it contains 0. Each run's own d are reported too.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any


def sign_test_rank(n: int, level: float = 0.95) -> tuple[int, float]:
    """The largest k with [d_(k), d_(n-k+1)] (order statistics, 1-based) covering the median with at least
    ``level``, and that coverage: 1 - 2 P(Binomial(n, 1/2) < k) (pure)."""
    def coverage(k: int) -> float:
        tail: int = sum(math.comb(n, i) for i in range(k))
        return 1.0 - 2.0 * tail / math.ldexp(1.0, n)
    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return k, coverage(k)


def interval(d: list[float], off_p50: float) -> dict[str, Any]:
    """Median of ``d`` and its sign-test interval (pure)."""
    n = len(d)
    k, conf = sign_test_rank(n)
    s = sorted(d)
    lo, hi = s[k - 1], s[n - k]
    return {"pairs": n, "diff_median_ms": round(statistics.median(d), 3), "interval_ms": [round(lo, 3), round(hi, 3)],
            "confidence": round(conf, 4), "diffs_ms": [round(x, 3) for x in d], "unchanged": lo <= 0 <= hi,
            "diff_median_pct_of_off": round(100 * statistics.median(d) / off_p50, 1) if off_p50 else None}


def diffs(result: dict[str, Any], on: str, scenario: str, op: str) -> tuple[list[float], float, float]:
    """(d_i on - off per round, p50 on, p50 off) of one run (``on``: the side that sampled, "a" or "b")."""
    off = "b" if on == "a" else "a"
    blocks = {k: next(s for s in result[k]["scenarios"] if s["name"] == scenario)["block_medians_ms"]
              for k in ("a", "b")}
    if len(blocks["a"]) != len(blocks["b"]) or not blocks["a"]:
        raise ValueError(f"{scenario}: {len(blocks['a'])} and {len(blocks['b'])} blocks: not paired")
    d = [x[op] - y[op] for x, y in zip(blocks[on], blocks[off], strict=True)]
    return d, statistics.median(x[op] for x in blocks[on]), statistics.median(y[op] for y in blocks[off])


def analyse(run1: dict[str, Any], run2: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for sc in [s["name"] for s in run1["a"]["scenarios"]]:
        for op in ("prepare", "unprepare"):
            d1, on1, off1 = diffs(run1, "a", sc, op)
            d2, on2, off2 = diffs(run2, "b", sc, op)
            if len(d1) != len(d2):
                raise ValueError(f"{sc}: {len(d1)} rounds in one run, {len(d2)} in the other")
            off_p50 = statistics.median([off1, off2])
            rows.append({"scenario": sc, "op": op, "on_p50_ms": [round(on1, 3), round(on2, 3)],
                         "off_p50_ms": [round(off1, 3), round(off2, 3)],
                         "run1_sampling_on_side_a": interval(d1, off1), "run2_sampling_on_side_b": interval(d2, off2),
                         **interval([(x + y) / 2 for x, y in zip(d1, d2, strict=True)], off_p50)})
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench/run telemetry_pairs", description=__doc__.splitlines()[0])
    ap.add_argument("on_a", type=Path, help="a bench/run prepare --compare-with result, side A sampling")
    ap.add_argument("on_b", type=Path, help="the swapped run: side B sampling")
    a = ap.parse_args(argv)
    run1, run2 = json.loads(a.on_a.read_text()), json.loads(a.on_b.read_text())
    rows = analyse(run1, run2)
    out = a.on_a.with_name(a.on_a.stem + "-paired.json")
    out.write_text(json.dumps({"bench": "telemetry_pairs", "sources": [a.on_a.name, a.on_b.name],
                               "configs": [run1.get("config", {}), run2.get("config", {})], "rows": rows,
                               "all_unchanged": all(r["unchanged"] for r in rows)}, indent=1) + "\n")
    for r in rows:
        print(f"{r['scenario']:30s} {r['op']:9s} on {r['on_p50_ms']} off {r['off_p50_ms']} ms  "
              f"effect {r['diff_median_ms']:+8.3f} ms [{r['interval_ms'][0]:+.3f}, {r['interval_ms'][1]:+.3f}] "
              f"({r['confidence']:.1%})  {'unchanged' if r['unchanged'] else 'CHANGED'}  "
              f"(run 1 {r['run1_sampling_on_side_a']['diff_median_ms']:+.3f}, "
              f"run 2 {r['run2_sampling_on_side_b']['diff_median_ms']:+.3f})")
    print(f"wrote {out}")
    return 0
