"""Opt-in reclaim of idle claims: evict the pods of a claim that stayed idle past its namespace's grace period.

By default topodra never evicts. A namespace opts in with the label ``topodra.io/idle-reclaim``: ``enabled``
evicts, ``dry-run`` only records an Event (and a count) saying what it would evict. The annotation
``topodra.io/idle-reclaim-grace`` (``90m``, ``1h30m``, ``3600s`` or plain seconds) sets how long the claim's GPUs
must have been below the idle thresholds, counted on the same clock as the idle time (``idle.IdleState``), so
it must be at least the node's idle time; without it the plugin's ``--idle-reclaim-grace`` applies (1 h). A
label or annotation that does not parse, or a grace shorter than the idle time, is an Event on the claim's pods
and a log line, and nothing is evicted.

``policy`` and ``decide`` are the pure decision; ``Reclaimer`` is the effect, called by the sampler's thread
after each sample, outside any lock. It evicts through the Eviction API (``pods/eviction``), so the pods'
PodDisruptionBudgets hold: the API server answers 429 while a budget allows no disruption
(k8s.io/kubernetes v1.37.2 pkg/registry/core/pod/storage/eviction.go:419,447), and the eviction is tried again
at the next sample. The namespace is read only for a claim that is idle, at most once per ``namespace_refresh``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from topodra.kube import Kube, KubeError
from topodra.telemetry.attribution import ClaimInfo
from topodra.telemetry.claimstatus import pod_event

log = logging.getLogger(__name__)

LABEL = "topodra.io/idle-reclaim"
GRACE_ANNOTATION = "topodra.io/idle-reclaim-grace"
ENABLED = "enabled"
DRY_RUN = "dry-run"
DEFAULT_GRACE_SECONDS = 3600.0

EVENT_RECLAIMED = "GPUClaimReclaimed"
EVENT_DRY_RUN = "GPUClaimReclaimDryRun"
EVENT_INVALID = "GPUClaimReclaimInvalid"
EVENT_BLOCKED = "GPUClaimReclaimBlocked"

Mode = Literal["off", "enabled", "dry-run", "invalid"]
Action = Literal["none", "wait", "evict", "dry-run", "invalid"]
# The `result` label of topodra_idle_reclaims_total.
RESULTS = ("evicted", "dry_run", "blocked", "invalid", "failed")

_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def parse_duration(text: str) -> float:
    """Seconds of ``90m``, ``1h30m``, ``45s`` or ``3600``; ValueError for anything else or zero."""
    t = text.strip()
    if t.isdigit():
        seconds = float(t)
    else:
        m = _DURATION.match(t)
        if not t or m is None:
            raise ValueError(f"{text!r} is not a duration (e.g. 90m, 1h30m, 3600s or 3600)")
        h, mi, s = (int(g or 0) for g in m.groups())
        seconds = float(h * 3600 + mi * 60 + s)
    if seconds <= 0:
        raise ValueError(f"{text!r} is not a positive duration")
    return seconds


@dataclass(frozen=True)
class Policy:
    """A namespace's reclaim setting; ``problem`` says why it is ``invalid``."""

    mode: Mode
    grace: float = 0.0
    problem: str = ""


def policy(namespace: Mapping[str, Any] | None, default_grace: float, idle_seconds: float) -> Policy:
    """The policy a Namespace object states (pure); None (not read) is ``off``."""
    meta = (namespace or {}).get("metadata") or {}
    mode = (meta.get("labels") or {}).get(LABEL)
    if mode is None:
        return Policy("off")
    if mode not in (ENABLED, DRY_RUN):
        return Policy("invalid", problem=f"label {LABEL}={mode!r}: expected {ENABLED!r} or {DRY_RUN!r}")
    raw = (meta.get("annotations") or {}).get(GRACE_ANNOTATION)
    if raw is None:
        grace = default_grace
    else:
        try:
            grace = parse_duration(str(raw))
        except ValueError as e:
            return Policy("invalid", problem=f"annotation {GRACE_ANNOTATION}: {e}")
    if grace < idle_seconds:
        return Policy("invalid", problem=f"annotation {GRACE_ANNOTATION}={raw!r}: {grace:.0f}s is shorter than this "
                                         f"node's idle time ({idle_seconds:.0f}s)")
    return Policy(mode, grace)


def decide(p: Policy, idle: bool, idle_for: float) -> Action:
    """What to do now about one claim (pure): ``idle_for`` is how long its GPUs have been below the thresholds."""
    if not idle or p.mode == "off":
        return "none"
    if p.mode == "invalid":
        return "invalid"
    if idle_for < p.grace:
        return "wait"
    return "evict" if p.mode == ENABLED else "dry-run"


def eviction(namespace: str, pod: str) -> dict[str, Any]:
    """A policy/v1 Eviction of ``pod`` (the pod's own terminationGracePeriodSeconds applies)."""
    return {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": namespace}}


@dataclass
class _ClaimDone:
    """What was done about one claim in its current idle period (reset when it is active again)."""

    reported: set[str] = field(default_factory=set)  # event reasons already recorded
    evicted: set[str] = field(default_factory=set)  # pods whose eviction the API accepted (or that are gone)


@dataclass
class _NsCache:
    obj: dict[str, Any] | None
    fetched_at: float


class Reclaimer:
    """The effect: reads the namespaces of idle claims, evicts or reports, and counts what it did.

    ``round`` takes the sampler's ``ClaimIdle`` rows of one sample: (claim, idle, idle_for)."""

    def __init__(self, kube: Kube, node: str, *, idle_seconds: float, default_grace: float = DEFAULT_GRACE_SECONDS,
                 namespace_refresh: float = 60.0, clock: Callable[[], float] = time.time) -> None:
        self.kube = kube
        self.node = node
        self.idle_seconds = idle_seconds
        self.default_grace = default_grace
        self.namespace_refresh = namespace_refresh
        self._clock = clock
        self._namespaces: dict[str, _NsCache] = {}
        self._done: dict[str, _ClaimDone] = {}
        self.counts: dict[tuple[str, str], int] = {}  # (namespace, result) -> count since start
        self.api_errors = 0

    def _count(self, namespace: str, result: str, n: int = 1) -> None:
        self.counts[(namespace, result)] = self.counts.get((namespace, result), 0) + n

    def _namespace(self, name: str, now: float) -> dict[str, Any] | None:
        cached = self._namespaces.get(name)
        if cached is None or now - cached.fetched_at >= self.namespace_refresh:
            try:
                obj = self.kube.get(f"/api/v1/namespaces/{name}")
            except KubeError as e:
                self.api_errors += 1
                log.warning("telemetry: cannot read namespace %s for idle reclaim: %s", name, e)
                return cached.obj if cached else None
            cached = _NsCache(obj, now)
            self._namespaces[name] = cached
        return cached.obj

    def round(self, claims: Sequence[tuple[ClaimInfo, bool, float]]) -> None:
        now = self._clock()
        live = {c.uid for c, idle, _f in claims if idle}
        for uid in list(self._done):
            if uid not in live:
                del self._done[uid]  # active again or gone: a new idle period starts from nothing done
        for claim, idle, idle_for in claims:
            if not idle or not claim.pods:
                continue
            p = policy(self._namespace(claim.namespace, now), self.default_grace, self.idle_seconds)
            action = decide(p, idle, idle_for)
            done = self._done.setdefault(claim.uid, _ClaimDone())
            if action == "invalid":
                self._report_once(claim, done, EVENT_INVALID, "invalid", "Warning",
                                  f"idle reclaim is off for this claim: {p.problem}")
            elif action == "dry-run":
                self._report_once(claim, done, EVENT_DRY_RUN, "dry_run", "Normal",
                                  f"dry run: would evict pod(s) {', '.join(claim.pods)}: claim {claim.name} idle "
                                  f"for {idle_for:.0f}s, grace {p.grace:.0f}s ({LABEL}={DRY_RUN})",
                                  per_pod=True)
            elif action == "evict":
                self._evict(claim, done, idle_for, p.grace)

    def _event(self, namespace: str, pod: str, reason: str, event_type: str, message: str) -> None:
        try:
            self.kube.create(f"/api/v1/namespaces/{namespace}/events",
                             pod_event(namespace, pod, self.node, reason, message, self._clock(), event_type))
        except KubeError as e:  # the decision stands; the Event is best effort
            self.api_errors += 1
            log.warning("telemetry: cannot record event %s on pod %s/%s: %s", reason, namespace, pod, e)

    def _report_once(self, claim: ClaimInfo, done: _ClaimDone, reason: str, result: str, event_type: str,
                     message: str, per_pod: bool = False) -> None:
        if reason in done.reported:
            return
        done.reported.add(reason)
        log.log(logging.WARNING if event_type == "Warning" else logging.INFO, "telemetry: claim %s/%s: %s",
                claim.namespace, claim.name, message)
        for pod in claim.pods:
            self._event(claim.namespace, pod, reason, event_type, message)
        self._count(claim.namespace, result, len(claim.pods) if per_pod else 1)

    def _evict(self, claim: ClaimInfo, done: _ClaimDone, idle_for: float, grace: float) -> None:
        for pod in claim.pods:
            if pod in done.evicted:
                continue
            try:
                self.kube.create(f"/api/v1/namespaces/{claim.namespace}/pods/{pod}/eviction",
                                 eviction(claim.namespace, pod))
            except KubeError as e:
                if e.not_found:  # gone already: nothing to reclaim
                    done.evicted.add(pod)
                    continue
                if e.status == 429:  # a PodDisruptionBudget allows no disruption now: tried again next sample
                    self._count(claim.namespace, "blocked")
                    if EVENT_BLOCKED not in done.reported:
                        done.reported.add(EVENT_BLOCKED)
                        log.info("telemetry: eviction of pod %s/%s blocked: %s", claim.namespace, pod, e.message)
                        self._event(claim.namespace, pod, EVENT_BLOCKED, "Warning",
                                    f"idle claim {claim.name}: eviction blocked, retried: {e.message}")
                    continue
                self.api_errors += 1
                self._count(claim.namespace, "failed")
                log.warning("telemetry: cannot evict pod %s/%s of idle claim %s: %s", claim.namespace, pod,
                            claim.name, e)
                continue
            done.evicted.add(pod)
            self._count(claim.namespace, "evicted")
            msg = (f"evicted: claim {claim.name} idle for {idle_for:.0f}s, past the grace of {grace:.0f}s "
                   f"({LABEL}={ENABLED})")
            log.warning("telemetry: pod %s/%s %s", claim.namespace, pod, msg)
            self._event(claim.namespace, pod, EVENT_RECLAIMED, "Warning", msg)
