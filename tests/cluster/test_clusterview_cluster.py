"""``topodra inventory`` on the real local cluster: its numbers equal those computed here from the raw objects.

Two kubelet-less DGX H100 nodes get their slices from ``topodra simulate``'s code (real discovery on mock
hardware); the real kube-scheduler allocates a 3-GPU claim; one GPU carries a NoSchedule taint in its
ResourceSlice and another is tainted NoExecute by a DeviceTaintRule; an 8-GPU NVLink claim then fits
nowhere and stays pending. The CLI runs as a subprocess with a label selector for the test's nodes; its
JSON, and the PNG's pixels, are compared with device states derived in this file from the API objects.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_scheduling_topology import RUN_LABEL, Scenario, scenario_maker
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO
from testkit.pixels import check_pixels
from testkit.ports import free_port

from topodra.apipaths import claim_path, device_taint_rule_path, node_path, slices_path
from topodra.clusterview.fetch import fetch
from topodra.clusterview.model import build_view
from topodra.simulate import Simulation, load_cluster

pytestmark = pytest.mark.cluster

DRIVER = "gpu.topodra.io"
BLOCKING = {"NoSchedule", "NoExecute"}
Obj = dict[str, Any]


@pytest.fixture
def scenarios(cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    yield from scenario_maker(cluster)


def inventory(cluster: ClusterHandle, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "topodra.cli", "inventory", "--kubeconfig", cluster.kubeconfig,
                           *args], capture_output=True, text=True, timeout=120, check=False)


def template(s: Scenario, name: str, count: int, nvlink: bool = False) -> None:
    devices: Obj = {"requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu-h100", "count": count}}]}
    if nvlink:
        devices["constraints"] = [{"requests": ["gpus"], "matchAttribute": f"{DRIVER}/nvlinkDomain"}]
    s.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
              "spec": {"spec": {"devices": devices}}})


def raw_states(cluster: ClusterHandle, nodes: list[str]) -> dict[tuple[str, str], str]:
    """(node, device) -> free | tainted | allocated:<namespace>, straight from slices, claims and rules."""
    held: dict[tuple[str, str], str] = {}
    for c in cluster.kube.list(claim_path()):
        for r in (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []:
            if r["driver"] == DRIVER:
                held[(r["pool"], r["device"])] = c["metadata"]["namespace"]
    rules = [r["spec"] for r in cluster.kube.list(device_taint_rule_path())]
    out = {}
    for sl in cluster.kube.list(slices_path(), field_selector=f"spec.driver={DRIVER}"):
        node, pool = sl["spec"]["nodeName"], sl["spec"]["pool"]["name"]
        if node not in nodes:
            continue
        for d in sl["spec"]["devices"]:
            if d["attributes"]["type"]["string"] not in ("gpu", "nic"):
                continue
            effects = [t["effect"] for t in d.get("taints") or []]
            effects += [r["taint"]["effect"] for r in rules
                        if all(r["deviceSelector"].get(k) in (None, v) for k, v in
                               (("driver", DRIVER), ("pool", pool), ("device", d["name"])))]
            key = (pool, d["name"])
            out[(node, d["name"])] = (f"allocated:{held[key]}" if key in held
                                      else "tainted" if BLOCKING & set(effects) else "free")
    return out


def scrape_exporter(cluster: ClusterHandle, selector: str) -> dict[str, dict[tuple[str, ...], float]]:
    """Start ``topodra inventory --serve`` on a free port, scrape /metrics once, stop it."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "topodra.cli", "inventory", "--kubeconfig", cluster.kubeconfig,
                             "-l", selector, "--serve", f"127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def get() -> str | None:
            assert proc.poll() is None, proc.communicate()[1]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                return str(r.read().decode())

        text: str = wait_for(get, 30, "inventory exporter serving")
    finally:
        proc.terminate()
        proc.wait(10)
    return {f.name: {tuple(s.labels.values()): s.value for s in f.samples}
            for f in text_string_to_metric_families(text)}


def test_inventory_equals_the_raw_objects(cluster: ClusterHandle, scenarios: Callable[..., Scenario],
                                          tmp_path: Path) -> None:
    s = scenarios([("h100", "dgx-h100", 2)], "inv")
    n0, n1 = s.nodes("h100")
    kube = cluster.kube
    # A NoSchedule taint written into n0's slice, as a driver reporting a sick GPU would.
    [sl] = kube.list(slices_path(), field_selector=f"spec.driver={DRIVER},spec.nodeName={n0}")
    next(d for d in sl["spec"]["devices"] if d["name"] == "gpu-6")["taints"] = [
        {"key": "topodra.io/xid", "value": "79", "effect": "NoSchedule"}]
    kube.replace(slices_path(sl["metadata"]["name"]), sl)
    # n1's gpu-7 drained by an admin's DeviceTaintRule.
    rule = f"inv-{s.run}"
    kube.create(device_taint_rule_path(), {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": {"name": rule},
        "spec": {"deviceSelector": {"driver": DRIVER, "pool": n1, "device": "gpu-7"},
                 "taint": {"key": "topodra.io/maintenance", "effect": "NoExecute"}}})
    try:
        template(s, "three", 3)
        template(s, "eight", 8, nvlink=True)
        s.wait_scheduler_sees_taints(n0, 7)  # its informers hold both taints before anything is allocated
        s.wait_scheduler_sees_taints(n1, 7)
        s.pod("small", "three", [n0])
        s.wait_allocated("small")
        s.pod("big", "eight", [n0, n1])  # n0: 4 usable, n1: 7 usable -> pending
        message = s.wait_unschedulable("big")
        big_claim = s.claim_of("big")
        assert big_claim is not None

        expected = raw_states(cluster, [n0, n1])
        # The scenario as designed, so the oracle above is checked too.
        assert sum(1 for (n, d), v in expected.items() if n == n0 and d.startswith("gpu") and v == "free") == 4
        assert sum(1 for (n, d), v in expected.items() if n == n1 and d.startswith("gpu") and v == "free") == 7
        assert expected[(n0, "gpu-6")] == expected[(n1, "gpu-7")] == "tainted"

        r = inventory(cluster, "-o", "json", "-l", f"{RUN_LABEL}={s.run}")
        assert r.returncode == 0, r.stderr
        data = json.loads(r.stdout)
        got = {(n["name"], c["name"]): c["state"] + (f":{c['namespace']}" if c["state"] == "allocated" else "")
               for n in data["nodes"] for c in n["gpus"] + n["nics"]}
        assert got == expected
        free = sum(1 for (_n, d), v in expected.items() if d.startswith("gpu") and v == "free")
        [model] = data["models"]
        assert (model["model"], model["total"], model["free"], model["allocated"], model["tainted"]) == \
            ("H100-SXM5-80GB", 16, free, 3, 2)
        assert model["largest"] == {"count": 7, "nvlink": 7, "rail_aligned": 7}
        assert (model["nvlink_domains"], model["nvlink_domains_free"]) == (2, 0)
        pending = {(p["namespace"], p["name"]): p for p in data["pending"]}
        mine = pending[(s.ns, big_claim["metadata"]["name"])]
        assert mine["pod"] == "big" and mine["device_classes"] == ["gpu-h100"]
        assert "cannot allocate all claims" in mine["reason"] and mine["message"] == message
        assert data["summary"]["pending_by_device_class"]["gpu-h100"] >= 1

        table = inventory(cluster, "-l", f"{RUN_LABEL}={s.run}")
        assert table.returncode == 0, table.stderr
        assert f"{n0}  " in table.stdout and "gpu-6" in table.stdout and "cannot allocate all claims" in table.stdout

        # The picture of the same cluster, read back pixel by pixel.
        src = fetch(kube, DRIVER, f"{RUN_LABEL}={s.run}")
        view = build_view(src, nodes=[n["metadata"]["name"] for n in src.nodes])
        check_pixels(view, tmp_path / "inv.png", expected)
        png = inventory(cluster, "-l", f"{RUN_LABEL}={s.run}", "--png", str(tmp_path / "cli.png"), "-o", "yaml")
        assert png.returncode == 0, png.stderr
        assert (tmp_path / "cli.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

        # The exporter mode serves the same numbers.
        gauges = scrape_exporter(cluster, f"{RUN_LABEL}={s.run}")
        m = "H100-SXM5-80GB"
        assert gauges["topodra_inventory_gpus_free"] == {(m, n0): 4, (m, n1): 7}
        assert gauges["topodra_inventory_gpus_tainted"] == {(m, n0): 1, (m, n1): 1}
        assert gauges["topodra_inventory_gpus_allocated"] == {(m, n0): 3, (m, n1): 0}
        assert gauges["topodra_inventory_largest_claim_gpus"][(m, "nvlink")] == 7
        assert gauges["topodra_inventory_pending_claims"][("gpu-h100",)] >= 1
        assert gauges["topodra_inventory_up"] == {(): 1.0}
    finally:
        kube.delete(device_taint_rule_path(rule))


def test_inventory_on_enterprise_400(cluster: ClusterHandle, tmp_path: Path) -> None:
    sim = Simulation(cluster.kube, load_cluster(REPO / "hack/clusters/enterprise-400.yaml"))
    sim.setup()
    try:
        sim.reconcile_all()
        selector = "topodra.io/scalable-unit in (su1,su2)"
        # New Nodes carry the not-ready taint until the node lifecycle controller sees them Ready; until
        # then the inventory rightly calls them unschedulable.
        wait_for(lambda: all(not (n.get("spec") or {}).get("taints")
                             for n in cluster.kube.list(node_path(), label_selector=selector)), 60,
                 "simulated nodes untainted")
        r = inventory(cluster, "-o", "json", "-l", selector, "--png", str(tmp_path / "e400.png"))
        assert r.returncode == 0, r.stderr
        data = json.loads(r.stdout)
        assert len(data["nodes"]) == 50 and data["summary"]["total"] == 400
        assert {m["model"]: m["total"] for m in data["models"]} == \
            {"A100-SXM4-80GB": 128, "H100-SXM5-80GB": 192, "H200-SXM5-141GB": 80}
        assert all(m["largest"] == {"count": 8, "nvlink": 8, "rail_aligned": 8} for m in data["models"])
        assert (tmp_path / "e400.png").stat().st_size > 10_000
        # The picture is drawn in a worker process: its errors still reach the operator, with exit 1.
        bad = inventory(cluster, "-l", selector, "--png", str(tmp_path / "missing-dir" / "x.png"))
        assert bad.returncode == 1 and "No such file or directory" in bad.stderr and not bad.stdout, bad

        # --watch reports (and redraws --png) again and again until SIGTERM, then exits 0.
        watch = subprocess.Popen([sys.executable, "-m", "topodra.cli", "inventory", "--kubeconfig",
                                  cluster.kubeconfig, "-l", selector, "--watch", "--interval", "0.5",
                                  "--png", str(tmp_path / "watch.png")],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(watch.stdout.readline, "")),  # type: ignore[union-attr]
                                  daemon=True)
        reader.start()
        try:
            wait_for(lambda: sum("Cluster: 400 GPUs" in line for line in list(lines)) >= 2, 120, "two reports")
        finally:
            watch.terminate()
            err = watch.stderr.read() if watch.stderr else ""
            watch.wait(30)
            reader.join(30)
        out = "".join(lines)
        assert watch.returncode == 0, err
        assert out.count("Cluster: 400 GPUs") >= 2, out[-2000:]
        assert (tmp_path / "watch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        sim.delete()
