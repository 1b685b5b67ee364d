"""The nvidia-cdi-hook hooks of topodra's claim spec run in a real container (issue 19, finding 2's rest).

Real kubelet + containerd + runc; the plugin (``--hardware nvml``) against a driver tree from hack/driver-tree,
with ``--nvidia-cdi-hook-path`` at the real nvidia-cdi-hook v1.20.2 that hack/build-bins built.  runc runs the
hooks on the host, in the container's mount namespace, so their effects are visible inside the busybox container:

- create-symlinks: ``libcuda.so -> libcuda.so.1 -> libcuda.so.<version>`` and ``libnvidia-ml.so.1`` are
  symlinks the spec does not mount, and the stub libcuda loads through the ``libcuda.so`` link and counts the
  pod's two GPUs;
- update-ldcache (the host's static ldconfig, run in the container's root): ``/etc/ld.so.conf.d/00-nvcr-*.conf``
  names the tree's library directory and the container's ``/etc/ld.so.cache`` lists ``libcuda.so.1`` there;
- enable-cuda-compat: a CUDA forward-compat ``libcuda.so.999.0.0`` in ``/usr/local/cuda/compat`` (newer than the
  tree's 580 driver) gets an ``00-compat-*.conf`` entry, so the loader's cache lists it too;
- update-application-profile: ``EGLVisibleDGPUDevices`` is the mask of the pod's two GPU minors.

Not visible here: disable-device-node-modification is a no-op on a host without ``/proc/driver/nvidia/params``
(this one has no NVIDIA kernel module), and apply-cuda-memory-limits is a no-op unless the container sets
``NVIDIA_GPU_MEMORY_REQUEST``/``_LIMIT`` (its NVML calls are not in the stand-in).  Both ran: a failing hook
fails the container, and the pod ran.

busybox has no dynamic loader and no ldconfig, so the probe and ``ldconfig -p`` come from the host in a hostPath
directory (``/probe``): the host's ``ld.so``, ``libc.so.6`` and its static ``/sbin/ldconfig``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_cdi_host_driver_node import PROBE, build_probe
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO
from testkit.pluginproc import CDI_ROOT, DRIVER, PluginProcess
from testkit.standin import LIBDIR, driver_tree

from topodra.apipaths import claim_path
from topodra.hardware.mockprofile import build_tree, load_profile

pytestmark = pytest.mark.node
R = "/apis/resource.k8s.io/v1"
PROFILE = "dgx-h100"
COMPAT = "libcuda.so.999.0.0"
# The other node test's probe, loading the library named by argv[1] instead of libcuda.so.1.
PROBE_ARGV = PROBE.replace("int main(void) {", "int main(int argc, char **argv) {").replace(
    'dlopen("libcuda.so.1", RTLD_NOW)', 'dlopen(argc > 1 ? argv[1] : "libcuda.so.1", RTLD_NOW)')


def hook_binary() -> Path:
    out = subprocess.run([str(REPO / "hack/build-bins"), "--print"], capture_output=True, text=True, check=True)
    hook = Path(out.stdout.strip()) / "nvidia-cdi-hook"
    assert hook.is_file(), f"{hook} missing: run hack/build-bins"
    return hook


@pytest.fixture(scope="module")
def rig(node_cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, Path]]:
    base = tmp_path_factory.mktemp("cdi-hooks")
    assert "argv[1]" in PROBE_ARGV, "the probe source changed: adapt PROBE_ARGV"
    probe = build_probe(base / "probe", PROBE_ARGV)
    shutil.copy2("/sbin/ldconfig", probe / "ldconfig")  # static: runs in busybox
    tree = driver_tree(base / "root", PROFILE, node=node_cluster.node_name, dev_nodes=True)
    compat = base / "compat"  # what a CUDA image's cuda-compat package installs, newer than the tree's driver
    compat.mkdir()
    shutil.copy2(os.path.realpath(tree / LIBDIR / "libcuda.so.1"), compat / COMPAT)
    os.symlink(COMPAT, compat / "libcuda.so.1")
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
                      node_cluster.lc.logs / "topodra-plugin-cdi-hooks.log", hardware="nvml",
                      extra_env={"TOPODRA_BOOT_ID_FILE": str(boot), "TOPODRA_HARDWARE_CONFIG": str(hw),
                                 "TOPODRA_SYSFS_ROOT": str(sysfs), "TOPODRA_NVIDIA_DRIVER_ROOT": str(tree),
                                 "TOPODRA_NVIDIA_PROC_ROOT": str(tree / "proc"),
                                 "TOPODRA_NVIDIA_CDI_HOOK_PATH": str(hook_binary())})
    p.start()
    try:
        yield tree, probe, compat
    finally:
        p.stop()


def test_the_hooks_effects_are_visible_in_the_container(node_cluster: ClusterHandle,
                                                        rig: tuple[Path, Path, Path]) -> None:
    nc = node_cluster
    tree, probe, compat = rig
    ns = nc.namespace("cdihooks")
    nc.kube.create(f"{R}/namespaces/{ns}/resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "two"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": 2}}]}}})
    lib = f"/{LIBDIR}"
    script = (f"for l in libcuda.so libcuda.so.1 libnvidia-ml.so.1; do echo LINK_$l=$(readlink {lib}/$l); done; "
              "echo NVCR=$(cat /etc/ld.so.conf.d/00-nvcr-*.conf); "
              "echo COMPATCONF=$(cat /etc/ld.so.conf.d/00-compat-*.conf); "
              "/probe/ldconfig -p | sed 's/^/CACHE /'; "
              "echo PROFILE=$(cat /etc/nvidia/nvidia-application-profiles-rc.d/10-container.conf); "
              f"/probe/ld-linux-x86-64.so.2 --library-path /probe /probe/probe {lib}/libcuda.so; echo PROBE_DONE; "
              "sleep 300")
    nc.kube.create(f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
        "spec": {"hostNetwork": True, "restartPolicy": "Never", "automountServiceAccountToken": False,
                 "terminationGracePeriodSeconds": 1, "resourceClaims": [{"name": "gpus", "resourceClaimName": "two"}],
                 "volumes": [{"name": "probe", "hostPath": {"path": str(probe), "type": "Directory"}},
                             {"name": "compat", "hostPath": {"path": str(compat), "type": "Directory"}}],
                 "containers": [{"name": "c", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                                 "command": ["sh", "-c", script], "resources": {"claims": [{"name": "gpus"}]},
                                 "volumeMounts": [{"name": "probe", "mountPath": "/probe", "readOnly": True},
                                                  {"name": "compat", "mountPath": "/usr/local/cuda/compat"}]}]}})

    def probed() -> str | None:
        pod = nc.kube.get(f"/api/v1/namespaces/{ns}/pods/p") or {}
        if (pod.get("status") or {}).get("phase") == "Failed":
            raise AssertionError(f"pod failed: {nc.kubectl('logs', '-n', ns, 'p', check=False)}\n"
                                 f"{nc.kubectl('describe', 'pod', '-n', ns, 'p', check=False)}")
        log = nc.kubectl("logs", "-n", ns, "p", check=False)
        return log if "PROBE_DONE" in log else None

    out = wait_for(probed, 120, "the probe's output")
    (spec_file,) = CDI_ROOT.glob("k8s.gpu.topodra.io-claim_*.json")
    top = json.loads(spec_file.read_text())["containerEdits"]
    assert [h["args"][1] for h in top["hooks"]] == [
        "create-symlinks", "enable-cuda-compat", "update-ldcache", "disable-device-node-modification",
        "update-application-profile"]
    mounted = {m["containerPath"] for m in top["mounts"]}
    assert f"{lib}/libcuda.so.1" not in mounted and f"{lib}/libnvidia-ml.so.1" not in mounted  # the hook's links
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line and not line.startswith("CACHE "))
    version = os.path.realpath(tree / LIBDIR / "libcuda.so.1").rsplit("libcuda.so.", 1)[1]
    # create-symlinks
    assert env["LINK_libcuda.so"] == "libcuda.so.1", out
    assert env["LINK_libcuda.so.1"] == f"libcuda.so.{version}", out
    assert env["LINK_libnvidia-ml.so.1"] == f"libnvidia-ml.so.{version}", out
    assert env["CUDA_LIB"] == f"{lib}/libcuda.so", out  # loaded through the link the hook made
    assert (env["CUDA_INIT"], env["CUDA_COUNT"]) == ("0", "2"), out
    # update-ldcache and enable-cuda-compat
    assert env["NVCR"].split() == [lib], out
    assert env["COMPATCONF"].split() == ["/usr/local/cuda/compat"], out
    cache = [ln for ln in out.splitlines() if ln.startswith("CACHE ")]
    assert any("libcuda.so.1 " in ln and ln.endswith(f"=> {lib}/libcuda.so.1") for ln in cache), out
    assert any("libnvidia-ml.so.1 " in ln and ln.endswith(f"=> {lib}/libnvidia-ml.so.1") for ln in cache), out
    assert any(ln.endswith("=> /usr/local/cuda/compat/libcuda.so.1") for ln in cache), out
    # update-application-profile: the pod's GPUs by minor
    claim = nc.kube.get(claim_path(ns, "two")) or {}
    minors = sorted(int(r["device"].removeprefix("gpu-")) for r in claim["status"]["allocation"]["devices"]["results"])
    mask = sum(1 << m for m in minors)
    assert f'"EGLVisibleDGPUDevices",0x{mask:x}]' in env["PROFILE"], out
    nc.kube.delete(f"/api/v1/namespaces/{ns}/pods/p")
    wait_for(lambda: nc.kube.get(f"/api/v1/namespaces/{ns}/pods/p") is None, 60, "pod p gone")
