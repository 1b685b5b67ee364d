"""Resident memory that each dependency adds to the kubelet plugin, imported in the plugin's order.

Each row is measured in a fresh interpreter that imports every module up to and including that row,
so a row's increment is what that import adds on top of the previous ones (shared dependencies are
counted where they first load). Usage: bench/run import_rss [--json FILE]   (no file unless --json)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# The plugin's heavy imports, roughly in the order `topodra kubelet-plugin` loads them.
STEPS: list[tuple[str, str]] = [
    ("python (nothing imported)", "pass"),
    ("pydantic + yaml (config)", "import pydantic, yaml"),
    ("grpc", "import grpc"),
    ("generated DRA/health stubs", "import topodra.pb.dra.v1.api_pb2, topodra.pb.dra.v1beta1.api_pb2, "
     "topodra.pb.drahealth.v1.api_pb2, topodra.pb.drahealth.v1alpha1.api_pb2, topodra.pb.grpchealth.v1.health_pb2"),
    ("prometheus_client", "import prometheus_client"),
    ("urllib3 (topodra.kube's light transport)", "import urllib3"),
    ("topodra plugin modules", "import topodra.plugin.main, topodra.plugin.server, topodra.plugin.probes, "
     "topodra.kube, topodra.publisher, topodra.hardware, topodra.state"),
    # Not loaded by the plugin any more (only for exec/auth-provider kubeconfigs): shown for comparison.
    ("+ kubernetes official client (fallback only)",
     "from kubernetes import config; from kubernetes.client import ApiClient"),
]

PROBE = """
import sys
{imports}
for line in open('/proc/self/status'):
    if line.startswith('VmRSS'):
        print(int(line.split()[1]))
"""


def rss_kib(statements: list[str]) -> int:
    code = PROBE.format(imports="\n".join(statements))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/run import_rss", description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="also write the rows as JSON")
    p.add_argument("--repeat", type=int, default=3, help="runs per row; the median is used")
    args = p.parse_args(argv)
    rows = []
    prev = 0
    for i, (label, _stmt) in enumerate(STEPS):
        stmts = [s for _, s in STEPS[: i + 1]]
        runs = sorted(rss_kib(stmts) for _ in range(args.repeat))
        total = runs[len(runs) // 2]
        rows.append({"import": label, "total_MiB": round(total / 1024, 1),
                     "added_MiB": round((total - prev) / 1024, 1)})
        prev = total
    print(f"{'import':40s} {'adds MiB':>9s} {'total MiB':>10s}")
    for r in rows:
        print(f"{r['import']:40s} {r['added_MiB']:>9.1f} {r['total_MiB']:>10.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
