"""Health against NVML's documented behaviour and NVIDIA's own policy (issue 19, real-gpu.md findings 7, 8, 11, 20).

The fake NVML here answers as nvml.h says: ``nvmlEventSetWait_v2`` fails with GPU_IS_LOST at once while a
registered GPU is lost; events carry gpuInstanceId/computeInstanceId (0xFFFFFFFF for the whole GPU); field
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION answers nvmlGpuRecoveryAction_t.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pynvml
import pytest
from test_health import Clock

from topodra.devices import Device
from topodra.hardware import NvmlBackend, load_backend
from topodra.hardware.mock import nvml_error
from topodra.health.monitor import HealthMonitor, HealthSource
from topodra.health.policy import (
    GPU_LOST_KEY,
    RECOVERY_KEY,
    XID_KEY,
    XID_RULES,
    Effect,
    HealthPolicy,
    Observation,
    classify,
)
from topodra.health.sources import NodeHealthSource
from topodra.inventory import Inventory
from topodra.plugin.config import ConfigError, PluginConfig
from topodra.slices import build_slices

RESET_XIDS = (48, 62, 74, 95, 119, 120, 140)


class Node:
    """Mock hardware with its own sysfs tree and faults file."""

    def __init__(self, root: Path, profile: str = "dgx-h100") -> None:
        self.faults_file = root / "faults.json"
        self.backend: NvmlBackend = load_backend(f"mock:{profile}", "node-r", sysfs_root=str(root / "hw"),
                                                 overrides={"faultsFile": str(self.faults_file),
                                                            "migStateFile": str(root / "mig.json")})
        self.devices = self.backend.discover()
        self.faults: dict[str, Any] = {"gpus": {}, "events": []}

    def write(self) -> None:
        tmp = self.faults_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.faults))
        tmp.replace(self.faults_file)

    def event(self, gpu: int, code: int, **ids: int) -> None:
        self.faults["events"].append({"gpu": gpu, "type": "xid", "data": code, **ids})
        self.write()

    def gpu(self, index: int, **faults: Any) -> None:
        if faults:
            self.faults["gpus"][str(index)] = faults
        else:
            self.faults["gpus"].pop(str(index), None)
        self.write()

    def source(self, devices: tuple[Device, ...] | list[Device] | None = None) -> NodeHealthSource:
        return NodeHealthSource(self.backend.nvml, self.backend.sysfs, self.devices if devices is None else devices)


def kinds(observations: list[Observation]) -> set[tuple[str, str, str]]:
    return {(o.device, o.kind, o.detail) for o in observations}


# ---------------- #8: no busy loop while a GPU is lost


def test_fake_event_wait_fails_at_once_for_a_lost_gpu(tmp_path: Path) -> None:
    """nvml.h: nvmlEventSetWait_v2 returns NVML_ERROR_GPU_IS_LOST; the old fake waited and timed out."""
    node = Node(tmp_path)
    n = node.backend.nvml
    n.nvmlInit()
    try:
        es = n.nvmlEventSetCreate()
        n.nvmlDeviceRegisterEvents(n.nvmlDeviceGetHandleByIndex(4), 0x8, es)
        node.gpu(4, lost=True)
        t0 = time.monotonic()
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            n.nvmlEventSetWait_v2(es, 5000)
        assert time.monotonic() - t0 < 2.0  # not the 5 s timeout
    finally:
        n.nvmlShutdown()


def test_wait_events_reports_the_lost_gpu_at_once_and_sleeps_out_its_timeout(tmp_path: Path) -> None:
    node = Node(tmp_path)
    src = node.source()
    src.open()
    try:
        node.gpu(5, lost=True)
        cpu0, wall0 = time.thread_time(), time.monotonic()
        got = src.wait_events(0.5)
        assert ("gpu-5", "gpu-lost", "") in kinds(got)
        assert time.monotonic() - wall0 >= 0.45  # the call used its timeout: the caller's loop cannot spin
        assert time.thread_time() - cpu0 < 0.25
    finally:
        src.close()


def _thread_cpu(t: threading.Thread) -> float:
    assert t.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(t.ident))


def test_monitor_thread_cpu_stays_low_while_a_gpu_is_lost(tmp_path: Path) -> None:
    """NVML answering GPU_IS_LOST at once, at every wait (as documented): the thread must not spin.

    The window is 3 polls (poll_interval 0.5 s) after the taint appeared; the thread's own CPU clock is measured.
    """
    node = Node(tmp_path)
    node.backend.nvml.nvmlEventSetWait_v2 = lambda es, ms: (_ for _ in ()).throw(nvml_error("GpuIsLost"))
    node.gpu(2, lost=True)
    polls: list[float] = []
    polled = threading.Condition()

    class Counting:
        def __init__(self, inner: HealthSource) -> None:
            self.inner = inner

        def open(self) -> None:
            self.inner.open()

        def close(self) -> None:
            self.inner.close()

        def wait_events(self, timeout: float) -> list[Observation]:
            return self.inner.wait_events(timeout)

        def poll(self) -> list[Observation]:
            out = self.inner.poll()
            with polled:
                polls.append(time.monotonic())
                polled.notify_all()
            return out

    inv = Inventory(node.devices)
    mon = HealthMonitor(inv, lambda devs: Counting(node.source(devs)), hold_seconds=30, poll_interval=0.5)
    mon.start()
    try:
        with polled:
            assert polled.wait_for(lambda: len(polls) >= 1, 30)
        deadline = time.monotonic() + 30
        while GPU_LOST_KEY not in {t.key for t in mon.taints().get("gpu-2", ())}:
            assert time.monotonic() < deadline, "gpu-lost never tainted"
            time.sleep(0.05)
        assert mon._thread is not None
        cpu0 = _thread_cpu(mon._thread)
        with polled:
            start = len(polls)
            assert polled.wait_for(lambda: len(polls) >= start + 3, 30)
        cpu = _thread_cpu(mon._thread) - cpu0
        window = polls[-1] - polls[start - 1]
        assert window >= 1.0
        assert cpu < 0.25 * window, f"health thread used {cpu:.2f} s CPU in {window:.2f} s"
    finally:
        mon.stop()


def test_a_node_without_nvml_events_does_not_spin(tmp_path: Path) -> None:
    node = Node(tmp_path)
    nics = [d for d in node.devices if d.kind == "nic"]
    src = node.source(nics)
    src.open()
    try:
        cpu0, wall0 = time.thread_time(), time.monotonic()
        assert src.wait_events(0.3) == []
        assert time.monotonic() - wall0 >= 0.25
        assert time.thread_time() - cpu0 < 0.2
    finally:
        src.close()


# ---------------- #7: reset-class taints are held while NVML's recovery action is not NONE


@pytest.mark.parametrize("code", RESET_XIDS)
def test_reset_class_taint_outlives_the_hold_while_a_reset_is_pending(code: int) -> None:
    p = HealthPolicy(hold_seconds=10)
    p.observe([Observation("gpu-1", "xid", str(code)), Observation("gpu-1", "recovery", "gpu-reset")], now=0)
    for t in range(1, 60):  # polled: still GPU_RESET
        p.observe([Observation("gpu-1", "recovery", "gpu-reset")], now=t)
        p.expire(t)
    assert f"{XID_KEY}={code}:NoSchedule" in {x.text for x in p.taints()["gpu-1"]}
    p.observe([Observation("gpu-1", "recovery", "none")], now=60)  # the GPU was reset
    p.expire(60)
    assert "gpu-1" not in p.taints()


def test_non_reset_xid_still_clears_after_the_hold_even_with_a_pending_action() -> None:
    p = HealthPolicy(hold_seconds=10)
    p.observe([Observation("gpu-1", "xid", "92"), Observation("gpu-1", "recovery", "gpu-reset")], now=0)
    p.observe([Observation("gpu-1", "recovery", "gpu-reset")], now=20)
    p.expire(20)
    assert {x.key for x in p.taints()["gpu-1"]} == {RECOVERY_KEY}


def test_a_mig_device_follows_its_parents_recovery_action() -> None:
    p = HealthPolicy(hold_seconds=10)
    p.set_parents({"gpu-0-mig-1g-10gb-3": "gpu-0"})
    p.observe([Observation("gpu-0-mig-1g-10gb-3", "xid", "95"), Observation("gpu-0", "recovery", "gpu-reset")], 0)
    p.observe([Observation("gpu-0", "recovery", "gpu-reset")], now=30)
    p.expire(30)
    assert "gpu-0-mig-1g-10gb-3" in p.taints()


def test_source_reads_the_recovery_field_and_monitor_holds_the_taint(tmp_path: Path) -> None:
    node = Node(tmp_path)
    clock = Clock()
    mon = HealthMonitor(Inventory(node.devices), node.source, hold_seconds=30, poll_interval=1, clock=clock)
    try:
        mon.step()
        node.gpu(3, recoveryAction=pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
        node.event(3, 74)
        clock.t += 1
        assert mon.step(wait=1.0)
        assert {t.text for t in mon.taints()["gpu-3"]} == {f"{XID_KEY}=74:NoSchedule",
                                                         f"{RECOVERY_KEY}=gpu-reset:NoSchedule"}
        clock.t += 301  # far past the hold: the old code untainted the GPU here
        mon.step()
        assert f"{XID_KEY}=74:NoSchedule" in {t.text for t in mon.taints()["gpu-3"]}
        node.gpu(3)  # reset done: the action is NONE again
        clock.t += 1
        mon.step()
        assert "gpu-3" not in mon.taints()
    finally:
        mon.stop()


def test_xid_154_reads_the_new_action_at_once(tmp_path: Path) -> None:
    node = Node(tmp_path)
    src = node.source()
    src.open()
    try:
        node.gpu(1, recoveryAction=pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT)
        node.event(1, 154)
        got = kinds(src.wait_events(1.0))
        assert got == {("gpu-1", "xid", "154"), ("gpu-1", "recovery", "node-reboot")}
    finally:
        src.close()
    assert classify(Observation("gpu-1", "xid", "154")) is not None
    assert classify(Observation("gpu-1", "xid", "154")).effect == Effect.NONE  # type: ignore[union-attr]
    cond = classify(Observation("gpu-1", "recovery", "drain-p2p"))
    assert cond is not None and (cond.key, cond.value, cond.effect) == (RECOVERY_KEY, "drain-p2p", Effect.NO_SCHEDULE)
    assert classify(Observation("gpu-1", "recovery", "none")) is None


def test_fake_field_values_follow_nvml() -> None:
    backend = load_backend("mock:dgx-h100", "n1")
    n = backend.nvml
    n.nvmlInit()
    try:
        v = n.nvmlDeviceGetFieldValues(n.nvmlDeviceGetHandleByIndex(0),
                                       [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, pynvml.NVML_FI_DEV_ECC_CURRENT])
        assert v[0].nvmlReturn == pynvml.NVML_SUCCESS and v[0].value.uiVal == pynvml.NVML_GPU_RECOVERY_ACTION_NONE
        assert v[1].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    finally:
        n.nvmlShutdown()


# ---------------- #11: MIG health per instance


def _create_instance(node: Node, mig: Device) -> int:
    a = {k: v.value for k, v in mig.attributes.items()}
    n = node.backend.nvml
    n.nvmlInit()
    try:
        h = n.nvmlDeviceGetHandleByUUID(str(a["parentUUID"]))
        placement = pynvml.c_nvmlGpuInstancePlacement_t(int(a["placementStart"]), int(a["placementSize"]))
        gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(h, int(a["migProfileID"]), placement)
        return int(n.nvmlGpuInstanceGetInfo(gi).id)
    finally:
        n.nvmlShutdown()


def test_an_xid_in_one_mig_instance_taints_only_that_mig_device(tmp_path: Path) -> None:
    node = Node(tmp_path, "dgx-a100-80gb-mig")
    migs = [d for d in node.devices if d.kind == "mig" and d.name.startswith("gpu-0-mig-1g-10gb-")]
    target = next(d for d in migs if d.name.endswith("-3"))
    _create_instance(node, next(d for d in migs if d.name.endswith("-0")))  # a neighbour exists too
    gi = _create_instance(node, target)
    src = node.source()
    src.open()
    try:
        node.event(0, 94, gi=gi, ci=0)
        got = src.wait_events(1.0)
        assert kinds(got) == {(target.name, "xid", "94")}
        node.event(0, 79)  # no ids: the whole GPU (0xFFFFFFFF)
        assert kinds(src.wait_events(1.0)) == {("gpu-0", "xid", "79")}
    finally:
        src.close()
    p = HealthPolicy(hold_seconds=10)
    p.observe(got, now=1)
    sl = build_slices("gpu.topodra.io", "node-r", None, node.devices, 1, p.taints())
    tainted = sorted(d["name"] for s in sl for d in s["spec"].get("devices", []) if d.get("taints"))
    assert tainted == [target.name]


def test_fake_events_carry_whole_gpu_ids(tmp_path: Path) -> None:
    node = Node(tmp_path)
    n = node.backend.nvml
    n.nvmlInit()
    try:
        es = n.nvmlEventSetCreate()
        n.nvmlDeviceRegisterEvents(n.nvmlDeviceGetHandleByIndex(0), 0x8, es)
        node.event(0, 31)
        ev = n.nvmlEventSetWait_v2(es, 1000)
        assert (ev.gpuInstanceId, ev.computeInstanceId) == (0xFFFFFFFF, 0xFFFFFFFF)
    finally:
        n.nvmlShutdown()


# ---------------- #20: the policy NVIDIA's DRA driver and device plugin follow


@pytest.mark.parametrize("code", [*RESET_XIDS, 79, 64, 92, 94, 12345])
def test_every_device_xid_is_noschedule_by_default(code: int) -> None:
    cond = classify(Observation("gpu-0", "xid", str(code)))
    assert cond is not None and cond.effect == Effect.NO_SCHEDULE
    lost = classify(Observation("gpu-0", "gpu-lost"))
    assert lost is not None and lost.effect == Effect.NO_SCHEDULE


def test_no_execute_is_opt_in_per_condition() -> None:
    ne = frozenset({"79", "gpu-lost"})
    assert classify(Observation("gpu-0", "xid", "79"), ne).effect == Effect.NO_EXECUTE  # type: ignore[union-attr]
    assert classify(Observation("gpu-0", "xid", "48"), ne).effect == Effect.NO_SCHEDULE  # type: ignore[union-attr]
    assert classify(Observation("gpu-0", "gpu-lost"), ne).effect == Effect.NO_EXECUTE  # type: ignore[union-attr]
    assert classify(Observation("gpu-0", "xid", "13"), ne) is None  # application XIDs never taint
    with pytest.raises(ValueError, match="no_execute"):
        HealthPolicy(no_execute={"everything"})


def test_ecc_event_types_do_not_taint() -> None:
    """DRA and the device plugin skip non-XID events: a double-bit error arrives as XID 48/94/95."""
    assert classify(Observation("gpu-0", "ecc-dbe")) is None
    assert classify(Observation("gpu-0", "ecc-sbe")) is None


def test_xid_94_message_matches_nvidia() -> None:
    """NVIDIA: after a contained error, new work can start on the GPU without a reset."""
    why = XID_RULES[94].why
    assert "without a reset" in why and "needs a reset" not in why
    assert XID_RULES[94].effect == Effect.NO_SCHEDULE and not XID_RULES[94].reset


def test_plugin_flag_validates_no_execute_names() -> None:
    cfg = PluginConfig.model_validate({"node_name": "n1", "health_no_execute": "79, gpu-lost"})
    assert cfg.health_no_execute == ("79", "gpu-lost")
    with pytest.raises(ValueError, match="not XID codes"):
        PluginConfig.model_validate({"node_name": "n1", "health_no_execute": "79,evict-all"})
    assert issubclass(ConfigError, ValueError)


def test_a_gpu_lost_at_discovery_is_tainted_before_the_first_poll(tmp_path: Path) -> None:
    node = Node(tmp_path)
    lost = node.devices[2].model_copy(update={"lost": "GPU 2: cannot read handle: GPU is lost"})
    devices = [lost if d.name == lost.name else d for d in node.devices]
    mon = HealthMonitor(Inventory(devices), node.source, hold_seconds=30, poll_interval=1)
    mon.adopt({})  # what the plugin calls before its publisher starts
    assert {t.key for t in mon.taints()[lost.name]} == {GPU_LOST_KEY}


def test_after_the_first_poll_the_source_decides_whether_a_discovery_lost_gpu_is_lost(tmp_path: Path) -> None:
    """Lost at discovery and still unreachable: tainted whatever NVML's error; answering again: it clears
    after the hold without waiting for the next re-discovery."""
    node = Node(tmp_path)
    lost = node.devices[4].model_copy(update={"lost": "GPU 4: cannot read handle: GPU is lost"})
    devices = [lost if d.name == lost.name else d for d in node.devices]
    real = node.backend.nvml.nvmlDeviceGetHandleByUUID

    def by_uuid(uuid: str) -> Any:
        if uuid == lost.uuid and unreachable.is_set():
            raise nvml_error("Unknown")  # not GPU_IS_LOST: discovery's verdict still holds
        return real(uuid)

    unreachable = threading.Event()
    unreachable.set()
    node.backend.nvml.nvmlDeviceGetHandleByUUID = by_uuid
    clock = Clock()
    mon = HealthMonitor(Inventory(devices), node.source, hold_seconds=5, poll_interval=1, clock=clock)
    try:
        mon.step()
        assert {t.key for t in mon.taints()[lost.name]} == {GPU_LOST_KEY}
        clock.t += 10
        mon.step()
        assert {t.key for t in mon.taints()[lost.name]} == {GPU_LOST_KEY}  # re-seen by the poll
        unreachable.clear()  # the GPU answers again; the inventory still says lost
        for _ in range(7):
            clock.t += 1
            mon.step()
        assert lost.name not in mon.taints()
    finally:
        mon.stop()
