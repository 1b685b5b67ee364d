"""DeviceClasses, examples, the ClaimProfile CRD and the controller against the real API server."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO

from topodra.apipaths import device_class_path, event_path, lease_path, profile_path, template_path
from topodra.controller.render import HASH_ANNOTATION
from topodra.kube import KubeError

pytestmark = pytest.mark.cluster

CRD = REPO / "deploy" / "crds" / "claimprofiles.topodra.io.yaml"
LOG_DIR = REPO / ".run" / "controller-test-logs"  # kept after the cluster is torn down


@pytest.fixture(scope="module")
def crd(cluster: ClusterHandle) -> ClusterHandle:
    cluster.install_claimprofile_crd()
    cluster.apply_yaml(REPO / "deviceclasses")
    return cluster


def test_device_classes_are_accepted(crd: ClusterHandle) -> None:
    names = {p.stem for p in (REPO / "deviceclasses").glob("*.yaml")}
    stored = {c["metadata"]["name"] for c in crd.kube.list(device_class_path())}
    assert names <= stored
    h200 = crd.kube.get(device_class_path("gpu-h200"))
    assert h200 is not None and "topodra.io/match" in h200["metadata"]["annotations"]


@pytest.mark.parametrize("path", sorted((REPO / "deploy" / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_pass_server_side_validation(crd: ClusterHandle, path: Path) -> None:
    ns = crd.namespace("ex")
    out = crd.kubectl("apply", "--dry-run=server", "-n", ns, "-f", str(path))
    kinds = [d["kind"] for d in yaml.safe_load_all(path.read_text()) if d]
    assert out.count("(server dry run)") == len(kinds), out
    # the templates themselves are also stored for real (CEL compiled, constraints validated)
    crd.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(
        [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] != "Pod"]))


VALID: dict[str, Any] = {"alternatives": [{"deviceClassName": "gpu-h200", "count": 4}],
                         "topology": {"nvlink": "Required"}}


def _profile(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile", "metadata": {"name": name}, "spec": spec}


@pytest.mark.parametrize(("spec", "needle"), [
    ({"alternatives": []}, "should have at least 1 items"),
    ({"alternatives": [{"deviceClassName": "gpu-h200"}] * 9}, "must have at most 8 items"),
    ({"alternatives": [{"deviceClassName": "gpu-h200", "count": 0}]}, "should be greater than or equal to 1"),
    ({"alternatives": [{"count": 2}]}, "deviceClassName: Required value"),
    ({"alternatives": [{"deviceClassName": "gpu-h200"}], "topology": {"nvlink": "Always"}}, "Unsupported value"),
    ({"alternatives": [{"name": "a", "deviceClassName": "gpu-h200"}, {"name": "a", "deviceClassName": "gpu-h100"}]},
     "alternative names must be unique"),
    ({"alternatives": [{"deviceClassName": "gpu-h200", "count": 2}, {"deviceClassName": "gpu-h100"}],
      "topology": {"nic": "RailAligned"}}, "same count"),
    ({"alternatives": [{"deviceClassName": "gpu-h200"}], "topology": {"nic": "RailAligned", "numa": "Preferred"}},
     "cannot be combined with Preferred"),
])
def test_crd_rejects_invalid_profiles(crd: ClusterHandle, spec: dict[str, Any], needle: str) -> None:
    ns = crd.namespace("bad")
    with pytest.raises(KubeError) as err:
        crd.kube.create(profile_path(ns), _profile("bad", spec))
    assert err.value.status == 422
    assert needle in err.value.message, err.value.message


def test_crd_accepts_and_defaults(crd: ClusterHandle) -> None:
    ns = crd.namespace("ok")
    obj = crd.kube.create(profile_path(ns), _profile("ok", {"alternatives": [{"deviceClassName": "gpu-l4"}]}))
    assert obj["spec"]["alternatives"] == [{"deviceClassName": "gpu-l4", "count": 1}]
    assert obj["spec"].get("topology") is None or obj["spec"]["topology"]["nvlink"] == "None"


# --- the controller process --------------------------------------------------------------------

def _start_controller(cluster: ClusterHandle, ns: str, identity: str) -> subprocess.Popen[str]:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = open(LOG_DIR / f"{ns}-{identity}.log", "w")  # noqa: SIM115 - the child holds it
    return subprocess.Popen(
        [sys.executable, "-m", "topodra.cli", "controller", "--kubeconfig", cluster.kubeconfig,
         "--namespace", ns, "--refresh-interval", "2", "--lease-namespace", ns, "--identity", identity],
        stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _stop(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(5)
    return proc.returncode


@pytest.fixture
def controller(crd: ClusterHandle) -> Iterator[tuple[ClusterHandle, str, subprocess.Popen[str]]]:
    ns = crd.namespace("ctl")
    proc = _start_controller(crd, ns, "one")
    try:
        yield crd, ns, proc
    finally:
        _stop(proc)


def _condition(cluster: ClusterHandle, ns: str, name: str, ctype: str) -> dict[str, Any] | None:
    obj = cluster.kube.get(profile_path(ns, name)) or {}
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == ctype), None)


def _refreshed_after(cluster: ClusterHandle, ns: str, name: str, stamp: str) -> str | None:
    """The profile's ``status.lastRefresh`` (RFC 3339, whole seconds) if later than ``stamp``."""
    got = ((cluster.kube.get(profile_path(ns, name)) or {}).get("status") or {}).get("lastRefresh")
    return str(got) if got and str(got) > stamp else None


def test_controller_renders_replaces_and_deletes(controller: tuple[ClusterHandle, str, Any]) -> None:
    cluster, ns, proc = controller
    cluster.kube.create(profile_path(ns), _profile("train", VALID))
    tmpl = wait_for(lambda: cluster.kube.get(template_path(ns, "train")), 60, "template for profile train")
    assert tmpl["metadata"]["ownerReferences"][0]["kind"] == "ClaimProfile"
    assert tmpl["spec"]["spec"]["devices"]["constraints"] == [
        {"requests": ["gpus"], "matchAttribute": "gpu.topodra.io/nvlinkDomain"}]
    ready = wait_for(lambda: (_condition(cluster, ns, "train", "Ready") or {}).get("status") == "True", 30,
                     "Ready=True")
    assert ready
    prof = cluster.kube.get(profile_path(ns, "train"))
    assert prof is not None
    assert prof["status"]["alternatives"][0]["name"] == "h200"

    # update -> the immutable template is replaced (new uid, new hash)
    spec = copy.deepcopy(VALID)
    spec["alternatives"].append({"deviceClassName": "gpu-h100", "count": 4})
    cluster.kube.merge_patch(profile_path(ns, "train"), {"spec": spec})

    def replaced() -> dict[str, Any] | None:
        t = cluster.kube.get(template_path(ns, "train"))
        return t if t and t["metadata"]["uid"] != tmpl["metadata"]["uid"] else None

    new = wait_for(replaced, 60, "template replaced")
    assert new["metadata"]["annotations"][HASH_ANNOTATION] != tmpl["metadata"]["annotations"][HASH_ANNOTATION]
    assert [s["name"] for s in new["spec"]["spec"]["devices"]["requests"][0]["firstAvailable"]] == ["h200", "h100"]

    # unknown class -> Invalid, no template
    cluster.kube.create(profile_path(ns), _profile("nope", {"alternatives": [{"deviceClassName": "gpu-x"}]}))
    inv = wait_for(lambda: _condition(cluster, ns, "nope", "Invalid"), 60, "Invalid condition")
    assert (inv["status"], inv["reason"]) == ("True", "UnknownDeviceClass")
    assert cluster.kube.get(template_path(ns, "nope")) is None
    # The controller posts the Event only after it patched the status: wait for it, do not read once.
    wait_for(lambda: any(e["reason"] == "UnknownDeviceClass" and e["involvedObject"]["name"] == "nope"
                         for e in cluster.kube.list(event_path(ns))), 30, "UnknownDeviceClass event")

    # delete -> template goes
    cluster.kube.delete(profile_path(ns, "train"))
    wait_for(lambda: cluster.kube.get(template_path(ns, "train")) is None, 60, "template deleted")
    assert proc.poll() is None


def test_restart_is_idempotent_and_standby_waits(crd: ClusterHandle) -> None:
    ns = crd.namespace("ha")
    crd.kube.create(profile_path(ns), _profile("train", VALID))
    first = _start_controller(crd, ns, "first")
    try:
        tmpl = wait_for(lambda: crd.kube.get(template_path(ns, "train")), 60, "template")
        standby = _start_controller(crd, ns, "second")
        try:
            lease = wait_for(lambda: crd.kube.get(lease_path(ns, "topodra-controller")), 30, "lease")
            assert lease["spec"]["holderIdentity"] == "first"
            assert _stop(first) == 0
            # a clean stop releases the lease (or the standby already took it): no wait for its expiry
            released = crd.kube.get(lease_path(ns, "topodra-controller")) or {}
            assert released["spec"]["holderIdentity"] in ("", "second"), released["spec"]
            wait_for(lambda: (crd.kube.get(lease_path(ns, "topodra-controller")) or {}).get("spec", {})
                     .get("holderIdentity") == "second", 30, "standby takes over")
            # the new leader re-reconciles and finds the template current: no replacement. Its status
            # stamp (written after each reconcile) moving past the takeover, twice, shows two passes ran.
            took_over = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            first_pass = wait_for(lambda: _refreshed_after(crd, ns, "train", took_over), 30, "a refresh pass")
            wait_for(lambda: _refreshed_after(crd, ns, "train", first_pass), 30, "a second refresh pass")
            assert (_condition(crd, ns, "train", "Ready") or {}).get("status") == "True"
            now = crd.kube.get(template_path(ns, "train"))
            assert now is not None and now["metadata"]["uid"] == tmpl["metadata"]["uid"]
            templates = list(crd.kube.list(template_path(ns)))
            assert len(templates) == 1
        finally:
            _stop(standby)
    finally:
        _stop(first)


@pytest.mark.parametrize("spec", [
    {"alternatives": [{"deviceClassName": "gpu-h200", "count": 4}, {"deviceClassName": "gpu-h100", "count": 4}],
     "topology": {"nvlink": "Preferred", "numa": "Preferred"}},
    {"alternatives": [{"deviceClassName": "gpu-h200", "count": 8}, {"deviceClassName": "gpu-b200", "count": 8}],
     "topology": {"nvlink": "Preferred", "order": "TopologyFirst"}},
    {"alternatives": [{"deviceClassName": "gpu-h200", "count": 2}, {"deviceClassName": "gpu-h100", "count": 2}],
     "topology": {"nic": "RailAligned", "nvlink": "Required"}},
    {"alternatives": [{"deviceClassName": "gpu-l4", "count": 1}], "topology": {"numa": "Required"}},
], ids=["preferred-both", "topology-first", "rail-aligned", "single"])
def test_rendered_templates_are_valid_api_objects(crd: ClusterHandle, spec: dict[str, Any]) -> None:
    """Every render shape (subrequest refs like gpus/h200-nvlink, per-GPU NIC pairs) passes API validation."""
    from topodra.controller.profile import ClaimProfile
    from topodra.controller.render import render_template

    ns = crd.namespace("render")
    prof = crd.kube.create(profile_path(ns), _profile("p", spec))
    tmpl = render_template(ClaimProfile.from_api(prof))
    stored = crd.kube.create(template_path(ns), tmpl)
    assert stored["spec"]["spec"]["devices"]["requests"] == tmpl["spec"]["spec"]["devices"]["requests"]


def _log_says(ns: str, identity: str, text: str) -> bool:
    path = LOG_DIR / f"{ns}-{identity}.log"
    return path.exists() and text in path.read_text()


def test_sigterm_before_the_operator_runs_is_a_clean_stop(crd: ClusterHandle) -> None:
    """SIGTERM while waiting for the Lease, or just after taking it, exits 0 and frees the Lease.

    kopf installs its signal handlers only once it runs; before that the default action killed the
    process (-15) and left the Lease held for its full duration (seen in CI).
    """
    ns = crd.namespace("term")
    crd.kube.create(profile_path(ns), _profile("train", VALID))
    holder = _start_controller(crd, ns, "holder")
    try:
        wait_for(lambda: _log_says(ns, "holder", "now holds lease"), 60, "holder leads")
        waiting = _start_controller(crd, ns, "waiting")
        try:
            wait_for(lambda: _log_says(ns, "waiting", "waiting for lease"), 60, "standby campaigns")
            assert _stop(waiting) == 0
            lease = crd.kube.get(lease_path(ns, "topodra-controller")) or {}
            assert lease["spec"]["holderIdentity"] == "holder"
        finally:
            _stop(waiting)
        # the holder, stopped as soon as it leads (its operator may not have started yet)
    finally:
        assert _stop(holder) == 0
    lease = crd.kube.get(lease_path(ns, "topodra-controller")) or {}
    assert lease["spec"]["holderIdentity"] == "", lease["spec"]

    early = _start_controller(crd, ns, "early")
    try:
        wait_for(lambda: _log_says(ns, "early", "now holds lease"), 60, "early leads")
        assert _stop(early) == 0
    finally:
        _stop(early)
    lease = crd.kube.get(lease_path(ns, "topodra-controller")) or {}
    assert lease["spec"]["holderIdentity"] == "", lease["spec"]
