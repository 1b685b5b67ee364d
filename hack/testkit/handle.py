"""What cluster tests get from the fixtures: a handle on the running cluster, and ``wait_for``."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from testkit.cluster import Cluster
from testkit.paths import REPO

from topodra.kube import Kube, SimpleConfig, Urllib3Transport


class KubectlError(RuntimeError):
    """kubectl exited non-zero. Not an AssertionError: inside ``wait_for`` it is a transient failure
    (the object is not there yet), retried like an API error, not a verdict that ends the wait."""


class ClusterHandle:
    """What tests get: kubeconfig, an admin client, kubectl, YAML apply, fake nodes."""

    def __init__(self, lc: Cluster, with_node: bool) -> None:
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
            raise KubectlError(f"kubectl {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
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
        """(status, body) of one API call made with ``token`` instead of the admin's certificate.

        Goes through topodra's own client with a bearer token and no client certificate -- the way the
        plugin authenticates in a pod -- and keeps the exact status (201 vs 200) the tests assert on."""
        transport = Urllib3Transport(SimpleConfig(server=self.kube.host, ca_file=str(self.lc.pki / "ca.crt"),
                                                  token=token))
        try:
            status, _reason, raw = transport.send(
                method, path, json.dumps(body).encode() if body is not None else None,
                {"Content-Type": content_type, "Accept": "application/json"}, 10)
        finally:
            transport.close()
        return status, json.loads(raw or b"{}")

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
    """Poll ``fn`` until it returns something truthy; fail with ``what`` on timeout.

    Any other exception (an API error, a kubectl that found nothing yet) is transient and retried;
    an AssertionError is ``fn``'s verdict ("the pod Failed") and ends the wait at once, so a
    fail-fast predicate fails in a poll interval, not after the whole timeout."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            v = fn()
            if v:
                return v
        except AssertionError:
            raise
        except Exception as e:
            last_exc = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" +
                         (f" (last error: {last_exc})" if last_exc else ""))
