"""Prepare/unprepare of ResourceClaims on this node, crash-safe; local work only (docs/prepare.md).

Both kubelet calls must be idempotent, answer every claim, and survive crashes, restarts and reboots.
This module owns the batch (group commit: calls queued behind the lock are served together, with one
checkpoint write), the locks (a process lock and ``flock(<state_dir>/serialize.lock)``, so two plugin
processes never interleave; the checkpoint is re-read under them), the checkpoint/CDI IO and one loop
over the GPU effects (``effects``).  Planning is ``claimplan``'s, recovery's rules ``recovery``'s.

The checkpoint write is the commit point: prepare applies effects in order, writes the CDI specs (not
fsynced), then the checkpoint; unprepare removes the specs, writes the checkpoint, then undoes effects in
reverse.  So the checkpoint never records state that does not exist; a crash leaves at most specs and
effects no entry records, which recovery removes (after a reboot it re-makes what entries record).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from topodra import cdi, checkpoint, claimplan, crashpoints, effects, recovery
from topodra.atomicfile import Sync
from topodra.checkpoint import PREPARE_COMPLETED, PREPARE_STARTED, CheckpointCorrupt, CheckpointData, ClaimEntry
from topodra.claimplan import Planned, PreparedDevice, PrepareResult
from topodra.claims import ClaimError, ClaimRef, FetchedClaim, HeldDevice, held_by
from topodra.crashpoints import CRASH_EXIT_CODE, CRASH_POINTS
from topodra.devices import Device
from topodra.effects import GpuEffect
from topodra.effects.base import OutsideLock
from topodra.filelock import FileLock, LockTimeout
from topodra.hostdriver import HostDriver
from topodra.inventory import Inventory
from topodra.observe import NO_OBSERVER, Observer
from topodra.recovery import RecoveryReport
from topodra.sharing.instances import MigInstance

__all__ = ["CRASH_EXIT_CODE", "CRASH_POINTS", "DeviceState", "PrepareResult", "PreparedDevice", "RecoveryReport"]

log = logging.getLogger(__name__)

DEFAULT_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
LOCK_FILE = "serialize.lock"
KEPT = "kept: prepared again after the cleanup pass read its ResourceClaim"


@dataclass(frozen=True)
class _Release(ClaimRef):
    """A claim the cleanup pass releases: kept if a prepare answered it after ``since`` (``prepare_mark``)."""

    since: int = 0

T = TypeVar("T")
Item = TypeVar("Item", ClaimRef, FetchedClaim)


@dataclass
class _Call(Generic[Item, T]):
    """One caller's claims waiting for the node lock; ``results`` is set by whoever serves it."""

    items: Sequence[Item]
    results: dict[str, T] | None = None


class DeviceState:
    """The node's prepared claims: checkpoint + CDI specs, serialized across processes."""

    def __init__(self, driver_name: str, node_name: str, inventory: Inventory, cdi_root: str | os.PathLike[str],
                 state_dir: str | os.PathLike[str], boot_id_path: str = DEFAULT_BOOT_ID_PATH,
                 crash_point: str | None = None, *,
                 nvidia_spec_dirs: Sequence[str | os.PathLike[str]] = cdi.DEFAULT_SPEC_DIRS,
                 quarantine_corrupt: bool = False, lock_timeout: float | None = 20.0,
                 observer: Observer = NO_OBSERVER, gpu_effects: Sequence[GpuEffect] | None = None,
                 host_driver: HostDriver | None = None) -> None:
        """Load the checkpoint and recover; raises ``CheckpointCorrupt`` unless ``quarantine_corrupt``.

        ``gpu_effects``: the GPU side effects of a prepare, in apply order (default ``effects.standard``:
        no NVML access, so claims on MIG devices or with time-slice levels fail; MPS from PATH).
        ``host_driver``: the node's NVIDIA driver files for containers (``hostdriver``; None on mock hardware).
        """
        self.effects = tuple(gpu_effects) if gpu_effects is not None else effects.standard(state_dir)
        # isinstance against a runtime-checkable Protocol walks every attribute of the class (~100 µs per
        # prepare for three effects on Python 3.11): the effects are fixed, so it is checked once.
        self._api_effects = tuple(e for e in self.effects if isinstance(e, OutsideLock))
        self.plans = claimplan.Planner(self.effects, driver_name, node_name, host_driver)
        self.driver_name = driver_name
        self.node_name = node_name
        self.pool_name = node_name
        self.inventory = inventory
        self.cdi_root = Path(cdi_root)
        self.state_dir = Path(state_dir)
        self.checkpoint_path = self.state_dir / checkpoint.FILE_NAME
        self.toolkit_ids = cdi.ToolkitIds(nvidia_spec_dirs, driver_name, node_name)
        self.observer = observer
        self._checkpoint_cache: checkpoint.LoadCache = {}
        self.crash_point = crashpoints.chosen(crash_point)
        self._lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._queues: dict[str, list[_Call[Any, Any]]] = {"prepare": [], "unprepare": []}
        self._prepares = 0  # prepare sections served (under the lock); _answered: uid -> the last that answered it
        self._answered: dict[str, int] = {}
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.cdi_root.mkdir(parents=True, exist_ok=True)
        self._flock = FileLock(self.state_dir / LOCK_FILE, timeout=lock_timeout)
        self.boot_id = recovery.read_boot_id(boot_id_path)
        self._known_devices: frozenset[str] | None = None
        self.last_recovery = self.recover(quarantine_corrupt=quarantine_corrupt)
        inventory.subscribe(self._devices_changed)

    # ---- public API ----

    def prepare(self, claims: Sequence[FetchedClaim]) -> dict[str, PrepareResult]:
        """Prepare a batch (UIDs unique); one result per claim UID (errors per claim, never raised)."""
        if not claims:
            return {}
        results = self._batch("prepare", claims, lambda c: c.ref, self._prepare_counted,
                              lambda e: PrepareResult([], e))
        ok = [uid for uid, r in results.items() if not r.error]
        for uid, err in self._after_prepare(ok).items():
            results[uid] = PrepareResult([], err)
        return results

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """Unprepare a batch; uid → "" on success (also for unknown claims) or an error."""
        if not claims:
            return {}
        results = self._batch("unprepare", claims, lambda c: c, self._unprepare_locked, lambda e: e)
        for effect in self._outside_lock():
            for uid, err in effect.after_unprepare().items():
                if results.get(uid) == "":  # another call's leftover is reported by that call's retry
                    results[uid] = err
        for effect in self._outside_lock():  # what a failure left behind and no process will remove
            effect.sweep(self._recorded_uids, force=any(results.values()))
        return results

    # ---- the effects' halves that talk to the API server: after the node lock ----

    def _outside_lock(self) -> list[OutsideLock]:
        return [e for e in self._api_effects if e.outside_lock]

    def _recorded_uids(self) -> set[str]:
        """The claims the checkpoint records now (read without the lock: it is replaced atomically)."""
        return set(self._load().claims)

    def _after_prepare(self, uids: Sequence[str]) -> dict[str, str]:
        """Let effects finish the prepared claims ``uids`` outside the lock (the checkpoint is read without it:
        it is replaced atomically, and a claim unprepared meanwhile is simply not found)."""
        effects_ = self._outside_lock()
        if not effects_ or not uids:
            return {}
        data = self._load()
        entries = [data.claims[u] for u in uids if u in data.claims]
        errors: dict[str, str] = {}
        for effect in effects_:
            errors.update(effect.after_prepare(entries, self.inventory.by_name))
        return errors

    def checkpointed_claims(self) -> list[ClaimRef]:
        """The claims in the checkpoint now, read without the lock (the file is replaced atomically)."""
        data = self._load()
        return [ClaimRef(namespace=e.namespace, uid=e.uid, name=e.name) for e in data.claims.values()]

    def held_devices(self) -> dict[str, tuple[ClaimRef, frozenset[HeldDevice]]]:
        """uid → (claim, the (pool, device, shareID) it holds) for each checkpointed claim, read without the lock."""
        return {e.uid: (ClaimRef(namespace=e.namespace, uid=e.uid, name=e.name), held_by(e))
                for e in self._load().claims.values()}

    def held_mig(self) -> dict[str, MigInstance]:
        """device name → the MIG instance prepare made for it, for each complete instance in the checkpoint, read
        without the lock (the telemetry sampler's per-instance reads)."""
        return {d.device_name: d.mig for e in self._load().claims.values() for d in e.devices
                if d.mig is not None and d.mig.uuid and d.mig.compute_instance is not None}

    def prepare_mark(self) -> int:
        """Take before reading claims for ``cleanup(..., since=)``: prepares answered later keep their claims."""
        return self._prepares

    def cleanup(self, stale: Sequence[ClaimRef], since: int | None = None) -> tuple[dict[str, str], list[str]]:
        """Unprepare ``stale`` claims (the caller read their ResourceClaims outside the lock: deleted, replaced
        or released, ``claims.release_reason``) and delete orphan specs; returns the unprepare answers and the
        orphan UIDs removed.  ``since``: the ``prepare_mark()`` taken before those reads; a claim that a prepare
        of this process answered after it is kept (an allocation can come back between the read and now), and
        left out of the answers."""
        refs: Sequence[ClaimRef] = stale if since is None else [
            _Release(namespace=r.namespace, uid=r.uid, name=r.name, since=since) for r in stale]
        answers = self.unprepare(refs)
        for uid in [u for u, err in answers.items() if err == KEPT]:
            del answers[uid]
            log.info("node %s: claim uid=%s was prepared again after the cleanup read; kept", self.node_name, uid)
        with self._lock, self._node_locked("cleanup"):
            orphans = self._remove_orphans(self._load())
        if orphans:
            log.warning("node %s: removed orphan CDI specs of claims %s", self.node_name, orphans)
        return answers, orphans

    def recover(self, quarantine_corrupt: bool = False) -> RecoveryReport:
        """Make the checkpoint, the CDI directory and the GPUs agree again after a crash, restart or reboot."""
        with self._lock, self._node_locked("recover"):
            report = self._recover_locked(quarantine_corrupt)
        recovery.log_report(self.node_name, self.cdi_root, report)
        for effect in self._outside_lock():  # stopped strays' leftovers; recorded claims' daemons made again
            for uid, err in effect.after_unprepare().items():
                log.error("node %s: claim %s: %s", self.node_name, uid, err)
            effect.sweep(self._recorded_uids, force=True)  # what an earlier process left (stray daemon pods)
        for uid, err in self._after_prepare(list(self._load().claims)).items():
            log.error("node %s: recovery: %s (claim %s)", self.node_name, err, uid)
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
        """Write the checkpoint before its answer goes to the kubelet (docs/prepare.md, *Durability*).

        Every version on disk is complete (data fsynced before the rename); ``"durable"`` also fsyncs the
        directory.  Prepare's and unprepare's writes are ``"data"``, like the Go driver's one fsync per call:
        the rename may be lost only with a power loss or kernel crash, i.e. a reboot.  After a reboot the
        kubelet prepares the claims of the pods it starts again (v1.37.2 pkg/kubelet/cm/dra/claiminfo.go
        ``newClaimInfoFromState``), so a lost prepare is repeated with the same answer; an unprepare it saw
        succeed is never repeated, but the entry it leaves is of a claim whose allocation the resourceclaim
        controller clears (or whose ResourceClaim is deleted) once its pods are done, and the cleanup pass
        at start and every interval releases those (``claims.release_reason``).  Recovery's writes stay
        ``"durable"`` (rare; docs/prepare.md, *Durability*).
        """
        # An unreadable boot ID must not erase the one recorded (reboot detection would be lost).
        boot_id = self.boot_id or data.boot_id
        if boot_id != data.boot_id:
            data = data.model_copy(update={"boot_id": boot_id})
        checkpoint.save(self.checkpoint_path, data, sync=sync, cache=self._checkpoint_cache)
        self._report(data)

    def _maybe_crash(self, point: str) -> None:
        crashpoints.reached(self.crash_point, point)

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

    def _prepare_counted(self, claims: Sequence[FetchedClaim]) -> dict[str, PrepareResult]:
        """``_prepare_locked``, and which claims it answered (under the lock, for ``cleanup``'s ``since``)."""
        results = self._prepare_locked(claims)
        self._prepares += 1
        for uid, r in results.items():
            if not r.error:
                self._answered[uid] = self._prepares
        return results

    def _prepare_locked(self, claims: Sequence[FetchedClaim]) -> dict[str, PrepareResult]:
        data, rolled_back = self._rollback_started(self._load())
        devices = self.inventory.by_name
        results: dict[str, PrepareResult] = {}
        fresh, repeats = self.plans.batch(claims, data, devices, self._nvidia_ids, results)
        for entry in repeats:
            results[entry.uid] = self._answer_existing(entry, devices)
        if not fresh:
            if rolled_back:
                self._save(data)
            return results
        fresh = self._apply_effects(fresh, data, devices, results)

        # Specs first (not fsynced), then one checkpoint write (data fsynced) with the claims completed.
        # A crash in between leaves only orphan specs and effects no entry records, which recovery removes.
        self._maybe_crash("prepare-before-write")
        completed = data
        written: list[tuple[ClaimRef, ClaimEntry]] = []
        failed: list[ClaimEntry] = []
        for n, (ref, entry, spec) in enumerate(fresh):
            if n == 1:
                self._maybe_crash("prepare-mid-cdi")
            try:
                cdi.write_spec(self.cdi_root, self.driver_name, ref.uid, spec)
            except OSError as e:
                with contextlib.suppress(OSError):
                    cdi.remove_spec(self.cdi_root, self.driver_name, ref.uid)
                failed.append(entry)
                results[ref.uid] = PrepareResult([], f"claim {ref}: cannot write CDI spec: {e}")
                continue
            completed = completed.with_claim(entry)
            written.append((ref, entry))
        self._maybe_crash("after-cdi-written")
        self._undo(failed, completed, devices)
        if not written:
            if rolled_back:
                self._save(data)
            return results

        try:
            self._save(completed, sync="data")  # see _save: the kubelet repeats it after a reboot
        except OSError as e:
            for ref, _entry in written:
                with contextlib.suppress(OSError):
                    cdi.remove_spec(self.cdi_root, self.driver_name, ref.uid)
                results[ref.uid] = PrepareResult([], f"claim {ref}: cannot write checkpoint: {e}")
            self._undo([e for _r, e in written], data, devices)
            return results
        self._maybe_crash("after-checkpoint-written")
        for ref, done in written:  # logged once, by the gRPC layer, outside the lock
            results[ref.uid] = PrepareResult(claimplan.prepared_devices(done))
        return results

    def _apply_effects(self, fresh: list[Planned], data: CheckpointData, devices: Mapping[str, Device],
                       results: dict[str, PrepareResult]) -> list[Planned]:
        """Each effect in order over the batch (so a crash point holds for all of it); a claim one fails
        gets the earlier ones undone, in reverse.  ``applied``: the claims whose effects exist now."""
        applied = data
        for i, effect in enumerate(self.effects):
            kept: list[Planned] = []
            used = False
            for ref, entry, spec in fresh:
                if not effect.used_by(entry, devices):
                    kept.append((ref, entry, spec))
                    continue
                used, done, new = True, i, entry
                try:
                    new = effect.apply(entry, applied, devices)
                    done = i + 1
                    if new != entry:  # it recorded something the spec shows (a MIG UUID)
                        spec = self.plans.spec(new, devices)
                except (ClaimError, cdi.CDISpecInvalid) as e:
                    applied = applied.without_claims({entry.uid})
                    self._undo([new], applied, devices, self.effects[:done])
                    claimplan.refuse(results, ref, e, self.node_name)
                    continue
                applied = applied.with_claim(new)
                kept.append((ref, new, spec))
            fresh = kept
            if used and effect.crash_point is not None:
                self._maybe_crash(effect.crash_point)
        return fresh

    def _undo(self, entries: Sequence[ClaimEntry], final: CheckpointData, devices: Mapping[str, Device],
              which: Sequence[GpuEffect] | None = None) -> None:
        """Undo the effects (all, or ``which``) of ``entries``, in reverse order; ``final``: what stays."""
        if entries:
            for effect in reversed(self.effects if which is None else which):
                effect.undo(entries, final, devices)

    def _answer_existing(self, entry: ClaimEntry, devices: Mapping[str, Device]) -> PrepareResult:
        """Idempotent repeat: the stored answer, with the CDI spec re-created if it went missing."""
        if not cdi.spec_exists(self.cdi_root, self.driver_name, entry.uid):
            try:
                cdi.write_spec(self.cdi_root, self.driver_name, entry.uid, self.plans.spec(entry, devices))
            except (ClaimError, cdi.CDISpecInvalid, OSError) as e:
                log.error("node %s: claim %s: %s", self.node_name, entry.ref, e)
                return PrepareResult([], f"claim {entry.ref}: already prepared but its CDI spec is missing "
                                         f"and cannot be re-created: {e}")
            log.warning("node %s: re-created missing CDI spec of prepared claim %s",
                        self.node_name, entry.ref)
        log.info("node %s: claim %s already prepared", self.node_name, entry.ref)
        return PrepareResult(claimplan.prepared_devices(entry))

    def _nvidia_ids(self) -> dict[str, str]:
        return self.toolkit_ids(self.inventory.devices)

    # ---- unprepare ----

    def _unprepare_locked(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """Specs removed, checkpoint written without the claims, then effects undone: the checkpoint never
        records an instance or daemon that is gone.  If the write fails nothing was undone and the spec
        goes back; if the process dies after it, what is left no entry records, and recovery removes it."""
        data, rolled_back = self._rollback_started(self._load())
        results: dict[str, str] = {}
        removed: list[ClaimEntry] = []
        for c in claims:
            entry = data.claims.get(c.uid)
            if isinstance(c, _Release) and self._answered.get(c.uid, 0) > c.since:
                results[c.uid] = KEPT
                continue
            if entry is None:
                self._answered.pop(c.uid, None)
                results[c.uid] = ""
                log.info("node %s: claim %s not prepared here (or already unprepared); nothing to do",
                         self.node_name, c)
                continue
            blocker = next((b for b in (e.release_blocker(entry) for e in self.effects) if b), None)
            if blocker is not None:
                results[c.uid] = blocker
                continue
            try:
                cdi.remove_spec(self.cdi_root, self.driver_name, c.uid)
            except OSError as e:
                results[c.uid] = f"claim {c}: cannot remove CDI spec: {e}"
                continue
            if not removed:
                self._maybe_crash("after-unprepare-cdi-removed")
            removed.append(entry)
            self._answered.pop(c.uid, None)
            results[c.uid] = ""
        if removed or rolled_back:
            remaining = data.without_claims({e.uid for e in removed})
            devices = self.inventory.by_name
            try:
                self._save(remaining, sync="data")  # see _save: a lost rename is released by the cleanup pass
            except OSError as e:
                for entry in removed:  # still prepared, its effects untouched: its spec goes back
                    results[entry.uid] = f"claim {entry.ref}: cannot write checkpoint: {e}"
                    with contextlib.suppress(OSError, ClaimError, cdi.CDISpecInvalid):
                        cdi.write_spec(self.cdi_root, self.driver_name, entry.uid, self.plans.spec(entry, devices))
                return results
            self._maybe_crash("after-unprepare-checkpoint-written")
            self._undo(removed, remaining, devices)
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
        for ref, gone in claimplan.users_of(data, set(removed)):
            log.warning("node %s: prepared claim %s uses devices %s that are no longer present",
                        self.node_name, ref, gone)

    # ---- recovery ----

    def _recover_locked(self, quarantine_corrupt: bool) -> RecoveryReport:
        for p in checkpoint.clean_temps(self.state_dir) + cdi.clean_temps(self.cdi_root, self.driver_name):
            log.info("node %s: removed temp file %s left by a crashed write", self.node_name, p)
        try:
            loaded = checkpoint.load(self.checkpoint_path)
        except CheckpointCorrupt:
            if not quarantine_corrupt:
                raise
            self._report(CheckpointData())  # the forgotten claims' pods may still run: their specs stay
            return RecoveryReport(orphan_specs=sorted(cdi.claim_spec_uids(self.cdi_root, self.driver_name)),
                                  quarantined=str(checkpoint.quarantine(self.checkpoint_path)))
        # No checkpoint yet: any effect found was made by a prepare that never answered.
        rebooted = bool(loaded and loaded.boot_id and self.boot_id and loaded.boot_id != self.boot_id)
        before, rolled_back = self._rollback_started(loaded or CheckpointData())
        devices = self.inventory.by_name
        data, done = recovery.reconcile(self.effects, before, devices)
        recreated: list[str] = []
        unrecoverable: dict[str, str] = {}
        for uid in recovery.specs_to_write(before, data, rebooted,
                                           lambda u: cdi.spec_exists(self.cdi_root, self.driver_name, u)):
            try:
                cdi.write_spec(self.cdi_root, self.driver_name, uid, self.plans.spec(data.claims[uid], devices))
            except (ClaimError, cdi.CDISpecInvalid, OSError) as e:
                unrecoverable[uid] = str(e)
                continue
            recreated.append(uid)
        if recovery.must_save(loaded, data, before, bool(rolled_back), self.boot_id):
            self._save(data)
        else:
            self._report(data)
        return RecoveryReport(rebooted=rebooted, rolled_back=rolled_back, recreated=recreated,
                              unrecoverable=unrecoverable, orphans_removed=self._remove_orphans(data),
                              stray={n: r.stray for n, r in done.items() if r.stray},
                              remade={n: r.remade for n, r in done.items() if r.remade})

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

    def _report(self, data: CheckpointData) -> None:
        done = [e for e in data.claims.values() if e.state == PREPARE_COMPLETED]
        self.observer.prepared(len(done), sum(len(e.devices) for e in done))

