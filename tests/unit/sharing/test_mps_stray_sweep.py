"""Stray MPS daemon pods (``--mps-daemon pod``) are swept: at plugin start and after an unprepare failed.

A pod whose claim no checkpoint entry records (a crash between the daemon's ``quit`` and the pod's delete, or
any crash while the delete still had to happen) is deleted; a prepared claim's pod, another node's pods and
pods without all of topodra's marks are kept.  The API server is a fake at the boundary here, with a "kubelet"
that runs a created daemon pod's command as a local process on the pod's hostPath directories (mock hardware);
tests/cluster/test_mps_stray_sweep_cluster.py does the same against the real API server.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from testkit import rigs as rig
from testkit.rigs import claim, hardware, ref

from topodra import effects
from topodra.hardware import mockmps
from topodra.hardware.mock import FakeNvml
from topodra.inventory import Inventory
from topodra.kube import KubeError
from topodra.sharing import mpspod, mpsshm, mpssweep
from topodra.sharing.config import Mps, Sharing
from topodra.sharing.instances import MigInstances
from topodra.sharing.mps import MpsDaemons
from topodra.sharing.mpspod import MpsPods
from topodra.state import DeviceState

Obj = dict[str, Any]
STAND_IN = str(Path(mockmps.__file__))
NS = "topodra-system"
MPS = Sharing(strategy="MPS", mps=Mps(defaultActiveThreadPercentage=40))


class Conflict(Exception):
    conflict = True


class FakeApi:
    """Pods by path, the calls made, and injected delete failures; a created daemon pod's container runs."""

    def __init__(self) -> None:
        self.pods: dict[str, Obj] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.calls: list[str] = []
        self.fail_delete: set[str] = set()

    def get(self, path: str) -> Obj | None:
        self.calls.append(f"GET {path}")
        pod = self.pods.get(path)
        return copy.deepcopy(pod) if pod else None

    def create(self, path: str, obj: Obj) -> Obj:
        full = f"{path}/{obj['metadata']['name']}"
        self.calls.append(f"POST {full}")
        if full in self.pods:
            raise Conflict(full)
        pod = self.put(obj)
        self.procs[full] = self._run(pod)
        return copy.deepcopy(pod)

    def put(self, obj: Obj) -> Obj:
        """Store a pod as the API server would (a uid, Running), without running anything."""
        pod = copy.deepcopy(obj)
        pod["metadata"]["uid"] = str(uuid.uuid4())
        pod["status"] = {"phase": "Running"}
        self.pods[mpspod.pods_path(pod["metadata"]["namespace"], pod["metadata"]["name"])] = pod
        return pod

    def delete(self, path: str, missing_ok: bool = True, uid: str | None = None) -> None:
        self.calls.append(f"DELETE {path}")
        if path in self.fail_delete:
            self.fail_delete.discard(path)
            raise RuntimeError(f"injected: DELETE {path} failed")
        if uid is not None and path in self.pods and self.pods[path]["metadata"]["uid"] != uid:
            raise KubeError(409, "Conflict", f"Precondition failed: UID in precondition: {uid}")
        self.pods.pop(path, None)
        proc = self.procs.pop(path, None)
        if proc is not None:
            proc.terminate()
            proc.wait(10)

    def list(self, path: str, label_selector: str | None = None,
             field_selector: str | None = None) -> Iterator[Obj]:
        self.calls.append(f"LIST {path}?{label_selector}")
        want = dict(kv.split("=", 1) for kv in (label_selector or "").split(",") if kv)
        for p, pod in list(self.pods.items()):
            labels = pod["metadata"].get("labels") or {}
            if p.startswith(path + "/") and all(labels.get(k) == v for k, v in want.items()):
                yield copy.deepcopy(pod)

    @staticmethod
    def _run(pod: Obj) -> subprocess.Popen[bytes]:
        """The kubelet's part: the container's command with its hostPath dirs where the pod has its mounts."""
        (c,) = pod["spec"]["containers"]
        host = {v["name"]: v["hostPath"]["path"] for v in pod["spec"]["volumes"]}
        env = {e["name"]: e["value"] for e in c["env"]}
        env.update(CUDA_MPS_PIPE_DIRECTORY=host["pipe"], CUDA_MPS_LOG_DIRECTORY=host["log"],
                   PATH=os.environ.get("PATH", ""))
        return subprocess.Popen(c["command"], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()


@pytest.fixture
def api(tmp_path: Path) -> Iterator[FakeApi]:
    a = FakeApi()
    yield a
    a.stop_all()
    for pid_file in (tmp_path / "state" / "mps").glob(f"*/pipe/{mockmps.PID_FILE}"):
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
    for shm in (tmp_path / "state" / "mps").glob("*/shm"):
        mpsshm.unmount(shm)


def start(tmp_path: Path, api: FakeApi, devices: list[Any], nvml: FakeNvml) -> DeviceState:
    """The plugin (re)started with --mps-daemon pod: rig.state's node with its daemons in pods."""
    boot = tmp_path / "boot_id"
    if not boot.exists():
        boot.write_text("boot-1\n")
    pods = MpsPods(api, NS, rig.NODE, "localhost/topodra:test", ready_timeout=15, gone_timeout=15)
    daemons = MpsDaemons(tmp_path / "state", binary=STAND_IN, compute_mode=nvml, pods=pods)
    return DeviceState(rig.DRIVER, rig.NODE, Inventory(devices), tmp_path / "cdi", tmp_path / "state",
                       boot_id_path=str(boot), nvidia_spec_dirs=[],
                       gpu_effects=effects.standard(tmp_path / "state", mig=MigInstances(nvml), mps=daemons))


def stray(api: FakeApi, claim_uid: str, node: str = rig.NODE, **changes: Any) -> str:
    """A daemon pod as the plugin makes them (its manifest), stored without a daemon: what a crash left."""
    pod = mpspod.manifest(claim_uid, namespace=NS, node=node, image="localhost/topodra:test", argv=["true"],
                          env={}, pipe=Path("/nonexistent"), logs=Path("/nonexistent"), shm=Path("/nonexistent"))
    for key, value in changes.items():
        if key == "labels":
            pod["metadata"]["labels"] = value
        elif key == "name":
            pod["metadata"]["name"] = value
        elif key == "nodeName":
            pod["spec"]["nodeName"] = value
    api.put(pod)
    return mpspod.pods_path(NS, pod["metadata"]["name"])


def test_strays_are_only_this_nodes_marked_pods_of_unrecorded_claims() -> None:
    def pod(uid: str, node: str = "n1", name: str | None = None, bound: str | None = "n1",
            labels: dict[str, str] | None = None) -> Obj:
        ls = labels if labels is not None else {mpspod.APP_LABEL[0]: mpspod.APP_LABEL[1], mpspod.CLAIM_LABEL: uid,
                                                mpspod.NODE_LABEL: node}
        return {"metadata": {"name": name or mpspod.pod_name(uid), "labels": ls}, "spec": {"nodeName": bound}}

    pods = [pod("gone"), pod("live"), pod("other", node="n2", bound="n2"), pod("moved", bound="n2"),
            pod("renamed", name="my-own-pod"), pod("nolabel", labels={mpspod.CLAIM_LABEL: "nolabel"})]
    assert mpssweep.strays(pods, "n1", {"live"}) == [("gone", mpspod.pod_name("gone"))]
    assert mpssweep.selector("n1") == "app.kubernetes.io/name=topodra-mps-daemon,topodra.io/node=n1"


def test_the_pods_are_listed_before_the_checkpoint_is_read(api: FakeApi) -> None:
    """A claim prepared between the two reads has its pod listed and its entry read: kept."""
    stray(api, "gone")
    listed_then_made = stray(api, "new")
    order: list[str] = []

    def recorded() -> set[str]:
        order.append("checkpoint read after " + api.calls[-1].split("?")[0])
        return {"new"}
    deleted, errors = mpssweep.sweep(api, NS, rig.NODE, recorded)
    assert (deleted, errors) == (["gone"], {})
    assert order == [f"checkpoint read after LIST {mpspod.pods_path(NS)}"]
    assert listed_then_made in api.pods and mpspod.pods_path(NS, mpspod.pod_name("gone")) not in api.pods


def test_a_pod_re_created_after_the_list_is_not_deleted(api: FakeApi, caplog: pytest.LogCaptureFixture) -> None:
    """The claim is unprepared (its pod deleted) after the list and prepared again (same claim UID, so a new pod
    of the same name) after the checkpoint read: the sweep deletes only the pod it listed, by UID (issue 31: it
    deleted the new claim's daemon by name)."""
    path = stray(api, "again")
    listed_uid = api.pods[path]["metadata"]["uid"]

    def recorded() -> set[str]:
        old = api.pods.pop(path)  # unprepare: the daemon pod went
        api.put(old)  # prepare again: a new pod, the same name, a new uid
        return set()  # the checkpoint was read in between: the claim was not recorded then

    with caplog.at_level(logging.INFO, logger="topodra.sharing.mpssweep"):
        deleted, errors = mpssweep.sweep(api, NS, rig.NODE, recorded)
    assert (deleted, errors) == ([], {})
    assert path in api.pods and api.pods[path]["metadata"]["uid"] != listed_uid, "the new claim's pod is kept"
    assert any("re-created since the sweep listed it" in r.getMessage() for r in caplog.records)


def test_a_failing_list_or_delete_is_reported_and_changes_nothing_else(api: FakeApi) -> None:
    a, b = stray(api, "a"), stray(api, "b")
    api.fail_delete.add(a)
    deleted, errors = mpssweep.sweep(api, NS, rig.NODE, set)
    assert deleted == ["b"] and list(errors) == ["a"] and "injected" in errors["a"]
    assert a in api.pods and b not in api.pods

    def broken() -> set[str]:
        raise OSError("checkpoint unreadable")
    deleted, errors = mpssweep.sweep(api, NS, rig.NODE, broken)
    assert deleted == [] and "checkpoint unreadable" in errors[""] and a in api.pods, "nothing deleted blind"


def test_plugin_start_deletes_stray_pods_and_keeps_the_prepared_claims(
        tmp_path: Path, api: FakeApi, caplog: pytest.LogCaptureFixture) -> None:
    devices, nvml = hardware(tmp_path)
    st = start(tmp_path, api, devices, nvml)
    assert st.prepare([claim("live", "gpu-0", MPS)])["live"].error == ""
    live = mpspod.pods_path(NS, mpspod.pod_name("live"))
    live_uid = api.pods[live]["metadata"]["uid"]
    assert rig.daemons(st).control("live", ["get_default_active_thread_percentage"]).strip() == "40.0"
    # What a crash between quit and the pod's delete leaves, and pods that are not this plugin's to delete.
    gone = stray(api, "crashed-before-delete")
    others = [stray(api, "elsewhere", node="other-node"),
              stray(api, "foreign", name="someone-elses-pod"),
              stray(api, "unmarked", labels={mpspod.CLAIM_LABEL: "unmarked", mpspod.NODE_LABEL: rig.NODE})]
    with caplog.at_level(logging.WARNING, logger="topodra.sharing.mpssweep"):
        start(tmp_path, api, devices, nvml)
    assert gone not in api.pods
    assert api.pods[live]["metadata"]["uid"] == live_uid, "the prepared claim's pod is kept, not made again"
    assert all(p in api.pods for p in others), sorted(api.pods)
    assert [r.getMessage() for r in caplog.records] == [
        f"claim crashed-before-delete: deleted stray MPS daemon pod {NS}/{mpspod.pod_name('crashed-before-delete')}"
        " (no prepared claim records it)"]


def test_a_failed_unprepare_sweeps_and_a_clean_one_does_not_list(tmp_path: Path, api: FakeApi) -> None:
    devices, nvml = hardware(tmp_path)
    st = start(tmp_path, api, devices, nvml)
    assert st.prepare([claim("a", "gpu-0", MPS), claim("b", "gpu-1", MPS)]) and len(api.procs) == 2
    api.calls.clear()
    assert st.unprepare([ref("a")]) == {"a": ""}
    assert not [c for c in api.calls if c.startswith("LIST")], "nothing failed: no sweep"
    left = stray(api, "left-by-an-earlier-process")
    b = mpspod.pods_path(NS, mpspod.pod_name("b"))
    api.fail_delete.add(b)
    result = st.unprepare([ref("b")])
    assert "injected" in result["b"], result
    assert mpspod.pods_path(NS, mpspod.pod_name("left-by-an-earlier-process")) not in api.pods, \
        "the failed unprepare swept the stray pod no process knew of"
    assert left not in api.pods and b not in api.pods, "and the sweep deleted b's pod on its second try"


def test_node_label_is_the_name_up_to_63_characters_then_a_hash() -> None:
    from topodra.sharing import mpspod, mpssweep

    assert mpspod.node_label("node-1") == "node-1"
    assert mpspod.node_label("n" * 63) == "n" * 63
    long_a, long_b = "x" * 63 + ".a", "x" * 63 + ".b"
    la, lb = mpspod.node_label(long_a), mpspod.node_label(long_b)
    assert len(la) == 63 and la.startswith("sha256-") and la != lb
    assert mpssweep.selector(long_a).endswith(f"={la}")
    pod = mpspod.manifest("u1", namespace="ns", node=long_a, image="i", argv=["true"], env={},
                          pipe=Path("/p"), logs=Path("/l"), shm=Path("/s"))
    assert pod["metadata"]["labels"][mpspod.NODE_LABEL] == la
    assert mpssweep.strays([pod], long_a, set()) == [("u1", "topodra-mps-u1")]
    assert mpssweep.strays([pod], long_b, set()) == []  # another node's (it is bound to long_a)
