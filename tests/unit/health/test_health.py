"""Device health without a cluster: the signal policy, the NVML/sysfs sources on injected mock faults,
the monitor feeding ResourceSlice taints and the kubelet's health streams, and the readiness probe.

Mock hardware runs the real ``NvmlBackend``/``NodeHealthSource`` code on a fake ``pynvml``; faults are
injected the way the e2e tests do it: the JSON faults file and writes into the sysfs tree.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from testkit.kubeletstub import KubeletStub, health_by_device
from testkit.paths import REPO

from topodra.devices import Device
from topodra.hardware import NvmlBackend, load_backend
from topodra.health.monitor import HealthMonitor, HealthSnapshot
from topodra.health.policy import (
    GPU_LOST_KEY,
    NIC_DOWN_KEY,
    NVLINK_KEY,
    XID_KEY,
    XID_RULES,
    DeviceTaint,
    Effect,
    HealthPolicy,
    Observation,
    classify,
)
from topodra.health.sources import NodeHealthSource
from topodra.inventory import Inventory
from topodra.pb.grpchealth.v1 import health_pb2
from topodra.plugin import probes
from topodra.plugin.device_health import DeviceHealthBoard
from topodra.plugin.probes import ProbeServer, all_of, answers
from topodra.plugin.server import PluginServer
from topodra.slices import MAX_DEVICES_PER_SLICE_ADVANCED, build_slices, same_content

NODE = "node-h"
DRIVER = "gpu.topodra.io"


# ---------------- policy (pure)


@pytest.mark.parametrize("code", [13, 31, 43, 45])
def test_application_xids_never_taint(code: int) -> None:
    assert classify(Observation("gpu-0", "xid", str(code))) is None


@pytest.mark.parametrize(("code", "effect"), [  # NoSchedule as NVIDIA's DRA driver; NoExecute is opt-in
    (48, Effect.NO_SCHEDULE), (79, Effect.NO_SCHEDULE), (95, Effect.NO_SCHEDULE), (74, Effect.NO_SCHEDULE),
    (119, Effect.NO_SCHEDULE), (120, Effect.NO_SCHEDULE), (94, Effect.NO_SCHEDULE), (92, Effect.NO_SCHEDULE),
    (64, Effect.NO_SCHEDULE), (63, Effect.NONE), (999, Effect.NO_SCHEDULE),
])
def test_xid_effects(code: int, effect: Effect) -> None:
    cond = classify(Observation("gpu-0", "xid", str(code)))
    assert cond is not None
    assert (cond.key, cond.value, cond.effect) == (XID_KEY, str(code), effect)


def test_docs_table_lists_every_xid_rule() -> None:
    """docs/health.md is the operator's table: each XID the code knows has a row with the same effect."""
    doc = (REPO / "docs" / "health.md").read_text()
    for code, rule in XID_RULES.items():
        effect = "no taint" if rule.effect is None else str(rule.effect)
        row = next((line for line in doc.splitlines() if line.startswith(f"| {code} |")), None)
        assert row is not None, f"XID {code} missing from docs/health.md"
        assert f"| {effect} |" in row, (code, row)


def test_bad_observations_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="numeric"):
        classify(Observation("gpu-0", "xid", "seventy-nine"))
    with pytest.raises(ValueError, match="hold_seconds"):
        HealthPolicy(-1)


def test_event_taint_holds_then_clears_and_repeat_extends() -> None:
    p = HealthPolicy(hold_seconds=10)
    p.observe([Observation("gpu-1", "xid", "79")], now=100.4)
    assert p.taints() == {"gpu-1": (DeviceTaint(XID_KEY, "79", Effect.NO_SCHEDULE, 100),)}
    assert p.states(["gpu-0", "gpu-1"])["gpu-1"].unhealthy
    assert not p.states(["gpu-0", "gpu-1"])["gpu-0"].unhealthy
    p.observe([Observation("gpu-1", "xid", "79")], now=105)  # again: the hold restarts, timeAdded stays
    p.expire(114)
    assert p.taints()["gpu-1"][0].time_added == 100
    assert not p.expire(114.9)
    assert p.expire(115)
    assert p.taints() == {}
    assert p.states(["gpu-1"])["gpu-1"].unhealthy is False


def test_level_signal_clears_hold_after_recovery() -> None:
    p = HealthPolicy(hold_seconds=3)
    for t in range(0, 10):  # the link is seen down at every poll for 10 s
        p.observe([Observation("nic-2", "nic-down", "port1-DOWN-POLLING")], now=t)
        p.expire(t)
        assert p.taints()["nic-2"][0].key == NIC_DOWN_KEY
    p.expire(11.9)
    assert "nic-2" in p.taints()
    p.expire(12)
    assert p.taints() == {}


def test_nvlink_down_degrades_the_domain_informationally() -> None:
    p = HealthPolicy(hold_seconds=5)
    p.set_domains({"gpu-0": "d1", "gpu-1": "d1", "gpu-2": "d2"})
    p.observe([Observation("gpu-0", "nvlink-down", "3")], now=1)
    t = p.taints()
    assert [(x.key, x.effect) for x in t["gpu-0"]] == [(NVLINK_KEY, Effect.NO_SCHEDULE)]
    assert [(x.key, x.value, x.effect) for x in t["gpu-1"]] == [(NVLINK_KEY, "domain", Effect.NONE)]
    assert "gpu-2" not in t
    states = p.states(["gpu-0", "gpu-1", "gpu-2"])
    assert states["gpu-0"].unhealthy and not states["gpu-1"].unhealthy
    assert "link" in states["gpu-1"].message


def test_worst_taints_are_kept_first() -> None:
    p = HealthPolicy(hold_seconds=5, no_execute={"gpu-lost"})
    p.observe([Observation("gpu-0", "throttle", "HwSlowdown"), Observation("gpu-0", "xid", "94"),
               Observation("gpu-0", "gpu-lost")], now=1)
    assert [t.effect for t in p.taints()["gpu-0"]] == [Effect.NO_EXECUTE, Effect.NO_SCHEDULE, Effect.NONE]


# ---------------- sources on injected mock faults


class MockNode:
    """dgx-h100 mock hardware with its own sysfs tree and faults file."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.faults_file = root / "faults.json"
        self.backend: NvmlBackend = load_backend("mock:dgx-h100", NODE, sysfs_root=str(root / "hw"),
                                                 overrides={"faultsFile": str(self.faults_file)})
        self.devices = self.backend.discover()
        self.faults: dict[str, Any] = {"gpus": {}, "events": []}

    def write(self) -> None:
        tmp = self.faults_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.faults))
        tmp.replace(self.faults_file)

    def event(self, gpu: int | str, kind: str, data: int = 0) -> None:
        self.faults["events"].append({"gpu": gpu, "type": kind, "data": data})
        self.write()

    def gpu(self, index: int, **faults: Any) -> None:
        if faults:
            self.faults["gpus"][str(index)] = faults
        else:
            self.faults["gpus"].pop(str(index), None)
        self.write()

    def port(self, rdma: str, state: str, phys: str) -> None:
        port = self.root / "hw" / "sys" / "class" / "infiniband" / rdma / "ports" / "1"
        (port / "state").write_text(state + "\n")
        (port / "phys_state").write_text(phys + "\n")

    def source(self) -> NodeHealthSource:
        return NodeHealthSource(self.backend.nvml, self.backend.sysfs, self.devices)


@pytest.fixture
def node(tmp_path: Path) -> MockNode:
    return MockNode(tmp_path)


def kinds(observations: list[Observation]) -> set[tuple[str, str, str]]:
    return {(o.device, o.kind, o.detail) for o in observations}


def test_healthy_mock_node_reports_nothing(node: MockNode) -> None:
    src = node.source()
    src.open()
    try:
        assert src.poll() == []
        assert src.wait_events(0.05) == []
    finally:
        src.close()


def test_nvml_events_are_delivered_once_and_only_after_registration(node: MockNode) -> None:
    node.event(0, "xid", 48)  # before the event set exists: never delivered (as in NVML)
    src = node.source()
    src.open()
    try:
        assert src.wait_events(0.05) == []
        node.event(3, "xid", 79)
        node.event(node.devices[5].uuid, "dbe")
        node.event(1, "sbe")
        node.event(2, "xid", 13)
        got = src.wait_events(1.0)
        assert kinds(got) == {("gpu-3", "xid", "79"), ("gpu-5", "ecc-dbe", ""), ("gpu-1", "ecc-sbe", ""),
                              ("gpu-2", "xid", "13")}
        assert src.wait_events(0.05) == []  # once
    finally:
        src.close()


def test_polled_gpu_faults(node: MockNode) -> None:
    src = node.source()
    src.open()
    try:
        assert src.poll() == []  # learns which links are up
        node.gpu(2, lost=True)
        node.gpu(4, nvlinksDown=[0, 7])
        node.gpu(6, clocksEventReasons=0x40 | 0x4)  # HW thermal slowdown + SW power cap (ignored)
        assert kinds(src.poll()) == {("gpu-2", "gpu-lost", ""), ("gpu-4", "nvlink-down", "0,7"),
                                     ("gpu-6", "throttle", "HwThermalSlowdown")}
        for i in (2, 4, 6):
            node.gpu(i)
        assert src.poll() == []
    finally:
        src.close()


def test_nvlink_down_before_start_is_found_from_the_domain_peers(node: MockNode) -> None:
    """A link already down at start was never seen up: the other GPUs on the NVSwitch have it up."""
    node.gpu(3, nvlinksDown=[5, 6])
    src = node.source()
    src.open()
    try:
        assert kinds(src.poll()) == {("gpu-3", "nvlink-down", "5,6")}
        node.gpu(3, nvlinksDown=[5])  # one link comes back
        assert kinds(src.poll()) == {("gpu-3", "nvlink-down", "5")}
        node.gpu(3)
        assert src.poll() == []
    finally:
        src.close()


def test_only_a_minority_missing_a_link_is_down(node: MockNode) -> None:
    """Links that most peers lack (not wired on this system) are not expected of anyone."""
    for i in range(5):  # 5 of 8 GPUs lack link 17: it is not counted as expected for the other 3
        node.gpu(i, nvlinksDown=[17])
    src = node.source()
    src.open()
    try:
        assert src.poll() == []
    finally:
        src.close()


def test_lost_gpu_stays_in_rediscovery_marked_lost(node: MockNode) -> None:
    """A GPU lost at run time keeps its device (marked lost, so it is tainted) instead of silently vanishing."""
    node.gpu(1, lost=True)
    again = {d.name: d for d in node.backend.discover()}
    assert set(again) == {d.name for d in node.devices}
    assert "GPU is lost" in again["gpu-1"].lost
    assert [n for n, d in again.items() if d.lost] == ["gpu-1"]


def test_nic_port_state_from_sysfs_survives_rediscovery(node: MockNode) -> None:
    src = node.source()
    src.open()
    try:
        node.port("mlx5_4", "1: DOWN", "3: Disabled")
        # Re-discovery builds the mock hardware again; the written fault must stay.
        load_backend("mock:dgx-h100", NODE, sysfs_root=str(node.root / "hw"),
                     overrides={"faultsFile": str(node.faults_file)}).discover()
        assert kinds(src.poll()) == {("nic-2", "nic-down", "port1-DOWN-DISABLED")}
        node.port("mlx5_4", "4: ACTIVE", "5: LinkUp")
        assert src.poll() == []
    finally:
        src.close()


def test_bad_faults_file_keeps_the_last_good_faults(node: MockNode, caplog: pytest.LogCaptureFixture) -> None:
    src = node.source()
    src.open()
    try:
        node.gpu(0, lost=True)
        assert kinds(src.poll()) == {("gpu-0", "gpu-lost", "")}
        node.faults_file.write_text('{"gpus": {"0": {"lost": "maybe?"}}, "bogus": 1}')
        assert kinds(src.poll()) == {("gpu-0", "gpu-lost", "")}
        assert "unusable" in caplog.text
    finally:
        src.close()


# ---------------- monitor → slices and the kubelet's health board/streams


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_monitor_feeds_taints_and_board_and_clears_after_hold(node: MockNode) -> None:
    inv = Inventory(node.devices)
    clock = Clock()
    mon = HealthMonitor(inv, lambda devs: NodeHealthSource(node.backend.nvml, node.backend.sysfs, devs),
                        hold_seconds=30, poll_interval=1, clock=clock)
    board = DeviceHealthBoard(NODE)
    inv.subscribe(board.devices_changed)
    seen: list[HealthSnapshot] = []
    mon.subscribe(board.health_changed)
    mon.subscribe(seen.append)
    try:
        mon.step()  # opens the sources; every device is known and healthy
        assert mon.taints() == {} and not any(s.unhealthy for s in mon.snapshot.states.values())
        assert not mon.step()  # nothing new: no notification
        node.event(3, "xid", 79)
        node.port("mlx5_0", "1: DOWN", "2: Polling")
        clock.t += 1
        assert mon.step(wait=1.0)
        taints = mon.taints()
        assert [t.text for t in taints["gpu-3"]] == [f"{XID_KEY}=79:NoSchedule"]
        assert [t.text for t in taints["nic-0"]] == [f"{NIC_DOWN_KEY}=port1-DOWN-POLLING:NoSchedule"]
        _, board_devices = board.snapshot()
        health_of = {d.name: d for d in board_devices}
        assert health_of["gpu-3"].health.name == "UNHEALTHY" and "XID 79" in health_of["gpu-3"].message
        assert health_of["nic-0"].health.name == "UNHEALTHY"
        assert health_of["gpu-0"].health.name == "HEALTHY"
        # ResourceSlice: the taints ride on the device entries; a tainted pool uses <= 64 devices per slice.
        sl = build_slices(DRIVER, NODE, None, node.devices, 7, taints)
        entries = {d["name"]: d for d in sl[0]["spec"]["devices"]}
        assert entries["gpu-3"]["taints"] == [{"key": XID_KEY, "value": "79", "effect": "NoSchedule",
                                              "timeAdded": "1970-01-01T00:16:41Z"}]
        assert "taints" not in entries["gpu-0"]
        node.port("mlx5_0", "4: ACTIVE", "5: LinkUp")  # recovered; no new XID
        clock.t += 29
        mon.step()
        assert set(mon.taints()) == {"gpu-3", "nic-0"}  # hysteresis
        clock.t += 2
        assert mon.step()
        assert mon.taints() == {}
        _, board_devices = board.snapshot()
        assert all(d.health.name == "HEALTHY" and d.message == "" for d in board_devices)
        assert len(seen) == 4  # empty, all healthy, tainted, cleared: no churn in between
    finally:
        mon.stop()


def test_tainted_slices_are_split_at_64_and_compare_equal_after_a_round_trip() -> None:
    devices = [Device(name=f"gpu-{i}", kind="gpu") for i in range(100)]
    taint = DeviceTaint(GPU_LOST_KEY, "", Effect.NO_EXECUTE, 1_700_000_000)
    clean = build_slices(DRIVER, NODE, None, devices, 1)
    tainted = build_slices(DRIVER, NODE, None, devices, 1, {"gpu-5": (taint,)})
    assert len(clean) == 1 and len(tainted) == 2
    assert len(tainted[0]["spec"]["devices"]) == MAX_DEVICES_PER_SLICE_ADVANCED
    assert tainted[0]["spec"]["devices"][5]["taints"] == [
        {"key": GPU_LOST_KEY, "effect": "NoExecute", "timeAdded": "2023-11-14T22:13:20Z"}]
    assert same_content(json.loads(json.dumps(tainted[0])), tainted[0])
    assert not same_content(build_slices(DRIVER, NODE, None, devices, 1)[0], tainted[0])


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="tdh", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


class NoState:
    def prepare(self, claims: Any) -> dict[str, Any]:
        return {}

    def unprepare(self, claims: Any) -> dict[str, str]:
        return {}


def start_server(base: Path, board: DeviceHealthBoard) -> PluginServer:
    server = PluginServer(driver_name=DRIVER, node_name=NODE, state=NoState(), claim_getter=lambda ns, n: None,
                          board=board, plugin_dir=base / "plugins", registry_dir=base / "registry")
    server.start()
    return server


@pytest.mark.parametrize("api", ["v1", "v1alpha1"])
def test_both_health_stream_versions_report_monitor_state(short_dir: Path, api: str) -> None:
    board = DeviceHealthBoard(NODE)
    board.set_devices(["gpu-0", "gpu-1"])
    server = start_server(short_dir, board)
    try:
        with KubeletStub(server.dra_socket) as kubelet:
            stream = kubelet.watch_health(api=api, timeout=5)
            assert health_by_device(next(stream)) == {(NODE, "gpu-0"): 1, (NODE, "gpu-1"): 1}
            p = HealthPolicy(5)
            p.observe([Observation("gpu-1", "gpu-lost")], now=1)
            board.health_changed(HealthSnapshot(p.taints(), p.states(["gpu-0", "gpu-1"])))
            msg = next(stream)
            assert health_by_device(msg) == {(NODE, "gpu-0"): 1, (NODE, "gpu-1"): 2}
            assert "GPU is lost" in msg.devices[1].message
            p.expire(10)
            board.health_changed(HealthSnapshot(p.taints(), p.states(["gpu-0", "gpu-1"])))
            assert health_by_device(next(stream)) == {(NODE, "gpu-0"): 1, (NODE, "gpu-1"): 1}
            stream.cancel()
    finally:
        server.stop(grace=0)


# ---------------- readiness: the server must answer, not just have socket files


def test_readiness_calls_our_own_sockets(short_dir: Path) -> None:
    board = DeviceHealthBoard(NODE)
    server = start_server(short_dir, board)
    probe = ProbeServer(0, all_of(server.problem, lambda: answers(server.dra_socket, server.registration_socket)))
    probe.start()
    try:
        assert answers(server.dra_socket, server.registration_socket) is None
        assert probes.probe(probe.port) == health_pb2.HealthCheckResponse.SERVING
    finally:
        probe.stop()
        server.stop(grace=0)


def test_readiness_fails_on_a_socket_that_exists_but_does_not_answer(short_dir: Path) -> None:
    """A wedged listener: the socket file is there (the old existence check passed), nobody answers."""
    short_dir.joinpath("reg").mkdir()
    dra, reg = short_dir / "dra.sock", short_dir / "reg" / "r.sock"
    listeners = []
    for path in (dra, reg):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(path))
        s.listen(1)  # accepts at the kernel level, never speaks HTTP/2
        listeners.append(s)
    try:
        t0 = time.monotonic()
        reason = answers(dra, reg, timeout=0.5)
        assert reason is not None and "registration GetInfo" in reason and "DEADLINE_EXCEEDED" in reason
        assert time.monotonic() - t0 < 5
    finally:
        for s in listeners:
            s.close()


class QuietSource:
    """A health source that opens and reports nothing."""

    def open(self) -> None: ...
    def close(self) -> None: ...
    def wait_events(self, timeout: float) -> list[Observation]:
        return []
    def poll(self) -> list[Observation]:
        return []


def test_restart_carries_published_taints_for_one_hold_time() -> None:
    """Our taints read back from the slices are kept ``hold`` more seconds; admins' taints are not ours."""
    devices = [Device(name="gpu-0", kind="gpu"), Device(name="gpu-1", kind="gpu")]
    xid = DeviceTaint(XID_KEY, "48", Effect.NO_EXECUTE, 1_700_000_000)
    published = build_slices(DRIVER, NODE, None, devices, 4, {"gpu-0": (xid,)})
    published[0]["spec"]["devices"][1]["taints"] = [
        {"key": "example.com/maintenance", "effect": "NoSchedule", "timeAdded": "2026-01-01T00:00:00Z"}]
    old = build_slices(DRIVER, NODE, None, devices, 3, {"gpu-1": (xid,)})  # an older generation: ignored
    from topodra.slices import published_taints
    found = published_taints(json.loads(json.dumps(old + published)))
    assert found == {"gpu-0": [xid]}
    inv = Inventory(devices)

    clock = Clock()
    mon = HealthMonitor(inv, lambda devs: QuietSource(), hold_seconds=60, poll_interval=1, clock=clock)
    mon.adopt(found)
    assert mon.taints() == {"gpu-0": (xid,)}  # timeAdded kept
    assert mon.snapshot.states["gpu-0"].unhealthy
    clock.t += 59
    mon.step()
    assert mon.taints() == {"gpu-0": (xid,)}
    clock.t += 1
    mon.step()
    assert mon.taints() == {}


def test_a_monitor_that_cannot_read_the_hardware_says_so_and_clears_when_it_can(
        caplog: pytest.LogCaptureFixture) -> None:
    """NVML init failing (or any source raising) taints every device unmonitored, effect None, with a metric;
    the next round that works clears it (issue 31: the devices stayed "healthy" with one log line)."""
    from topodra.health.policy import UNMONITORED_KEY
    from topodra.plugin import metrics

    devices = [Device(name="gpu-0", kind="gpu"), Device(name="gpu-1", kind="gpu"), Device(name="nic-0", kind="nic")]
    inv = Inventory(devices)
    broken = [True]
    opened: list[int] = []

    class NvmlLike(QuietSource):
        def open(self) -> None:
            if broken[0]:
                raise RuntimeError("NVML_ERROR_LIBRARY_NOT_FOUND")
            opened.append(1)

    clock = Clock()
    mon = HealthMonitor(inv, lambda devs: NvmlLike(), hold_seconds=60, poll_interval=1, clock=clock)
    seen: list[HealthSnapshot] = []
    mon.subscribe(seen.append)
    mon.subscribe(metrics.health_changed)
    with caplog.at_level(logging.ERROR, logger="topodra.health.monitor"):
        assert not mon.round(0)
    assert mon.unmonitored
    assert {d: [t.text for t in ts] for d, ts in mon.taints().items()} == {
        n: [f"{UNMONITORED_KEY}=RuntimeError:None"] for n in ("gpu-0", "gpu-1", "nic-0")}
    assert metrics.HEALTH_UNMONITORED._value.get() == 3
    assert not any(s.unhealthy for s in mon.snapshot.states.values())  # nothing is known to be wrong
    sl = build_slices(DRIVER, NODE, None, devices, 1, mon.taints())
    assert sl[0]["spec"]["devices"][0]["taints"] == [{"key": UNMONITORED_KEY, "value": "RuntimeError",
                                                      "effect": "None", "timeAdded": "1970-01-01T00:16:40Z"}]
    assert sum("health monitoring failed" in r.getMessage() for r in caplog.records) == 1
    clock.t += 5
    assert not mon.round(0)  # still failing: the same taint (since kept), no new notification
    assert len(seen) == 2 and mon.taints()["gpu-0"][0].time_added == 1000
    broken[0] = False
    clock.t += 5
    assert mon.round(0)
    assert opened == [1] and not mon.unmonitored
    assert mon.taints() == {} and metrics.HEALTH_UNMONITORED._value.get() == 0
    mon.stop()


def test_a_restart_does_not_carry_over_an_unmonitored_taint() -> None:
    """It is the running instance's state: one that can read the hardware starts without it."""
    from topodra.health.policy import UNMONITORED_KEY

    devices = [Device(name="gpu-0", kind="gpu")]
    mark = DeviceTaint(UNMONITORED_KEY, "RuntimeError", Effect.NONE, 1_700_000_000)
    assert DeviceTaint.from_api(mark.to_api()) == mark  # ours: read back from the slices

    mon = HealthMonitor(Inventory(devices), lambda devs: QuietSource(), hold_seconds=60, poll_interval=1, clock=Clock())
    mon.adopt({"gpu-0": [mark]})
    assert mon.taints() == {}
