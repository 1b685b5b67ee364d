"""MIG on the real node: the real kubelet prepares MIG slices through the plugin process, containerd injects them.

The plugin runs as a host process on mock ``dgx-a100-80gb-mig`` hardware whose MIG instances live in a
state file (as on a GPU, they outlive the process).  Containers must see exactly their MIG UUID; a plugin
killed after creating an instance (exit 137 at a crash point, like kill -9) leaks none once restarted.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_plugin_e2e import delete_pod, env_of, pod, pod_claim, wait_phase
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO
from testkit.pluginproc import PluginProcess

from topodra.apipaths import slices_path
from topodra.hardware.mockmig import MigState, mig_uuid

pytestmark = pytest.mark.node
R = "/apis/resource.k8s.io/v1"
D = 'device.attributes["gpu.topodra.io"]'


@pytest.fixture(scope="module")
def mig_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mig") / "mig-instances.json"


@pytest.fixture(scope="module")
def plugin(node_cluster: ClusterHandle, mig_state: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[PluginProcess]:
    cfg = tmp_path_factory.mktemp("hw") / "hardware.yaml"
    cfg.write_text(f"migStateFile: {mig_state}\n")
    boot = tmp_path_factory.mktemp("boot") / "boot_id"
    boot.write_text(Path("/proc/sys/kernel/random/boot_id").read_text())
    node_cluster.apply_yaml(REPO / "deviceclasses/gpu-mig-1g.yaml")
    p = PluginProcess(node_cluster.kubeconfig, node_cluster.node_name, node_cluster.lc.logs / "topodra-plugin-mig.log",
                      hardware="mock:dgx-a100-80gb-mig",
                      extra_env={"TOPODRA_BOOT_ID_FILE": str(boot), "TOPODRA_HARDWARE_CONFIG": str(cfg)})
    p.start()
    wait_for(lambda: any(d["name"] == "gpu-0-mig-1g-10gb-0" for s in node_cluster.kube.list(
        slices_path(), field_selector=f"spec.driver=gpu.topodra.io,spec.nodeName={node_cluster.node_name}")
        for d in s["spec"].get("devices") or []), 60, "MIG devices published")
    yield p
    p.stop()


def instances(path: Path) -> dict[str, list[tuple[int, int]]]:
    """GPU UUID -> (GPU instance, compute instance) pairs the mock GPUs hold now."""
    if not path.exists():
        return {}
    st = MigState.model_validate_json(path.read_text())
    return {g: [(x.id, c.id) for x in gis for c in x.computeInstances] for g, gis in st.gpus.items() if gis}


def slice_template(nc: ClusterHandle, ns: str, gpu: str) -> None:
    nc.kube.create(f"{R}/namespaces/{ns}/resourceclaimtemplates", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "one-1g"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
            "deviceClassName": "gpu-mig-1g",
            "selectors": [{"cel": {"expression": f'{D}.profile == "1g.10gb" && {D}.parentDevice == "{gpu}"'}}]}}]}}}})


def logged_env(nc: ClusterHandle, ns: str, name: str) -> bool:
    return "NVIDIA_VISIBLE_DEVICES" in nc.kubectl("logs", "-n", ns, name)


def parent_uuid(nc: ClusterHandle, gpu: str) -> str:
    for s in nc.kube.list(slices_path(), field_selector=f"spec.driver=gpu.topodra.io,spec.nodeName={nc.node_name}"):
        for d in s["spec"].get("devices") or []:
            if d["name"] == gpu:
                return str(d["attributes"]["uuid"]["string"])
    raise AssertionError(f"{gpu} not published")


def test_containers_see_only_their_mig_device(node_cluster: ClusterHandle, plugin: PluginProcess,
                                              mig_state: Path) -> None:
    nc = node_cluster
    ns = nc.namespace("mig")
    slice_template(nc, ns, "gpu-2")
    parent = parent_uuid(nc, "gpu-2")
    for name in ("a", "b"):
        pod(nc, ns, name, {"resourceClaimTemplateName": "one-1g"}, "env | sort; sleep 3600")
    claims = {name: pod_claim(nc, ns, name) for name in ("a", "b")}
    for name in ("a", "b"):  # running: the kubelet unprepares (destroys the instance) once a pod ends
        wait_phase(nc, ns, name, "Running")
        wait_for(functools.partial(logged_env, nc, ns, name), 30, f"{name}'s env")
    held = instances(mig_state)[parent]
    assert len(held) == 2
    expected = {mig_uuid(parent, gi, ci) for gi, ci in held}
    seen = set()
    for name in ("a", "b"):
        env = env_of(nc.kubectl("logs", "-n", ns, name))
        visible = env["TOPODRA_VISIBLE_UUIDS"].split(",")
        assert len(visible) == 1 and visible[0].startswith("MIG-"), env["TOPODRA_VISIBLE_UUIDS"]
        assert parent not in json.dumps(env), "the parent GPU's UUID must not reach the container"
        (device,) = [r["device"] for r in claims[name]["status"]["allocation"]["devices"]["results"]]
        assert env["TOPODRA_VISIBLE_DEVICES"] == device
        seen.add(visible[0])
    assert seen == expected
    for name in ("a", "b"):
        delete_pod(nc, ns, name)
    wait_for(lambda: parent not in instances(mig_state), 60, "MIG instances destroyed by unprepare")


def test_kill_after_instance_creation_leaks_nothing(node_cluster: ClusterHandle, plugin: PluginProcess,
                                                    mig_state: Path) -> None:
    nc = node_cluster
    ns = nc.namespace("migcrash")
    slice_template(nc, ns, "gpu-4")
    parent = parent_uuid(nc, "gpu-4")
    plugin.stop()
    plugin.start(extra_env={"TOPODRA_CRASH_POINT": "after-mig-created"})
    pod(nc, ns, "p", {"resourceClaimTemplateName": "one-1g"}, "env | sort; sleep 3600")
    claim = pod_claim(nc, ns, "p")
    assert plugin.wait_exit(90) == 137  # died with the instance made, before its CDI spec and checkpoint
    assert len(instances(mig_state).get(parent, [])) == 1
    plugin.start()  # recovery destroys the unrecorded instance; the kubelet's retry makes a new one
    wait_phase(nc, ns, "p", "Running", timeout=120)
    wait_for(functools.partial(logged_env, nc, ns, "p"), 30, "p's env")
    held = instances(mig_state)[parent]
    assert len(held) == 1, held
    env = env_of(nc.kubectl("logs", "-n", ns, "p"))
    assert env["TOPODRA_VISIBLE_UUIDS"] == mig_uuid(parent, *held[0])
    assert claim["metadata"]["uid"] in env.get(
        f"TOPODRA_DEVICE_{env['TOPODRA_VISIBLE_DEVICES'].upper().replace('-', '_').replace('.', '_')}_CLAIM_UID", "")
    delete_pod(nc, ns, "p")
    wait_for(lambda: parent not in instances(mig_state), 60, "no leaked MIG instance")


def test_memory_shares_see_their_limits(node_cluster: ClusterHandle, plugin: PluginProcess,
                                        tmp_path: Path) -> None:
    """The same node, its plugin restarted on a GPU-memory-sharing config: two shares of gpu-0, each its limit."""
    nc = node_cluster
    cfg = tmp_path / "hardware.yaml"
    cfg.write_text("shareGpuMemory: true\n")
    nc.apply_yaml(REPO / "deviceclasses/gpu-shared-memory.yaml")
    plugin.stop()
    shared = PluginProcess(nc.kubeconfig, nc.node_name, nc.lc.logs / "topodra-plugin-shared.log",
                           hardware="mock:dgx-a100-80gb", extra_env={**plugin.extra_env,
                                                                     "TOPODRA_HARDWARE_CONFIG": str(cfg)})
    shared.start()
    try:
        ns = nc.namespace("memshare")
        wait_for(lambda: published_type(nc, "gpu-0") == "gpu-shared", 60, "gpu-0 published as shared")
        for name, mem in (("a", "20Gi"), ("b", "30Gi")):
            nc.kube.create(f"{R}/namespaces/{ns}/resourceclaimtemplates", {
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
                "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
                    "deviceClassName": "gpu-shared-memory", "capacity": {"requests": {"memory": mem}},
                    "selectors": [{"cel": {"expression": f"{D}.minor == 0"}}]}}]}}}})
            pod(nc, ns, name, {"resourceClaimTemplateName": name}, "env | sort; sleep 3600")
        gpu0 = parent_uuid(nc, "gpu-0")
        for name, mem in (("a", "20Gi"), ("b", "30Gi")):
            wait_phase(nc, ns, name, "Running")
            wait_for(functools.partial(logged_env, nc, ns, name), 30, f"{name}'s env")
            env = env_of(nc.kubectl("logs", "-n", ns, name))
            assert env["TOPODRA_VISIBLE_UUIDS"] == gpu0 and env["TOPODRA_VISIBLE_DEVICES"] == "gpu-0"
            assert env["TOPODRA_DEVICE_GPU_0_MEMORY_LIMIT"] == mem
            assert env["TOPODRA_DEVICE_GPU_0_SHARE_ID"]
        for name in ("a", "b"):
            delete_pod(nc, ns, name)
    finally:
        shared.stop()
        plugin.start()


def published_type(nc: ClusterHandle, gpu: str) -> str | None:
    for s in nc.kube.list(slices_path(), field_selector=f"spec.driver=gpu.topodra.io,spec.nodeName={nc.node_name}"):
        for d in s["spec"].get("devices") or []:
            if d["name"] == gpu:
                return str(d["attributes"]["type"]["string"])
    return None
