"""Reading health signals: NVML events and state, NVLink links, RDMA port state in sysfs.

``NodeHealthSource`` works on whatever ``pynvml``-shaped object and ``Sysfs``
discovery uses — the real module on a GPU host, ``FakeNvml`` and a generated
tree for mock hardware — so the same code reads real and injected faults.
Devices are identified the way discovery published them: a GPU by its ``uuid``
attribute, a NIC by ``rdmaDevice``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from topodra.devices import Device
from topodra.hardware.sysfs import Sysfs
from topodra.health.policy import HW_THROTTLE_REASONS, RECOVERY_ACTIONS, Observation

log = logging.getLogger(__name__)

# nvmlEventType* bits (same numbers in every binding): single-bit ECC, double-bit ECC, XID.
EVENT_SBE, EVENT_DBE, EVENT_XID = 0x1, 0x2, 0x8
MAX_EVENTS_PER_WAIT = 256  # a storm is drained in bounded batches
# nvmlEventData_t gpuInstanceId / computeInstanceId of an event about the whole GPU (nvml.h).
WHOLE_GPU_ID = 0xFFFFFFFF
XID_RECOVERY_CHANGED = 154
# nvml.h NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (pynvml has the same number; older bindings lack the name).
FI_GPU_RECOVERY_ACTION = 230


@dataclass
class GpuTarget:
    name: str
    uuid: str
    nvlink_domain: str | None
    handle: Any = None
    links_seen_up: set[int] = field(default_factory=set)  # links ever active: only those can go "down"
    links_up_now: set[int] | None = None  # at the last poll; None: not read (no domain, GPU lost)
    reset_pending: bool = False  # NVML's recovery action was not NONE at the last read
    lost_at_discovery: bool = False  # discovery could not read it: unreachable now means lost, whatever the error


@dataclass(frozen=True)
class NicTarget:
    name: str
    rdma: str


def mig_devices(devices: Iterable[Device]) -> dict[tuple[str, int, int], str]:
    """(parent GPU name, GPU-instance profile id, placement start) → MIG placement device name."""
    out: dict[tuple[str, int, int], str] = {}
    for d in devices:
        a = d.attributes
        if d.kind == "mig" and {"parentDevice", "migProfileID", "placementStart"} <= set(a):
            key = (str(a["parentDevice"].value), int(a["migProfileID"].value), int(a["placementStart"].value))
            out[key] = d.name
    return out


def mig_parents(devices: Iterable[Device]) -> dict[str, str]:
    """MIG device name → parent GPU name."""
    return {d.name: str(d.attributes["parentDevice"].value) for d in devices
            if d.kind == "mig" and "parentDevice" in d.attributes}


def targets(devices: Iterable[Device]) -> tuple[list[GpuTarget], list[NicTarget]]:
    gpus: list[GpuTarget] = []
    nics: list[NicTarget] = []
    for d in devices:
        attrs = {k: v.value for k, v in d.attributes.items()}
        if d.kind == "gpu" and isinstance(attrs.get("uuid"), str):
            domain = attrs.get("nvlinkDomain")
            gpus.append(GpuTarget(d.name, str(attrs["uuid"]), str(domain) if domain else None,
                                  lost_at_discovery=bool(d.lost)))
        elif d.kind == "nic" and isinstance(attrs.get("rdmaDevice"), str):
            nics.append(NicTarget(d.name, str(attrs["rdmaDevice"])))
    return gpus, nics


def nvlink_domains(devices: Iterable[Device]) -> dict[str, str]:
    """GPU name → NVLink domain id, for GPUs in one."""
    out = {}
    for d in devices:
        v = d.attributes.get("nvlinkDomain")
        if d.kind == "gpu" and v is not None:
            out[d.name] = str(v.value)
    return out


def _handle_key(h: Any) -> Any:
    """A hashable identity of an NVML device handle (a ctypes pointer in the real binding)."""
    if isinstance(h, ctypes._Pointer):
        return ctypes.cast(h, ctypes.c_void_p).value
    return h


class NodeHealthSource:
    """One node's signals; ``open()`` once, then ``wait_events`` and ``poll`` from one thread."""

    def __init__(self, nvml: Any, sysfs: Sysfs, devices: Iterable[Device],
                 sleep: Callable[[float], None] = time.sleep) -> None:
        devices = list(devices)
        self.nvml = nvml
        self.sysfs = sysfs
        self.gpus, self.nics = targets(devices)
        self._migs = mig_devices(devices)
        self._event_set: Any = None
        self._by_handle: dict[Any, str] = {}
        self._initialized = False
        self._sleep = sleep
        self._recovery_unread: set[str] = set()  # GPUs whose recovery action was found unreadable (logged once)

    # -- NVML helpers

    def _is(self, err: BaseException, *names: str) -> bool:
        classes = (getattr(self.nvml, "NVMLError_" + n, None) for n in names)
        return any(isinstance(err, c) for c in classes if c is not None)

    def _lost(self, err: BaseException) -> bool:
        return self._is(err, "GpuIsLost")

    def open(self) -> None:
        """Initialise NVML and register for XID and ECC events on every GPU that supports them."""
        if not self.gpus:
            return
        try:
            self.nvml.nvmlInit()
        except self.nvml.NVMLError as e:
            log.error("health: NVML initialisation failed, GPU health is not watched: %s", e)
            return
        self._initialized = True
        try:
            self._event_set = self.nvml.nvmlEventSetCreate()
        except (self.nvml.NVMLError, AttributeError) as e:
            log.warning("health: NVML event sets unavailable (%s); XID/ECC events are not watched", e)
        for g in self.gpus:
            self._resolve(g)

    def _resolve(self, g: GpuTarget) -> bool:
        """Get the GPU's handle and register its events; False while it cannot be reached."""
        if g.handle is not None:
            return True
        try:
            g.handle = self.nvml.nvmlDeviceGetHandleByUUID(g.uuid)
        except self.nvml.NVMLError as e:
            if not self._lost(e):
                log.warning("health: %s (%s) has no NVML handle: %s", g.name, g.uuid, e)
            return False
        self._by_handle[_handle_key(g.handle)] = g.name
        if self._event_set is not None:
            wanted = EVENT_XID | EVENT_SBE | EVENT_DBE
            try:
                supported = int(self.nvml.nvmlDeviceGetSupportedEventTypes(g.handle))
                wanted &= supported
            except (self.nvml.NVMLError, AttributeError):
                pass
            try:
                if wanted:
                    self.nvml.nvmlDeviceRegisterEvents(g.handle, wanted, self._event_set)
            except self.nvml.NVMLError as e:
                log.warning("health: %s: cannot register NVML events (%s); only polled signals", g.name, e)
        return True

    def close(self) -> None:
        if self._event_set is not None:
            with contextlib.suppress(self.nvml.NVMLError, AttributeError):
                self.nvml.nvmlEventSetFree(self._event_set)
            self._event_set = None
        if self._initialized:
            with contextlib.suppress(self.nvml.NVMLError):
                self.nvml.nvmlShutdown()
            self._initialized = False

    # -- events

    def wait_events(self, timeout: float) -> list[Observation]:
        """Events that arrive within ``timeout`` seconds (returns as soon as some did), then any queued ones.

        Never returns early without an event: when the wait fails at once (``nvmlEventSetWait_v2`` answers
        GPU_IS_LOST immediately, at every call, while a registered GPU is lost), the rest of ``timeout`` is
        slept, so the monitor's loop cannot spin.  A lost GPU is reported at once.
        """
        if self._event_set is None:
            if timeout > 0:
                self._sleep(timeout)
            return []
        out: list[Observation] = []
        start = time.monotonic()
        wait_ms = max(0, int(timeout * 1000))
        while len(out) < MAX_EVENTS_PER_WAIT:
            try:
                ev = self.nvml.nvmlEventSetWait_v2(self._event_set, wait_ms)
            except self.nvml.NVMLError as e:
                if wait_ms == 0 or self._is(e, "Timeout"):
                    break
                log.debug("health: NVML event wait failed: %s", e)
                if self._lost(e):
                    out.extend(self._lost_gpus())
                left = timeout - (time.monotonic() - start)
                if left > 0:
                    self._sleep(left)
                break
            wait_ms = 0
            out.extend(self._event(ev))
        return out

    def _lost_gpus(self) -> list[Observation]:
        """The GPUs that answer GPU_IS_LOST now (the event wait does not say which one it is)."""
        out = []
        for g in self.gpus:
            if g.handle is None:
                lost = self._gone(g)
            else:
                try:
                    self.nvml.nvmlDeviceGetUUID(g.handle)
                    lost = False
                except self.nvml.NVMLError as e:
                    lost = self._lost(e)
            if lost:
                out.append(Observation(g.name, "gpu-lost"))
        return out

    def _event(self, ev: Any) -> list[Observation]:
        name = self._by_handle.get(_handle_key(ev.device))
        if name is None:
            return []
        kind = int(ev.eventType)
        if kind & EVENT_XID:
            code = int(ev.eventData)
            device = self._instance_device(name, ev)
            if device is None:
                return []
            out = [Observation(device, "xid", str(code))]
            if code == XID_RECOVERY_CHANGED:  # read the new action now, not at the next poll
                g = next(g for g in self.gpus if g.name == name)
                out.extend(self._recovery(g))
            return out
        if kind & EVENT_DBE:
            return [Observation(name, "ecc-dbe")]
        if kind & EVENT_SBE:
            return [Observation(name, "ecc-sbe")]
        return []

    def _instance_device(self, gpu: str, ev: Any) -> str | None:
        """The device an event is about: the GPU, or the MIG device of the event's GPU instance.

        nvmlEventData_t carries gpuInstanceId/computeInstanceId; 0xFFFFFFFF means the whole GPU.  A GPU
        instance is found by its profile and placement (nvmlGpuInstanceGetInfo), which name the device.
        """
        gi = int(getattr(ev, "gpuInstanceId", WHOLE_GPU_ID))
        if gi == WHOLE_GPU_ID:
            return gpu
        try:
            info = self.nvml.nvmlGpuInstanceGetInfo(self.nvml.nvmlDeviceGetGpuInstanceById(ev.device, gi))
            key = (gpu, int(info.profileId), int(info.placement.start))
        except (self.nvml.NVMLError, AttributeError) as e:
            log.warning("health: %s: XID %d in GPU instance %d, which cannot be read (%s); ignored",
                        gpu, int(ev.eventData), gi, e)
            return None
        name = self._migs.get(key)
        if name is None:
            log.warning("health: %s: XID %d in GPU instance %d (profile %d, start %d), which is not a device "
                        "topodra publishes; ignored", gpu, int(ev.eventData), gi, key[1], key[2])
        return name

    # -- polled state

    def poll(self) -> list[Observation]:
        out: list[Observation] = []
        for g in self.gpus:
            g.links_up_now = None
            if self._initialized:
                out.extend(self._poll_gpu(g))
        out.extend(self._nvlinks_down())
        for n in self.nics:
            out.extend(self._poll_nic(n))
        return out

    def _nvlinks_down(self) -> list[Observation]:
        """Links down now: ones seen up before, and ones the GPU's NVLink-domain peers have up.

        The second rule catches a link that was already down when the plugin started: NVML answers
        DISABLED both for a failed link and for a link that is not wired, so only the peers (NVSwitch
        GPUs, or the two GPUs of a bridge pair, use the same link indices) tell which ought to be up.
        A link counts as expected when more than half of the other GPUs of the domain have it up.
        """
        domains: dict[str, list[GpuTarget]] = {}
        for g in self.gpus:
            if g.nvlink_domain is not None and g.links_up_now is not None:
                domains.setdefault(g.nvlink_domain, []).append(g)
        out: list[Observation] = []
        for members in domains.values():
            for g in members:
                assert g.links_up_now is not None
                peers = [m.links_up_now for m in members if m is not g and m.links_up_now is not None]
                votes = Counter(link for up in peers for link in up)
                expected = {link for link, n in votes.items() if 2 * n > len(peers)}
                down = (g.links_seen_up | expected) - g.links_up_now
                if down:
                    out.append(Observation(g.name, "nvlink-down", ",".join(map(str, sorted(down)))))
        return out

    def _recovery(self, g: GpuTarget) -> list[Observation]:
        """NVML's recovery action for the GPU as a level observation; [] when it cannot be read."""
        fn = getattr(self.nvml, "nvmlDeviceGetFieldValues", None)
        if fn is None or g.handle is None:
            return []
        field_id = int(getattr(self.nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", FI_GPU_RECOVERY_ACTION))
        try:
            value = fn(g.handle, [field_id])[0]
            ret = int(value.nvmlReturn)
            if ret != int(getattr(self.nvml, "NVML_SUCCESS", 0)):
                raise self.nvml.NVMLError(ret)
        except self.nvml.NVMLError as e:
            if self._lost(e):
                return [Observation(g.name, "gpu-lost")]
            if g.name not in self._recovery_unread:
                self._recovery_unread.add(g.name)
                log.info("health: %s: NVML recovery action unreadable (%s); reset-class taints clear by time only",
                         g.name, e)
            return []
        action = int(value.value.uiVal)
        # A pending action is seen at every poll (a level signal); NONE only when it changes back to NONE,
        # since never-read and NONE mean the same to the policy.
        was_pending, g.reset_pending = g.reset_pending, action != 0
        if action == 0 and not was_pending:
            return []
        return [Observation(g.name, "recovery", RECOVERY_ACTIONS.get(action, f"action-{action}"))]

    def _poll_gpu(self, g: GpuTarget) -> list[Observation]:
        if not self._resolve(g):
            lost = g.lost_at_discovery or self._gone(g)
            return [Observation(g.name, "gpu-lost", "no NVML handle")] if lost else []
        out: list[Observation] = []
        try:
            reasons = self._throttle_reasons(g.handle)
        except self.nvml.NVMLError as e:
            if self._lost(e):
                return [Observation(g.name, "gpu-lost")]
            reasons = None
        recovery = self._recovery(g)
        if any(o.kind == "gpu-lost" for o in recovery):
            return recovery
        out.extend(recovery)
        if reasons:
            names = [n for bit, n in sorted(HW_THROTTLE_REASONS.items()) if reasons & bit]
            if names:
                out.append(Observation(g.name, "throttle", ".".join(names)))
        if g.nvlink_domain is not None:
            up = self._links_up(g)
            if up is None:
                return [Observation(g.name, "gpu-lost")]
            g.links_up_now = up
        return out

    def _gone(self, g: GpuTarget) -> bool:
        """True when NVML says the GPU is lost (not merely unknown to it)."""
        try:
            self.nvml.nvmlDeviceGetHandleByUUID(g.uuid)
        except self.nvml.NVMLError as e:
            return self._lost(e)
        return False

    def _throttle_reasons(self, h: Any) -> int | None:
        for fn_name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            fn = getattr(self.nvml, fn_name, None)
            if fn is None:
                continue
            try:
                return int(fn(h))
            except self.nvml.NVMLError as e:
                if self._is(e, "NotSupported", "FunctionNotFound"):
                    continue
                raise
        return None

    def _links_up(self, g: GpuTarget) -> set[int] | None:
        """Links active now (remembered in ``links_seen_up``); None when the GPU is lost."""
        enabled = int(getattr(self.nvml, "NVML_FEATURE_ENABLED", 1))
        up: set[int] = set()
        for link in range(int(getattr(self.nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                state = int(self.nvml.nvmlDeviceGetNvLinkState(g.handle, link))
            except self.nvml.NVMLError as e:
                if self._lost(e):
                    return None
                if self._is(e, "InvalidArgument"):
                    break
                continue
            if state == enabled:
                up.add(link)
        g.links_seen_up |= up
        return up

    def _poll_nic(self, n: NicTarget) -> list[Observation]:
        ports_dir = self.sysfs.path(f"sys/class/infiniband/{n.rdma}/ports")
        try:
            ports = sorted(os.listdir(ports_dir), key=lambda p: (len(p), p))
        except OSError:
            return [Observation(n.name, "nic-down", "absent")]
        bad = []
        for p in ports:
            state = self.sysfs.read(os.path.join(ports_dir, p, "state"))
            phys = self.sysfs.read(os.path.join(ports_dir, p, "phys_state"))
            state_ok = state is not None and _port_word(state) in ("ACTIVE", "ACTIVE_DEFER")
            phys_ok = phys is None or _port_word(phys) == "LINKUP"
            if not (state_ok and phys_ok):
                words = [_port_word(x) for x in (state, phys) if x is not None] or ["unknown"]
                bad.append(f"port{p}-{'-'.join(words)}")
        return [Observation(n.name, "nic-down", ",".join(bad))] if bad else []


def _port_word(text: str) -> str:
    """ "4: ACTIVE" -> "ACTIVE"; "5: LinkUp" -> "LINKUP" (sysfs gives "<number>: <name>")."""
    return text.partition(":")[2].strip().replace(" ", "").upper() or text.strip().upper()
