"""``bench/run reliability``: run the campaigns with counts from flags, print a table, write JSON."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.paths import result_file
from bench.reliability import cleanup as reliability_cleanup
from bench.reliability import crash as reliability_crash
from bench.reliability import disk as reliability_disk
from bench.reliability import fuzz as reliability_fuzz
from bench.reliability import gpueffects as reliability_gpueffects
from bench.reliability import process as reliability_process

PARTS = ("crash", "gpu-effects", "process", "fuzz", "disk", "cleanup", "apifaults")


def count_of(part: str, result: Mapping[str, Any]) -> tuple[int, str]:
    """How much a part did, read from its own result (what the table's count column shows), and its unit."""
    if part in ("crash", "gpu-effects", "process"):
        return int(result["runs"]), "runs"
    if part == "fuzz":
        return int(result["requests"]), "requests"
    if part == "disk":
        return int(result["rounds_per_target"]) * len(result["targets"]), "rounds"
    if part == "cleanup":
        return int(result["rounds"]), "rounds"
    if part == "apifaults":
        return len(result["scenarios"]), "scenarios"
    raise ValueError(f"unknown part {part!r}; parts are {', '.join(PARTS)}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/run reliability", description=__doc__)
    p.add_argument("--crash-runs", type=int, default=500, help="kill -9 runs (default 500)")
    p.add_argument("--gpu-rounds", type=int, default=25,
                   help="gpu-effects: passes over every crash point on each of its 3 nodes (default 25: 550 runs; "
                        "root, MPS mounts tmpfs)")
    p.add_argument("--process-runs", type=int, default=30,
                   help="kill -9 runs on a real plugin process over its socket (default 30; ~1 s each)")
    p.add_argument("--fuzz-requests", type=int, default=10_000, help="fuzzed gRPC requests (default 10000)")
    p.add_argument("--fuzz-big-calls", type=int, default=2, help="extra calls with 10,000 claims each (default 2)")
    p.add_argument("--disk-rounds", type=int, default=3, help="disk-full rounds per directory (default 3)")
    p.add_argument("--cleanup-rounds", type=int, default=100, help="deleted-while-down rounds (default 100)")
    p.add_argument("--apifault-pause", type=float, default=10.0,
                   help="seconds each control-plane component stays stopped (default 10)")
    p.add_argument("--lock-timeout", type=float, default=3600.0,
                   help="how long apifaults waits for the shared cluster lock (default 3600 s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--workdir", type=Path, default=None, help="where the node directories go (default /tmp)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file (default bench/results/reliability/<UTC time>.json)")
    args = p.parse_args(argv)
    unknown = set(args.only.split(",")) - set(PARTS)
    if unknown:
        p.error(f"--only: unknown parts {sorted(unknown)}")
    return args


def apifaults(args: argparse.Namespace) -> dict[str, Any]:
    """The API-fault part on its own local control plane, in a turn of the shared cluster lock."""
    import tempfile

    from bench.prepare.main import cluster_lock
    from bench.reliability import apifaults as reliability_apifaults
    from testkit import cluster as localcluster

    start = time.monotonic()
    with cluster_lock(args.lock_timeout):
        state = Path(tempfile.mkdtemp(prefix="topodra-reliability-cluster-"))
        state.rmdir()  # the harness creates (and removes) its own directory
        lc = localcluster.Cluster(state_dir=state)
        try:
            lc.up(node=False, build=True)
            out = reliability_apifaults.run(lc, pause_s=args.apifault_pause)
        finally:
            lc.down(quiet=True)
    out["seconds"] = round(time.monotonic() - start, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    parts = args.only.split(",")
    results: dict[str, Any] = {}
    if "crash" in parts:
        results["crash"] = reliability_crash.run(args.crash_runs, seed=args.seed, root=args.workdir)
    if "gpu-effects" in parts:
        results["gpu-effects"] = reliability_gpueffects.run(args.gpu_rounds, seed=args.seed, root=args.workdir)
    if "process" in parts:
        results["process"] = reliability_process.run(args.process_runs, seed=args.seed, root=args.workdir)
    if "fuzz" in parts:
        results["fuzz"] = reliability_fuzz.run(args.fuzz_requests, big_calls=args.fuzz_big_calls, seed=args.seed,
                                               root=args.workdir)
    if "disk" in parts:
        results["disk"] = reliability_disk.run(args.disk_rounds, root=args.workdir)
    if "cleanup" in parts:
        results["cleanup"] = reliability_cleanup.run(args.cleanup_rounds, seed=args.seed, root=args.workdir)
    if "apifaults" in parts:
        results["apifaults"] = apifaults(args)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    doc = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit,
           "host": platform.node(), "args": {k: str(v) for k, v in vars(args).items()}, "results": results}
    out = args.out or result_file("reliability")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    if "gpu-effects" in results:
        print(reliability_gpueffects.table(results["gpu-effects"]))
    print(f"{'part':<11} {'count':>8} {'of':<9} {'lost':>5} {'seconds':>8}")
    total_lost = 0
    for part, r in results.items():
        count, unit = count_of(part, r)
        total_lost += len(r["lost"])
        print(f"{part:<11} {count:>8} {unit:<9} {len(r['lost']):>5} {r['seconds']:>8}")
        for line in r["lost"][:20]:
            print(f"  LOST {line}", file=sys.stderr)
    print(f"wrote {out}")
    return 1 if total_lost else 0
