"""The chart's real-GPU branch on kind (issue 19): hardware nvml against each node's host driver tree.

The plugin image (Debian 12) loads the tree's NVML stand-in by absolute path and publishes the profile's GPUs;
a claim's containers get what a GPU node gives them: their own /dev/nvidiaN, the control nodes, libcuda.so.1
from the tree (the stub counts the GPU nodes it may open), and a MIG device's capability nodes by number though
the node has no /dev/nvidia-caps. The test pods run the topodra image, the one image in the nodes with a libc
(python's ctypes dlopens libcuda.so.1 by soname, as a CUDA program does).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from functools import partial
from typing import Any

import pytest

from .conftest import DRIVER, PLUGIN_NS, Kind, wait_until
from .test_kind_suite import gpu_template, injected

TOPODRA_IMAGE = "localhost/topodra:0.1.0"  # hack/kind-up's default TOPODRA_IMAGE, loaded into every node
LIBDIR = "usr/lib/x86_64-linux-gnu"
# What the container sees: its environment (as `env | sort` prints it), then one JSON line.
PROBE = r"""
import ctypes, hashlib, json, os, stat
for k, v in sorted(os.environ.items()):
    print(f"{k}={v}")
def node(p):
    st = os.stat(p)
    return {"char": stat.S_ISCHR(st.st_mode), "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev)}
dev = {f"/dev/{n}": node(f"/dev/{n}") for n in sorted(os.listdir("/dev")) if n.startswith("nvidia")
       and not os.path.isdir(f"/dev/{n}")}
caps = {}
if os.path.isdir("/dev/nvidia-caps"):
    caps = {f"/dev/nvidia-caps/{n}": node(f"/dev/nvidia-caps/{n}") for n in sorted(os.listdir("/dev/nvidia-caps"))}
cuda = ctypes.CDLL("libcuda.so.1")
init = cuda.cuInit(0)
count = ctypes.c_int(-1)
rc = cuda.cuDeviceGetCount(ctypes.byref(count))
minors = []
for i in range(max(count.value, 0)):
    m = ctypes.c_int(-1)
    cuda.topodraStandinDeviceMinor(i, ctypes.byref(m))
    minors.append(m.value)
loaded = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libcuda" in line})
sha = hashlib.sha256(open(loaded[0], "rb").read()).hexdigest() if loaded else ""
print("PROBE " + json.dumps({"dev": dev, "caps": caps, "init": init, "rc": rc, "count": count.value,
                             "minors": minors, "loaded": loaded, "sha256": sha}), flush=True)
import time
time.sleep(3600)  # keep the claim prepared (the kubelet unprepares it once the pod is done) while the test looks
"""


def probe_pod(name: str, template: str) -> str:
    return f"""
apiVersion: v1
kind: Pod
metadata:
  name: {name}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  resourceClaims:
  - name: gpus
    resourceClaimTemplateName: {template}
  containers:
  - name: c0
    image: {TOPODRA_IMAGE}
    imagePullPolicy: Never
    command: {json.dumps(["python3", "-c", PROBE])}
    resources:
      claims: [{{name: gpus}}]
"""


def run_probe(kind: Kind, ns: str, name: str, template: str) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(pod, what the probe printed, injected() of its environment) of a running probe pod, its claim prepared."""
    kind.apply(ns, probe_pod(name, template))
    pod = kind.wait_pod_phase(ns, name, ("Running",), timeout=240)

    def printed() -> str | None:
        log = kind.k("logs", "-n", ns, name).stdout
        return log if any(line.startswith("PROBE ") for line in log.splitlines()) else None
    log = wait_until(f"{name}'s probe output", printed, timeout=120)
    lines = [line for line in log.splitlines() if line.startswith("PROBE ")]
    assert len(lines) == 1, log
    return pod, json.loads(lines[0].removeprefix("PROBE ")), injected(log)


def version(v: str) -> str:
    """A driver version as the slices publish it (semver: no leading zeros, 535.161.08 -> 535.161.8)."""
    return ".".join(str(int(x)) for x in v.split("."))


def standin_config(kind: Kind, node: str) -> Any:
    return json.loads((kind.tree(node) / LIBDIR / "nvml-standin.json").read_text())


def plugin_nodes(kind: Kind) -> dict[str, str]:
    """profile -> node, for the nodes that have a driver tree."""
    nodes = kind.nodes_by_profile()
    for node in nodes.values():
        assert (kind.tree(node) / LIBDIR / "libnvidia-ml.so.1").exists(), f"no driver tree for {node}"
    return nodes


@pytest.mark.smoke
def test_plugin_runs_on_nvml_and_publishes_the_trees_gpus(kind: Kind) -> None:
    """Every plugin pod is Ready on hardware nvml, and its node's slices carry exactly the GPUs the stand-in's
    NVML answers (UUIDs and driver version from the tree's config: nothing else knows them)."""
    for profile, node in plugin_nodes(kind).items():
        pod = wait_until(f"a Ready plugin pod on {node}", partial(_ready, kind, node), timeout=180)
        (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "plugin"]
        env = {e["name"]: e.get("value") for e in c.get("env") or []}
        assert env["TOPODRA_HARDWARE"] == "nvml" and env["TOPODRA_NVIDIA_DRIVER_ROOT"] == "/driver-root", env
        assert not [k for k in env if k.startswith("LD_")], env
        cfg = standin_config(kind, node)
        slices = kind.get("resourceslices", "--field-selector", f"spec.driver={DRIVER},spec.nodeName={node}")
        gpus = [d for s in slices["items"] for d in s["spec"].get("devices") or []
                if (d.get("attributes") or {}).get("type", {}).get("string") in ("gpu", "gpu-mig-parent")]
        assert {d["attributes"]["uuid"]["string"] for d in gpus} == {g["uuid"] for g in cfg["gpus"]}, profile
        assert {d["attributes"]["driverVersion"]["version"] for d in gpus} == {version(cfg["driverVersion"])}, profile
        logs = kind.k("logs", "-n", PLUGIN_NS, pod["metadata"]["name"], "-c", "plugin").stdout
        # hostdriver's start line ("host driver <version>: N device nodes under ..., M libraries from ...").
        assert re.search(r"topodra\.hostdriver: host driver \S+: \d+ device nodes", logs), logs[-3000:]


def _ready(kind: Kind, node: str) -> Any:
    pod = kind.plugin_pod_on(node)
    if pod is None:
        return None
    ready = {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}.get("Ready")
    return pod if ready == "True" else None


@pytest.mark.smoke
def test_two_gpu_pod_sees_only_its_gpus_the_control_nodes_and_the_trees_libcuda(kind: Kind, ns: str) -> None:
    """A 2-GPU claim: the container has its two /dev/nvidiaN (by the allocated GPUs' minors), /dev/nvidiactl and
    /dev/nvidia-uvm; libcuda.so.1 is the tree's stub, and its cuDeviceGetCount is 2."""
    kind.apply(ns, gpu_template("two", 2))
    pod, got, env = run_probe(kind, ns, "cuda2", "two")
    node = pod["spec"]["nodeName"]
    tree = kind.tree(node)
    by_uuid = {g["uuid"]: g["minor"] for g in standin_config(kind, node)["gpus"]}
    uuids = env["nvidia"].split(",")
    assert len(uuids) == 2 and set(uuids) <= set(by_uuid), (env, sorted(by_uuid))
    minors = sorted(by_uuid[u] for u in uuids)
    gpu_nodes = {p: n for p, n in got["dev"].items() if p.removeprefix("/dev/nvidia").isdigit()}
    assert gpu_nodes == {f"/dev/nvidia{m}": {"char": True, "major": 195, "minor": m} for m in minors}, got["dev"]
    for ctl in ("nvidiactl", "nvidia-uvm"):
        st = os.stat(tree / "dev" / ctl)
        assert got["dev"].get(f"/dev/{ctl}") == {"char": True, "major": os.major(st.st_rdev),
                                                 "minor": os.minor(st.st_rdev)}, got["dev"]
    assert not got["caps"], got["caps"]
    # The stub from the tree, found by soname with no LD_LIBRARY_PATH, sees exactly the two GPUs.
    assert got["init"] == 0 and got["rc"] == 0 and got["count"] == 2, got
    assert got["minors"] == minors, got
    (loaded,) = got["loaded"]
    assert loaded.startswith(f"/{LIBDIR}/libcuda.so."), loaded
    tree_lib = tree / LIBDIR / "libcuda.so.1"
    assert got["sha256"] == hashlib.sha256(tree_lib.resolve().read_bytes()).hexdigest()


def test_mig_pod_gets_its_caps_nodes_by_number_though_the_node_lacks_them(kind: Kind, ns: str) -> None:
    """A 1g MIG claim on the MIG-mode worker: the plugin creates the instance through the stand-in, and the
    container gets its capability nodes as char devices with the tree's nvidia-caps major and the minors of the
    capability files, while the node itself has no /dev/nvidia-caps/nvidia-capN."""
    nodes = plugin_nodes(kind)
    assert "dgx-h100-mig" in nodes, nodes
    node = nodes["dgx-h100-mig"]
    tree = kind.tree(node)
    kind.apply(ns, gpu_template("mig", 1, device_class="gpu-mig-1g"))
    pod, got, env = run_probe(kind, ns, "mig1", "mig")
    assert pod["spec"]["nodeName"] == node
    assert env["nvidia"].startswith("MIG-"), env
    caps_major = next(int(line.split()[0]) for line in (tree / "proc/devices").read_text().splitlines()
                      if line.strip().endswith(" nvidia-caps"))
    # The capability files the stand-in wrote for the one instance (GI and CI access), as the driver does.
    files = sorted((tree / "proc/driver/nvidia/capabilities").glob("gpu*/mig/gi*/**/access"))
    want = {int(line.split(":")[1]) for f in files for line in f.read_text().splitlines()
            if line.startswith("DeviceFileMinor:")}
    assert len(want) == 2, files
    assert got["caps"] == {f"/dev/nvidia-caps/nvidia-cap{m}": {"char": True, "major": caps_major, "minor": m}
                           for m in want}, got["caps"]
    for m in want:
        assert kind.node_exec(node, "test", "-e", f"/dev/nvidia-caps/nvidia-cap{m}", check=False).returncode != 0
