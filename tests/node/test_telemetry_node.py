"""Per-claim telemetry on the real kubelet node, scraped by real Prometheus (docs/telemetry.md).

The plugin runs with ``--hardware nvml`` against a driver tree of the C NVML stand-in (dgx-h100), samples every
second and calls a claim idle after 3 s below the thresholds. A pod holding 2 GPUs gets series labelled with its
namespace, pod, claim and the GPUs' UUIDs; Prometheus (Debian's pinned package) scrapes the plugin and a
dcgm-exporter-shaped target that knows no pods, and the documented join gives the pod's name. Driving the
scenario idle sets the claim's Idle condition in status.devices and a pod Event; busy again clears it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO
from testkit.pluginproc import CDI_ROOT, DRIVER, PluginProcess
from testkit.ports import free_port
from testkit.prometheus import PrometheusProcess
from testkit.standin import driver_tree, write_faults

from topodra.apipaths import claim_path
from topodra.hardware.mockprofile import build_tree, load_profile

pytestmark = pytest.mark.node
R = "/apis/resource.k8s.io/v1"
PROFILE = "dgx-h100"
GIB = 1 << 30
BUSY = {"utilGpu": 95, "utilMemory": 50, "memoryUsed": 40 * GIB, "smActivity": 85.0, "tensorActivity": 60.0,
        "graphicsActivity": 90.0, "nvlinkTxKiBps": 2_000_000, "nvlinkRxKiBps": 2_000_000, "powerMw": 650000}
# The documented join (docs/telemetry.md): dcgm-exporter's series gain the pod and namespace of the claim.
JOIN = "DCGM_FI_DEV_GPU_UTIL * on (UUID) group_left (namespace, pod) topodra_gpu_claim_info"


def scenario(tree: Path, telemetry: dict[str, Any] | None) -> None:
    write_faults(tree, {"gpus": {str(i): {"telemetry": telemetry} for i in range(8)}} if telemetry else {})


@pytest.fixture(scope="module")
def rig(node_cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, PluginProcess]]:
    base = tmp_path_factory.mktemp("telemetry")
    tree = driver_tree(base / "root", PROFILE, node=node_cluster.node_name, dev_nodes=True)
    scenario(tree, BUSY)  # busy from the start: the claim must not be flagged before the test drives it idle
    sysfs = base / "sysfs"
    build_tree(load_profile(PROFILE), frozenset()).materialize(str(sysfs))
    boot = base / "boot_id"
    boot.write_text(Path("/proc/sys/kernel/random/boot_id").read_text())
    hw = base / "hardware.yaml"
    hw.write_text("{}\n")
    for f in CDI_ROOT.glob("k8s.gpu.topodra.io-claim_*.json"):
        f.unlink()
    node_cluster.apply_yaml(REPO / "deviceclasses/gpu.topodra.io.yaml")
    p = PluginProcess(node_cluster.kubeconfig, node_cluster.node_name,
                      node_cluster.lc.logs / "topodra-plugin-telemetry.log", hardware="nvml",
                      extra_env={"TOPODRA_BOOT_ID_FILE": str(boot), "TOPODRA_HARDWARE_CONFIG": str(hw),
                                 "TOPODRA_SYSFS_ROOT": str(sysfs), "TOPODRA_NVIDIA_DRIVER_ROOT": str(tree),
                                 "TOPODRA_NVIDIA_PROC_ROOT": str(tree / "proc"), "TOPODRA_TELEMETRY_INTERVAL": "1",
                                 "TOPODRA_IDLE_SECONDS": "3"})
    p.start()
    try:
        yield tree, p
    finally:
        p.stop()


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
