"""Real Kueue (controller-manager built from Go modules by hack/build-bins) on the local cluster.

``start(cluster)`` installs Kueue's CRDs, a ClusterRole for Kueue's own client identity (a client
certificate from the cluster CA, so RBAC is real, not system:masters), and webhook configurations that
point at Kueue's webhook server on 127.0.0.1 (serving certificate from the cluster CA, ``caBundle`` set),
then runs the controller-manager as a cluster process (``hack/cluster down`` stops it).  ``stop(cluster)``
removes every object ``start`` made, so the rest of a shared test cluster never sees Kueue.

Kueue acts only where asked: ``manageJobsWithoutQueueName: false``, the Job integration only, and the
Job webhooks carry a namespace selector (``topodra.io/kueue: enabled``), so a pod or Job elsewhere is
never sent to Kueue, even while Kueue is down.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from testkit.log import log
from testkit.ports import port_holder

if TYPE_CHECKING:
    from testkit.cluster import Cluster

KUEUE_VERSION = "v0.17.0"
NAMESPACE = "kueue-system"
IDENTITY = "topodra-kueue"  # the client certificate's CN: Kueue's user name for RBAC
ROLE = "topodra-kueue-manager"
WEBHOOK_PREFIX = "topodra-kueue"
NAMESPACE_LABEL = ("topodra.io/kueue", "enabled")
FRAMEWORKS = ("batch/job",)
WEBHOOK_PORT = 9443  # hack/cluster up --kueue; tests pick free ports
HEALTH_PORT = 8081
# Kueue reads its metrics serving certificate from this fixed path whenever its internal certificate
# management is off (cmd/kueue/main.go in v0.17.0), even with metrics disabled.
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")
# Kueue's own objects: their webhooks apply everywhere (they are Kueue's API, not users' workloads).
OWN_PATH_MARK = "-kueue-x-k8s-io-"
FRAMEWORK_PATHS = {"batch/job": "-batch-v1-job"}


class KueueError(RuntimeError):
    """Kueue could not be installed or started; the message says which step and why."""


@dataclass(frozen=True)
class Manifests:
    """Kueue's release manifests, copied next to the binary by hack/build-bins."""

    crds: list[dict[str, Any]]
    role: dict[str, Any]
    webhooks: list[dict[str, Any]]

    @classmethod
    def load(cls, bin_dir: Path) -> Manifests:
        root = bin_dir / "kueue-manifests"
        if not (bin_dir / "kueue").exists() or not root.is_dir():
            raise KueueError(f"Kueue is not built in {bin_dir} (run hack/build-bins)")
        crds = [yaml.safe_load(p.read_text()) for p in sorted((root / "crd").glob("*.yaml"))]
        role = next(d for d in yaml.safe_load_all((root / "role.yaml").read_text())
                    if d and d.get("kind") == "ClusterRole")
        webhooks = [d for d in yaml.safe_load_all((root / "webhooks.yaml").read_text()) if d]
        return cls(crds, role, webhooks)


def webhook_configurations(docs: list[dict[str, Any]], port: int, ca_pem: bytes,
                           frameworks: tuple[str, ...] = FRAMEWORKS) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, served on 127.0.0.1:port, for its own API and ``frameworks`` only.

    Pure.  Service references become loopback URLs (no Service, no kube-proxy here); webhooks of
    integrations that are not enabled are dropped (Kueue would not serve their paths); workload
    webhooks get the namespace selector that opts a namespace in.
    """
    marks = [FRAMEWORK_PATHS[f] for f in frameworks]
    ca = base64.b64encode(ca_pem).decode()
    out = []
    for doc in docs:
        kind = doc["kind"]
        hooks = []
        for hook in doc.get("webhooks") or []:
            path = hook["clientConfig"]["service"]["path"]
            own = OWN_PATH_MARK in path
            if not own and not any(path.endswith(m) for m in marks):
                continue
            h = {**hook, "clientConfig": {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca}}
            if not own:
                h["namespaceSelector"] = {"matchLabels": {NAMESPACE_LABEL[0]: NAMESPACE_LABEL[1]}}
            hooks.append(h)
        suffix = "mutating" if kind == "MutatingWebhookConfiguration" else "validating"
        out.append({"apiVersion": "admissionregistration.k8s.io/v1", "kind": kind,
                    "metadata": {"name": f"{WEBHOOK_PREFIX}-{suffix}"}, "webhooks": hooks})
    return out


def configuration(webhook_port: int, health_port: int, cert_dir: Path) -> dict[str, Any]:
    """Kueue's Configuration for the local cluster (pure)."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "managedJobsNamespaceSelector": {"matchLabels": {NAMESPACE_LABEL[0]: NAMESPACE_LABEL[1]}},
        "integrations": {"frameworks": list(FRAMEWORKS)},
        "clientConnection": {"qps": 100, "burst": 200},
        # The on-demand visibility API would need an APIService and a port of its own; not used here.
        "featureGates": {"VisibilityOnDemand": False},
    }


def _issue(c: Cluster, name: str, cn: str, server: bool) -> None:
    """A key and certificate signed by the cluster CA into the cluster's PKI dir."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    pki = c.pki
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
         .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now).not_valid_after(now + dt.timedelta(days=30))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.ExtendedKeyUsage(
             [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
    cert = b.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    (pki / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                        serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
    os.chmod(pki / f"{name}.key", 0o600)
    (pki / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _kubectl(c: Cluster, bins: Path, *args: str, input: str | None = None) -> str:
    r = subprocess.run([str(bins / "kubectl"), f"--kubeconfig={c.admin_kubeconfig}", *args],
                       capture_output=True, text=True, input=input, timeout=120, check=False)
    if r.returncode != 0:
        raise KueueError(f"kubectl {' '.join(args[:2])} failed: {r.stderr.strip()}")
    return r.stdout


def _apiserver(c: Cluster) -> str:
    cfg = json.loads(c.admin_kubeconfig.read_text())
    return str(cfg["clusters"][0]["cluster"]["server"])


def _kueue_dir(c: Cluster) -> Path:
    return c.state_dir / "kueue"


def start(c: Cluster, webhook_port: int, health_port: int, timeout: float = 120) -> None:
    """Install Kueue into the running cluster and start its controller-manager; wait until it admits.

    On any failure everything installed so far is removed again (a half-installed Kueue's webhooks
    would otherwise reject requests on the shared cluster)."""
    if c.running().get("kueue") or c.meta().get("kueue"):
        raise KueueError("Kueue already runs in this cluster (testkit.kueue.stop first)")
    for port in (webhook_port, health_port):
        if holder := port_holder(port):
            raise KueueError(f"port 127.0.0.1:{port} for Kueue is in use by {holder}")
    try:
        _install(c, webhook_port, health_port, timeout)
    except BaseException:
        if c.meta().get("kueue"):
            with contextlib.suppress(Exception):
                stop(c)
        raise


def _install(c: Cluster, webhook_port: int, health_port: int, timeout: float) -> None:
    bins = Path(c.meta()["bin_dir"])
    man = Manifests.load(bins)
    t0 = time.monotonic()
    kdir = _kueue_dir(c)
    certs = kdir / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    _issue(c, "kueue-webhook", "kueue-webhook", server=True)
    _issue(c, IDENTITY, IDENTITY, server=False)
    shutil.copy2(c.pki / "kueue-webhook.crt", certs / "tls.crt")
    shutil.copy2(c.pki / "kueue-webhook.key", certs / "tls.key")
    meta = c.meta()
    if not METRICS_CERT_DIR.exists():
        created = next(p for p in (*reversed(METRICS_CERT_DIR.parents), METRICS_CERT_DIR) if not p.exists())
        METRICS_CERT_DIR.mkdir(parents=True)
        meta["kueue_host_dir"] = str(created)
    for f in ("tls.crt", "tls.key"):
        shutil.copy2(certs / f, METRICS_CERT_DIR / f)
    meta["kueue"] = {"webhook_port": webhook_port, "health_port": health_port}
    c._save(meta)
    kubeconfig = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": _apiserver(c),
                                                   "certificate-authority": str(c.pki / "ca.crt")}}],
        "users": [{"name": IDENTITY, "user": {"client-certificate": str(c.pki / f"{IDENTITY}.crt"),
                                              "client-key": str(c.pki / f"{IDENTITY}.key")}}],
        "contexts": [{"name": IDENTITY, "context": {"cluster": "local", "user": IDENTITY}}],
        "current-context": IDENTITY}
    (kdir / "kubeconfig").write_text(json.dumps(kubeconfig, indent=2))
    (kdir / "config.yaml").write_text(json.dumps(configuration(webhook_port, health_port, certs), indent=2))

    # CRDs are big: server-side apply keeps them out of the last-applied annotation.
    _kubectl(c, bins, "apply", "--server-side", "--force-conflicts", "-f", "-",
             input="\n---\n".join(json.dumps(d) for d in man.crds))
    _kubectl(c, bins, "wait", "--for=condition=Established", "--timeout=60s",
             *[f"crd/{d['metadata']['name']}" for d in man.crds])
    role = {**man.role, "metadata": {"name": ROLE}}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": ROLE},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ROLE},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": IDENTITY}]}
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    # As config/components/rbac/manager_secrets_role.yaml: Kueue's cache watches Secrets in its namespace
    # and no controller starts until that informer syncs.
    secrets = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": f"{ROLE}-secrets", "namespace": NAMESPACE},
               "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list", "update", "watch"]}]}
    secrets_binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                       "metadata": {"name": f"{ROLE}-secrets", "namespace": NAMESPACE},
                       "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{ROLE}-secrets"},
                       "subjects": binding["subjects"]}
    hooks = webhook_configurations(man.webhooks, webhook_port, (c.pki / "ca.crt").read_bytes())
    _kubectl(c, bins, "apply", "-f", "-", input="\n---\n".join(
        json.dumps(d) for d in [ns, role, binding, secrets, secrets_binding, *hooks]))

    c.start_process("kueue", [str(bins / "kueue"), f"--config={kdir / 'config.yaml'}",
                              "--zap-log-level=2"], env={"KUBECONFIG": str(kdir / "kubeconfig")})
    c._wait("kueue", lambda: _http_ok(f"http://127.0.0.1:{health_port}/readyz"), timeout)
    # Ready means the webhook server answers: a dry-run ResourceFlavor goes through Kueue's webhooks.
    probe = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
             "metadata": {"name": "topodra-kueue-probe"}}
    c._wait("kueue", lambda: bool(c.kube().request("POST", "/apis/kueue.x-k8s.io/v1beta2/resourceflavors",
                                                    probe, query={"dryRun": "All"})), timeout)
    # ...and the controllers run (they start only once every informer synced, RBAC permitting):
    # a ClusterQueue becomes Active.
    cq = "/apis/kueue.x-k8s.io/v1beta2/clusterqueues"
    c.kube().create(cq, {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
                         "metadata": {"name": "topodra-kueue-probe"}, "spec": {"namespaceSelector": {}}})

    def active() -> bool:
        conds = ((c.kube().get(f"{cq}/topodra-kueue-probe") or {}).get("status") or {}).get("conditions") or []
        return any(x.get("type") == "Active" and x.get("status") == "True" for x in conds)

    c._wait("kueue", active, timeout)
    c.kube().delete(f"{cq}/topodra-kueue-probe")
    log(f"Kueue {KUEUE_VERSION} ready in {time.monotonic() - t0:.1f}s "
        f"(webhooks on 127.0.0.1:{webhook_port}, namespaces labelled {'='.join(NAMESPACE_LABEL)})")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return bool(r.status == 200)
    except urllib.error.URLError:
        return False


def stop(c: Cluster, remove: bool = True) -> None:
    """Stop Kueue; with ``remove``, delete its webhooks, RBAC, CRDs (and so every Kueue object), namespace."""
    pid = c.running().get("kueue")
    if pid:
        c._stop("kueue", pid)
    meta = c.meta()
    if remove and meta.get("kueue"):
        bins = Path(meta["bin_dir"])
        man = Manifests.load(bins)
        # Webhooks first: with Kueue gone they would fail every request they match.
        names = [f"mutatingwebhookconfiguration/{WEBHOOK_PREFIX}-mutating",
                 f"validatingwebhookconfiguration/{WEBHOOK_PREFIX}-validating",
                 f"clusterrolebinding/{ROLE}", f"clusterrole/{ROLE}"]
        _kubectl(c, bins, "delete", "--ignore-not-found", "--wait=true", *names)
        # Kueue's finalizers would hold its objects for ever now that it is stopped.
        for crd in man.crds:
            plural = crd["spec"]["names"]["plural"]
            group = crd["spec"]["group"]
            with contextlib.suppress(KueueError):
                out = _kubectl(c, bins, "get", f"{plural}.{group}", "-A", "-o", "json")
                for item in json.loads(out).get("items") or []:
                    if item["metadata"].get("finalizers"):
                        m = item["metadata"]
                        ns_args = ["-n", m["namespace"]] if m.get("namespace") else []
                        _kubectl(c, bins, "patch", f"{plural}.{group}", m["name"], *ns_args, "--type=merge",
                                 "-p", '{"metadata":{"finalizers":null}}')
        _kubectl(c, bins, "delete", "--ignore-not-found", "--wait=true", "--timeout=120s",
                 *[f"crd/{d['metadata']['name']}" for d in man.crds], f"namespace/{NAMESPACE}")
        meta = c.meta()
        meta.pop("kueue", None)
        c._save(meta)
    if remove_host_dir(meta):
        c._save(meta)
    log("Kueue stopped" + (" and removed" if remove else ""))


def remove_host_dir(meta: dict[str, Any]) -> bool:
    """Remove the certificate directory ``start`` created outside the state dir (``down`` calls this too)."""
    created = meta.pop("kueue_host_dir", None)
    if created:
        shutil.rmtree(created, ignore_errors=True)
    return bool(created)
