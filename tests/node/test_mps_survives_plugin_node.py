"""MPS on the real node (issue 19 finding 4): an MPS claim's pod and its daemon share one ``/dev/shm`` (the
claim's tmpfs), the GPU runs EXCLUSIVE_PROCESS while the daemon runs, the daemon keeps answering on its control
pipe after the plugin process is killed (-9) and started again, and unprepare stops it and removes the tmpfs.

Mock ``dgx-a100-80gb`` hardware (its GPU state file records the compute mode), the stand-in control daemon
(``topodra.hardware.mockmps``), the real kubelet and containerd applying the claim's CDI mounts.  The plugin is
a host process here, as in every node test; the plugin pod under containerd is docs/sharing.md's open item.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_plugin_e2e import delete_pod, pod, pod_claim, wait_phase
from test_sharing_gpuconfig_node import logged, published_uuid, template
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO
from testkit.pluginproc import PluginProcess

from topodra.hardware import mockmps
from topodra.sharing import mpsshm
from topodra.sharing.config import API_VERSION
from topodra.sharing.mps import MpsDaemons

pytestmark = pytest.mark.node
STAND_IN = str(Path(mockmps.__file__))


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
                      node_cluster.lc.logs / "topodra-plugin-mps-survives.log", hardware="mock:dgx-a100-80gb",
                      extra_env={"TOPODRA_BOOT_ID_FILE": str(boot), "TOPODRA_HARDWARE_CONFIG": str(cfg),
                                 "TOPODRA_MPS_CONTROL": STAND_IN})
    p.start()
    wait_for(lambda: published_uuid(node_cluster, "gpu-7") is not None, 60, "the A100 devices published")
    yield p
    p.stop()


def compute_modes(path: Path) -> dict[str, int]:
    return dict(json.loads(path.read_text()).get("computeModes", {})) if path.exists() else {}


def test_mps_pod_shares_dev_shm_with_a_daemon_that_outlives_the_plugin(
        node_cluster: ClusterHandle, plugin: PluginProcess, gpu_state: Path) -> None:
    nc = node_cluster
    ns = nc.namespace("mpsshm")
    template(nc, ns, "mps", 3, {"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 30, "defaultPinnedDeviceMemoryLimit": "4Gi"}}})
    pod(nc, ns, "mps", {"resourceClaimTemplateName": "mps"},
        "ls /dev/shm | sed 's/^/SHM=/'; echo hello > /dev/shm/from-client; echo done; sleep 3600")
    uid = pod_claim(nc, ns, "mps")["metadata"]["uid"]
    wait_phase(nc, ns, "mps", "Running")
    wait_for(functools.partial(logged, nc, ns, "mps", "done"), 30, "the client's output")
    daemons = MpsDaemons(plugin.plugin_dir, binary=STAND_IN)
    shm = daemons.shm_dir(uid)
    pid = daemons.pid(uid)
    assert pid is not None and mpsshm.fstype(shm) == "tmpfs"
    out = nc.kubectl("logs", "-n", ns, "mps")
    assert f"SHM={mockmps.SHM_PREFIX}{pid}" in out, f"the client's /dev/shm is not the daemon's: {out}"
    assert (shm / "from-client").read_text() == "hello\n", "the client's write is in the claim's tmpfs"
    gpu3 = published_uuid(nc, "gpu-3")
    assert compute_modes(gpu_state) == {gpu3: 3}, "EXCLUSIVE_PROCESS while the daemon runs"
    assert daemons.control(uid, ["get_default_active_thread_percentage"]).strip() == "30.0"

    plugin.kill9()
    assert daemons.alive(uid), "the daemon answers get_server_list with the plugin gone"
    plugin.start()
    assert daemons.pid(uid) == pid, "the restarted plugin keeps the running daemon"
    _, logs = daemons.dirs(uid)
    assert (logs / "control.log").read_text().count("startup:") == 1

    delete_pod(nc, ns, "mps")
    wait_for(lambda: not shm.parent.exists(), 60, "unprepare to stop the daemon and remove its directories")
    assert mpsshm.fstype(shm) is None and compute_modes(gpu_state) == {}
