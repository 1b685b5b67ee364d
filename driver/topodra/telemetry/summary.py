"""The per-device telemetry summary in a claim's status (pure): what it says, and when it is written.

Beside the ``Idle`` condition, the plugin writes a small JSON object into ``ResourceClaim.status.devices[].data``
of each whole GPU of the claim on its node: the mean compute activity and memory-in-use share over the last
``window`` seconds, whether the claim is idle and since when, and the seconds the claim has held the device
(``allocatedSeconds``) and, of those, the seconds it was above the idle thresholds (``activeSeconds``).
``topodra inventory`` reads it from the claims it already lists (per-node activity, per-namespace GPU-hours).

Kubernetes v1.37.2: ``AllocatedDeviceStatus.Data`` is a ``runtime.RawExtension``, "arbitrary driver-specific
data" whose raw length "must be smaller or equal to 10 Ki" (k8s.io/api@v0.37.2 resource/v1/types.go:2604-2609,
``AllocatedDeviceStatusDataMaxLength`` = 10 * 1024 at types.go:2539); validation wants a JSON object
(pkg/apis/resource/validation/validation.go:1823-1848, ``validateRawExtension``). One entry here is ~250 bytes.

Rate: each claim has a **slot**, an offset in [0, ``min_interval``) drawn from its UID (``slot_of``), and may write
only in the first sampling round at or after each of its slot times (offset + k x ``min_interval``, absolute
time): at most once per ``min_interval``, and the claims of a cluster spread evenly over it whatever happens to
them at the same moment (topodra installed on a running cluster: every plugin finds every claim at once and
flags every idle one 15 minutes later). At its slot a claim writes when there is a reason (``write_reason``):
first sight, the claim turned idle or active, a device's activity or memory share moved by ``delta`` or more
since the last write, or the last write is about ``max_interval`` old (the seconds go stale otherwise). A failed
write is tried at the next slot. A restarted plugin takes over what the claim shows (``seed``) and keeps the slot,
the same on every plugin. So every round writes at most the claims whose slot falls into it: at 2,048 nodes with
one claim per GPU, about 16,384 x 10 s / 300 s = 546 per 10 s round, 54.6/s (bench/scale ``--rows
status-writes`` measures the rate, docs/telemetry.md). The Idle condition (``claimstatus``) is not slotted: users
and alerts act on it.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SUMMARY_KIND = "GPUTelemetrySummary"
SUMMARY_VERSION = 1
DEFAULT_MIN_INTERVAL = 300.0
DEFAULT_MAX_INTERVAL = 1800.0
DEFAULT_DELTA = 0.10
DEFAULT_WINDOW = 60.0
DATA_MAX_BYTES = 10 * 1024  # AllocatedDeviceStatusDataMaxLength (k8s.io/api@v0.37.2 resource/v1/types.go:2539)

# Why a write happens (the bench counts them by reason).
FIRST, STATE, CHANGE, REFRESH = "first", "state", "change", "refresh"


class SummaryPolicy(BaseModel):
    """When to write; defaults: a summary at most every 5 minutes per claim, refreshed at least every 30."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_interval: float = Field(default=DEFAULT_MIN_INTERVAL, gt=0)
    max_interval: float = Field(default=DEFAULT_MAX_INTERVAL, gt=0)
    delta: float = Field(default=DEFAULT_DELTA, gt=0, le=1)
    window: float = Field(default=DEFAULT_WINDOW, gt=0)
    spread: float = Field(default=1.0, ge=0, le=1)  # share of min_interval the claims' slots spread over


def slot_of(uid: str, policy: SummaryPolicy) -> float:
    """A claim's slot offset in [0, spread x min_interval): the same for a UID on every plugin, uniform."""
    frac = int.from_bytes(hashlib.sha256(uid.encode()).digest()[:4], "big") / 2**32
    return frac * policy.spread * policy.min_interval


def next_slot(now: float, slot: float, period: float, after: bool) -> float:
    """The first slot time (``slot`` + k x ``period``) at or after ``now`` (strictly after with ``after``)."""
    k = math.floor((now - slot) / period)
    t = slot + k * period
    while t < now or (after and t == now):
        t += period
    return t


@dataclass(frozen=True)
class DeviceFigures:
    """One device's figures; ``activity``/``memory`` None when no sample of the window was read."""

    activity: float | None
    memory: float | None
    allocated_seconds: float
    active_seconds: float


@dataclass(frozen=True)
class ClaimSummary:
    at: float
    idle: bool
    idle_since: float | None  # start of the current run of below-threshold samples, when idle
    devices: Mapping[str, DeviceFigures]


@dataclass
class DeviceAccount:
    """One device of one claim: its recent samples and the seconds accumulated (mutable, one per device)."""

    allocated_seconds: float = 0.0
    active_seconds: float = 0.0
    last_at: float | None = None
    samples: deque[tuple[float, float | None, float | None]] = field(default_factory=deque)

    def add(self, now: float, activity: float | None, memory: float | None, active: bool | None,
            window: float, max_gap: float) -> None:
        """One sample at ``now``. The time since the previous one counts as held (and as active when this sample
        was above the thresholds), up to ``max_gap`` (a stalled sampler does not invent seconds)."""
        if self.last_at is not None:
            dt = min(max(0.0, now - self.last_at), max_gap)
            self.allocated_seconds += dt
            if active:
                self.active_seconds += dt
        self.last_at = now
        self.samples.append((now, activity, memory))
        while self.samples and self.samples[0][0] <= now - window:
            self.samples.popleft()

    def figures(self) -> DeviceFigures:
        acts = [a for _t, a, _m in self.samples if a is not None]
        mems = [m for _t, _a, m in self.samples if m is not None]
        return DeviceFigures(sum(acts) / len(acts) if acts else None, sum(mems) / len(mems) if mems else None,
                             self.allocated_seconds, self.active_seconds)


@dataclass
class ClaimTrack:
    """One claim's summary state on its node: per-device accounts, what was last written, its slot.
    The sampler keeps one per claim; bench/scale's write-rate row drives the same object."""

    slot: float = 0.0  # ``slot_of`` the claim's UID
    accounts: dict[str, DeviceAccount] = field(default_factory=dict)
    last: ClaimSummary | None = None  # last written (or found written after a restart)
    writes: int = 0
    seeded: bool = False  # the claim's status was read and what it showed taken over
    next_at: float | None = None  # the next slot time (None: before the first sample)

    def observe(self, now: float, levels: Mapping[str, tuple[float | None, float | None, bool | None]],
                idle: bool, idle_since: float | None, policy: SummaryPolicy, max_gap: float) -> ClaimSummary:
        """Add one sample (device -> activity, memory share, above the idle thresholds) and return the summary
        as of ``now``."""
        for name, (activity, memory, active) in levels.items():
            self.accounts.setdefault(name, DeviceAccount()).add(now, activity, memory, active, policy.window,
                                                                max_gap)
        return ClaimSummary(now, idle, idle_since if idle else None,
                            {n: self.accounts[n].figures() for n in levels})

    def due(self, policy: SummaryPolicy, summary: ClaimSummary) -> str | None:
        """Why to write ``summary`` now, or None: only in the first round at or after a slot time, and only for a
        reason (``write_reason``). Each slot is used once, written or not (a failed write waits for the next)."""
        now = summary.at
        if self.next_at is None:
            self.next_at = next_slot(now, self.slot, policy.min_interval, after=False)
        if now < self.next_at:
            return None
        self.next_at = next_slot(now, self.slot, policy.min_interval, after=True)
        return write_reason(policy, self.last, summary)

    def wrote(self, summary: ClaimSummary) -> None:
        self.last = summary
        self.writes += 1

    def seed(self, found: Mapping[str, SummaryData], now: float) -> None:
        """Continue from the summary the API shows (a restarted plugin keeps the seconds and the write schedule:
        the plugins of a cluster restarting at once do not all write at once)."""
        self.seeded = True
        if not found or self.writes:
            return
        for n, d in found.items():
            acct = self.accounts.setdefault(n, DeviceAccount())
            acct.allocated_seconds += d.allocated_seconds
            acct.active_seconds += d.active_seconds
        first = next(iter(found.values()))
        self.last = ClaimSummary(min(first.observed, now), first.idle, first.idle_since_s,
                                 {n: DeviceFigures(d.activity, d.memory_used, d.allocated_seconds, d.active_seconds)
                                  for n, d in found.items()})


def _moved(a: float | None, b: float | None, delta: float) -> bool:
    if a is None or b is None:
        return (a is None) != (b is None)
    return abs(a - b) >= delta


def write_reason(policy: SummaryPolicy, last: ClaimSummary | None, now: ClaimSummary) -> str | None:
    """Why ``now`` differs enough from ``last`` (what was last written; None: nothing yet) to be written: FIRST,
    STATE, CHANGE, REFRESH, or None. Asked at the claim's slots only (``ClaimTrack.due``), so a refresh is due at
    the slot nearest ``max_interval`` after the last write."""
    if last is None:
        return FIRST
    age = now.at - last.at
    if now.idle != last.idle:
        return STATE
    if set(now.devices) != set(last.devices):
        return CHANGE
    for name, fig in now.devices.items():
        old = last.devices[name]
        if _moved(fig.activity, old.activity, policy.delta) or _moved(fig.memory, old.memory, policy.delta):
            return CHANGE
    if age >= policy.max_interval - policy.min_interval / 2:
        return REFRESH
    return None


def stamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def device_data(s: ClaimSummary, device: str, window: float) -> dict[str, Any]:
    """The ``data`` object of one device entry (JSON, well under DATA_MAX_BYTES)."""
    f = s.devices[device]
    out: dict[str, Any] = {"kind": SUMMARY_KIND, "version": SUMMARY_VERSION, "observedAt": stamp(s.at),
                           "windowSeconds": round(window), "idle": s.idle,
                           "allocatedSeconds": round(f.allocated_seconds), "activeSeconds": round(f.active_seconds)}
    if f.activity is not None:
        out["activity"] = _round(f.activity)
    if f.memory is not None:
        out["memoryUsed"] = _round(f.memory)
    if s.idle and s.idle_since is not None:
        out["idleSince"] = stamp(s.idle_since)
    return out


class SummaryData(BaseModel):
    """The ``data`` object as read back (the inventory, a restarted plugin); extra keys are ignored."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    kind: str
    version: int
    observed_at: str = Field(alias="observedAt")
    window_seconds: float = Field(default=DEFAULT_WINDOW, alias="windowSeconds", ge=0)
    idle: bool = False
    idle_since: str | None = Field(default=None, alias="idleSince")
    allocated_seconds: float = Field(default=0.0, alias="allocatedSeconds", ge=0)
    active_seconds: float = Field(default=0.0, alias="activeSeconds", ge=0)
    activity: float | None = Field(default=None, ge=0, le=1)
    memory_used: float | None = Field(default=None, alias="memoryUsed", ge=0, le=1)

    @property
    def observed(self) -> float:
        return parse_stamp(self.observed_at)

    @property
    def idle_since_s(self) -> float | None:
        return parse_stamp(self.idle_since) if self.idle_since else None


def read_data(data: Any) -> SummaryData | None:
    """A device entry's ``data`` if it is a summary of this kind and version, else None (another writer's
    data, an older format, or a value that does not parse)."""
    if not isinstance(data, dict) or data.get("kind") != SUMMARY_KIND or data.get("version") != SUMMARY_VERSION:
        return None
    try:
        got = SummaryData.model_validate(data)
        _ = (got.observed, got.idle_since_s)  # the time stamps parse, or the entry is not used
    except (ValidationError, ValueError):
        return None
    return got


def written_summaries(claim: Mapping[str, Any], driver: str, pool: str) -> dict[str, SummaryData]:
    """device name -> the summary the claim carries now on this driver's devices of ``pool``."""
    out = {}
    for d in (claim.get("status") or {}).get("devices") or []:
        if d.get("driver") == driver and d.get("pool") == pool:
            got = read_data(d.get("data"))
            if got is not None:
                out[str(d.get("device"))] = got
    return out


def summary_apply(namespace: str, name: str, uid: str, driver: str, pool: str, s: ClaimSummary,
                  window: float, shares: Mapping[str, str | None] | None = None) -> dict[str, Any]:
    """The server-side apply configuration of the claim's summaries (pure): one entry per device of ``s``
    (with its ``shareID`` when the claim holds a share of it: the entry must name an allocated device)."""
    entries = []
    for dev in sorted(s.devices):
        e: dict[str, Any] = {"driver": driver, "pool": pool, "device": dev, "data": device_data(s, dev, window)}
        share = (shares or {}).get(dev)
        if share:
            e["shareID"] = share
        entries.append(e)
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": uid}, "status": {"devices": entries}}
