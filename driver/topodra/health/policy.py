"""What a hardware signal means for a device, and when it stops meaning it (pure; time is passed in).

A source reports ``Observation``s: one-shot events (an XID, an ECC error) or
level states seen at a poll (GPU lost, NVLink links down, NIC port down, clock
throttling, the GPU's recovery action).  ``classify`` maps each to a ``Condition``
— a device taint with an effect — or to nothing (application XIDs such as 13,
31, 43, 45).  ``HealthPolicy`` keeps every condition until ``hold_seconds`` have
passed without the signal being seen again: a level signal is re-seen at every
poll while it lasts, so its taint ends ``hold`` after recovery; an event's taint
ends ``hold`` after the last event.  That hysteresis keeps a flapping link from
flapping the ResourceSlice, and clearing needs no restart.  The taint of an XID
that needs a GPU reset is held, beyond that, while NVML's recovery action
(``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``) says the GPU still needs one: time
alone does not repair a GPU.

Effects follow NVIDIA's DRA driver (``device_health.go``): every XID that is not
an application error is ``NoSchedule``, so nothing is evicted unless the
operator opts in per condition (``no_execute``, e.g. ``{"79", "gpu-lost"}``).

docs/health.md is the table of signals and effects; keep them in step.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Literal

GPU_DOMAIN = "gpu.topodra.io"
NIC_DOMAIN = "nic.topodra.io"
XID_KEY = f"{GPU_DOMAIN}/xid"
ECC_KEY = f"{GPU_DOMAIN}/ecc"
GPU_LOST_KEY = f"{GPU_DOMAIN}/gpu-lost"
NVLINK_KEY = f"{GPU_DOMAIN}/nvlink-degraded"
THROTTLE_KEY = f"{GPU_DOMAIN}/clock-throttled"
RECOVERY_KEY = f"{GPU_DOMAIN}/recovery-action"
NIC_DOWN_KEY = f"{NIC_DOMAIN}/link-down"
# Effect None on every device while the monitor cannot read the hardware (NVML init failed, a source that
# raises): "healthy" would be a guess. Set and cleared by health/monitor.py, never held: it is a state, not an event.
UNMONITORED_KEY = f"{GPU_DOMAIN}/unmonitored"
# ECC_KEY stays ours although ECC event types no longer taint: taints published by older versions are adopted
# and expire instead of being left behind.
OWN_KEYS = frozenset({XID_KEY, ECC_KEY, GPU_LOST_KEY, NVLINK_KEY, THROTTLE_KEY, RECOVERY_KEY, NIC_DOWN_KEY,
                      UNMONITORED_KEY})
DEFAULT_HOLD_SECONDS = 300.0
MAX_TAINTS_PER_DEVICE = 16  # resource.k8s.io/v1 limit

_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


class Effect(StrEnum):
    """resource.k8s.io/v1 DeviceTaintEffect."""

    NONE = "None"  # informs only
    NO_SCHEDULE = "NoSchedule"  # no new allocations
    NO_EXECUTE = "NoExecute"  # no new allocations, and pods using the device are evicted


BLOCKING = frozenset({Effect.NO_SCHEDULE, Effect.NO_EXECUTE})


@dataclass(frozen=True)
class XidRule:
    effect: Effect | None  # None: an application error, no taint
    why: str
    reset: bool = False  # the GPU needs a reset: the taint is held while the recovery action is not NONE


_NS = Effect.NO_SCHEDULE
# Which XIDs taint: NVIDIA's DRA driver and device plugin skip exactly the application XIDs (13, 31, 43, 45,
# 68, 109) and treat every other code as a device fault; DRA's taint is NoSchedule.  Why each code matters and
# which need a reset: NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors, "Resolution Bucket") and the
# A100/H100 memory-error-management guide.  63 stays informational: the catalog says no action is needed.
XID_RULES: Mapping[int, XidRule] = {
    13: XidRule(None, "graphics engine exception: an application fault"),
    31: XidRule(None, "GPU memory page fault: an application fault (bad address)"),
    43: XidRule(None, "GPU stopped processing: the application's channel was reset, the GPU is fine"),
    45: XidRule(None, "preemptive cleanup after an earlier error: follows the application's exit"),
    68: XidRule(None, "video decoder (NVDEC) exception: the application's stream"),
    109: XidRule(None, "context switch timeout: the application's context"),
    48: XidRule(_NS, "double-bit ECC error: data in GPU memory is corrupt", reset=True),
    62: XidRule(_NS, "internal micro-controller halt: GPU reset needed", reset=True),
    63: XidRule(Effect.NONE, "row remapping recorded: applied at the next reset; running and new work is safe"),
    64: XidRule(_NS, "row remapping failed: the GPU is at its repair limit, drain it"),
    74: XidRule(_NS, "NVLink error: the link needs a GPU reset; collectives over it fail or hang", reset=True),
    79: XidRule(_NS, "GPU has fallen off the bus"),
    92: XidRule(_NS, "high single-bit ECC error rate: a failing memory, drain it"),
    94: XidRule(_NS, "contained ECC error: the hit application was stopped and the page is offlined; new work "
                "can start without a reset"),
    95: XidRule(_NS, "uncontained ECC error: every application on the GPU is affected", reset=True),
    119: XidRule(_NS, "GSP RPC timeout: the GPU's system processor stopped answering", reset=True),
    120: XidRule(_NS, "GSP error: the GPU's system processor failed", reset=True),
    140: XidRule(_NS, "unrecovered ECC error: GPU reset needed", reset=True),
    154: XidRule(Effect.NONE, "GPU recovery action changed: the action itself is read from NVML "
                 "(gpu.topodra.io/recovery-action)", reset=True),
}
UNKNOWN_XID = XidRule(Effect.NO_SCHEDULE, "an XID not in topodra's table: no new work until it has been quiet")
# Besides XID codes, the conditions an operator can make evict (``--health-no-execute``).
NO_EXECUTE_NAMES = frozenset({"gpu-lost", "recovery-action"})

# Clock-event reasons that mean the hardware itself is slowing the GPU (not a power cap or idling).
HW_THROTTLE_REASONS: Mapping[int, str] = {
    0x8: "HwSlowdown",
    0x40: "HwThermalSlowdown",
    0x80: "HwPowerBrakeSlowdown",
}

# nvmlGpuRecoveryAction_t (nvml.h NVML_GPU_RECOVERY_ACTION_*): the value of NVML_FI_DEV_GET_GPU_RECOVERY_ACTION.
RECOVERY_ACTIONS: Mapping[int, str] = {
    0: "none", 1: "gpu-reset", 2: "node-reboot", 3: "drain-p2p", 4: "drain-and-reset", 5: "recover-imex-domain",
    6: "bus-reset", 7: "system-reboot",
}
RECOVERY_NONE = "none"

Kind = Literal["xid", "ecc-dbe", "ecc-sbe", "gpu-lost", "nvlink-down", "nic-down", "throttle", "recovery"]


@dataclass(frozen=True)
class Observation:
    """One signal about one device seen now: an event, or a bad level state at a poll."""

    device: str
    kind: Kind
    detail: str = ""  # XID code, down link numbers, port state, throttle reason names, recovery action


@dataclass(frozen=True)
class Condition:
    key: str
    value: str
    effect: Effect
    message: str


@dataclass(frozen=True)
class DeviceTaint:
    """A resource.k8s.io/v1 DeviceTaint; ``time_added`` is Unix seconds (whole seconds, as the API keeps)."""

    key: str
    value: str
    effect: Effect
    time_added: int

    def to_api(self) -> dict[str, str]:
        out = {"key": self.key, "effect": str(self.effect),
               "timeAdded": datetime.fromtimestamp(self.time_added, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
        if self.value:
            out["value"] = self.value
        return out

    @property
    def text(self) -> str:
        return f"{self.key}={self.value}:{self.effect}" if self.value else f"{self.key}:{self.effect}"

    @classmethod
    def from_api(cls, t: Mapping[str, object]) -> DeviceTaint | None:
        """One of *our* taints as the API returns it; None for anything else (admins' or unparsable)."""
        key, effect, added = t.get("key"), t.get("effect"), t.get("timeAdded")
        if key not in OWN_KEYS or effect not in {e.value for e in Effect} or not isinstance(added, str):
            return None
        try:
            when = datetime.strptime(added, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
        except ValueError:
            return None
        return cls(str(key), str(t.get("value") or ""), Effect(str(effect)), int(when.timestamp()))


def label_value(text: str) -> str:
    """``text`` made a valid label value (what a taint value must be)."""
    return _LABEL_VALUE_BAD.sub("-", text).strip("-_.")[:63].strip("-_.")


def xid_code(obs: Observation) -> int:
    try:
        return int(obs.detail)
    except ValueError:
        raise ValueError(f"XID observation on {obs.device} needs a numeric code, got {obs.detail!r}") from None


def needs_reset(cond: Condition) -> bool:
    """True for the taint of an XID that needs a GPU reset (held while the recovery action is not NONE)."""
    return cond.key == XID_KEY and cond.value.isdigit() and XID_RULES.get(int(cond.value), UNKNOWN_XID).reset


def _escalate(cond: Condition, name: str, no_execute: frozenset[str]) -> Condition:
    """NoExecute instead of NoSchedule where the operator opted in for this condition (XID code or kind)."""
    if cond.effect == Effect.NO_SCHEDULE and name in no_execute:
        return Condition(cond.key, cond.value, Effect.NO_EXECUTE, cond.message)
    return cond


def classify(obs: Observation, no_execute: frozenset[str] = frozenset()) -> Condition | None:
    """The taint one observation asks for, or None when it must not taint.

    ``no_execute`` names the conditions that evict (XID codes such as "79", or "gpu-lost", "recovery-action").
    """
    if obs.kind == "xid":
        code = xid_code(obs)
        rule = XID_RULES.get(code, UNKNOWN_XID)
        if rule.effect is None:
            return None
        return _escalate(Condition(XID_KEY, str(code), rule.effect, f"XID {code}: {rule.why}"), str(code),
                         no_execute)
    if obs.kind in ("ecc-dbe", "ecc-sbe"):
        # As NVIDIA's DRA driver and device plugin: only XID events taint.  A double-bit error arrives as
        # XID 48 (or 94/95 on A100+), a high single-bit rate as XID 92.
        return None
    if obs.kind == "recovery":
        if obs.detail == RECOVERY_NONE:
            return None
        return _escalate(Condition(RECOVERY_KEY, label_value(obs.detail), Effect.NO_SCHEDULE,
                                   f"NVML recovery action: {obs.detail}"), "recovery-action", no_execute)
    if obs.kind == "gpu-lost":
        return _escalate(Condition(GPU_LOST_KEY, "", Effect.NO_SCHEDULE,
                                   f"GPU is lost (NVML_ERROR_GPU_IS_LOST){_sep(obs)}"), "gpu-lost", no_execute)
    if obs.kind == "nvlink-down":
        return Condition(NVLINK_KEY, "link-down", Effect.NO_SCHEDULE, f"NVLink link(s) down: {obs.detail}")
    if obs.kind == "nic-down":
        return Condition(NIC_DOWN_KEY, label_value(obs.detail) or "down", Effect.NO_SCHEDULE,
                         f"port not active: {obs.detail}")
    if obs.kind == "throttle":
        return Condition(THROTTLE_KEY, label_value(obs.detail), Effect.NONE, f"hardware clock slowdown: {obs.detail}")
    raise ValueError(f"unknown observation kind {obs.kind!r}")


def _sep(obs: Observation) -> str:
    return f": {obs.detail}" if obs.detail else ""


@dataclass
class _Active:
    condition: Condition
    first_seen: float
    last_seen: float


@dataclass(frozen=True)
class DeviceHealth:
    """What the kubelet is told about one device."""

    unhealthy: bool
    message: str


class HealthPolicy:
    """Conditions per device with hysteresis; not thread-safe (the monitor owns it)."""

    def __init__(self, hold_seconds: float = DEFAULT_HOLD_SECONDS, no_execute: Iterable[str] = ()) -> None:
        if hold_seconds < 0:
            raise ValueError(f"hold_seconds must be >= 0, got {hold_seconds}")
        self.hold_seconds = hold_seconds
        self.no_execute = frozenset(no_execute)
        bad = sorted(n for n in self.no_execute if not (n.isdigit() or n in NO_EXECUTE_NAMES))
        if bad:
            raise ValueError(f"no_execute names XID codes or {sorted(NO_EXECUTE_NAMES)}, got {bad}")
        self._active: dict[tuple[str, str, Effect], _Active] = {}
        self._domains: dict[str, str] = {}  # GPU -> NVLink domain
        self._parents: dict[str, str] = {}  # MIG device -> its GPU
        # GPU -> its last read recovery action needs a reset (True), does not (False); absent: never read.
        self._reset_pending: dict[str, bool] = {}

    def set_parents(self, parents: Mapping[str, str]) -> None:
        """MIG device name → parent GPU name: a MIG device's reset-class taint follows its GPU's recovery action."""
        self._parents = dict(parents)

    def set_domains(self, domains: Mapping[str, str]) -> None:
        """GPU name → NVLink domain: a GPU with a down link marks its domain's other GPUs as degraded."""
        self._domains = dict(domains)

    def observe(self, observations: Iterable[Observation], now: float) -> None:
        for obs in observations:
            if obs.kind == "recovery":
                self._reset_pending[obs.device] = obs.detail != RECOVERY_NONE
                if obs.detail == RECOVERY_NONE:
                    # The driver itself says no action is needed (after the reset): no hysteresis to wait out.
                    for slot in [x for x in self._active if x[0] == obs.device and x[1] == RECOVERY_KEY]:
                        del self._active[slot]
            cond = classify(obs, self.no_execute)
            if cond is not None:
                self._raise(obs.device, cond, now)
            if obs.kind == "nvlink-down" and obs.device in self._domains:
                domain = self._domains[obs.device]
                for peer, d in self._domains.items():
                    if d == domain and peer != obs.device:
                        # Informational: single-GPU work on a peer is fine; a job spanning the domain is not.
                        self._raise(peer, Condition(NVLINK_KEY, "domain", Effect.NONE,
                                                    f"a GPU of NVLink domain {domain} ({obs.device}) has a link "
                                                    "down"), now)

    def _raise(self, device: str, cond: Condition, now: float) -> None:
        slot = (device, cond.key, cond.effect)
        cur = self._active.get(slot)
        if cur is None or cur.condition.value != cond.value:
            self._active[slot] = _Active(cond, now, now)
        else:
            cur.last_seen = now
            cur.condition = cond

    def adopt(self, taints: Mapping[str, Iterable[DeviceTaint]], now: float) -> None:
        """Carry taints a previous instance published over a restart: kept for ``hold`` unless seen again.

        Without this, a restart would forget one-shot events (an XID 48) and untaint a broken GPU early.
        """
        for device, ts in taints.items():
            for t in ts:
                cond = Condition(t.key, t.value, t.effect, f"{t.text} (published before the plugin restarted)")
                self._active.setdefault((device, t.key, t.effect), _Active(cond, t.time_added, now))

    def _held_for_reset(self, device: str, cond: Condition) -> bool:
        """A reset-class taint stays while NVML's recovery action for the GPU is not NONE.

        Never read (an NVML without the field, before R550): time alone clears it, as before; docs/health.md.
        """
        return needs_reset(cond) and self._reset_pending.get(self._parents.get(device, device), False)

    def expire(self, now: float) -> bool:
        """Drop conditions not seen for ``hold_seconds`` (reset-class: and recovery NONE); True if any went."""
        gone = [s for s, a in self._active.items()
                if now - a.last_seen >= self.hold_seconds and not self._held_for_reset(s[0], a.condition)]
        for s in gone:
            del self._active[s]
        return bool(gone)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop conditions of devices that no longer exist."""
        names = set(keep)
        for s in [s for s in self._active if s[0] not in names]:
            del self._active[s]

    def taints(self) -> dict[str, tuple[DeviceTaint, ...]]:
        """Device → its taints (only devices that have some), in a stable order."""
        out: dict[str, list[DeviceTaint]] = {}
        for (device, key, effect), a in sorted(self._active.items()):
            out.setdefault(device, []).append(DeviceTaint(key, a.condition.value, effect, int(a.first_seen)))
        # The worst effects first, so the API's per-device limit never drops a blocking one.
        order = {Effect.NO_EXECUTE: 0, Effect.NO_SCHEDULE: 1, Effect.NONE: 2}
        return {d: tuple(sorted(ts, key=lambda t: (order[t.effect], t.key))[:MAX_TAINTS_PER_DEVICE])
                for d, ts in out.items()}

    def states(self, devices: Iterable[str]) -> dict[str, DeviceHealth]:
        """Per device: unhealthy iff a NoSchedule/NoExecute condition is active; the message lists them all."""
        by_device: dict[str, list[_Active]] = {}
        for (device, _, _), a in sorted(self._active.items()):
            by_device.setdefault(device, []).append(a)
        out = {}
        for d in devices:
            active = by_device.get(d, [])
            unhealthy = any(a.condition.effect in BLOCKING for a in active)
            out[d] = DeviceHealth(unhealthy, "; ".join(
                f"{a.condition.message} [{a.condition.effect}]" for a in active))
        return out
