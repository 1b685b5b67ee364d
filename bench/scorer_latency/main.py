"""Latency of the placement scorer's ``prioritize`` at 50 nodes (enterprise-400) and 500 nodes.

The view is built offline from the real discovery output of the cluster file's mock profiles (the
500-node view is enterprise-400's node mix ten times over), filled to ~50% with first-fit claims of
1/2/4/8 GPUs. Each step then asks for one pod's scores over *all* nodes, binds the pod where the
scorer said (the allocation goes into the view, as the watch would deliver it) and, to stay near 50%,
releases a random claim when above it -- so every call sees a view that changed since the last one,
as in a real cluster. Calls are timed in-process (``Placement.prioritize_json``: scoring and the reply's
JSON, what the server does once the request is parsed; on an older driver without it, ``prioritize`` and
``json.dumps`` as its server does) and over HTTP on a kept-alive connection (what kube-scheduler does),
including JSON of the pod and all node names.

With ``--cluster FILE`` the view is the first N nodes of that cluster file instead (whole groups in file
order, ``bench/scale``'s sizes), each Node with its labels and its profile's allocatable CPU and memory as
``topodra simulate`` creates it, so CPU/memory-aware scoring (``--host-resources on``, the scorer's default)
is exercised; ``--pods-per-node K`` also binds K CPU-only pods of random size to every node, so the nodes'
free CPU and memory differ (the hard case for the per-state scorer). ``--per-node`` measures the per-node
path (``Placement(by_state=False)``, the scorer before issue 22) for comparison.

Usage: bench/run scorer_latency [--calls N] [--runs R] [--json FILE]   (no file unless --json)
Targets (issue 15): p99 <= 5 ms at 50 nodes, <= 25 ms at 500 nodes; issue 22: CPU p99 <= 5 ms at 2,048 nodes.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from bench.paths import REPO
from testkit.ports import free_port
from testkit.views import claim, device_classes, node_slices

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.fleet.allocator import place
from topodra.fleet.demand import parse_demand
from topodra.fleet.fgd import DEFAULT_PRIOR
from topodra.fleet.state import ClusterState
from topodra.kube import Kube, Obj
from topodra.placement.cache import Cache, settle_heap
from topodra.placement.server import Placement, Server
from topodra.simulate import fake_node, fake_node_status, load_cluster, plan, profile_allocatable

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


def build_cluster(path: Path, nodes: int, seed: int, pods_per_node: int = 0) -> tuple[ClusterState, random.Random]:
    """The first ``nodes`` nodes of a cluster file (labels, allocatable), ~50% of GPUs allocated first-fit;
    ``pods_per_node`` bound CPU-only pods of random size on each node."""
    from bench.scale.clusters import first_nodes

    sim = plan(first_nodes(load_cluster(path), nodes))
    st = ClusterState(DRIVER, window=200)
    st.replace("classes", device_classes())
    node_objs = []
    for n in sim:
        obj = fake_node(n.name, n.labels)
        obj.update(fake_node_status(n.name, *profile_allocatable(n.profile)))
        node_objs.append(obj)
    st.replace("nodes", node_objs)
    st.replace("slices", [s for n in sim for s in node_slices(n.name, n.profile)])
    rng = random.Random(seed)
    names = [n.name for n in sim]
    if pods_per_node:
        st.replace("pods", [{"metadata": {"name": f"cpu-{i}-{k}", "namespace": "ns"},
                             "spec": {"nodeName": n, "containers": [{"name": "c", "resources": {"requests": {
                                 "cpu": f"{rng.choice((1, 2, 4, 8))}", "memory": f"{rng.choice((4, 16, 64))}Gi"}}}]},
                             "status": {"phase": "Running"}}
                            for i, n in enumerate(names) for k in range(pods_per_node)])
    total = sum(v.gpus for n in names if (v := st.node_view(n)) is not None)
    tries = 0
    while len(st.used) < total // 2 and tries < 20 * len(names):
        tries += 1
        allocate(st, rng, rng.choice(names), rng.choices(SIZES, SIZE_P)[0], rng.random() < 0.3)
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


def responder(placement: Placement) -> Callable[[Obj], bytes]:
    """What the server computes per call once the request body is parsed: ``prioritize_json``; on a driver
    without it (a before-run with an older package on PYTHONPATH) ``prioritize`` and the handler's
    ``json.dumps``, as that version's server does."""
    fast = getattr(placement, "prioritize_json", None)
    if fast is not None:
        return cast(Callable[[Obj], bytes], fast)

    def old(args: Obj) -> bytes:
        return json.dumps(placement.prioritize(args), separators=(",", ":")).encode()

    return old


def warm(placement: Placement) -> None:
    """What the cache's relist does for the placement (``Placement.warm``: every node's state built in the
    watch thread); a driver without it builds them in the first call."""
    hook = getattr(placement, "warm", None)
    if hook is not None:
        hook()


def best_of(reply: bytes) -> tuple[str, int]:
    """The first best-scored host of a reply and its score. Its 2,048 decoded objects are gone when this
    returns: kept alive into the next timed call they would be young objects for the cyclic collector to
    walk there (0.2-0.5 ms per collection at 2,048 nodes), a cost of the bench, not of the server."""
    best = max(json.loads(reply), key=lambda r: r["Score"])
    return str(best["Host"]), int(best["Score"])


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# Pods without claims (issue 34, ``--host-resources mix``): the trace's CPU-only task sizes, roughly
# (openb_pod_list_default.csv: CPU-only tasks ask 1-32 CPUs, 2-64Gi).
CPU_ONLY_SHAPES = tuple((c, m) for c in ("1", "2", "4", "8", "16", "32") for m in ("4Gi", "16Gi", "64Gi"))


def cpu_only_pod(rng: random.Random, k: int) -> Obj:
    """A pod without claims of one of ``CPU_ONLY_SHAPES``."""
    cpu, mem = rng.choice(CPU_ONLY_SHAPES)
    return {"metadata": {"name": f"cpu-pod{k}", "namespace": "ns"},
            "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": cpu, "memory": mem}}}]}}


def run_once(nodes: int, calls: int, seed: int, cluster: Path | None = None, host_aware: bool = True,
             pods_per_node: int = 0, by_state: bool = True, profile: Path | None = None,
             per_class: bool = False, cpu_only: float = 0.0) -> dict[str, Any]:
    st, rng = build(nodes, seed) if cluster is None else build_cluster(cluster, nodes, seed, pods_per_node)
    names = sorted(st.nodes)
    st.warm_views()
    settle_heap()  # both as the cache does after its relist
    cache = Cache(Kube.__new__(Kube), st)  # never started: the view is fed directly
    placement = Placement(cache, DEFAULT_PRIOR, 20, host_aware=host_aware, by_state=by_state, per_class=per_class)
    warm(placement)
    prof = None
    cpu_only_cpu: list[float] = []  # the calls for pods without claims, apart
    if profile is not None:
        import cProfile

        prof = cProfile.Profile()
    respond = responder(placement)
    server = Server(placement, "127.0.0.1", free_port())
    server.start()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    inproc: list[float] = []
    inproc_cpu: list[float] = []  # thread CPU time: on a loaded machine wall time also counts waiting for a CPU
    over_http: list[float] = []
    cold = 0.0
    try:
        for k in range(calls):
            if cpu_only and rng.random() < cpu_only:  # a pod without claims: scored, not bound
                args = {"Pod": cpu_only_pod(rng, k), "NodeNames": names}
                c0 = time.thread_time()
                respond(args)
                cpu_only_cpu.append(time.thread_time() - c0)
                inproc_cpu.append(cpu_only_cpu[-1])
                continue
            count, fallback = rng.choices(SIZES, SIZE_P)[0], rng.random() < 0.3
            pending = claim(f"p{k}", spec(count, fallback))
            st.set_claim(pending)
            pod = {"metadata": {"name": f"pod{k}", "namespace": "ns"},
                   "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimName": f"p{k}"}]}}
            args = {"Pod": pod, "NodeNames": names}
            if prof is not None and k > 0:
                prof.enable()
            t0, c0 = time.perf_counter(), time.thread_time()
            reply = respond(args)
            dt = time.perf_counter() - t0
            inproc_cpu.append(time.thread_time() - c0)
            if prof is not None:
                prof.disable()
            if k == 0:
                cold = dt
            inproc.append(dt)
            body = json.dumps(args).encode()
            t0 = time.perf_counter()
            conn.request("POST", "/prioritize", body, {"Content-Type": "application/json"})
            got = conn.getresponse().read()
            over_http.append(time.perf_counter() - t0)
            assert got == reply
            # Bind where the scorer prefers (if it fits anywhere), then keep occupancy near 50%.
            st.delete_claim("ns", f"p{k}", forget=False)
            host, score = best_of(reply)
            if score > 0:
                allocate(st, rng, host, count, fallback)
            total = sum(v.gpus for n in names if (v := st.node_view(n)) is not None)
            while len(st.used) > total // 2:
                victims = [key for key, info in st.claims.items() if info.allocated]
                st.delete_claim(*rng.choice(victims))
    finally:
        conn.close()
        server.shutdown()
    if prof is not None and profile is not None:
        prof.dump_stats(str(profile))
    ms = 1000.0
    return {"nodes": nodes, "calls": calls, "seed": seed, "cold_ms": cold * ms,
            "cluster": str(cluster) if cluster else "enterprise-400 x N", "host_aware": host_aware,
            "pods_per_node": pods_per_node, "by_state": by_state, "used": len(st.used),
            "inproc_p50_ms": pct(inproc, 0.5) * ms, "inproc_p99_ms": pct(inproc, 0.99) * ms,
            "inproc_cpu_p50_ms": pct(inproc_cpu, 0.5) * ms, "inproc_cpu_p99_ms": pct(inproc_cpu, 0.99) * ms,
            "http_p50_ms": pct(over_http, 0.5) * ms, "http_p99_ms": pct(over_http, 0.99) * ms,
            "http_max_ms": max(over_http) * ms, "shapes": st.sizes()["shapes"],
            "per_class": per_class, "cpu_only_calls": len(cpu_only_cpu),
            "cpu_only_cpu_p50_ms": pct(cpu_only_cpu, 0.5) * ms if cpu_only_cpu else None,
            "cpu_only_cpu_p99_ms": pct(cpu_only_cpu, 0.99) * ms if cpu_only_cpu else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/run scorer_latency", description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=1000, help="prioritize calls per run (default 1000)")
    p.add_argument("--runs", type=int, default=5, help="runs (seeds) per cluster size (default 5)")
    p.add_argument("--nodes", default="50,500", help="cluster sizes (default 50,500)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--cluster", type=Path, default=None,
                   help="take the nodes from this cluster file (e.g. hack/clusters/superpod-16k.yaml)")
    p.add_argument("--host-resources", choices=["on", "off", "mix"], default="on",
                   help="the scorer's CPU/memory-aware scoring (default on, as the scorer's flag)")
    p.add_argument("--cpu-only", type=float, default=0.0,
                   help="share of calls for pods without claims (issue 34; scored with --host-resources mix; "
                        "their thread CPU also apart, cpu_only_cpu_p99_ms)")
    p.add_argument("--pods-per-node", type=int, default=0, help="with --cluster: bound CPU-only pods per node")
    p.add_argument("--per-node", action="store_true", help="the per-node path (by_state=False)")
    p.add_argument("--profile", type=Path, default=None, help="cProfile the calls of the first run into FILE")
    args = p.parse_args(argv)
    if args.pods_per_node < 0 or (args.pods_per_node and args.cluster is None):
        p.error("--pods-per-node must be >= 0 and needs --cluster")
    if not 0.0 <= args.cpu_only <= 1.0:
        p.error("--cpu-only must be between 0 and 1")
    out: dict[str, Any] = {"bench": "scorer_latency", "runs": []}
    for n in (int(x) for x in args.nodes.split(",")):
        rows = [run_once(n, args.calls, seed, args.cluster, args.host_resources != "off", args.pods_per_node,
                         not args.per_node, args.profile if seed == 0 else None, args.host_resources == "mix",
                         args.cpu_only) for seed in range(args.runs)]
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
              f"first call {summary['cold_ms']:.1f} ms"
              + (f"; pods without claims: CPU p99 {statistics.median(r['cpu_only_cpu_p99_ms'] for r in rows):.2f} ms"
                 if args.cpu_only else ""), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
