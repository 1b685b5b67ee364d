"""How long ``topodra inventory`` takes on enterprise-400 (50 nodes, 400 GPUs), as an operator runs it.

Target (issue 12): an answer in under 2 s for 400 GPUs, table and ``--png``.

Setup (untimed), on a fresh control plane of ``hack/testkit/cluster.py`` (taking the cluster lock the test
fixtures use): ``topodra simulate --once hack/clusters/enterprise-400.yaml``, the shipped DeviceClasses,
then ``--pods`` pods, each with one claim allocated by the real kube-scheduler: jobs of 1-8 GPUs in three namespaces
(default 56 jobs, 195 GPUs, about half the cluster), two GPUs drained by DeviceTaintRules, plus one
16-GPU claim that fits nowhere (a pending claim with the scheduler's reason).

Timed: each run is a fresh ``python -m topodra.cli inventory`` process (interpreter start, imports, six
lists, the view, the output), for the table, ``-o json``, ``-o yaml`` and ``--png FILE``. In-process, the
same run's phases: listing (``fetch``) and building the view (``build_view``). Statistics: median with its
distribution-free 95% interval, p99 (nearest rank: the maximum below 100 runs), min, max. Results go to
``bench/results/inventory/<UTC time>.json``, with the 1-minute load average before each run.

``--baseline-src DIR`` runs each variant a second time with DIR's ``driver/`` (``*_baseline``), interleaved,
and reports the paired differences run by run (``*_paired_diff_s``: this checkout minus the baseline), which
the machine's drifting load blurs far less than two separate medians.

    bench/run inventory --runs 15
    bench/run inventory --runs 21 --baseline-src /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from bench.paths import REPO, result_file
from bench.simulate.main import log, summarize, with_cluster

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.apipaths import (
    claim_path,
    device_class_path,
    device_taint_rule_path,
    namespace_path,
    pod_path,
    template_path,
)
from topodra.clusterview.fetch import fetch
from topodra.clusterview.model import build_view
from topodra.kube import Kube

CLUSTER_FILE = REPO / "hack/clusters/enterprise-400.yaml"
NAMESPACES = ("team-a", "team-b", "ml-train")
SIZES = (8, 4, 1, 2, 4, 1, 8, 1, 2, 4)  # GPUs per job, cycled: a mix that leaves fragments
TAINTED = (("a100-su1-3", "gpu-2"), ("h100-su2-7", "gpu-5"))  # drained by DeviceTaintRules
TARGET_S = 2.0


def cli(kubeconfig: Path) -> list[str]:
    return [sys.executable, "-m", "topodra.cli", "inventory", "--kubeconfig", str(kubeconfig)]


def wait(fn: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.5)
    raise SystemExit(f"timed out waiting for {what}")


def pod(ns: str, name: str, tmpl: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
            "spec": {"restartPolicy": "Never", "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": tmpl}],
                     "containers": [{"name": "main", "image": "localhost/busybox:1.35", "command": ["true"],
                                     "resources": {"claims": [{"name": "gpus"}]}}]}}


def template(ns: str, count: int) -> dict[str, Any]:
    devices: dict[str, Any] = {
        "requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu.topodra.io", "count": count}}]}
    if count > 1:
        devices["constraints"] = [{"requests": ["gpus"], "matchAttribute": f"{DRIVER}/nvlinkDomain"}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": f"gpus-{count}", "namespace": ns}, "spec": {"spec": {"devices": devices}}}


def populate(kube: Kube, kubeconfig: Path, pods: int) -> int:
    """Publish enterprise-400, taint two GPUs, let the scheduler allocate ``pods`` jobs; returns GPUs allocated."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "topodra.cli", "simulate", str(CLUSTER_FILE), "--kubeconfig",
                    str(kubeconfig), "--once"], check=True, capture_output=True, text=True)
    for p in sorted((REPO / "deviceclasses").glob("*.yaml")):
        kube.create(device_class_path(), yaml.safe_load(p.read_text()))
    for node, dev in TAINTED:
        kube.create(device_taint_rule_path(), {
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": {"name": f"drain-{node}-{dev}"},
            "spec": {"deviceSelector": {"driver": DRIVER, "pool": node, "device": dev},
                     "taint": {"key": "topodra.io/maintenance", "effect": "NoSchedule"}}})
    for ns in NAMESPACES:
        kube.create(namespace_path(), {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        wait(lambda ns=ns: kube.get(f"/api/v1/namespaces/{ns}/serviceaccounts/default"), 60, "ServiceAccount")
        for size in (*sorted(set(SIZES)), 16):
            kube.create(template_path(ns), template(ns, size))
    time.sleep(1.0)  # the scheduler sees the taint rules first
    gpus = 0
    for i in range(pods):
        ns, size = NAMESPACES[i % len(NAMESPACES)], SIZES[i % len(SIZES)]
        kube.create(pod_path(ns), pod(ns, f"job-{i}", f"gpus-{size}"))
        gpus += size
    kube.create(pod_path("ml-train"), pod("ml-train", "too-big", "gpus-16"))  # pending: no node has 16

    def allocated() -> bool:
        return sum(1 for c in kube.list(claim_path()) if (c.get("status") or {}).get("allocation")) >= pods

    wait(allocated, 300, f"{pods} claims allocated")
    log(f"cluster populated in {time.monotonic() - t0:.1f}s: 400 GPUs, {pods} jobs holding {gpus} GPUs")
    return gpus


def measure(kubeconfig: Path, runs: int, pods: int, save_png: Path | None,
            baseline: Path | None = None) -> dict[str, Any]:
    kube = Kube.from_kubeconfig(str(kubeconfig))
    gpus = populate(kube, kubeconfig, pods)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        variants: dict[str, list[str]] = {"table": [], "json": ["-o", "json"], "yaml": ["-o", "yaml"],
                                          "png": ["--png", f"{tmp}/inv.png"]}
        envs: dict[str, dict[str, str] | None] = dict.fromkeys(variants)
        if baseline is not None:  # the same runs with another checkout's driver/, under the same load
            for name, extra in list(variants.items()):
                variants[f"{name}_baseline"] = ["--png", f"{tmp}/base.png"] if name == "png" else extra
                envs[f"{name}_baseline"] = {**os.environ, "PYTHONPATH": str(baseline / "driver")}
        walls: dict[str, list[float]] = {k: [] for k in variants}
        loads: list[float] = []
        for i in range(runs):
            loads.append(os.getloadavg()[0])
            for name, extra in variants.items():  # interleaved, so drift in machine load hits all alike
                t0 = time.perf_counter()
                p = subprocess.run([*cli(kubeconfig), *extra], capture_output=True, text=True, env=envs[name])
                walls[name].append(time.perf_counter() - t0)
                if p.returncode != 0:
                    raise SystemExit(f"inventory {name} failed: {p.stderr[-2000:]}")
                if name.startswith("json"):
                    data = json.loads(p.stdout)
                    if data["summary"]["total"] != 400 or data["summary"]["allocated"] != gpus:
                        raise SystemExit(f"unexpected inventory: {data['summary']}")
            log(f"  run {i + 1}/{runs}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in walls.items()))
        out.update({f"{k}_wall_s": summarize(v) for k, v in walls.items()})
        for k in [k for k in walls if f"{k}_baseline" in walls]:  # paired: run i of both saw the same load
            diffs = [a - b for a, b in zip(walls[k], walls[f"{k}_baseline"], strict=True)]
            out[f"{k}_paired_diff_s"] = {**summarize(diffs), "faster_runs": sum(d < 0 for d in diffs)}
        out["samples"] = {k: [round(x, 3) for x in v] for k, v in walls.items()}
        out["loadavg_1m_samples"] = [round(x, 2) for x in loads]
        if save_png is not None:
            save_png.write_bytes(Path(f"{tmp}/inv.png").read_bytes())
    fetch_s, build_s = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        src = fetch(kube, DRIVER)
        t1 = time.perf_counter()
        build_view(src)
        fetch_s.append(t1 - t0)
        build_s.append(time.perf_counter() - t1)
    out["fetch_s"] = summarize(fetch_s)
    out["build_view_s"] = summarize(build_s)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/run inventory", description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--pods", type=int, default=56, help="jobs allocated before timing (default 56: ~half the GPUs)")
    ap.add_argument("--save-png", type=Path, default=None, help="keep the last --png picture here")
    ap.add_argument("--json", type=Path, default=None,
                    help="result file (default bench/results/inventory/<UTC time>.json)")
    ap.add_argument("--baseline-src", type=Path, default=None,
                    help="a checkout (e.g. `git worktree add /tmp/base HEAD~3`) whose driver/ also runs every "
                         "variant, interleaved with this one: *_baseline_wall_s and the paired *_paired_diff_s")
    args = ap.parse_args(argv)
    if args.baseline_src is not None and not (args.baseline_src / "driver/topodra/cli.py").is_file():
        ap.error(f"--baseline-src {args.baseline_src}: no driver/topodra/cli.py there")
    if args.runs < 1 or not 0 <= args.pods <= 100:
        ap.error("--runs must be >= 1 and --pods in 0..100")
    load_start = os.getloadavg()
    result = {"benchmark": "inventory", "cluster": CLUSTER_FILE.name, "pods": args.pods, "runs": args.runs,
              "target_s": TARGET_S, "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
              **with_cluster(lambda kc: measure(kc, args.runs, args.pods, args.save_png, args.baseline_src))}
    if args.baseline_src is not None:
        result["baseline_src"] = str(args.baseline_src)
    # Other work on the machine inflates every number; the load average says how much there was.
    result["loadavg_1m"] = {"start": round(load_start[0], 2), "end": round(os.getloadavg()[0], 2)}
    path = args.json or result_file("inventory")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    variants = ("table", "json", "yaml", "png")
    for k in (*(f"{v}_wall_s" for v in variants), *(f"{v}_baseline_wall_s" for v in variants),
              *(f"{v}_paired_diff_s" for v in variants), "fetch_s", "build_view_s"):
        if k not in result:
            continue
        s = result[k]
        faster = f"  faster in {s['faster_runs']}/{s['n']}" if "faster_runs" in s else ""
        print(f"{k:21} median {s['median']:.3f} [{s['median_ci95'][0]:.3f}, {s['median_ci95'][1]:.3f}]  "
              f"p99 {s['p99']:.3f}  min {s['min']:.3f}  max {s['max']:.3f}{faster}")
    print(f"target: < {TARGET_S} s; results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
