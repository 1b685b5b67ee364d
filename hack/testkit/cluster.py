"""A real, local, loopback-only Kubernetes cluster built from Go modules.

etcd -> kube-apiserver -> kube-controller-manager -> kube-scheduler run as host
processes; ``--node`` adds containerd (CDI on) and a real kubelet; ``--fake-nodes``
adds kubelet-less Ready Node objects for scheduling at scale.  Everything binds to
127.0.0.1 or unix sockets.  State (PKI, kubeconfigs, pids, logs, etcd data) lives
in one directory; ``down`` stops exactly the processes recorded there, unmounts
what the node left mounted, restores sysctls and /etc/hosts, and removes it.

Used by ``hack/cluster`` (CLI, ``main`` below) and by the pytest fixtures in ``tests/conftest.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testkit import kueue
from testkit.errors import ClusterError
from testkit.locks import CLUSTER_LOCK_FILE, cluster_lock, instance_lock_file
from testkit.log import log
from testkit.paths import HACK, REPO
from testkit.pki import write_kubeconfig, write_pki
from testkit.ports import FREE_PORT_RANGE, KUBELET_PORTS, PORTS, Ports, free_port, port_holder
from testkit.procs import children_of, pid_alive, proc_status, procs_matching, rss_mib, tail
from testkit.schedconfig import (
    SCHEDULER_CONFIG_API,
    SCHEDULER_EXTENDER_WEIGHT,
    extender_stanza,
    scheduler_configuration,
)

from topodra.kube import Kube, KubeError

# Re-exported: callers that hold a Cluster reach the rest of its vocabulary here.
__all__ = ["CLUSTER_LOCK_FILE", "DEMO_OWNER", "FREE_PORT_RANGE", "NODE_NAME", "PORTS", "REPO", "SCHEDULER_CONFIG_API",
           "SCHEDULER_EXTENDER_WEIGHT", "Cluster", "ClusterError", "Ports", "cluster_lock", "default_state_dir",
           "extender_stanza", "free_port", "instance_lock_file", "main", "pid_alive", "port_holder", "proc_status",
           "rss_mib", "scheduler_configuration", "stop_demo_cluster", "tail"]

K8S_VERSION = "v1.37.2"
NODE_NAME = "topodra-node"
DEMO_OWNER = "demo"  # cluster.json's owner when ``make demo`` started the cluster (stop_demo_cluster)
PAUSE_IMAGE = "registry.k8s.io/pause:3.10.1"
BUSYBOX_IMAGE = "localhost/busybox:1.35"
SERVICE_CIDR = "10.0.0.0/24"
KUBELET_ROOT = Path("/var/lib/kubelet")
HOSTS_MARK = "# topodra-cluster"
SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops")


def default_state_dir() -> Path:
    return Path(os.environ.get("TOPODRA_CLUSTER_DIR", "/var/lib/topodra-cluster"))


def bin_dir(build: bool) -> Path:
    """The cached binaries directory; builds what is missing when ``build``."""
    args = [str(HACK / "build-bins")] + ([] if build else ["--print"])
    out = subprocess.run(args, check=False, stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise ClusterError("hack/build-bins failed (see its output above)")
    return Path(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- cluster



# Kubernetes feature gates the harness can turn on, and what each needs. Only these: a test or bench asks for a
# capability by name and the harness knows which components take the gate and which API it serves.
WORKLOAD_API = "workload-api"
TOPOLOGY_SCHEDULING = "topology-scheduling"
# resource.k8s.io v1beta1 and v1beta2 served beside v1: kube-apiserver 1.37 serves only v1 by default
# (pkg/controlplane/instance.go, betaAPIGroupVersionsDisabledByDefault). No gate: the types are there.
RESOURCE_BETA_APIS = "resource-beta-apis"
GATE_SETS: dict[str, tuple[str, ...]] = {
    # Workload and PodGroup (scheduling.k8s.io/v1beta1), gang scheduling: beta, off by default in 1.37.
    WORKLOAD_API: ("GenericWorkload",),
    # PodGroup schedulingConstraints.topology: alpha; depends on GenericWorkload (kube_features.go).
    TOPOLOGY_SCHEDULING: ("GenericWorkload", "TopologyAwareWorkloadScheduling"),
    RESOURCE_BETA_APIS: (),
}
# Beta APIs are not served unless asked for.
GATE_RUNTIME_CONFIG: dict[str, str] = {WORKLOAD_API: "scheduling.k8s.io/v1beta1=true",
                                       TOPOLOGY_SCHEDULING: "scheduling.k8s.io/v1beta1=true",
                                       RESOURCE_BETA_APIS: "resource.k8s.io/v1beta1=true,resource.k8s.io/v1beta2=true"}


def gate_flags(features: tuple[str, ...] | list[str]) -> tuple[list[str], list[str]]:
    """(``--feature-gates`` args for every component, extra kube-apiserver args) for harness features."""
    unknown = [f for f in features if f not in GATE_SETS]
    if unknown:
        raise ClusterError(f"unknown harness feature(s) {unknown}; known: {sorted(GATE_SETS)}")
    gates = sorted({g for f in features for g in GATE_SETS[f]})
    runtime = sorted({GATE_RUNTIME_CONFIG[f] for f in features if f in GATE_RUNTIME_CONFIG})
    common = [f"--feature-gates={','.join(f'{g}=true' for g in gates)}"] if gates else []
    api = common + ([f"--runtime-config={','.join(runtime)}"] if runtime else [])
    return common, api

@dataclass
class Cluster:
    state_dir: Path = field(default_factory=default_state_dir)
    node_name: str = NODE_NAME
    ports: Ports = field(default_factory=Ports)
    _kube: tuple[int, Kube] | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def private(cls, instance: str) -> Cluster:
        """A kubelet-less cluster of its own (for benchmarks): a fresh state directory and free
        ports in FREE_PORT_RANGE, so it runs beside the shared fixed-port cluster of the tests.
        Callers serialize runs of one instance with ``cluster_lock(t, instance_lock_file(instance))``."""
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

    @property
    def features(self) -> list[str]:
        """The harness features (``GATE_SETS`` keys) this cluster was started with."""
        return list(self.meta().get("features") or [])

    def running(self) -> dict[str, int]:
        return {n: p for n, p in (self.meta().get("pids") or {}).items() if pid_alive(p)}

    # ----- API access for the harness itself

    def kube(self) -> Kube:
        """The admin's client (topodra's own), made again whenever ``up`` wrote new credentials."""
        stamp = self.admin_kubeconfig.stat().st_mtime_ns
        if self._kube is None or self._kube[0] != stamp:
            if self._kube is not None:
                self._kube[1].close()
            self._kube = (stamp, Kube.from_kubeconfig(str(self.admin_kubeconfig)))
        return self._kube[1]

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
           scheduler_config: dict[str, Any] | None = None, scheduler_extender: str | None = None,
           features: tuple[str, ...] | list[str] = (), owner: str = "") -> None:
        """Start the cluster. ``owner`` names who started it (``DEMO_OWNER``: ``make demo``), recorded in
        cluster.json so a test run can tell the demo's cluster from a developer's own. ``scheduler_config``
        (a KubeSchedulerConfiguration without clientConnection) and ``scheduler_extender`` (a prioritize-only
        extender URL) shape kube-scheduler; ``features`` (``WORKLOAD_API``, ``TOPOLOGY_SCHEDULING``) turn on
        Kubernetes feature gates on the apiserver, controller-manager and scheduler (``GATE_SETS``)."""
        t0 = time.monotonic()
        gate_flags(features)  # an unknown name fails before anything starts
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
                    "started": time.time(), "ports": dataclasses.asdict(self.ports),
                    "features": sorted(set(features)), "owner": owner})
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
        common_gates, api_gates = gate_flags(self.features)
        write_pki(self.pki, self.node_name)
        for ident in ("admin", "kube-controller-manager", "kube-scheduler", "node"):
            write_kubeconfig(self.state_dir / f"{ident}.kubeconfig", self.pki, ident, self.ports.apiserver)
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
            "--profiling=false", "--v=1", *api_gates])
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
            "--node-monitor-grace-period=8760h", "--controllers=*", *common_gates])
        self._start_scheduler(bins, scheduler_config, scheduler_extender)
        self._wait("kube-controller-manager", lambda: self._https_ok(self.ports.controller_manager, "/healthz"), 90)
        self._wait("kube-scheduler", lambda: self._https_ok(self.ports.scheduler, "/healthz"), 90)
        # The default namespace's ServiceAccount shows the controller-manager is really working.
        self._wait("kube-controller-manager", lambda: bool(
            self.kube().get("/api/v1/namespaces/default/serviceaccounts/default")), 60)

    # ----- scheduler

    def _start_scheduler(self, bins: Path, scheduler_config: dict[str, Any] | None,
                         scheduler_extender: str | None) -> None:
        kubeconfig = self.state_dir / "kube-scheduler.kubeconfig"
        argv = [str(bins / "kube-scheduler"), "--bind-address=127.0.0.1", f"--secure-port={self.ports.scheduler}",
                "--profiling=false", "--v=1",
                f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
                *gate_flags(self.features)[0]]
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
        node = self.kube().get(f"/api/v1/nodes/{self.node_name}") or {}
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
        kube = self.kube()
        for name in names:
            try:
                kube.create("/api/v1/nodes", fake_node(name, labels))
            except KubeError as e:
                if not e.conflict:
                    raise
            kube.request("PATCH", f"/api/v1/nodes/{name}/status", fake_node_status(name),
                         content_type="application/merge-patch+json")
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
            kueue.remove_host_dir(meta)
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

    @property
    def owner(self) -> str:
        """Who started the cluster recorded here (``up``'s ``owner``; "" when not said)."""
        return str(self.meta().get("owner") or "")

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
                nodes = self.kube().list("/api/v1/nodes")
                for n in nodes:
                    ready = {c["type"]: c["status"] for c in n["status"].get("conditions", [])}.get("Ready")
                    lines.append(f"  node {n['metadata']['name']:20s} Ready={ready}")
        lines.append(f"export KUBECONFIG={self.admin_kubeconfig}")
        return "\n".join(lines)


def stop_demo_cluster(state_dir: Path | None = None) -> str | None:
    """Stop the ``make demo`` cluster running from ``state_dir`` (default: ``default_state_dir()``) so a test
    run can take the fixed ports, /var/lib/kubelet and containerd's state that a node cluster needs.

    Returns the one line to show the user, or None when nothing runs there. A running cluster there that the
    demo did not start (``hack/cluster up`` by hand) is someone's work: raise a ClusterError that says what to
    run, and stop nothing. The README promises ``make demo`` then ``make test`` passes with no
    ``make demo-down`` between them (issue 31), and the node cluster cannot run twice on one host.
    """
    demo = Cluster.attach(state_dir or default_state_dir())
    alive = demo.running()
    if not alive:
        return None
    if demo.owner != DEMO_OWNER:
        raise ClusterError(f"a cluster started by hand runs from {demo.state_dir} "
                           f"({', '.join(f'{n}={p}' for n, p in alive.items())}) and holds the ports and the node "
                           "the tests need; stop it with 'hack/cluster down' (the tests stop only the demo's)")
    demo.down(quiet=True)
    left = demo.running()
    if left:
        raise ClusterError(f"stopping the demo's cluster in {demo.state_dir} left processes running: {left}")
    return (f"stopped the demo's cluster ({demo.state_dir}): the tests need its ports and node; "
            "'make demo' starts it again")


def main(argv: list[str] | None = None) -> int:
    """``hack/cluster``: up, down, status, fake-nodes."""
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
                    help="also run Kueue's controller-manager (webhooks on 127.0.0.1:9443, see testkit/kueue.py)")
    up.add_argument("--workload-api", action="store_true",
                    help="turn on GenericWorkload (gang scheduling; Workload/PodGroup at scheduling.k8s.io/v1beta1)")
    up.add_argument("--topology-scheduling", action="store_true",
                    help="also turn on TopologyAwareWorkloadScheduling (PodGroup schedulingConstraints.topology)")
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
                 scheduler_config=sched_cfg, scheduler_extender=args.scheduler_extender,
                 features=[f for f, on in ((WORKLOAD_API, args.workload_api),
                                           (TOPOLOGY_SCHEDULING, args.topology_scheduling)) if on])
            if args.kueue:
                try:
                    kueue.start(c, webhook_port=kueue.WEBHOOK_PORT, health_port=kueue.HEALTH_PORT)
                except (kueue.KueueError, ClusterError) as e:
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
