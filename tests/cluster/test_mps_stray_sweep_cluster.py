"""Stray MPS daemon pods are swept at plugin start, against the real API server (``--mps-daemon pod``).

The plugin's state (``DeviceState``, mock hardware, the ``mockmps`` stand-in) runs with its daemon pods made
through the real kube-apiserver, on a kubelet-less fake node: the pods stay Pending (no kubelet runs them, so
the prepare's readiness wait fails fast here; the node tier and kind run them), which is all the sweep looks
at.  A pod that a crash between ``quit`` and the delete left (its claim is in no checkpoint) gets deleted at the
next start; the prepared claim's pod, another node's daemon pod and an unlabelled pod in the namespace are kept.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from testkit import rigs as rig
from testkit.handle import ClusterHandle
from testkit.rigs import claim, hardware

from topodra import effects
from topodra.hardware import mockmps
from topodra.hardware.mock import FakeNvml
from topodra.inventory import Inventory
from topodra.kube import Kube
from topodra.sharing import mpspod, mpsshm
from topodra.sharing.config import Mps, Sharing
from topodra.sharing.instances import MigInstances
from topodra.sharing.mps import MpsDaemons
from topodra.sharing.mpspod import MpsPods
from topodra.state import DeviceState

pytestmark = pytest.mark.cluster
STAND_IN = str(Path(mockmps.__file__))
IMAGE = "localhost/topodra:never-pulled"


@pytest.fixture
def site(cluster: ClusterHandle, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(namespace, node): a fresh namespace and a kubelet-less Ready node; everything removed afterwards."""
    node = f"sweep-{uuid.uuid4().hex[:6]}"
    cluster.fake_nodes([node])
    ns = cluster.namespace("mps-sweep")
    yield ns, node
    for pod in cluster.kube.list(mpspod.pods_path(ns)):  # bound pods without a kubelet: only a forced delete
        cluster.kubectl("delete", "pod", "-n", ns, pod["metadata"]["name"], "--grace-period=0", "--force",
                        check=False)
    cluster.kube.delete(f"/api/v1/namespaces/{ns}")
    cluster.kube.delete(f"/api/v1/nodes/{node}")
    for shm in (tmp_path / "state" / "mps").glob("*/shm"):
        mpsshm.unmount(shm)


def start(tmp_path: Path, kube: Kube, ns: str, node: str, devices: list[Any], nvml: FakeNvml) -> DeviceState:
    boot = tmp_path / "boot_id"
    if not boot.exists():
        boot.write_text("boot-1\n")
    pods = MpsPods(kube, ns, node, IMAGE, ready_timeout=1, gone_timeout=10)
    daemons = MpsDaemons(tmp_path / "state", binary=STAND_IN, compute_mode=nvml, pods=pods)
    return DeviceState(rig.DRIVER, node, Inventory(devices), tmp_path / "cdi", tmp_path / "state",
                       boot_id_path=str(boot), nvidia_spec_dirs=[],
                       gpu_effects=effects.standard(tmp_path / "state", mig=MigInstances(nvml), mps=daemons))


def daemon_pod(kube: Kube, ns: str, claim_uid: str, node: str, name: str | None = None,
               labelled: bool = True) -> str:
    """Create a daemon pod as the plugin makes them (nothing serves it); its name."""
    pod = mpspod.manifest(claim_uid, namespace=ns, node=node, image=IMAGE, argv=["true"], env={},
                          pipe=Path("/nonexistent"), logs=Path("/nonexistent"), shm=Path("/nonexistent"))
    if name:
        pod["metadata"]["name"] = name
    if not labelled:
        pod["metadata"]["labels"] = {mpspod.CLAIM_LABEL: claim_uid}
    return str(kube.create(mpspod.pods_path(ns), pod)["metadata"]["name"])


def state_of(kube: Kube, ns: str, name: str) -> tuple[str, bool] | None:
    """(pod UID, being deleted) or None when gone."""
    pod = kube.get(mpspod.pods_path(ns, name))
    return None if pod is None else (pod["metadata"]["uid"], bool(pod["metadata"].get("deletionTimestamp")))


def test_plugin_start_deletes_a_stray_daemon_pod_and_keeps_the_live_claims(
        cluster: ClusterHandle, site: tuple[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ns, node = site
    kube = cluster.kube
    devices, nvml = hardware(tmp_path)
    st = start(tmp_path, kube, ns, node, devices, nvml)
    sharing = Sharing(strategy="MPS", mps=Mps(defaultActiveThreadPercentage=40))
    result = st.prepare([claim("live", "gpu-0", sharing)])["live"]
    assert "did not answer on its pipe" in result.error, result  # no kubelet; the claim stays prepared
    live = mpspod.pod_name("live")
    live_state = state_of(kube, ns, live)
    assert live_state is not None and not live_state[1], "prepare made the live claim's pod"
    stray = daemon_pod(kube, ns, "crashed-before-delete", node)
    others = [daemon_pod(kube, ns, "elsewhere", "another-node"), daemon_pod(kube, ns, "foreign", node, "my-pod"),
              daemon_pod(kube, ns, "unlabelled", node, labelled=False)]
    before = {name: state_of(kube, ns, name) for name in others}

    with caplog.at_level(logging.WARNING, logger="topodra.sharing.mpssweep"):
        start(tmp_path, kube, ns, node, devices, nvml)  # the plugin started again: recovery sweeps

    gone = state_of(kube, ns, stray)
    assert gone is None or gone[1], "the stray pod is deleted (no kubelet here to finish a graceful delete)"
    assert state_of(kube, ns, live) == live_state, "the prepared claim's pod is the same, not deleted"
    assert {name: state_of(kube, ns, name) for name in others} == before
    assert [r.getMessage() for r in caplog.records if r.name == "topodra.sharing.mpssweep"] == [
        f"claim crashed-before-delete: deleted stray MPS daemon pod {ns}/{stray} (no prepared claim records it)"]


def test_a_node_name_longer_than_a_label_value_gets_its_daemon_pods_and_its_sweep(cluster: ClusterHandle) -> None:
    """A node name is a DNS subdomain of up to 253 characters, a label value at most 63: the pod's node label
    is then a hash (``mpspod.node_label``), which the real API server accepts and the sweep selects by."""
    from topodra.sharing import mpssweep

    ns = cluster.namespace("mps-longnode")
    node = "gpu-" + "a" * 70 + ".rack-17.example.internal"
    other = "gpu-" + "a" * 70 + ".rack-18.example.internal"  # same first 63 characters
    try:
        stray = daemon_pod(cluster.kube, ns, "stray-long", node)  # a 422 here before issue 31's fix
        kept = daemon_pod(cluster.kube, ns, "other-long", other)
        deleted, errors = mpssweep.sweep(cluster.kube, ns, node, lambda: set())
        assert (deleted, errors) == (["stray-long"], {})
        gone = state_of(cluster.kube, ns, stray)
        assert gone is None or gone[1]
        kept_state = state_of(cluster.kube, ns, kept)
        assert kept_state is not None and not kept_state[1], "another node's pod is not this node's to sweep"
    finally:
        for pod in cluster.kube.list(mpspod.pods_path(ns)):
            cluster.kubectl("delete", "pod", "-n", ns, pod["metadata"]["name"], "--grace-period=0", "--force",
                            check=False)
        cluster.kube.delete(f"/api/v1/namespaces/{ns}")
