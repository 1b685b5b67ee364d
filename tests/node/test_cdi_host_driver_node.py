"""A real pod on the real kubelet + containerd gets the driver from topodra's CDI spec (issue 19 findings 2, 9).

The plugin runs with ``--hardware nvml`` against a driver tree from hack/driver-tree (the C NVML stand-in,
the stub ``libcuda.so.1``, char nodes with NVIDIA's numbers) and no NVIDIA toolkit spec.  A 2-GPU pod must
see exactly its two ``/dev/nvidiaN`` plus the control nodes, and the stub libcuda, loaded by soname from the
path the spec mounts it at, must count 2 devices: the ones the scheduler allocated.

The busybox image has no dynamic loader, so the probe (a tiny C program that dlopens ``libcuda.so.1``) comes
with the host's ``ld.so`` and ``libc.so.6`` in a hostPath directory; ``libcuda.so.1`` itself comes only
from the spec's mounts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO
from testkit.pluginproc import CDI_ROOT, DRIVER, PluginProcess
from testkit.standin import LIBDIR, driver_tree

from topodra.apipaths import claim_path
from topodra.hardware.mockprofile import build_tree, load_profile

pytestmark = pytest.mark.node
R = "/apis/resource.k8s.io/v1"
PROFILE = "dgx-h100"

PROBE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
int main(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { printf("DLOPEN-FAILED %s\n", dlerror()); return 1; }
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(h, "cuInit");
    int (*count)(int *) = (int (*)(int *))dlsym(h, "cuDeviceGetCount");
    int (*minor)(int, int *) = (int (*)(int, int *))dlsym(h, "topodraStandinDeviceMinor");
    Dl_info info;
    dladdr((void *)init, &info);
    int n = -1, rc = init(0);
    count(&n);
    printf("CUDA_LIB=%s\nCUDA_INIT=%d\nCUDA_COUNT=%d\nCUDA_MINORS=", info.dli_fname, rc, n);
    for (int i = 0; i < n; i++) { int m = -1; minor(i, &m); printf("%s%d", i ? "," : "", m); }
    printf("\n");
    return 0;
}
"""


def build_probe(out: Path, source: str = PROBE) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.c").write_text(source)
    subprocess.run(["gcc", "-O1", "-o", str(out / "probe"), str(out / "probe.c")], check=True, timeout=120)
    for lib in ("/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/libc.so.6"):
        shutil.copy2(os.path.realpath(lib), out / Path(lib).name)
    return out


@pytest.fixture(scope="module")
def rig(node_cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    base = tmp_path_factory.mktemp("cdi-host")
    probe = build_probe(base / "probe")
    tree = driver_tree(base / "root", PROFILE, node=node_cluster.node_name, dev_nodes=True)
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
                      node_cluster.lc.logs / "topodra-plugin-cdi-host.log", hardware="nvml",
                      extra_env={"TOPODRA_BOOT_ID_FILE": str(boot), "TOPODRA_HARDWARE_CONFIG": str(hw),
                                 "TOPODRA_SYSFS_ROOT": str(sysfs), "TOPODRA_NVIDIA_DRIVER_ROOT": str(tree),
                                 "TOPODRA_NVIDIA_PROC_ROOT": str(tree / "proc")})
    p.start()
    try:
        yield tree, probe
    finally:
        p.stop()


def test_two_gpu_pod_sees_its_gpus_the_control_nodes_and_libcuda(node_cluster: ClusterHandle,
                                                                 rig: tuple[Path, Path]) -> None:
    nc = node_cluster
    tree, probe = rig
    ns = nc.namespace("cdihost")
    nc.kube.create(f"{R}/namespaces/{ns}/resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "two"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": 2}}]}}})
    script = ("env; for n in /dev/nvidia*; do echo NODE=$n:$(stat -c '%t:%T' $n); done; "
              "/probe/ld-linux-x86-64.so.2 --library-path /probe /probe/probe; echo PROBE_DONE; sleep 300")
    nc.kube.create(f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
        "spec": {"hostNetwork": True, "restartPolicy": "Never", "automountServiceAccountToken": False,
                 "terminationGracePeriodSeconds": 1, "resourceClaims": [{"name": "gpus", "resourceClaimName": "two"}],
                 "volumes": [{"name": "probe", "hostPath": {"path": str(probe), "type": "Directory"}}],
                 "containers": [{"name": "c", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                                 "command": ["sh", "-c", script], "resources": {"claims": [{"name": "gpus"}]},
                                 "volumeMounts": [{"name": "probe", "mountPath": "/probe", "readOnly": True}]}]}})

    def probed() -> str | None:  # the claim stays allocated while the pod runs
        pod = nc.kube.get(f"/api/v1/namespaces/{ns}/pods/p") or {}
        if (pod.get("status") or {}).get("phase") == "Failed":
            raise AssertionError(f"pod failed: {nc.kubectl('logs', '-n', ns, 'p', check=False)}\n"
                                 f"{nc.kubectl('describe', 'pod', '-n', ns, 'p', check=False)}")
        log = nc.kubectl("logs", "-n", ns, "p", check=False)
        return log if "PROBE_DONE" in log else None

    out = wait_for(probed, 120, "the probe's output")
    claim = nc.kube.get(claim_path(ns, "two")) or {}
    gpus = sorted(r["device"] for r in claim["status"]["allocation"]["devices"]["results"])
    minors = sorted(int(g.removeprefix("gpu-")) for g in gpus)
    assert len(minors) == 2
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line and not line.startswith("NODE="))
    nodes = {ln.split("=", 1)[1].rsplit(":", 2)[0]: tuple(int(x, 16) for x in ln.rsplit(":", 2)[1:])
             for ln in out.splitlines() if ln.startswith("NODE=")}
    majors = {n: int(m) for m, n in (ln.split() for ln in (tree / "proc/devices").read_text()
                                     .split("Block devices:")[0].splitlines()[1:] if ln.strip())}
    uvm = majors["nvidia-uvm"]
    assert nodes == {**{f"/dev/nvidia{m}": (195, m) for m in minors}, "/dev/nvidiactl": (195, 255),
                     "/dev/nvidia-uvm": (uvm, 0), "/dev/nvidia-uvm-tools": (uvm, 1)}, out
    assert env["CUDA_LIB"] == f"/{LIBDIR}/libcuda.so.1", out  # found by soname where the spec mounted it
    assert (env["CUDA_INIT"], env["CUDA_COUNT"]) == ("0", "2"), out
    assert sorted(int(m) for m in env["CUDA_MINORS"].split(",")) == minors, out
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert env["TOPODRA_VISIBLE_DEVICES"].split(",") == gpus
    nc.kube.delete(f"/api/v1/namespaces/{ns}/pods/p")
    wait_for(lambda: nc.kube.get(f"/api/v1/namespaces/{ns}/pods/p") is None, 60, "pod p gone")
