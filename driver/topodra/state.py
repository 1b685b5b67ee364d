"""Prepare/unprepare of ResourceClaims on this node, crash-safe.

The kubelet calls NodePrepareResources before a pod's containers start and
NodeUnprepareResources after its last pod on the node is gone.  Both must be
idempotent, answer every claim, and survive plugin crashes, restarts and node
reboots.  The rules (see docs/prepare.md):

* Every operation holds a process lock and ``flock(<state_dir>/serialize.lock)``
  so two plugin processes (rolling upgrade) never interleave, and re-reads the
  checkpoint from disk under it (the peer may have changed it).
* Prepare writes the claim as ``PrepareStarted`` to the checkpoint, then its
  CDI spec, then marks it ``PrepareCompleted``.  A ``PrepareStarted`` entry
  seen while holding the lock was left by a crashed process and is rolled back.
* Unprepare removes the CDI spec, then the checkpoint entry; it needs only the
  checkpoint, never the (possibly deleted) claim object.
* A claim that fails changes nothing: no checkpoint entry, no CDI file.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from topodra import cdi, checkpoint
from topodra.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Access,
    CheckpointCorrupt,
    CheckpointData,
    CheckpointDevice,
    ClaimEntry,
)
from topodra.devices import Device
from topodra.filelock import FileLock, LockTimeout

log = logging.getLogger(__name__)

ClaimGetter = Callable[[str, str], dict[str, Any] | None]

DEFAULT_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
LOCK_FILE = "serialize.lock"
CRASH_POINT_ENV = "TOPODRA_CRASH_POINT"
CRASH_POINTS = frozenset({"after-prepare-started", "after-cdi-written", "after-unprepare-cdi-removed"})
CRASH_EXIT_CODE = 137


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    uid: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


@dataclass(frozen=True)
class PreparedDevice:
    request_names: list[str]
    pool_name: str
    device_name: str
    cdi_device_ids: list[str]
    share_id: str | None = None


@dataclass(frozen=True)
class PrepareResult:
    devices: list[PreparedDevice] = field(default_factory=list)
    error: str = ""


@dataclass(frozen=True)
class RecoveryReport:
    """What startup recovery did, for logs and tests."""

    rebooted: bool = False
    rolled_back: list[str] = field(default_factory=list)
    recreated: list[str] = field(default_factory=list)
    unrecoverable: dict[str, str] = field(default_factory=dict)
    orphan_specs: list[str] = field(default_factory=list)
    quarantined: str | None = None


class ClaimError(Exception):
    """A claim cannot be prepared; the message names the claim and the reason."""


@dataclass(frozen=True)
class _Planned:
    """One allocation result of a claim, checked and resolved to a local device."""

    device: Device
    request_names: list[str]
    share_id: str | None
    access: Access


def base_request_name(request: str) -> str:
    """``gpus/h100`` → ``gpus``: pods can reference only main request names."""
    return request.split("/", 1)[0]


def read_boot_id(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        log.warning("cannot read boot ID from %s (%s); reboot detection is off", path, e)
        return ""


def _access(result: dict[str, Any]) -> Access:
    if result.get("adminAccess"):
        return "admin"
    if result.get("shareID") or result.get("consumedCapacity"):
        return "shared"
    return "exclusive"


def _conflicts(new_access: Access, holder_access: Access) -> bool:
    if "admin" in (new_access, holder_access):
        return False  # admin access observes devices; it never takes them
    return not (new_access == "shared" and holder_access == "shared")


class DeviceState:
    """The node's prepared claims: checkpoint + CDI specs, serialized across processes."""

    def __init__(
        self,
        driver_name: str,
        node_name: str,
        devices: Sequence[Device],
        claim_getter: ClaimGetter,
        cdi_root: str | os.PathLike[str],
        state_dir: str | os.PathLike[str],
        boot_id_path: str = DEFAULT_BOOT_ID_PATH,
        crash_point: str | None = None,
        *,
        nvidia_spec_dirs: Sequence[str | os.PathLike[str]] = cdi.DEFAULT_SPEC_DIRS,
        quarantine_corrupt: bool = False,
        lock_timeout: float | None = 20.0,
    ) -> None:
        """Load the checkpoint and recover; raises ``CheckpointCorrupt`` unless ``quarantine_corrupt``."""
        self.driver_name = driver_name
        self.node_name = node_name
        self.pool_name = node_name
        self.claim_getter = claim_getter
        self.cdi_root = Path(cdi_root)
        self.state_dir = Path(state_dir)
        self.checkpoint_path = self.state_dir / checkpoint.FILE_NAME
        self.nvidia_spec_dirs = [Path(d) for d in nvidia_spec_dirs]
        self._spec_cache: cdi.SpecCache = {}
        point = crash_point if crash_point is not None else os.environ.get(CRASH_POINT_ENV) or None
        if point is not None and point not in CRASH_POINTS:
            raise ValueError(f"unknown crash point {point!r}; known: {', '.join(sorted(CRASH_POINTS))}")
        self.crash_point = point
        self._devices: dict[str, Device] = {d.name: d for d in devices}
        self._lock = threading.Lock()
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.cdi_root.mkdir(parents=True, exist_ok=True)
        self._flock = FileLock(self.state_dir / LOCK_FILE, timeout=lock_timeout)
        self.boot_id = read_boot_id(boot_id_path)
        self.last_recovery = self.recover(quarantine_corrupt=quarantine_corrupt)

    # ---- public API ----

    @property
    def devices(self) -> list[Device]:
        return list(self._devices.values())

    def set_devices(self, devices: Sequence[Device]) -> None:
        """Hardware changed: later prepares see the new set; prepared claims are kept."""
        new = {d.name: d for d in devices}
        with self._lock:
            old, self._devices = self._devices, new
        added, removed = sorted(set(new) - set(old)), sorted(set(old) - set(new))
        if added or removed:
            log.info("node %s: devices added %s, removed %s", self.node_name, added, removed)
        if removed:
            try:
                data = checkpoint.load(self.checkpoint_path) or CheckpointData()
            except CheckpointCorrupt as e:
                log.error("node %s: %s", self.node_name, e)
                return
            for entry in data.claims.values():
                gone = sorted({d.device_name for d in entry.devices} & set(removed))
                if gone:
                    log.warning("node %s: prepared claim %s uses devices %s that are no longer present",
                                self.node_name, entry.ref, gone)

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        """Prepare a batch; one result per claim UID (errors per claim, never raised)."""
        if not claims:
            return {}
        try:
            with self._locked():
                return self._prepare_locked(claims)
        except (LockTimeout, CheckpointCorrupt, OSError) as e:
            log.error("node %s: prepare of %s failed: %s", self.node_name, [str(c) for c in claims], e)
            return {c.uid: PrepareResult([], f"claim {c}: prepare failed on node {self.node_name}: {e}")
                    for c in claims}

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """Unprepare a batch; uid → "" on success (also for unknown claims) or an error."""
        if not claims:
            return {}
        try:
            with self._locked():
                return self._unprepare_locked(claims)
        except (LockTimeout, CheckpointCorrupt, OSError) as e:
            log.error("node %s: unprepare of %s failed: %s", self.node_name, [str(c) for c in claims], e)
            return {c.uid: f"claim {c}: unprepare failed on node {self.node_name}: {e}" for c in claims}

    def prepared_claims(self) -> dict[str, ClaimEntry]:
        """Checkpointed claims (read without the lock; files are replaced atomically)."""
        data = checkpoint.load(self.checkpoint_path)
        return dict(data.claims) if data else {}

    def recover(self, quarantine_corrupt: bool = False) -> RecoveryReport:
        """Make the checkpoint and the CDI directory agree again after a crash, restart or reboot."""
        with self._locked():
            report = self._recover_locked(quarantine_corrupt)
        self._log_recovery(report)
        return report

    # ---- locking / IO helpers ----

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock, self._flock:
            yield

    def _load(self) -> CheckpointData:
        return checkpoint.load(self.checkpoint_path) or CheckpointData(boot_id=self.boot_id)

    def _save(self, data: CheckpointData) -> None:
        # An unreadable boot ID must not erase the one recorded (reboot detection would be lost).
        boot_id = self.boot_id or data.boot_id
        checkpoint.save(self.checkpoint_path, data.model_copy(update={"boot_id": boot_id}))
        self._update_metrics(data)

    def _maybe_crash(self, point: str) -> None:
        if self.crash_point == point:
            log.critical("crash point %s reached: exiting with %d as if killed", point, CRASH_EXIT_CODE)
            for h in logging.getLogger().handlers:
                h.flush()
            os._exit(CRASH_EXIT_CODE)

    def _spec_for(self, entry: ClaimEntry) -> dict[str, Any]:
        """Re-derive the claim's CDI spec from current device facts (device nodes may move on reboot)."""
        sds = []
        for d in entry.devices:
            dev = self._devices.get(d.device_name)
            if dev is None:
                raise ClaimError(f"claim {entry.ref}: device {d.device_name} is no longer present on node "
                                 f"{self.node_name}; cannot re-create its CDI spec")
            sds.append(cdi.SpecDevice(dev, d.share_id))
        return cdi.build_spec(self.driver_name, entry.uid, sds)

    def _rollback_started(self, data: CheckpointData) -> tuple[CheckpointData, list[str]]:
        """Drop PrepareStarted entries (left by a process that died mid-prepare) and their specs."""
        started = [e for e in data.claims.values() if e.state == PREPARE_STARTED]
        for e in started:
            cdi.remove_spec(self.cdi_root, self.driver_name, e.uid)
            log.warning("node %s: rolled back claim %s left in %s by a crashed prepare",
                        self.node_name, e.ref, PREPARE_STARTED)
        return data.without_claims({e.uid for e in started}), [e.uid for e in started]

    # ---- prepare ----

    def _prepare_locked(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        data, rolled_back = self._rollback_started(self._load())
        counts = Counter(c.uid for c in claims)
        results: dict[str, PrepareResult] = {}
        working = data
        fresh: list[tuple[ClaimRef, ClaimEntry, dict[str, Any]]] = []
        nvidia_ids: dict[str, str] | None = None
        for c in claims:
            if c.uid in results:
                continue
            if counts[c.uid] > 1:
                results[c.uid] = PrepareResult([], f"claim {c}: UID appears {counts[c.uid]} times in one "
                                                   "NodePrepareResources call; refusing to prepare it")
                continue
            existing = data.claims.get(c.uid)
            if existing is not None:
                results[c.uid] = self._answer_existing(existing)
                continue
            try:
                planned = self._plan(c, working)
                if nvidia_ids is None:
                    nvidia_ids = self._nvidia_ids()
                entry, spec = self._entry_for(c, planned, nvidia_ids)
                cdi.validate_spec(spec)
            except (ClaimError, cdi.CDISpecInvalid) as e:
                log.warning("node %s: cannot prepare claim %s: %s", self.node_name, c, e)
                results[c.uid] = PrepareResult([], str(e))
                continue
            working = working.with_claim(entry)
            fresh.append((c, entry, spec))
        if not fresh:
            if rolled_back:
                self._save(data)
            return results

        try:
            self._save(working)
        except OSError as e:
            for c, _, _ in fresh:
                results[c.uid] = PrepareResult([], f"claim {c}: cannot write checkpoint: {e}")
            return results
        self._maybe_crash("after-prepare-started")

        completed = working
        written: list[tuple[ClaimRef, ClaimEntry]] = []
        for c, entry, spec in fresh:
            try:
                cdi.write_spec(self.cdi_root, self.driver_name, c.uid, spec)
            except (OSError, cdi.CDISpecInvalid) as e:
                with contextlib.suppress(OSError):
                    cdi.remove_spec(self.cdi_root, self.driver_name, c.uid)
                completed = completed.without_claims({c.uid})
                results[c.uid] = PrepareResult([], f"claim {c}: cannot write CDI spec: {e}")
                continue
            done = entry.model_copy(update={"state": PREPARE_COMPLETED})
            completed = completed.with_claim(done)
            written.append((c, done))
        self._maybe_crash("after-cdi-written")

        try:
            self._save(completed)
        except OSError as e:
            for c, _ in written:
                with contextlib.suppress(OSError):
                    cdi.remove_spec(self.cdi_root, self.driver_name, c.uid)
                results[c.uid] = PrepareResult([], f"claim {c}: cannot write checkpoint: {e}")
            return results
        for c, done in written:
            results[c.uid] = PrepareResult(_to_prepared(done))
            log.info("node %s: prepared claim %s: devices %s", self.node_name, c,
                     [d.device_name for d in done.devices])
        return results

    def _answer_existing(self, entry: ClaimEntry) -> PrepareResult:
        """Idempotent repeat: the stored answer, with the CDI spec re-created if it went missing."""
        if not cdi.spec_exists(self.cdi_root, self.driver_name, entry.uid):
            try:
                cdi.write_spec(self.cdi_root, self.driver_name, entry.uid, self._spec_for(entry))
            except (ClaimError, cdi.CDISpecInvalid, OSError) as e:
                log.error("node %s: claim %s: %s", self.node_name, entry.ref, e)
                return PrepareResult([], f"claim {entry.ref}: already prepared but its CDI spec is missing "
                                         f"and cannot be re-created: {e}")
            log.warning("node %s: re-created missing CDI spec of prepared claim %s",
                        self.node_name, entry.ref)
        log.info("node %s: claim %s already prepared", self.node_name, entry.ref)
        return PrepareResult(_to_prepared(entry))

    def _get_claim(self, c: ClaimRef) -> dict[str, Any]:
        try:
            claim = self.claim_getter(c.namespace, c.name)
        except Exception as e:
            raise ClaimError(f"claim {c}: cannot read the ResourceClaim: {e}") from None
        if claim is None:
            raise ClaimError(f"claim {c}: ResourceClaim not found")
        api_uid = (claim.get("metadata") or {}).get("uid")
        if api_uid != c.uid:
            raise ClaimError(f"claim {c}: ResourceClaim was replaced (the API has UID {api_uid})")
        return claim

    def _plan(self, c: ClaimRef, working: CheckpointData) -> list[_Planned]:
        """Check the claim's allocation against this node and current holders (no side effects)."""
        claim = self._get_claim(c)
        allocation = (claim.get("status") or {}).get("allocation")
        if not allocation:
            raise ClaimError(f"claim {c}: ResourceClaim is not allocated")
        results = (allocation.get("devices") or {}).get("results") or []
        ours = [r for r in results if r.get("driver") == self.driver_name]
        if not ours:
            others = sorted({str(r.get("driver")) for r in results})
            raise ClaimError(f"claim {c}: no devices allocated from driver {self.driver_name} "
                             f"(allocated drivers: {others or 'none'})")
        holders: dict[str, list[tuple[str, Access]]] = {}
        for entry in working.claims.values():
            for d in entry.devices:
                holders.setdefault(d.device_name, []).append((entry.ref, d.access))
        planned: list[_Planned] = []
        mine: dict[str, list[Access]] = {}
        for r in ours:
            pool, name = str(r.get("pool", "")), str(r.get("device", ""))
            if pool != self.pool_name:
                raise ClaimError(f"claim {c}: device {pool}/{name} is from pool {pool}, but this is node "
                                 f"{self.node_name} (pool {self.pool_name}); the claim is for another node")
            dev = self._devices.get(name)
            if dev is None:
                raise ClaimError(f"claim {c}: device {name} is unknown on node {self.node_name}")
            access = _access(r)
            for holder, held in holders.get(name, []):
                if _conflicts(access, held):
                    raise ClaimError(f"claim {c}: device {name} on node {self.node_name} is already in use "
                                     f"by claim {holder} ({held}); this allocation is {access}")
            if any(_conflicts(access, a) for a in mine.get(name, [])):
                raise ClaimError(f"claim {c}: device {name} is allocated twice in this claim without sharing")
            mine.setdefault(name, []).append(access)
            base = base_request_name(str(r.get("request", "")))
            share = r.get("shareID")
            planned.append(_Planned(dev, [base] if base else [], str(share) if share else None, access))
        return planned

    def _nvidia_ids(self) -> dict[str, str]:
        specs = cdi.load_specs(self.nvidia_spec_dirs, skip_prefix=cdi.spec_file_prefix(self.driver_name),
                               cache=self._spec_cache)
        return cdi.nvidia_gpu_ids(specs, self._devices.values())

    def _entry_for(self, c: ClaimRef, planned: list[_Planned],
                   nvidia_ids: dict[str, str]) -> tuple[ClaimEntry, dict[str, Any]]:
        sds = [cdi.SpecDevice(p.device, p.share_id) for p in planned]
        spec = cdi.build_spec(self.driver_name, c.uid, sds)
        devices = []
        for p, spec_dev in zip(planned, spec["devices"], strict=True):
            ids = [cdi.qualified_id(self.driver_name, spec_dev["name"])]
            if p.device.name in nvidia_ids:
                ids.append(nvidia_ids[p.device.name])
            devices.append(CheckpointDevice(
                request_names=p.request_names, pool_name=self.pool_name, device_name=p.device.name,
                cdi_device_ids=ids, share_id=p.share_id, access=p.access))
        entry = ClaimEntry(uid=c.uid, namespace=c.namespace, name=c.name, state=PREPARE_STARTED,
                           devices=devices)
        return entry, spec

    # ---- unprepare ----

    def _unprepare_locked(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        data, rolled_back = self._rollback_started(self._load())
        results: dict[str, str] = {}
        removed: list[ClaimEntry] = []
        for c in claims:
            if c.uid in results:
                continue
            entry = data.claims.get(c.uid)
            if entry is None:
                results[c.uid] = ""
                log.info("node %s: claim %s not prepared here (or already unprepared); nothing to do",
                         self.node_name, c)
                continue
            try:
                cdi.remove_spec(self.cdi_root, self.driver_name, c.uid)
            except OSError as e:
                results[c.uid] = f"claim {c}: cannot remove CDI spec: {e}"
                continue
            self._maybe_crash("after-unprepare-cdi-removed")
            removed.append(entry)
            results[c.uid] = ""
        if removed or rolled_back:
            try:
                self._save(data.without_claims({e.uid for e in removed}))
            except OSError as e:
                for entry in removed:
                    results[entry.uid] = f"claim {entry.ref}: cannot write checkpoint: {e}"
                return results
        for entry in removed:
            log.info("node %s: unprepared claim %s: released devices %s", self.node_name, entry.ref,
                     [d.device_name for d in entry.devices])
        return results

    # ---- recovery ----

    def _recover_locked(self, quarantine_corrupt: bool) -> RecoveryReport:
        for p in checkpoint.clean_temps(self.state_dir) + cdi.clean_temps(self.cdi_root, self.driver_name):
            log.info("node %s: removed temp file %s left by a crashed write", self.node_name, p)
        quarantined: str | None = None
        try:
            loaded = checkpoint.load(self.checkpoint_path)
        except CheckpointCorrupt:
            if not quarantine_corrupt:
                raise
            quarantined = str(checkpoint.quarantine(self.checkpoint_path))
            loaded = None
        if loaded is None:
            self._update_metrics(CheckpointData())
            orphans = sorted(cdi.claim_spec_uids(self.cdi_root, self.driver_name))
            return RecoveryReport(orphan_specs=orphans, quarantined=quarantined)
        rebooted = bool(loaded.boot_id and self.boot_id and loaded.boot_id != self.boot_id)
        data, rolled_back = self._rollback_started(loaded)
        recreated: list[str] = []
        unrecoverable: dict[str, str] = {}
        for entry in data.claims.values():
            if not rebooted and cdi.spec_exists(self.cdi_root, self.driver_name, entry.uid):
                continue
            try:
                cdi.write_spec(self.cdi_root, self.driver_name, entry.uid, self._spec_for(entry))
            except (ClaimError, cdi.CDISpecInvalid, OSError) as e:
                unrecoverable[entry.uid] = str(e)
                continue
            recreated.append(entry.uid)
        if rebooted or rolled_back or (self.boot_id and loaded.boot_id != self.boot_id):
            self._save(data)
        else:
            self._update_metrics(data)
        orphans = sorted(cdi.claim_spec_uids(self.cdi_root, self.driver_name) - set(data.claims))
        return RecoveryReport(rebooted=rebooted, rolled_back=rolled_back, recreated=recreated,
                              unrecoverable=unrecoverable, orphan_specs=orphans, quarantined=quarantined)

    def _log_recovery(self, r: RecoveryReport) -> None:
        node = self.node_name
        if r.quarantined:
            log.warning("node %s: corrupt checkpoint moved to %s; started empty", node, r.quarantined)
        if r.rebooted:
            log.warning("node %s: boot ID changed (node rebooted); re-created CDI specs of %d prepared "
                        "claims", node, len(r.recreated))
        elif r.recreated:
            log.warning("node %s: re-created missing CDI specs for claims %s", node, r.recreated)
        if r.rolled_back:
            log.warning("node %s: rolled back interrupted prepares of claims %s", node, r.rolled_back)
        for uid, why in r.unrecoverable.items():
            log.error("node %s: claim %s: %s", node, uid, why)
        if r.orphan_specs:
            log.warning("node %s: CDI specs for claims %s in %s have no checkpoint entry; left in place "
                        "(remove them once no pod uses those claims)", node, r.orphan_specs, self.cdi_root)

    # ---- metrics ----

    def _update_metrics(self, data: CheckpointData) -> None:
        """Set the prepared claims/devices gauges when the plugin's metrics module is present."""
        try:
            metrics = importlib.import_module("topodra.plugin.metrics")
        except ImportError:
            return
        done = [e for e in data.claims.values() if e.state == PREPARE_COMPLETED]
        n_devices = sum(len(e.devices) for e in done)
        for attr, value in (("PREPARED_CLAIMS", len(done)), ("PREPARED_DEVICES", n_devices)):
            gauge = getattr(metrics, attr, None)
            if gauge is not None and hasattr(gauge, "set"):
                gauge.set(value)


def _to_prepared(entry: ClaimEntry) -> list[PreparedDevice]:
    return [PreparedDevice(request_names=list(d.request_names), pool_name=d.pool_name,
                           device_name=d.device_name, cdi_device_ids=list(d.cdi_device_ids),
                           share_id=d.share_id) for d in entry.devices]
