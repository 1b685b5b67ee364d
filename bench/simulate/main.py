"""How long ``topodra simulate --once`` takes on a 50-node / 400-GPU cluster, quiet and under CPU load.

Target (issue 15): ``topodra simulate --once hack/clusters/enterprise-400.yaml`` at most 10 s end
to end, also while other work loads the machine.

Two measurements, each repeated (``--runs``) on a quiet machine and again while ``--load-procs``
busy-loop processes compete for the CPUs (a build's worth of runnable work: by default twice the
number of cores). Every repetition is a fresh process, so nothing is cached between them: the
profiles are parsed and the sysfs trees written again each time, as in a real ``--once`` run.

* ``discovery``: mock discovery of every node of the cluster file through the real ``NvmlBackend``
  (``topodra.simulate.discover``, what ``simulate`` runs per node), without a cluster. Reports the
  discovery time inside the process and the process's whole wall time (interpreter, imports,
  discovery). Each run must find the expected GPU count.
* ``e2e`` (``--e2e``, needs root and the cluster binaries): the control plane of
  ``hack/testkit/cluster.py`` (etcd, kube-apiserver, controller-manager, scheduler; no kubelet), then
  ``topodra simulate --once CLUSTER`` as a subprocess, timed from start to exit. After each run the
  published ResourceSlices are counted (untimed) and ``topodra simulate --delete`` removes the nodes
  and slices, so every run starts from the same empty cluster. Takes the cluster lock the test
  fixtures use, because the local cluster binds fixed ports.

``--src DIR`` runs the children against another checkout's ``driver/`` (e.g. ``git archive`` of an
older commit) for before/after numbers in the same conditions. Statistics: median with its
distribution-free 95% interval (order statistics), p99 (nearest rank; with fewer than 100 runs that
is the maximum), min and max. Results go to ``bench/results/simulate/<UTC time>[-<label>].json``.

    bench/run simulate --runs 20                # discovery only
    sudo bench/run simulate --runs 10 --e2e     # plus the real cluster
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.paths import REPO, result_file
from testkit import cluster as localcluster

LOCK_FILE = "/tmp/topodra-test-cluster.lock"  # the pytest cluster fixtures take it too (bench/run inventory also)
DEFAULT_CLUSTER = REPO / "hack/clusters/enterprise-400.yaml"
TARGET_S = 10.0
_SETUP_LOG = re.compile(r"simulating \d+ nodes \(discovery \+ node objects in ([0-9.]+)s")
_DISCOVERY_LOG = re.compile(r"simulating \d+ nodes \(.*; discovery ([0-9.]+)s\)")
_PUBLISH_LOG = re.compile(r"published \d+ nodes, \d+ GPUs in ([0-9.]+)s")

# Runs in a fresh interpreter: time mock discovery of every node, print one JSON line.
_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from topodra.simulate import discover, load_cluster, plan
nodes = plan(load_cluster(sys.argv[1]))
t1 = time.perf_counter()
devices = [discover(n) for n in nodes]
t2 = time.perf_counter()
print(json.dumps({"nodes": len(nodes), "gpus": sum(d.kind == "gpu" for ds in devices for d in ds),
                  "setup_s": t1 - t0, "discover_s": t2 - t1}))
"""


def log(msg: str) -> None:
    print(f"[simulate-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- statistics


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of an ascending list."""
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def median_interval(sorted_values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free interval for the median: the narrowest order statistics (x_k, x_(n+1-k))
    whose coverage, from Binomial(n, 1/2), is at least ``confidence`` (whole range if n is too small)."""
    n = len(sorted_values)
    cdf = 0.0
    k = 0  # largest k with P(B <= k-1) <= (1 - confidence) / 2
    for j in range(n + 1):
        cdf += math.comb(n, j) / 2**n
        if cdf > (1 - confidence) / 2:
            break
        k = j + 1
    if k == 0:
        return sorted_values[0], sorted_values[-1]
    return sorted_values[k - 1], sorted_values[n - k]


def summarize(samples: list[float]) -> dict[str, Any]:
    v = sorted(samples)
    lo, hi = median_interval(v)
    return {"n": len(v), "median": round(statistics.median(v), 3), "median_ci95": [round(lo, 3), round(hi, 3)],
            "p99": round(percentile(v, 99), 3), "min": round(v[0], 3), "max": round(v[-1], 3)}


# --------------------------------------------------------------------------- load


@contextlib.contextmanager
def cpu_load(procs: int) -> Iterator[None]:
    """``procs`` busy-loop processes at normal priority for the duration of the block."""
    started = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(procs)]
    try:
        time.sleep(1.0)  # let the scheduler see them as CPU hogs before the first timed run
        yield
    finally:
        for p in started:
            p.kill()
        for p in started:
            p.wait()


def child_env(src: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src / "driver"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


# --------------------------------------------------------------------------- discovery


def discovery_runs(cluster_file: Path, runs: int, env: dict[str, str], expect_gpus: int | None) -> dict[str, Any]:
    discover_s: list[float] = []
    process_s: list[float] = []
    gpus: set[int] = set()
    for i in range(runs):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", _CHILD, str(cluster_file)], env=env, check=True,
                             capture_output=True, text=True)
        process_s.append(time.perf_counter() - t0)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        discover_s.append(r["discover_s"])
        gpus.add(r["gpus"])
        log(f"  run {i + 1}/{runs}: discovery {r['discover_s']:.2f}s, process {process_s[-1]:.2f}s, "
            f"{r['nodes']} nodes, {r['gpus']} GPUs")
    if len(gpus) != 1 or (expect_gpus is not None and gpus != {expect_gpus}):
        raise SystemExit(f"discovery found {sorted(gpus)} GPUs, expected {expect_gpus}")
    return {"gpus": gpus.pop(), "discover_s": summarize(discover_s), "process_s": summarize(process_s),
            "samples_discover_s": [round(x, 3) for x in discover_s]}


# --------------------------------------------------------------------------- end to end


@contextlib.contextmanager
def cluster_lock() -> Iterator[None]:
    fd = os.open(LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        if not _try_lock(fd):
            log(f"waiting for {LOCK_FILE} (another session runs a cluster)")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def topodra_cmd() -> list[str]:
    return [sys.executable, "-m", "topodra.cli"]


def published_gpus(kubeconfig: Path, env: dict[str, str]) -> int:
    """GPUs in the apiserver's ResourceSlices (checked after each run, untimed)."""
    code = ("import sys; from topodra.kube import Kube; k = Kube.from_kubeconfig(sys.argv[1]); "
            "print(sum(d['attributes']['type']['string'] == 'gpu' for s in "
            "k.list('/apis/resource.k8s.io/v1/resourceslices') for d in s['spec'].get('devices', [])))")
    out = subprocess.run([sys.executable, "-c", code, str(kubeconfig)], env=env, check=True,
                         capture_output=True, text=True)
    return int(out.stdout.strip())


def e2e_runs(cluster_file: Path, runs: int, kubeconfig: Path, env: dict[str, str],
             expect_gpus: int) -> dict[str, Any]:
    base = [*topodra_cmd(), "simulate", str(cluster_file), "--kubeconfig", str(kubeconfig)]
    wall: list[float] = []
    phases: dict[str, list[float]] = {"setup_s": [], "discovery_s": [], "publish_s": []}
    for i in range(runs):
        t0 = time.perf_counter()
        # Publishing only, as measured before simulate waited for the nodes to become schedulable.
        p = subprocess.run([*base, "--once", "--ready-timeout", "0"], env=env, capture_output=True, text=True)
        wall.append(time.perf_counter() - t0)
        if p.returncode != 0:
            raise SystemExit(f"simulate --once failed ({p.returncode}):\n{p.stderr[-3000:]}")
        for key, pattern in (("setup_s", _SETUP_LOG), ("discovery_s", _DISCOVERY_LOG), ("publish_s", _PUBLISH_LOG)):
            m = pattern.search(p.stderr)
            if m:
                phases[key].append(float(m.group(1)))
        got = published_gpus(kubeconfig, env)
        if got != expect_gpus:
            raise SystemExit(f"simulate --once published {got} GPUs, expected {expect_gpus}")
        subprocess.run([*base, "--delete"], env=env, check=True, capture_output=True, text=True)
        if published_gpus(kubeconfig, env) != 0:
            raise SystemExit("simulate --delete left slices behind")
        log(f"  run {i + 1}/{runs}: simulate --once {wall[-1]:.2f}s, {got} GPUs published "
            f"(its log: setup {_last(phases['setup_s'])} incl. discovery {_last(phases['discovery_s'])}, "
            f"publish {_last(phases['publish_s'])})")
    out: dict[str, Any] = {"wall_s": summarize(wall), "samples_wall_s": [round(x, 3) for x in wall]}
    # Phases as simulate logs them (0.1 s resolution): discovery + Node objects (setup), then the slice writes.
    out.update({k: summarize(v) for k, v in phases.items() if len(v) == runs})
    return out


def _last(values: list[float]) -> str:
    return f"{values[-1]:.1f}s" if values else "?"


def with_cluster(fn: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    with cluster_lock():
        state = Path(tempfile.mkdtemp(prefix="topodra-simbench-cluster-"))
        state.rmdir()  # the harness creates (and removes) its own directory
        lc = localcluster.Cluster(state_dir=state)
        failed = True
        try:
            log("starting the control plane (etcd, apiserver, controller-manager, scheduler)")
            lc.up(node=False, build=False)
            result = fn(lc.admin_kubeconfig)
            failed = False
            return result
        finally:
            os.environ.setdefault("TOPODRA_LOG_ARCHIVE", str(REPO / ".run" / "bench-logs"))
            lc.down(quiet=True, keep_logs=failed)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/run simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster-file", type=Path, default=DEFAULT_CLUSTER)
    p.add_argument("--runs", type=int, default=20, help="repetitions per condition (default 20)")
    p.add_argument("--load-procs", type=int, default=2 * (os.cpu_count() or 1),
                   help="busy-loop processes for the loaded condition (default: 2 x cores)")
    p.add_argument("--expect-gpus", type=int, default=400)
    p.add_argument("--e2e", action="store_true", help="also time `topodra simulate --once` on a real local cluster")
    p.add_argument("--no-discovery", action="store_true", help="skip the cluster-less discovery measurement")
    p.add_argument("--src", type=Path, default=None, help="checkout whose driver/ the children import")
    p.add_argument("--label", default="", help="stored with the results and ends the default file name (e.g. "
                   "'before-faf15f3'; letters, digits, '.', '_', '-')")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.runs < 1 or args.load_procs < 0:
        p.error("--runs must be >= 1 and --load-procs >= 0")
    if args.src is not None and not (args.src / "driver" / "topodra").is_dir():
        p.error(f"--src {args.src}: no driver/topodra there")
    try:
        result_file("simulate", args.label)
    except ValueError as e:
        p.error(f"--label: {e}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = child_env(args.src)
    now = time.time()
    started = time.gmtime(now)
    result: dict[str, Any] = {
        "benchmark": "simulate", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", started), "label": args.label,
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_1m": os.getloadavg()[0]},
        "config": {"cluster_file": str(args.cluster_file), "runs": args.runs, "load_procs": args.load_procs,
                   "src": str(args.src) if args.src else str(REPO)},
        "target_s": TARGET_S,
    }
    conditions = [("quiet", 0), ("loaded", args.load_procs)]
    if not args.no_discovery:
        result["discovery"] = {}
        for name, procs in conditions:
            log(f"mock discovery, {name} ({procs} busy processes), {args.runs} runs")
            with cpu_load(procs):
                result["discovery"][name] = discovery_runs(args.cluster_file, args.runs, env, args.expect_gpus)
    if args.e2e:
        if os.geteuid() != 0:
            log("--e2e needs root (the local cluster binds fixed ports and writes /etc/hosts)")
            return 2

        def measure(kubeconfig: Path) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for name, procs in conditions:
                log(f"simulate --once end to end, {name} ({procs} busy processes), {args.runs} runs")
                with cpu_load(procs):
                    out[name] = e2e_runs(args.cluster_file, args.runs, kubeconfig, env, args.expect_gpus)
            return out

        result["e2e"] = with_cluster(measure)
    out_path: Path = args.out or result_file("simulate", args.label, when=now)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    log(f"results written to {out_path}")
    return 0


def print_table(result: dict[str, Any]) -> None:
    rows = [("measurement", "condition", "n", "median s", "95% CI of median", "p99 s", "max s")]
    for part, key in (("discovery", "discover_s"), ("discovery", "process_s"), ("e2e", "wall_s"),
                      ("e2e", "setup_s"), ("e2e", "discovery_s"), ("e2e", "publish_s")):
        for cond, r in (result.get(part) or {}).items():
            if key not in r:
                continue
            s = r[key]
            rows.append((f"{part} {key}", cond, str(s["n"]), f"{s['median']:.2f}",
                         f"[{s['median_ci95'][0]:.2f}, {s['median_ci95'][1]:.2f}]", f"{s['p99']:.2f}",
                         f"{s['max']:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print("\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows))
    e2e = result.get("e2e") or {}
    if e2e:
        worst = max(r["wall_s"]["p99"] for r in e2e.values())
        print(f"target: simulate --once <= {TARGET_S:.0f}s: {'met' if worst <= TARGET_S else 'MISSED'} "
              f"(worst p99 {worst:.2f}s)")


if __name__ == "__main__":
    sys.exit(main())
