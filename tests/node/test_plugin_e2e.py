"""The kubelet plugin against the real kubelet, containerd, scheduler and controller-manager.

The plugin runs as a root host process with the dgx-h100 mock profile on the
real node; the kubelet registers it, the scheduler allocates claims from its
ResourceSlices, the kubelet calls NodePrepareResources and containerd injects
the CDI edits into busybox containers whose output we read.
"""

from __future__ import annotations

import functools
import json
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from testkit.handle import ClusterHandle, wait_for
from testkit.kubeletstub import KubeletStub
from testkit.paths import REPO
from testkit.pluginproc import CDI_ROOT, DRA_SOCKET, DRIVER, PLUGIN_DIR, PluginProcess

from topodra.apipaths import claim_path, slices_path
from topodra.simulate import SimulatedCluster, Simulation

pytestmark = pytest.mark.node
R = "/apis/resource.k8s.io/v1"


@pytest.fixture(scope="module")
def boot_id_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("boot") / "boot_id"
    f.write_text(Path("/proc/sys/kernel/random/boot_id").read_text())
    return f


@pytest.fixture(scope="module")
def hardware_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("hw") / "hardware.yaml"
    f.write_text("{}\n")
    return f


@pytest.fixture(scope="module")
def plugin(node_cluster: ClusterHandle, boot_id_file: Path, hardware_config: Path) -> Iterator[PluginProcess]:
    for f in CDI_ROOT.glob("k8s.gpu.topodra.io-claim_*.json"):
        f.unlink()
    node_cluster.apply_yaml(REPO / "deviceclasses/gpu.topodra.io.yaml")
    p = PluginProcess(node_cluster.kubeconfig, node_cluster.node_name,
                      node_cluster.lc.logs / "topodra-plugin.log",
                      extra_env={"TOPODRA_BOOT_ID_FILE": str(boot_id_file),
                                 "TOPODRA_HARDWARE_CONFIG": str(hardware_config)})
    p.start()
    yield p
    p.stop()


def our_specs() -> set[str]:
    return {f.name for f in CDI_ROOT.glob("k8s.gpu.topodra.io-claim_*.json")}


def checkpoint_bytes() -> bytes:
    files = sorted(PLUGIN_DIR.glob("*checkpoint*"))
    return b"".join(f.read_bytes() for f in files if f.is_file())


def env_of(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def template(nc: ClusterHandle, ns: str, name: str, count: int) -> None:
    nc.kube.create(f"{R}/namespaces/{ns}/resourceclaimtemplates", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": count}}]}}}})


def pod(nc: ClusterHandle, ns: str, name: str, claim: dict[str, str], script: str,
        containers: int = 1) -> None:
    nc.kube.create(f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"hostNetwork": True, "restartPolicy": "Never", "automountServiceAccountToken": False,
                 "terminationGracePeriodSeconds": 1,
                 "resourceClaims": [{"name": "gpus", **claim}],
                 "containers": [{"name": f"c{k}", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                                 "command": ["sh", "-c", script], "resources": {"claims": [{"name": "gpus"}]}}
                                for k in range(containers)]}})


def phase(nc: ClusterHandle, ns: str, name: str) -> str:
    return str(((nc.kube.get(f"/api/v1/namespaces/{ns}/pods/{name}") or {}).get("status") or {}).get("phase"))


def wait_phase(nc: ClusterHandle, ns: str, name: str, want: str, timeout: float = 90) -> None:
    def check() -> bool:
        ph = phase(nc, ns, name)
        if ph == "Failed" and want != "Failed":
            raise AssertionError(f"pod {ns}/{name} failed: {nc.kubectl('describe', 'pod', '-n', ns, name)}")
        return ph == want
    try:
        wait_for(check, timeout, f"pod {ns}/{name} to be {want}")
    except AssertionError:
        print(nc.kubectl("describe", "pod", "-n", ns, name, check=False))
        raise


def pod_claim(nc: ClusterHandle, ns: str, name: str) -> dict[str, Any]:
    """The pod's claim once allocated (generated claims vanish soon after the pod finishes: call early)."""
    def get() -> dict[str, Any] | None:
        p = nc.kube.get(f"/api/v1/namespaces/{ns}/pods/{name}") or {}
        ref = p["spec"]["resourceClaims"][0]
        statuses = p.get("status", {}).get("resourceClaimStatuses") or []
        cname = statuses[0]["resourceClaimName"] if statuses else ref.get("resourceClaimName")
        claim = nc.kube.get(claim_path(ns, cname)) if cname else None
        return claim if claim and claim.get("status", {}).get("allocation") else None
    result: dict[str, Any] = wait_for(get, 60, f"allocated claim of pod {ns}/{name}")
    return result


def allocated(claim: dict[str, Any]) -> list[str]:
    return sorted(r["device"] for r in claim["status"]["allocation"]["devices"]["results"])


def uuids_of(nc: ClusterHandle, node: str, devices: list[str]) -> list[str]:
    out = {}
    for sl in nc.kube.list(slices_path(), field_selector=f"spec.driver={DRIVER},spec.nodeName={node}"):
        for d in sl["spec"]["devices"]:
            if "uuid" in d.get("attributes", {}):
                out[d["name"]] = d["attributes"]["uuid"]["string"]
    return [out[d] for d in devices]


def delete_pod(nc: ClusterHandle, ns: str, name: str) -> None:
    nc.kube.delete(f"/api/v1/namespaces/{ns}/pods/{name}")
    wait_for(lambda: nc.kube.get(f"/api/v1/namespaces/{ns}/pods/{name}") is None, 60, f"pod {name} gone")


def test_registered_and_published(node_cluster: ClusterHandle, plugin: PluginProcess) -> None:
    assert plugin.metric("topodra_plugin_registration_status") == 1.0
    want = [f"gpu-{k}" for k in range(8)] + [f"nic-{k}" for k in range(8)]
    slices: list[dict[str, Any]] = []

    def published() -> bool:
        # The publisher is a thread of its own: registration does not wait for it, and a slice another
        # node test's plugin left on this node stays until the first pass replaces it.
        slices[:] = node_cluster.kube.list(slices_path(), field_selector=f"spec.driver={DRIVER},"
                                           f"spec.nodeName={node_cluster.node_name}")
        return len(slices) == 1 and [d["name"] for d in slices[0]["spec"]["devices"]] == want

    try:
        wait_for(published, 60, "the dgx-h100 pool published in one slice")
    except AssertionError as e:
        raise AssertionError(f"{e}; slices: {[[d['name'] for d in s['spec']['devices']] for s in slices]}") from None
    kubelet_log = (node_cluster.lc.logs / "kubelet.log").read_text()
    assert DRIVER in kubelet_log and "Register" in kubelet_log


def test_two_gpu_pod_sees_its_allocation_and_unprepare_removes_spec(
        node_cluster: ClusterHandle, plugin: PluginProcess) -> None:
    nc = node_cluster
    ns = nc.namespace("two")
    template(nc, ns, "two", 2)
    pod(nc, ns, "p", {"resourceClaimTemplateName": "two"}, "env | sort; sleep 2")
    claim = pod_claim(nc, ns, "p")
    wait_phase(nc, ns, "p", "Succeeded")
    devs = allocated(claim)
    assert len(devs) == 2 and all(d.startswith("gpu-") for d in devs)
    env = env_of(nc.kubectl("logs", "-n", ns, "p"))
    assert sorted(env["TOPODRA_VISIBLE_DEVICES"].split(",")) == devs
    assert sorted(env["TOPODRA_VISIBLE_UUIDS"].split(",")) == sorted(uuids_of(nc, nc.node_name, devs))
    for d in devs:
        frag = d.upper().replace("-", "_")
        assert env[f"TOPODRA_DEVICE_{frag}_MODEL"] == "H100-SXM5-80GB"
        assert env[f"TOPODRA_DEVICE_{frag}_UUID"] in env["TOPODRA_VISIBLE_UUIDS"]
    spec = f"k8s.gpu.topodra.io-claim_{claim['metadata']['uid']}.json"
    # The kubelet unprepares a finished pod's claim: the CDI spec goes away.
    delete_pod(nc, ns, "p")
    wait_for(lambda: spec not in our_specs(), 60, "CDI spec removal after unprepare")


def test_two_pods_get_distinct_gpus(node_cluster: ClusterHandle, plugin: PluginProcess) -> None:
    nc = node_cluster
    ns = nc.namespace("distinct")
    template(nc, ns, "one", 1)
    for name in ("a", "b"):
        pod(nc, ns, name, {"resourceClaimTemplateName": "one"}, "env | sort; sleep 300")
    for name in ("a", "b"):
        wait_phase(nc, ns, name, "Running")
    seen = {}

    def output(pod_name: str) -> str | None:
        out = nc.kubectl("logs", "-n", ns, pod_name)
        return out if "NVIDIA_VISIBLE_DEVICES" in out else None

    for name in ("a", "b"):
        out = wait_for(functools.partial(output, name), 30, "container output")
        seen[name] = env_of(out)["TOPODRA_VISIBLE_UUIDS"]
        assert [seen[name]] == uuids_of(nc, nc.node_name, allocated(pod_claim(nc, ns, name)))
    assert seen["a"] != seen["b"]
    for name in ("a", "b"):
        delete_pod(nc, ns, name)


def test_claim_shared_by_two_containers(node_cluster: ClusterHandle, plugin: PluginProcess) -> None:
    nc = node_cluster
    ns = nc.namespace("shared")
    nc.kube.create(f"{R}/namespaces/{ns}/resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "shared"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER}}]}}})
    pod(nc, ns, "p", {"resourceClaimName": "shared"}, "echo TOPODRA_VISIBLE_UUIDS=$TOPODRA_VISIBLE_UUIDS",
        containers=2)
    claim = pod_claim(nc, ns, "p")
    wait_phase(nc, ns, "p", "Succeeded")
    outs = [env_of(nc.kubectl("logs", "-n", ns, "p", "-c", c))["TOPODRA_VISIBLE_UUIDS"] for c in ("c0", "c1")]
    assert outs[0] == outs[1] != ""
    assert [outs[0]] == uuids_of(nc, nc.node_name, allocated(claim))
    delete_pod(nc, ns, "p")


def test_error_paths_are_per_claim_and_change_nothing(node_cluster: ClusterHandle, plugin: PluginProcess) -> None:
    nc = node_cluster
    ns = nc.namespace("errors")
    # An unallocated claim.
    nc.kube.create(f"{R}/namespaces/{ns}/resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "idle"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER}}]}}})
    idle = nc.kube.get(claim_path(ns, "idle"))
    assert idle is not None
    # A claim the real scheduler allocated on another node (a simulated dgx-h100), and one for another driver.
    sim = Simulation(nc.kube, SimulatedCluster.model_validate(
        {"groups": [{"namePrefix": "elsewhere-", "count": 1, "profile": "dgx-h100"}]}))
    sim.setup()
    sim.reconcile_all()
    other = Simulation(nc.kube, SimulatedCluster.model_validate(
        {"driverName": "other.example.com",
         "groups": [{"namePrefix": "otherdrv-", "count": 1, "profile": "l4"}]}))
    other.setup()
    other.reconcile_all()
    nc.kube.create(f"{R}/deviceclasses", {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": f"other-{ns}"},
        "spec": {"selectors": [{"cel": {"expression": 'device.driver == "other.example.com"'}}]}})
    for name, node, cls in (("far", "elsewhere-0", DRIVER), ("foreign", "otherdrv-0", f"other-{ns}")):
        nc.kube.create(f"{R}/namespaces/{ns}/resourceclaims", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": cls}}]}}})
        nc.kube.create(f"/api/v1/namespaces/{ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                     "resourceClaims": [{"name": "gpus", "resourceClaimName": name}],
                     "containers": [{"name": "c", "image": "localhost/busybox:1.35",
                                     "resources": {"claims": [{"name": "gpus"}]}}]}})
    far = wait_for(lambda: (c := nc.kube.get(claim_path(ns, "far"))) and c.get("status", {}).get("allocation")
                   and c, 60, "scheduler to allocate the far claim")
    foreign = wait_for(lambda: (c := nc.kube.get(claim_path(ns, "foreign"))) and
                       c.get("status", {}).get("allocation") and c, 60, "allocation of the foreign claim")

    before_specs, before_ckpt = our_specs(), checkpoint_bytes()

    def uid(c: dict[str, Any]) -> str:
        return str(c["metadata"]["uid"])

    with KubeletStub(DRA_SOCKET) as stub:
        assert dict(stub.prepare([]).claims) == {}
        cases = {
            str(uuid.uuid4()): ((ns, "missing"), "not found"),
            uid(idle): ((ns, "idle"), "not allocated"),
            str(uuid.uuid4()) + "x": ((ns, "idle"), "uid"),
            uid(far): ((ns, "far"), "elsewhere-0"),
            uid(foreign): ((ns, "foreign"), DRIVER),
        }
        for api in ("v1", "v1beta1"):
            resp = stub.prepare([(n[0], u, n[1]) for u, (n, _) in cases.items()], api=api)
            assert set(resp.claims) == set(cases)
            for u, (_, needle) in cases.items():
                err = resp.claims[u].error
                assert err and needle.lower() in err.lower(), (u, err)
                assert not resp.claims[u].devices
        dup = stub.prepare([(ns, uid(far), "far"), (ns, uid(far), "far")])
        assert "duplicate" in dup.claims[uid(far)].error.lower()
        # Unprepare of something never prepared is fine (idempotent).
        assert stub.unprepare([(ns, uid(idle), "idle")]).claims[uid(idle)].error == ""
    assert our_specs() == before_specs
    assert checkpoint_bytes() == before_ckpt
    sim.delete()
    other.delete()


def test_crash_between_started_and_completed_recovers(node_cluster: ClusterHandle, plugin: PluginProcess) -> None:
    nc = node_cluster
    ns = nc.namespace("crash")
    plugin.stop()
    plugin.start(extra_env={"TOPODRA_CRASH_POINT": "after-cdi-written"})
    template(nc, ns, "one", 1)
    pod(nc, ns, "p", {"resourceClaimTemplateName": "one"}, "env | sort; sleep 2")
    claim = pod_claim(nc, ns, "p")
    rc = plugin.wait_exit(90)  # the kubelet's prepare call hits the crash point
    assert rc != 0
    # The spec is written, the checkpoint is not: an orphan spec the kubelet got no answer for.
    assert claim["metadata"]["uid"] not in checkpoint_bytes().decode(errors="replace")
    assert [s for s in our_specs() if claim["metadata"]["uid"] in s]
    plugin.start()  # normal restart: removes the orphan spec; the kubelet retries prepare
    wait_phase(nc, ns, "p", "Succeeded", timeout=120)
    env = env_of(nc.kubectl("logs", "-n", ns, "p"))
    assert [env["TOPODRA_VISIBLE_UUIDS"]] == uuids_of(nc, nc.node_name, allocated(claim))
    matching = [s for s in our_specs() if claim["metadata"]["uid"] in s]
    assert len(matching) <= 1
    delete_pod(nc, ns, "p")
    wait_for(lambda: not [s for s in our_specs() if claim["metadata"]["uid"] in s], 60, "no leaked spec")


def test_restart_recreates_wiped_cdi_specs_and_handles_reboot(
        node_cluster: ClusterHandle, plugin: PluginProcess, boot_id_file: Path) -> None:
    nc = node_cluster
    ns = nc.namespace("restart")
    template(nc, ns, "one", 1)
    pod(nc, ns, "p", {"resourceClaimTemplateName": "one"}, "sleep 300")
    wait_phase(nc, ns, "p", "Running")
    uid = pod_claim(nc, ns, "p")["metadata"]["uid"]
    spec = CDI_ROOT / f"k8s.gpu.topodra.io-claim_{uid}.json"
    original = json.loads(spec.read_text())
    # Plugin restart with the CDI dir wiped (tmpfs after a reboot): specs come back.
    plugin.stop()
    for f in CDI_ROOT.glob("k8s.gpu.topodra.io-claim_*.json"):
        f.unlink()
    plugin.start()
    assert json.loads(spec.read_text()) == original
    # A different boot ID is handled as a reboot: the prepared claim is kept and its spec re-created.
    plugin.stop()
    spec.unlink()
    boot_id_file.write_text(str(uuid.uuid4()) + "\n")
    plugin.start()
    assert json.loads(spec.read_text()) == original
    assert "reboot" in plugin.tail(80).lower()
    assert plugin.metric("topodra_plugin_prepared_claims") == 1.0
    delete_pod(nc, ns, "p")
    wait_for(lambda: not spec.exists(), 60, "spec removed after unprepare")


def test_slices_deleted_while_running_come_back(node_cluster: ClusterHandle, plugin: PluginProcess) -> None:
    nc = node_cluster
    sel = f"spec.driver={DRIVER},spec.nodeName={nc.node_name}"
    before = list(nc.kube.list(slices_path(), field_selector=sel))
    gen = before[0]["spec"]["pool"]["generation"]
    for sl in before:
        nc.kube.delete(slices_path(sl["metadata"]["name"]))
    after = wait_for(lambda: list(nc.kube.list(slices_path(), field_selector=sel)), 60, "slices re-published")
    assert after[0]["spec"]["pool"]["generation"] > gen
    assert len(after[0]["spec"]["devices"]) == 16


def test_hardware_change_republishes_with_new_generation(
        node_cluster: ClusterHandle, plugin: PluginProcess, hardware_config: Path) -> None:
    nc = node_cluster
    sel = f"spec.driver={DRIVER},spec.nodeName={nc.node_name}"

    def pool() -> tuple[int, list[str]]:
        sl = list(nc.kube.list(slices_path(), field_selector=sel))
        return sl[0]["spec"]["pool"]["generation"], [d["name"] for d in sl[0]["spec"]["devices"]]

    gen, names = pool()
    assert "gpu-3" in names
    # GPU 3 disappears (mock hardware's hideGpus); SIGHUP re-reads the hardware config and re-discovers.
    hardware_config.write_text("hideGpus: [3]\n")
    assert plugin.proc is not None
    plugin.proc.send_signal(signal.SIGHUP)
    gen2, names2 = wait_for(lambda: (p := pool()) and "gpu-3" not in p[1] and p, 30, "republish without gpu-3")
    assert gen2 > gen and len(names2) == len(names) - 1
    hardware_config.write_text("{}\n")
    plugin.proc.send_signal(signal.SIGHUP)
    gen3, names3 = wait_for(lambda: (p := pool()) and "gpu-3" in p[1] and p, 30, "gpu-3 back")
    assert gen3 > gen2 and names3 == names
