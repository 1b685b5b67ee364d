"""``bench/run telemetry``: what the telemetry sampler costs (issue 32's target: 8 GPUs and 8 NICs every 10 s
for at most 0.5% of one core, median over 10 minutes, and at most 5 MiB more RSS).

This process loads the C NVML stand-in of a dgx-h100 driver tree (hack/driver-tree) the production way, builds
the sysfs tree with each compute NIC's port counters, discovers the devices as the plugin does, and runs the
plugin's ``Sampler`` thread on them with every device in a claim (so every GPU and NIC series is attributed and
the idle rule runs). Its CPU share per interval (process CPU time / wall time; the main thread only sleeps) and
its RSS before and after are recorded. The stand-in answers in microseconds; the real driver's calls take
longer, so this measures topodra's side only: run it on a GPU host with ``--driver-root /`` for the whole cost.

    bench/run telemetry [--duration 600] [--interval 10] [--label NAME] [--driver-root DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.paths import REPO, result_file


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench/run telemetry", description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of sampling measured (default 600)")
    ap.add_argument("--interval", type=float, default=10.0, help="sampling interval in seconds (default 10)")
    ap.add_argument("--label", default="", help="result file label")
    ap.add_argument("--driver-root", default=None, help="an NVIDIA driver root (default: a stand-in dgx-h100 tree)")
    ap.add_argument("--out", default=None, help="result file (default bench/results/telemetry/<UTC>.json)")
    a = ap.parse_args(argv)
    if a.duration <= 0 or a.interval <= 0 or a.duration < a.interval:
        ap.error("need 0 < --interval <= --duration")
    out = Path(a.out) if a.out else result_file("telemetry", a.label)

    from topodra.claims import ClaimRef
    from topodra.hardware import load_backend
    from topodra.hardware.mockprofile import build_tree, load_profile
    from topodra.inventory import Inventory
    from topodra.telemetry.sampler import Sampler

    work = Path(tempfile.mkdtemp(prefix="topodra-bench-telemetry."))
    root = a.driver_root
    if root is None:
        r = subprocess.run([str(REPO / "hack" / "driver-tree"), "--profile", "dgx-h100", str(work / "root"),
                            "--node", "n1", "--no-dev-nodes"], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            sys.stderr.write(r.stderr)
            return 1
        root = r.stdout.strip()
    sysfs = work / "sysfs"
    build_tree(load_profile("dgx-h100"), frozenset()).materialize(str(sysfs))
    for dev in (sysfs / "sys/class/infiniband").iterdir():
        counters = dev / "ports/1/counters"
        counters.mkdir(parents=True, exist_ok=True)
        for name in ("port_rcv_data", "port_xmit_data"):
            (counters / name).write_text("123456789\n")
    be = load_backend("nvml", "n1", sysfs_root=str(sysfs), nvidia_driver_root=root)
    inv = Inventory(be.discover())
    held = {"u": (ClaimRef("bench", "u", "all"), frozenset(("n1", d.name, None) for d in inv.devices))}
    sampler = Sampler(inv, be.nvml, be.sysfs, pool="n1", driver="gpu.topodra.io", held=lambda: held,
                      interval=a.interval)
    rss_before = _rss_mib()
    sampler.start()
    time.sleep(min(a.interval, 2.0))  # the first round opens NVML: not a steady-state cost
    shares: list[float] = []
    rounds: list[int] = []
    end = time.monotonic() + a.duration
    while time.monotonic() < end:
        c0, t0, n0 = _cpu(), time.monotonic(), sampler.snapshot.samples
        time.sleep(a.interval)
        shares.append((_cpu() - c0) / (time.monotonic() - t0))
        rounds.append(sampler.snapshot.samples - n0)
    rss_after = _rss_mib()
    snap = sampler.snapshot
    sampler.stop()
    result: dict[str, Any] = {
        "bench": "telemetry", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "driver_root": a.driver_root or "stand-in dgx-h100", "interval_s": a.interval, "duration_s": a.duration,
        "gpus": len(snap.gpus), "nics": len(snap.nics), "windows": len(shares), "rounds_per_window": rounds,
        "cpu_share_of_one_core_median": statistics.median(shares),
        "cpu_share_of_one_core_max": max(shares), "cpu_share_per_window": shares,
        "last_round_duration_s": snap.duration, "errors": dict(snap.errors),
        "rss_before_mib": round(rss_before, 2), "rss_after_mib": round(rss_after, 2),
        "rss_delta_mib": round(rss_after - rss_before, 2),
        "targets": {"cpu_share_median_max": 0.005, "rss_delta_mib_max": 5.0},
        "load_average": os.getloadavg(),
    }
    result["meets_targets"] = (result["cpu_share_of_one_core_median"] <= 0.005 and result["rss_delta_mib"] <= 5.0)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("gpus", "nics", "windows", "cpu_share_of_one_core_median",
                                              "rss_delta_mib", "meets_targets")}))
    print(f"wrote {out}")
    return 0
