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

The cluster is a private instance (``localcluster.Cluster.private``: own state directory, free
ports), so a run never waits for the test sessions' fixed-port cluster; runs of this benchmark
queue behind each other on the instance's own lock (two at once on 2 cores would measure each
other). It always tears the cluster down.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import grpc

REPO = Path(__file__).resolve().parent.parent

from testkit import cluster as localcluster  # noqa: E402
from testkit.kubeletstub import KubeletStub  # noqa: E402
from testkit.pluginproc import PluginProcess  # noqa: E402

from topodra import DEFAULT_DRIVER_NAME  # noqa: E402
from topodra.apipaths import claim_path, slices_path  # noqa: E402
from topodra.cdi import spec_path  # noqa: E402
from topodra.kube import Kube, KubeError  # noqa: E402

INSTANCE = "bench-prepare"
LOCK_FILE = localcluster.instance_lock_file(INSTANCE)
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


Sample = Callable[[], dict[str, int]]
"""A process's /proc status memory fields in KiB (``localcluster.proc_status``)."""


class RssSampler:
    """Samples a plugin's VmRSS every ``interval`` seconds in the background."""

    def __init__(self, sample: Sample, interval: float = 0.1) -> None:
        self.sample = sample
        self.interval = interval
        self.max_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(OSError, KeyError, AssertionError):
                self.max_kib = max(self.max_kib, self.sample()["VmRSS"])

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
                timeout: float, *, node: str = NODE, driver: str = DRIVER, device_class: str = DRIVER,
                pools: frozenset[str] | None = None) -> list[Claim]:
    """``count`` claims of ``devices`` devices of ``device_class``, each referenced by a pod pinned to
    ``node``; returns them once the scheduler has allocated every one from ``driver``'s ``pools``
    (default: the pool named after the node)."""
    pools = pools or frozenset([node])
    exactly: dict[str, Any] = {"deviceClassName": device_class, "count": devices}
    if admin:
        exactly["adminAccess"] = True
    names = [f"{prefix}-{i}" for i in range(count)]
    for name in names:
        kube.create(f"{R}/namespaces/{ns}/resourceclaims", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": exactly}]}}})
        kube.create(f"/api/v1/namespaces/{ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, "automountServiceAccountToken": False,
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
                if len(results) != devices or any(r["pool"] not in pools or r["driver"] != driver for r in results):
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
    blocks: list[dict[str, float]] = field(default_factory=list)  # per interleaved block (compare mode)

    def result(self) -> dict[str, Any]:
        n = len(self.prepare_s)
        extra = {"block_medians_ms": self.blocks} if self.blocks else {}
        return {
            "name": self.name, "devices_per_claim": self.devices, "access": self.access,
            "concurrency": self.concurrency, "cycles_per_caller": self.cycles_per_caller,
            "prepare_ms": summarize(self.prepare_s), "unprepare_ms": summarize(self.unprepare_s),
            "first_prepare_ms": None if self.first_prepare_s is None else round(self.first_prepare_s * 1000, 3),
            "wall_s": round(self.wall_s, 3),
            "prepares_per_s": round(n / self.wall_s, 1) if self.wall_s else None,
            "server_mean_ms": self.server,
            **extra,
        }


class CycleChecker:
    """Checks each answer: no error, the right number of devices, CDI spec there / gone.

    ``spec_exists(claim_uid)`` says whether the plugin's CDI spec for a claim is on disk.
    """

    def __init__(self, spec_exists: Callable[[str], bool]) -> None:
        self.spec_exists = spec_exists

    def prepared(self, claim: Claim, resp: Any) -> None:
        entry = resp.claims.get(claim.uid)
        if entry is None or entry.error:
            raise BenchError(f"prepare of {claim.namespace}/{claim.name} failed: "
                             f"{entry.error if entry is not None else 'no entry'}")
        if len(entry.devices) != claim.devices:
            raise BenchError(f"prepare of {claim.name} returned {len(entry.devices)} devices, "
                             f"expected {claim.devices}")
        if not self.spec_exists(claim.uid):
            raise BenchError(f"no CDI spec for {claim.name} after a successful prepare")

    def unprepared(self, claim: Claim, resp: Any) -> None:
        entry = resp.claims.get(claim.uid)
        if entry is None or entry.error:
            raise BenchError(f"unprepare of {claim.name} failed: {entry.error if entry is not None else 'no entry'}")
        if self.spec_exists(claim.uid):
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


def drive(name: str, stub: KubeletStub, claims: list[Claim], checker: CycleChecker, concurrency: int,
          cycles_per_caller: int, warmup: int, on_ready: Callable[[], None] | None = None,
          ) -> tuple[list[float], list[float], float]:
    """Timed prepare+unprepare cycles; returns (prepare seconds, unprepare seconds, wall seconds).

    ``concurrency`` callers share one channel (as the kubelet does); each cycles its own claim.
    Every caller warms up, then all wait at a barrier; ``on_ready`` runs while they wait (the
    plugin's own counters are read there) and all callers are released at once.
    """
    if len(claims) < concurrency:
        raise BenchError(f"{name}: {concurrency} callers need as many claims, have {len(claims)}")
    lock = threading.Lock()
    errors: list[BaseException] = []
    prepare_s: list[float] = []
    unprepare_s: list[float] = []
    ready = threading.Barrier(concurrency + 1)
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
                prepare_s.append(t1 - t0)
                unprepare_s.append(t3 - t2)

    def caller(claim: Claim) -> None:
        try:
            for _ in range(warmup):
                cycle(claim, record=False)
            ready.wait(120)
            go.wait(120)
            for _ in range(cycles_per_caller):
                cycle(claim, record=True)
        except BaseException as e:
            errors.append(e)
            ready.abort()

    threads = [threading.Thread(target=caller, args=(c,), name=f"caller-{i}", daemon=True)
               for i, c in enumerate(claims[:concurrency])]
    for t in threads:
        t.start()
    released = False
    try:
        ready.wait(180)
        if on_ready is not None:
            on_ready()
        released = True
    except threading.BrokenBarrierError:
        pass
    finally:
        t0 = time.perf_counter()
        go.set()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - t0
    if errors:
        raise BenchError(f"{name}: {errors[0]}") from errors[0]
    if any(t.is_alive() for t in threads) or not released:
        raise BenchError(f"{name}: callers did not finish (barrier broken or still running after 600 s)")
    return prepare_s, unprepare_s, wall


def first_cycle(stub: KubeletStub, claim: Claim, checker: CycleChecker) -> float:
    """One untimed-by-the-stats cycle (the plugin's first prepare of a claim); returns the prepare seconds."""
    t0 = time.perf_counter()
    resp = stub.prepare([claim.ref])
    took = time.perf_counter() - t0
    checker.prepared(claim, resp)
    checker.unprepared(claim, stub.unprepare([claim.ref]))
    return took


def run_scenario(sc: Scenario, stub: KubeletStub, claims: list[Claim], checker: CycleChecker,
                 plugin: BenchPlugin, warmup: int) -> Scenario:
    """One scenario against topodra; the plugin's own latency totals must count every timed call."""
    sc.first_prepare_s = first_cycle(stub, claims[0], checker)
    before: dict[str, tuple[float, float]] = {}

    def read_before() -> None:
        before.update(server_totals(plugin))

    sc.prepare_s, sc.unprepare_s, sc.wall_s = drive(sc.name, stub, claims, checker, sc.concurrency,
                                                    sc.cycles_per_caller, warmup, read_before)
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


cluster_lock = localcluster.cluster_lock  # one implementation, shared with the other benchmarks


@contextlib.contextmanager
def lock_held_by_caller() -> Iterator[None]:
    """For ``--lock-held``: the caller (e.g. ``flock LOCK_FILE sh -c '...'`` around several runs) holds
    the lock; refuse to run when nobody does, since two runs would then share the CPUs unknowingly."""
    fd = os.open(LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield
            return
        raise BenchError(f"--lock-held, but nobody holds {LOCK_FILE}")
    finally:
        os.close(fd)


class Timeout(Exception):
    pass


def _on_alarm(_signum: int, _frame: FrameType | None) -> None:
    raise Timeout("benchmark exceeded --timeout")


def memory_point(sample: Sample) -> dict[str, Any]:
    st = sample()
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
        checker = CycleChecker(lambda uid: spec_path(plugin.cdi_root, DRIVER, uid).exists())
        memory: dict[str, Any] = {"after_start": memory_point(plugin.sample_rss)}
        scenarios: list[Scenario] = []
        with KubeletStub(plugin.socket) as stub:
            call, reader = health_stream(stub)
            time.sleep(args.settle)
            memory["idle"] = memory_point(plugin.sample_rss)
            log(f"idle plugin memory: {memory['idle']}")
            with RssSampler(plugin.sample_rss) as sampler:
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
                memory["after_runs"] = memory_point(plugin.sample_rss)
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


# --------------------------------------------------------------------------- comparison with another plugin
#
# ``--compare-with BINARY`` runs a second DRA kubelet plugin next to topodra in the same cluster:
# topodra serves the kubelet-less node NODE, the other plugin OTHER_NODE, each with its own
# directories. The benchmark finds the other plugin the way the kubelet does (GetInfo on the
# registration socket it creates in its registry directory), selects its devices with a DeviceClass
# on its driver name, and has the real scheduler allocate claims from the ResourceSlices it
# publishes. Each scenario then runs in interleaved blocks (A B, B A, A B, ...), so load on the
# shared machine falls on both plugins alike.

OTHER_NODE = "fake-bench-1"
OTHER_CLASS = "bench-compare"
OTHER_DEVICES = 8
PLACEHOLDERS: dict[str, str] = {
    "node": "name of the other plugin's node",
    "kubeconfig": "admin kubeconfig of the local cluster",
    "plugins_dir": "kubelet plugins directory (the plugin makes <driver>/dra.sock in it)",
    "registry_dir": "kubelet plugin registry directory (where the registration socket goes)",
    "cdi_root": "CDI spec directory",
    "state_dir": "an empty private directory for anything else",
    "metrics_port": "a free loopback port",
    "health_port": "another free loopback port",
}
# kubernetes-sigs/dra-example-driver's dra-example-kubeletplugin: 8 GPUs, the client rate limit out of the way,
# and, like topodra in this benchmark, its metrics and health servers on.
EXAMPLE_ARGS = ("--node-name={node} --kubeconfig={kubeconfig} --kubelet-plugins-directory-path={plugins_dir} "
                "--kubelet-registrar-directory-path={registry_dir} --cdi-root={cdi_root} --num-devices=8 "
                "--device-profile=gpu --kube-api-qps=10000 --kube-api-burst=10000 --metrics-port={metrics_port} "
                "--healthcheck-port={health_port}")
BLOCK_WARMUP = 2  # untimed cycles per caller at the start of every block (the other side just ran)
COMPARE_STATS = (("prepare_ms", "median"), ("prepare_ms", "p99"), ("unprepare_ms", "median"), ("unprepare_ms", "p99"))


def expand_template(template: str, values: Mapping[str, str]) -> list[str]:
    """Shell-split ``template``, then fill ``{placeholder}`` fields of each word from ``values``.

    Splitting first keeps a path with spaces one argument. Only bare names in ``values`` are
    accepted (no ``{0}``, ``{x.attr}``, ``{x!r}`` or format specs); ``{{``/``}}`` are literal braces.
    """
    try:
        words = shlex.split(template)
    except ValueError as e:
        raise BenchError(f"--compare-args: {e}") from None
    out = []
    for word in words:
        parts = []
        try:
            parsed = list(string.Formatter().parse(word))
        except ValueError as e:
            raise BenchError(f"--compare-args: {word!r}: {e}") from None
        for literal, name, spec, conversion in parsed:
            parts.append(literal)
            if name is None:
                continue
            if name not in values or spec or conversion:
                raise BenchError(f"--compare-args: {word!r} uses {{{name}{'!' + conversion if conversion else ''}"
                                 f"{':' + spec if spec else ''}}}; the placeholders are "
                                 + ", ".join(f"{{{k}}}" for k in sorted(values)))
            parts.append(values[name])
        out.append("".join(parts))
    return out


def block_order(rounds: int) -> list[tuple[str, str]]:
    """Side order of each round, A B then B A alternately, so neither side always runs first."""
    return [("a", "b") if i % 2 == 0 else ("b", "a") for i in range(rounds)]


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b rounded to 0.01; None when either is missing or b is not positive."""
    if a is None or b is None or not b > 0 or math.isnan(a):
        return None
    return round(a / b, 2)


def compare_rows(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Side-by-side rows (scenario, metric, a, b, a/b) from two results of the same scenarios, plus peak RSS."""
    b_by_name = {s["name"]: s for s in b["scenarios"]}
    rows = []
    for sa in a["scenarios"]:
        sb = b_by_name.get(sa["name"])
        if sb is None:
            raise BenchError(f"scenario {sa['name']!r} ran for one plugin only")
        for op, stat in COMPARE_STATS:
            va, vb = sa[op].get(stat), sb[op].get(stat)
            rows.append({"scenario": sa["name"], "metric": f"{op.removesuffix('_ms')} {stat} ms", "a": va, "b": vb,
                         "ratio": ratio(va, vb)})
    ha, hb = a["memory"]["peak_VmHWM_MiB"], b["memory"]["peak_VmHWM_MiB"]
    rows.append({"scenario": "whole run", "metric": "peak RSS (VmHWM) MiB", "a": ha, "b": hb, "ratio": ratio(ha, hb)})
    return rows


def format_comparison(rows: list[dict[str, Any]], a_label: str, b_label: str) -> str:
    """The side-by-side table as text; ratio is a / b (below 1: ``a_label`` is faster or smaller)."""
    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    width = max(len(r["scenario"]) for r in rows)
    head = f"{'scenario':{width}s}  {'metric':22s} {a_label[:12]:>12s} {b_label[:12]:>12s} {'ratio':>6s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['scenario']:{width}s}  {r['metric']:22s} {num(r['a']):>12s} {num(r['b']):>12s} "
                     f"{num(r['ratio']):>6s}")
    return "\n".join(lines)


class OtherPlugin:
    """The plugin to compare with: ``binary`` started with the expanded template, its own directories."""

    def __init__(self, binary: Path, template: str, kubeconfig: Path, root: Path, log_path: Path,
                 extra_env: dict[str, str]) -> None:
        self.root = root
        self.plugins_dir, self.registry_dir, self.cdi_root = root / "plugins", root / "registry", root / "cdi"
        state = root / "state"
        for d in (self.plugins_dir, self.registry_dir, self.cdi_root, state):
            d.mkdir(parents=True, exist_ok=True)
        values = {"node": OTHER_NODE, "kubeconfig": str(kubeconfig), "plugins_dir": str(self.plugins_dir),
                  "registry_dir": str(self.registry_dir), "cdi_root": str(self.cdi_root), "state_dir": str(state),
                  "metrics_port": str(localcluster.free_port()), "health_port": str(localcluster.free_port())}
        assert values.keys() == PLACEHOLDERS.keys()
        self.argv = [str(binary), *expand_template(template, values)]
        self.log_path = log_path
        self.env = {**os.environ, **extra_env}
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=self.root, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def sample_rss(self) -> dict[str, int]:
        assert self.proc is not None
        return localcluster.proc_status(self.proc.pid)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 30 s; the exit code (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        rc = self.proc.returncode
        self.proc = None
        return rc

    def tail(self, n: int = 40) -> str:
        return localcluster.tail(self.log_path, n)

    def spec_exists(self, claim_uid: str) -> bool:
        """Transient CDI specs carry the claim UID in their file name (the CDI library's convention)."""
        return any(claim_uid in p.name for p in self.cdi_root.iterdir())

    def ready(self, kube: Kube, timeout: float) -> tuple[str, Path, frozenset[str], float]:
        """Registered and published: (driver name, DRA socket, pool names, seconds since start)."""
        driver, socket = self.discover(timeout)
        if driver == DRIVER:
            raise BenchError(f"the other plugin registers {DRIVER} too; give it another driver name")
        pools = wait_published(kube, driver, OTHER_NODE, OTHER_DEVICES, timeout)
        return driver, socket, pools, time.monotonic() - self.started

    def discover(self, timeout: float) -> tuple[str, Path]:
        """Like the kubelet's plugin watcher: GetInfo on a socket in the registry directory, then
        NotifyRegistrationStatus(true). Returns (driver name, DRA socket)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise BenchError(f"{self.argv[0]} exited with {self.proc.returncode if self.proc else '?'}:\n"
                                 f"{self.tail()}")
            for sock in sorted(self.registry_dir.glob("*.sock")):
                with KubeletStub(sock) as reg:
                    try:
                        info = reg.get_info()
                    except grpc.RpcError:
                        continue
                    if info.type != "DRAPlugin":
                        continue
                    if "v1.DRAPlugin" not in info.supported_versions:
                        raise BenchError(f"{info.name} serves {list(info.supported_versions)}, not v1.DRAPlugin")
                    reg.notify_registration(True)
                    return str(info.name), Path(info.endpoint)
            time.sleep(0.2)
        raise BenchError(f"no DRA registration socket in {self.registry_dir} after {timeout:.0f}s:\n{self.tail()}")


def wait_published(kube: Kube, driver: str, node: str, devices: int, timeout: float) -> frozenset[str]:
    """Until ``driver`` has published at least ``devices`` devices for ``node``; returns its pool names."""
    deadline = time.monotonic() + timeout
    found: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        found = list(kube.list(slices_path(), field_selector=f"spec.driver={driver},spec.nodeName={node}"))
        if sum(len(s["spec"].get("devices") or []) for s in found) >= devices:
            return frozenset(s["spec"]["pool"]["name"] for s in found)
        time.sleep(0.25)
    raise BenchError(f"{driver} published {sum(len(s['spec'].get('devices') or []) for s in found)} devices for "
                     f"{node} within {timeout:.0f}s; the comparison needs {devices}")


@dataclass(frozen=True)
class Side:
    """One plugin under comparison, as the scenarios see it."""

    label: str
    stub: KubeletStub
    checker: CycleChecker
    node: str
    driver: str
    device_class: str
    pools: frozenset[str]
    server_totals: Callable[[], dict[str, tuple[float, float]]] | None = None  # topodra's own request metrics


def timed_block(name: str, side: Side, claims: list[Claim], concurrency: int, cycles_per_caller: int,
                ) -> tuple[list[float], list[float], float, dict[str, tuple[float, float]]]:
    """One block on one side: (prepare s, unprepare s, wall s, the plugin's own (sum s, count) per method
    during the timed part, when it exports them)."""
    before: dict[str, tuple[float, float]] = {}

    def read_before() -> None:
        if side.server_totals is not None:
            before.update(side.server_totals())

    p, u, wall = drive(name, side.stub, claims, side.checker, concurrency, cycles_per_caller, BLOCK_WARMUP,
                       read_before)
    if side.server_totals is None:
        return p, u, wall, {}
    after = side.server_totals()
    return p, u, wall, {m: (after[m][0] - before[m][0], after[m][1] - before[m][1]) for m in after}


def interleaved(name: str, devices: int, concurrency: int, cycles_per_caller: int, sides: dict[str, Side],
                claims: dict[str, list[Claim]], rounds: int, warmup: int) -> dict[str, Scenario]:
    """One scenario on both sides: a first cycle and ``warmup`` untimed cycles each, then ``rounds``
    rounds of one block per side (order from ``block_order``), ``cycles_per_caller`` split over them."""
    per_block = max(1, math.ceil(cycles_per_caller / rounds))
    out = {}
    server: dict[str, dict[str, list[float]]] = {k: {} for k in sides}
    for key, side in sides.items():
        sc = out[key] = Scenario(name, devices, "exclusive", concurrency, per_block * rounds)
        sc.first_prepare_s = first_cycle(side.stub, claims[key][0], side.checker)
        drive(f"{side.label} {name} warm-up", side.stub, claims[key], side.checker, concurrency, 0, warmup)
    for order in block_order(rounds):
        for key in order:
            sc = out[key]
            p, u, wall, delta = timed_block(f"{sides[key].label} {name}", sides[key], claims[key], concurrency,
                                            per_block)
            for method, (total, count) in delta.items():
                acc = server[key].setdefault(method, [0.0, 0.0])
                acc[0] += total
                acc[1] += count
            sc.prepare_s += p
            sc.unprepare_s += u
            sc.wall_s += wall
            sc.blocks.append({"prepare": round(statistics.median(p) * 1000, 3),
                              "unprepare": round(statistics.median(u) * 1000, 3)})
    for key, sc in out.items():
        for method, (total, count) in server[key].items():
            if int(count) != len(sc.prepare_s):
                raise BenchError(f"{name}: {sides[key].label} counted {count:.0f} {method} calls, we made "
                                 f"{len(sc.prepare_s)}")
            sc.server["prepare" if method == "NodePrepareResources" else "unprepare"] = round(total / count * 1000, 3)
        p, u = sc.result()["prepare_ms"], sc.result()["unprepare_ms"]
        log(f"{sides[key].label} {name}: prepare median {p['median']} p99 {p['p99']} ms; unprepare median "
            f"{u['median']} p99 {u['p99']} ms ({len(sc.prepare_s)} cycles)")
    return out


def compare_bench(args: argparse.Namespace, lc: localcluster.Cluster, workdir: Path) -> dict[str, Any]:
    kube = Kube.from_kubeconfig(str(lc.admin_kubeconfig))
    try:
        return _compare(args, lc, kube, workdir)
    finally:
        kube.close()


def _compare(args: argparse.Namespace, lc: localcluster.Cluster, kube: Kube, workdir: Path) -> dict[str, Any]:
    lc.create_fake_nodes([NODE, OTHER_NODE])
    subprocess.run([str(Path(lc.meta()["bin_dir"]) / "kubectl"), f"--kubeconfig={lc.admin_kubeconfig}",
                    "apply", "-f", str(REPO / "deviceclasses/gpu.topodra.io.yaml")],
                   check=True, capture_output=True)
    a = BenchPlugin(lc.admin_kubeconfig, workdir / "a", lc.logs / "topodra-bench-plugin.log",
                    extra_env=dict(args.plugin_env))
    b = OtherPlugin(args.compare_with, args.compare_args, lc.admin_kubeconfig, workdir / "b",
                    lc.logs / "compare-plugin.log", dict(args.compare_env))
    log(f"other plugin: {shlex.join(b.argv)}")
    a.start(wait=False)
    b.start()
    try:
        # Both start at once; each one's ready time (serving and published) is waited for in its own thread.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            a_wait = pool.submit(a.wait_ready, 90)
            b_wait = pool.submit(b.ready, kube, 90)
            other_driver, other_socket, pools, b_ready_s = b_wait.result()
            a_ready_s = a_wait.result()
        log(f"topodra ready in {a_ready_s:.1f}s; {other_driver} ready in {b_ready_s:.1f}s (socket {other_socket})")
        kube.create(f"{R}/deviceclasses", {
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": OTHER_CLASS},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == {json.dumps(other_driver)}"}}]}})
        ns = f"bench-{os.getpid()}"
        kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        wait_until(lambda: kube.get(f"/api/v1/namespaces/{ns}/serviceaccounts/default"), 60, "default SA")
        labels = {"a": "topodra", "b": args.compare_label or args.compare_with.name}
        memory: dict[str, dict[str, Any]] = {"a": {}, "b": {}}
        samples: dict[str, Sample] = {"a": a.sample_rss, "b": b.sample_rss}
        results: dict[str, list[Scenario]] = {"a": [], "b": []}
        with KubeletStub(a.socket) as sa, KubeletStub(other_socket) as sb:
            sides = {
                "a": Side(labels["a"], sa, CycleChecker(lambda uid: spec_path(a.cdi_root, DRIVER, uid).exists()),
                          NODE, DRIVER, DRIVER, frozenset([NODE]), lambda: server_totals(a)),
                "b": Side(labels["b"], sb, CycleChecker(b.spec_exists), OTHER_NODE, other_driver, OTHER_CLASS,
                          pools)}
            streams = [health_stream(sa), health_stream(sb)]  # the other may not serve health; then it just ends
            time.sleep(args.settle)
            for k in memory:
                memory[k]["idle"] = memory_point(samples[k])
            with RssSampler(a.sample_rss) as rss_a, RssSampler(b.sample_rss) as rss_b:

                def claims_for(prefix: str, count: int, devices: int) -> dict[str, list[Claim]]:
                    return {k: make_claims(kube, ns, f"{k}-{prefix}", count, devices, admin=False, timeout=120,
                                           node=s.node, driver=s.driver, device_class=s.device_class,
                                           pools=s.pools) for k, s in sides.items()}

                excl1 = claims_for("excl1", 8, 1)
                for name, conc, cycles in (("sequential 1-GPU exclusive", 1, args.cycles),
                                           ("8 concurrent 1-GPU exclusive", 8, max(1, args.concurrent_cycles * 4))):
                    for k, sc in interleaved(name, 1, conc, cycles, sides, excl1, args.rounds,
                                             args.warmup if conc == 1 else 1).items():
                        results[k].append(sc)
                release_claims(kube, excl1["a"] + excl1["b"], 120)
                excl8 = claims_for("excl8", 1, 8)
                for k, sc in interleaved("sequential 8-GPU exclusive", 8, 1, args.cycles, sides, excl8,
                                         args.rounds, args.warmup).items():
                    results[k].append(sc)
                release_claims(kube, excl8["a"] + excl8["b"], 120)
                for k, sampler in (("a", rss_a), ("b", rss_b)):
                    memory[k]["after_runs"] = memory_point(samples[k])
                    memory[k]["sampled_max_VmRSS_MiB"] = round(sampler.max_kib / 1024, 1)
                    memory[k]["peak_VmHWM_MiB"] = memory[k]["after_runs"]["VmHWM_MiB"]
            for call, reader in streams:
                call.cancel()
                reader.join(5)
        leftovers = sorted(p.name for p in a.cdi_root.glob("*.json"))
        leftovers += sorted(p.name for p in b.cdi_root.iterdir()
                            if any(c.uid in p.name for c in excl1["b"] + excl8["b"]))
        if leftovers:
            raise BenchError(f"CDI specs left after the runs: {leftovers}")
        out = {k: {"label": labels[k], "scenarios": [s.result() for s in results[k]], "memory": memory[k]}
               for k in ("a", "b")}
        out["a"]["plugin_ready_s"], out["b"]["plugin_ready_s"] = round(a_ready_s, 2), round(b_ready_s, 2)
        out["b"].update({"driver": other_driver, "argv": b.argv})
        rc_a, rc_b = a.stop(), b.stop()
        if rc_a != 0:
            raise BenchError(f"topodra exited with {rc_a} on SIGTERM:\n{a.tail()}")
        out["b"]["exit_code_on_sigterm"] = rc_b
        return {"a": out["a"], "b": out["b"], "comparison": compare_rows(out["a"], out["b"])}
    finally:
        a.stop()
        b.stop()


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
    p.add_argument("--lock-held", action="store_true",
                   help=f"the caller already holds {LOCK_FILE} (several runs in one turn: "
                        f"flock {LOCK_FILE} sh -c 'bench/prepare --lock-held ...; bench/prepare --lock-held ...')")
    c = p.add_argument_group("side by side with another DRA kubelet plugin")
    c.add_argument("--compare-with", type=Path, metavar="PLUGIN_BINARY",
                   help="run the exclusive-claim scenarios against this kubelet plugin too, in interleaved blocks "
                        "(topodra and it at once, each on its own kubelet-less node)")
    c.add_argument("--compare-args", default=EXAMPLE_ARGS, metavar="TEMPLATE",
                   help="its command-line arguments; placeholders: "
                        + "; ".join(f"{{{k}}} {v}" for k, v in PLACEHOLDERS.items())
                        + f". Default (kubernetes-sigs/dra-example-driver's kubelet plugin): {EXAMPLE_ARGS}")
    c.add_argument("--compare-env", action="append", default=[], type=env_pair, metavar="NAME=VALUE",
                   help="extra environment of the other plugin (repeatable)")
    c.add_argument("--compare-label", default=None, help="its name in the table (default: the binary's file name)")
    c.add_argument("--rounds", type=int, default=6, help="interleaved rounds (one block per plugin each) per scenario")
    args = p.parse_args(argv)
    for name in ("cycles", "concurrency", "concurrent_cycles", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.compare_with is not None:
        if not (args.compare_with.is_file() and os.access(args.compare_with, os.X_OK)):
            p.error(f"--compare-with {args.compare_with}: not an executable file")
        args.compare_with = args.compare_with.resolve()
        try:
            expand_template(args.compare_args, dict.fromkeys(PLACEHOLDERS, "x"))
        except BenchError as e:
            p.error(str(e))
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
        with lock_held_by_caller() if args.lock_held else cluster_lock(args.lock_timeout, LOCK_FILE):
            signal.alarm(args.timeout)
            started = time.time()
            kind = "prepare" if args.compare_with is None else "prepare-compare"
            out: Path = args.out or REPO / "bench/results" / time.strftime(f"{kind}-%Y%m%dT%H%M%SZ.json",
                                                                           time.gmtime(started))
            workdir = Path(tempfile.mkdtemp(prefix="topodra-bench-"))
            lc = localcluster.Cluster.private(INSTANCE)
            try:
                log("starting the control plane (etcd, apiserver, controller-manager, scheduler)")
                lc.up(node=False, build=True)
                result: dict[str, Any] = {"benchmark": kind, "started": time.strftime(
                    "%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "host": host_info(),
                    "config": {"node": NODE, "hardware": HARDWARE, "driver": DRIVER, "cycles": args.cycles,
                               "concurrency": args.concurrency, "concurrent_cycles": args.concurrent_cycles,
                               "warmup": args.warmup, "plugin_env": dict(args.plugin_env),
                               "workdir_fs": fs_type(workdir)}}
                if args.compare_with is None:
                    result.update(bench(args, lc, workdir))
                    result["verdicts"] = verdicts(result)
                else:
                    result["config"].update({"compare_with": str(args.compare_with), "rounds": args.rounds,
                                             "compare_env": dict(args.compare_env)})
                    result.update(compare_bench(args, lc, workdir))
                result["duration_s"] = round(time.time() - started, 1)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(result, indent=2) + "\n")
                if args.compare_with is None:
                    print_table(result)
                else:
                    print(format_comparison(result["comparison"], result["a"]["label"], result["b"]["label"]))
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
