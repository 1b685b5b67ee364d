"""Prepare/unprepare of ResourceClaims on this node, crash-safe; local work only.

The kubelet calls NodePrepareResources before a pod's containers start and
NodeUnprepareResources after its last pod on the node is gone.  Both must be
idempotent, answer every claim, and survive plugin crashes, restarts and node
reboots.  The gRPC layer reads and checks the claims from the API server first
(``topodra.claims``); this module gets plain values and never talks to the
network.  The rules (see docs/prepare.md):

* Every operation holds a process lock and ``flock(<state_dir>/serialize.lock)``
  so two plugin processes (rolling upgrade) never interleave, and re-reads the
  checkpoint from disk under it (the peer may have changed it).
* Prepare writes the CDI specs of one call (not fsynced), then the checkpoint
  with the claims ``PrepareCompleted`` (one fsynced write per call, however many
  claims).  A crash before that write leaves only *orphan specs* (a spec with
  no checkpoint entry), which the kubelet never saw an answer for; recovery and
  the periodic ``cleanup`` delete them, and the kubelet's retry writes them again.
  ``PrepareStarted`` stays in the format for preparations with side effects
  that must be recorded before they happen: such an entry seen while holding the
  lock was left by a crashed process and is rolled back (MIG does not need it;
  see the MIG rule below).
* Group commit: calls that queue while another holds the lock are served
  together by the next holder, with one checkpoint write sequence for all of
  them, so concurrent pods do not pay one fsync sequence each.
* Crash safety rests on the checkpoint alone: CDI specs are not fsynced, and
  start-up recovery re-creates a missing spec of every prepared claim.
* Unprepare removes the CDI specs, then the checkpoint entries; it needs only
  the checkpoint, never the (possibly deleted) claim object.
* A claim that fails changes nothing: no checkpoint entry, no CDI file.
* MIG placement devices (topodra.sharing): prepare creates the GPU and compute
  instance before the CDI spec (which carries the MIG UUID) and records it in the
  checkpoint entry; unprepare destroys it before dropping the entry.  A crash in
  between leaves an instance no entry records: recovery destroys every such
  instance on the node's MIG GPUs, and re-creates recorded ones that are gone
  (after a reboot), so instances and checkpoint agree again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from topodra import cdi, checkpoint
from topodra.atomicfile import Sync
from topodra.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Access,
    CheckpointCorrupt,
    CheckpointData,
    CheckpointDevice,
    ClaimEntry,
)
from topodra.claims import AllocatedClaim, ClaimError, ClaimRef, FetchedClaim, UnavailableClaim
from topodra.devices import Device
from topodra.filelock import FileLock, LockTimeout
from topodra.inventory import Inventory
from topodra.observe import NO_OBSERVER, Observer
from topodra.sharing import mps as mps_dirs
from topodra.sharing import timeslice
from topodra.sharing.config import TIMESLICE_LEVEL, Mps, Sharing
from topodra.sharing.instances import MigError, MigInstance, MigInstances
from topodra.sharing.mig import placement_of
from topodra.sharing.mps import MpsDaemons, MpsError
from topodra.sharing.mps import claim_env as mps_claim_env
from topodra.sharing.timeslice import TimeSliceControl, TimeSliceError

log = logging.getLogger(__name__)

DEFAULT_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
LOCK_FILE = "serialize.lock"
CRASH_POINT_ENV = "TOPODRA_CRASH_POINT"
# Where TOPODRA_CRASH_POINT makes the process exit as if killed (docs/prepare.md, "Testing hooks").
CRASH_POINTS = frozenset({
    "after-mig-created",             # MIG instances of the batch created, no CDI spec or checkpoint yet
    "prepare-before-write",          # GPU state (MIG, time-slice, MPS) made, no CDI spec or checkpoint yet
    "prepare-mid-cdi",               # after the first new CDI spec of the batch, before the others
    "after-cdi-written",             # every new spec written, checkpoint not yet
    "after-checkpoint-written",      # checkpoint written, answer not yet sent
    "after-unprepare-cdi-removed",   # first spec of the batch removed, checkpoint not yet
    "after-unprepare-checkpoint-written",  # checkpoint durable, answer not yet sent
})
CRASH_EXIT_CODE = 137
_INTERVAL_NAME = {v: k for k, v in TIMESLICE_LEVEL.items()}

T = TypeVar("T")
Item = TypeVar("Item", ClaimRef, FetchedClaim)


@dataclass
class _Call(Generic[Item, T]):
    """One caller's claims waiting for the node lock; ``results`` is set by whoever serves it."""

    items: Sequence[Item]
    results: dict[str, T] | None = None


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
    mig_destroyed: list[str] = field(default_factory=list)  # "<GPU UUID>/<GI>" of instances nothing recorded
    mig_recreated: list[str] = field(default_factory=list)  # claim UIDs whose recorded instance was re-made
    unrecoverable: dict[str, str] = field(default_factory=dict)
    orphan_specs: list[str] = field(default_factory=list)  # kept: only after a quarantined checkpoint
    orphans_removed: list[str] = field(default_factory=list)
    quarantined: str | None = None


def read_boot_id(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        log.warning("cannot read boot ID from %s (%s); reboot detection is off", path, e)
        return ""


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
        inventory: Inventory,
        cdi_root: str | os.PathLike[str],
        state_dir: str | os.PathLike[str],
        boot_id_path: str = DEFAULT_BOOT_ID_PATH,
        crash_point: str | None = None,
        *,
        nvidia_spec_dirs: Sequence[str | os.PathLike[str]] = cdi.DEFAULT_SPEC_DIRS,
        quarantine_corrupt: bool = False,
        lock_timeout: float | None = 20.0,
        observer: Observer = NO_OBSERVER,
        mig: MigInstances | None = None,
        timeslice_control: TimeSliceControl | None = None,
        mps: MpsDaemons | None = None,
    ) -> None:
        """Load the checkpoint and recover; raises ``CheckpointCorrupt`` unless ``quarantine_corrupt``.

        ``mig``: NVML access for MIG instances; without it, claims on MIG placement devices fail.
        ``timeslice_control``: sets GPUs' time-slice levels; without it, non-default TimeSlicing claims fail.
        ``mps``: the per-claim MPS control daemons (default: under ``state_dir``, binary from PATH).
        """
        self.mig = mig
        self.timeslice = timeslice_control
        self.mps = mps if mps is not None else MpsDaemons(state_dir)
        self.driver_name = driver_name
        self.node_name = node_name
        self.pool_name = node_name
        self.inventory = inventory
        self.cdi_root = Path(cdi_root)
        self.state_dir = Path(state_dir)
        self.checkpoint_path = self.state_dir / checkpoint.FILE_NAME
        self.nvidia_spec_dirs = [Path(d) for d in nvidia_spec_dirs]
        self.observer = observer
        self._spec_cache: cdi.SpecCache = {}
        self._checkpoint_cache: checkpoint.LoadCache = {}
        point = crash_point if crash_point is not None else os.environ.get(CRASH_POINT_ENV) or None
        if point is not None and point not in CRASH_POINTS:
            raise ValueError(f"unknown crash point {point!r}; known: {', '.join(sorted(CRASH_POINTS))}")
        self.crash_point = point
        self._lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._queues: dict[str, list[_Call[Any, Any]]] = {"prepare": [], "unprepare": []}
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.cdi_root.mkdir(parents=True, exist_ok=True)
        self._flock = FileLock(self.state_dir / LOCK_FILE, timeout=lock_timeout)
        self.boot_id = read_boot_id(boot_id_path)
        self._known_devices: frozenset[str] | None = None
        self.last_recovery = self.recover(quarantine_corrupt=quarantine_corrupt)
        inventory.subscribe(self._devices_changed)

    # ---- public API ----

    def prepare(self, claims: Sequence[FetchedClaim]) -> dict[str, PrepareResult]:
        """Prepare a batch (UIDs unique); one result per claim UID (errors per claim, never raised)."""
        return self._batch("prepare", claims, lambda c: c.ref, self._prepare_locked, lambda e: PrepareResult([], e))

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """Unprepare a batch; uid → "" on success (also for unknown claims) or an error."""
        return self._batch("unprepare", claims, lambda c: c, self._unprepare_locked, lambda e: e)

    def checkpointed_claims(self) -> list[ClaimRef]:
        """The claims in the checkpoint now, read without the lock (the file is replaced atomically)."""
        data = self._load()
        return [ClaimRef(namespace=e.namespace, uid=e.uid, name=e.name) for e in data.claims.values()]

    def cleanup(self, stale: Sequence[ClaimRef]) -> tuple[dict[str, str], list[str]]:
        """Unprepare ``stale`` claims (their ResourceClaim is gone; the caller checked, outside the lock)
        and delete orphan specs; returns the unprepare answers and the orphan UIDs removed."""
        answers = self.unprepare(stale)
        with self._lock, self._node_locked("cleanup"):
            orphans = self._remove_orphans(self._load())
        if orphans:
            log.warning("node %s: removed orphan CDI specs of claims %s", self.node_name, orphans)
        return answers, orphans

    def recover(self, quarantine_corrupt: bool = False) -> RecoveryReport:
        """Make the checkpoint and the CDI directory agree again after a crash, restart or reboot."""
        with self._lock, self._node_locked("recover"):
            report = self._recover_locked(quarantine_corrupt)
        self._log_recovery(report)
        return report

    # ---- the one skeleton of both operations ----

    def _batch(self, op: str, items: Sequence[Item], ref_of: Callable[[Item], ClaimRef],
               locked: Callable[[list[Item]], dict[str, T]], failed: Callable[[str], T]) -> dict[str, T]:
        """Serve ``items`` under the node lock, together with every call of ``op`` queued meanwhile.

        If the lock or the checkpoint fails, every claim gets the error.  A UID that several
        concurrent calls ask for is handled once and its answer goes to each of them.
        """
        if not items:
            return {}
        call: _Call[Item, T] = _Call(items)
        with self._queue_lock:
            self._queues[op].append(call)
        with self._lock:
            if call.results is not None:  # an earlier lock holder served this call with its own
                return call.results
            with self._queue_lock:
                calls: list[_Call[Item, T]] = self._queues[op]
                self._queues[op] = []
            by_uid: dict[str, Item] = {}
            for c in calls:
                for i in c.items:
                    by_uid.setdefault(ref_of(i).uid, i)
            merged = list(by_uid.values())
            try:
                with self._node_locked(op):
                    results = locked(merged)
            except Exception as e:  # the lock, the checkpoint, or a bug: every queued caller must get an answer
                refs = [ref_of(i) for i in merged]
                expected = isinstance(e, LockTimeout | CheckpointCorrupt | OSError)
                log.error("node %s: %s of %s failed: %s", self.node_name, op, [str(r) for r in refs], e,
                          exc_info=not expected)
                results = {r.uid: failed(f"claim {r}: {op} failed on node {self.node_name}: {e}") for r in refs}
            for c in calls:
                c.results = {ref_of(i).uid: results[ref_of(i).uid] for i in c.items if ref_of(i).uid in results}
        assert call.results is not None
        return call.results

    @contextlib.contextmanager
    def _node_locked(self, op: str) -> Iterator[None]:
        """The cross-process flock (take ``self._lock`` first); reports how long it was held."""
        with self._flock:
            start = time.perf_counter()
            try:
                yield
            finally:
                self.observer.lock_held(op, time.perf_counter() - start)

    # ---- IO helpers ----

    def _load(self) -> CheckpointData:
        """The checkpoint as on disk now (re-read under the lock: a peer process may have written it)."""
        return checkpoint.load(self.checkpoint_path, self._checkpoint_cache) or CheckpointData(boot_id=self.boot_id)

    def _save(self, data: CheckpointData, sync: Sync = "durable") -> None:
        """Write the checkpoint before its answer goes to the kubelet (see docs/prepare.md, *Durability*).

        Every version on disk is complete (the data is always fsynced before the rename).
        ``"durable"`` (also fsync the directory, so the new version survives a power loss) is
        the rule.  Prepare's write of newly prepared claims is ``"data"``, like the Go example
        driver's one fsync per call: a power loss or kernel crash reboots the node, and after
        any restart the kubelet prepares every claim of every pod it starts again (it loads its
        own claim cache with ``prepared: false``; k8s.io/kubernetes v1.37.2
        pkg/kubelet/cm/dra/claiminfo.go ``newClaimInfoFromState``), so a prepare whose rename
        was lost is repeated from the claim object with the same answer; its containers died
        with the node.  Unprepare stays durable: the kubelet never repeats an unprepare it
        saw succeed, and a lost one would hold the device.  Measured side by side on the busy
        2-core VM, the directory fsync was most of the sequential gap to the Go driver
        (docs/benchmarks.md).
        """
        # An unreadable boot ID must not erase the one recorded (reboot detection would be lost).
        boot_id = self.boot_id or data.boot_id
        if boot_id != data.boot_id:
            data = data.model_copy(update={"boot_id": boot_id})
        checkpoint.save(self.checkpoint_path, data, sync=sync, cache=self._checkpoint_cache)
        self._report(data)

    def _maybe_crash(self, point: str) -> None:
        if self.crash_point == point:
            log.critical("crash point %s reached: exiting with %d as if killed", point, CRASH_EXIT_CODE)
            for h in logging.getLogger().handlers:
                h.flush()
            os._exit(CRASH_EXIT_CODE)

    def _spec_for(self, entry: ClaimEntry, devices: Mapping[str, Device]) -> dict[str, Any]:
        """Re-derive the claim's CDI spec from current device facts (device nodes may move on reboot)."""
        sds = []
        for d in entry.devices:
            dev = devices.get(d.device_name)
            if dev is None:
                raise ClaimError(f"claim {entry.ref}: device {d.device_name} is no longer present on node "
                                 f"{self.node_name}; cannot re-create its CDI spec")
            if d.mig is not None:
                dev = dev.model_copy(update={"uuid": d.mig.uuid, "device_nodes": self._mig_nodes(dev, d.mig)})
            sds.append(cdi.SpecDevice(dev, d.share_id, d.consumed_capacity,
                                      timeslice.sharing_env(cdi.env_fragment(dev.name), d.sharing)))
        env, mounts = self._mps_edits(entry.uid, [(d.sharing, d.consumed_capacity) for d in entry.devices])
        return cdi.valid_spec(self.driver_name, entry.uid, sds, env, mounts)

    # ---- MIG instances ----

    def _create_mig(self, entry: ClaimEntry, devices: Mapping[str, Device]) -> ClaimEntry:
        """The entry with a MIG instance created and recorded for each MIG device; on failure none is left."""
        out: list[CheckpointDevice] = []
        made: list[MigInstance] = []
        try:
            for d in entry.devices:
                dev = devices[d.device_name]
                if dev.kind != "mig":
                    out.append(d)
                    continue
                if self.mig is None:
                    raise ClaimError(f"claim {entry.ref}: {d.device_name} is a MIG device, but this plugin has "
                                     "no NVML access to create MIG instances")
                try:
                    inst = self.mig.create(placement_of(dev))
                except (MigError, ValueError) as e:
                    raise ClaimError(f"claim {entry.ref}: {d.device_name}: {e}") from e
                made.append(inst)
                out.append(d.model_copy(update={"mig": inst}))
        except ClaimError:
            self._destroy_mig(made)
            raise
        return entry.model_copy(update={"devices": out})

    def _mig_nodes(self, dev: Device, inst: MigInstance) -> tuple[str, ...]:
        """A MIG device's nodes: the parent's ``/dev/nvidiaN`` plus the instance's capability nodes (this host's
        GPUs only; mock hardware has none)."""
        if not dev.device_nodes:
            return ()
        if self.mig is None:
            raise ClaimError(f"device {dev.name}: no NVML access to find its MIG capability device nodes")
        try:
            minor = int(str(dev.attributes["parentDevice"].value).removeprefix("gpu-"))
            return (*dev.device_nodes, *self.mig.cap_device_nodes(inst, minor))
        except (KeyError, ValueError, MigError) as e:
            raise ClaimError(f"device {dev.name}: {e}") from e

    def _refuse(self, results: dict[str, PrepareResult], ref: ClaimRef, error: Exception, answer: str) -> None:
        """One claim of the batch fails (the others go on): log why, answer the kubelet with ``answer``."""
        log.warning("node %s: cannot prepare claim %s: %s", self.node_name, ref, error)
        results[ref.uid] = PrepareResult([], answer)

    def _destroy_mig(self, instances: Sequence[MigInstance]) -> None:
        for inst in instances:
            if self.mig is None:
                return
            try:
                self.mig.destroy(inst)
            except MigError as e:  # left for recovery's reconcile; logged
                log.error("node %s: %s", self.node_name, e)

    def _reconcile_mig(self, data: CheckpointData, devices: Mapping[str, Device]
                       ) -> tuple[CheckpointData, list[str], list[str]]:
        """Destroy instances no entry records; re-create recorded ones that are gone. (data, destroyed, re-made)"""
        if self.mig is None:
            return data, [], []
        recorded = [d.mig for e in data.claims.values() for d in e.devices if d.mig is not None]
        parents = sorted({str(d.attributes["parentUUID"].value) for d in devices.values()
                          if d.kind == "mig" and "parentUUID" in d.attributes} | {r.parent_uuid for r in recorded})
        if not parents:
            return data, [], []
        try:
            stray = self.mig.reconcile(parents, recorded)
            present = {i.key for i in self.mig.existing(parents)}
        except Exception as e:  # NVML failed (any NVMLError): prepared claims keep working; next start retries
            log.error("node %s: cannot reconcile MIG instances: %s", self.node_name, e)
            return data, [], []
        remade: list[str] = []
        for entry in list(data.claims.values()):
            if not any(d.mig is not None and d.mig.key not in present for d in entry.devices):
                continue
            stripped = entry.model_copy(update={"devices": [d.model_copy(update={"mig": None})
                                                            for d in entry.devices]})  # fmt: skip
            try:
                fresh = self._create_mig(stripped, devices)
                self._destroy_mig([m for m in entry.mig_instances if m.key in present])
            except (ClaimError, KeyError) as e:
                log.error("node %s: claim %s: its MIG instance is gone and cannot be re-created: %s",
                          self.node_name, entry.ref, e)
                continue
            data = data.with_claim(fresh)
            remade.append(entry.uid)
        return data, [f"{i.parent_uuid}/{i.gpu_instance}" for i in stray], remade

    # ---- sharing config (GpuConfig) ----

    def _timeslice_uses(self, data: CheckpointData, devices: Mapping[str, Device],
                        skip: set[str] | None = None) -> list[tuple[str, int]]:
        """(GPU UUID, level) of every prepared device with a TimeSlicing config (claims in ``skip`` left out)."""
        out = []
        for e in data.claims.values():
            if skip and e.uid in skip:
                continue
            for d in e.devices:
                dev = devices.get(d.device_name)
                level = timeslice.level_of(d.sharing)
                if dev is not None and dev.uuid and level != timeslice.DEFAULT_LEVEL:
                    out.append((dev.uuid, level))
        return out

    def _check_sharing(self, ref: ClaimRef, dev: Device, sharing: Sharing | None, working: CheckpointData) -> None:
        """Refuse a sharing config this device or node cannot honour, before anything changes."""
        if sharing is None:
            return
        if sharing.strategy == "MPS":
            if dev.kind not in ("gpu", "mig"):
                raise ClaimError(f"claim {ref}: device {dev.name} is a {dev.kind} device; MPS needs a GPU or MIG slice")
            return
        if dev.kind != "gpu":
            raise ClaimError(f"claim {ref}: device {dev.name} is a {dev.kind} device; time slicing is a property of a "
                             "whole GPU (a MIG slice has its own compute and needs none)")
        level = timeslice.level_of(sharing)
        if level == timeslice.DEFAULT_LEVEL:
            return
        if self.timeslice is None:
            raise ClaimError(f"claim {ref}: device {dev.name}: node {self.node_name} cannot set time-slice levels")
        held = timeslice.conflict(self._timeslice_uses(working, self.inventory.by_name), dev.uuid, level)
        if held is not None:
            raise ClaimError(f"claim {ref}: device {dev.name} already runs with time-slice interval "
                             f"{_INTERVAL_NAME[held]} for another prepared claim; this claim asks for "
                             f"{sharing.interval} (one GPU has one interval)")

    def _apply_timeslices(self, data: CheckpointData, devices: Mapping[str, Device], gpus: set[str],
                          *, unknown_default: bool = True) -> None:
        """Bring the time-slice level of ``gpus`` in line with ``data``; TimeSliceError on failure."""
        if self.timeslice is None or not gpus:
            return
        levels = timeslice.desired_levels(self._timeslice_uses(data, devices), gpus)
        timeslice.apply(self.timeslice, {u: v for u, v in levels.items() if u in gpus},
                        unknown_default=unknown_default)

    def _settle_levels(self, final: CheckpointData, devices: Mapping[str, Device],
                       entries: Sequence[ClaimEntry]) -> None:
        """After a failure: the GPUs of ``entries`` get the levels ``final`` asks for (errors left to recovery)."""
        gpus = set().union(*(self._timeslice_gpus(e, devices) for e in entries)) if entries else set()
        try:
            self._apply_timeslices(final, devices, gpus)
        except TimeSliceError as e:
            log.error("node %s: cannot set time-slice levels back (the next start retries): %s", self.node_name, e)

    def _mps_edits(self, uid: str, devices: Sequence[tuple[Sharing | None, Mapping[str, str]]]
                   ) -> tuple[list[str], list[tuple[str, str]]]:
        """The claim-wide container env and mounts of its MPS daemon (none without MPS devices)."""
        configs = [(sh.mps, consumed.get("memory")) for sh, consumed in devices if sh is not None
                   and sh.strategy == "MPS"]
        if not configs:
            return [], []
        first = configs[0][0] or Mps()
        if any((m or Mps()) != first for m, _ in configs):
            raise ClaimError(f"claim {uid}: its requests ask for different MPS settings; one claim has one MPS "
                             "daemon, so they must agree")
        pipe, logs = self.mps.dirs(uid)
        return mps_claim_env(first, [mem for _m, mem in configs]), [(str(pipe), mps_dirs.CONTAINER_PIPE_DIR),
                                                                   (str(logs), mps_dirs.CONTAINER_LOG_DIR)]

    def _mps_uuids(self, entry: ClaimEntry, devices: Mapping[str, Device]) -> list[str]:
        """What the claim's MPS daemon serves: the UUIDs (MIG UUIDs for slices) of its MPS devices."""
        return [d.mig.uuid if d.mig is not None else devices[d.device_name].uuid for d in entry.devices
                if d.sharing is not None and d.sharing.strategy == "MPS" and d.device_name in devices]

    def _stop_mps(self, entries: Sequence[ClaimEntry]) -> None:
        for e in entries:
            if any(d.sharing is not None and d.sharing.strategy == "MPS" for d in e.devices):
                try:
                    self.mps.stop(e.uid)
                except MpsError as err:  # left for recovery's reconcile; logged
                    log.error("node %s: %s", self.node_name, err)

    @staticmethod
    def _timeslice_gpus(entry: ClaimEntry, devices: Mapping[str, Device]) -> set[str]:
        return {devices[d.device_name].uuid for d in entry.devices
                if d.device_name in devices and devices[d.device_name].uuid
                and timeslice.level_of(d.sharing) != timeslice.DEFAULT_LEVEL}

    def _reconcile_mps(self, data: CheckpointData, devices: Mapping[str, Device]) -> None:
        """Stop daemons no prepared claim records; start recorded ones that are not running (after a reboot)."""
        try:
            stray = self.mps.reconcile(e.uid for e in data.claims.values() if self._mps_uuids(e, devices))
        except MpsError as e:
            log.error("node %s: cannot stop stray MPS daemons: %s", self.node_name, e)
            stray = []
        if stray:
            log.warning("node %s: stopped MPS daemons of claims no checkpoint entry records: %s", self.node_name,
                        stray)
        for entry in data.claims.values():
            uuids = self._mps_uuids(entry, devices)
            if uuids and self.mps.pid(entry.uid) is None:
                try:
                    self.mps.start(entry.uid, uuids)
                    log.warning("node %s: restarted the MPS daemon of claim %s", self.node_name, entry.ref)
                except MpsError as e:
                    log.error("node %s: claim %s: %s", self.node_name, entry.ref, e)

    def _rollback_started(self, data: CheckpointData) -> tuple[CheckpointData, list[str]]:
        """Drop PrepareStarted entries (left by a process that died mid-prepare) and their specs."""
        started = [e for e in data.claims.values() if e.state == PREPARE_STARTED]
        if not started:
            return data, []
        for e in started:
            cdi.remove_spec(self.cdi_root, self.driver_name, e.uid)
            log.warning("node %s: rolled back claim %s left in %s by a crashed prepare",
                        self.node_name, e.ref, PREPARE_STARTED)
        return data.without_claims({e.uid for e in started}), [e.uid for e in started]

    # ---- prepare ----

    def _prepare_locked(self, claims: Sequence[FetchedClaim]) -> dict[str, PrepareResult]:
        data, rolled_back = self._rollback_started(self._load())
        nvidia_ids: dict[str, str] | None = None
        devices = self.inventory.by_name
        results: dict[str, PrepareResult] = {}
        working = data
        fresh: list[tuple[ClaimRef, ClaimEntry, dict[str, Any]]] = []
        for c in claims:
            existing = data.claims.get(c.ref.uid)
            if existing is not None and (existing.namespace, existing.name) != (c.ref.namespace, c.ref.name):
                results[c.ref.uid] = PrepareResult([], f"claim {c.ref}: UID {c.ref.uid} is prepared on node "
                                                       f"{self.node_name} as claim {existing.ref}; not answered")
                continue
            if existing is not None:
                results[c.ref.uid] = self._answer_existing(existing, devices)
                continue
            if isinstance(c, UnavailableClaim):
                results[c.ref.uid] = PrepareResult([], c.error)
                continue
            try:
                if nvidia_ids is None:
                    nvidia_ids = self._nvidia_ids()
                entry, spec = self._plan(c, working, devices, nvidia_ids)
            except (ClaimError, cdi.CDISpecInvalid) as e:
                self._refuse(results, c.ref, e, str(e))
                continue
            working = working.with_claim(entry)
            fresh.append((c.ref, entry, spec))
        if not fresh:
            if rolled_back:
                self._save(data)
            return results

        # MIG instances first: the spec carries the MIG UUID.  A crash from here to the checkpoint
        # write leaves instances no entry records, which recovery destroys.
        if any(devices[d.device_name].kind == "mig" for _r, e, _s in fresh for d in e.devices):
            with_mig = []
            for ref, entry, spec in fresh:
                try:
                    if any(devices[d.device_name].kind == "mig" for d in entry.devices):
                        entry = self._create_mig(entry, devices)
                        spec = self._spec_for(entry, devices)
                except (ClaimError, cdi.CDISpecInvalid) as e:
                    self._destroy_mig(entry.mig_instances)  # created, unusable
                    self._refuse(results, ref, e, str(e))
                    continue
                with_mig.append((ref, entry, spec))
            fresh = with_mig
            self._maybe_crash("after-mig-created")

        # Time-slice levels next: like MIG instances, GPU state made before the checkpoint records it; a crash
        # from here to the checkpoint write leaves a level nothing asks for, which recovery sets back.
        applied = data
        with_levels = []
        for ref, entry, spec in fresh:
            gpus = self._timeslice_gpus(entry, devices)
            try:
                if gpus:
                    self._apply_timeslices(applied.with_claim(entry), devices, gpus)
            except TimeSliceError as e:
                with contextlib.suppress(TimeSliceError):
                    self._apply_timeslices(applied, devices, gpus)
                self._destroy_mig(entry.mig_instances)
                self._refuse(results, ref, e, f"claim {ref}: {e}")
                continue
            applied = applied.with_claim(entry)
            with_levels.append((ref, entry, spec))
        fresh = with_levels

        # MPS daemons last of the GPU state (they serve MIG UUIDs too); a crash before the checkpoint write
        # leaves a daemon no entry records, which recovery stops.
        with_mps = []
        for ref, entry, spec in fresh:
            uuids = self._mps_uuids(entry, devices)
            try:
                if uuids:
                    self.mps.start(entry.uid, uuids)
            except MpsError as e:
                self._settle_levels(applied.without_claims({entry.uid}), devices, [entry])
                applied = applied.without_claims({entry.uid})
                self._destroy_mig(entry.mig_instances)
                self._refuse(results, ref, e, f"claim {ref}: {e}")
                continue
            with_mps.append((ref, entry, spec))
        fresh = with_mps

        # Specs first (not fsynced), then one checkpoint write (data fsynced) with the claims completed.
        # A crash in between leaves only orphan specs of claims the kubelet got no answer for.
        self._maybe_crash("prepare-before-write")
        completed = data
        written: list[tuple[ClaimRef, ClaimEntry]] = []
        for n, (ref, entry, spec) in enumerate(fresh):
            if n == 1:
                self._maybe_crash("prepare-mid-cdi")
            try:
                cdi.write_spec(self.cdi_root, self.driver_name, ref.uid, spec)
            except OSError as e:
                with contextlib.suppress(OSError):
                    cdi.remove_spec(self.cdi_root, self.driver_name, ref.uid)
                self._destroy_mig(entry.mig_instances)
                self._stop_mps([entry])
                results[ref.uid] = PrepareResult([], f"claim {ref}: cannot write CDI spec: {e}")
                continue
            completed = completed.with_claim(entry)
            written.append((ref, entry))
        self._maybe_crash("after-cdi-written")
        if len(written) < len(fresh):  # claims whose spec failed: their GPUs' levels go back
            self._settle_levels(completed, devices, [e for _r, e, _s in fresh])
        if not written:
            if rolled_back:
                self._save(data)
            return results

        try:
            self._save(completed, sync="data")  # see _save: the kubelet repeats it after a reboot
        except OSError as e:
            for ref, entry in written:
                with contextlib.suppress(OSError):
                    cdi.remove_spec(self.cdi_root, self.driver_name, ref.uid)
                self._destroy_mig(entry.mig_instances)
                self._stop_mps([entry])
                results[ref.uid] = PrepareResult([], f"claim {ref}: cannot write checkpoint: {e}")
            self._settle_levels(data, devices, [e for _r, e in written])
            return results
        self._maybe_crash("after-checkpoint-written")
        for ref, done in written:  # logged once, by the gRPC layer, outside the lock
            results[ref.uid] = PrepareResult(_to_prepared(done))
        return results

    def _answer_existing(self, entry: ClaimEntry, devices: Mapping[str, Device]) -> PrepareResult:
        """Idempotent repeat: the stored answer, with the CDI spec re-created if it went missing."""
        if not cdi.spec_exists(self.cdi_root, self.driver_name, entry.uid):
            try:
                cdi.write_spec(self.cdi_root, self.driver_name, entry.uid, self._spec_for(entry, devices))
            except (ClaimError, cdi.CDISpecInvalid, OSError) as e:
                log.error("node %s: claim %s: %s", self.node_name, entry.ref, e)
                return PrepareResult([], f"claim {entry.ref}: already prepared but its CDI spec is missing "
                                         f"and cannot be re-created: {e}")
            log.warning("node %s: re-created missing CDI spec of prepared claim %s",
                        self.node_name, entry.ref)
        log.info("node %s: claim %s already prepared", self.node_name, entry.ref)
        return PrepareResult(_to_prepared(entry))

    def _plan(self, c: AllocatedClaim, working: CheckpointData, devices: Mapping[str, Device],
              nvidia_ids: dict[str, str]) -> tuple[ClaimEntry, dict[str, Any]]:
        """The claim's checkpoint entry and CDI spec, checked against local devices and holders (no IO)."""
        holders: dict[str, list[tuple[str, Access]]] = {}
        for entry in working.claims.values():
            for d in entry.devices:
                holders.setdefault(d.device_name, []).append((entry.ref, d.access))
        mine: dict[str, list[Access]] = {}
        sds: list[cdi.SpecDevice] = []
        for a in c.devices:
            dev = devices.get(a.device)
            if dev is None:
                raise ClaimError(f"claim {c.ref}: device {a.device} is unknown on node {self.node_name}")
            for holder, held in holders.get(a.device, []):
                if _conflicts(a.access, held):
                    raise ClaimError(f"claim {c.ref}: device {a.device} on node {self.node_name} is already in "
                                     f"use by claim {holder} ({held}); this allocation is {a.access}")
            if any(_conflicts(a.access, m) for m in mine.get(a.device, [])):
                raise ClaimError(f"claim {c.ref}: device {a.device} is allocated twice in this claim "
                                 "without sharing")
            mine.setdefault(a.device, []).append(a.access)
            self._check_sharing(c.ref, dev, a.sharing, working)
            sds.append(cdi.SpecDevice(dev, a.share_id, dict(a.consumed),
                                      timeslice.sharing_env(cdi.env_fragment(dev.name), a.sharing)))
        env, mounts = self._mps_edits(c.ref.uid, [(a.sharing, dict(a.consumed)) for a in c.devices])
        spec = cdi.valid_spec(self.driver_name, c.ref.uid, sds, env, mounts)
        entry_devices = []
        for a, spec_dev in zip(c.devices, spec["devices"], strict=True):
            ids = [cdi.qualified_id(self.driver_name, spec_dev["name"])]
            if a.device in nvidia_ids:
                ids.append(nvidia_ids[a.device])
            entry_devices.append(CheckpointDevice(
                request_names=[a.request] if a.request else [], pool_name=self.pool_name, device_name=a.device,
                cdi_device_ids=ids, share_id=a.share_id, access=a.access, consumed_capacity=dict(a.consumed),
                sharing=a.sharing))
        # Completed at once: the CDI spec is this claim's only side effect (see the module docstring).
        entry = ClaimEntry(uid=c.ref.uid, namespace=c.ref.namespace, name=c.ref.name, state=PREPARE_COMPLETED,
                           devices=entry_devices)
        return entry, spec

    def _nvidia_ids(self) -> dict[str, str]:
        """The NVIDIA toolkit's CDI IDs of our GPUs (its specs are parsed again only when they change)."""
        specs = cdi.load_specs(self.nvidia_spec_dirs, skip_prefix=cdi.spec_file_prefix(self.driver_name),
                               cache=self._spec_cache)
        return cdi.nvidia_gpu_ids(specs, self.inventory.devices)

    # ---- unprepare ----

    def _unprepare_locked(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        data, rolled_back = self._rollback_started(self._load())
        results: dict[str, str] = {}
        removed: list[ClaimEntry] = []
        for c in claims:
            entry = data.claims.get(c.uid)
            if entry is None:
                results[c.uid] = ""
                log.info("node %s: claim %s not prepared here (or already unprepared); nothing to do",
                         self.node_name, c)
                continue
            migs = entry.mig_instances
            if migs and self.mig is None:
                results[c.uid] = f"claim {c}: has MIG instances, but this plugin has no NVML access to destroy them"
                continue
            try:
                if any(d.sharing is not None and d.sharing.strategy == "MPS" for d in entry.devices):
                    self.mps.stop(entry.uid)  # before the instances it serves go
                for inst in migs:
                    assert self.mig is not None
                    self.mig.destroy(inst)  # already gone (e.g. after a reboot) is fine
            except (MigError, MpsError) as e:
                results[c.uid] = f"claim {c}: {e}"
                continue
            try:
                cdi.remove_spec(self.cdi_root, self.driver_name, c.uid)
            except OSError as e:
                results[c.uid] = f"claim {c}: cannot remove CDI spec: {e}"
                continue
            if not removed:
                self._maybe_crash("after-unprepare-cdi-removed")
            removed.append(entry)
            results[c.uid] = ""
        if removed or rolled_back:
            remaining = data.without_claims({e.uid for e in removed})
            try:
                self._save(remaining)
            except OSError as e:
                devices = self.inventory.by_name
                for entry in removed:  # still prepared: put its spec back, so the two agree until the retry
                    results[entry.uid] = f"claim {entry.ref}: cannot write checkpoint: {e}"
                    with contextlib.suppress(OSError, ClaimError, cdi.CDISpecInvalid):
                        cdi.write_spec(self.cdi_root, self.driver_name, entry.uid, self._spec_for(entry, devices))
                return results
            self._maybe_crash("after-unprepare-checkpoint-written")
            self._settle_levels(remaining, self.inventory.by_name, removed)
        return results  # successes are logged once, by the gRPC layer, outside the lock

    # ---- devices ----

    def _devices_changed(self, devices: tuple[Device, ...]) -> None:
        """Inventory callback: later prepares see the new set; prepared claims are kept, and reported."""
        new = frozenset(d.name for d in devices)
        old, self._known_devices = self._known_devices, new
        if old is None:
            return
        added, removed = sorted(new - old), sorted(old - new)
        if added or removed:
            log.info("node %s: devices added %s, removed %s", self.node_name, added, removed)
        if not removed:
            return
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
            self._report(CheckpointData())
            if quarantined:  # the forgotten claims' pods may still run: their specs stay for the operator
                orphans = sorted(cdi.claim_spec_uids(self.cdi_root, self.driver_name))
                return RecoveryReport(orphan_specs=orphans, quarantined=quarantined)
            # No checkpoint yet: any MIG instance was made by a prepare that never answered.
            _data, destroyed, _ = self._reconcile_mig(CheckpointData(), self.inventory.by_name)
            self._reconcile_mps(CheckpointData(), self.inventory.by_name)
            try:
                self._apply_timeslices(CheckpointData(), self.inventory.by_name, {
                    d.uuid for d in self.inventory.devices if d.kind == "gpu" and d.uuid}, unknown_default=False)
            except TimeSliceError as e:
                log.error("node %s: cannot reconcile GPU time-slice levels: %s", self.node_name, e)
            return RecoveryReport(orphans_removed=self._remove_orphans(CheckpointData()), mig_destroyed=destroyed)
        rebooted = bool(loaded.boot_id and self.boot_id and loaded.boot_id != self.boot_id)
        data, rolled_back = self._rollback_started(loaded)
        devices = self.inventory.by_name
        before = data
        data, mig_destroyed, mig_recreated = self._reconcile_mig(data, devices)
        try:  # levels set by a prepare that crashed before its checkpoint write, or left by a crashed unprepare
            self._apply_timeslices(data, devices, {d.uuid for d in devices.values() if d.kind == "gpu" and d.uuid},
                                   unknown_default=False)
        except TimeSliceError as e:
            log.error("node %s: cannot reconcile GPU time-slice levels: %s", self.node_name, e)
        self._reconcile_mps(data, devices)
        recreated: list[str] = []
        unrecoverable: dict[str, str] = {}
        for entry in data.claims.values():
            if not rebooted and entry.uid not in mig_recreated \
                    and cdi.spec_exists(self.cdi_root, self.driver_name, entry.uid):
                continue
            try:
                cdi.write_spec(self.cdi_root, self.driver_name, entry.uid, self._spec_for(entry, devices))
            except (ClaimError, cdi.CDISpecInvalid, OSError) as e:
                unrecoverable[entry.uid] = str(e)
                continue
            recreated.append(entry.uid)
        if rebooted or rolled_back or data != before or (self.boot_id and loaded.boot_id != self.boot_id):
            self._save(data)
        else:
            self._report(data)
        return RecoveryReport(rebooted=rebooted, rolled_back=rolled_back, recreated=recreated,
                              unrecoverable=unrecoverable, orphans_removed=self._remove_orphans(data),
                              mig_destroyed=mig_destroyed, mig_recreated=mig_recreated)

    def _remove_orphans(self, data: CheckpointData) -> list[str]:
        """Delete our specs that have no checkpoint entry (call with the node lock held).

        Under the lock, such a spec was left by a prepare that died before its checkpoint
        write, so the kubelet never got an answer and no container uses it (a retry writes
        it again). Only after a quarantined checkpoint do orphans belong to claims in use,
        and that path keeps them.
        """
        removed = sorted(cdi.claim_spec_uids(self.cdi_root, self.driver_name) - set(data.claims))
        for uid in removed:
            cdi.remove_spec(self.cdi_root, self.driver_name, uid)
        return removed

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
        if r.mig_destroyed:
            log.warning("node %s: destroyed MIG instances no prepared claim records: %s", node, r.mig_destroyed)
        if r.mig_recreated:
            log.warning("node %s: re-created lost MIG instances of claims %s", node, r.mig_recreated)
        for uid, why in r.unrecoverable.items():
            log.error("node %s: claim %s: %s", node, uid, why)
        if r.orphans_removed:
            log.warning("node %s: removed CDI specs of claims %s left by a prepare that crashed before its "
                        "checkpoint write (the kubelet got no answer for them)", node, r.orphans_removed)
        if r.orphan_specs:
            log.warning("node %s: CDI specs for claims %s in %s have no checkpoint entry; left in place "
                        "(remove them once no pod uses those claims)", node, r.orphan_specs, self.cdi_root)

    def _report(self, data: CheckpointData) -> None:
        done = [e for e in data.claims.values() if e.state == PREPARE_COMPLETED]
        self.observer.prepared(len(done), sum(len(e.devices) for e in done))


def _to_prepared(entry: ClaimEntry) -> list[PreparedDevice]:
    return [PreparedDevice(request_names=list(d.request_names), pool_name=d.pool_name,
                           device_name=d.device_name, cdi_device_ids=list(d.cdi_device_ids),
                           share_id=d.share_id) for d in entry.devices]
