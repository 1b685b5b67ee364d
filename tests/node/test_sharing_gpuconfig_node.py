"""GpuConfig on the real node: the real kubelet hands the claim's opaque config to the plugin process.

Mock ``dgx-a100-80gb`` hardware records the time-slice level in its GPU state file; MPS runs the stand-in
control daemon (``topodra.hardware.mockmps``, mock hardware).  A TimeSlicing pod and an MPS pod run and see
their env (the MPS pod its daemon's pipe directory, mounted); a bad config fails the pod's prepare with a
clear event and changes nothing on the node.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_plugin_e2e import delete_pod, env_of, pod, pod_claim, wait_phase
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO
from testkit.pluginproc import PluginProcess

from topodra import checkpoint
from topodra.apipaths import slices_path
from topodra.hardware import mockmps
from topodra.sharing.config import API_VERSION

pytestmark = pytest.mark.node
R = "/apis/resource.k8s.io/v1"
D = 'device.attributes["gpu.topodra.io"]'


@pytest.fixture(scope="module")
def gpu_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gpu") / "gpu-state.json"


@pytest.fixture(scope="module")
def plugin(node_cluster: ClusterHandle, gpu_state: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[PluginProcess]:
    cfg = tmp_path_factory.mktemp("hw") / "hardware.yaml"
    cfg.write_text(f"migStateFile: {gpu_state}\n")
    boot = tmp_path_factory.mktemp("boot") / "boot_id"
    boot.write_text(Path("/proc/sys/kernel/random/boot_id").read_text())
    node_cluster.apply_yaml(REPO / "deviceclasses/gpu.topodra.io.yaml")
    p = PluginProcess(node_cluster.kubeconfig, node_cluster.node_name,
                      node_cluster.lc.logs / "topodra-plugin-gpuconfig.log", hardware="mock:dgx-a100-80gb",
                      extra_env={"TOPODRA_BOOT_ID_FILE": str(boot), "TOPODRA_HARDWARE_CONFIG": str(cfg),
                                 "TOPODRA_MPS_CONTROL": str(Path(mockmps.__file__))})
    p.start()
    # Registration does not wait for the publisher, and the slice an earlier plugin of the session (dgx-h100)
    # left on this node also has a gpu-7: wait for this plugin's A100 pool.
    wait_for(lambda: published_model(node_cluster, "gpu-7").startswith("A100"), 60, "the A100 devices published")
    yield p
    p.stop()


def published_uuid(nc: ClusterHandle, gpu: str) -> str | None:
    for s in nc.kube.list(slices_path(), field_selector=f"spec.driver=gpu.topodra.io,spec.nodeName={nc.node_name}"):
        for d in s["spec"].get("devices") or []:
            if d["name"] == gpu:
                return str(d["attributes"]["uuid"]["string"])
    return None


def published_model(nc: ClusterHandle, gpu: str) -> str:
    for s in nc.kube.list(slices_path(), field_selector=f"spec.driver=gpu.topodra.io,spec.nodeName={nc.node_name}"):
        for d in s["spec"].get("devices") or []:
            if d["name"] == gpu:
                return str(d["attributes"].get("model", {}).get("string", ""))
    return ""


def template(nc: ClusterHandle, ns: str, name: str, minor: int, parameters: dict[str, Any]) -> None:
    nc.kube.create(f"{R}/namespaces/{ns}/resourceclaimtemplates", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
        "spec": {"spec": {"devices": {
            "requests": [{"name": "gpus", "exactly": {
                "deviceClassName": "gpu.topodra.io", "selectors": [{"cel": {"expression": f"{D}.minor == {minor}"}}]}}],
            "config": [{"requests": ["gpus"], "opaque": {"driver": "gpu.topodra.io", "parameters": parameters}}]}}}})


def levels(path: Path) -> dict[str, int]:
    return dict(json.loads(path.read_text()).get("timeslices", {})) if path.exists() else {}


def logged(nc: ClusterHandle, ns: str, name: str, marker: str) -> bool:
    return marker in nc.kubectl("logs", "-n", ns, name, check=False)


def test_time_slicing_and_mps_pods_run_with_their_config(node_cluster: ClusterHandle, plugin: PluginProcess,
                                                         gpu_state: Path) -> None:
    nc = node_cluster
    ns = nc.namespace("gpucfg")
    template(nc, ns, "ts", 5, {"apiVersion": API_VERSION, "kind": "GpuConfig",
                               "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}})
    template(nc, ns, "mps", 6, {"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 40, "defaultPinnedDeviceMemoryLimit": "10Gi"}}})
    pod(nc, ns, "ts", {"resourceClaimTemplateName": "ts"}, "env | sort; echo done; sleep 3600")
    pod(nc, ns, "mps", {"resourceClaimTemplateName": "mps"},
        "env | sort; ls $CUDA_MPS_PIPE_DIRECTORY | sed 's/^/PIPE=/'; echo done; sleep 3600")
    mps_uid = pod_claim(nc, ns, "mps")["metadata"]["uid"]
    for name in ("ts", "mps"):
        wait_phase(nc, ns, name, "Running")
        wait_for(functools.partial(logged, nc, ns, name, "done"), 30, f"{name}'s output")
    gpu5, gpu6 = published_uuid(nc, "gpu-5"), published_uuid(nc, "gpu-6")
    assert levels(gpu_state) == {gpu5: 3}
    ts_env = env_of(nc.kubectl("logs", "-n", ns, "ts"))
    assert ts_env["TOPODRA_DEVICE_GPU_5_SHARING"] == "TimeSlicing"
    assert ts_env["TOPODRA_DEVICE_GPU_5_TIMESLICE_INTERVAL"] == "Long"
    out = nc.kubectl("logs", "-n", ns, "mps")
    env = env_of(out)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps" and env["TOPODRA_VISIBLE_UUIDS"] == gpu6
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
    assert "PIPE=control" in out and f"PIPE={mockmps.PID_FILE}" in out, out  # the daemon's pipe dir, mounted
    pipe = plugin.plugin_dir / "mps" / mps_uid / "pipe"
    assert (pipe / mockmps.PID_FILE).exists()
    for name in ("ts", "mps"):
        delete_pod(nc, ns, name)
    wait_for(lambda: levels(gpu_state) == {} and not pipe.exists(), 60,
             "time-slice level back to Default and the MPS daemon stopped by unprepare")


def test_bad_config_fails_prepare_with_a_clear_event_and_changes_nothing(
        node_cluster: ClusterHandle, plugin: PluginProcess, gpu_state: Path) -> None:
    nc = node_cluster
    ns = nc.namespace("gpucfgbad")
    template(nc, ns, "bad", 4, {"apiVersion": API_VERSION, "kind": "GpuConfig",
                                "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Forever"}}})
    pod(nc, ns, "bad", {"resourceClaimTemplateName": "bad"}, "env; sleep 3600")
    uid = pod_claim(nc, ns, "bad")["metadata"]["uid"]

    def event() -> str | None:
        for e in nc.kube.list(f"/api/v1/namespaces/{ns}/events"):
            if e.get("involvedObject", {}).get("name") == "bad" and "invalid GpuConfig" in e.get("message", ""):
                return str(e["message"])
        return None

    message = wait_for(event, 90, "the pod's prepare-failure event")
    assert "sharing.timeSlicing.interval" in message and uid in message, message
    assert nc.kubectl("get", "pod", "-n", ns, "bad", "-o", "jsonpath={.status.phase}") == "Pending"
    data = checkpoint.load(plugin.plugin_dir / checkpoint.FILE_NAME)
    assert data is None or uid not in data.claims
    assert not list(plugin.cdi_root.glob(f"*{uid}*")) and levels(gpu_state) == {}
    assert not (plugin.plugin_dir / "mps" / uid).exists()
    delete_pod(nc, ns, "bad")
