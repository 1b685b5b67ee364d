"""The controller runs as the Deployment's non-root uid with no passwd entry, as in its container.

The pod once crash-looped: kopf names itself through ``getpass.getuser()``, which raises KeyError for
uid 65532 (no /etc/passwd line). Here the real ``topodra controller`` runs under ``setpriv`` as that uid,
with no USER/LOGNAME/HOME in its environment, against the real apiserver as its ServiceAccount.

Split by tier; the rest: tests/node/test_install_controller_uid_node.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from test_deploy_manifests_cluster import FORBIDDEN, NS, installed, stop  # noqa: F401
from testkit.handle import ClusterHandle, wait_for
from testkit.manifests import controller_deploy

from topodra.apipaths import template_path

UID = 65532


def _no_passwd_entry(uid: int) -> bool:
    import pwd

    try:
        pwd.getpwuid(uid)
    except KeyError:
        return True
    return False


@pytest.fixture
def world_readable_dir() -> Iterator[Path]:
    """pytest's tmp_path is 0700 root: the unprivileged controller could not read its kubeconfig there."""
    d = Path(tempfile.mkdtemp(prefix="topodra-uid-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.cluster
def test_controller_runs_as_uid_without_passwd_entry(installed: ClusterHandle,  # noqa: F811
                                                     world_readable_dir: Path) -> None:
    nc = installed
    if shutil.which("setpriv") is None:
        pytest.fail("setpriv (util-linux) is required: hack/install-deps installs it")
    assert os.geteuid() == 0, "the local cluster tests run as root"
    assert _no_passwd_entry(UID), f"uid {UID} has a passwd entry here; the test would prove nothing"
    dep = controller_deploy()
    pod_sc = dep["spec"]["template"]["spec"]["securityContext"]
    assert pod_sc["runAsUser"] == UID and pod_sc["runAsNonRoot"] is True
    (c,) = dep["spec"]["template"]["spec"]["containers"]

    token = nc.kubectl("create", "token", "topodra-controller", "-n", NS, "--duration=1h").strip()
    ca = world_readable_dir / "ca.crt"
    shutil.copy(nc.lc.pki / "ca.crt", ca)
    kubeconfig = world_readable_dir / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "l", "cluster": {"server": "https://127.0.0.1:6443", "certificate-authority": str(ca)}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "l", "user": "u"}}]}))
    for f in (ca, kubeconfig):
        f.chmod(0o644)

    ns = nc.namespace("uid")
    identity = f"uid-test-{uuid.uuid4().hex[:6]}"
    args = [a.replace("$(POD_NAMESPACE)", NS).replace("$(POD_NAME)", identity) for a in c["args"]]
    # What a container runtime gives a uid without a passwd entry: no USER, LOGNAME or HOME.
    env = {"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"}
    log = world_readable_dir / "controller.log"
    with log.open("wb") as logf:
        proc = subprocess.Popen(
            ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", "--",
             sys.executable, "-m", "topodra.cli", *c["command"][1:], *args, f"--kubeconfig={kubeconfig}",
             "--refresh-interval=2"],
            stdout=logf, stderr=subprocess.STDOUT, cwd=world_readable_dir, env=env)
    try:
        lease = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/topodra-controller"
        wait_for(lambda: proc.poll() is None and
                 (nc.kube.get(lease) or {}).get("spec", {}).get("holderIdentity") == identity, 60,
                 f"controller to hold its Lease (log: {log})")
        uids = Path(f"/proc/{proc.pid}/status").read_text().split("Uid:")[1].split()[:2]
        assert uids == [str(UID), str(UID)], uids
        nc.kube.create(f"/apis/topodra.io/v1alpha1/namespaces/{ns}/claimprofiles", {
            "apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile", "metadata": {"name": "train"},
            "spec": {"alternatives": [{"deviceClassName": "gpu-h100", "count": 2}]}})

        def rendered() -> bool:
            assert proc.poll() is None, log.read_text()
            return bool(nc.kube.get(template_path(ns, "train")))
        wait_for(rendered, 60, "template rendered by the unprivileged controller")
        assert stop(proc) == 0, log.read_text()
        text = log.read_text()
        assert "getpwuid" not in text and "Traceback" not in text, text
        assert not FORBIDDEN.search(text), text
    finally:
        stop(proc)
        nc.kube.delete(f"/api/v1/namespaces/{ns}")
