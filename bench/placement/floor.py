"""How short can the 64-GPU jobs' wait be on a stream? A floor estimate, with no cluster (issue 33). Pure.

Why: issue 33 asks (g) for a 64-GPU p95 wait of at most 0.5x (f)'s. Session 11 measured that on the worst seeds
those jobs wait behind *other big jobs of the one model they accept*, which no reservation can shorten. This module
computes how long the big jobs must wait from each other alone, so a missed target can be told apart from an
unreachable one.

The model, "big jobs alone" (``floor_starts``):

* only the stream's jobs of at least ``min_gpus`` GPUs (``min_gpus`` >= 8: whole servers); every smaller job is
  assumed away, as if a perfect reservation with perfect backfill kept each of them off every server a big job
  will need, at no cost;
* each job runs for its true duration and is never preempted;
* arrival order is kept in the way Slurm's conservative backfill keeps it: jobs are placed in arrival order, each
  at the earliest time at which ``pods`` whole servers of its unit (the PodGroup's topology key) of a listed model
  are free for its whole run, around the jobs placed before it; a later job may start earlier than an earlier
  one only where it delays none of them (it is placed around them);
* servers are chosen by ``choice``: ``"preference"`` takes the job's preference order first (what the
  ``firstAvailable`` claims do: an ``h200>h100>a100`` job takes H200 servers when they are free), ``"scarce"``
  takes the model the fewest preference lists of the stream accept first (an ``h200>h100>a100`` job takes A100
  servers and leaves H200 to the jobs that accept nothing else).

It is an estimate, not a proof: choosing other servers for earlier jobs can leave a better slot for a later one,
and a policy that lets a later big job delay an earlier one can shorten one wait by lengthening another. The
bench's own waits are also measured on ``--tick`` steps; here time is continuous.

``python -m bench.placement.floor RESULT.json [--min-gpus 64,32,8]`` rebuilds the streams of a
``bench/run placement --multinode`` result (its stored arguments and seeds), computes the floor per seed and prints
it beside each policy's 64-GPU p95 wait in that file.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.placement import model as pm

CHOICES = ("preference", "scarce")


@dataclass(frozen=True)
class Server:
    name: str
    model: str
    unit: str


def servers_of(cluster: str | Path) -> tuple[list[Server], pm.NodeCapacity]:
    """The cluster file's servers with their model and unit, from the slices topodra would publish for them
    (``simulate.plan`` + the mock discovery + ``slices.build_slices``) read by the bench's own
    ``inventory_from_slices`` with topodra's class catalog: the same models and class matches as a replay."""
    from topodra.classcatalog import catalog
    from topodra.simulate import discover, load_cluster, plan
    from topodra.slices import build_slices

    nodes = plan(load_cluster(cluster))
    slices = [s for n in nodes for s in build_slices(pm.DRIVER, n.name, None, discover(n), 1)]
    node_su = {n.name: n.labels.get(pm.SU_LABEL, "") for n in nodes}
    inv = pm.inventory_from_slices(slices, node_su, {c.name: c.match for c in catalog()})
    return [Server(n, inv.node_model(n), node_su[n]) for n in inv.nodes], inv


def model_order(job: pm.Job, inv: pm.NodeCapacity, choice: str, demand: Mapping[str, int]) -> list[str]:
    """The models ``job`` may take, in the order it takes them (module docstring, ``choice``)."""
    if choice not in CHOICES:
        raise ValueError(f"choice must be one of {CHOICES}, got {choice!r}")
    ordered: list[str] = []
    for cls in job.classes:  # the preference order: class by class, as firstAvailable tries them
        ordered += sorted(m for m in inv.accepts.get(cls, frozenset()) if m not in ordered)
    if choice == "scarce":
        pref = {m: i for i, m in enumerate(ordered)}
        return sorted(ordered, key=lambda m: (demand.get(m, 0), pref[m]))
    return ordered


def demand_of(jobs: Sequence[pm.Job], inv: pm.NodeCapacity) -> dict[str, int]:
    """model -> how many of the stream's distinct preference lists accept it."""
    out: dict[str, int] = {}
    for prefs in sorted({j.prefs for j in jobs}):
        for m in frozenset().union(*(inv.accepts.get(c, frozenset()) for c in pm.PREFERENCES[prefs])):
            out[m] = out.get(m, 0) + 1
    return out


def _free(busy: Sequence[tuple[float, float]], t: float, end: float) -> bool:
    return all(e <= t or s >= end for s, e in busy)


def floor_starts(jobs: Sequence[pm.Job], servers: Sequence[Server], inv: pm.NodeCapacity, min_gpus: int = 64,
                 choice: str = "preference") -> dict[int, float]:
    """job id -> its start in the "big jobs alone" model (module docstring), for every job of at least
    ``min_gpus`` GPUs; a job no unit can ever hold is left out."""
    if min_gpus < 8:
        raise ValueError(f"min_gpus must be at least 8 (whole servers), got {min_gpus}")
    big = sorted((j for j in jobs if j.gpus >= min_gpus), key=lambda j: (j.arrival, j.id))
    demand = demand_of(jobs, inv)
    busy: dict[str, list[tuple[float, float]]] = {s.name: [] for s in servers}
    starts: dict[int, float] = {}
    for job in big:
        order = model_order(job, inv, choice, demand)
        rank = {m: i for i, m in enumerate(order)}
        usable = [s for s in servers if s.model in rank]
        times = sorted({job.arrival} | {e for s in usable for _b, e in busy[s.name] if e > job.arrival})
        for t in times:
            end = t + job.duration
            by_unit: dict[str, list[Server]] = {}
            for s in usable:
                if _free(busy[s.name], t, end):
                    by_unit.setdefault(s.unit, []).append(s)
            fits = {u: ss for u, ss in by_unit.items() if len(ss) >= job.pods}
            if not fits:
                continue
            # The unit whose chosen servers rank best, then its name; in it, servers by model rank, then name.
            picks = {u: sorted(ss, key=lambda s: (rank[s.model], s.name))[:job.pods] for u, ss in fits.items()}
            unit = min(picks, key=lambda u: (sorted(rank[s.model] for s in picks[u]), u))
            for s in picks[unit]:
                busy[s.name].append((t, end))
            starts[job.id] = t
            break
    return starts


def floor_waits(jobs: Sequence[pm.Job], starts: Mapping[int, float], gpus: int = 64) -> list[float]:
    return [starts[j.id] - j.arrival for j in jobs if j.gpus == gpus and j.id in starts]


def checked_args(result: Mapping[str, Any]) -> Mapping[str, Any]:
    """The result's stored arguments; ValueError unless it is a ``--multinode`` run on the synthetic stream."""
    args = result.get("args") or {}
    if not args.get("multinode") or args.get("adversarial") or args.get("trace"):
        raise ValueError("the floor needs a result of `bench/run placement --multinode` on the synthetic stream")
    if not args.get("cluster"):
        raise ValueError("the result names no cluster file (args.cluster)")
    return args


def streams(result: Mapping[str, Any], inv: pm.NodeCapacity | None = None) -> dict[int, list[pm.Job]]:
    """seed -> the jobs of a ``--multinode`` result's runs, rebuilt from its stored arguments (``main.workload``);
    ``inv``: the result's cluster (``servers_of``), built here when not given."""
    args = checked_args(result)
    from bench.placement.main import workload

    capacity = (inv if inv is not None else servers_of(args["cluster"])[1]).total()
    ns = argparse.Namespace(**{**args, "trace": None})
    seeds = sorted({int(r["seed"]) for r in result.get("runs", [])})
    return {s: workload(ns, s, capacity)[1] for s in seeds}


def report(result: Mapping[str, Any], mins: Sequence[int]) -> dict[str, Any]:
    """Per seed: each policy's 64-GPU p95 wait in ``result`` and the floor's, per ``min_gpus`` and choice."""
    servers, inv = servers_of(checked_args(result)["cluster"])
    by_seed = streams(result, inv)
    rows: dict[int, dict[str, float]] = {}
    for seed, jobs in by_seed.items():
        row: dict[str, float] = {}
        for r in result["runs"]:
            if int(r["seed"]) == seed:
                row[f"({r['policy']})"] = float((r["metrics"].get("wait_p95_s") or {}).get("64", math.nan))
        for m in mins:
            for choice in CHOICES:
                waits = floor_waits(jobs, floor_starts(jobs, servers, inv, m, choice))
                row[f"floor >= {m} GPUs, {choice}"] = pm.percentile(waits, 95)
        rows[seed] = row
    return {"rows": rows, "mean": {k: sum(r[k] for r in rows.values()) / len(rows)
                                   for k in next(iter(rows.values()))} if rows else {}}


def markdown(rep: Mapping[str, Any]) -> str:
    rows = rep["rows"]
    if not rows:
        return "(no seeds)"
    keys = list(next(iter(rows.values())))
    out = ["| seed | " + " | ".join(keys) + " |", "|" + " --- |" * (len(keys) + 1)]
    for seed, row in sorted(rows.items()):
        out.append(f"| {seed} | " + " | ".join(f"{row[k]:,.0f}" for k in keys) + " |")
    out.append("| mean | " + " | ".join(f"{rep['mean'][k]:,.0f}" for k in keys) + " |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.placement.floor", description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a bench/run placement --multinode result file")
    ap.add_argument("--min-gpus", default="64,32,8", help="comma-separated: jobs of at least this many GPUs count")
    ap.add_argument("--json", help="also write the report here")
    a = ap.parse_args(argv)
    try:
        mins = [int(x) for x in a.min_gpus.split(",") if x.strip()]
        result = json.loads(Path(a.result).read_text())
        rep = report(result, mins)
    except (OSError, ValueError, KeyError) as e:
        print(f"floor: {e}", file=sys.stderr)
        return 2
    print(markdown(rep))
    if a.json:
        Path(a.json).write_text(json.dumps({"result": a.result, "min_gpus": mins, **rep}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
