"""NodePrepareResources / NodeUnprepareResources latency and plugin memory, on a real cluster.

What runs (all loopback, all real except the kubelet):

* ``hack/localcluster.py``: etcd, kube-apiserver, kube-controller-manager, kube-scheduler.
* One kubelet-less Ready node ``fake-bench-0`` (the same Node object ``topodra simulate`` creates).
* The real plugin process (``topodra kubelet-plugin --hardware mock:dgx-h100``, 8 GPUs + 8 NICs) for
  that node, with its own plugin, registry and CDI directories in a temporary directory: it
  publishes its ResourceSlice through the apiserver and serves its real DRA unix socket. No
  kubelet watches its registry directory, so nobody but this benchmark calls it.
* Pods pinned to ``fake-bench-0`` that reference ResourceClaims: the real scheduler allocates
  the claims from the plugin's slice (the pods never run: there is no kubelet).
* This process plays the kubelet (``tests/kubeletstub.py``, the same generated stubs and method
  paths) and times NodePrepareResources / NodeUnprepareResources cycles on those claims over
  the socket: each prepare GETs the claim from the apiserver, checks the allocation, writes the
  checkpoint (fsync) as PrepareStarted, writes the CDI spec, writes the checkpoint again; each
  unprepare removes the spec and rewrites the checkpoint. A device-health stream is held open
  the whole time, as the kubelet does.

Scenarios: sequential cycles on one exclusive 1-GPU claim and one exclusive 8-GPU claim; 8
concurrent callers on 8 exclusive 1-GPU claims (a full node of single-GPU pods starting at
once); 32 concurrent callers on 32 admin-access claims of 1 and of 8 GPUs (admin access is
the only way to have 32 claims allocated on the same 8 GPUs; the plugin does the same work for
them). The plugin's RSS (VmRSS, VmHWM) is sampled idle, during and after the runs.

It takes ``/tmp/topodra-test-cluster.lock`` (the pytest fixtures hold the same lock) because
the cluster uses fixed ports, and always tears the cluster down.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "hack"))
sys.path.insert(0, str(REPO / "tests"))

import localcluster  # noqa: E402
from kubeletstub import KubeletStub  # noqa: E402
from pluginproc import PluginProcess  # noqa: E402

from topodra import DEFAULT_DRIVER_NAME  # noqa: E402
from topodra.apipaths import claim_path, slices_path  # noqa: E402
from topodra.cdi import spec_path  # noqa: E402
from topodra.kube import Kube, KubeError  # noqa: E402

LOCK_FILE = "/tmp/topodra-test-cluster.lock"
DRIVER = DEFAULT_DRIVER_NAME
NODE = "fake-bench-0"
HARDWARE = "mock:dgx-h100"
R = "/apis/resource.k8s.io/v1"
ADMIN_LABEL = "resource.kubernetes.io/admin-access"
TARGET_P99_MS_8DEV = 20.0
TARGET_RSS_MB = 80.0  # decimal megabytes (80e6 bytes), the stricter reading of "80 MB"
MiB = 1024 * 1024


class BenchError(RuntimeError):
    """The benchmark cannot continue; the message says why."""


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- statistics


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of an ascending list."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def summarize(samples_s: list[float]) -> dict[str, float | int]:
    """Latency summary in milliseconds."""
    v = sorted(x * 1000 for x in samples_s)
    if not v:
        return {"n": 0}
    return {"n": len(v), "min": round(v[0], 3), "median": round(statistics.median(v), 3),
            "mean": round(statistics.fmean(v), 3), "p90": round(percentile(v, 90), 3),
            "p99": round(percentile(v, 99), 3), "max": round(v[-1], 3)}


# --------------------------------------------------------------------------- plugin process



class BenchPlugin(PluginProcess):
    """The plugin for the kubelet-less bench node, in its own directories and on free ports."""

    def __init__(self, kubeconfig: Path, root: Path, log_path: Path, extra_env: dict[str, str]) -> None:
        super().__init__(kubeconfig, NODE, log_path, HARDWARE, extra_env, plugin_dir=root / "plugin",
                         registry_dir=root / "registry", cdi_root=root / "cdi", metrics_port=localcluster.free_port(),
                         health_port=localcluster.free_port(), inherit_topodra_env=False)

    def wait_ready(self, timeout: float) -> float:
        """Until the DRA socket serves and the ResourceSlice is published; returns seconds taken."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if not self.alive():
                raise BenchError(f"plugin exited with {self.proc.returncode if self.proc else '?'}:\n"
                                 f"{self.tail()}")
            with contextlib.suppress(OSError, ValueError):
                if self.socket.is_socket() and self.metric("topodra_plugin_published_devices") == 16.0:
                    return time.monotonic() - t0
            time.sleep(0.1)
        raise BenchError(f"plugin not ready after {timeout:.0f}s:\n{self.tail()}")

    def sample_rss(self) -> dict[str, int]:
        return localcluster.proc_status(self.pid)


class RssSampler:
    """Samples the plugin's VmRSS every ``interval`` seconds in the background."""

    def __init__(self, plugin: BenchPlugin, interval: float = 0.1) -> None:
        self.plugin = plugin
        self.interval = interval
        self.max_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(OSError, KeyError, AssertionError):
                self.max_kib = max(self.max_kib, self.plugin.sample_rss()["VmRSS"])

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


# --------------------------------------------------------------------------- claims via the scheduler


@dataclass(frozen=True)
class Claim:
    namespace: str
    name: str
    uid: str
    devices: int

    @property
    def ref(self) -> tuple[str, str, str]:
        return (self.namespace, self.uid, self.name)


def make_claims(kube: Kube, ns: str, prefix: str, count: int, devices: int, admin: bool,
                timeout: float) -> list[Claim]:
    """``count`` claims of ``devices`` GPUs, each referenced by a pod pinned to the bench node;
    returns them once the scheduler has allocated every one."""
    exactly: dict[str, Any] = {"deviceClassName": DRIVER, "count": devices}
    if admin:
        exactly["adminAccess"] = True
    names = [f"{prefix}-{i}" for i in range(count)]
    for name in names:
        kube.create(f"{R}/namespaces/{ns}/resourceclaims", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": exactly}]}}})
        kube.create(f"/api/v1/namespaces/{ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": NODE}, "automountServiceAccountToken": False,
                     "terminationGracePeriodSeconds": 0,
                     "resourceClaims": [{"name": "gpus", "resourceClaimName": name}],
                     "containers": [{"name": "c", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                                     "command": ["true"], "resources": {"claims": [{"name": "gpus"}]}}]}})
    deadline = time.monotonic() + timeout
    pending = set(names)
    claims: dict[str, Claim] = {}
    while pending:
        if time.monotonic() > deadline:
            raise BenchError(f"scheduler did not allocate claims {sorted(pending)} in {ns} within {timeout:.0f}s")
        for name in sorted(pending):
            obj = kube.get(claim_path(ns, name)) or {}
            alloc = (obj.get("status") or {}).get("allocation")
            if alloc:
                results = alloc["devices"]["results"]
                if len(results) != devices or any(r["pool"] != NODE or r["driver"] != DRIVER for r in results):
                    raise BenchError(f"claim {ns}/{name} has an unexpected allocation: {results}")
                claims[name] = Claim(ns, name, obj["metadata"]["uid"], devices)
                pending.discard(name)
        if pending:
            time.sleep(0.25)
    return [claims[n] for n in names]


def release_claims(kube: Kube, claims: list[Claim], timeout: float) -> None:
    """Force-delete the pods (no kubelet will confirm), delete the claims, wait until they are gone."""
    for c in claims:
        kube.request("DELETE", f"/api/v1/namespaces/{c.namespace}/pods/{c.name}", {"gracePeriodSeconds": 0})
    for c in claims:
        kube.delete(claim_path(c.namespace, c.name))
    deadline = time.monotonic() + timeout
    for c in claims:
        while kube.get(claim_path(c.namespace, c.name)) is not None:
            if time.monotonic() > deadline:
                raise BenchError(f"claim {c.namespace}/{c.name} still exists {timeout:.0f}s after deletion")
            time.sleep(0.2)


# --------------------------------------------------------------------------- the measurement


@dataclass
class Scenario:
    name: str
    devices: int
    access: str  # exclusive | admin
    concurrency: int
    cycles_per_caller: int
    prepare_s: list[float] = field(default_factory=list)
    unprepare_s: list[float] = field(default_factory=list)
    first_prepare_s: float | None = None
    wall_s: float = 0.0
    server: dict[str, float] = field(default_factory=dict)

    def result(self) -> dict[str, Any]:
        n = len(self.prepare_s)
        return {
            "name": self.name, "devices_per_claim": self.devices, "access": self.access,
            "concurrency": self.concurrency, "cycles_per_caller": self.cycles_per_caller,
            "prepare_ms": summarize(self.prepare_s), "unprepare_ms": summarize(self.unprepare_s),
            "first_prepare_ms": None if self.first_prepare_s is None else round(self.first_prepare_s * 1000, 3),
            "wall_s": round(self.wall_s, 3),
            "prepares_per_s": round(n / self.wall_s, 1) if self.wall_s else None,
            "server_mean_ms": self.server,
        }


class CycleChecker:
    """Checks each answer: no error, the right number of devices, CDI spec there / gone."""

    def __init__(self, cdi_root: Path) -> None:
        self.cdi_root = cdi_root

    def prepared(self, claim: Claim, resp: Any) -> None:
        entry = resp.claims.get(claim.uid)
        if entry is None or entry.error:
            raise BenchError(f"prepare of {claim.namespace}/{claim.name} failed: "
                             f"{entry.error if entry is not None else 'no entry'}")
        if len(entry.devices) != claim.devices:
            raise BenchError(f"prepare of {claim.name} returned {len(entry.devices)} devices, "
                             f"expected {claim.devices}")
        if not spec_path(self.cdi_root, DRIVER, claim.uid).exists():
            raise BenchError(f"no CDI spec for {claim.name} after a successful prepare")

    def unprepared(self, claim: Claim, resp: Any) -> None:
        entry = resp.claims.get(claim.uid)
        if entry is None or entry.error:
            raise BenchError(f"unprepare of {claim.name} failed: {entry.error if entry is not None else 'no entry'}")
        if spec_path(self.cdi_root, DRIVER, claim.uid).exists():
            raise BenchError(f"CDI spec of {claim.name} still there after unprepare")


def server_totals(plugin: BenchPlugin) -> dict[str, tuple[float, float]]:
    text = plugin.metrics()
    out = {}
    for method in ("NodePrepareResources", "NodeUnprepareResources"):
        vals = []
        for suffix in ("_sum", "_count"):
            m = re.search(rf'^topodra_plugin_request_duration_seconds{suffix}{{method="{method}"}} (\S+)$', text, re.M)
            vals.append(float(m.group(1)) if m else 0.0)
        out[method] = (vals[0], vals[1])
    return out


def run_scenario(sc: Scenario, stub: KubeletStub, claims: list[Claim], checker: CycleChecker,
                 plugin: BenchPlugin, warmup: int) -> Scenario:
    """``sc.concurrency`` callers share one channel (as the kubelet does); each cycles its own claim.

    Every caller warms up, then all wait at a barrier; the plugin's own latency totals are read
    and all callers are released at once.
    """
    if len(claims) < sc.concurrency:
        raise BenchError(f"{sc.name}: {sc.concurrency} callers need as many claims, have {len(claims)}")
    lock = threading.Lock()
    errors: list[BaseException] = []
    ready = threading.Barrier(sc.concurrency + 1)
    go = threading.Event()

    def cycle(claim: Claim, record: bool) -> None:
        t0 = time.perf_counter()
        resp = stub.prepare([claim.ref])
        t1 = time.perf_counter()
        checker.prepared(claim, resp)
        t2 = time.perf_counter()
        resp = stub.unprepare([claim.ref])
        t3 = time.perf_counter()
        checker.unprepared(claim, resp)
        if record:
            with lock:
                sc.prepare_s.append(t1 - t0)
                sc.unprepare_s.append(t3 - t2)

    def caller(claim: Claim) -> None:
        try:
            for _ in range(warmup):
                cycle(claim, record=False)
            ready.wait(120)
            go.wait(120)
            for _ in range(sc.cycles_per_caller):
                cycle(claim, record=True)
        except BaseException as e:
            errors.append(e)
            ready.abort()

    t0 = time.perf_counter()
    resp = stub.prepare([claims[0].ref])
    sc.first_prepare_s = time.perf_counter() - t0
    checker.prepared(claims[0], resp)
    checker.unprepared(claims[0], stub.unprepare([claims[0].ref]))
    threads = [threading.Thread(target=caller, args=(c,), name=f"caller-{i}", daemon=True)
               for i, c in enumerate(claims[:sc.concurrency])]
    for t in threads:
        t.start()
    before: dict[str, tuple[float, float]] = {}
    try:
        ready.wait(180)
        before = server_totals(plugin)
    except threading.BrokenBarrierError:
        pass
    finally:
        t0 = time.perf_counter()
        go.set()
    for t in threads:
        t.join(600)
    sc.wall_s = time.perf_counter() - t0
    if errors:
        raise BenchError(f"{sc.name}: {errors[0]}") from errors[0]
    if any(t.is_alive() for t in threads) or not before:
        raise BenchError(f"{sc.name}: callers did not finish (barrier broken or still running after 600 s)")
    after = server_totals(plugin)
    for method, short in (("NodePrepareResources", "prepare"), ("NodeUnprepareResources", "unprepare")):
        dsum, dcount = after[method][0] - before[method][0], after[method][1] - before[method][1]
        if int(dcount) != len(sc.prepare_s):
            raise BenchError(f"{sc.name}: the plugin counted {dcount:.0f} {method} calls, we made "
                             f"{len(sc.prepare_s)}")
        sc.server[short] = round(dsum / dcount * 1000, 3)
    p, u = sc.result()["prepare_ms"], sc.result()["unprepare_ms"]
    log(f"{sc.name}: prepare median {p['median']} ms p99 {p['p99']} ms; unprepare median {u['median']} ms "
        f"p99 {u['p99']} ms; {len(sc.prepare_s)} cycles in {sc.wall_s:.1f}s")
    return sc


# --------------------------------------------------------------------------- orchestration


@contextlib.contextmanager
def cluster_lock(timeout: float) -> Iterator[None]:
    fd = os.open(LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        deadline = time.monotonic() + timeout
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BenchError(f"{LOCK_FILE} still held by another cluster user after {timeout:.0f}s") from None
                if not said:
                    log(f"waiting for {LOCK_FILE} (another test session runs a cluster)")
                    said = True
                time.sleep(2)
        yield
    finally:
        os.close(fd)


class Timeout(Exception):
    pass


def _on_alarm(_signum: int, _frame: FrameType | None) -> None:
    raise Timeout("benchmark exceeded --timeout")


def memory_point(plugin: BenchPlugin) -> dict[str, Any]:
    st = plugin.sample_rss()
    return {"VmRSS_MiB": round(st["VmRSS"] / 1024, 1), "VmHWM_MiB": round(st["VmHWM"] / 1024, 1),
            "RssAnon_MiB": round(st.get("RssAnon", 0) / 1024, 1), "RssFile_MiB": round(st.get("RssFile", 0) / 1024, 1),
            "Threads": st.get("Threads", 0)}


def health_stream(stub: KubeletStub) -> tuple[Any, threading.Thread]:
    """Hold a NodeWatchResources stream open like the kubelet; returns (call, reader thread)."""
    call = stub.watch_health()

    def read() -> None:
        with contextlib.suppress(Exception):
            for _ in call:
                pass

    t = threading.Thread(target=read, name="health-stream", daemon=True)
    t.start()
    return call, t


def bench(args: argparse.Namespace, lc: localcluster.Cluster, workdir: Path) -> dict[str, Any]:
    kube = Kube.from_kubeconfig(str(lc.admin_kubeconfig))
    try:
        return _bench(args, lc, kube, workdir)
    finally:
        kube.close()


def _bench(args: argparse.Namespace, lc: localcluster.Cluster, kube: Kube, workdir: Path) -> dict[str, Any]:
    lc.create_fake_nodes([NODE])
    subprocess.run([str(Path(lc.meta()["bin_dir"]) / "kubectl"), f"--kubeconfig={lc.admin_kubeconfig}",
                    "apply", "-f", str(REPO / "deviceclasses/gpu.topodra.io.yaml")],
                   check=True, capture_output=True)
    plugin = BenchPlugin(lc.admin_kubeconfig, workdir, lc.logs / "topodra-bench-plugin.log",
                         extra_env=dict(args.plugin_env))
    plugin.start(wait=False)  # no kubelet registers the bench node's plugin
    try:
        ready_s = plugin.wait_ready(90)
        log(f"plugin ready in {ready_s:.1f}s (socket {plugin.socket})")
        slices = list(kube.list(slices_path(), field_selector=f"spec.driver={DRIVER},spec.nodeName={NODE}"))
        if sum(len(s["spec"]["devices"]) for s in slices) != 16:
            raise BenchError(f"expected 16 published devices on {NODE}, got slices {slices}")
        ns = f"bench-{os.getpid()}"
        kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                           "metadata": {"name": ns, "labels": {ADMIN_LABEL: "true"}}})
        wait_until(lambda: kube.get(f"/api/v1/namespaces/{ns}/serviceaccounts/default"), 60, "default SA")
        checker = CycleChecker(plugin.cdi_root)
        memory: dict[str, Any] = {"after_start": memory_point(plugin)}
        scenarios: list[Scenario] = []
        with KubeletStub(plugin.socket) as stub:
            call, reader = health_stream(stub)
            time.sleep(args.settle)
            memory["idle"] = memory_point(plugin)
            log(f"idle plugin memory: {memory['idle']}")
            with RssSampler(plugin) as sampler:
                # 1) exclusive 1-GPU claims: one sequentially, then 8 at once (a full node).
                excl1 = make_claims(kube, ns, "excl1", 8, 1, admin=False, timeout=120)
                scenarios.append(run_scenario(Scenario("sequential 1-GPU exclusive", 1, "exclusive", 1, args.cycles),
                                              stub, excl1, checker, plugin, args.warmup))
                scenarios.append(run_scenario(Scenario("8 concurrent 1-GPU exclusive", 1, "exclusive", 8,
                                                       max(1, args.concurrent_cycles * 4)),
                                              stub, excl1, checker, plugin, 1))
                release_claims(kube, excl1, 120)
                # 2) one exclusive 8-GPU claim.
                excl8 = make_claims(kube, ns, "excl8", 1, 8, admin=False, timeout=120)
                scenarios.append(run_scenario(Scenario("sequential 8-GPU exclusive", 8, "exclusive", 1, args.cycles),
                                              stub, excl8, checker, plugin, args.warmup))
                release_claims(kube, excl8, 120)
                # 3) 32 concurrent callers: admin-access claims may share devices.
                c = args.concurrency
                adm1 = make_claims(kube, ns, "adm1", c, 1, admin=True, timeout=180)
                adm8 = make_claims(kube, ns, "adm8", c, 8, admin=True, timeout=180)
                scenarios.append(run_scenario(Scenario("sequential 8-GPU admin-access", 8, "admin", 1, args.cycles),
                                              stub, adm8, checker, plugin, args.warmup))
                scenarios.append(run_scenario(Scenario(f"{c} concurrent 1-GPU admin-access", 1, "admin", c,
                                                       args.concurrent_cycles),
                                              stub, adm1, checker, plugin, 1))
                scenarios.append(run_scenario(Scenario(f"{c} concurrent 8-GPU admin-access", 8, "admin", c,
                                                       args.concurrent_cycles),
                                              stub, adm8, checker, plugin, 1))
                memory["after_runs"] = memory_point(plugin)
                memory["sampled_max_VmRSS_MiB"] = round(sampler.max_kib / 1024, 1)
                release_claims(kube, adm1 + adm8, 180)
            call.cancel()
            reader.join(5)
        leftovers = sorted(p.name for p in plugin.cdi_root.glob("*.json"))
        if leftovers:
            raise BenchError(f"CDI specs left after the runs: {leftovers}")
        prepared = plugin.metric("topodra_plugin_prepared_claims")
        errors = plugin.metric("topodra_plugin_request_errors_total")
        if prepared != 0.0:
            raise BenchError(f"plugin reports {prepared} prepared claims after the runs")
        memory["process_resident_memory_bytes_metric_MiB"] = round(
            (plugin.metric("process_resident_memory_bytes") or 0) / MiB, 1)
        rc = plugin.stop()
        if rc != 0:
            raise BenchError(f"plugin exited with {rc} on SIGTERM:\n{plugin.tail()}")
        return {"plugin_ready_s": round(ready_s, 2), "scenarios": [s.result() for s in scenarios],
                "memory": memory, "plugin_request_errors": errors}
    finally:
        plugin.stop()


def wait_until(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(KubeError):
            v = fn()
            if v:
                return v
        time.sleep(0.2)
    raise BenchError(f"timed out waiting for {what}")


def verdicts(result: dict[str, Any]) -> dict[str, Any]:
    by_name = {s["name"]: s for s in result["scenarios"]}
    seq8 = by_name["sequential 8-GPU exclusive"]["prepare_ms"]
    hwm = result["memory"]["after_runs"]["VmHWM_MiB"] * MiB / 1e6
    idle = result["memory"]["idle"]["VmRSS_MiB"] * MiB / 1e6
    return {
        "prepare_p99_8gpu_sequential_ms": seq8["p99"],
        "prepare_p99_target_ms": TARGET_P99_MS_8DEV,
        "prepare_p99_ratio": round(seq8["p99"] / TARGET_P99_MS_8DEV, 3),
        "prepare_p99_ok": seq8["p99"] <= TARGET_P99_MS_8DEV,
        "rss_idle_MB": round(idle, 1),
        "rss_peak_MB": round(hwm, 1),
        "rss_target_MB": TARGET_RSS_MB,
        "rss_peak_ratio": round(hwm / TARGET_RSS_MB, 3),
        "rss_ok": hwm <= TARGET_RSS_MB,
    }


def print_table(result: dict[str, Any]) -> None:
    head = (f"{'scenario':36s} {'n':>5s} {'prep med':>9s} {'prep p99':>9s} {'unprep med':>10s} "
            f"{'unprep p99':>10s} {'srv prep':>9s} {'prep/s':>7s}")
    print(head)
    print("-" * len(head))
    for s in result["scenarios"]:
        p, u = s["prepare_ms"], s["unprepare_ms"]
        print(f"{s['name']:36s} {p['n']:>5d} {p['median']:>9.2f} {p['p99']:>9.2f} {u['median']:>10.2f} "
              f"{u['p99']:>10.2f} {s['server_mean_ms']['prepare']:>9.2f} {s['prepares_per_s'] or 0:>7.1f}")
    m = result["memory"]
    print(f"\nplugin memory (MiB): idle VmRSS {m['idle']['VmRSS_MiB']} (anon {m['idle']['RssAnon_MiB']}, file "
          f"{m['idle']['RssFile_MiB']}), after runs VmRSS {m['after_runs']['VmRSS_MiB']}, "
          f"VmHWM {m['after_runs']['VmHWM_MiB']}, threads {m['after_runs']['Threads']}")
    v = result["verdicts"]
    print(f"target prepare p99 (8 GPUs, sequential) <= {v['prepare_p99_target_ms']} ms: "
          f"{v['prepare_p99_8gpu_sequential_ms']} ms (ratio {v['prepare_p99_ratio']}) "
          f"{'OK' if v['prepare_p99_ok'] else 'MISSED'}")
    print(f"target RSS <= {v['rss_target_MB']} MB: idle {v['rss_idle_MB']} MB, peak {v['rss_peak_MB']} MB "
          f"(ratio {v['rss_peak_ratio']}) {'OK' if v['rss_ok'] else 'MISSED'}")


def host_info() -> dict[str, Any]:
    return {"python": platform.python_version(), "kernel": platform.release(), "cpus": os.cpu_count(),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "kubernetes": localcluster.K8S_VERSION}


def env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/prepare", description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=300, help="timed prepare+unprepare cycles per sequential scenario")
    p.add_argument("--concurrency", type=int, default=32, help="callers in the admin-access concurrent scenarios")
    p.add_argument("--concurrent-cycles", type=int, default=10, help="timed cycles per concurrent caller")
    p.add_argument("--warmup", type=int, default=20, help="untimed cycles before a sequential scenario")
    p.add_argument("--settle", type=float, default=3.0, help="seconds to let the idle plugin settle before "
                   "measuring idle memory")
    p.add_argument("--plugin-env", action="append", default=[], type=env_pair, metavar="NAME=VALUE",
                   help="extra environment of the plugin process (repeatable), e.g. MALLOC_ARENA_MAX=2")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON result file (default bench/results/prepare-<UTC time>.json)")
    p.add_argument("--timeout", type=int, default=1200, help="give up (and clean up) after this many seconds")
    p.add_argument("--lock-timeout", type=float, default=1800, help="seconds to wait for the cluster lock")
    args = p.parse_args(argv)
    for name in ("cycles", "concurrency", "concurrent_cycles"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        log("the local cluster needs root (it binds fixed ports and writes /etc/hosts)")
        return 2
    previous = {s: signal.getsignal(s) for s in (signal.SIGALRM, signal.SIGTERM)}
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGTERM, lambda *_: _on_alarm(0, None))
    started = time.time()
    failed = True
    try:
        with cluster_lock(args.lock_timeout):
            signal.alarm(args.timeout)
            started = time.time()
            out: Path = args.out or REPO / "bench/results" / time.strftime("prepare-%Y%m%dT%H%M%SZ.json",
                                                                           time.gmtime(started))
            workdir = Path(tempfile.mkdtemp(prefix="topodra-bench-"))
            state = Path(tempfile.mkdtemp(prefix="topodra-bench-cluster-"))
            state.rmdir()  # the harness creates (and later removes) its own directory
            lc = localcluster.Cluster(state_dir=state)
            try:
                log("starting the control plane (etcd, apiserver, controller-manager, scheduler)")
                lc.up(node=False, build=True)
                result: dict[str, Any] = {"benchmark": "prepare", "started": time.strftime(
                    "%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "host": host_info(),
                    "config": {"node": NODE, "hardware": HARDWARE, "driver": DRIVER, "cycles": args.cycles,
                               "concurrency": args.concurrency, "concurrent_cycles": args.concurrent_cycles,
                               "warmup": args.warmup, "plugin_env": dict(args.plugin_env),
                               "workdir_fs": fs_type(workdir)}}
                result.update(bench(args, lc, workdir))
                result["verdicts"] = verdicts(result)
                result["duration_s"] = round(time.time() - started, 1)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(result, indent=2) + "\n")
                print_table(result)
                log(f"results written to {out}")
                failed = False
            finally:
                signal.alarm(0)
                os.environ.setdefault("TOPODRA_LOG_ARCHIVE", str(REPO / ".run" / "bench-logs"))
                lc.down(quiet=True, keep_logs=failed)
                shutil.rmtree(workdir, ignore_errors=True)
    except (BenchError, Timeout, localcluster.ClusterError) as e:
        log(f"FAILED: {e}")
        return 1
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 0


def fs_type(path: Path) -> str:
    """Filesystem type of the mount holding ``path`` (fsync cost depends on it)."""
    best, kind = "", "?"
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if str(path).startswith(parts[1]) and len(parts[1]) >= len(best):
            best, kind = parts[1], parts[2]
    return kind


if __name__ == "__main__":
    sys.exit(main())
