"""The telemetry sampler: one thread of the kubelet plugin that reads every GPU and compute NIC at an interval.

It never takes the node lock and never blocks prepare or unprepare: the claims it attributes come from the
checkpoint read without the lock (``held``: the file is replaced atomically), the pods from the API server
(``get_claim``, outside any lock, at most once per claim per ``claim_refresh`` seconds), and it publishes an
immutable ``Snapshot`` that the /metrics collector reads. Its only API writes are the idle condition and Events,
on change (``claimstatus``), the per-device summary in the claim's status, on change and at a bounded rate
(``summary``), and, in namespaces that opt in, the evictions of idle claims' pods (``reclaim``, after the sample,
still outside any lock). Any failing read becomes a missing series and a counted error, never an exception out
of the loop.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from topodra.claims import ClaimRef, HeldDevice
from topodra.devices import Device
from topodra.hardware.sysfs import Sysfs
from topodra.inventory import Inventory
from topodra.sharing.instances import MigInstance
from topodra.telemetry import idle as idlerule
from topodra.telemetry.attribution import ClaimInfo, Holder, claim_rows, holders, pods_of
from topodra.telemetry.claimstatus import ClaimStatusWriter, written_idle
from topodra.telemetry.gpureads import GpuReader, GpuReading, MigReader, XidEvents
from topodra.telemetry.ibcounters import PortCounters, read_ports
from topodra.telemetry.reclaim import Reclaimer
from topodra.telemetry.summary import (
    ClaimTrack,
    SummaryData,
    SummaryPolicy,
    slot_of,
    summary_apply,
    written_summaries,
)

log = logging.getLogger(__name__)

Held = Mapping[str, tuple[ClaimRef, frozenset[HeldDevice]]]
HeldMig = Mapping[str, MigInstance]  # device name -> the MIG instance prepare made for it


@dataclass(frozen=True)
class GpuTarget:
    name: str
    uuid: str
    model: str
    bus_id: str


@dataclass(frozen=True)
class NicTarget:
    name: str
    rdma: str


@dataclass(frozen=True)
class MigLabels:
    """What a MIG device's series add: dcgm-exporter's ``GPU_I_ID`` and ``GPU_I_PROFILE`` and the MIG device's
    own UUID (dcgm-exporter's DRA label ``dra_mig_device_uuid``); ``UUID`` stays the parent GPU's, as there."""

    gpu_instance: int
    profile: str
    uuid: str


@dataclass(frozen=True)
class GpuSeries:
    """One GPU, or one MIG device (``mig`` set: ``target`` then names the MIG device and its parent's UUID, model
    and bus id, ``reading`` holds only the per-instance figures)."""

    target: GpuTarget
    index: int | None
    holder: Holder
    reading: GpuReading
    mig: MigLabels | None = None


@dataclass(frozen=True)
class NicSeries:
    target: NicTarget
    holder: Holder
    ports: tuple[PortCounters, ...]


@dataclass(frozen=True)
class ClaimIdle:
    claim: ClaimInfo
    idle: bool
    idle_seconds: float  # how long its GPUs have been below the thresholds (0 when they are not)


@dataclass(frozen=True)
class Snapshot:
    """What the last sample found; the collector exposes it as is."""

    taken_at: float = 0.0
    duration: float = 0.0
    gpus: tuple[GpuSeries, ...] = ()
    nics: tuple[NicSeries, ...] = ()
    claims: tuple[tuple[str, ClaimInfo, str], ...] = ()  # (device name, claim, pod) rows of the info series
    idle: tuple[ClaimIdle, ...] = ()
    errors: Mapping[str, int] = field(default_factory=dict)  # call -> failed reads since start
    xids: Mapping[tuple[str, int], int] = field(default_factory=dict)  # (device name, XID) -> events since start
    samples: int = 0
    api_errors: int = 0
    reclaims: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (namespace, result) -> count
    summary_writes: int = 0


def targets(devices: tuple[Device, ...]) -> tuple[list[GpuTarget], list[NicTarget]]:
    gpus, nics = [], []
    for d in devices:
        a = {k: v.value for k, v in d.attributes.items()}
        if d.kind == "gpu" and isinstance(a.get("uuid"), str):
            gpus.append(GpuTarget(d.name, str(a["uuid"]), str(a.get("model", "")),
                                  str(a.get("resource.kubernetes.io/pciBusID", ""))))
        elif d.kind == "nic" and isinstance(a.get("rdmaDevice"), str):
            nics.append(NicTarget(d.name, str(a["rdmaDevice"])))
    return gpus, nics


@dataclass
class _ClaimCache:
    info: ClaimInfo
    fetched_at: float
    written: bool | None  # the Idle condition's status as the API last showed or we last wrote it
    summaries: Mapping[str, SummaryData] = field(default_factory=dict)  # as the API showed them when first read


class Sampler:
    """``round()`` is one sample; ``start()`` runs rounds every ``interval`` seconds in a thread."""

    def __init__(self, inventory: Inventory, nvml: Any, sysfs: Sysfs, *, pool: str, driver: str,
                 held: Callable[[], Held], get_claim: Callable[[str, str], dict[str, Any] | None] | None = None,
                 held_mig: Callable[[], HeldMig] | None = None,
                 writer: ClaimStatusWriter | None = None, reclaimer: Reclaimer | None = None, interval: float = 10.0,
                 rule: idlerule.IdleRule | None = None, claim_refresh: float = 60.0,
                 clock: Callable[[], float] = time.time, summary_writer: ClaimStatusWriter | None = None,
                 summary_policy: SummaryPolicy | None = None) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.nvml = nvml
        self.sysfs = sysfs
        self.pool = pool
        self.driver = driver
        self.interval = interval
        self.rule = rule or idlerule.IdleRule()
        self.claim_refresh = claim_refresh
        self._held = held
        self._held_mig = held_mig
        self._get_claim = get_claim
        self._writer = writer
        self._reclaimer = reclaimer
        self._summary_writer = summary_writer
        self.summary_policy = summary_policy or SummaryPolicy()
        self._summaries: dict[str, ClaimTrack] = {}
        self.summary_writes = 0
        self._clock = clock
        self._lock = threading.Lock()
        self._devices: tuple[Device, ...] = ()
        self._dirty = True
        self._gpus: list[GpuTarget] = []
        self._nics: list[NicTarget] = []
        self._readers: dict[str, GpuReader] = {}
        self._mig_readers: dict[str, MigReader] = {}  # MIG device UUID -> its reader
        self._xids = XidEvents(nvml)
        self._initialized = False
        self._claims: dict[str, _ClaimCache] = {}
        self._idle: dict[str, idlerule.IdleState] = {}
        self._errors: dict[str, int] = {}
        self._xid_counts: dict[tuple[str, int], int] = {}
        self._samples = 0
        self._api_errors = 0
        self._snapshot = Snapshot()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        inventory.subscribe(self._devices_changed)

    def _devices_changed(self, devices: tuple[Device, ...]) -> None:
        with self._lock:
            self._devices = devices
            self._dirty = True

    @property
    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._snapshot

    # ----- NVML session

    def _reopen(self) -> None:
        with self._lock:
            devices, self._dirty = self._devices, False
        self._close()
        self._gpus, self._nics = targets(devices)
        if not self._gpus:
            return
        try:
            self.nvml.nvmlInit()
        except Exception as e:  # NVMLError, or a binding without a library
            self._count("nvmlInit")
            log.error("telemetry: NVML initialisation failed, GPUs are not sampled: %s", e)
            with self._lock:
                self._dirty = True  # tried again next round
            return
        self._initialized = True
        self._readers = {g.name: GpuReader(self.nvml, g.uuid) for g in self._gpus}
        handles = {}
        for g in self._gpus:
            with contextlib.suppress(Exception):
                handles[g.name] = self.nvml.nvmlDeviceGetHandleByUUID(g.uuid)
        self._xids = XidEvents(self.nvml)
        self._xids.open(handles)

    def _close(self) -> None:
        for r in [*self._readers.values(), *self._mig_readers.values()]:
            r.close()
        self._readers = {}
        self._mig_readers = {}
        self._xids.close()
        if self._initialized:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()
            self._initialized = False

    def _count(self, call: str) -> None:
        self._errors[call] = self._errors.get(call, 0) + 1

    # ----- one round

    def round(self) -> Snapshot:
        started = time.monotonic()
        if self._dirty:
            self._reopen()
        now = self._clock()
        try:
            held = dict(self._held())
        except Exception as e:  # a corrupt checkpoint is the prepare path's to report
            self._count("checkpoint")
            log.warning("telemetry: cannot read the prepared claims: %s", e)
            held = {}
        infos = self._claim_infos(held, now)
        who = holders(held, infos, self.pool)
        gpus = []
        for g in self._gpus:
            reader = self._readers.get(g.name)
            reading = reader.read() if reader is not None else GpuReading(lost=False)
            for call, _err in reading.errors:
                self._count(call)
            gpus.append(GpuSeries(g, reader.index if reader else None, who.get(g.name, Holder()), reading))
        gpus += self._mig_round(who)
        for name, xid in self._xids.drain():
            self._xid_counts[(name, xid)] = self._xid_counts.get((name, xid), 0) + 1
        nics = []
        for n in self._nics:
            holder = who.get(n.name)
            if holder is None:  # only NICs in a claim are sampled ("per compute NIC in a claim")
                continue
            ports, errors = read_ports(self.sysfs, n.rdma)
            for call in errors:
                self._count(call)
            nics.append(NicSeries(n, holder, tuple(ports)))
        idle = self._idle_round(held, infos, {s.target.name: s.reading for s in gpus}, now)
        reclaims: Mapping[tuple[str, str], int] = {}
        api_errors = self._api_errors
        if self._reclaimer is not None:
            try:
                self._reclaimer.round([(c.claim, c.idle, c.idle_seconds) for c in idle])
            except Exception:  # an unexpected reply must not stop sampling
                self._count("reclaim")
                log.exception("telemetry: idle reclaim failed")
            reclaims = dict(self._reclaimer.counts)
            api_errors += self._reclaimer.api_errors
        self._samples += 1
        snap = Snapshot(taken_at=now, duration=time.monotonic() - started, gpus=tuple(gpus), nics=tuple(nics),
                        claims=tuple(claim_rows(held, infos, self.pool)), idle=tuple(idle),
                        errors=dict(self._errors), xids=dict(self._xid_counts), samples=self._samples,
                        api_errors=api_errors, reclaims=reclaims, summary_writes=self.summary_writes)
        with self._lock:
            self._snapshot = snap
        return snap

    def _mig_round(self, who: Mapping[str, Holder]) -> list[GpuSeries]:
        """The MIG devices claims hold (instances exist only while prepared): per-instance reads, one reader per
        MIG device UUID, dropped with its instance."""
        if self._held_mig is None or not self._initialized:
            return []
        try:
            instances = dict(self._held_mig())
        except Exception as e:
            self._count("checkpoint")
            log.warning("telemetry: cannot read the prepared MIG instances: %s", e)
            instances = {}
        with self._lock:
            devices = {d.name: d for d in self._devices}
        parents = {g.uuid: g for g in self._gpus}
        out = []
        for name, inst in sorted(instances.items()):
            parent, dev = parents.get(inst.parent_uuid), devices.get(name)
            if parent is None or dev is None or name not in who:
                continue  # not this node's device, or no longer held
            reader = self._mig_readers.get(inst.uuid)
            if reader is None:
                reader = self._mig_readers[inst.uuid] = MigReader(self.nvml, inst.uuid, inst.parent_uuid,
                                                                  inst.gpu_instance)
            reading = reader.read()
            for call, _err in reading.errors:
                self._count(call)
            profile = dev.attributes.get("profile")
            out.append(GpuSeries(GpuTarget(name, parent.uuid, parent.model, parent.bus_id), reader.index, who[name],
                                 reading, MigLabels(inst.gpu_instance, "" if profile is None else str(profile.value),
                                                    inst.uuid)))
        live = {inst.uuid for inst in instances.values()}
        for uuid in [u for u in self._mig_readers if u not in live]:
            self._mig_readers.pop(uuid).close()
        return out

    def _claim_infos(self, held: Held, now: float) -> dict[str, ClaimInfo]:
        for uid in list(self._claims):
            if uid not in held:
                del self._claims[uid]
                self._idle.pop(uid, None)
        for uid in list(self._summaries):
            if uid not in held:
                del self._summaries[uid]
        out = {}
        for uid, (ref, _devices) in held.items():
            cached = self._claims.get(uid)
            if self._get_claim is not None and (cached is None or now - cached.fetched_at >= self.claim_refresh):
                try:
                    obj = self._get_claim(ref.namespace, ref.name)
                except Exception as e:
                    self._api_errors += 1
                    log.debug("telemetry: cannot read claim %s/%s: %s", ref.namespace, ref.name, e)
                    obj = None
                if obj is not None and (obj.get("metadata") or {}).get("uid") == uid:
                    written = written_idle(obj, self.driver, self.pool)
                    cached = _ClaimCache(ClaimInfo(ref.namespace, ref.name, uid, pods_of(obj)), now,
                                         written if cached is None else cached.written,
                                         written_summaries(obj, self.driver, self.pool) if cached is None
                                         else cached.summaries)
                    self._claims[uid] = cached
            out[uid] = cached.info if cached else ClaimInfo(ref.namespace, ref.name, uid)
        return out

    def _idle_round(self, held: Held, infos: Mapping[str, ClaimInfo], readings: Mapping[str, GpuReading],
                    now: float) -> list[ClaimIdle]:
        out = []
        for uid, (_ref, devices) in held.items():
            gpus = [readings[d] for pool, d, _s in devices if pool == self.pool and d in readings]
            if not gpus:
                continue  # no GPU or MIG device of this node (NICs only): not judged
            levels = [idlerule.GpuLevel(r.activity, r.memory_ratio) for r in gpus]
            is_below = idlerule.below(self.rule, levels)
            state = idlerule.step(self._idle.get(uid, idlerule.IdleState()), is_below, now)
            self._idle[uid] = state
            is_idle = state.idle(self.rule, now)
            info = infos[uid]
            out.append(ClaimIdle(info, is_idle, state.idle_for(now)))
            self._account(uid, info, devices, readings, is_idle, state, now)
            # The condition says True once idle, and False only when a sample was above the thresholds: a restart
            # (the clock starts again) or an unread GPU does not clear what the API shows.
            want = True if is_idle else (False if is_below is False else None)
            if want is not None:
                self._maybe_write(uid, info, [d for d in devices if d[0] == self.pool], want, state.idle_for(now))
        return out

    def _maybe_write(self, uid: str, info: ClaimInfo, devices: list[HeldDevice], is_idle: bool,
                     idle_for: float) -> None:
        cached = self._claims.get(uid)
        if self._writer is None or cached is None:
            return  # nothing known of the claim's status yet: no write on a guess
        if cached.written is is_idle or (cached.written is None and not is_idle):
            return  # unchanged (a claim never flagged needs no "not idle")
        r = self.rule
        if is_idle:
            msg = (f"the claim's GPUs ({', '.join(d for _p, d, _s in devices)}) have been below "
                   f"{r.activity_below:.0%} activity and {r.memory_below:.0%} memory for {idle_for:.0f}s "
                   f"(idle after {r.idle_seconds:.0f}s)")
        else:
            msg = "activity or memory use returned above the idle thresholds"
        try:
            self._writer.write(info.namespace, info.name, uid, devices, is_idle, info.pods, msg)
        except Exception as e:
            self._api_errors += 1
            log.warning("telemetry: cannot write the Idle condition of claim %s/%s: %s", info.namespace,
                        info.name, e)
            return
        cached.written = is_idle
        log.info("telemetry: claim %s/%s %s", info.namespace, info.name, "is idle" if is_idle else "is active again")

    def _account(self, uid: str, info: ClaimInfo, devices: frozenset[HeldDevice],
                 readings: Mapping[str, GpuReading], is_idle: bool, state: idlerule.IdleState, now: float) -> None:
        """Add this sample to the claim's per-device accounts; write its summary when ``write_reason`` says so."""
        mine = {d: share for pool, d, share in devices if pool == self.pool and d in readings}
        st = self._summaries.get(uid)
        if st is None:
            st = self._summaries[uid] = ClaimTrack(slot=slot_of(uid, self.summary_policy))
        if not st.seeded and uid in self._claims:
            st.seed(self._claims[uid].summaries, now)
        p = self.summary_policy
        levels = {}
        for name in mine:
            r = readings[name]
            below = idlerule.below(self.rule, [idlerule.GpuLevel(r.activity, r.memory_ratio)])
            levels[name] = (r.activity, r.memory_ratio, None if below is None else not below)
        summary = st.observe(now, levels, is_idle, state.below_since, p, 3 * self.interval)
        if self._summary_writer is None or uid not in self._claims:
            return  # nothing known of the claim's status yet: wait for the first read
        if st.due(p, summary) is None:
            return
        body = summary_apply(info.namespace, info.name, uid, self.driver, self.pool, summary, p.window, mine)
        try:
            self._summary_writer.apply_summary(info.namespace, info.name, body)
        except Exception as e:
            self._api_errors += 1
            log.warning("telemetry: cannot write the summary of claim %s/%s: %s", info.namespace, info.name, e)
            return
        st.wrote(summary)
        self.summary_writes += 1

    # ----- thread

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="telemetry-sampler", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._close()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.round()
            except Exception:
                self._count("round")
                log.exception("telemetry: a sampling round failed")
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))
