"""Paired comparison of policies in a ``bench/placement`` result (pure over the stored document).

``python -m bench.placement.paired [--gang] RESULT.json BASE OTHER [OTHER ...]`` prints a Markdown table (``--gang``:
the multi-node rows of ``gang.TABLE_ROWS``, waits per job size and the reservation metrics): per metric,
each policy's mean [95% interval] over its seeds, and per OTHER the paired difference OTHER - BASE (the same
seed is the same task window, so the difference per seed removes the window's own variance) with the change of
the mean in percent. The target verdicts of docs/placement.md are read off this table.

One metric is derived from each run's series rather than stored by the run: ``utilisation_while_waiting``, the
GPU utilisation time-averaged over the steps of the arrival window at which some job waited (the window's
first steps fill an empty cluster; this is the utilisation once the cluster is full).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.placement import model as pm

ROWS: list[tuple[str, str, int]] = [
    ("stranded_gpus", "stranded GPUs (mean)", 2),
    ("stranded_gpus_cpu", "stranded by CPU (mean)", 2),
    ("stranded_gpus_memory", "stranded by memory (mean)", 2),
    ("utilisation", "GPU utilisation (window)", 3),
    ("utilisation_while_waiting", "GPU utilisation while jobs wait", 3),
    ("goodput", "goodput (model)", 3),
    ("wait_mean_s_all", "mean wait of GPU jobs, incl. still waiting (s)", 0),
    ("wait_p95_s.1", "1-GPU wait p95, placed jobs (s)", 0),
    ("servers_8_free", "servers with 8 free GPUs (mean)", 2),
    ("wait_p95_s.8", "8-GPU wait p95, placed jobs (s)", 0),
    ("wait_p95_s_all.8", "8-GPU wait p95, incl. still waiting (s)", 0),
    ("waiting_at_end", "jobs still waiting at the window's end", 1),
    ("cpu_only_pods_on_gpu_nodes", "CPU-only pods on GPU nodes (mean)", 1),
    ("cpu_only_jobs", "CPU-only tasks in the window", 1),
    ("scorer_cpu_p99_ms", "prioritize CPU p99 (ms)", 2),
]


def utilisation_while_waiting(run: Mapping[str, Any]) -> float:
    """Time-averaged used/total GPUs over the window's steps at which some job waited; NaN if none did."""
    series = run.get("series") or []
    t0, t1 = run["metrics"]["window_s"]
    total = busy = 0.0
    for i, s in enumerate(series):
        a = max(float(s["t"]), t0)
        b = min(float(series[i + 1]["t"]) if i + 1 < len(series) else t1, t1)
        if b > a and s.get("waiting"):
            total += b - a
            busy += (b - a) * s["used"] / run["gpus"]
    return busy / total if total > 0 else math.nan


def run_values(run: Mapping[str, Any]) -> dict[str, float]:
    """The run's flattened metrics plus the derived ones (module docstring)."""
    return {**pm.flatten(run["metrics"]), "utilisation_while_waiting": utilisation_while_waiting(run)}


def compare(runs: Sequence[Mapping[str, Any]], base: str, others: Sequence[str],
            keys: Sequence[str]) -> dict[str, dict[str, dict[str, float]]]:
    """``{"policy": {key: interval}}`` for base and others, and ``{"other-base": {key: paired interval}}``,
    all over the seeds every one of these policies ran (a matrix cut short compares like with like)."""
    by = {(r["policy"], int(r["seed"])): run_values(r) for r in runs}
    seeds: set[int] | None = None
    for p in [base, *others]:
        mine = {s for q, s in by if q == p}
        if not mine:
            raise ValueError(f"no runs of policy ({p}) in the result")
        seeds = mine if seeds is None else seeds & mine
    common = sorted(seeds or ())
    out: dict[str, dict[str, dict[str, float]]] = {}
    for p in [base, *others]:
        out[p] = {k: pm.interval([by[(p, s)].get(k, math.nan) for s in common]) for k in keys}
    for p in others:
        out[f"{p}-{base}"] = {k: pm.interval([by[(p, s)].get(k, math.nan) - by[(base, s)].get(k, math.nan)
                                              for s in common]) for k in keys}
    return out


def _cell(iv: Mapping[str, float] | None, digits: int) -> str:
    if not iv or math.isnan(iv["mean"]):
        return "-"
    if math.isnan(iv["lo"]):
        return f"{iv['mean']:.{digits}f}"
    return f"{iv['mean']:.{digits}f} [{iv['lo']:.{digits}f}, {iv['hi']:.{digits}f}]"


def markdown(doc: Mapping[str, Any], base: str, others: Sequence[str],
             rows: Sequence[tuple[str, str, int]] = ROWS) -> str:
    got = compare(doc["runs"], base, others, [k for k, _l, _d in rows])
    n = {p: int(max((iv.get("n", 0) for iv in got[p].values()), default=0)) for p in [base, *others]}
    head = ["metric", *(f"({p}) n={n[p]}" for p in [base, *others]),
            *(f"({p}) - ({base}), paired [change of mean]" for p in others)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for key, label, digits in rows:
        cells = [_cell(got[p].get(key), digits) for p in [base, *others]]
        for p in others:
            diff, b = got[f"{p}-{base}"].get(key), got[base].get(key)
            cell = _cell(diff, digits)
            if cell != "-" and b and b["mean"] and not math.isnan(b["mean"]):
                cell += f" [{100 * got[p][key]['mean'] / b['mean'] - 100:+.0f}%]"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    rows = ROWS
    if argv[:1] == ["--gang"]:
        from bench.placement.gang import TABLE_ROWS
        rows, argv = TABLE_ROWS, argv[1:]
    if len(argv) < 3 or argv[0] in ("-h", "--help"):
        print("usage: python -m bench.placement.paired [--gang] RESULT.json BASE OTHER [OTHER ...]", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    try:
        doc = json.loads(Path(argv[0]).read_text())
        print(markdown(doc, argv[1], argv[2:], rows))
    except (OSError, ValueError, KeyError) as e:
        print(f"bench.placement.paired: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
