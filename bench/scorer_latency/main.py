"""Latency of the placement scorer's ``prioritize`` at 50 nodes (enterprise-400) and 500 nodes.

The view is built offline from the real discovery output of the cluster file's mock profiles (the
500-node view is enterprise-400's node mix ten times over), filled to ~50% with first-fit claims of
1/2/4/8 GPUs. Each step then asks for one pod's scores over *all* nodes, binds the pod where the
scorer said (the allocation goes into the view, as the watch would deliver it) and, to stay near 50%,
releases a random claim when above it -- so every call sees a view that changed since the last one,
as in a real cluster. Calls are timed in-process (``Placement.prioritize``) and over HTTP on a
kept-alive connection (what kube-scheduler does), including JSON of the pod and all node names.

Usage: bench/run scorer_latency [--calls N] [--runs R] [--json FILE]   (no file unless --json)
Targets (issue 15): p99 <= 5 ms at 50 nodes, <= 25 ms at 500 nodes.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.paths import REPO
from testkit.ports import free_port
from testkit.views import claim, device_classes, node_slices

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.fleet.allocator import place
from topodra.fleet.demand import parse_demand
from topodra.fleet.fgd import DEFAULT_PRIOR
from topodra.fleet.state import ClusterState
from topodra.kube import Kube, Obj
from topodra.placement.cache import Cache
from topodra.placement.server import Placement, Server
from topodra.simulate import load_cluster

SIZES = (1, 2, 4, 8)
SIZE_P = (0.6, 0.1, 0.1, 0.2)
# Pod shapes: (weight, claim spec). Multi-GPU claims are NVLink-local; some use firstAvailable fallback.
NVLINK = [{"requests": ["gpus"], "matchAttribute": f"{DRIVER}/nvlinkDomain"}]


def spec(count: int, fallback: bool) -> Obj:
    if fallback:
        req: Obj = {"name": "gpus", "firstAvailable": [
            {"name": m, "deviceClassName": f"gpu-{m}", "count": count} for m in ("h200", "h100", "a100-80gb")]}
    else:
        req = {"name": "gpus", "exactly": {"deviceClassName": "gpu.topodra.io", "count": count}}
    devices: Obj = {"requests": [req]}
    if count > 1:
        devices["constraints"] = NVLINK
    return {"devices": devices}


def build(nodes: int, seed: int) -> tuple[ClusterState, random.Random]:
    """A view of ``nodes`` nodes with enterprise-400's profile mix, ~50% of GPUs allocated first-fit."""
    cluster = load_cluster(REPO / "hack" / "clusters" / "enterprise-400.yaml")
    profiles = [g.profile for g in cluster.groups for _ in range(g.count)]
    names = {f"n{i:04d}": profiles[i % len(profiles)] for i in range(nodes)}
    st = ClusterState(DRIVER, window=200)
    st.replace("classes", device_classes())
    st.replace("nodes", [{"metadata": {"name": n}} for n in names])
    st.replace("slices", [s for n, p in names.items() for s in node_slices(n, p)])
    rng = random.Random(seed)
    total = sum(v.gpus for n in names if (v := st.node_view(n)) is not None)
    while len(st.used) < total // 2:
        allocate(st, rng, rng.choice(list(names)), rng.choices(SIZES, SIZE_P)[0], rng.random() < 0.3)
    return st, rng


_seq = 0


def allocate(st: ClusterState, rng: random.Random, node: str, count: int, fallback: bool) -> bool:
    """First-fit one claim onto ``node`` (as the scheduler's allocator would) and record it."""
    global _seq
    view = st.node_view(node)
    if view is None:
        return False
    sp = spec(count, fallback)
    used = st.unavailable_indices(view)
    after = place(view, used, [parse_demand(sp)])
    if after is None:
        return False
    _seq += 1
    st.set_claim(claim(f"c{_seq}", sp, allocated=[view.devices[i].key for i in sorted(after - used)]))
    return True


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_once(nodes: int, calls: int, seed: int) -> dict[str, Any]:
    st, rng = build(nodes, seed)
    names = sorted(st.nodes)
    cache = Cache(Kube.__new__(Kube), st)  # never started: the view is fed directly
    placement = Placement(cache, DEFAULT_PRIOR, 20)
    server = Server(placement, "127.0.0.1", free_port())
    server.start()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    inproc: list[float] = []
    inproc_cpu: list[float] = []  # thread CPU time: on a loaded machine wall time also counts waiting for a CPU
    over_http: list[float] = []
    cold = 0.0
    try:
        for k in range(calls):
            count, fallback = rng.choices(SIZES, SIZE_P)[0], rng.random() < 0.3
            pending = claim(f"p{k}", spec(count, fallback))
            st.set_claim(pending)
            pod = {"metadata": {"name": f"pod{k}", "namespace": "ns"},
                   "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimName": f"p{k}"}]}}
            args = {"Pod": pod, "NodeNames": names}
            t0, c0 = time.perf_counter(), time.thread_time()
            result = placement.prioritize(args)
            dt = time.perf_counter() - t0
            inproc_cpu.append(time.thread_time() - c0)
            if k == 0:
                cold = dt
            inproc.append(dt)
            body = json.dumps(args).encode()
            t0 = time.perf_counter()
            conn.request("POST", "/prioritize", body, {"Content-Type": "application/json"})
            reply = conn.getresponse().read()
            over_http.append(time.perf_counter() - t0)
            assert json.loads(reply) == result
            # Bind where the scorer prefers (if it fits anywhere), then keep occupancy near 50%.
            st.delete_claim("ns", f"p{k}", forget=False)
            best = max(result, key=lambda r: r["Score"])
            if best["Score"] > 0:
                allocate(st, rng, best["Host"], count, fallback)
            total = sum(v.gpus for n in names if (v := st.node_view(n)) is not None)
            while len(st.used) > total // 2:
                victims = [key for key, info in st.claims.items() if info.allocated]
                st.delete_claim(*rng.choice(victims))
    finally:
        conn.close()
        server.shutdown()
    ms = 1000.0
    return {"nodes": nodes, "calls": calls, "seed": seed, "cold_ms": cold * ms,
            "inproc_p50_ms": pct(inproc, 0.5) * ms, "inproc_p99_ms": pct(inproc, 0.99) * ms,
            "inproc_cpu_p50_ms": pct(inproc_cpu, 0.5) * ms, "inproc_cpu_p99_ms": pct(inproc_cpu, 0.99) * ms,
            "http_p50_ms": pct(over_http, 0.5) * ms, "http_p99_ms": pct(over_http, 0.99) * ms,
            "http_max_ms": max(over_http) * ms, "shapes": st.sizes()["shapes"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/run scorer_latency", description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=1000, help="prioritize calls per run (default 1000)")
    p.add_argument("--runs", type=int, default=5, help="runs (seeds) per cluster size (default 5)")
    p.add_argument("--nodes", default="50,500", help="cluster sizes (default 50,500)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    out: dict[str, Any] = {"bench": "scorer_latency", "runs": []}
    for n in (int(x) for x in args.nodes.split(",")):
        rows = [run_once(n, args.calls, seed) for seed in range(args.runs)]
        out["runs"] += rows
        summary = {k: statistics.median(r[k] for r in rows)
                   for k in ("inproc_p50_ms", "inproc_p99_ms", "inproc_cpu_p50_ms", "inproc_cpu_p99_ms",
                             "http_p50_ms", "http_p99_ms", "cold_ms")}
        spread = {k: [round(min(r[k] for r in rows), 2), round(max(r[k] for r in rows), 2)]
                  for k in ("http_p50_ms", "http_p99_ms")}
        out[f"nodes_{n}"] = {"median_of_runs": summary, "min_max_of_runs": spread}
        print(f"{n:4d} nodes, {args.runs} runs x {args.calls} calls: "
              f"HTTP p50 {summary['http_p50_ms']:.2f} ms (runs {spread['http_p50_ms']}), "
              f"p99 {summary['http_p99_ms']:.2f} ms (runs {spread['http_p99_ms']}); "
              f"in-process p50 {summary['inproc_p50_ms']:.2f} p99 {summary['inproc_p99_ms']:.2f} ms "
              f"(CPU p50 {summary['inproc_cpu_p50_ms']:.2f} p99 {summary['inproc_cpu_p99_ms']:.2f} ms); "
              f"first call {summary['cold_ms']:.1f} ms", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
