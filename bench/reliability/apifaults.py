"""API faults on the real control plane: kube-apiserver stopped, then etcd stopped, during prepare and publishing.

Needs a running ``hack/testkit/cluster.py`` control plane (``lc``; the pytest ``cluster``
fixture or ``bench/run reliability --only apifaults``, which takes the cluster lock).
The real plugin process (``topodra kubelet-plugin``, mock dgx-h100) serves a
kubelet-less node; the real scheduler allocates its claims. A component is
"stopped" with SIGSTOP (connections hang, the hardest case for a client: no
refusal, only timeouts) and resumed with SIGCONT.

First, a claim deleted while the plugin was down must be unprepared by the cleanup pass at
start (``--claim-cleanup-interval``), and another one kept. Then, for each of kube-apiserver and etcd:

* **prepare**: a claim prepared while the component is stopped gets a per-claim
  error within the kubelet's 45 s deadline; after resuming, the kubelet's retries
  succeed; unprepare needs no API and succeeds throughout;
* **publishing**: the plugin is restarted with its slices deleted, and the
  component is stopped while it publishes; after resuming, the node's slices
  must converge (all 16 devices, each once, slice count = the pool's
  ``resourceSliceCount``, one generation) within 30 s, with no duplicate slice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.paths import REPO
from bench.prepare import claims as pb_claims
from bench.prepare.common import DRIVER, NODE, wait_until
from bench.prepare.plugin import BenchPlugin
from bench.reliability.common import Node, violations
from testkit import cluster as localcluster
from testkit.kubeletstub import KubeletStub

from topodra.apipaths import slices_path
from topodra.kube import Kube

HERE = REPO / "bench"

KUBELET_DEADLINE = 45.0
CONVERGE_LIMIT = 30.0
DEVICES = 16  # mock:dgx-h100: 8 GPUs, 8 NICs


class PluginDirs(Node):
    """The bench plugin's directories (``<root>/cdi``, ``<root>/plugin``) seen as a ``Node``."""

    @property
    def state_dir(self) -> Path:
        return self.root / "plugin"


@dataclass
class Stopped:
    """SIGSTOP a control-plane process for the ``with`` block; SIGCONT on exit, whatever happens."""

    lc: localcluster.Cluster
    name: str

    def __enter__(self) -> Stopped:
        self.pid = self.lc.running()[self.name]
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc: object) -> None:
        os.kill(self.pid, signal.SIGCONT)


def slice_state(kube: Kube) -> tuple[bool, str]:
    """(converged, description) of the bench node's ResourceSlices."""
    slices = list(kube.list(slices_path(), field_selector=f"spec.driver={DRIVER},spec.nodeName={NODE}"))
    names = [d["name"] for s in slices for d in s["spec"].get("devices") or []]
    gens = {s["spec"]["pool"]["generation"] for s in slices}
    counts = {s["spec"]["pool"]["resourceSliceCount"] for s in slices}
    ok = (len(names) == DEVICES and len(set(names)) == DEVICES and len(gens) == 1
          and counts == {len(slices)})
    return ok, f"{len(slices)} slices, {len(names)} devices ({len(set(names))} distinct), generations {sorted(gens)}"


def wait_converged(kube: Kube, limit: float) -> tuple[float | None, str]:
    start = time.monotonic()
    what = ""
    while time.monotonic() - start < limit:
        try:
            ok, what = slice_state(kube)
        except Exception as e:  # the apiserver may still be catching up
            ok, what = False, f"list failed: {e}"
        if ok:
            return time.monotonic() - start, what
        time.sleep(0.2)
    return None, what


def run(lc: localcluster.Cluster, pause_s: float = 8.0) -> dict[str, Any]:
    """Both faults, both phases, on ``lc``; returns timings and everything lost."""
    lost: list[str] = []
    done: list[str] = []  # scenarios that ran to their end: the count bench/run reliability reports
    out: dict[str, Any] = {"pause_s": pause_s, "scenarios": done}
    lc.create_fake_nodes([NODE])
    kube = Kube.from_kubeconfig(str(lc.admin_kubeconfig))
    with tempfile.TemporaryDirectory(prefix="topodra-apifault-") as tmp:
        root = Path(tmp)
        subprocess.run([str(Path(lc.meta()["bin_dir"]) / "kubectl"), f"--kubeconfig={lc.admin_kubeconfig}",
                       "apply", "-f", str(HERE.parent / "deviceclasses/gpu.topodra.io.yaml")],
                       check=True, capture_output=True)
        plugin = BenchPlugin(lc.admin_kubeconfig, root, lc.logs / "topodra-apifault-plugin.log", extra_env={})
        plugin.start(wait=False)
        try:
            plugin.wait_ready(90)
            ns = f"apifault-{os.getpid()}"
            kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
            wait_until(lambda: kube.get(f"/api/v1/namespaces/{ns}/serviceaccounts/default"), 60, "default SA")
            out["deleted_while_down"] = _deleted_while_down(kube, plugin, root, ns, lost)
            done.append("deleted-while-down")
            for component in ("kube-apiserver", "etcd"):
                out[component] = _fault(lc, kube, plugin, root, ns, component, pause_s, lost, done)
        finally:
            plugin.stop()
            kube.close()
    out["lost"] = lost
    return out


def _deleted_while_down(kube: Kube, plugin: BenchPlugin, root: Path, ns: str, lost: list[str]) -> dict[str, Any]:
    """The real plugin's cleanup pass at start unprepares a claim deleted while it was down."""
    gone, kept = pb_claims.make_claims(kube, ns, "down", 2, 1, admin=False, timeout=120)
    with KubeletStub(plugin.socket) as stub:
        answers = stub.prepare([gone.ref, kept.ref]).claims
    if answers[gone.uid].error or answers[kept.uid].error:
        lost.append(f"deleted while down: prepare failed: {answers}")
    plugin.stop()
    pb_claims.release_claims(kube, [gone], 120)  # the kubelet never unprepared it
    t0 = time.monotonic()
    plugin.start(wait=False)
    wait_until(lambda: plugin.socket.is_socket(), 60, "plugin socket")
    dirs = PluginDirs(root)
    while gone.uid in dirs.checkpoint().claims and time.monotonic() - t0 < 60:
        time.sleep(0.2)
    took = time.monotonic() - t0
    claims = set(dirs.checkpoint().claims)
    if gone.uid in claims or kept.uid not in claims:
        lost.append(f"deleted while down: after restart the checkpoint holds {sorted(claims)}; want only {kept.uid}")
    lost.extend(f"deleted while down: {v}" for v in violations(dirs))
    with KubeletStub(plugin.socket) as stub:
        if stub.unprepare([kept.ref]).claims[kept.uid].error:
            lost.append("deleted while down: unprepare of the kept claim failed")
    pb_claims.release_claims(kube, [kept], 120)
    return {"unprepared_after_start_s": round(took, 2)}


def _fault(lc: localcluster.Cluster, kube: Kube, plugin: BenchPlugin, root: Path, ns: str, component: str,
           pause_s: float, lost: list[str], done: list[str]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    held, fresh = pb_claims.make_claims(kube, ns, f"{component[:4]}", 2, 1, admin=False, timeout=120)
    with KubeletStub(plugin.socket) as stub:
        first = stub.prepare([held.ref]).claims[held.uid]
        if first.error:
            lost.append(f"{component}: prepare before the fault failed: {first.error}")
        with Stopped(lc, component):
            t0 = time.monotonic()
            try:
                ans = stub.prepare([fresh.ref], timeout=KUBELET_DEADLINE).claims[fresh.uid]
                res["prepare_error_after_s"] = round(time.monotonic() - t0, 2)
                res["prepare_error"] = ans.error[:300]
                if not ans.error:
                    lost.append(f"{component} stopped: prepare of a claim it cannot read succeeded")
            except Exception as e:
                lost.append(f"{component} stopped: no per-claim answer within {KUBELET_DEADLINE:.0f} s: {e}")
            un = stub.unprepare([held.ref]).claims[held.uid]
            if un.error:
                lost.append(f"{component} stopped: unprepare (needs no API) failed: {un.error}")
            time.sleep(max(0.0, pause_s - (time.monotonic() - t0)))
        t1 = time.monotonic()
        while True:  # the kubelet retries
            ans = stub.prepare([fresh.ref], timeout=KUBELET_DEADLINE).claims[fresh.uid]
            if not ans.error:
                res["prepare_ok_after_resume_s"] = round(time.monotonic() - t1, 2)
                break
            if time.monotonic() - t1 > CONVERGE_LIMIT:
                lost.append(f"{component} resumed: prepare still fails after {CONVERGE_LIMIT:.0f} s: {ans.error}")
                break
            time.sleep(1)
        if stub.unprepare([fresh.ref]).claims[fresh.uid].error:
            lost.append(f"{component} resumed: unprepare failed")
    lost.extend(f"{component}, prepare phase: {v}" for v in violations(PluginDirs(root)))
    pb_claims.release_claims(kube, [held, fresh], 120)
    done.append(f"{component}/prepare")

    # Publishing: restart the plugin with its slices gone, stop the component while it publishes.
    plugin.stop()
    for s in kube.list(slices_path(), field_selector=f"spec.driver={DRIVER},spec.nodeName={NODE}"):
        kube.delete(f"{slices_path()}/{s['metadata']['name']}")
    plugin.start(wait=False)
    wait_until(lambda: plugin.socket.is_socket(), 60, "plugin socket")
    with Stopped(lc, component):
        time.sleep(pause_s)
        if not plugin.alive():
            lost.append(f"{component} stopped: the plugin exited while publishing: {plugin.tail()}")
    took, what = wait_converged(kube, CONVERGE_LIMIT)
    res["slices_converged_after_resume_s"] = None if took is None else round(took, 2)
    res["slices"] = what
    if took is None:
        lost.append(f"{component} resumed: slices did not converge within {CONVERGE_LIMIT:.0f} s ({what})")
    time.sleep(2)  # a late duplicate write would show up now
    ok, what = slice_state(kube)
    if not ok:
        lost.append(f"{component} resumed: slices diverged again: {what}")
    done.append(f"{component}/publishing")
    return res
