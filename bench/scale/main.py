"""``bench/run scale``: how every part of topodra grows from 64 to 2,048 nodes (512 to 16,384 GPUs).

One run measures each row at every size of ``--sizes`` (default 64, 256, 512, 1,024, 2,048 nodes: the first
N nodes of ``hack/clusters/superpod-16k.yaml``, whole scalable units, four GPU models). Per size a private
local cluster (``testkit.cluster.Cluster.private``: own state, free ports, its own lock, so it never waits for
a test session) is started, measured and always torn down; the scheduler row starts one more per size
(``bench/schedule_throughput``'s ``Bed``: DGX-H100 nodes, a scheduler held stopped between variants) and
runs its four variants on it.

Rows (``--rows``):

* ``simulate``: ``topodra simulate FILE --once`` wall time and its publishing time; kube-apiserver requests and
  request/response bytes during it (the apiserver's own metrics).
* ``etcd``: ResourceSlices stored, their devices and bytes (compact JSON, as watchers get them) and etcd's
  database size (``etcd_mvcc_db_total_size_in_bytes``).
* ``inventory``: ``topodra inventory`` as a table, ``-o json`` and ``--png`` (median of ``--runs`` runs).
* ``controller``: one ClaimProfile availability pass in process as ``topodra controller`` runs it, from its
  watched facts (``controller/facts.py``) right after a slice event (snapshot + ``PROFILES``): process CPU and
  wall time (``cpu_s``, ``wall_s``); after a node event (``node_event_cpu_s``); the watches' initial list and
  sync (``initial_cpu_s``), and the listing pass of before in the same run (``list_cpu_s``: list slices, claims,
  classes, nodes and taint rules, build the snapshot, evaluate).
* ``scorer``: the placement scorer's view built from the listed objects, filled to ~50% with first-fit claims
  (as ``bench/scorer_latency``); thread CPU and wall p50/p99 per ``prioritize`` over all nodes (scoring and
  the reply's JSON, ``bench.scorer_latency.main.responder``); the view's
  Python heap (``tracemalloc``): ``lists_mib`` the listed objects and indexes, ``view_mib`` with every node's
  view built as the cache does after its relist.
* ``publisher``: every node's ``SlicePublisher`` (``topodra.simulate.Simulation`` in process) reconciling with
  the kubelet plugin's resync period (10 s) for ``--publisher-window`` seconds after a first pass; its requests,
  counted at the client, per node per hour.
* ``status-writes``: the claim-status writes of the telemetry summaries and Idle conditions, N nodes x 8 GPUs
  over ``--status-minutes`` virtual minutes after a ``--status-warmup``, with the sampler's own write decision
  at its 10 s interval (``bench/scale/statuswrites.py``; no cluster): writes per second cluster-wide, median and
  p99 over the minutes, for the ``mixed`` claim layout and ``one-gpu`` (8 claims per node, the worst case).
* ``scheduler``: kube-scheduler pods/s (10-90% slope) for N 1-GPU and N/8 8-GPU claims on N DGX-H100 nodes, with
  topodra's slices (``full``) and stripped slices (``stripped``: type, model, nvlinkDomain, rail only), each
  without and with the scorer.

Each curve gets a fit (``bench/scale/fit.py``): the log-log exponent decides "at most linear". Targets are
issue 22's, checked at the largest size measured. Writes JSON, a Markdown table and one PNG per curve into
``bench/results/scale/`` (``--out-dir``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import re
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml
from bench.paths import REPO, result_file, utc_stamp
from bench.scale.clusters import first_nodes
from bench.scale.fit import growth
from testkit import cluster as localcluster
from testkit.locks import cluster_lock, instance_lock_file

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.apipaths import claim_path, device_class_path, node_path, slices_path
from topodra.controller.availability import profile_availability
from topodra.controller.operator import ControllerConfig, SnapshotCache
from topodra.controller.profile import ClaimProfile
from topodra.fleet.fgd import DEFAULT_PRIOR
from topodra.fleet.state import ClusterState
from topodra.kube import Kube, KubeError, Obj
from topodra.simulate import SimulatedCluster, load_cluster
from topodra.slicewatch import WATCH_TIMEOUT_S

INSTANCE = "bench-scale"
CLUSTER_FILE = REPO / "hack" / "clusters" / "superpod-16k.yaml"
SIZES = (64, 256, 512, 1024, 2048)
ROWS = ("simulate", "etcd", "inventory", "controller", "scorer", "publisher", "status-writes", "scheduler")
NO_CLUSTER_ROWS = ("scheduler", "status-writes")  # rows that start no private cluster of the size
PLUGIN_RESYNC_S = 10.0  # SlicePublisher's default resync, what every kubelet plugin runs with

# Issue 22's targets, at 2,048 nodes on the 2-core machine: (row, metric) -> (comparison, bound, what).
TARGETS: dict[tuple[str, str], tuple[str, float, str]] = {
    ("simulate", "wall_s"): ("<=", 20.0, "simulate <= 20 s"),
    ("scorer", "cpu_p99_ms"): ("<=", 5.0, "scorer CPU p99 <= 5 ms"),
    ("scorer", "view_mib"): ("<=", 300.0, "scorer cache <= 300 MiB"),
    ("controller", "cpu_s"): ("<=", 1.0, "controller pass <= 1 s CPU"),
    ("inventory", "json_s"): ("<=", 1.5, "inventory -o json <= 1.5 s"),
    ("inventory", "png_s"): ("<=", 3.0, "inventory --png <= 3 s"),
    ("scheduler", "stripped_ratio"): (">=", 0.9, "topodra's slices >= 0.9x of stripped slices"),
    ("scheduler", "scorer_ratio"): (">=", 0.8, "with the scorer >= 0.8x of without"),
    # Issue 32: the summaries' API writes stay bounded (docs/telemetry.md): never more than one per claim per
    # --status-summary-interval in any such window (1.0 = the bound), the busiest minute within 10% of the
    # window's average, and all telemetry writes (summaries and Idle conditions) at 2,048 nodes with 8 one-GPU
    # claims per node <= 60/s in the p99 minute.
    ("status-writes", "one_gpu_window_ratio"): ("<=", 1.0, "summary writes <= claims alive per interval window"),
    ("status-writes", "one_gpu_minute_max_ratio"): ("<=", 1.1, "busiest minute <= 1.1x claims / interval"),
    ("status-writes", "one_gpu_all_p99_per_s"): ("<=", 60.0, "telemetry status writes p99 minute <= 60/s"),
}
# The curves a fit is made for: (row, metric) of the per-size results.
CURVES: tuple[tuple[str, str], ...] = (
    ("simulate", "wall_s"), ("simulate", "publish_s"), ("simulate", "requests"), ("simulate", "request_bytes"),
    ("etcd", "slices"), ("etcd", "slice_bytes"), ("etcd", "db_bytes"),
    ("inventory", "table_s"), ("inventory", "json_s"), ("inventory", "png_s"),
    ("controller", "cpu_s"), ("controller", "initial_cpu_s"), ("controller", "list_cpu_s"),
    ("scorer", "cpu_p99_ms"), ("scorer", "view_mib"),
    ("publisher", "requests_per_hour"),
    ("status-writes", "mixed_summary_median_per_s"), ("status-writes", "one_gpu_all_p99_per_s"),
)
# Profiles evaluated by one controller pass: the shapes users write (fallback chains, NVLink, rail-aligned).
PROFILES: tuple[Obj, ...] = (
    {"alternatives": [{"name": "h200", "deviceClassName": "gpu-h200", "count": 8},
                      {"name": "h100", "deviceClassName": "gpu-h100", "count": 8}], "topology": {"nvlink": "Required"}},
    {"alternatives": [{"name": "any", "deviceClassName": "gpu.topodra.io", "count": 1}]},
    {"alternatives": [{"name": "a100", "deviceClassName": "gpu-a100-80gb", "count": 4}],
     "topology": {"nvlink": "Required"}},
    {"alternatives": [{"name": "b200", "deviceClassName": "gpu-b200", "count": 8}],
     "topology": {"nvlink": "Required", "nic": "RailAligned"}},
)


def log(msg: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class ScaleError(RuntimeError):
    pass


# ----- metrics of the control plane


def _metrics_text(url: str, ctx: ssl.SSLContext | None) -> str:
    with urllib.request.urlopen(url, context=ctx, timeout=30) as r:
        return str(r.read().decode())


def apiserver_metrics(lc: localcluster.Cluster) -> str:
    ctx = ssl.create_default_context(cafile=str(lc.pki / "ca.crt"))
    ctx.load_cert_chain(str(lc.pki / "admin.crt"), str(lc.pki / "admin.key"))
    return _metrics_text(f"https://127.0.0.1:{lc.ports.apiserver}/metrics", ctx)


def etcd_metrics(lc: localcluster.Cluster) -> str:
    return _metrics_text(f"http://127.0.0.1:{lc.ports.etcd}/metrics", None)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def metric_total(text: str, name: str, **labels: str) -> float:
    """Sum of every sample of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        lab = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if all(lab.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def request_counts(text: str) -> dict[str, float]:
    return {"requests": metric_total(text, "apiserver_request_total"),
            "request_bytes": metric_total(text, "apiserver_request_body_size_bytes_sum"),
            "response_bytes": metric_total(text, "apiserver_response_sizes_sum")}


# ----- the rows


def topodra(*args: str) -> list[str]:
    return [sys.executable, "-m", "topodra.cli", *args]


def run_simulate(lc: localcluster.Cluster, sub: Path, n: int) -> dict[str, Any]:
    m0 = request_counts(apiserver_metrics(lc))
    t0 = time.perf_counter()
    p = subprocess.run(topodra("simulate", str(sub), "--once", "--ready-timeout", "0",  # settle_nodes, after timing
                               "--kubeconfig", str(lc.admin_kubeconfig)),
                       capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise ScaleError(f"simulate failed: {p.stderr[-2000:]}")
    m1 = request_counts(apiserver_metrics(lc))
    pub = re.search(r"published (\d+) nodes, (\d+) GPUs in ([0-9.]+)s", p.stderr + p.stdout)
    if not pub or int(pub.group(1)) != n:
        raise ScaleError(f"simulate did not say it published {n} nodes: {(p.stderr + p.stdout)[-1000:]}")
    return {"wall_s": wall, "publish_s": float(pub.group(3)), "gpus": int(pub.group(2)),
            **{k: m1[k] - m0[k] for k in m0}}


def run_etcd(lc: localcluster.Cluster) -> dict[str, Any]:
    """Slices as stored and served. The apiserver's own object-count and size gauges are refreshed once a
    minute (``--etcd-count-metric-poll-period``), so the count and bytes come from a list instead: ``slice_bytes``
    is their compact JSON, what every watcher of slices is sent; ``db_bytes`` is etcd's database, read live."""
    kube = lc.kube()
    slices = list(kube.list(slices_path(), field_selector=f"spec.driver={DRIVER}"))
    return {"slices": len(slices),
            "devices": sum(len(s.get("spec", {}).get("devices") or []) for s in slices),
            "slice_bytes": sum(len(json.dumps(s, separators=(",", ":"))) for s in slices),
            "db_bytes": metric_total(etcd_metrics(lc), "etcd_mvcc_db_total_size_in_bytes")}


NOT_READY = "node.kubernetes.io/not-ready"


def settle_nodes(lc: localcluster.Cluster) -> dict[str, Any]:
    """Lift ``node.kubernetes.io/not-ready`` from the Ready Nodes that still carry it, as kube-controller-manager's
    node lifecycle controller would, so the rows after ``simulate --once`` see the cluster in steady state.

    The apiserver's TaintNodesByCondition admission taints every new Node; the controller lifts it a few Nodes
    per second (rate-limited: 105 s for 500 Nodes, bench/schedule_throughput), so at 2,048 Nodes inventory ran
    while it was still patching them, measured a busy API server and drew most Nodes unschedulable. One
    merge patch per Node, the other taints kept; ``tainted`` says how many it found, ``left`` how many still carry
    it after (0 unless a Node was re-tainted meanwhile). Runs after simulate is measured, before every other row."""
    kube = lc.kube()
    t0 = time.monotonic()

    def ready(node: Obj) -> bool:
        return any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in (node.get("status") or {}).get("conditions") or [])

    def tainted() -> list[Obj]:
        return [n for n in kube.list(node_path()) if ready(n)
                and any(t.get("key") == NOT_READY for t in (n.get("spec") or {}).get("taints") or [])]

    todo = tainted()

    def lift(node: Obj) -> None:
        rest = [t for t in node["spec"]["taints"] if t.get("key") != NOT_READY]
        try:
            kube.merge_patch(node_path(node["metadata"]["name"]), {"spec": {"taints": rest or None}})
        except KubeError as e:
            if not e.not_found:
                raise

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lift, todo))
    took = time.monotonic() - t0
    return {"tainted": len(todo), "settle_s": took, "left": len(tainted())}


def run_inventory(lc: localcluster.Cluster, gpus: int, runs: int, png_out: Path | None,
                  baseline: Path | None = None) -> dict[str, Any]:
    """Median wall time of ``topodra inventory`` as a table, ``-o json`` and ``--png``. With ``baseline`` (a
    checkout), the same commands with its ``driver/`` too, run by run interleaved with this one's (the load
    of a shared machine then hits both alike): ``<variant>_baseline_s``."""
    kc = ["--kubeconfig", str(lc.admin_kubeconfig)]

    def total_is_right(out: str) -> None:
        got = json.loads(out)["summary"]["total"]
        if got != gpus:
            raise ScaleError(f"inventory -o json counts {got} GPUs, the cluster has {gpus}")

    with tempfile.TemporaryDirectory() as tmp:
        png = Path(tmp) / "inv.png"
        variants: dict[str, tuple[list[str], Callable[[str], None] | None]] = {
            "table_s": (topodra("inventory", *kc), None),
            "json_s": (topodra("inventory", *kc, "-o", "json"), total_is_right),
            "png_s": (topodra("inventory", *kc, "--png", str(png)), None)}
        envs: dict[str, Mapping[str, str] | None] = {"": None}
        if baseline is not None:
            envs["_baseline"] = {**os.environ, "PYTHONPATH": str(baseline / "driver")}
        walls: dict[str, list[float]] = {}
        for _ in range(runs):
            for name, (cmd, check) in variants.items():
                for suffix, env in envs.items():
                    if suffix:
                        cmd = [*cmd[:-1], str(Path(tmp) / "base.png")] if name == "png_s" else cmd
                    t0 = time.perf_counter()
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
                    walls.setdefault(name.replace("_s", f"{suffix}_s"), []).append(time.perf_counter() - t0)
                    if p.returncode != 0:
                        raise ScaleError(f"{' '.join(cmd[2:5])}{suffix} failed: {p.stderr[-2000:]}")
                    if check is not None:
                        check(p.stdout)
        out: dict[str, Any] = {k: statistics.median(v) for k, v in walls.items()}
        out["samples"] = {k: [round(x, 3) for x in v] for k, v in walls.items()}
        out["png_bytes"] = png.stat().st_size
        with _pil_size(png) as size:
            out["png_px"] = size
        if png_out is not None:
            png_out.write_bytes(png.read_bytes())
    return out


@contextmanager
def _pil_size(png: Path) -> Iterator[list[int] | None]:
    try:
        import matplotlib.image as mpimg

        img = mpimg.imread(str(png))
        yield [int(img.shape[1]), int(img.shape[0])]
    except (ImportError, OSError, ValueError):
        yield None


def run_controller(lc: localcluster.Cluster) -> dict[str, Any]:
    """One ClaimProfile refresh pass as ``topodra controller`` runs it: from its watched facts
    (``controller/facts.py``) right after a slice event, so the devices are rebuilt and matched against every
    class again (the dearest change; ``node_event_cpu_s``: after a node event, the devices and their matches
    kept). The initial list + sync of the watches is reported apart (``initial_cpu_s``), and the listing pass
    the controller ran before (``SnapshotCache``: list and decode every pass) in the same run (``list_cpu_s``).
    Process CPU: the watch threads' parsing counts. All three must give the same availability."""
    from topodra.controller.facts import WatchedFacts

    def devices_of(statuses: list[list[Any]]) -> list[list[tuple[Any, ...]]]:
        return [[(a.name, a.known, a.devices_total, a.devices_free) for a in alts] for alts in statuses]

    kube = lc.kube()
    profiles = [ClaimProfile.model_validate({"apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile",
                                             "metadata": {"name": f"p{i}", "namespace": "default"}, "spec": spec})
                for i, spec in enumerate(PROFILES)]
    def timed_pass(get: Callable[[], Any], what: str) -> tuple[Any, list[Any], float, float]:
        """One snapshot and the profiles' availability from it: (snapshot, statuses, process CPU, wall)."""
        c0, t0 = time.process_time(), time.perf_counter()
        snap = get()
        if isinstance(snap, str):
            raise ScaleError(f"{what}: {snap}")
        got = [profile_availability(p, snap) for p in profiles]
        return snap, got, time.process_time() - c0, time.perf_counter() - t0

    cache = SnapshotCache(ControllerConfig(snapshot_ttl_s=0.0))
    listed, want, list_cpu, list_wall = timed_pass(lambda: cache.get(kube), "controller snapshot")
    devices = len(listed.devices)
    del listed
    facts = WatchedFacts(lc.kube(), DRIVER)
    c0, t0 = time.process_time(), time.perf_counter()
    facts.start()
    try:
        if not facts.wait_synced(300):
            raise ScaleError("controller: the watches did not list within 300 s")
        initial_cpu, initial_wall = time.process_time() - c0, time.perf_counter() - t0

        def pass_after(change: Callable[[], Any], which: int) -> tuple[float, float]:
            seen = facts.versions()[which]
            change()
            deadline = time.monotonic() + 60
            while facts.versions()[which] == seen:  # the event is applied by the watch thread
                if time.monotonic() > deadline:
                    raise ScaleError("controller: the watch did not deliver the change within 60 s")
                time.sleep(0.02)
            _, got, cpu, wall = timed_pass(lambda: facts.get(kube), "controller facts")
            if devices_of(got) != devices_of(want):  # nodesFit may move: the node controller marks nodes
                raise ScaleError(f"controller: the watched pass disagrees with the listing pass: {got} != {want}")
            return cpu, wall

        first_slice = next(iter(kube.list(slices_path(), field_selector=f"spec.driver={DRIVER}")))["metadata"]["name"]
        first_node = next(iter(kube.list(node_path())))["metadata"]["name"]
        touch = {"metadata": {"labels": {"bench.topodra.io/touched": str(time.time_ns())}}}
        cpu, wall = pass_after(lambda: kube.merge_patch(slices_path(first_slice), touch), 1)
        node_cpu, _ = pass_after(lambda: kube.merge_patch(node_path(first_node), touch), 0)
    finally:
        facts.close()
    return {"cpu_s": cpu, "wall_s": wall, "node_event_cpu_s": node_cpu, "initial_cpu_s": initial_cpu,
            "initial_wall_s": initial_wall, "list_cpu_s": list_cpu, "list_wall_s": list_wall,
            "devices": devices,
            "profiles": len(profiles), "free_first_alternative": [s[0].devices_free for s in want]}


def run_scorer(lc: localcluster.Cluster, calls: int, seed: int, host_resources: str = "on",
               cpu_only: float = 0.0) -> dict[str, Any]:
    """``host_resources``: the scorer's flag; ``cpu_only``: share of calls for pods without claims (issue 34: scored
    with ``mix``), drawn from ``bench.scorer_latency.main.CPU_ONLY_SHAPES`` and timed apart too."""
    from bench.scorer_latency.main import SIZE_P, SIZES, allocate, cpu_only_pod, pct, responder, spec, warm
    from testkit.views import claim

    from topodra.placement.cache import Cache, settle_heap
    from topodra.placement.server import Placement

    kube = lc.kube()
    # What the scorer's cache holds: the listed objects it keeps plus its indexes (``lists``), then with every
    # node's view built, as the cache does right after its relist (``view``). Traced from before the lists are
    # read, measured after every local reference to them is gone.
    gc.collect()
    tracemalloc.start()
    st = ClusterState(DRIVER, window=200)
    st.replace("classes", list(kube.list(device_class_path())))
    st.replace("nodes", list(kube.list(node_path())))
    st.replace("slices", list(kube.list(slices_path(), field_selector=f"spec.driver={DRIVER}")))
    st.replace("claims", list(kube.list(claim_path())))
    gc.collect()
    lists_bytes = tracemalloc.get_traced_memory()[0]
    st.warm_views()
    gc.collect()
    view_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    names = sorted(st.nodes)
    rng = random.Random(seed)
    total = sum(v.gpus for n in names if (v := st.node_view(n)) is not None)
    tries = 0
    while len(st.used) < total // 2 and tries < 20 * len(names):
        tries += 1
        allocate(st, rng, rng.choice(names), rng.choices(SIZES, SIZE_P)[0], rng.random() < 0.3)
    settle_heap()  # what the cache does after its relist
    cache = Cache(Kube.__new__(Kube), st)  # never started: fed directly, as bench/scorer_latency does
    placement = Placement(cache, DEFAULT_PRIOR, 20, host_aware=host_resources != "off",
                          per_class=host_resources == "mix")
    warm(placement)  # as the cache's relist does
    respond = responder(placement)  # scoring and the reply's JSON, as the server per call
    cpu, wall, cpu_only_cpu = [], [], []
    for k in range(calls):
        if cpu_only and rng.random() < cpu_only:
            c0 = time.thread_time()
            respond({"Pod": cpu_only_pod(rng, k), "NodeNames": names})
            cpu_only_cpu.append(time.thread_time() - c0)
            cpu.append(cpu_only_cpu[-1])
            continue
        count, fallback = rng.choices(SIZES, SIZE_P)[0], rng.random() < 0.3
        st.set_claim(claim(f"scale-p{k}", spec(count, fallback)))
        args = {"Pod": {"metadata": {"name": f"pod{k}", "namespace": "ns"},
                        "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimName": f"scale-p{k}"}]}},
                "NodeNames": names}
        t0, c0 = time.perf_counter(), time.thread_time()
        respond(args)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
        st.delete_claim("ns", f"scale-p{k}", forget=True)
    ms = 1000.0
    return {"calls": calls, "nodes": len(names), "gpus": total, "used": len(st.used),
            "cpu_p50_ms": pct(cpu, 0.5) * ms, "cpu_p99_ms": pct(cpu, 0.99) * ms,
            "wall_p50_ms": pct(wall, 0.5) * ms, "wall_p99_ms": pct(wall, 0.99) * ms,
            "view_mib": view_bytes / 2**20, "lists_mib": lists_bytes / 2**20, "shapes": st.sizes().get("shapes"),
            "node_states": len(placement.states.states.states),
            "memo_entries": len(placement.scorer._place) + len(placement.scorer._unusable),
            "host_resources": host_resources, "cpu_only_calls": len(cpu_only_cpu),
            "cpu_only_cpu_p99_ms": pct(cpu_only_cpu, 0.99) * ms if cpu_only_cpu else math.nan}


class CountingKube(Kube):
    """topodra's client, counting its requests: the publishers' own traffic, apart from the control plane's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0
        self._count_lock = threading.Lock()

    def request(self, *args: Any, **kwargs: Any) -> Obj:
        with self._count_lock:
            self.calls += 1
        return super().request(*args, **kwargs)

    def watch(self, *args: Any, **kwargs: Any) -> Iterator[Obj]:
        with self._count_lock:
            self.calls += 1  # a watch request is a request too
        return super().watch(*args, **kwargs)


def run_publisher(lc: localcluster.Cluster, cluster: SimulatedCluster, n: int, window: float) -> dict[str, Any]:
    """Steady state: every simulated node's SlicePublisher reconciling every PLUGIN_RESYNC_S, as each
    kubelet plugin does, run in process so its requests are counted at the client (the apiserver's totals
    also count the controller-manager's and scheduler's traffic, which swamps a 64-node publisher rate).
    ``passes``: pool comparisons in the window (each a list per pool before the publisher watched)."""
    from topodra.simulate import Simulation

    kube = CountingKube.from_kubeconfig(str(lc.admin_kubeconfig))
    assert isinstance(kube, CountingKube)
    sim = Simulation(kube, cluster)
    sim.setup()
    sim.reconcile_all()  # the first pass writes nothing new: simulate --once published the same pools
    stop = threading.Event()
    worker = threading.Thread(target=sim.run, args=(stop, PLUGIN_RESYNC_S), daemon=True)
    pubs = [*sim.publishers.values(), *sim.cpu_publishers.values()]
    c0, p0, t0 = kube.calls, sum(p.passes for p in pubs), time.monotonic()
    worker.start()
    stop.wait(window)  # a rate over a fixed window: nothing is asserted about its absence
    threads = threading.active_count()  # the process's, while every publisher runs
    stop.set()
    worker.join(timeout=120)
    calls, elapsed = kube.calls - c0, time.monotonic() - t0
    kube.close()
    return {"window_s": elapsed, "requests": calls, "requests_per_s": calls / elapsed,
            "requests_per_hour": calls / elapsed * 3600 / n, "resync_s": PLUGIN_RESYNC_S,
            "passes": sum(p.passes for p in pubs) - p0, "threads": threads,
            # A kubelet plugin watches its own node's slices: each renewal is one request (no list).
            "plugin_watch_renewals_per_hour": 3600 / (sum(WATCH_TIMEOUT_S) / 2)}


# The scheduler row's variants in the order they run on one cluster: each target's two variants run back to
# back (stripped, full: the attribute cost; full, full + scorer: the scorer's), with two slice switches.
SCHEDULER_VARIANTS = (("stripped", False), ("full", False), ("full", True), ("stripped", True))


def run_scheduler(n: int, seed: int, qps: int, pprof_dir: Path | None = None, max_pods: int = 512) -> dict[str, Any]:
    """The four variants on one private cluster of ``n`` nodes (``bench/schedule_throughput``'s ``Bed``):
    ``min(n, max_pods)`` 1-GPU pods and an eighth as many 8-GPU pods each. kube-scheduler's CPU per pod
    grows with the nodes it filters (58 ms at 512 nodes, 2026-12-02), so N pods on N nodes would make the
    row quadratic (about an hour at 2,048 nodes); the cap keeps it near linear."""
    from bench.placement.main import BenchError
    from bench.schedule_throughput.main import run_variants, template_devices

    one = min(n, max_pods)
    args = SimpleNamespace(nodes=n, one_gpu_pods=one, eight_gpu_pods=max(1, one // 8), seed=seed, scheduler_qps=qps,
                           stall=60.0, timeout=1200.0, pprof_dir=pprof_dir, pprof_seconds=20)
    t0 = time.monotonic()
    try:
        results = run_variants(args, SCHEDULER_VARIANTS, template_devices())  # type: ignore[arg-type]
    except BenchError as e:
        raise ScaleError(f"scheduler row at {n} nodes: {e}") from None
    out: dict[str, Any] = {"one_gpu_pods": one, "eight_gpu_pods": args.eight_gpu_pods, "pods": results[0].pods,
                           "order": [f"{sc}{'_scorer' if on else ''}" for sc, on in SCHEDULER_VARIANTS]}
    for r in results:
        key = f"{r.scenario}{'_scorer' if r.scorer else ''}"
        out[f"{key}_pods_per_s"] = r.pods_per_s
        out[f"{key}_scheduled"] = r.scheduled
        out[f"{key}_attempt_ms"] = r.mean_attempt_ms
        out[f"{key}_gpu_attributes"] = r.gpu_attributes
        out[f"{key}_cpu_ms_per_pod"] = r.cpu_ms_per_pod
        out[f"{key}_prioritize_p50_ms"] = r.scorer_latency.get("p50_ms")
        out[f"{key}_prioritize_p99_ms"] = r.scorer_latency.get("p99_ms")
    full, stripped = out["full_pods_per_s"], out["stripped_pods_per_s"]
    out["stripped_ratio"] = full / stripped if stripped == stripped and stripped else None
    out["scorer_ratio"] = out["full_scorer_pods_per_s"] / full if full == full and full else None
    # The same two ratios in kube-scheduler's CPU per pod, which the load of a shared machine hardly moves.
    cpu = {k: out[f"{k}_cpu_ms_per_pod"].get("scheduler") for k in ("full", "stripped", "full_scorer")}
    out["cpu_stripped_ratio"] = cpu["stripped"] / cpu["full"] if cpu["full"] and cpu["stripped"] else None
    out["cpu_scorer_ratio"] = cpu["full"] / cpu["full_scorer"] if cpu["full"] and cpu["full_scorer"] else None
    out["wall_s"] = time.monotonic() - t0
    log(f"{n} nodes: scheduler row in {out['wall_s']:.0f}s: full {full:.1f}, stripped {stripped:.1f}, "
        f"full + scorer {out['full_scorer_pods_per_s']:.1f} pods/s")
    return out


# ----- one size


def run_status_writes(n: int, minutes: float, warmup: float, seed: int) -> dict[str, Any]:
    """Both claim layouts; the flat metrics the targets and curves read, the full runs under their names."""
    from bench.scale.statuswrites import simulate

    out: dict[str, Any] = {}
    for layout in ("mixed", "one-gpu"):
        r = simulate(n, layout, minutes=minutes, warmup=warmup, seed=seed)
        key = layout.replace("-", "_")
        out[layout] = r
        out[f"{key}_claims"] = r["claims"]
        out[f"{key}_summary_median_per_s"] = r["summary"]["per_second_median"]
        out[f"{key}_summary_p99_per_s"] = r["summary"]["per_second_p99"]
        out[f"{key}_condition_p99_per_s"] = r["condition"]["per_second_p99"]
        out[f"{key}_all_median_per_s"] = r["all"]["per_second_median"]
        out[f"{key}_all_p99_per_s"] = r["all"]["per_second_p99"]
        out[f"{key}_bound_per_s"] = r["bound_per_second"]
        out[f"{key}_window_ratio"] = r["window_max_ratio"]
        out[f"{key}_minute_max_ratio"] = r["minute_max_ratio"]
        log(f"{n} nodes: status writes ({layout}, {r['claims']} claims): summaries median "
            f"{r['summary']['per_second_median']:.2f}/s p99 {r['summary']['per_second_p99']:.2f}/s, conditions p99 "
            f"{r['condition']['per_second_p99']:.2f}/s, bound {r['bound_per_second']:.1f}/s, window max "
            f"{r['window_max_per_second']:.2f}/s ({r['sim_cpu_s']:.0f}s CPU)")
    return out


def measure_size(n: int, cluster: SimulatedCluster, rows: Sequence[str], args: argparse.Namespace,
                 png_dir: Path | None) -> dict[str, Any]:
    sub_cluster = first_nodes(cluster, n)
    out: dict[str, Any] = {"nodes": n}
    cluster_rows = [r for r in rows if r not in NO_CLUSTER_ROWS]
    if cluster_rows:
        lc = localcluster.Cluster.private(args.instance)
        with tempfile.TemporaryDirectory() as tmp:
            sub = Path(tmp) / f"scale-{n}.yaml"
            sub.write_text(yaml.safe_dump(sub_cluster.model_dump(by_alias=True, exclude_defaults=True)))
            lc.up(build=False)
            try:
                kube = lc.kube()
                for p in sorted((REPO / "deviceclasses").glob("*.yaml")):
                    kube.create(device_class_path(), yaml.safe_load(p.read_text()))
                t0 = time.monotonic()
                sim = run_simulate(lc, sub, n)
                log(f"{n} nodes: simulate {sim['wall_s']:.1f}s (publishing {sim['publish_s']:.1f}s)")
                if "simulate" in rows:
                    out["simulate"] = sim
                settled = out["settle"] = settle_nodes(lc)
                log(f"{n} nodes: lifted not-ready from {settled['tainted']} Nodes in {settled['settle_s']:.1f}s")
                if "etcd" in rows:
                    out["etcd"] = run_etcd(lc)
                if "inventory" in rows:
                    png = png_dir / f"inventory-{n}.png" if png_dir else None
                    out["inventory"] = run_inventory(lc, sim["gpus"], args.runs, png, args.inventory_baseline)
                if "controller" in rows:
                    out["controller"] = run_controller(lc)
                if "scorer" in rows:
                    out["scorer"] = run_scorer(lc, args.scorer_calls, args.seed, args.scorer_host_resources,
                                               args.scorer_cpu_only)
                if "publisher" in rows:
                    out["publisher"] = run_publisher(lc, sub_cluster, n, args.publisher_window)
                log(f"{n} nodes: rows {', '.join(cluster_rows)} in {time.monotonic() - t0:.0f}s: "
                    + "; ".join(f"{r} " + ", ".join(f"{k}={v:.3g}" for k, v in out[r].items()
                                                    if isinstance(v, float)) for r in cluster_rows if r in out))
            finally:
                os.environ.setdefault("TOPODRA_LOG_ARCHIVE", str(REPO / ".run" / "bench-logs"))
                lc.down(quiet=True, keep_logs=True)
    if "status-writes" in rows:
        out["status-writes"] = run_status_writes(n, args.status_minutes, args.status_warmup, args.seed)
    if "scheduler" in rows:
        pprof = Path(args.scheduler_pprof_dir) if args.scheduler_pprof_dir else None
        out["scheduler"] = run_scheduler(n, args.seed, args.scheduler_qps, pprof, args.scheduler_pods)
    return out


# ----- report


def curves(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    fits: dict[str, Any] = {}
    for row, metric in CURVES:
        pts = [(r["nodes"], r[row][metric]) for r in results if row in r and r[row].get(metric) is not None]
        g = growth([p[0] for p in pts], [p[1] for p in pts])
        fits[f"{row}.{metric}"] = {"points": pts, "fit": g.to_json() if g else None}
    return fits


def verdicts(results: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each target at the largest size measured: met or missed (a missed one is reported, not an error)."""
    out = []
    for (row, metric), (op, bound, what) in TARGETS.items():
        have = [r for r in results if row in r and r[row].get(metric) is not None]
        if not have:
            continue
        last = max(have, key=lambda r: r["nodes"])
        v = float(last[row][metric])
        met = v <= bound if op == "<=" else v >= bound
        out.append({"target": what, "nodes": last["nodes"], "value": v, "met": met,
                    "note": "" if last["nodes"] == 2048 else "measured below 2,048 nodes"})
    return out


def markdown(results: Sequence[Mapping[str, Any]], fits: Mapping[str, Any], checks: Sequence[Mapping[str, Any]]) -> str:
    sizes = [r["nodes"] for r in results]
    lines = ["| row | " + " | ".join(f"{n} nodes" for n in sizes) + " | exponent | ≤ linear |",
             "|---|" + "---|" * (len(sizes) + 2)]
    for key, c in fits.items():
        row, metric = key.split(".", 1)
        vals = {n: v for n, v in c["points"]}
        if not vals:
            continue
        cells = [f"{vals[n]:.4g}" if n in vals else "-" for n in sizes]
        fit = c["fit"]
        lines.append(f"| {row} {metric} | " + " | ".join(cells) + " | "
                     + (f"{fit['exponent']:.2f} | {'yes' if fit['at_most_linear'] else 'NO'} |" if fit else "- | - |"))
    sched = [r for r in results if "scheduler" in r]
    for metric in ("full_pods_per_s", "full_scorer_pods_per_s", "stripped_pods_per_s", "stripped_scorer_pods_per_s",
                   "stripped_ratio", "scorer_ratio", "cpu_stripped_ratio", "cpu_scorer_ratio", "wall_s"):
        if sched:
            vals = {r["nodes"]: r["scheduler"].get(metric) for r in sched}
            lines.append(f"| scheduler {metric} | " + " | ".join(
                f"{vals[n]:.3g}" if vals.get(n) is not None else "-" for n in sizes) + " | - | - |")
    lines += ["", "| target | nodes | value | met |", "|---|---|---|---|"]
    lines += [f"| {c['target']} | {c['nodes']} | {c['value']:.3g} | {'met' if c['met'] else 'MISSED'} |"
              for c in checks]
    return "\n".join(lines) + "\n"


def plot(fits: Mapping[str, Any], out_dir: Path, stamp: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    for key, c in fits.items():
        if len(c["points"]) < 2:
            continue
        xs, ys = zip(*c["points"], strict=True)
        fig, ax = plt.subplots(figsize=(4.2, 3.0), dpi=100)
        ax.plot(xs, ys, "o-", label="measured")
        fit = c["fit"]
        if fit:
            ax.plot(xs, [fit["intercept"] + fit["slope_per_node"] * x for x in xs], "--", label="linear fit")
            ax.set_title(f"{key} (exponent {fit['exponent']:.2f})", fontsize=9)
        ax.set_xlabel("nodes")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{stamp}-{key.replace('.', '-')}.png"
        fig.savefig(path)
        plt.close(fig)
        files.append(str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path))
    return files


def _json_default(o: object) -> object:
    """Paths (e.g. ``--inventory-baseline``) as text, numpy-like numbers as floats."""
    return str(o) if isinstance(o, Path) else float(o)  # type: ignore[arg-type]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/run scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="node counts, comma-separated")
    p.add_argument("--rows", default=",".join(ROWS), help=f"rows to measure, of {','.join(ROWS)}")
    p.add_argument("--cluster", default=str(CLUSTER_FILE), help="the cluster file whose first N nodes are taken")
    p.add_argument("--runs", type=int, default=3, help="inventory runs per variant (median)")
    p.add_argument("--inventory-baseline", type=Path, default=None,
                   help="a checkout whose driver/ also runs each inventory variant, interleaved (*_baseline_s)")
    p.add_argument("--scorer-calls", type=int, default=300)
    p.add_argument("--scorer-host-resources", choices=["on", "off", "mix"], default="on",
                   help="the scorer row's --host-resources (default on, the scorer's default)")
    p.add_argument("--scorer-cpu-only", type=float, default=0.0,
                   help="share of the scorer row's calls for pods without claims (issue 34; default 0)")
    p.add_argument("--publisher-window", type=float, default=60.0, help="seconds of steady state counted")
    p.add_argument("--scheduler-qps", type=int, default=500)
    p.add_argument("--scheduler-pods", type=int, default=512,
                   help="the scheduler row's 1-GPU pods per size: min(nodes, this); 8-GPU pods an eighth of that")
    p.add_argument("--scheduler-pprof-dir", default=None,
                   help="write kube-scheduler's CPU profile (first 20 s) of each scheduler variant here")
    p.add_argument("--status-minutes", type=float, default=30.0,
                   help="status-writes: virtual minutes measured after the warm-up")
    p.add_argument("--status-warmup", type=float, default=30.0,
                   help="status-writes: virtual minutes first (every claim new, as at install: reported apart)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--label", default="", help="result file label")
    p.add_argument("--out-dir", default=None, help="where JSON, Markdown and PNGs go (default bench/results/scale)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--lock-timeout", type=float, default=3600)
    p.add_argument("--instance", default=INSTANCE,
                   help="private cluster instance (and lock) name: runs of other rows need not wait for each other")
    args = p.parse_args(argv)
    try:
        args.size_list = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError:
        p.error(f"--sizes must be integers, got {args.sizes!r}")
    args.row_list = [r for r in args.rows.split(",") if r]
    bad = [r for r in args.row_list if r not in ROWS]
    if bad or not args.row_list:
        p.error(f"unknown rows {bad}; choose from {','.join(ROWS)}")
    if not args.size_list or min(args.size_list) < 1:
        p.error("--sizes needs positive node counts")
    return args


def _exit_on_sigterm() -> None:
    """SIGTERM (a timeout, a Ctrl-C'd wrapper) unwinds like an exception, so every cluster is torn down."""
    def handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    old = signal.getsignal(signal.SIGTERM)
    _exit_on_sigterm()
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, old)  # a caller (pytest) keeps its own handling


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    try:
        cluster = load_cluster(args.cluster)
        for n in args.size_list:
            first_nodes(cluster, n)  # every size fits the file, before anything starts
    except ValueError as e:
        print(f"bench/run scale: {e}", file=sys.stderr)
        return 2
    now = time.time()
    stamp = utc_stamp(now)
    out_dir = Path(args.out_dir) if args.out_dir else result_file("scale", when=now).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    base = f"{stamp}{'-' + args.label if args.label else ''}"
    results: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        with cluster_lock(args.lock_timeout, instance_lock_file(args.instance)):
            for n in args.size_list:
                results.append(measure_size(n, cluster, args.row_list, args,
                                            None if args.no_plots else out_dir))
    except (ScaleError, localcluster.ClusterError, KubeError, subprocess.TimeoutExpired) as e:
        print(f"bench/run scale: {e}", file=sys.stderr)
        return 1
    fits = curves(results)
    checks = verdicts(results)
    pngs = [] if args.no_plots else plot(fits, out_dir, base)
    doc = {"benchmark": "scale", "created": stamp, "wall_s": time.monotonic() - t0,
           "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg": os.getloadavg()},
           "args": {k: v for k, v in vars(args).items()}, "results": results, "curves": fits,
           "targets": checks, "plots": pngs}
    (out_dir / f"{base}.json").write_text(json.dumps(doc, indent=1, default=_json_default))
    table = markdown(results, fits, checks)
    (out_dir / f"{base}.md").write_text(f"# bench/run scale {stamp}\n\n{table}")
    print(table)
    log(f"results: {out_dir / base}.json (+ .md, {len(pngs)} plots) in {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
