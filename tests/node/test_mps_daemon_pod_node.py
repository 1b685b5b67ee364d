"""``--mps-daemon pod`` on the real node (issue 19 finding 4, NVIDIA's way): prepare of an MPS claim creates the
claim's daemon pod (bound to the node, no owner, the topodra image running the stand-in ``-f``), the client pod
and the daemon share the claim's tmpfs as ``/dev/shm``, the daemon pod keeps serving while the plugin process is
killed (-9) and started again (which finds it, not a second one), and unprepare deletes it.

Real kubelet and containerd; the topodra image built and imported as tests/node/test_install_helm_node.py does
(hack/build-image --import, cached layers); mock ``dgx-a100-80gb`` hardware and ``topodra.hardware.mockmps``.
The plugin is a host process with an admin kubeconfig, so the chart's pod RBAC is not exercised here.
"""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_plugin_e2e import delete_pod, pod, pod_claim, wait_phase
from test_sharing_gpuconfig_node import logged, published_uuid, template
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO
from testkit.pluginproc import PluginProcess

from topodra.hardware import mockmps
from topodra.sharing import mpspod, mpsshm
from topodra.sharing.config import API_VERSION
from topodra.sharing.mps import MpsDaemons

pytestmark = pytest.mark.node
STAND_IN = str(Path(mockmps.__file__))
IMAGE = "localhost/topodra:0.1.0"


@pytest.fixture(scope="module")
def daemon_ns(node_cluster: ClusterHandle) -> str:
    nc = node_cluster
    r = subprocess.run([str(REPO / "hack/build-image"), "--import", str(nc.lc.containerd_sock)],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "CTR": str(nc.bin_dir / "ctr")},
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return nc.namespace("mps-daemons")


@pytest.fixture(scope="module")
def plugin(node_cluster: ClusterHandle, daemon_ns: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[PluginProcess]:
    cfg = tmp_path_factory.mktemp("hw") / "hardware.yaml"
    cfg.write_text(f"migStateFile: {tmp_path_factory.mktemp('gpu') / 'gpu-state.json'}\n")
    boot = tmp_path_factory.mktemp("boot") / "boot_id"
    boot.write_text(Path("/proc/sys/kernel/random/boot_id").read_text())
    node_cluster.apply_yaml(REPO / "deviceclasses/gpu.topodra.io.yaml")
    p = PluginProcess(node_cluster.kubeconfig, node_cluster.node_name,
                      node_cluster.lc.logs / "topodra-plugin-mps-daemon-pod.log", hardware="mock:dgx-a100-80gb",
                      extra_env={"TOPODRA_BOOT_ID_FILE": str(boot), "TOPODRA_HARDWARE_CONFIG": str(cfg),
                                 "TOPODRA_MPS_CONTROL": STAND_IN, "TOPODRA_MPS_DAEMON": "pod",
                                 "TOPODRA_MPS_DAEMON_NAMESPACE": daemon_ns, "TOPODRA_MPS_DAEMON_IMAGE": IMAGE})
    p.start()
    wait_for(lambda: published_uuid(node_cluster, "gpu-7") is not None, 60, "the A100 devices published")
    yield p
    p.stop()


def daemon_pod(nc: ClusterHandle, ns: str, uid: str) -> dict[str, Any] | None:
    return nc.kube.get(mpspod.pods_path(ns, mpspod.pod_name(uid)))


def test_the_daemon_pod_serves_the_client_outlives_the_plugin_and_goes_with_unprepare(
        node_cluster: ClusterHandle, plugin: PluginProcess, daemon_ns: str) -> None:
    nc = node_cluster
    ns = nc.namespace("mpspod")
    template(nc, ns, "mps", 2, {"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 30, "defaultPinnedDeviceMemoryLimit": "4Gi"}}})
    pod(nc, ns, "mps", {"resourceClaimTemplateName": "mps"},
        "ls /dev/shm | sed 's/^/SHM=/'; echo hello > /dev/shm/from-client; echo done; sleep 3600")
    uid = pod_claim(nc, ns, "mps")["metadata"]["uid"]
    wait_phase(nc, ns, "mps", "Running")
    wait_for(functools.partial(logged, nc, ns, "mps", "done"), 30, "the client's output")

    d = daemon_pod(nc, daemon_ns, uid)
    assert d is not None, "prepare made the claim's daemon pod"
    assert d["spec"]["nodeName"] == nc.node_name and not d["metadata"].get("ownerReferences")
    assert d["metadata"]["labels"][mpspod.CLAIM_LABEL] == uid
    assert d["status"]["phase"] == "Running"
    pod_uid = d["metadata"]["uid"]

    daemons = MpsDaemons(plugin.plugin_dir, binary=STAND_IN)
    shm = daemons.shm_dir(uid)
    pid = daemons.pid(uid)
    assert pid is not None and mpsshm.fstype(shm) == "tmpfs"
    out = nc.kubectl("logs", "-n", ns, "mps")
    assert f"SHM={mockmps.SHM_PREFIX}{pid}" in out, f"the client's /dev/shm is not the daemon pod's: {out}"
    assert (shm / "from-client").read_text() == "hello\n"
    assert daemons.control(uid, ["get_default_active_thread_percentage"]).strip() == "30.0", \
        "the limits were set on the pod's daemon"

    plugin.kill9()
    assert daemons.alive(uid), "the daemon pod answers with the plugin gone"
    plugin.start()
    again = daemon_pod(nc, daemon_ns, uid)
    assert again is not None and again["metadata"]["uid"] == pod_uid, "the restarted plugin keeps the pod"
    assert daemons.pid(uid) == pid
    _, logs = daemons.dirs(uid)
    assert (logs / "control.log").read_text().count("startup:") == 1, "one daemon, never a second"

    delete_pod(nc, ns, "mps")
    wait_for(lambda: daemon_pod(nc, daemon_ns, uid) is None, 90, "unprepare to delete the daemon pod")
    assert not shm.parent.exists() and mpsshm.fstype(shm) is None
