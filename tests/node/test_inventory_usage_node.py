"""The telemetry summary from the real plugin on the real kubelet node, read back by ``topodra inventory``.

The plugin runs with ``--hardware nvml`` against the C NVML stand-in (dgx-h100), samples every second, calls a
claim idle after 3 s below the thresholds and may write a claim's summary every 2 s (its slots). A pod holding 2
GPUs runs busy, then the scenario goes idle: the claim's ``status.devices[].data`` carries the summary (busy,
then idle with ``idleSince``) next to the Idle condition, and the inventory CLI's JSON and table show the node's
activity, the namespace's GPU-hours and the idle claim with its pod.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from testkit.handle import ClusterHandle, wait_for
from testkit.pluginproc import DRIVER, PluginProcess
from testkit.standin import driver_tree, write_faults
from testkit.standinplugin import standin_plugin

from topodra.apipaths import claim_path

pytestmark = pytest.mark.node
R = "/apis/resource.k8s.io/v1"
PROFILE = "dgx-h100"
GIB = 1 << 30
BUSY = {"utilGpu": 95, "memoryUsed": 40 * GIB, "smActivity": 85.0}


def scenario(tree: Path, telemetry: dict[str, Any] | None) -> None:
    write_faults(tree, {"gpus": {str(i): {"telemetry": telemetry} for i in range(8)}} if telemetry else {})


@pytest.fixture(scope="module")
def rig(node_cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, PluginProcess]]:
    base = tmp_path_factory.mktemp("invusage")
    tree = driver_tree(base / "root", PROFILE, node=node_cluster.node_name, dev_nodes=True)
    scenario(tree, BUSY)
    with standin_plugin(node_cluster, base, tree, PROFILE, "topodra-plugin-invusage.log",
                        {"TOPODRA_TELEMETRY_INTERVAL": "1", "TOPODRA_IDLE_SECONDS": "3",
                         "TOPODRA_STATUS_SUMMARY_INTERVAL": "2"}) as p:
        yield tree, p


def summaries(claim: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["device"]: d["data"] for d in (claim.get("status") or {}).get("devices") or []
            if d.get("driver") == DRIVER and (d.get("data") or {}).get("kind") == "GPUTelemetrySummary"}


def inventory(nc: ClusterHandle, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "topodra.cli", "inventory", "--kubeconfig", nc.kubeconfig,
                           "--node", nc.node_name, *args], capture_output=True, text=True, timeout=120, check=False)


def test_plugin_summary_reaches_the_inventory(node_cluster: ClusterHandle, rig: tuple[Path, PluginProcess]) -> None:
    nc = node_cluster
    tree, plugin = rig
    ns = nc.namespace("invuse")
    nc.kube.create(f"{R}/namespaces/{ns}/resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "two"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": 2}}]}}})
    nc.kube.create(f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
        "spec": {"hostNetwork": True, "restartPolicy": "Never", "automountServiceAccountToken": False,
                 "terminationGracePeriodSeconds": 1, "resourceClaims": [{"name": "gpus", "resourceClaimName": "two"}],
                 "containers": [{"name": "c", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                                 "command": ["sh", "-c", "sleep 600"], "resources": {"claims": [{"name": "gpus"}]}}]}})
    try:
        wait_for(lambda: ((nc.kube.get(f"/api/v1/namespaces/{ns}/pods/p") or {}).get("status") or {}).get("phase")
                 == "Running", 120, "pod p running")
        claim = nc.kube.get(claim_path(ns, "two")) or {}
        gpus = sorted(r["device"] for r in claim["status"]["allocation"]["devices"]["results"])

        def busy_summary() -> dict[str, dict[str, Any]] | None:
            got = summaries(nc.kube.get(claim_path(ns, "two")) or {})
            ok = sorted(got) == gpus and all(d.get("activity") == pytest.approx(0.85, abs=0.01)
                                             and d["activeSeconds"] > 0 for d in got.values())
            return got if ok else None

        busy = wait_for(busy_summary, 90, "a busy summary on both GPUs")
        assert all(d["idle"] is False and "idleSince" not in d and d["memoryUsed"] == pytest.approx(0.5, abs=0.02)
                   for d in busy.values()), busy

        scenario(tree, None)

        def idle_summary() -> dict[str, dict[str, Any]] | None:
            got = summaries(nc.kube.get(claim_path(ns, "two")) or {})
            ok = sorted(got) == gpus and all(d["idle"] and "idleSince" in d and d["activity"] < 0.05
                                             for d in got.values())
            return got if ok else None

        # Idle after 3 s; the activity is the mean of the last minute, so it reads low a minute later (the
        # summary follows at the slots: on each move of 0.1, and refreshed every 12 s).
        idle = wait_for(idle_summary, 150, "an idle summary with low activity on both GPUs")
        assert all(d["allocatedSeconds"] > d["activeSeconds"] > 0 for d in idle.values())
        stored = nc.kube.get(claim_path(ns, "two")) or {}
        conds = [c["status"] for d in stored["status"]["devices"] for c in d.get("conditions") or []
                 if c["type"] == "Idle"]
        assert conds == ["True", "True"]  # the condition's manager kept its fields beside the summary's

        written = [float(line.rsplit(" ", 1)[1]) for line in plugin.metrics().splitlines()
                   if line.startswith("topodra_telemetry_summary_writes_total{")]
        assert written and written[0] >= 2  # the busy summary and the idle one, counted on /metrics
        r = inventory(nc, "-o", "json")
        assert r.returncode == 0, r.stderr
        data = json.loads(r.stdout)
        mine = [c for c in data["idle_claims"] if c["namespace"] == ns]
        assert [(c["claim"], c["pods"], c["gpus"], c["nodes"]) for c in mine] == [("two", ["p"], 2, [nc.node_name])]
        assert mine[0]["idle_seconds"] >= 0
        [row] = [n for n in data["namespaces"] if n["namespace"] == ns]
        assert row["gpus"] == row["gpus_reporting"] == 2
        assert row["gpu_hours_allocated"] > row["gpu_hours_active"] > 0
        [node] = data["nodes"]
        assert node["gpus_idle"] >= 2 and {g["name"] for g in node["gpus"] if g["idle"]} >= set(gpus)
        table = inventory(nc)
        assert table.returncode == 0, table.stderr
        assert re.search(rf"^\s+{ns}\s+two\s+p\s+2\s", table.stdout, re.M), table.stdout
    finally:
        nc.kube.delete(f"/api/v1/namespaces/{ns}/pods/p")
        wait_for(lambda: nc.kube.get(f"/api/v1/namespaces/{ns}/pods/p") is None, 60, "pod p gone")
