"""The plugin's gRPC layer against a kubelet stand-in.

Most tests use a fake prepare state (records calls, returns canned results);
everything else is real: sockets, grpc servers, generated stubs, metrics HTTP
endpoint.  The prepare-lock test uses the real ``DeviceState``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from prometheus_client import REGISTRY
from testkit.kubeletstub import KubeletStub, health_by_device
from testkit.ports import free_port

from topodra.claims import ClaimRef, FetchedClaim, UnavailableClaim
from topodra.devices import Device
from topodra.inventory import Inventory
from topodra.pb.grpchealth.v1 import health_pb2, health_pb2_grpc
from topodra.plugin import config, metrics, probes
from topodra.plugin.config import ConfigError
from topodra.plugin.device_health import DeviceHealthBoard, Health
from topodra.plugin.probes import ProbeServer
from topodra.plugin.registration import (
    MAX_SOCKET_PATH,
    SocketPathError,
    dra_socket_path,
    registration_socket_path,
)
from topodra.plugin.server import MAX_HEALTH_STREAMS, ClaimGetter, PluginServer
from topodra.state import DeviceState, PreparedDevice, PrepareResult

DRIVER = "gpu.topodra.io"
NODE = "node-a"


class FakeState:
    """Records what the gRPC layer passes in; answers from ``results``/``unprepare_results``."""

    def __init__(self) -> None:
        self.prepare_calls: list[list[ClaimRef]] = []
        self.prepare_claims: list[FetchedClaim] = []
        self.unprepare_calls: list[list[ClaimRef]] = []
        self.results: dict[str, PrepareResult] = {}
        self.unprepare_results: dict[str, str] = {}
        self.raise_on_call: Exception | None = None

    def prepare(self, claims: Sequence[FetchedClaim]) -> dict[str, PrepareResult]:
        self.prepare_calls.append([c.ref for c in claims])
        self.prepare_claims.extend(claims)
        if self.raise_on_call:
            raise self.raise_on_call
        return dict(self.results)

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        self.unprepare_calls.append(list(claims))
        if self.raise_on_call:
            raise self.raise_on_call
        return dict(self.unprepare_results)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short base path: AF_UNIX paths must stay under 108 bytes."""
    d = Path(tempfile.mkdtemp(prefix="tdg", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Running:
    def __init__(self, server: PluginServer, state: FakeState, board: DeviceHealthBoard) -> None:
        self.server = server
        self.state = state
        self.board = board
        self.kubelet = KubeletStub(server.dra_socket)
        self.registrar = KubeletStub(server.registration_socket)


def no_claims(_namespace: str, _name: str) -> dict[str, Any] | None:
    """An API server without ResourceClaims."""
    return None


def start_plugin(base: Path, pod_uid: str | None = None, devices: Sequence[str] = ("gpu-0", "gpu-1"),
                 resend_interval: float = 10.0, claim_getter: ClaimGetter = no_claims) -> Running:
    state = FakeState()
    board = DeviceHealthBoard(NODE, resend_interval=resend_interval, timeout_seconds=30)
    board.set_devices(devices)
    server = PluginServer(driver_name=DRIVER, node_name=NODE, state=state, claim_getter=claim_getter, board=board,
                          plugin_dir=base / "plugins" / DRIVER, registry_dir=base / "registry", pod_uid=pod_uid)
    server.start()
    return Running(server, state, board)


@pytest.fixture
def plugin(short_dir: Path) -> Iterator[Running]:
    p = start_plugin(short_dir)
    yield p
    p.kubelet.close()
    p.registrar.close()
    p.server.stop(grace=0)


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


# ---------------- registration ----------------


def test_get_info_advertises_dra_and_health_services(plugin: Running, short_dir: Path) -> None:
    info = plugin.registrar.get_info()
    assert info.type == "DRAPlugin"
    assert info.name == DRIVER
    assert info.endpoint == str(short_dir / "plugins" / DRIVER / "dra.sock")
    assert Path(info.endpoint).is_absolute()
    # v1 first: 1.34+ kubelets take the first entry they know.
    assert list(info.supported_versions) == [
        "v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"]
    assert plugin.server.registration_socket == short_dir / "registry" / f"{DRIVER}-reg.sock"


def test_registration_status_is_logged_and_counted(plugin: Running, caplog: pytest.LogCaptureFixture) -> None:
    failures = sample("topodra_plugin_registration_failures_total")
    assert sample("topodra_plugin_registration_status") == 0
    with caplog.at_level(logging.INFO, logger="topodra.plugin.registration"):
        plugin.registrar.notify_registration(False, "plugin validation failed: bad endpoint")
    assert not plugin.server.registration.registered
    assert plugin.server.registration.last_error == "plugin validation failed: bad endpoint"
    assert sample("topodra_plugin_registration_status") == 0
    assert sample("topodra_plugin_registration_failures_total") == failures + 1
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and "bad endpoint" in errors[-1].getMessage() and DRIVER in errors[-1].getMessage()

    plugin.registrar.notify_registration(True)
    assert plugin.server.registration.registered
    assert sample("topodra_plugin_registration_status") == 1
    assert sample("topodra_plugin_registration_failures_total") == failures + 1
    # Still answering afterwards, as the plugin watcher re-checks GetInfo.
    assert plugin.registrar.get_info().name == DRIVER


# ---------------- prepare / unprepare ----------------


def two_devices() -> PrepareResult:
    return PrepareResult(devices=[
        PreparedDevice(request_names=["gpu", "nic"], pool_name=NODE, device_name="gpu-0",
                       cdi_device_ids=["k8s.gpu.topodra.io/claim=uid-a-gpu-0"], share_id="share-1"),
        PreparedDevice(request_names=[], pool_name=NODE, device_name="gpu-1",
                       cdi_device_ids=["k8s.gpu.topodra.io/claim=uid-a-gpu-1", "nvidia.com/gpu=1"], share_id=None),
    ])


def test_prepare_v1_carries_share_id_and_request_names(plugin: Running) -> None:
    plugin.state.results = {"uid-a": two_devices()}
    resp = plugin.kubelet.prepare([("ns", "uid-a", "claim-a")], api="v1")
    assert plugin.state.prepare_calls == [[ClaimRef(namespace="ns", uid="uid-a", name="claim-a")]]
    # The claim was read before the state was called; this API server does not have it.
    assert plugin.state.prepare_claims == [
        UnavailableClaim(ClaimRef("ns", "uid-a", "claim-a"),
                         "claim ns/claim-a (uid-a): ResourceClaim not found")]
    assert set(resp.claims) == {"uid-a"}
    entry = resp.claims["uid-a"]
    assert entry.error == ""
    d0, d1 = entry.devices
    assert list(d0.request_names) == ["gpu", "nic"]
    assert (d0.pool_name, d0.device_name) == (NODE, "gpu-0")
    assert list(d0.cdi_device_ids) == ["k8s.gpu.topodra.io/claim=uid-a-gpu-0"]
    assert d0.HasField("share_id") and d0.share_id == "share-1"
    assert list(d1.request_names) == []
    assert list(d1.cdi_device_ids) == ["k8s.gpu.topodra.io/claim=uid-a-gpu-1", "nvidia.com/gpu=1"]
    assert not d1.HasField("share_id")


def test_prepare_v1beta1_drops_share_id(plugin: Running) -> None:
    plugin.state.results = {"uid-a": two_devices()}
    resp = plugin.kubelet.prepare([("ns", "uid-a", "claim-a")], api="v1beta1")
    d0, d1 = resp.claims["uid-a"].devices
    assert "share_id" not in d0.DESCRIPTOR.fields_by_name
    assert list(d0.request_names) == ["gpu", "nic"]
    assert d1.device_name == "gpu-1"
    assert len(plugin.state.prepare_calls) == 1


@pytest.mark.parametrize("api", ["v1", "v1beta1"])
def test_every_requested_claim_gets_an_entry(plugin: Running, api: str) -> None:
    plugin.state.results = {
        "uid-ok": PrepareResult(devices=[PreparedDevice(["gpu"], NODE, "gpu-0", ["k/c=x"])]),
        "uid-bad": PrepareResult(error="device gpu-9 is not on this node"),
        "uid-stranger": PrepareResult(),  # not requested: the kubelet would reject the whole answer
        # uid-missing: the state forgot it
    }
    claims = [("ns", "uid-ok", "a"), ("ns", "uid-bad", "b"), ("ns", "uid-missing", "c"),
              ("ns", "uid-noname", ""), ("ns", "uid-dup", "d"), ("ns", "uid-dup", "d")]
    errors = sample("topodra_plugin_request_errors_total", {"method": "NodePrepareResources", "scope": "claim"})
    resp = plugin.kubelet.prepare(claims, api=api)
    assert set(resp.claims) == {"uid-ok", "uid-bad", "uid-missing", "uid-noname", "uid-dup"}
    assert resp.claims["uid-ok"].error == "" and len(resp.claims["uid-ok"].devices) == 1
    assert resp.claims["uid-bad"].error == "device gpu-9 is not on this node"
    assert "no prepare result" in resp.claims["uid-missing"].error
    assert "lacks name" in resp.claims["uid-noname"].error
    assert "more than once" in resp.claims["uid-dup"].error and not resp.claims["uid-dup"].devices
    # Malformed and duplicate claims never reach the state.
    assert [c.uid for c in plugin.state.prepare_calls[0]] == ["uid-ok", "uid-bad", "uid-missing"]
    assert sample("topodra_plugin_request_errors_total",
                  {"method": "NodePrepareResources", "scope": "claim"}) == errors + 4


@pytest.mark.parametrize("api", ["v1", "v1beta1"])
def test_unprepare_maps_per_claim_errors(plugin: Running, api: str) -> None:
    plugin.state.unprepare_results = {"uid-a": "", "uid-b": "cannot remove CDI spec: busy"}
    resp = plugin.kubelet.unprepare([("ns", "uid-a", "a"), ("ns", "uid-b", "b"), ("ns", "uid-c", "c")], api=api)
    assert set(resp.claims) == {"uid-a", "uid-b", "uid-c"}
    assert resp.claims["uid-a"].error == ""
    assert resp.claims["uid-b"].error == "cannot remove CDI spec: busy"
    assert "no unprepare result" in resp.claims["uid-c"].error
    assert [c.uid for c in plugin.state.unprepare_calls[0]] == ["uid-a", "uid-b", "uid-c"]


@pytest.mark.parametrize("api", ["v1", "v1beta1"])
def test_empty_batch(plugin: Running, api: str) -> None:
    assert len(plugin.kubelet.prepare([], api=api).claims) == 0
    assert len(plugin.kubelet.unprepare([], api=api).claims) == 0
    assert plugin.state.prepare_calls == [] and plugin.state.unprepare_calls == []


@pytest.mark.parametrize("method", ["prepare", "unprepare"])
def test_state_crash_fails_the_whole_call(plugin: Running, method: str) -> None:
    plugin.state.raise_on_call = RuntimeError("checkpoint is on fire")
    name = "NodePrepareResources" if method == "prepare" else "NodeUnprepareResources"
    before = sample("topodra_plugin_request_errors_total", {"method": name, "scope": "call"})
    with pytest.raises(grpc.RpcError) as err:
        getattr(plugin.kubelet, method)([("ns", "uid-a", "a")])
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "checkpoint is on fire" in err.value.details()
    assert sample("topodra_plugin_request_errors_total", {"method": name, "scope": "call"}) == before + 1
    assert sample("topodra_plugin_requests_in_flight", {"method": name}) == 0


def test_claim_without_uid_is_invalid_argument(plugin: Running) -> None:
    with pytest.raises(grpc.RpcError) as err:
        plugin.kubelet.prepare([("ns", "uid-a", "a"), ("ns", "", "b")])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ns/b has no uid" in err.value.details()
    assert plugin.state.prepare_calls == []


def test_request_metrics(plugin: Running) -> None:
    labels = {"method": "NodePrepareResources", "api": "v1beta1"}
    count = sample("topodra_plugin_requests_total", labels)
    observed = sample("topodra_plugin_request_duration_seconds_count", {"method": "NodePrepareResources"})
    plugin.state.results = {"u": PrepareResult()}
    plugin.kubelet.prepare([("ns", "u", "n")], api="v1beta1")
    assert sample("topodra_plugin_requests_total", labels) == count + 1
    assert sample("topodra_plugin_request_duration_seconds_count",
                  {"method": "NodePrepareResources"}) == observed + 1


# ---------------- the prepare lock: no API call while it is held ----------------


def test_claims_are_read_concurrently_before_the_prepare_lock(short_dir: Path) -> None:
    """N concurrent prepares, each GET slow: the GETs must overlap, and the lock is held only briefly.

    The getter waits on a barrier of N: it passes only if all N GETs are in flight at
    once, which is impossible when a GET runs under the node lock (the old design).
    """
    n, api_delay = 4, 1.0
    inventory = Inventory([Device(name=f"gpu-{k}", kind="gpu", uuid=f"GPU-{k}") for k in range(n)])
    claims = {f"c{k}": {"metadata": {"uid": f"uid-{k}"}, "status": {"allocation": {"devices": {"results": [
        {"request": "gpus/h100", "driver": DRIVER, "pool": NODE, "device": f"gpu-{k}"}]}}}} for k in range(n)}
    all_in_flight = threading.Barrier(n, timeout=20)

    def slow_api(_namespace: str, name: str) -> dict[str, Any]:
        all_in_flight.wait()
        time.sleep(api_delay)
        return claims[name]

    state = DeviceState(DRIVER, NODE, inventory, short_dir / "cdi", short_dir / "state",
                        boot_id_path=str(short_dir / "no-boot-id"), nvidia_spec_dirs=[],
                        observer=metrics.MetricsObserver())
    board = DeviceHealthBoard(NODE)
    server = PluginServer(driver_name=DRIVER, node_name=NODE, state=state, claim_getter=slow_api, board=board,
                          plugin_dir=short_dir / "plugins" / DRIVER, registry_dir=short_dir / "registry")
    server.start()
    labels = {"operation": "prepare"}
    count0 = sample("topodra_plugin_lock_hold_seconds_count", labels)
    fast0 = sample("topodra_plugin_lock_hold_seconds_bucket", {**labels, "le": "0.5"})
    answers: dict[str, Any] = {}

    def call(k: int) -> None:
        with KubeletStub(server.dra_socket) as kubelet:
            answers[f"uid-{k}"] = kubelet.prepare([("ns", f"uid-{k}", f"c{k}")], timeout=30).claims[f"uid-{k}"]

    try:
        threads = [threading.Thread(target=call, args=(k,)) for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        server.stop(grace=0)
    assert {uid: a.error for uid, a in answers.items()} == {f"uid-{k}": "" for k in range(n)}
    assert [list(answers[f"uid-{k}"].devices[0].request_names) for k in range(n)] == [["gpus"]] * n
    # The lock was held at most once per call (calls that queue are served together), and each
    # time for less than half of one API round trip.
    holds = sample("topodra_plugin_lock_hold_seconds_count", labels) - count0
    assert 1 <= holds <= n
    assert sample("topodra_plugin_lock_hold_seconds_bucket", {**labels, "le": "0.5"}) - fast0 == holds


# ---------------- sockets ----------------


def make_stale_socket(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # the file stays behind, nobody listens: like a crashed plugin's socket


def test_stale_sockets_are_replaced(short_dir: Path) -> None:
    dra = short_dir / "plugins" / DRIVER / "dra.sock"
    reg = short_dir / "registry" / f"{DRIVER}-reg.sock"
    make_stale_socket(dra)
    make_stale_socket(reg)
    for path in (dra, reg):
        with pytest.raises(ConnectionRefusedError), socket.socket(socket.AF_UNIX) as s:
            s.connect(str(path))
    p = start_plugin(short_dir)
    try:
        assert p.registrar.get_info().endpoint == str(dra)
        p.state.results = {"u": PrepareResult()}
        assert set(p.kubelet.prepare([("ns", "u", "n")]).claims) == {"u"}
    finally:
        p.server.stop(grace=0)


def test_refuses_to_replace_a_non_socket(short_dir: Path) -> None:
    reg = short_dir / "registry" / f"{DRIVER}-reg.sock"
    reg.parent.mkdir(parents=True)
    reg.write_text("not a socket")
    with pytest.raises(SocketPathError, match="not a socket"):
        start_plugin(short_dir)
    assert reg.read_text() == "not a socket"
    # The DRA socket that was already up is cleaned away again.
    assert not (short_dir / "plugins" / DRIVER / "dra.sock").exists()


def test_stop_removes_own_sockets_only(short_dir: Path) -> None:
    p = start_plugin(short_dir)
    dra, reg = p.server.dra_socket, p.server.registration_socket
    assert dra.exists() and reg.exists()
    assert p.server.problem() is None
    # Someone (a new instance) replaced the registration socket: not ours to delete any more.
    reg.unlink()
    make_stale_socket(reg)
    assert "registration socket" in (p.server.problem() or "")
    p.server.stop(grace=0)
    assert not dra.exists()
    assert reg.exists()
    assert p.server.problem() == "servers are not running"


def test_pod_uid_socket_names(short_dir: Path) -> None:
    uid = "3f6c1a2e-6c1b-4d8e-9a57-0f1e2d3c4b5a"
    p = start_plugin(short_dir, pod_uid=uid)
    try:
        assert p.server.dra_socket == short_dir / "plugins" / DRIVER / f"dra-{uid}.sock"
        assert p.server.registration_socket == short_dir / "registry" / f"{DRIVER}-{uid}-reg.sock"
        assert p.server.dra_socket.exists() and p.server.registration_socket.exists()
        assert p.registrar.get_info().endpoint == str(p.server.dra_socket)
    finally:
        p.server.stop(grace=0)
    assert not p.server.dra_socket.exists() and not p.server.registration_socket.exists()


def test_long_socket_names_are_shortened() -> None:
    uid = "3f6c1a2e-6c1b-4d8e-9a57-0f1e2d3c4b5a"
    short = Path("/var/lib/kubelet/plugins_registry")
    assert registration_socket_path(short, DRIVER) == short / f"{DRIVER}-reg.sock"
    assert registration_socket_path(short, DRIVER, uid) == short / f"{DRIVER}-{uid}-reg.sock"
    # Long driver name: the UID is hashed to 8 characters.
    driver = "gpu-accelerators.example-corporation.topodra.io"
    hashed = registration_socket_path(short, driver, uid)
    assert hashed.name.startswith(driver + "-") and hashed.name.endswith("-reg.sock")
    assert len(hashed.name) == len(driver) + 1 + 8 + len("-reg.sock")
    assert len(str(hashed).encode()) <= MAX_SOCKET_PATH
    assert registration_socket_path(short, driver, uid) == hashed  # deterministic
    assert registration_socket_path(short, driver, uid + "x") != hashed
    # Even longer: driver and UID hashed together.
    deep = Path("/var/lib/kubelet/plugins_registry/some/rather/deep/sub/directory")
    both = registration_socket_path(deep, driver, uid)
    assert both.name.startswith("dra-") and len(both.name) == len("dra-") + 16 + len("-reg.sock")
    with pytest.raises(SocketPathError, match="longer than"):
        registration_socket_path(Path("/" + "x" * 100), DRIVER)
    with pytest.raises(SocketPathError, match="longer than"):
        dra_socket_path(Path("/" + "x" * 100), uid)


# ---------------- device health stream ----------------


@pytest.mark.parametrize("api", ["v1", "v1alpha1"])
def test_health_stream_snapshot_updates_and_cancel(plugin: Running, api: str) -> None:
    start = time.time()
    # The gauge is process-wide: a stream of an earlier test's server may still be winding down (its generator
    # ends when next woken or collected), so count from what is open now.
    before = sample("topodra_plugin_health_streams")
    stream = plugin.kubelet.watch_health(api=api, timeout=3)
    first = next(stream)
    assert health_by_device(first) == {(NODE, "gpu-0"): 1, (NODE, "gpu-1"): 1}
    d = first.devices[0]
    assert d.health_check_timeout_seconds == 30
    assert start - 1 <= d.last_updated_time <= time.time() + 1
    assert sample("topodra_plugin_health_streams") == before + 1

    plugin.board.set_health("gpu-1", Health.UNHEALTHY, "XID 79: fallen off the bus")
    second = next(stream)
    assert health_by_device(second) == {(NODE, "gpu-0"): 1, (NODE, "gpu-1"): 2}
    assert [x.message for x in second.devices] == ["", "XID 79: fallen off the bus"]

    stream.cancel()
    deadline = time.monotonic() + 5
    while sample("topodra_plugin_health_streams") > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sample("topodra_plugin_health_streams") <= before


def test_health_stream_resends_periodically(short_dir: Path) -> None:
    p = start_plugin(short_dir, resend_interval=0.2)
    try:
        stream = p.kubelet.watch_health(timeout=10)
        t0 = time.monotonic()
        messages = [next(stream) for _ in range(3)]
        assert time.monotonic() - t0 < 5
        assert all(health_by_device(m) == {(NODE, "gpu-0"): 1, (NODE, "gpu-1"): 1} for m in messages)
        stream.cancel()
    finally:
        p.server.stop(grace=0)


def test_health_stream_ends_when_server_stops(short_dir: Path) -> None:
    p = start_plugin(short_dir)
    stream = p.kubelet.watch_health(timeout=3)
    next(stream)
    done = threading.Event()
    outcome: list[Any] = []

    def drain() -> None:
        try:
            for _ in stream:
                pass
            outcome.append("eof")
        except grpc.RpcError as e:
            outcome.append(e.code())
        done.set()

    threading.Thread(target=drain, daemon=True).start()
    t0 = time.monotonic()
    p.server.stop(grace=1)
    assert done.wait(5), "stream still open after server stop"
    assert time.monotonic() - t0 < 5
    assert outcome[0] in ("eof", grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


def test_health_streams_are_bounded(plugin: Running) -> None:
    streams = [plugin.kubelet.watch_health(timeout=20) for _ in range(MAX_HEALTH_STREAMS)]
    for s in streams:
        next(s)
    extra = plugin.kubelet.watch_health(timeout=3)
    with pytest.raises(grpc.RpcError) as err:
        next(extra)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Prepare still gets served while all streams are open.
    plugin.state.results = {"u": PrepareResult()}
    assert set(plugin.kubelet.prepare([("ns", "u", "n")], timeout=5).claims) == {"u"}
    for s in streams:
        s.cancel()


def test_board_rejects_unknown_devices_and_bad_timing() -> None:
    board = DeviceHealthBoard(NODE)
    board.set_devices(["gpu-0"])
    with pytest.raises(KeyError, match="gpu-7"):
        board.set_health("gpu-7", Health.UNHEALTHY)
    assert [d.name for d in board.snapshot()[1]] == ["gpu-0"]
    with pytest.raises(ValueError, match="resend_interval"):
        DeviceHealthBoard(NODE, resend_interval=30, timeout_seconds=30)


# ---------------- probe service and metrics endpoint ----------------


def test_probe_service_follows_plugin_health(short_dir: Path) -> None:
    p = start_plugin(short_dir)
    probe = ProbeServer(0, p.server.problem)
    probe.start()
    try:
        serving = health_pb2.HealthCheckResponse.SERVING
        assert probes.probe(probe.port) == serving
        assert probes.probe(probe.port, probes.PLUGIN_SERVICE) == serving
        assert probes.main(["--port", str(probe.port)]) == 0
        assert probes.probe(probe.port, "no.such.Service") == health_pb2.HealthCheckResponse.UNKNOWN
        p.server.dra_socket.unlink()  # the kubelet can no longer reach us: restart wanted
        assert probes.probe(probe.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert probes.main(["--port", str(probe.port)]) == 1
    finally:
        probe.stop()
        p.server.stop(grace=0)


def test_probe_watch_reports_changes(short_dir: Path) -> None:
    p = start_plugin(short_dir)
    probe = ProbeServer(0, p.server.problem)
    probe.servicer._watch_interval = 0.05
    probe.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{probe.port}") as channel:
            stub: Any = health_pb2_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            p.server.registration_socket.unlink()
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            unknown = stub.Watch(health_pb2.HealthCheckRequest(service="other"), timeout=10)
            assert [m.status for m in unknown] == [health_pb2.HealthCheckResponse.SERVICE_UNKNOWN]
    finally:
        probe.stop()
        p.server.stop(grace=0)


def test_probe_port_is_loopback_only() -> None:
    probe = ProbeServer(0, lambda: None)
    probe.start()
    try:
        with socket.create_connection(("127.0.0.1", probe.port), timeout=2):
            pass
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            local = line.split()[1]
            if int(local.split(":")[1], 16) == probe.port:
                assert local.split(":")[0] == "0100007F"  # 127.0.0.1
    finally:
        probe.stop()


def test_metrics_endpoint_exposes_all_metrics(plugin: Running) -> None:
    metrics.PUBLISHED_DEVICES.set(12)
    metrics.LAST_PUBLISH.set_to_current_time()
    plugin.state.results = {"u": PrepareResult()}
    plugin.kubelet.prepare([("ns", "u", "n")])
    plugin.kubelet.unprepare([("ns", "u", "n")])
    httpd = metrics.serve(0)
    try:
        assert httpd.server_address[0] == "127.0.0.1"
        url = f"http://127.0.0.1:{httpd.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    finally:
        httpd.shutdown()
        httpd.server_close()
    for name in ("topodra_plugin_requests_total", "topodra_plugin_request_errors_total",
                 "topodra_plugin_request_duration_seconds_bucket", "topodra_plugin_requests_in_flight",
                 "topodra_plugin_prepared_claims", "topodra_plugin_prepared_devices",
                 "topodra_plugin_registration_status", "topodra_plugin_registration_failures_total",
                 "topodra_plugin_health_streams", "topodra_plugin_last_publish_timestamp_seconds"):
        assert f"\n{name}" in text, name
    assert "\ntopodra_plugin_published_devices 12.0" in text
    assert 'topodra_plugin_requests_total{api="v1",method="NodeUnprepareResources"}' in text


# ---------------- configuration ----------------


def parse(argv: list[str], env: dict[str, str]) -> config.PluginConfig:
    parser = argparse.ArgumentParser()
    config.configure(parser)
    return config.from_args(parser.parse_args(argv), env)


def test_config_defaults_env_and_flags() -> None:
    cfg = parse([], {"NODE_NAME": "node-1"})
    assert cfg.node_name == "node-1"
    assert cfg.driver_name == DRIVER
    assert cfg.plugin_dir == Path("/var/lib/kubelet/plugins") / DRIVER
    assert cfg.registry_dir == Path("/var/lib/kubelet/plugins_registry")
    assert cfg.cdi_root == Path("/var/run/cdi")
    assert cfg.hardware == "nvml" and cfg.pod_uid is None and cfg.kubeconfig is None

    env = {"NODE_NAME": "ignored", "TOPODRA_NODE_NAME": "node-2", "TOPODRA_DRIVER_NAME": "x.example.com",
           "TOPODRA_HEALTH_PORT": "7000", "TOPODRA_HARDWARE": "mock:dgx-h100", "TOPODRA_POD_UID": "abc-123"}
    cfg = parse(["--health-port", "7001", "--metrics-port", "0"], env)
    assert cfg.node_name == "node-2"
    assert cfg.driver_name == "x.example.com"
    assert cfg.plugin_dir == Path("/var/lib/kubelet/plugins/x.example.com")
    assert cfg.health_port == 7001 and cfg.metrics_port == 0
    assert cfg.hardware == "mock:dgx-h100" and cfg.pod_uid == "abc-123"


@pytest.mark.parametrize(("argv", "env", "message"), [
    ([], {}, "--node-name is required"),
    (["--node-name", "Node_1"], {}, "--node-name (env TOPODRA_NODE_NAME)"),
    (["--node-name", "n", "--driver-name=-bad-"], {}, "--driver-name (env TOPODRA_DRIVER_NAME)"),
    (["--node-name", "n", "--health-port", "70000"], {}, "--health-port"),
    (["--node-name", "n"], {"TOPODRA_METRICS_PORT": "many"}, "--metrics-port (env TOPODRA_METRICS_PORT)"),
    (["--node-name", "n", "--plugin-dir", "relative/dir"], {}, "must be an absolute path"),
    (["--node-name", "n", "--hardware", "gpu"], {}, "is not 'nvml', 'mock:<profile>' or 'replay:<path>'"),
    (["--node-name", "n", "--hardware", "mock:"], {}, "--hardware"),
    (["--node-name", "n", "--pod-uid", "../etc"], {}, "--pod-uid"),
])
def test_config_errors_name_the_flag(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(argv, env)
    assert message in str(err.value)


def test_hardware_config_file(tmp_path: Path) -> None:
    good = tmp_path / "hw.yaml"
    good.write_text("rails:\n  mlx5_0: 0\n  mlx5_1: 1\n")
    cfg = parse(["--node-name", "n", "--hardware-config", str(good)], {})
    assert cfg.hardware_overrides() == {"rails": {"mlx5_0": 0, "mlx5_1": 1}}
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping, got list"):
        parse(["--node-name", "n", "--hardware-config", str(bad)], {}).hardware_overrides()
    broken = tmp_path / "broken.yaml"
    broken.write_text("rails: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        parse(["--node-name", "n", "--hardware-config", str(broken)], {}).hardware_overrides()
    with pytest.raises(ConfigError, match="cannot read"):
        parse(["--node-name", "n", "--hardware-config", str(tmp_path / "nope.yaml")], {}).hardware_overrides()


# ---------------- the whole process ----------------


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"plugin exited with {proc.returncode} while waiting for {what}:\n"
                                 f"{proc.stdout.read() if proc.stdout else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_kubelet_plugin_process_serves_and_cleans_up_on_sigterm(short_dir: Path) -> None:
    # An API server that is not there: the publisher keeps retrying, everything else must work.
    kubeconfig = short_dir / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))
    health_port, metrics_port = free_port(), free_port()
    plugin_dir, registry_dir = short_dir / "plugins" / DRIVER, short_dir / "registry"
    cmd = [sys.executable, "-m", "topodra.cli", "--log-level", "INFO", "kubelet-plugin",
           "--hardware", "mock:dgx-h100", "--kubeconfig", str(kubeconfig), "--plugin-dir", str(plugin_dir),
           "--registry-dir", str(registry_dir), "--cdi-root", str(short_dir / "cdi"),
           "--health-port", str(health_port), "--metrics-port", str(metrics_port)]
    env = {**os.environ, "NODE_NAME": NODE}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        reg_socket = registry_dir / f"{DRIVER}-reg.sock"
        wait_until(reg_socket.exists, 60, "the registration socket", proc)
        with KubeletStub(reg_socket) as registrar:
            info = registrar.get_info()
            assert info.endpoint == str(plugin_dir / "dra.sock")
            registrar.notify_registration(True)
        with KubeletStub(info.endpoint) as kubelet:
            assert len(kubelet.prepare([]).claims) == 0
            # Unknown claims unprepare cleanly (idempotent), answered by the real state.
            assert kubelet.unprepare([("ns", "uid-never-prepared", "c")]).claims["uid-never-prepared"].error == ""
            stream = kubelet.watch_health(timeout=30)
            devices = health_by_device(next(stream))
            stream.cancel()
        assert {(NODE, f"gpu-{i}") for i in range(8)} <= set(devices)
        assert set(devices.values()) == {1}
        wait_until(lambda: probes.probe(health_port, timeout=1) == health_pb2.HealthCheckResponse.SERVING,
                   30, "SERVING", proc)
        vm_rss_before = vm_rss(proc.pid)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        vm_rss_after = vm_rss(proc.pid)
        assert "\ntopodra_plugin_registration_status 1.0" in text
        # The process collector is what docs/benchmarks.md reads the memory budget from: it must be
        # this process's resident memory, as the kernel reports it around the same moment.
        rss = next(float(line.split()[1]) for line in text.splitlines()
                   if line.startswith("process_resident_memory_bytes"))
        assert 0.8 * min(vm_rss_before, vm_rss_after) <= rss <= 1.2 * max(vm_rss_before, vm_rss_after)

        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert not reg_socket.exists() and not (plugin_dir / "dra.sock").exists()
    assert "received SIGTERM" in out and "ResourceSlices are kept" in out


def vm_rss(pid: int) -> int:
    """Resident memory of ``pid`` in bytes, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _plugin_cmd(short_dir: Path, health_port: int, metrics_port: int) -> list[str]:
    kubeconfig = short_dir / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))
    return [sys.executable, "-m", "topodra.cli", "--log-level", "INFO", "kubelet-plugin",
            "--hardware", "mock:dgx-h100", "--kubeconfig", str(kubeconfig),
            "--plugin-dir", str(short_dir / "plugins" / DRIVER), "--registry-dir", str(short_dir / "registry"),
            "--cdi-root", str(short_dir / "cdi"), "--health-port", str(health_port),
            "--metrics-port", str(metrics_port)]


def test_kubelet_plugin_keeps_serving_when_metrics_port_is_taken(short_dir: Path) -> None:
    # /metrics is optional: a port held by someone else must not cost the kubelet its plugin.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", free_port()))
        squatter.listen()
        taken = squatter.getsockname()[1]
        proc = subprocess.Popen(_plugin_cmd(short_dir, free_port(), taken), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**os.environ, "NODE_NAME": NODE})
        try:
            reg_socket = short_dir / "registry" / f"{DRIVER}-reg.sock"
            wait_until(reg_socket.exists, 60, "the registration socket", proc)
            with KubeletStub(reg_socket) as registrar:
                endpoint = registrar.get_info().endpoint
            with KubeletStub(endpoint) as kubelet:
                assert kubelet.unprepare([("ns", "uid-x", "c")]).claims["uid-x"].error == ""
            assert proc.poll() is None
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, out
    assert f"metrics endpoint is off: cannot listen on 127.0.0.1:{taken}" in out
    assert "The kubelet plugin keeps serving" in out


def test_kubelet_plugin_health_port_taken_exits_2_clearly(short_dir: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", free_port()))
        squatter.listen()
        taken = squatter.getsockname()[1]
        r = subprocess.run(_plugin_cmd(short_dir, taken, 0), capture_output=True, text=True, timeout=60,
                           env={**os.environ, "NODE_NAME": NODE})
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"--health-port {taken}: cannot listen on 127.0.0.1:{taken}" in r.stderr
    assert "another process holds the port" in r.stderr
    # It stopped cleanly: no socket is left for the kubelet to dial.
    assert not (short_dir / "registry" / f"{DRIVER}-reg.sock").exists()


def test_kubelet_plugin_config_error_exits_2(short_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_NAME", "TOPODRA_NODE_NAME")}
    r = subprocess.run([sys.executable, "-m", "topodra.cli", "kubelet-plugin", "--registry-dir", str(short_dir)],
                       capture_output=True, text=True, env=env, timeout=60, check=False)
    assert r.returncode == 2
    assert "--node-name is required" in r.stderr
    assert list(short_dir.iterdir()) == []  # nothing created
