"""A real, local, loopback-only Kubernetes cluster built from Go modules.

etcd -> kube-apiserver -> kube-controller-manager -> kube-scheduler run as host
processes; ``--node`` adds containerd (CDI on) and a real kubelet; ``--fake-nodes``
adds kubelet-less Ready Node objects for scheduling at scale.  Everything binds to
127.0.0.1 or unix sockets.  State (PKI, kubeconfigs, pids, logs, etcd data) lives
in one directory; ``down`` stops exactly the processes recorded there, unmounts
what the node left mounted, restores sysctls and /etc/hosts, and removes it.

Used by ``hack/cluster`` (CLI) and by the pytest fixtures in ``tests/conftest.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HACK = Path(__file__).resolve().parent
REPO = HACK.parent
K8S_VERSION = "v1.37.2"
NODE_NAME = "topodra-node"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10.1"
BUSYBOX_IMAGE = "localhost/busybox:1.35"
SERVICE_CIDR = "10.0.0.0/24"
KUBELET_ROOT = Path("/var/lib/kubelet")
HOSTS_MARK = "# topodra-cluster"
SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops")

PORTS = {
    "etcd": [2379, 2380],
    "kube-apiserver": [6443],
    "kube-controller-manager": [10257],
    "kube-scheduler": [10259],
    "kubelet": [10250, 10248],
}
KUBELET_PORTS = PORTS["kubelet"]


@dataclass(frozen=True)
class Ports:
    """Where one cluster instance's control plane listens (127.0.0.1). The defaults are the shared
    cluster's fixed ports; ``Ports.free()`` gives a private instance its own."""

    etcd: int = 2379
    etcd_peer: int = 2380
    apiserver: int = 6443
    controller_manager: int = 10257
    scheduler: int = 10259

    @classmethod
    def free(cls) -> Ports:
        """Five distinct ports nothing listens on now, from FREE_PORT_RANGE (never the fixed ones)."""
        picked: list[int] = []
        while len(picked) < 5:
            port = free_port()
            if port not in picked:
                picked.append(port)
        return cls(*picked)

    def by_component(self) -> dict[str, list[int]]:
        return {"etcd": [self.etcd, self.etcd_peer], "kube-apiserver": [self.apiserver],
                "kube-controller-manager": [self.controller_manager], "kube-scheduler": [self.scheduler],
                "kubelet": list(KUBELET_PORTS)}

    @property
    def is_default(self) -> bool:
        return self == Ports()


class ClusterError(RuntimeError):
    """A clear, user-facing failure: which component, what happened, the log tail."""


# --------------------------------------------------------------------------- scheduler configuration

SCHEDULER_CONFIG_API = "kubescheduler.config.k8s.io/v1"
# Extender scores are 0..10 and the scheduler multiplies them by weight * 10 (MaxNodeScore /
# MaxExtenderPriority). With weight 5 one step of the scorer's scale is worth 50 points: more than the
# whole spread LeastAllocated + BalancedAllocation put between nodes that differ by one GPU job's
# CPU/memory share (a few points each), yet the full 0..10 range (500) does not outweigh a required
# filter -- extenders never override filters -- only the default scores.
SCHEDULER_EXTENDER_WEIGHT = 5


def extender_stanza(url: str, weight: int = SCHEDULER_EXTENDER_WEIGHT) -> dict[str, Any]:
    """The ``extenders[]`` entry for topodra's placement scorer: prioritize only, never a veto."""
    if not url.startswith(("http://", "https://")):
        raise ClusterError(f"scheduler extender URL must start with http:// or https://, got {url!r}")
    return {"urlPrefix": url.rstrip("/"), "prioritizeVerb": "prioritize", "weight": weight,
            "nodeCacheCapable": True, "ignorable": True, "httpTimeout": "1s", "enableHTTPS": False}


def scheduler_configuration(base: dict[str, Any] | None, kubeconfig: Path,
                            extender: str | None = None) -> dict[str, Any]:
    """The KubeSchedulerConfiguration the harness runs: ``base`` plus our kubeconfig (and extender).

    Pure. ``base`` may tune ``clientConnection`` (``qps``, ``burst``) but not set its
    ``kubeconfig``: the harness owns the credentials.
    """
    import copy

    cfg: dict[str, Any] = copy.deepcopy(base) if base else {
        "apiVersion": SCHEDULER_CONFIG_API, "kind": "KubeSchedulerConfiguration"}
    if not isinstance(cfg, dict) or cfg.get("kind") != "KubeSchedulerConfiguration" \
            or cfg.get("apiVersion") != SCHEDULER_CONFIG_API:
        raise ClusterError(f"scheduler config must be a KubeSchedulerConfiguration of apiVersion "
                           f"{SCHEDULER_CONFIG_API}, got kind={cfg.get('kind') if isinstance(cfg, dict) else cfg!r} "
                           f"apiVersion={cfg.get('apiVersion') if isinstance(cfg, dict) else None!r}")
    conn = cfg.get("clientConnection") or {}
    if not isinstance(conn, dict) or "kubeconfig" in conn:
        raise ClusterError("scheduler config must not set clientConnection.kubeconfig: the harness fills it in")
    cfg["clientConnection"] = {**conn, "kubeconfig": str(kubeconfig)}
    cfg.setdefault("leaderElection", {"leaderElect": False})
    if extender:
        cfg["extenders"] = [*(cfg.get("extenders") or []), extender_stanza(extender)]
    return cfg


def log(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def default_state_dir() -> Path:
    return Path(os.environ.get("TOPODRA_CLUSTER_DIR", "/var/lib/topodra-cluster"))


def bin_dir(build: bool) -> Path:
    """The cached binaries directory; builds what is missing when ``build``."""
    args = [str(HACK / "build-bins")] + ([] if build else ["--print"])
    out = subprocess.run(args, check=False, stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise ClusterError("hack/build-bins failed (see its output above)")
    return Path(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- PKI


def _pki(pki: Path, node_name: str) -> None:
    """CA, apiserver serving cert, one client cert per identity, SA signing key."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    pki.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    later = now + dt.timedelta(days=30)

    def write_key(name: str, key: Any) -> None:
        (pki / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        os.chmod(pki / f"{name}.key", 0o600)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "topodra-local-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now).not_valid_after(later)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    write_key("ca", ca_key)
    (pki / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def issue(name: str, cn: str, orgs: tuple[str, ...] = (), server: bool = False) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, cn))
        b = (x509.CertificateBuilder().subject_name(x509.Name(attrs)).issuer_name(ca_name)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now).not_valid_after(later)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage(
                 [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]),
                 critical=False))
        if server:
            b = b.add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
                x509.DNSName("localhost"), x509.DNSName("kubernetes"),
                x509.DNSName("kubernetes.default"), x509.DNSName("kubernetes.default.svc"),
                x509.DNSName("kubernetes.default.svc.cluster.local")]), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        write_key(name, key)
        (pki / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    issue("apiserver", "kube-apiserver", server=True)
    issue("admin", "topodra-admin", ("system:masters",))
    issue("kube-controller-manager", "system:kube-controller-manager")
    issue("kube-scheduler", "system:kube-scheduler")
    issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", ("system:masters",))
    issue("node", f"system:node:{node_name}", ("system:nodes",))
    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    write_key("sa", sa)
    (pki / "sa.pub").write_bytes(sa.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


def _kubeconfig(path: Path, pki: Path, ident: str, apiserver_port: int = 6443) -> None:
    cfg = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": {
            "server": f"https://127.0.0.1:{apiserver_port}", "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": ident, "user": {
            "client-certificate": str(pki / f"{ident}.crt"), "client-key": str(pki / f"{ident}.key")}}],
        "contexts": [{"name": ident, "context": {"cluster": "local", "user": ident}}],
        "current-context": ident,
    }
    path.write_text(json.dumps(cfg, indent=2))  # JSON is valid YAML


# --------------------------------------------------------------------------- helpers


def port_holder(port: int) -> str | None:
    """None if 127.0.0.1:port is free, else a description of what holds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            pass
        else:
            return None
    try:
        out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True,
                             check=False).stdout.strip()
    except FileNotFoundError:
        out = ""
    return out or "unknown process"


# Every user of the fixed-port local cluster (pytest fixtures, benchmarks) takes this lock first.
CLUSTER_LOCK_FILE = "/tmp/topodra-test-cluster.lock"


def instance_lock_file(instance: str) -> str:
    """The lock of a private cluster instance (see ``Cluster.private``): one run per instance name."""
    if not instance or not all(ch.isalnum() or ch in "-_" for ch in instance):
        raise ClusterError(f"cluster instance name must be letters, digits, '-' or '_', got {instance!r}")
    return f"/tmp/topodra-cluster-{instance}.lock"


@contextlib.contextmanager
def cluster_lock(timeout: float, path: str = CLUSTER_LOCK_FILE) -> Iterator[None]:
    """The local cluster uses fixed ports: take turns with the pytest fixtures and other benchmarks.

    ``path`` names another lock (``instance_lock_file``) for a private instance, which shares
    nothing with the fixed-port cluster and so never waits for it.
    A blocking flock (bounded by SIGALRM) queues us fairly behind the other waiters; polling with
    LOCK_NB let every blocking waiter (pytest) go first, so a bench could wait for ever."""
    import fcntl

    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for {path} (another test session or benchmark runs a cluster)")

            def expired(_sig: int, _frame: object) -> None:
                raise TimeoutError

            old = signal.signal(signal.SIGALRM, expired)
            signal.alarm(max(1, int(timeout)))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except TimeoutError:
                raise ClusterError(f"{path} still held by another cluster user after "
                                   f"{timeout:.0f}s") from None
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, old)
        yield
    finally:
        os.close(fd)


# Ports for test and bench listeners: below Linux's ephemeral range (32768-60999), so the
# kernel never hands them to an outgoing connection (an apiserver->etcd socket in TIME_WAIT
# on a port in that range once broke every plugin e2e test). Above the cluster's own ports.
FREE_PORT_RANGE = (20000, 32000)


def free_port() -> int:
    """A loopback TCP port in FREE_PORT_RANGE that nothing is bound to right now."""
    import random

    lo, hi = FREE_PORT_RANGE
    for port in random.sample(range(lo, hi), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise ClusterError(f"no free loopback port in {lo}-{hi} after 200 tries")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def proc_status(pid: int) -> dict[str, int]:
    """Memory fields of /proc/<pid>/status in KiB, plus Threads."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem", "Threads"):
            out[key] = int(rest.split()[0])
    return out


def rss_mib(pid: int) -> float:
    with contextlib.suppress(OSError, KeyError):
        return proc_status(pid)["VmRSS"] / 1024
    return 0.0


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def children_of(pids: set[int]) -> set[int]:
    """All live descendants of ``pids`` (from /proc)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = set(pids)
    while frontier:
        nxt = {p for p, pp in parent.items() if pp in frontier and p not in found}
        found |= nxt
        frontier = nxt
    return found


def procs_matching(needle: str) -> set[int]:
    out: set[int] = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    out.add(int(d.name))
    return out


# --------------------------------------------------------------------------- cluster


@dataclass
class Cluster:
    state_dir: Path = field(default_factory=default_state_dir)
    node_name: str = NODE_NAME
    ports: Ports = field(default_factory=Ports)

    @classmethod
    def private(cls, instance: str) -> Cluster:
        """A kubelet-less cluster of its own (for benchmarks): a fresh state directory and free
        ports in FREE_PORT_RANGE, so it runs beside the shared fixed-port cluster of the tests.
        Callers serialize runs of one instance with ``cluster_lock(t, instance_lock_file(instance))``."""
        import tempfile

        instance_lock_file(instance)  # validates the name
        state = Path(tempfile.mkdtemp(prefix=f"topodra-cluster-{instance}-"))
        state.rmdir()  # ``up`` refuses a foreign non-empty dir; let it create its own
        return cls(state_dir=state, ports=Ports.free())

    @classmethod
    def attach(cls, state_dir: Path) -> Cluster:
        """The cluster recorded in ``state_dir`` (its ports from cluster.json; the fixed ones if none)."""
        c = cls(state_dir=state_dir)
        recorded = c.meta().get("ports")
        if isinstance(recorded, dict):
            c.ports = Ports(**recorded)
        return c

    @property
    def pki(self) -> Path:
        return self.state_dir / "pki"

    @property
    def logs(self) -> Path:
        return self.state_dir / "logs"

    @property
    def meta_path(self) -> Path:
        return self.state_dir / "cluster.json"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.state_dir / "admin.kubeconfig"

    @property
    def containerd_state(self) -> Path:
        return Path("/run/topodra-containerd")

    @property
    def containerd_sock(self) -> Path:
        return self.containerd_state / "containerd.sock"

    # ----- metadata (pids etc.)

    def meta(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(self.meta_path.read_text())
            return data
        except (OSError, ValueError):
            return {}

    def _save(self, meta: dict[str, Any]) -> None:
        tmp = self.meta_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=2))
        tmp.replace(self.meta_path)

    def running(self) -> dict[str, int]:
        return {n: p for n, p in (self.meta().get("pids") or {}).items() if pid_alive(p)}

    # ----- API access for the harness itself (stdlib only)

    def _ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    def api(self, method: str, path: str, body: Any = None, timeout: float = 10) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"https://127.0.0.1:{self.ports.apiserver}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              "Accept": "application/json"})
        with urllib.request.urlopen(req, context=self._ssl(), timeout=timeout) as r:
            raw = r.read()
        return json.loads(raw) if raw.startswith(b"{") else raw.decode()

    # ----- processes

    def start_process(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        """Start a process whose PID, log and lifetime this cluster manages (down stops it)."""
        self.logs.mkdir(parents=True, exist_ok=True)
        logf = (self.logs / f"{name}.log").open("ab")
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, **(env or {})})
        meta = self.meta()
        meta.setdefault("pids", {})[name] = proc.pid
        self._save(meta)
        log(f"started {name} (pid {proc.pid}), log {self.logs / (name + '.log')}")
        return proc.pid

    def _wait(self, name: str, check: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pid = self.meta()["pids"][name]
        last = ""
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                raise ClusterError(f"{name} exited during startup. Last log lines:\n"
                                   f"{tail(self.logs / (name + '.log'))}")
            try:
                if check():
                    return
            except Exception as e:
                last = str(e)
            time.sleep(0.5)
        raise ClusterError(f"{name} not ready after {timeout:.0f}s ({last}). Last log lines:\n"
                           f"{tail(self.logs / (name + '.log'))}")

    def _https_ok(self, port: int, path: str) -> bool:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        if port != self.ports.apiserver:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        else:
            ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        with urllib.request.urlopen(f"https://127.0.0.1:{port}{path}", context=ctx, timeout=3) as r:
            return bool(r.status == 200)

    # ----- up

    def preflight(self, node: bool) -> None:
        alive = self.running()
        if alive:
            raise ClusterError(f"a cluster is already running from {self.state_dir} "
                               f"({', '.join(f'{n}={p}' for n, p in alive.items())}); "
                               "run 'hack/cluster down' first")
        if self.state_dir.exists() and any(self.state_dir.iterdir()):
            if not self.meta_path.exists():
                raise ClusterError(f"{self.state_dir} exists and is not a topodra cluster directory; "
                                   "refusing to touch it (set TOPODRA_CLUSTER_DIR)")
            log(f"removing stale state of a stopped cluster in {self.state_dir}")
            self.down(quiet=True)
        comps = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"]
        if node:
            comps.append("kubelet")
        ports = self.ports.by_component()
        busy = [f"127.0.0.1:{p} ({c}) is in use by {h}" for c in comps for p in ports[c]
                if (h := port_holder(p))]
        if busy:
            raise ClusterError("ports needed by the cluster are in use:\n  " + "\n  ".join(busy))
        if node:
            marker = KUBELET_ROOT / ".topodra-cluster"
            if KUBELET_ROOT.exists() and any(KUBELET_ROOT.iterdir()) and not marker.exists():
                raise ClusterError(f"{KUBELET_ROOT} is in use by another kubelet; refusing to start a node")
            if self.containerd_sock.exists() and procs_matching(str(self.containerd_sock)):
                raise ClusterError(f"a containerd already serves {self.containerd_sock}")

    def up(self, node: bool = False, fake_nodes: int = 0, build: bool = True,
           scheduler_config: dict[str, Any] | None = None, scheduler_extender: str | None = None) -> None:
        """Start the cluster. ``scheduler_config`` (a KubeSchedulerConfiguration without
        clientConnection) and ``scheduler_extender`` (a prioritize-only extender URL) shape kube-scheduler."""
        t0 = time.monotonic()
        if node and not self.ports.is_default:
            raise ClusterError("a cluster on private ports cannot run a node: the kubelet's ports, "
                               f"{KUBELET_ROOT} and containerd's state are host-wide (use fake nodes)")
        if scheduler_config is not None or scheduler_extender:
            # Fail on a bad config before anything starts.
            scheduler_configuration(scheduler_config, Path("kubeconfig"), scheduler_extender)
        bins = bin_dir(build)
        self.preflight(node)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._save({"pids": {}, "bin_dir": str(bins), "node": node, "node_name": self.node_name,
                    "started": time.time(), "ports": dataclasses.asdict(self.ports)})
        try:
            self._up_control_plane(bins, scheduler_config, scheduler_extender)
            log(f"control plane ready in {time.monotonic() - t0:.1f}s")
            if node:
                t1 = time.monotonic()
                self._up_node(bins)
                log(f"node {self.node_name} Ready in {time.monotonic() - t1:.1f}s")
            if fake_nodes:
                self.create_fake_nodes([f"fake-node-{i}" for i in range(fake_nodes)])
        except BaseException:
            log(f"startup failed; stopping what was started (logs kept in {self.logs})")
            self.down(quiet=True, keep_logs=True)
            raise
        log(f"cluster up in {time.monotonic() - t0:.1f}s")

    def _up_control_plane(self, bins: Path, scheduler_config: dict[str, Any] | None = None,
                          scheduler_extender: str | None = None) -> None:
        _pki(self.pki, self.node_name)
        for ident in ("admin", "kube-controller-manager", "kube-scheduler", "node"):
            _kubeconfig(self.state_dir / f"{ident}.kubeconfig", self.pki, ident, self.ports.apiserver)
        p = self.pki
        etcd = f"http://127.0.0.1:{self.ports.etcd}"
        peer = f"http://127.0.0.1:{self.ports.etcd_peer}"
        self.start_process("etcd", [
            str(bins / "etcd"), "--name=topodra", f"--data-dir={self.state_dir / 'etcd'}",
            f"--listen-client-urls={etcd}", f"--advertise-client-urls={etcd}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=topodra={peer}", "--listen-metrics-urls=",
            "--unsafe-no-fsync=true", "--log-level=warn"])
        self._wait("etcd", lambda: urllib.request.urlopen(f"{etcd}/health", timeout=2)
                   .status == 200, 60)
        self.start_process("kube-apiserver", [
            str(bins / "kube-apiserver"),
            f"--etcd-servers={etcd}", "--bind-address=127.0.0.1", f"--secure-port={self.ports.apiserver}",
            "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none",
            f"--tls-cert-file={p / 'apiserver.crt'}", f"--tls-private-key-file={p / 'apiserver.key'}",
            f"--client-ca-file={p / 'ca.crt'}",
            f"--kubelet-client-certificate={p / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={p / 'apiserver-kubelet-client.key'}",
            "--kubelet-preferred-address-types=Hostname",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction,ResourceQuota",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={p / 'sa.pub'}", f"--service-account-signing-key-file={p / 'sa.key'}",
            "--allow-privileged=true", "--storage-media-type=application/vnd.kubernetes.protobuf",
            "--profiling=false", "--v=1"])
        self._wait("kube-apiserver", lambda: self._https_ok(self.ports.apiserver, "/readyz"), 120)
        common = ["--bind-address=127.0.0.1", "--leader-elect=false", "--profiling=false", "--v=1"]
        self.start_process("kube-controller-manager", [
            str(bins / "kube-controller-manager"), *common, f"--secure-port={self.ports.controller_manager}",
            f"--kubeconfig={self.state_dir / 'kube-controller-manager.kubeconfig'}",
            f"--authentication-kubeconfig={self.state_dir / 'kube-controller-manager.kubeconfig'}",
            f"--authorization-kubeconfig={self.state_dir / 'kube-controller-manager.kubeconfig'}",
            f"--service-account-private-key-file={p / 'sa.key'}", f"--root-ca-file={p / 'ca.crt'}",
            "--use-service-account-credentials=true", f"--service-cluster-ip-range={SERVICE_CIDR}",
            # Kubelet-less fake nodes never heartbeat: a long grace period keeps them Ready while the
            # node lifecycle controller still removes the not-ready taint as on a real cluster.
            "--node-monitor-grace-period=8760h", "--controllers=*"])
        self._start_scheduler(bins, scheduler_config, scheduler_extender)
        self._wait("kube-controller-manager", lambda: self._https_ok(self.ports.controller_manager, "/healthz"), 90)
        self._wait("kube-scheduler", lambda: self._https_ok(self.ports.scheduler, "/healthz"), 90)
        # The default namespace's ServiceAccount shows the controller-manager is really working.
        self._wait("kube-controller-manager", lambda: bool(
            self.api("GET", "/api/v1/namespaces/default/serviceaccounts/default")), 60)

    # ----- scheduler

    def _start_scheduler(self, bins: Path, scheduler_config: dict[str, Any] | None,
                         scheduler_extender: str | None) -> None:
        kubeconfig = self.state_dir / "kube-scheduler.kubeconfig"
        argv = [str(bins / "kube-scheduler"), "--bind-address=127.0.0.1", f"--secure-port={self.ports.scheduler}",
                "--profiling=false", "--v=1",
                f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}"]
        meta = self.meta()
        if scheduler_config is None and not scheduler_extender:
            argv += ["--leader-elect=false", f"--kubeconfig={kubeconfig}"]
            meta.pop("scheduler_config", None)
        else:
            cfg = scheduler_configuration(scheduler_config, kubeconfig, scheduler_extender)
            path = self.state_dir / "kube-scheduler-config.yaml"
            path.write_text(json.dumps(cfg, indent=2))  # JSON is valid YAML
            argv.append(f"--config={path}")
            meta["scheduler_config"] = cfg
        self._save(meta)
        self.start_process("kube-scheduler", argv)

    def restart_scheduler(self, scheduler_config: dict[str, Any] | None = None,
                          scheduler_extender: str | None = None) -> None:
        """Run kube-scheduler again with another configuration (stock when both are None).

        Lets one running cluster compare scheduling policies; waits until the new one is healthy.
        """
        scheduler_configuration(scheduler_config, Path("kubeconfig"), scheduler_extender)  # validate first
        pid = self.running().get("kube-scheduler")
        if pid:
            self._stop("kube-scheduler", pid)
        self._start_scheduler(Path(self.meta()["bin_dir"]), scheduler_config, scheduler_extender)
        self._wait("kube-scheduler", lambda: self._https_ok(self.ports.scheduler, "/healthz"), 90)

    def scheduler_metrics(self, timeout: float = 10) -> str:
        """kube-scheduler's Prometheus text (e.g. ``scheduler_pending_pods``), read as the admin."""
        with urllib.request.urlopen(f"https://127.0.0.1:{self.ports.scheduler}/metrics", context=self._scheduler_ssl(),
                                    timeout=timeout) as r:
            return str(r.read().decode())

    def _scheduler_ssl(self) -> ssl.SSLContext:
        # The scheduler serves a self-signed certificate of its own: authenticate us, not it (loopback).
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    # ----- node

    def _hosts_entry(self) -> None:
        hosts = Path("/etc/hosts")
        text = hosts.read_text()
        if any(line.split()[1:2] == [self.node_name] for line in text.splitlines() if line.strip()):
            return
        hosts.write_text(text + ("" if text.endswith("\n") else "\n") +
                         f"127.0.0.1 {self.node_name} {HOSTS_MARK}\n")

    def _up_node(self, bins: Path) -> None:
        meta = self.meta()
        meta["sysctls"] = {k: Path("/proc/sys", k).read_text().strip() for k in SYSCTLS}
        self._save(meta)
        self._hosts_entry()
        cni = self.state_dir / "cni"
        cni.mkdir(parents=True, exist_ok=True)
        (cni / "10-loopback.conflist").write_text(
            '{"cniVersion":"1.0.0","name":"topodra-loopback","plugins":[{"type":"loopback"}]}\n')
        ctd_root = self.state_dir / "containerd"
        runc = shutil.which("runc") or "/usr/sbin/runc"
        (self.state_dir / "containerd.toml").write_text(f"""version = 3
root = "{ctd_root}"
state = "{self.containerd_state}"
[grpc]
  address = "{self.containerd_sock}"
[ttrpc]
  address = "{self.containerd_sock}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "{cni}"
""")
        env = {"PATH": f"{bins}:{os.environ.get('PATH', '')}"}
        self.start_process("containerd",
                           [str(bins / "containerd"), "--config", str(self.state_dir / "containerd.toml")], env=env)
        ctr = [str(bins / "ctr"), "--address", str(self.containerd_sock), "-n", "k8s.io"]
        self._wait("containerd", lambda: subprocess.run([*ctr, "version"], capture_output=True,
                                                        check=False).returncode == 0, 60)
        for tar in self._images():
            r = subprocess.run([*ctr, "images", "import", "--platform", "linux/amd64", str(tar)],
                               capture_output=True, text=True, check=False)
            if r.returncode != 0:
                raise ClusterError(f"importing {tar.name} into containerd failed: {r.stderr.strip()}")
        KUBELET_ROOT.mkdir(parents=True, exist_ok=True)
        (KUBELET_ROOT / ".topodra-cluster").write_text(str(self.state_dir))
        (self.state_dir / "kubelet.yaml").write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": "127.0.0.1", "healthzBindAddress": "127.0.0.1", "healthzPort": KUBELET_PORTS[1],
            "readOnlyPort": 0, "port": KUBELET_PORTS[0],
            "containerRuntimeEndpoint": f"unix://{self.containerd_sock}",
            "cgroupDriver": "cgroupfs", "failCgroupV1": False, "failSwapOn": False, "oomScoreAdj": 0,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(self.pki / "ca.crt")}},
            "authorization": {"mode": "AlwaysAllow"},
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "resolvConf": "/etc/resolv.conf", "serializeImagePulls": False,
            "localStorageCapacityIsolation": True,
            "registerNode": True, "syncFrequency": "10s", "fileCheckFrequency": "10s",
        }, indent=2))
        self.start_process("kubelet", [
            str(bins / "kubelet"), f"--config={self.state_dir / 'kubelet.yaml'}",
            f"--kubeconfig={self.state_dir / 'node.kubeconfig'}", f"--root-dir={KUBELET_ROOT}",
            f"--hostname-override={self.node_name}", "--v=2"], env=env)
        self._wait("kubelet", self._node_ready, 120)

    def _node_ready(self) -> bool:
        node = self.api("GET", f"/api/v1/nodes/{self.node_name}")
        conds = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
        return conds.get("Ready") == "True"

    def _images(self) -> list[Path]:
        """Build (once, cached next to the binaries) the pause and busybox OCI tarballs."""
        out = self.state_dir / "images"
        out.mkdir(parents=True, exist_ok=True)
        busybox = shutil.which("busybox") or "/bin/busybox"
        if not Path(busybox).exists():
            raise ClusterError("busybox-static is not installed (apt-get install busybox-static)")
        pause_root = out / "pause-root"
        pause_root.mkdir(exist_ok=True)
        r = subprocess.run(["gcc", "-static", "-Os", "-o", str(pause_root / "pause"), str(HACK / "images/pause.c")],
                           capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise ClusterError(f"building the pause binary failed: {r.stderr.strip()}")
        bb_root = out / "busybox-root"
        (bb_root / "bin").mkdir(parents=True, exist_ok=True)
        (bb_root / "tmp").mkdir(exist_ok=True)
        shutil.copy2(busybox, bb_root / "bin/busybox")
        for applet in ("sh", "env", "cat", "echo", "ls", "sleep", "true", "grep", "sort", "printenv"):
            link = bb_root / "bin" / applet
            if not link.exists():
                link.symlink_to("busybox")
        mk = HACK / "images/mkoci.py"
        tars = [(out / "pause.tar", pause_root, PAUSE_IMAGE, ["/pause"], []),
                (out / "busybox.tar", bb_root, BUSYBOX_IMAGE, [], ["/bin/sh"])]
        for tar, root, name, ep, cmd in tars:
            argv = [sys.executable, str(mk), "--rootfs", str(root), "--name", name, "-o", str(tar)]
            if ep:
                argv += ["--entrypoint", *ep]
            if cmd:
                argv += ["--cmd", *cmd]
            subprocess.run(argv, check=True)
        return [t[0] for t in tars]

    # ----- fake nodes

    def create_fake_nodes(self, names: list[str], labels: dict[str, str] | None = None) -> None:
        """Kubelet-less Ready nodes, built by the same code as ``topodra simulate`` uses."""
        try:
            from topodra.simulate import fake_node, fake_node_status
        except ImportError as e:
            raise ClusterError(f"fake nodes need the topodra package installed (make venv): {e}") from None
        for name in names:
            try:
                self.api("POST", "/api/v1/nodes", fake_node(name, labels))
            except urllib.error.HTTPError as e:
                if e.code != 409:
                    raise
            data = json.dumps(fake_node_status(name)).encode()
            url = f"https://127.0.0.1:{self.ports.apiserver}/api/v1/nodes/{name}/status"
            req = urllib.request.Request(url, data=data, method="PATCH",
                                         headers={"Content-Type": "application/merge-patch+json"})
            with urllib.request.urlopen(req, context=self._ssl(), timeout=10):
                pass
        log(f"fake nodes Ready: {', '.join(names)}")

    # ----- down

    def down(self, quiet: bool = False, keep_logs: bool = False) -> None:
        meta = self.meta()
        if not meta and not self.state_dir.exists():
            if not quiet:
                log("nothing to stop")
            return
        pids: dict[str, int] = meta.get("pids") or {}
        # A cluster on private ports never runs a node: containerd's shims, the kubelet's mounts,
        # /etc/hosts, sysctls and kubepods cgroups are host-wide and may belong to the shared cluster.
        host_node = meta.get("ports") is None or Ports(**meta["ports"]).is_default
        # Pods first: shims and container processes were started on containerd's behalf.
        ctd_procs = procs_matching(f"-address {self.containerd_sock}") if host_node else set()
        order = ["kubelet", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "containerd", "etcd"]
        for name in order:
            pid = pids.get(name)
            if pid and pid_alive(pid):
                self._stop(name, pid)
        leftovers = ctd_procs | children_of(ctd_procs)
        for pid in sorted(leftovers, reverse=True):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for name, pid in pids.items():
            if name not in order and pid_alive(pid):
                self._stop(name, pid)
        if meta.get("kueue_host_dir"):
            import localkueue

            localkueue.remove_host_dir(meta)
        if host_node:
            self._unmount()
            for key, value in (meta.get("sysctls") or {}).items():
                with contextlib.suppress(OSError):
                    Path("/proc/sys", key).write_text(value)
            self._remove_hosts_entry()
            self._remove_cgroups()
        if meta.get("node") and host_node:
            marker = KUBELET_ROOT / ".topodra-cluster"
            if marker.exists():
                shutil.rmtree(KUBELET_ROOT, ignore_errors=True)
            shutil.rmtree(self.containerd_state, ignore_errors=True)
        if keep_logs and self.logs.exists():
            dest = Path(os.environ.get("TOPODRA_LOG_ARCHIVE", str(self.state_dir) + "-logs"))
            dest = dest / time.strftime("%Y%m%d-%H%M%S")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(self.logs, dest, dirs_exist_ok=True)
            log(f"logs kept in {dest}")
        shutil.rmtree(self.state_dir, ignore_errors=True)
        if not quiet:
            log("cluster stopped; no process, mount or state left")

    def _stop(self, name: str, pid: int, grace: float = 10) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and pid_alive(pid):
            time.sleep(0.1)
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        log(f"stopped {name} (pid {pid})")

    def _mounts(self) -> Iterator[str]:
        roots = (str(KUBELET_ROOT), str(self.state_dir), str(self.containerd_state))
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            mp = line.split()[4].replace("\\040", " ")
            if mp in roots or mp.startswith(tuple(r + "/" for r in roots)):
                yield mp

    def _unmount(self) -> None:
        for _ in range(3):
            mps = sorted(set(self._mounts()), key=len, reverse=True)
            if not mps:
                return
            for mp in mps:
                r = subprocess.run(["umount", mp], capture_output=True, check=False)
                if r.returncode != 0:
                    subprocess.run(["umount", "-l", mp], capture_output=True, check=False)
        left = list(self._mounts())
        if left:
            log(f"WARNING: could not unmount: {left}")

    def _remove_hosts_entry(self) -> None:
        hosts = Path("/etc/hosts")
        with contextlib.suppress(OSError):
            text = hosts.read_text()
            kept = [ln for ln in text.splitlines() if not ln.rstrip().endswith(HOSTS_MARK)]
            if len(kept) != len(text.splitlines()):
                hosts.write_text("\n".join(kept) + "\n")

    def _remove_cgroups(self) -> None:
        root = Path("/sys/fs/cgroup")
        for hier in [root, *root.iterdir()] if root.exists() else []:
            kp = hier / "kubepods"
            if kp.is_dir():
                for d in sorted((p for p in kp.rglob("*") if p.is_dir()), key=lambda p: len(p.parts),
                                reverse=True):
                    with contextlib.suppress(OSError):
                        d.rmdir()
                with contextlib.suppress(OSError):
                    kp.rmdir()

    # ----- status

    def status(self) -> str:
        meta = self.meta()
        if not meta:
            return "no cluster (nothing running)"
        lines = [f"cluster dir {self.state_dir} (binaries {meta.get('bin_dir')})"]
        for name, pid in (meta.get("pids") or {}).items():
            state = f"running, {rss_mib(pid):.0f} MiB resident" if pid_alive(pid) else "NOT RUNNING"
            lines.append(f"  {name:24s} pid {pid:<8d} {state}")
        if self.running().get("kube-apiserver"):
            with contextlib.suppress(Exception):
                nodes = self.api("GET", "/api/v1/nodes")["items"]
                for n in nodes:
                    ready = {c["type"]: c["status"] for c in n["status"].get("conditions", [])}.get("Ready")
                    lines.append(f"  node {n['metadata']['name']:20s} Ready={ready}")
        lines.append(f"export KUBECONFIG={self.admin_kubeconfig}")
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="hack/cluster", description="Real local Kubernetes (loopback only).")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the control plane (and optionally a real node and fake nodes)")
    up.add_argument("--node", action="store_true", help="also start containerd + a real kubelet")
    up.add_argument("--fake-nodes", type=int, default=0, metavar="N", help="add N kubelet-less Ready nodes")
    up.add_argument("--no-build", action="store_true", help="fail instead of building missing binaries")
    up.add_argument("--scheduler-config", metavar="PATH.yaml", default=None,
                    help="run kube-scheduler with this KubeSchedulerConfiguration (without clientConnection)")
    up.add_argument("--scheduler-extender", metavar="URL", default=None,
                    help="add topodra's placement scorer at URL as a prioritize-only, ignorable extender")
    up.add_argument("--kueue", action="store_true",
                    help="also run Kueue's controller-manager (webhooks on 127.0.0.1:9443, see hack/localkueue.py)")
    down = sub.add_parser("down", help="stop everything this harness started and remove its state")
    down.add_argument("--keep-logs", action="store_true", help="copy component logs aside before removing state")
    sub.add_parser("status", help="say what is running")
    fk = sub.add_parser("fake-nodes", help="add kubelet-less Ready nodes to a running cluster")
    fk.add_argument("names", nargs="+")
    args = p.parse_args(argv)
    c = Cluster.attach(default_state_dir())
    try:
        if args.cmd == "up":
            sched_cfg = None
            if args.scheduler_config:
                import yaml

                try:
                    sched_cfg = yaml.safe_load(Path(args.scheduler_config).read_text())
                except (OSError, yaml.YAMLError) as e:
                    raise ClusterError(f"cannot read scheduler config {args.scheduler_config}: {e}") from None
            c.up(node=args.node, fake_nodes=args.fake_nodes, build=not args.no_build,
                 scheduler_config=sched_cfg, scheduler_extender=args.scheduler_extender)
            if args.kueue:
                import localkueue

                try:
                    localkueue.start(c, webhook_port=localkueue.WEBHOOK_PORT, health_port=localkueue.HEALTH_PORT)
                except (localkueue.KueueError, ClusterError) as e:
                    c.down(quiet=True, keep_logs=True)
                    raise ClusterError(f"Kueue: {e}") from None
            print(f"export KUBECONFIG={c.admin_kubeconfig}")
        elif args.cmd == "down":
            c.down(keep_logs=args.keep_logs)
        elif args.cmd == "status":
            print(c.status())
        elif args.cmd == "fake-nodes":
            c.create_fake_nodes(args.names)
    except ClusterError as e:
        print(f"hack/cluster: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
