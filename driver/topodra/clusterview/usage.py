"""What the allocated GPUs are doing, from the claims the inventory already lists (pure).

The kubelet plugin writes, per GPU of a claim, a summary into ``ResourceClaim.status.devices[].data``
(``topodra.telemetry.summary``: mean activity and memory in use over its last minute, idle since, the seconds the
claim has held the GPU and of those the seconds it was above the idle thresholds), on change and at most once
per ``--status-summary-interval`` (default 5 min), and the ``Idle`` condition beside it on each change
(``topodra.telemetry.claimstatus``). So the figures here are as of each summary's ``observedAt`` (at most
``max_interval``, 30 min by default, old while the plugin runs); the idle list follows the condition, which is
written at once.

GPU-hours cover the claims that exist now, for as long as their plugin saw them: a deleted claim's hours leave
with it (history is Prometheus' job: ``topodra_claim_*`` and ``topodra_gpu_*`` series, docs/telemetry.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

Obj = dict[str, Any]
IDLE_CONDITION = "Idle"  # telemetry.claimstatus.CONDITION_TYPE (not imported: claimstatus imports the API client)


@dataclass(frozen=True)
class DeviceUse:
    """One allocated device's summary and condition as its claim shows them."""

    namespace: str
    claim: str
    activity: float | None = None
    memory_used: float | None = None
    allocated_seconds: float = 0.0
    active_seconds: float = 0.0
    observed_at: float | None = None  # the summary's observedAt; None: no summary
    idle: bool = False  # the Idle condition is True
    idle_since: float | None = None


@dataclass(frozen=True)
class ClaimUse:
    namespace: str
    name: str
    pods: tuple[str, ...]
    idle: bool
    idle_since: float | None


@dataclass(frozen=True)
class NamespaceUse:
    namespace: str
    gpus: int  # GPUs its claims hold now (on the nodes shown)
    gpus_reporting: int  # of those, with a summary
    gpu_hours_allocated: float
    gpu_hours_active: float

    @property
    def active_share(self) -> float | None:
        return self.gpu_hours_active / self.gpu_hours_allocated if self.gpu_hours_allocated > 0 else None


@dataclass(frozen=True)
class IdleClaim:
    namespace: str
    claim: str
    pods: tuple[str, ...]
    gpus: int  # its GPUs on the nodes shown
    idle_seconds: float  # how long its GPUs have been below the thresholds (since the condition, when no summary)
    nodes: tuple[str, ...]


def _time(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


def _pods(claim: Obj) -> tuple[str, ...]:
    return tuple(sorted(str(r["name"]) for r in (claim.get("status") or {}).get("reservedFor") or []
                        if r.get("resource") == "pods" and not r.get("apiGroup") and r.get("name")))


def device_uses(claims: Iterable[Obj], driver: str) -> tuple[dict[tuple[str, str], DeviceUse], dict[tuple[str, str],
                                                                                                        ClaimUse]]:
    """(pool, device) -> its use, for every device of ``driver`` with a status entry in an allocated claim; and
    (namespace, claim) -> the claim's pods and idle state."""
    from topodra.telemetry.summary import read_data

    devices: dict[tuple[str, str], DeviceUse] = {}
    out_claims: dict[tuple[str, str], ClaimUse] = {}
    for c in claims:
        st = c.get("status") or {}
        if not st.get("allocation") or not st.get("devices"):
            continue
        meta = c.get("metadata") or {}
        ns, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
        claim_idle, since = False, None
        for d in st["devices"]:
            if d.get("driver") != driver:
                continue
            cond = next((x for x in d.get("conditions") or [] if x.get("type") == IDLE_CONDITION), None)
            idle = cond is not None and cond.get("status") == "True"
            data = read_data(d.get("data"))
            dev_since = (data.idle_since_s if data is not None and data.idle else None)
            if idle and dev_since is None:
                dev_since = _time(cond.get("lastTransitionTime") if cond else None)
            key = (str(d.get("pool", "")), str(d.get("device", "")))
            devices[key] = DeviceUse(
                ns, name, data.activity if data else None, data.memory_used if data else None,
                data.allocated_seconds if data else 0.0, data.active_seconds if data else 0.0,
                data.observed if data else None, idle, dev_since if idle else None)
            if idle:
                claim_idle = True
                if dev_since is not None:
                    since = dev_since if since is None else min(since, dev_since)
        out_claims[(ns, name)] = ClaimUse(ns, name, _pods(c), claim_idle, since)
    return devices, out_claims


def mean(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return sum(got) / len(got) if got else None


def namespace_uses(held: Iterable[tuple[str, DeviceUse | None]]) -> list[NamespaceUse]:
    """Per namespace, from (namespace, use) of every allocated GPU shown (use None: no status entry)."""
    sums: dict[str, list[float]] = {}
    for ns, use in held:
        s = sums.setdefault(ns, [0, 0, 0.0, 0.0])
        s[0] += 1
        if use is not None and use.observed_at is not None:
            s[1] += 1
            s[2] += use.allocated_seconds / 3600
            s[3] += use.active_seconds / 3600
    return [NamespaceUse(ns, int(s[0]), int(s[1]), s[2], s[3]) for ns, s in sorted(sums.items())]


def idle_claims(claims: Mapping[tuple[str, str], ClaimUse], gpus_of: Mapping[tuple[str, str], list[str]],
                now: float) -> list[IdleClaim]:
    """The idle claims with GPUs on the nodes shown (``gpus_of``: claim -> the node of each of its GPUs), the
    longest idle first."""
    out = []
    for key, c in claims.items():
        nodes = gpus_of.get(key)
        if not c.idle or not nodes:
            continue
        out.append(IdleClaim(c.namespace, c.name, c.pods, len(nodes),
                             max(0.0, now - c.idle_since) if c.idle_since is not None else 0.0,
                             tuple(sorted(set(nodes)))))
    out.sort(key=lambda i: (-i.idle_seconds, i.namespace, i.claim))
    return out


def duration_text(seconds: float) -> str:
    """``2d03h``, ``1h05m``, ``7m``."""
    m = int(seconds // 60)
    d, h = divmod(m // 60, 24)
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m % 60:02d}m"
    return f"{m}m"
