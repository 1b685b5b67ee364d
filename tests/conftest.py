"""Session fixtures that run tests against the real local cluster (hack/localcluster.py).

``cluster`` brings up the control plane once per test run; ``node_cluster`` the
same plus containerd and a real kubelet.  Asking for ``node_cluster`` after
``cluster`` upgrades the running cluster (the control plane is restarted with a
node) so the whole run shares one cluster.  Component logs are copied to
``.run/logs/<timestamp>`` in the repo when the session ends, pass or fail.
"""

from __future__ import annotations

import fcntl
import json
import os
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "hack"))

import localcluster  # noqa: E402

from topodra.kube import Kube  # noqa: E402

LOG_ARCHIVE = REPO / ".run" / "logs"


class ClusterHandle:
    """What tests get: kubeconfig, an admin client, kubectl, YAML apply, fake nodes."""

    def __init__(self, lc: localcluster.Cluster, with_node: bool) -> None:
        self.lc = lc
        self.with_node = with_node
        self.kubeconfig = str(lc.admin_kubeconfig)
        self.run_dir = lc.state_dir
        self.bin_dir = Path(lc.meta()["bin_dir"])
        self.node_name = lc.node_name
        self.kube = Kube.from_kubeconfig(self.kubeconfig)

    def kubectl(self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120) -> str:
        r = subprocess.run([str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
                           capture_output=True, text=True, input=input, timeout=timeout, check=False)
        if check and r.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
        return r.stdout if r.returncode == 0 else r.stdout + r.stderr

    def apply_yaml(self, text_or_path: str | Path, *extra: str) -> str:
        if isinstance(text_or_path, Path) or (isinstance(text_or_path, str) and "\n" not in text_or_path
                                               and Path(text_or_path).exists()):
            return self.kubectl("apply", "-f", str(text_or_path), *extra)
        return self.kubectl("apply", "-f", "-", *extra, input=str(text_or_path))

    def pod_bound_token(self, namespace: str, service_account: str, node: str, pod: str = "plugin") -> str:
        """A token of ``service_account`` bound to a pod on ``node``, as a DaemonSet pod's projected token is.

        It carries the node name (``authentication.kubernetes.io/node-name``) our admission policies key on; the
        pod needs no kubelet, its binding is what counts."""
        created = self.kube.create(f"/api/v1/namespaces/{namespace}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
            "spec": {"serviceAccountName": service_account, "nodeName": node, "automountServiceAccountToken": False,
                     "containers": [{"name": "c", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never"}]}})
        tr = self.kube.create(f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600, "boundObjectRef": {
                "kind": "Pod", "apiVersion": "v1", "name": pod, "uid": created["metadata"]["uid"]}}})
        return str(tr["status"]["token"])

    def as_token(self, token: str, method: str, path: str, body: dict[str, Any] | None,
                 content_type: str = "application/json") -> tuple[int, dict[str, Any]]:
        """(status, body) of one API call made with ``token`` instead of the admin's certificate."""
        ctx = ssl.create_default_context(cafile=str(self.lc.pki / "ca.crt"))
        req = urllib.request.Request(f"https://127.0.0.1:{self.lc.ports.apiserver}{path}", method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def install_claimprofile_crd(self) -> None:
        """Apply the ClaimProfile CRD and wait until the apiserver serves it."""
        name = "claimprofiles.topodra.io"
        self.apply_yaml(REPO / "deploy" / "crds" / f"{name}.yaml")

        def established() -> bool:
            obj = self.kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}") or {}
            return any(c.get("type") == "Established" and c.get("status") == "True"
                       for c in (obj.get("status") or {}).get("conditions") or [])

        wait_for(established, 60, "ClaimProfile CRD established")

    def fake_nodes(self, names: list[str], labels: dict[str, str] | None = None) -> None:
        self.lc.create_fake_nodes(names, labels)

    def namespace(self, prefix: str = "t") -> str:
        ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                 "metadata": {"name": ns}})
        # Pods need the default ServiceAccount, which the controller-manager creates.
        wait_for(lambda: self.kube.get(f"/api/v1/namespaces/{ns}/serviceaccounts/default"), 30,
                 f"default ServiceAccount in {ns}")
        return ns


def wait_for(fn: Callable[[], Any], timeout: float, what: str, interval: float = 0.3) -> Any:
    """Poll ``fn`` until it returns something truthy; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            v = fn()
            if v:
                return v
        except Exception as e:
            last_exc = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" +
                         (f" (last error: {last_exc})" if last_exc else ""))


class _Manager:
    """One cluster per pytest session, upgraded to a node cluster on demand."""

    def __init__(self) -> None:
        self.lc: localcluster.Cluster | None = None
        self.with_node = False
        self.owned = False
        self._lock_fd: int | None = None
        self.leftovers: list[str] = []

    def _lock(self) -> None:
        """The cluster uses fixed loopback ports: concurrent test sessions on one machine take turns."""
        if self._lock_fd is None:
            self._lock_fd = os.open("/tmp/topodra-test-cluster.lock", os.O_CREAT | os.O_RDWR, 0o644)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)

    def get(self, node: bool) -> ClusterHandle:
        if self.lc is None or (node and not self.with_node):
            self._start(node)
        assert self.lc is not None
        return ClusterHandle(self.lc, self.with_node)

    def _start(self, node: bool) -> None:
        self._lock()
        state = os.environ.get("TOPODRA_TEST_CLUSTER_DIR") or tempfile.mkdtemp(prefix="topodra-test-cluster-")
        if self.lc is not None:
            self._stop_cluster()
        lc = localcluster.Cluster(state_dir=Path(state))
        if not os.environ.get("TOPODRA_TEST_CLUSTER_DIR"):
            # A fresh temp dir: let the harness own it (it refuses non-empty foreign dirs).
            Path(state).rmdir()
        lc.up(node=node, build=True)
        self.lc, self.with_node, self.owned = lc, node, True

    def _stop_cluster(self) -> None:
        if self.lc is not None and self.owned:
            os.environ["TOPODRA_LOG_ARCHIVE"] = str(LOG_ARCHIVE)
            pids = dict(self.lc.meta().get("pids") or {})
            self.lc.down(quiet=True, keep_logs=True)
            # `down` must leave nothing behind: no process, no mount, no state directory.
            alive = {n: p for n, p in pids.items() if localcluster.pid_alive(p)}
            mounts = list(self.lc._mounts())
            if alive or mounts or self.lc.state_dir.exists():
                self.leftovers.append(f"after down: processes {alive}, mounts {mounts}, "
                                      f"state dir exists: {self.lc.state_dir.exists()}")
        self.lc = None

    def stop(self) -> None:
        self._stop_cluster()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


_MANAGER = _Manager()


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterHandle]:
    yield _MANAGER.get(node=False)


@pytest.fixture(scope="session")
def node_cluster() -> Iterator[ClusterHandle]:
    yield _MANAGER.get(node=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _MANAGER.stop()
    if _MANAGER.leftovers:
        print("\nhack/cluster down left things behind:\n  " + "\n  ".join(_MANAGER.leftovers), file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run node tests last and cluster tests before them, so the cluster is upgraded at most once."""
    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("node"):
            return 2
        if item.get_closest_marker("cluster"):
            return 1
        return 0
    items.sort(key=rank)


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True)
