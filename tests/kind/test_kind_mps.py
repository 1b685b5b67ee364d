"""MPS under the chart on kind (issue 19, finding 4): ``plugin.mpsDaemon: pod`` on the nvml branch.

An MPS claim's control daemon runs in a pod of its own (``sharing/mpspod.py``): the tree's C stand-in
``nvidia-cuda-mps-control -f`` from the driver root, with the claim's pipe, log and tmpfs directories as hostPath
mounts. Checked here with the real kubelet, containerd and DaemonSet: the client container and the daemon pod
share one ``/dev/shm`` and one pipe directory (the client talks to the daemon through it), the daemon pod
outlives its plugin pod, and unprepare deletes it.
"""

from __future__ import annotations

import json
import subprocess
from functools import partial
from typing import Any

from .conftest import PLUGIN_NS, Kind, wait_until
from .test_kind_real_gpu import TOPODRA_IMAGE, _ready, plugin_nodes

API_VERSION = "gpu.topodra.io/v1alpha1"
PLUGIN_DIR = "/var/lib/kubelet/plugins/gpu.topodra.io"  # the chart's plugin dir on the node
CONTROL = "/driver-root/usr/bin/nvidia-cuda-mps-control"
# By absolute path: the daemon pod's PATH is the driver tools' directory only (sharing/driverbins.py).
PYTHON = "/opt/topodra/bin/python3"  # the tree's stand-in, as the daemon pod names it
# A client of the daemon, speaking the stand-in's pipe protocol (as mockmps and mps.c do): a reply FIFO named
# relative to the pipe directory, the command on the control FIFO, the answer read back. Prints "ANSWER <json>".
ASK = r"""
import json, os, select, signal, sys
signal.alarm(20)
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
name = f"reply.kindtest.{os.getpid()}"
os.mkfifo(os.path.join(pipe, name), 0o600)
try:
    # The reader first: the daemon opens the reply non-blocking and drops an answer nobody reads (mps.c serve).
    rfd = os.open(os.path.join(pipe, name), os.O_RDONLY | os.O_NONBLOCK)
    fd = os.open(os.path.join(pipe, "control"), os.O_WRONLY | os.O_NONBLOCK)
    os.write(fd, f"{name} {' '.join(sys.argv[1:])}\n".encode())
    os.close(fd)
    got = b""
    while True:
        select.select([rfd], [], [])
        try:
            chunk = os.read(rfd, 4096)
        except BlockingIOError:
            continue
        if not chunk:
            break
        got += chunk
    print("ANSWER " + json.dumps(got.decode()), flush=True)
finally:
    os.unlink(os.path.join(pipe, name))
"""
CLIENT = r"""
import os, time
open("/dev/shm/from-client", "w").write("written by the client\n")
print("SHM " + " ".join(sorted(os.listdir("/dev/shm"))), flush=True)
print("PIPE " + os.environ.get("CUDA_MPS_PIPE_DIRECTORY", ""), flush=True)
time.sleep(3600)
"""


def mps_template(name: str) -> str:
    params = {"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 30, "defaultPinnedDeviceMemoryLimit": "4Gi"}}}
    return json.dumps({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
        "spec": {"spec": {"devices": {
            "requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu.topodra.io", "count": 1}}],
            "config": [{"requests": ["gpus"], "opaque": {"driver": "gpu.topodra.io", "parameters": params}}]}}}})


def client_pod(name: str, template: str, node: str) -> str:
    return json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                 "nodeSelector": {"kubernetes.io/hostname": node},
                 "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template}],
                 "containers": [{
                     "name": "c0", "image": TOPODRA_IMAGE, "imagePullPolicy": "Never",
                     "command": ["python3", "-c", CLIENT],
                     # root: the client makes its reply FIFO in the pipe directory, which the plugin made (root)
                     "securityContext": {"runAsUser": 0, "runAsGroup": 0},
                     "resources": {"claims": [{"name": "gpus"}]}}]}})


def ask(kind: Kind, ns: str, pod: str, *command: str, container: str | None = None) -> str:
    """The daemon's answer to ``command``, asked from inside ``pod`` through its pipe directory."""
    extra = ["-c", container] if container else []
    out = kind.k("exec", "-n", ns, pod, *extra, "--", PYTHON, "-c", ASK, *command, timeout=60).stdout
    (line,) = [x for x in out.splitlines() if x.startswith("ANSWER ")]
    return str(json.loads(line.removeprefix("ANSWER ")))


def read_in(kind: Kind, ns: str, pod: str, path: str) -> subprocess.CompletedProcess[str]:
    """A file as ``pod`` sees it (the topodra image has python but no coreutils)."""
    return kind.k("exec", "-n", ns, pod, "--", PYTHON, "-c",
                  "import sys; sys.stdout.write(open(sys.argv[1]).read())", path, check=False, timeout=60)


def daemon_pid(kind: Kind, daemon: str) -> int:
    r = read_in(kind, PLUGIN_NS, daemon, "/tmp/nvidia-mps/nvidia-cuda-mps-control.pid")
    assert r.returncode == 0, r.stderr
    return int(r.stdout)


def daemon_pod(kind: Kind, claim_uid: str) -> Any | None:
    r = kind.k("get", "pod", "-n", PLUGIN_NS, f"topodra-mps-{claim_uid}", "-o", "json", "--ignore-not-found")
    return json.loads(r.stdout) if r.stdout.strip() else None


def test_mps_daemon_pod_shares_dev_shm_outlives_the_plugin_pod_and_goes_with_unprepare(kind: Kind, ns: str) -> None:
    nodes = plugin_nodes(kind)
    node = nodes["dgx-h100"]
    tree = kind.tree(node)
    assert (tree / "usr/bin/nvidia-cuda-mps-control").is_file(), "the tree has the C MPS stand-in"
    kind.apply(ns, mps_template("mps"))
    kind.apply(ns, client_pod("client", "mps", node))
    pod = kind.wait_pod_phase(ns, "client", ("Running",), timeout=240)
    uid = kind.claim_of(pod)["metadata"]["uid"]

    def printed() -> str | None:
        log = kind.k("logs", "-n", ns, "client").stdout
        return log if "PIPE " in log else None
    log = wait_until("the client's output", printed, timeout=120)

    d = kind.wait_pod_phase(PLUGIN_NS, f"topodra-mps-{uid}", ("Running",), timeout=60)
    assert d["spec"]["nodeName"] == node and not d["metadata"].get("ownerReferences"), d["metadata"]
    (c,) = d["spec"]["containers"]
    assert c["command"] == [CONTROL, "-f"] and c["image"] == TOPODRA_IMAGE, c
    daemon = d["metadata"]["name"]
    pid = daemon_pid(kind, daemon)

    # (a) one /dev/shm: the daemon's own file is in the client's listing, the client's file in the daemon pod.
    shm = next(x for x in log.splitlines() if x.startswith("SHM ")).split()[1:]
    assert f"cuda.shm.standin.control.{pid}" in shm, f"the client's /dev/shm is not the daemon pod's: {shm}"
    seen = read_in(kind, PLUGIN_NS, daemon, "/dev/shm/from-client")
    assert seen.returncode == 0 and seen.stdout == "written by the client\n", seen.stderr
    # ... and one pipe directory: the client is served, with the limits the plugin set on the daemon.
    assert ask(kind, ns, "client", "get_default_active_thread_percentage").strip() == "30.0"
    assert ask(kind, ns, "client", "get_server_list") == ""

    # (b) the plugin pod goes (the DaemonSet makes a new one); the daemon pod keeps running and serving.
    old = kind.plugin_pod_on(node)
    assert old is not None
    kind.k("delete", "pod", "-n", PLUGIN_NS, old["metadata"]["name"], "--wait=true", timeout=180)
    new = wait_until(f"a new Ready plugin pod on {node}", partial(_ready, kind, node), timeout=240)
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    again = daemon_pod(kind, uid)
    assert again is not None and again["metadata"]["uid"] == d["metadata"]["uid"], "the same daemon pod"
    assert again["status"]["phase"] == "Running"
    assert [s["restartCount"] for s in again["status"]["containerStatuses"]] == [0], "the daemon never restarted"
    assert daemon_pid(kind, daemon) == pid
    assert ask(kind, ns, "client", "get_default_active_thread_percentage").strip() == "30.0"
    logs = kind.k("logs", "-n", PLUGIN_NS, daemon).stdout
    assert logs.count("Starting control daemon") == 1, logs

    # (c) unprepare: the client pod and its claim go, and with them the daemon pod, its dirs and its tmpfs.
    kind.k("delete", "pod", "-n", ns, "client", "--wait=true", timeout=180)
    wait_until("the client's claim deleted", lambda: not kind.k(
        "get", "resourceclaims", "-n", ns, "-o", "name").stdout.strip(), timeout=120)
    wait_until("unprepare to delete the daemon pod", lambda: daemon_pod(kind, uid) is None, timeout=180)
    claim_dir = f"{PLUGIN_DIR}/mps/{uid}"
    wait_until("the claim's MPS dirs removed", lambda: kind.node_exec(
        node, "test", "-e", claim_dir, check=False).returncode != 0, timeout=60)
    mounts = kind.node_exec(node, "cat", "/proc/self/mountinfo").stdout
    assert claim_dir not in mounts, "the claim's tmpfs is unmounted on the node"
