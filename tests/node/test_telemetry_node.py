"""Per-claim telemetry on the real kubelet node, scraped by real Prometheus (docs/telemetry.md).

The plugin runs with ``--hardware nvml`` against a driver tree of the C NVML stand-in (dgx-h100), samples every
second and calls a claim idle after 3 s below the thresholds. A pod holding 2 GPUs gets series labelled with its
namespace, pod, claim and the GPUs' UUIDs; Prometheus (Debian's pinned package) scrapes the plugin and a
dcgm-exporter-shaped target that knows no pods, and the documented join gives the pod's name. Driving the
scenario idle sets the claim's Idle condition in status.devices and a pod Event; busy again clears it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO
from testkit.pluginproc import DRIVER, PluginProcess
from testkit.ports import free_port
from testkit.prometheus import PrometheusProcess
from testkit.standin import driver_tree, write_faults
from testkit.standinplugin import standin_plugin

from topodra.apipaths import claim_path

pytestmark = pytest.mark.node
R = "/apis/resource.k8s.io/v1"
PROFILE = "dgx-h100"
GIB = 1 << 30
BUSY = {"utilGpu": 95, "utilMemory": 50, "memoryUsed": 40 * GIB, "smActivity": 85.0, "tensorActivity": 60.0,
        "graphicsActivity": 90.0, "nvlinkTxKiBps": 2_000_000, "nvlinkRxKiBps": 2_000_000, "powerMw": 650000}
# The documented join (docs/telemetry.md): dcgm-exporter's series gain the pod and namespace of the claim.
JOIN = "DCGM_FI_DEV_GPU_UTIL * on (UUID) group_left (namespace, pod) topodra_gpu_claim_info"
DEFAULT_GRACE = 4  # --idle-reclaim-grace: a namespace that opts in without the annotation waits this long


def scenario(tree: Path, telemetry: dict[str, Any] | None) -> None:
    write_faults(tree, {"gpus": {str(i): {"telemetry": telemetry} for i in range(8)}} if telemetry else {})


@pytest.fixture(scope="module")
def rig(node_cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, PluginProcess]]:
    base = tmp_path_factory.mktemp("telemetry")
    tree = driver_tree(base / "root", PROFILE, node=node_cluster.node_name, dev_nodes=True)
    scenario(tree, BUSY)  # busy from the start: the claim must not be flagged before the test drives it idle
    with standin_plugin(node_cluster, base, tree, PROFILE, "topodra-plugin-telemetry.log",
                        {"TOPODRA_TELEMETRY_INTERVAL": "1", "TOPODRA_IDLE_SECONDS": "3",
                         "TOPODRA_IDLE_RECLAIM_GRACE": str(DEFAULT_GRACE)}) as p:
        yield tree, p


def series(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of ``name`` in a text exposition."""
    out = []
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        labels_text, value = line[len(name) + 1:].rsplit("} ", 1)
        labels = dict(kv.split("=", 1) for kv in labels_text.split('",') if kv)
        out.append(({k: v.strip('"') for k, v in labels.items()}, float(value)))
    return out


def idle_condition(claim: dict[str, Any]) -> list[str]:
    return [c["status"] for d in (claim.get("status") or {}).get("devices") or [] if d.get("driver") == DRIVER
            for c in d.get("conditions") or [] if c.get("type") == "Idle"]


def events(nc: ClusterHandle, ns: str, reason: str) -> list[dict[str, Any]]:
    items = (nc.kube.get(f"/api/v1/namespaces/{ns}/events") or {}).get("items") or []
    return [e for e in items if e.get("reason") == reason and e["involvedObject"].get("name") == "p"]


def claim_and_pod(nc: ClusterHandle, ns: str, gpus: int = 1) -> None:
    """Claim ``one`` (``gpus`` GPUs) and pod ``p`` holding it, in ``ns``."""
    nc.kube.create(f"{R}/namespaces/{ns}/resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "one"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": gpus}}]}}})
    nc.kube.create(f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {"app": "p"}},
        "spec": {"hostNetwork": True, "restartPolicy": "Never", "automountServiceAccountToken": False,
                 "terminationGracePeriodSeconds": 1, "resourceClaims": [{"name": "gpus", "resourceClaimName": "one"}],
                 "containers": [{"name": "c", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                                 "command": ["sh", "-c", "sleep 600"], "resources": {"claims": [{"name": "gpus"}]}}]}})


def pod(nc: ClusterHandle, ns: str) -> dict[str, Any]:
    return nc.kube.get(f"/api/v1/namespaces/{ns}/pods/p") or {}


def running(nc: ClusterHandle, ns: str) -> bool:
    p = pod(nc, ns)
    return (p.get("status") or {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")


def opt_in(nc: ClusterHandle, ns: str, mode: str, grace: str | None) -> None:
    meta: dict[str, Any] = {"labels": {"topodra.io/idle-reclaim": mode}}
    if grace is not None:
        meta["annotations"] = {"topodra.io/idle-reclaim-grace": grace}
    nc.kube.merge_patch(f"/api/v1/namespaces/{ns}", {"metadata": meta})


def stamp(event: dict[str, Any]) -> float:
    return datetime.strptime(event["firstTimestamp"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def reclaims(plugin: PluginProcess) -> dict[tuple[str, str], float]:
    return {(lab["namespace"], lab["result"]): v for lab, v in series(plugin.metrics(), "topodra_idle_reclaims_total")}


def test_pod_series_prometheus_join_and_idle_condition(node_cluster: ClusterHandle, rig: tuple[Path, PluginProcess],
                                                       tmp_path: Path) -> None:
    nc = node_cluster
    tree, plugin = rig
    ns = nc.namespace("tel")
    nc.kube.create(f"{R}/namespaces/{ns}/resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "two"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": 2}}]}}})
    nc.kube.create(f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
        "spec": {"hostNetwork": True, "restartPolicy": "Never", "automountServiceAccountToken": False,
                 "terminationGracePeriodSeconds": 1, "resourceClaims": [{"name": "gpus", "resourceClaimName": "two"}],
                 "containers": [{"name": "c", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                                 "command": ["sh", "-c", "sleep 600"], "resources": {"claims": [{"name": "gpus"}]}}]}})
    wait_for(lambda: ((nc.kube.get(f"/api/v1/namespaces/{ns}/pods/p") or {}).get("status") or {}).get("phase")
             == "Running", 120, "pod p running")
    claim = nc.kube.get(claim_path(ns, "two")) or {}
    uid = claim["metadata"]["uid"]
    gpus = sorted(r["device"] for r in claim["status"]["allocation"]["devices"]["results"])
    assert len(gpus) == 2

    def labelled(name: str) -> list[tuple[dict[str, str], float]] | None:
        got = [(lab, v) for lab, v in series(plugin.metrics(), name) if lab.get("pod") == "p"]
        return got if len(got) == 2 else None

    active = wait_for(lambda: labelled("topodra_gpu_sm_active_ratio"), 60, "SM activity of the pod's 2 GPUs")
    for labels, value in active:
        assert labels["namespace"] == ns and labels["dra_claim_name"] == "two" and labels["dra_claim_uid"] == uid
        assert labels["dra_device_name"] in gpus and labels["UUID"].startswith("GPU-")
        assert labels["Hostname"] == nc.node_name and labels["modelName"] == "H100-SXM5-80GB"
        assert value == pytest.approx(0.85, abs=0.01)
    uuids = sorted(lab["UUID"] for lab, _v in active)
    for name in ("topodra_gpu_memory_used_bytes", "topodra_gpu_nvlink_tx_bytes_total", "topodra_gpu_utilization_ratio"):
        got = labelled(name)
        assert got is not None and sorted(lab["UUID"] for lab, _v in got) == uuids, name
    assert {v for _lab, v in labelled("topodra_gpu_memory_used_bytes") or []} == {40.0 * GIB}
    # Busy, sampled with the claim attributed (the positive signal): no Idle condition was written.
    busy = [v for lab, v in series(plugin.metrics(), "topodra_claim_idle") if lab["dra_claim_uid"] == uid]
    assert busy == [0.0]
    assert idle_condition(nc.kube.get(claim_path(ns, "two")) or {}) == []

    # Real Prometheus scrapes the plugin and a dcgm-exporter-shaped target (no pod labels) for the same GPUs.
    reg = CollectorRegistry()
    dcgm = Gauge("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", ["gpu", "UUID", "device", "modelName",
                                                                      "Hostname"], registry=reg)
    for i, u in enumerate(uuids):
        dcgm.labels(str(i), u, f"nvidia{i}", "NVIDIA H100 80GB HBM3", nc.node_name).set(93)
    dport = free_port()
    server, _thread = start_http_server(dport, addr="127.0.0.1", registry=reg)
    prom = PrometheusProcess(tmp_path / "prom", [f"127.0.0.1:{plugin.metrics_port}", f"127.0.0.1:{dport}"])
    prom.start()
    try:
        joined = wait_for(lambda: (r := prom.query(JOIN)) and len(r) == 2 and r, 60, "the PromQL join")
        assert sorted(r["metric"]["UUID"] for r in joined) == uuids
        assert {(r["metric"]["pod"], r["metric"]["namespace"], r["value"][1]) for r in joined} == {("p", ns, "93")}
        info = prom.query(f'topodra_gpu_claim_info{{dra_claim_uid="{uid}"}}')
        assert {r["metric"]["pod"] for r in info} == {"p"} and len(info) == 2
    finally:
        prom.stop()
        server.shutdown()

    # Idle: the claim gets its condition (what `kubectl get resourceclaim -o yaml` shows) and the pod an Event.
    scenario(tree, None)
    wait_for(lambda: idle_condition(nc.kube.get(claim_path(ns, "two")) or {}) == ["True", "True"], 60,
             "the Idle condition on both devices")
    shown = yaml.safe_load(nc.kubectl("get", "resourceclaim", "-n", ns, "two", "-o", "yaml"))
    devices = {d["device"]: d for d in shown["status"]["devices"]}
    assert sorted(devices) == gpus
    for d in devices.values():
        (cond,) = d["conditions"]
        assert (d["driver"], d["pool"], cond["type"], cond["status"], cond["reason"]) == (
            DRIVER, nc.node_name, "Idle", "True", "BelowThresholds"), json.dumps(d)
    ev = wait_for(lambda: events(nc, ns, "GPUClaimIdle"), 30, "the GPUClaimIdle event on pod p")
    assert ev[0]["type"] == "Warning" and ev[0]["source"]["host"] == nc.node_name

    # Activity returns: the condition turns False and the pod gets a second Event.
    scenario(tree, BUSY)
    wait_for(lambda: idle_condition(nc.kube.get(claim_path(ns, "two")) or {}) == ["False", "False"], 60,
             "the Idle condition cleared")
    wait_for(lambda: events(nc, ns, "GPUClaimActive"), 30, "the GPUClaimActive event on pod p")
    assert len(events(nc, ns, "GPUClaimIdle")) == 1  # written on change only

    nc.kube.delete(f"/api/v1/namespaces/{ns}/pods/p")
    wait_for(lambda: nc.kube.get(f"/api/v1/namespaces/{ns}/pods/p") is None, 60, "pod p gone")


ON_GRACE = 15  # the opted-in namespace's grace (annotation), well past the dry-run's and the default's


def test_opt_in_reclaim(node_cluster: ClusterHandle, rig: tuple[Path, PluginProcess]) -> None:
    """Reclaim acts only in an opted-in namespace and only after its grace; a PodDisruptionBudget holds it off.

    Four 1-GPU pods, all driven idle at once: ``off`` (no label; the plugin's default grace is 4 s), ``dry``
    (dry-run, 4 s), ``bad`` (enabled with a grace that does not parse), ``on`` (enabled, 15 s, and a PDB that
    allows no disruption until the test deletes it)."""
    nc = node_cluster
    tree, plugin = rig
    scenario(tree, BUSY)
    spaces = {k: nc.namespace(f"rc{k}") for k in ("off", "dry", "bad", "on")}
    opt_in(nc, spaces["dry"], "dry-run", "4s")
    opt_in(nc, spaces["bad"], "enabled", "soon")
    opt_in(nc, spaces["on"], "enabled", f"{ON_GRACE}s")
    on = spaces["on"]
    nc.kube.create(f"/apis/policy/v1/namespaces/{on}/poddisruptionbudgets", {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "keep"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "p"}}}})
    try:
        for ns in spaces.values():
            claim_and_pod(nc, ns)
        for ns in spaces.values():
            wait_for(partial(running, nc, ns), 120, f"pod p running in {ns}")

        def attributed() -> bool:  # busy, and every claim sampled with its pod known: the start line
            idle = {lab["namespace"]: v for lab, v in series(plugin.metrics(), "topodra_claim_idle")}
            pods = {lab["namespace"] for lab, _v in series(plugin.metrics(), "topodra_gpu_claim_info")
                    if lab["pod"] == "p"}
            return all(idle.get(ns) == 0.0 and ns in pods for ns in spaces.values())
        wait_for(attributed, 60, "the four claims sampled busy, with their pods")

        went_idle = time.time()
        scenario(tree, None)
        dry = wait_for(lambda: events(nc, spaces["dry"], "GPUClaimReclaimDryRun"), 60, "the dry-run Event")
        assert "would evict pod(s) p" in dry[0]["message"] and dry[0]["type"] == "Normal", dry[0]
        bad = wait_for(lambda: events(nc, spaces["bad"], "GPUClaimReclaimInvalid"), 60, "the invalid-setting Event")
        assert "'soon' is not a duration" in bad[0]["message"] and bad[0]["type"] == "Warning", bad[0]

        # Past the grace the plugin tries to evict; the PDB refuses (429) and the pod keeps running.
        blocked = wait_for(lambda: events(nc, on, "GPUClaimReclaimBlocked"), 90, "the eviction blocked by the PDB")
        assert stamp(blocked[0]) >= int(went_idle) + ON_GRACE - 1, (blocked[0], went_idle)
        assert "disruption budget" in blocked[0]["message"], blocked[0]
        assert running(nc, on)
        assert reclaims(plugin).get((on, "blocked"), 0) >= 1
        nc.kube.delete(f"/apis/policy/v1/namespaces/{on}/poddisruptionbudgets/keep")

        # Without the PDB the next sample's eviction goes through.
        done = wait_for(lambda: events(nc, on, "GPUClaimReclaimed"), 60, "the GPUClaimReclaimed Event")
        assert done[0]["type"] == "Warning" and f"grace of {ON_GRACE}s" in done[0]["message"], done[0]
        idle_for = float(done[0]["message"].split("idle for ")[1].split("s")[0])
        assert idle_for >= ON_GRACE, done[0]
        wait_for(lambda: not running(nc, on), 30, "pod p in the opted-in namespace evicted")

        # The positive signal for the others: their claims went idle (the Event) 11 s before the eviction above,
        # and their grace (4 s) is far shorter, so a reclaim that ignored the opt-in or dry-run would have
        # evicted them first. They still run.
        for k in ("off", "dry", "bad"):
            assert events(nc, spaces[k], "GPUClaimIdle"), k
            assert running(nc, spaces[k]), k
            assert not events(nc, spaces[k], "GPUClaimReclaimed"), k
        assert not [e for e in (nc.kube.get(f"/api/v1/namespaces/{spaces['off']}/events") or {}).get("items", [])
                    if str(e.get("reason", "")).startswith("GPUClaimReclaim")]
        counts = reclaims(plugin)
        assert counts.get((on, "evicted")) == 1.0
        assert counts.get((spaces["dry"], "dry_run")) == 1.0 and counts.get((spaces["bad"], "invalid")) == 1.0
        assert not [k for k in counts if k[0] == spaces["off"]]
        assert len(events(nc, spaces["dry"], "GPUClaimReclaimDryRun")) == 1  # once per idle period
    finally:
        scenario(tree, BUSY)
        for ns in spaces.values():
            nc.kube.delete(f"/api/v1/namespaces/{ns}/pods/p")
        for ns in spaces.values():
            wait_for(partial(lambda n: not pod(nc, n), ns), 60, f"pod p gone in {ns}")


DASHBOARD = REPO / "deploy" / "grafana" / "topodra-inventory.json"
GRAFANA_BUILTINS = {"__range": "1h", "__rate_interval": "1m", "__interval": "15s"}


def dashboard_queries() -> tuple[list[tuple[str, str]], dict[str, tuple[str, str]]]:
    """(panel title, expr) of every target of every panel (rows included), and each query variable's
    ``label_values(metric, label)`` as name -> (metric selector, label)."""
    dash = json.loads(DASHBOARD.read_text())
    exprs: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            exprs.extend((p["title"], t["expr"]) for t in p.get("targets") or [])
            walk(p.get("panels") or [])

    walk(dash["panels"])
    variables = {}
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q)
            assert m, f"variable {var['name']}: {q!r} is not label_values(metric, label)"
            variables[var["name"]] = (m.group(1), m.group(2))
    return exprs, variables


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's variable interpolation for one selected value each (unknown variables fail)."""
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        assert name in values, f"dashboard variable ${name} has no value in the test"
        return values[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def test_every_dashboard_query_returns_data(node_cluster: ClusterHandle, rig: tuple[Path, PluginProcess],
                                            tmp_path: Path) -> None:
    """Every query of deploy/grafana/topodra-inventory.json, in real Prometheus scraping the real plugin and the
    real inventory exporter (``topodra inventory --serve``): each parses and returns data. The state behind it:
    a pod in a dry-run namespace whose 1-GPU claim is idle (activity, idle GPUs, idle claims, a dry-run reclaim),
    and a claim no pod uses (pending)."""
    nc = node_cluster
    tree, plugin = rig
    exprs, variables = dashboard_queries()
    assert len(exprs) >= 20 and set(variables) == {"model", "namespace"}
    ns = nc.namespace("dash")
    opt_in(nc, ns, "dry-run", "4s")
    scenario(tree, None)
    claim_and_pod(nc, ns)
    nc.kube.create(f"{R}/namespaces/{ns}/resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "pending"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": 1}}]}}})
    wait_for(lambda: running(nc, ns), 120, "pod p running")
    port = free_port()
    exporter = subprocess.Popen([sys.executable, "-m", "topodra.cli", "inventory", "--kubeconfig",
                                 str(nc.kubeconfig), "--serve", f"127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=(tmp_path / "exporter.log").open("wb"))
    prom = PrometheusProcess(tmp_path / "prom", [f"127.0.0.1:{plugin.metrics_port}", f"127.0.0.1:{port}"])
    try:
        def serving() -> bool:
            assert exporter.poll() is None, (tmp_path / "exporter.log").read_text()[-2000:]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                return b"topodra_inventory_up 1.0" in r.read()
        wait_for(serving, 60, "the inventory exporter serving")
        prom.start()
        # The state above, scraped (the reclaim counter twice, for increase()): then each query is asked once.
        wait_for(lambda: prom.query(f'topodra_claim_idle{{namespace="{ns}"}} == 1')
                 and prom.query(f'count_over_time(topodra_idle_reclaims_total{{namespace="{ns}"}}[5m]) >= 2')
                 and prom.query('topodra_inventory_pending_claims{device_class="gpu.topodra.io"} >= 1')
                 and prom.query("topodra_inventory_up == 1"), 120, "the idle claim and the inventory scraped")

        values = dict(GRAFANA_BUILTINS)
        for name, (metric, label) in variables.items():
            found = prom.label_values(label, metric)
            assert found, f"variable ${name}: label_values({metric}, {label}) is empty"
            values[name] = ns if name == "namespace" else found[0]
        assert ns in prom.label_values("namespace", variables["namespace"][0])
        failures = []
        for title, expr in exprs:
            q = substitute(expr, values)
            result, error = prom.evaluate(q)
            if result is None:
                failures.append(f"{title}: {q}\n    error {error}")
            elif not result:
                failures.append(f"{title}: {q}\n    empty")
        assert not failures, "dashboard queries that fail or return nothing:\n  " + "\n  ".join(failures)

        # Spot checks of the new panels against what the test set up.
        by_title = {t: substitute(e, values) for t, e in exprs}
        assert [r["value"][1] for r in prom.query(by_title["Idle GPUs"])] == ["1"]
        (row,) = prom.query(by_title["Idle claims"])
        assert (row["metric"]["namespace"], row["metric"]["dra_claim_name"]) == (ns, "one")
    finally:
        prom.stop()
        exporter.terminate()
        exporter.wait(10)
        scenario(tree, BUSY)
        nc.kube.delete(f"/api/v1/namespaces/{ns}/pods/p")
        wait_for(lambda: not pod(nc, ns), 60, "pod p gone")
