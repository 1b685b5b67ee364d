"""`helm install` on the real local node: the plugin runs as a container in a DaemonSet pod on the real
kubelet, the controller as a pod; example pods get GPUs; then `helm upgrade` to a new image tag while pods
with claims come and go, `helm rollback`, and `helm uninstall`.

The local cluster is loopback-only (no kube-proxy, pods use hostNetwork), so the chart's apiServer.host/port
point the pods at 127.0.0.1:6443 (docs/deploy.md). With hostNetwork the surge pod of an upgrade shares the
node's network namespace with the old one, so the upgrade also moves the plugin's 127.0.0.1 ports.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO

from topodra.apipaths import slices_path, template_path
from topodra.cdi import spec_file_prefix

CHART = REPO / "deploy" / "helm" / "topodra"
NS = "topodra-system"
DRIVER = "gpu.topodra.io"
TAG2 = "0.1.0-upgrade"
LOCAL = ["--set", "plugin.hardware=mock:dgx-h100", "--set", "plugin.hostNetwork=true",
         "--set", "controller.hostNetwork=true", "--set", "apiServer.host=127.0.0.1", "--set", "apiServer.port=6443",
         "--set", "image.pullPolicy=Never", "--set", "controller.replicas=1"]


def helm(nc: ClusterHandle, *args: str, timeout: float = 300) -> str:
    r = subprocess.run([str(nc.bin_dir / "helm"), f"--kubeconfig={nc.kubeconfig}", *args], capture_output=True,
                       text=True, timeout=timeout, check=False)
    assert r.returncode == 0, f"helm {' '.join(args)}: {r.stdout}\n{r.stderr}"
    return r.stdout


def plugin_pods(nc: ClusterHandle) -> list[dict[str, Any]]:
    return list(nc.kube.list(f"/api/v1/namespaces/{NS}/pods",
                             label_selector="app.kubernetes.io/component=kubelet-plugin"))


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions", []))


class LogFollower:
    """`kubectl logs -f` of every plugin pod that appears: the old pod's log is gone once it is deleted."""

    def __init__(self, nc: ClusterHandle, out: Path) -> None:
        self.nc, self.out, self.seen, self.procs = nc, out, set[str](), list[subprocess.Popen[bytes]]()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for p in plugin_pods(self.nc):
                name = p["metadata"]["name"]
                if name not in self.seen and (p.get("status") or {}).get("phase") == "Running":
                    self.seen.add(name)
                    f = (self.out / f"{name}.log").open("wb")
                    self.procs.append(subprocess.Popen(
                        [str(self.nc.bin_dir / "kubectl"), f"--kubeconfig={self.nc.kubeconfig}", "logs", "-f",
                         "-n", NS, name], stdout=f, stderr=subprocess.STDOUT))
            time.sleep(0.3)

    def close(self) -> str:
        self.stop.set()
        self.thread.join()
        time.sleep(1)
        for p in self.procs:
            p.terminate()
            p.wait(10)
        return "".join(f.read_text() for f in sorted(self.out.glob("*.log")))


class Churn:
    """Pods with a one-GPU claim, created and deleted back to back on the node."""

    def __init__(self, nc: ClusterHandle, ns: str) -> None:
        self.nc, self.ns = nc, ns
        self.done: list[tuple[float, float, str]] = []  # (created, finished, phase)
        self.claims: set[str] = set()
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        k = 0
        while not self.stop.is_set():
            name = f"churn-{k}"
            k += 1
            t0 = time.monotonic()
            try:
                self.nc.kube.create(f"/api/v1/namespaces/{self.ns}/pods", {
                    "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                    "spec": {"hostNetwork": True, "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                             "nodeSelector": {"kubernetes.io/hostname": self.nc.node_name},
                             "resourceClaims": [{"name": "g", "resourceClaimTemplateName": "one"}],
                             "containers": [{"name": "c", "image": "localhost/busybox:1.35",
                                             "imagePullPolicy": "Never", "command": ["true"],
                                             "resources": {"claims": [{"name": "g"}]}}]}})
                pod = wait_for(functools.partial(self._finished, name), 120, f"churn pod {name}")
                for st in pod["status"].get("resourceClaimStatuses") or []:
                    self.claims.add(st["resourceClaimName"])
                self.done.append((t0, time.monotonic(), pod["status"]["phase"]))
                self.nc.kube.request("DELETE", f"/api/v1/namespaces/{self.ns}/pods/{name}", {"gracePeriodSeconds": 0})
            except Exception as e:  # recorded, the test fails on it
                self.errors.append(f"{name}: {e}")

    def _finished(self, name: str) -> dict[str, Any] | None:
        p = self.nc.kube.get(f"/api/v1/namespaces/{self.ns}/pods/{name}")
        return p if p and p.get("status", {}).get("phase") in ("Succeeded", "Failed") else None

    def __enter__(self) -> Churn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(180)


@pytest.mark.node
def test_helm_install_upgrade_rollback_uninstall_on_the_real_node(node_cluster: ClusterHandle,
                                                                  tmp_path: Path) -> None:
    nc = node_cluster
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    r = subprocess.run([str(REPO / "hack/build-image"), "--import", str(nc.lc.containerd_sock)],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "CTR": str(nc.bin_dir / "ctr")},
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    timings["build+import image"] = time.monotonic() - t0
    ctr = [str(nc.bin_dir / "ctr"), "--address", str(nc.lc.containerd_sock), "-n", "k8s.io"]
    subprocess.run([*ctr, "images", "tag", "--force", "localhost/topodra:0.1.0", f"localhost/topodra:{TAG2}"],
                   check=True, capture_output=True)
    nc.kubectl("label", "node", nc.node_name, "topodra.io/kubelet-plugin=true", "--overwrite")
    # Earlier plugins of the session may have labelled the node: the pod below must do it again.
    nc.kube.merge_patch(f"/api/v1/nodes/{nc.node_name}", {"metadata": {"labels": {"topodra.io/gpu-count": None}}})
    ns = nc.namespace("helm-node")
    cdi_before = set(Path("/var/run/cdi").glob(f"{spec_file_prefix(DRIVER)}*"))
    follower = LogFollower(nc, tmp_path)
    try:
        t0 = time.monotonic()
        # Other tests of the session applied deviceclasses/ with kubectl; a user's first install may meet
        # the same (docs/deploy.md), so the release adopts them.
        helm(nc, "install", "topodra", str(CHART), "-n", NS, "--create-namespace", *LOCAL, "--wait",
             "--timeout=240s", "--take-ownership")
        timings["helm install --wait"] = time.monotonic() - t0
        (pod,) = plugin_pods(nc)
        assert pod["spec"]["nodeName"] == nc.node_name and ready(pod)
        wait_for(lambda: sum(len(s["spec"]["devices"]) for s in nc.kube.list(
            slices_path(), field_selector=f"spec.driver={DRIVER},spec.nodeName={nc.node_name}")) == 16, 60,
            "16 devices published by the plugin pod")
        # The plugin pod labels its own Node through RBAC + the own-node-labels admission policy (pod-bound token).
        wait_for(lambda: ((nc.kube.get(f"/api/v1/nodes/{nc.node_name}") or {}).get("metadata", {}).get("labels", {})
                          .get("topodra.io/gpu-count") == "8"), 60, "the plugin pod to label its Node")
        # An example pod gets two GPUs from the plugin running in its pod.
        pin = f"  nodeSelector: {{kubernetes.io/hostname: {nc.node_name}}}\n"
        text = (REPO / "deploy/examples/gpu-2-basic.yaml").read_text().replace(
            "  restartPolicy: Never\n", "  restartPolicy: Never\n" + pin)
        nc.kubectl("apply", "-n", ns, "-f", "-", input=text)
        wait_for(lambda: (nc.kube.get(f"/api/v1/namespaces/{ns}/pods/gpu-2-basic") or {}).get("status", {})
                 .get("phase") == "Succeeded", 120, "gpu-2-basic to run")
        env = nc.kubectl("logs", "-n", ns, "gpu-2-basic")
        visible = next(x for x in env.splitlines() if x.startswith("TOPODRA_VISIBLE_DEVICES="))
        assert len(visible.split("=", 1)[1].split(",")) == 2, env
        print(f"\ngpu-2-basic got {visible}")
        # The controller pod renders a ClaimProfile.
        nc.kube.create(f"/apis/topodra.io/v1alpha1/namespaces/{ns}/claimprofiles", {
            "apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile", "metadata": {"name": "train"},
            "spec": {"alternatives": [{"deviceClassName": "gpu-h100", "count": 2}]}})
        wait_for(lambda: nc.kube.get(template_path(ns, "train")), 90, "the controller pod to render a template")

        # Rolling upgrade under churn.
        nc.kube.create(f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "one"},
            "spec": {"spec": {"devices": {"requests": [{"name": "g", "exactly": {"deviceClassName": DRIVER}}]}}}})
        old_uid = pod["metadata"]["uid"]
        with Churn(nc, ns) as churn:
            wait_for(lambda: len(churn.done) >= 3, 120, "churn to get going")
            t0 = time.monotonic()
            helm(nc, "upgrade", "topodra", str(CHART), "-n", NS, "--reuse-values", "--set", f"image.tag={TAG2}",
                 "--set", "plugin.healthPort=9425", "--set", "plugin.metricsPort=9426", "--wait", "--timeout=240s")
            wait_for(lambda: [p["metadata"]["uid"] for p in plugin_pods(nc)
                              if p["metadata"].get("deletionTimestamp") is None] not in ([], [old_uid])
                     and len(plugin_pods(nc)) == 1, 120, "the old plugin pod to go")
            timings["helm upgrade --wait (plugin handed over)"] = time.monotonic() - t0
            upgraded_at = time.monotonic()
            wait_for(lambda: any(c[0] > upgraded_at for c in churn.done), 120, "a churn pod after the upgrade")
        (new,) = plugin_pods(nc)
        assert new["spec"]["containers"][0]["image"] == f"localhost/topodra:{TAG2}"
        assert not churn.errors, churn.errors
        phases = Counter(p for _, _, p in churn.done)
        assert phases.get("Failed", 0) == 0, churn.done
        # The longest a churn pod took to start during the upgrade: the handover window as users see it.
        during = [end - start for start, end, _ in churn.done]
        timings["churn pods"] = len(churn.done)
        timings["churn pod create->done max s"] = max(during)
        timings["churn pod create->done median s"] = sorted(during)[len(during) // 2]
        events = nc.kube.list(f"/api/v1/namespaces/{ns}/events")
        failed = [e for e in events if "Prepare" in e.get("reason", "") and e.get("type") == "Warning"]
        assert not failed, [e.get("message") for e in failed]

        t0 = time.monotonic()
        helm(nc, "rollback", "topodra", "1", "-n", NS, "--wait", "--timeout=240s")
        wait_for(lambda: [p["spec"]["containers"][0]["image"] for p in plugin_pods(nc)] == ["localhost/topodra:0.1.0"],
                 120, "rollback to the first image")
        timings["helm rollback --wait"] = time.monotonic() - t0
    except BaseException:
        # Leave no plugin pod behind for the rest of the session: it would serve the node's driver socket.
        subprocess.run([str(nc.bin_dir / "helm"), f"--kubeconfig={nc.kubeconfig}", "uninstall", "topodra", "-n", NS,
                        "--wait", "--timeout=120s"], capture_output=True, timeout=180, check=False)
        nc.kubectl("label", "node", nc.node_name, "topodra.io/kubelet-plugin-", check=False)
        raise
    finally:
        logs = follower.close()
        nc.kube.delete(f"/api/v1/namespaces/{ns}")
        wait_for(lambda: nc.kube.get(f"/api/v1/namespaces/{ns}") is None, 120, "test namespace gone")
    # No claim prepared twice across every plugin pod of the run (old, surged, rolled back).
    prepared = Counter(re.findall(r" prepared claim=\S+ uid=(\S+)", logs))
    assert len(prepared) >= len(churn.claims) and max(prepared.values()) == 1, prepared.most_common(3)
    # No CDI spec left behind for any claim once every pod is gone.
    def leaked() -> list[Path]:  # the kubelet unprepares right after the pods are gone from the API
        return sorted(set(Path("/var/run/cdi").glob(f"{spec_file_prefix(DRIVER)}*")) - cdi_before)
    try:
        wait_for(lambda: not leaked(), 60, "every CDI spec of the run to be removed")
    except AssertionError:
        raise AssertionError(f"leaked CDI specs: {leaked()}") from None

    t0 = time.monotonic()
    helm(nc, "uninstall", "topodra", "-n", NS, "--wait", "--timeout=120s")
    timings["helm uninstall --wait"] = time.monotonic() - t0
    left = {k: nc.kubectl("get", k, "-A", "-l", "app.kubernetes.io/part-of=topodra", "-o", "name").split()
            for k in ("daemonsets", "deployments", "clusterroles", "clusterrolebindings", "serviceaccounts",
                      "validatingadmissionpolicies", "deviceclasses", "priorityclasses")}
    assert not any(left.values()), left
    # What docs/deploy.md says stays: the CRD (Helm never deletes crds/), and nothing else of ours.
    assert nc.kube.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/claimprofiles.topodra.io")
    slices = list(nc.kube.list(slices_path(), field_selector=f"spec.driver={DRIVER},spec.nodeName={nc.node_name}"))
    timings["slices left after uninstall"] = len(slices)
    print("\n" + "\n".join(f"  {k}: {v:.1f}" if isinstance(v, float) else f"  {k}: {v}" for k, v in timings.items()))
    nc.kubectl("label", "node", nc.node_name, "topodra.io/kubelet-plugin-")
    nc.apply_yaml(REPO / "deviceclasses")  # uninstall deleted the adopted classes; later tests expect them
    nc.kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=false", check=False)
