"""Device health on the real components: taints from injected faults, handled by the real scheduler,
kube-controller-manager (device-taint eviction), kubelet (allocatedResourcesStatus) and the controller.

The plugin runs as a root host process (dgx-h100 mock) with its own sysfs tree and a faults file
(docs/health.md, "Mock hardware"), a 3 s hold time and a 0.5 s poll, so taints come and go in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO
from testkit.pluginproc import CDI_ROOT, DRIVER, PluginProcess
from testkit.sliceseen import scheduler_has_seen_slices

from topodra.apipaths import claim_path, profile_path, slices_path

pytestmark = pytest.mark.node
R = "/apis/resource.k8s.io/v1"
HOLD = 3.0
XID = "gpu.topodra.io/xid"
CONFIRM_PODS = 2  # more pods refused after the first, each a fresh scheduling of the same tainted GPUs


class Faults:
    """The plugin's mock hardware: the NVML faults file and the sysfs tree."""

    def __init__(self, base: Path) -> None:
        self.file = base / "faults.json"
        self.sysfs = base / "sysfs"
        self.data: dict[str, Any] = {"gpus": {}, "events": []}
        self._lock = threading.Lock()
        self.write()

    def write(self) -> None:
        with self._lock:
            tmp = self.file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data))
            os.replace(tmp, self.file)

    def gpu(self, index: int, **faults: Any) -> None:
        with self._lock:
            if faults:
                self.data["gpus"][str(index)] = faults
            else:
                self.data["gpus"].pop(str(index), None)
        self.write()

    def xid(self, indexes: list[int], code: int) -> None:
        with self._lock:
            self.data["events"] += [{"gpu": i, "type": "xid", "data": code} for i in indexes]
        self.write()

    def port(self, rdma: str, state: str, phys: str) -> None:
        port = self.sysfs / "sys" / "class" / "infiniband" / rdma / "ports" / "1"
        (port / "state").write_text(state + "\n")
        (port / "phys_state").write_text(phys + "\n")


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Faults:
    return Faults(tmp_path_factory.mktemp("health-hw"))


@pytest.fixture(scope="module")
def plugin(node_cluster: ClusterHandle, faults: Faults,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[PluginProcess]:
    base = tmp_path_factory.mktemp("health-cfg")
    (base / "boot_id").write_text(Path("/proc/sys/kernel/random/boot_id").read_text())
    (base / "hardware.yaml").write_text(f"faultsFile: {faults.file}\n")
    for f in CDI_ROOT.glob("k8s.gpu.topodra.io-claim_*.json"):
        f.unlink()
    node_cluster.apply_yaml(REPO / "deviceclasses")
    p = PluginProcess(node_cluster.kubeconfig, node_cluster.node_name,
                      node_cluster.lc.logs / "topodra-plugin-health.log",
                      extra_env={"TOPODRA_BOOT_ID_FILE": str(base / "boot_id"),
                                 "TOPODRA_HARDWARE_CONFIG": str(base / "hardware.yaml"),
                                 "TOPODRA_SYSFS_ROOT": str(faults.sysfs),
                                 "TOPODRA_HEALTH_HOLD_SECONDS": str(HOLD),
                                 "TOPODRA_HEALTH_POLL_INTERVAL": "0.5",
                                 # NoSchedule by default (as NVIDIA's DRA driver); eviction is opted into.
                                 "TOPODRA_HEALTH_NO_EXECUTE": "gpu-lost"})
    p.start()
    yield p
    p.stop()


# ---------------- helpers


def taints(nc: ClusterHandle) -> dict[str, list[dict[str, Any]]]:
    """Device → its taints, from the node's published ResourceSlices."""
    out: dict[str, list[dict[str, Any]]] = {}
    for sl in nc.kube.list(slices_path(), field_selector=f"spec.driver={DRIVER},spec.nodeName={nc.node_name}"):
        for d in sl["spec"]["devices"]:
            if d.get("taints"):
                out[d["name"]] = d["taints"]
    return out


def keys(nc: ClusterHandle) -> dict[str, set[str]]:
    return {d: {f"{t['key']}={t.get('value', '')}:{t['effect']}" for t in ts} for d, ts in taints(nc).items()}


def template(nc: ClusterHandle, ns: str, name: str, tolerations: list[dict[str, Any]] | None = None) -> None:
    exactly: dict[str, Any] = {"deviceClassName": DRIVER, "count": 1}
    if tolerations:
        exactly["tolerations"] = tolerations
    nc.kube.create(f"{R}/namespaces/{ns}/resourceclaimtemplates", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": exactly}]}}}})


def pod(nc: ClusterHandle, ns: str, name: str, tmpl: str, script: str = "sleep 300") -> None:
    nc.kube.create(f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        # Pinned to the real node: simulated nodes of other tests may publish the same driver's devices.
        "spec": {"hostNetwork": True, "restartPolicy": "Never", "automountServiceAccountToken": False,
                 "terminationGracePeriodSeconds": 1, "nodeSelector": {"kubernetes.io/hostname": nc.node_name},
                 "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": tmpl}],
                 "containers": [{"name": "c", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                                 "command": ["sh", "-c", script], "resources": {"claims": [{"name": "gpus"}]}}]}})


def get_pod(nc: ClusterHandle, ns: str, name: str) -> dict[str, Any]:
    return nc.kube.get(f"/api/v1/namespaces/{ns}/pods/{name}") or {}


def wait_running(nc: ClusterHandle, ns: str, name: str, timeout: float = 90) -> None:
    def running() -> bool:
        ph = (get_pod(nc, ns, name).get("status") or {}).get("phase")
        assert ph != "Failed", nc.kubectl("describe", "pod", "-n", ns, name, check=False)
        return ph in ("Running", "Succeeded")
    try:
        wait_for(running, timeout, f"pod {ns}/{name} running")
    except AssertionError:
        print(nc.kubectl("describe", "pod", "-n", ns, name, check=False))
        raise


def claim_of(nc: ClusterHandle, ns: str, name: str) -> dict[str, Any] | None:
    statuses = (get_pod(nc, ns, name).get("status") or {}).get("resourceClaimStatuses") or []
    if not statuses or not statuses[0].get("resourceClaimName"):
        return None
    return nc.kube.get(claim_path(ns, statuses[0]["resourceClaimName"]))


def device_of(nc: ClusterHandle, ns: str, name: str) -> str:
    def get() -> str | None:
        c = claim_of(nc, ns, name) or {}
        results = ((c.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
        return str(results[0]["device"]) if results else None
    return str(wait_for(get, 60, f"allocation of {ns}/{name}"))


def resource_health(nc: ClusterHandle, ns: str, name: str) -> dict[str, str]:
    """resourceID → health, from the kubelet's containerStatuses[].allocatedResourcesStatus."""
    out = {}
    for cs in (get_pod(nc, ns, name).get("status") or {}).get("containerStatuses") or []:
        for ars in cs.get("allocatedResourcesStatus") or []:
            for r in ars.get("resources") or []:
                out[str(r.get("resourceID"))] = str(r.get("health"))
    return out


def delete_pod(nc: ClusterHandle, ns: str, name: str) -> None:
    if get_pod(nc, ns, name):
        nc.kube.delete(f"/api/v1/namespaces/{ns}/pods/{name}")
    wait_for(lambda: not get_pod(nc, ns, name), 60, f"pod {name} gone")


class Repeater:
    """An XID that keeps coming back (a failing GPU) until stopped."""

    def __init__(self, faults: Faults, indexes: list[int], code: int, every: float = 0.7) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(faults, indexes, code, every), daemon=True)

    def _run(self, faults: Faults, indexes: list[int], code: int, every: float) -> None:
        while not self._stop.is_set():
            faults.xid(indexes, code)
            self._stop.wait(every)

    def __enter__(self) -> Repeater:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def wait_blocked(nc: ClusterHandle, ns: str, timeout: float = 60) -> str:
    """A pod of template ``plain`` the scheduler reports Unschedulable on the tainted GPUs; returns its name.

    The taints are in the API, but the scheduler learns of them from its slice informer, which may lag under
    load. So first a positive signal that the informer holds them (``scheduler_has_seen_slices``); from then on
    the first pod must be refused, and so must the next ones: a scheduler that lets a tainted GPU through even
    once fails here."""
    scheduler_has_seen_slices(nc.kube, ns, timeout)
    for k in range(1 + CONFIRM_PODS):
        name = f"blocked-{k}"
        pod(nc, ns, name, "plain", "true")

        def outcome(name: str = name) -> str | None:
            p = get_pod(nc, ns, name)
            if any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
                   for c in (p.get("status") or {}).get("conditions") or []):
                return "unschedulable"
            return "allocated" if p["spec"].get("nodeName") else None

        assert wait_for(outcome, timeout, f"pod {name} decided") == "unschedulable", \
            f"the scheduler placed {name} on GPUs tainted NoSchedule"
        if k < CONFIRM_PODS:
            delete_pod(nc, ns, name)
    return f"blocked-{CONFIRM_PODS}"


# ---------------- tests


def test_noschedule_xid_blocks_new_claims_but_a_tolerating_claim_gets_one_then_clears(
        node_cluster: ClusterHandle, plugin: PluginProcess, faults: Faults) -> None:
    nc = node_cluster
    ns = nc.namespace("hxid")
    template(nc, ns, "plain")
    template(nc, ns, "tolerant", [{"key": XID, "operator": "Exists", "effect": "NoSchedule"}])
    gpus = [f"gpu-{i}" for i in range(8)]
    with Repeater(faults, list(range(8)), 94):  # XID 94 (contained ECC) on every GPU: NoSchedule
        wait_for(lambda: all(f"{XID}=94:NoSchedule" in keys(nc).get(g, set()) for g in gpus), 30,
                 "XID 94 taints on all 8 GPUs")
        t = taints(nc)["gpu-0"][0]
        assert t["timeAdded"].endswith("Z") and t["value"] == "94"
        # The real scheduler leaves a claim without toleration unallocated ...
        blocked = wait_blocked(nc, ns)
        c = claim_of(nc, ns, blocked)
        assert not (c or {}).get("status", {}).get("allocation")
        # ... and gives a tainted GPU to a claim that tolerates the taint.
        pod(nc, ns, "tolerant", "tolerant")
        dev = device_of(nc, ns, "tolerant")
        wait_running(nc, ns, "tolerant")
        assert dev in gpus
        # The real kubelet reports the device Unhealthy in the running pod's status (the pod has one device;
        # its resourceID is the CDI device ID, or driver/pool/device).
        wait_for(lambda: list(resource_health(nc, ns, "tolerant").values()) == ["Unhealthy"], 60,
                 f"allocatedResourcesStatus Unhealthy for {dev}")
        print("allocatedResourcesStatus:", resource_health(nc, ns, "tolerant"))
        assert (get_pod(nc, ns, blocked).get("status") or {}).get("phase") == "Pending"
    # The XIDs stop: after the hold time the taints clear by themselves, no restart.
    t0 = time.monotonic()
    wait_for(lambda: not taints(nc), 30, "taints cleared after recovery")
    assert time.monotonic() - t0 >= HOLD - 1.5  # hysteresis, not an instant flip
    assert plugin.alive()
    wait_running(nc, ns, blocked, timeout=90)  # the waiting claim is now allocated
    wait_for(lambda: list(resource_health(nc, ns, "tolerant").values()) == ["Healthy"], 60,
             "allocatedResourcesStatus back to Healthy")
    for name in (blocked, "tolerant"):
        delete_pod(nc, ns, name)


def test_gpu_lost_is_noexecute_and_kcm_evicts_the_pod_then_clears(
        node_cluster: ClusterHandle, plugin: PluginProcess, faults: Faults) -> None:
    nc = node_cluster
    ns = nc.namespace("hlost")
    template(nc, ns, "one")
    pod(nc, ns, "victim", "one")
    dev = device_of(nc, ns, "victim")
    wait_running(nc, ns, "victim")
    uid = get_pod(nc, ns, "victim")["metadata"]["uid"]
    index = int(dev.split("-")[1])  # dgx-h100 mock: gpu-N is NVML index N
    faults.gpu(index, lost=True)
    wait_for(lambda: "gpu.topodra.io/gpu-lost=:NoExecute" in keys(nc).get(dev, set()), 30, f"gpu-lost on {dev}")
    seen: dict[str, Any] = {}

    def evicted() -> bool:
        p = get_pod(nc, ns, "victim")
        if p and p["metadata"]["uid"] == uid:
            for c in (p.get("status") or {}).get("conditions") or []:
                if c["type"] == "DisruptionTarget":
                    seen.update(c)
            return False
        return True

    wait_for(evicted, 90, "kube-controller-manager to evict the pod using the lost GPU")
    # The pod was deleted by kcm's device-taint-eviction-controller (not by us, not by the kubelet).
    assert seen.get("reason") == "DeletionByDeviceTaintManager", seen
    faults.gpu(index)  # the GPU is back
    wait_for(lambda: dev not in taints(nc), 30, "gpu-lost taint cleared after recovery")


def test_nvlink_and_nic_faults_taint_and_clear(node_cluster: ClusterHandle, plugin: PluginProcess,
                                              faults: Faults) -> None:
    nc = node_cluster
    faults.gpu(2, nvlinksDown=[0, 5])
    faults.port("mlx5_0", "1: DOWN", "3: Disabled")
    try:
        want = {"gpu-2": {"gpu.topodra.io/nvlink-degraded=link-down:NoSchedule"},
                "gpu-0": {"gpu.topodra.io/nvlink-degraded=domain:None"},
                "nic-0": {"nic.topodra.io/link-down=port1-DOWN-DISABLED:NoSchedule"}}
        wait_for(lambda: all(keys(nc).get(d) == v for d, v in want.items()), 30, "NVLink and NIC taints")
        assert set(keys(nc)) == {f"gpu-{i}" for i in range(8)} | {"nic-0"}
    finally:
        faults.gpu(2)
        faults.port("mlx5_0", "4: ACTIVE", "5: LinkUp")
    wait_for(lambda: not taints(nc), 30, "NVLink/NIC taints cleared")


def test_claimprofile_counts_tainted_devices_as_not_free(
        node_cluster: ClusterHandle, plugin: PluginProcess, faults: Faults) -> None:
    nc = node_cluster
    nc.install_claimprofile_crd()
    ns = nc.namespace("hprof")
    log = (nc.lc.logs / f"controller-{ns}.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "topodra.cli", "controller", "--kubeconfig", nc.kubeconfig, "--namespace", ns,
         "--refresh-interval", "2", "--lease-namespace", ns, "--identity", "health"],
        stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        nc.kube.create(profile_path(ns), {"apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile",
                                          "metadata": {"name": "h100"},
                                          "spec": {"alternatives": [{"deviceClassName": "gpu-h100", "count": 1}]}})

        def free() -> int | None:
            alts = ((nc.kube.get(profile_path(ns, "h100")) or {}).get("status") or {}).get("alternatives") or []
            return alts[0].get("devicesFree") if alts else None

        base = wait_for(lambda: free() is not None and not taints(nc) and free(), 60, "devicesFree reported")
        faults.gpu(1, nvlinksDown=[3])
        faults.gpu(6, lost=True)
        wait_for(lambda: free() == base - 2, 60, f"devicesFree {base} - 2 with gpu-1 and gpu-6 tainted")
        faults.gpu(1)
        faults.gpu(6)
        wait_for(lambda: free() == base, 60, "devicesFree back after recovery")
    finally:
        faults.gpu(1)
        faults.gpu(6)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
