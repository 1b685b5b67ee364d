"""The topodra demo: mock GPUs on a real local Kubernetes node, then fallback across GPU types.

1. Starts the real cluster (etcd, apiserver, controller-manager, scheduler,
   containerd, kubelet) unless one is running, runs ``topodra kubelet-plugin``
   on the node with the dgx-h100 mock profile, installs the DeviceClasses.
2. Runs example pods on the real node and prints which GPUs each one got, as
   the container itself saw them (CDI-injected environment).
3. Adds a simulated heterogeneous cluster (H200, H100, A100, H100 NVL nodes),
   starts the ClaimProfile controller and shows 8-GPU claims falling back
   H200 -> H100 -> A100 as the scheduler fills the cluster.

Everything stays up afterwards for exploring (the last line prints the
KUBECONFIG export); ``make demo-down`` (hack/cluster down) stops it all.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from testkit import cluster as localcluster
from testkit.pluginproc import CDI_ROOT, PLUGIN_DIR, REGISTRY_DIR

from topodra.apipaths import (
    claim_path,
    namespace_path,
    pod_path,
    profile_path,
    service_account_path,
    slices_path,
    template_path,
)
from topodra.kube import Kube, KubeError

HACK = Path(__file__).resolve().parent
REPO = HACK.parent

NS = "topodra-demo"


def say(msg: str) -> None:
    print(f"\n==> {msg}", flush=True)


def wait(fn: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.5)
    raise SystemExit(f"demo: timed out after {timeout:.0f}s waiting for {what}")


def kubectl(lc: localcluster.Cluster, *args: str, stdin: str | None = None) -> str:
    bins = Path(lc.meta()["bin_dir"])
    r = subprocess.run([str(bins / "kubectl"), f"--kubeconfig={lc.admin_kubeconfig}", *args],
                       input=stdin, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"demo: kubectl {' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout


def ensure_cluster() -> localcluster.Cluster:
    lc = localcluster.Cluster()
    running = lc.running()
    if running.get("kubelet") and running.get("kube-apiserver"):
        say(f"reusing the running cluster in {lc.state_dir}")
    else:
        say("starting the real local cluster with one kubelet node (binaries are built once and cached)")
        lc.up(node=True, owner=localcluster.DEMO_OWNER)
    return lc


def ensure_process(lc: localcluster.Cluster, name: str, argv: list[str]) -> None:
    if name in lc.running():
        return
    lc.start_process(name, argv)


def run_logged(lc: localcluster.Cluster, name: str, argv: list[str]) -> None:
    """Run a one-shot component with its log in the cluster's log dir: the terminal keeps the story."""
    lc.logs.mkdir(parents=True, exist_ok=True)
    path = lc.logs / f"{name}.log"
    with path.open("ab") as logf:
        r = subprocess.run(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False)
    if r.returncode != 0:
        raise SystemExit(f"demo: {name} failed ({r.returncode}); last lines of {path}:\n"
                         f"{localcluster.tail(path)}")


def pod_claim_devices(kube: Kube, ns: str, pod: str) -> tuple[list[str], str]:
    """(allocated 'request: pool/device' strings, pool) once the pod's claim is allocated."""
    def get() -> tuple[list[str], str] | None:
        p = kube.get(pod_path(ns, pod)) or {}
        st = (p.get("status") or {}).get("resourceClaimStatuses") or []
        if not st:
            return None
        c = kube.get(claim_path(ns, st[0]["resourceClaimName"])) or {}
        res = ((c.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results")
        if not res:
            return None
        return [f"{r['request']}: {r['device']}" for r in res], res[0]["pool"]
    out: tuple[list[str], str] = wait(get, 60, f"allocation of {pod}'s claim")
    return out


def main() -> int:
    lc = ensure_cluster()
    kube = Kube.from_kubeconfig(str(lc.admin_kubeconfig))
    py = sys.executable

    say("running topodra kubelet-plugin on node topodra-node with 8 mock H100 GPUs + 8 rail NICs (dgx-h100)")
    ensure_process(lc, "topodra-plugin", [
        py, "-m", "topodra.cli", "kubelet-plugin", f"--node-name={lc.node_name}", "--hardware=mock:dgx-h100",
        f"--kubeconfig={lc.admin_kubeconfig}", f"--cdi-root={CDI_ROOT}", f"--plugin-dir={PLUGIN_DIR}",
        f"--registry-dir={REGISTRY_DIR}"])
    wait(lambda: list(kube.list(slices_path(), field_selector=f"spec.nodeName={lc.node_name}")), 60,
         "the plugin's ResourceSlice")
    kubectl(lc, "apply", "-f", str(REPO / "deviceclasses"))
    kubectl(lc, "apply", "-f", str(REPO / "deploy/crds"))
    if kube.get(namespace_path(NS)) is None:
        kube.create(namespace_path(), {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    wait(lambda: kube.get(service_account_path(NS, "default")), 30, "default ServiceAccount")

    say("part 1: pods on the real node; each container prints what CDI injected")
    for name in ("gpu-2-basic", "gpu-8-nvlink", "gpu-1-rail-nic"):
        text = (REPO / "deploy/examples" / f"{name}.yaml").read_text()
        # Keep these on the real node; the simulated nodes of part 2 cannot run containers.
        text = text.replace("  restartPolicy: Never\n",
                            f"  restartPolicy: Never\n  nodeSelector: {{kubernetes.io/hostname: {lc.node_name}}}\n")
        kubectl(lc, "delete", "pod", name, "-n", NS, "--ignore-not-found", "--wait=true")
        kubectl(lc, "apply", "-n", NS, "-f", "-", stdin=text)
        devices, _ = pod_claim_devices(kube, NS, name)
        wait(lambda n=name: (kube.get(pod_path(NS, n)) or {}).get("status", {})
             .get("phase") in ("Succeeded", "Failed"), 120, f"pod {name}")
        env = dict(line.split("=", 1) for line in kubectl(lc, "logs", "-n", NS, name).splitlines() if "=" in line)
        print(f"  pod {name:16s} allocated {', '.join(devices)}")
        print(f"      TOPODRA_VISIBLE_DEVICES={env.get('TOPODRA_VISIBLE_DEVICES', '?')}")
        print(f"      TOPODRA_VISIBLE_UUIDS={env.get('TOPODRA_VISIBLE_UUIDS', '?')}")
        print(f"      NVIDIA_VISIBLE_DEVICES={env.get('NVIDIA_VISIBLE_DEVICES', '?')}")
        kubectl(lc, "delete", "pod", name, "-n", NS, "--wait=true")

    say("part 2: a simulated heterogeneous cluster (2x DGX H200, 2x DGX H100, 2x DGX A100 80GB, 2x H100 NVL)")
    run_logged(lc, "topodra-simulate-once", [py, "-m", "topodra.cli", "simulate",
                                              str(REPO / "hack/clusters/mixed-8.yaml"),
                                              f"--kubeconfig={lc.admin_kubeconfig}", "--once"])
    print(f"  8 simulated nodes published their ResourceSlices (log: {lc.logs / 'topodra-simulate-once.log'})")
    ensure_process(lc, "topodra-simulate", [py, "-m", "topodra.cli", "simulate",
                                            str(REPO / "hack/clusters/mixed-8.yaml"),
                                            f"--kubeconfig={lc.admin_kubeconfig}"])
    ensure_process(lc, "topodra-controller", [py, "-m", "topodra.cli", "controller",
                                              f"--kubeconfig={lc.admin_kubeconfig}", "--no-leader-elect",
                                              "--refresh-interval=5"])
    # Keep part 2 off the real node so the fallback order is easy to read.
    kubectl(lc, "taint", "node", lc.node_name, "topodra.io/demo=part1:NoSchedule", "--overwrite")
    profile = {"apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile", "metadata": {"name": "train-8"},
               "spec": {"alternatives": [{"deviceClassName": "gpu-h200", "count": 8},
                                         {"deviceClassName": "gpu-h100", "count": 8},
                                         {"deviceClassName": "gpu-a100-80gb", "count": 8}],
                        "topology": {"nvlink": "Required"}}}
    kubectl(lc, "apply", "-n", NS, "-f", "-", stdin=json.dumps(profile))
    wait(lambda: kube.get(template_path(NS, "train-8")), 60,
         "the controller to render ResourceClaimTemplate train-8")
    print("  ClaimProfile train-8: 8 GPUs on one NVLink domain; H200, else H100, else A100-80GB")
    for k in range(7):
        name = f"train-{k}"
        try:
            kube.create(pod_path(NS), {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                "spec": {"hostNetwork": True, "restartPolicy": "Never",
                         "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "train-8"}],
                         "containers": [{"name": "main", "image": "localhost/busybox:1.35",
                                         "imagePullPolicy": "Never", "command": ["true"],
                                         "resources": {"claims": [{"name": "gpus"}]}}]}})
        except KubeError as e:
            if not e.conflict:
                raise
        if k < 6:
            devices, pool = pod_claim_devices(kube, NS, name)
            sub = devices[0].split(":")[0]
            print(f"  pod {name}: subrequest {sub:18s} on {pool:14s} ({len(devices)} GPUs)")
        else:
            time.sleep(5)
            p = kube.get(pod_path(NS, name)) or {}
            conds = p.get("status", {}).get("conditions", [])
            cond: dict[str, Any] = next((c for c in conds if c["type"] == "PodScheduled"), {})
            print(f"  pod {name}: {p.get('status', {}).get('phase')} - {cond.get('message', '')[:160]}")
    time.sleep(6)
    prof = kube.get(profile_path(NS, "train-8")) or {}
    for alt in (prof.get("status") or {}).get("alternatives", []):
        print(f"  status {alt.get('name'):10s} total={alt.get('devicesTotal')} free={alt.get('devicesFree')} "
              f"nodesFit={alt.get('nodesFit')}")
    say("done; explore with:")
    print(f"export KUBECONFIG={lc.admin_kubeconfig}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
