"""ClaimProfile reconciliation: kopf handlers plus a periodic availability refresh.

The work is done by plain synchronous functions on a ``Kube`` client
(``reconcile``, ``process``, ``refresh_all``), so it can be tested against a
fake API and reused by the refresh loop; the kopf handlers are thin wrappers
that kopf runs in its thread pool, with its watch, retries and backoff.

Idempotent by construction: the template's name is the profile's and it
carries a hash of its spec, so a restart or a second pass finds the template
current and writes nothing.  ResourceClaimTemplates are immutable, so a changed
hash means delete + create; claims already made from the old template keep
working.  Deletion relies on the owner reference (garbage collection) and
also deletes explicitly when the controller sees it, without a finalizer, so
profiles are never stuck when the controller is down.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Protocol

from topodra import DEFAULT_DRIVER_NAME
from topodra.apipaths import (
    PROFILE_GROUP,
    PROFILE_PLURAL,
    PROFILE_VERSION,
    claim_path,
    device_class_path,
    device_taint_rule_path,
    event_path,
    node_path,
    pod_path,
    profile_path,
    slices_path,
    template_path,
)
from topodra.controller import gang
from topodra.controller.availability import (
    AlternativeStatus,
    Snapshot,
    host_resources,
    make_snapshot,
    profile_availability,
)
from topodra.controller.cpucheck import CpuReadiness, CpuSettings, readiness
from topodra.controller.hostfit import pod_shape
from topodra.controller.kueue import class_models_from, queueing_status
from topodra.controller.profile import API_VERSION, KIND, ClaimProfile, ProfileError
from topodra.controller.render import (
    DEFAULT_NIC_CLASS,
    HASH_ANNOTATION,
    MANAGED_BY,
    PROFILE_LABEL,
    device_class_names,
    render_template,
    reserves,
)
from topodra.controller.reserve import delete_rules_of, reconcile_reservations
from topodra.fleet.hostres import HostResources
from topodra.informer import gc_paused
from topodra.kube import Kube, KubeError, load_configuration

log = logging.getLogger(__name__)

Obj = dict[str, Any]

INVALID_REASONS = {"InvalidSpec", "UnknownDeviceClass", "TemplateConflict"}
# The kopf handlers and the refresh loop may reach one profile at once; passes are short, so serialize them.
_PROCESS_LOCK = threading.Lock()


@dataclass(frozen=True)
class ControllerConfig:
    driver: str = DEFAULT_DRIVER_NAME
    nic_class: str = DEFAULT_NIC_CLASS
    namespaces: tuple[str, ...] = ()  # empty: all namespaces
    refresh_interval_s: float = 30.0
    snapshot_ttl_s: float = 10.0
    cpu: CpuSettings = field(default_factory=CpuSettings)  # alignCpus (controller/cpucheck.py)
    # Reservations (issue 33, controller/reserve.py): on/off cluster-wide, and the defaults a profile's
    # ``reservation`` does not state.
    reservations: bool = True
    reservation_after_s: float = 900.0
    reservation_max_hold_s: float = 86400.0  # docs/multi-node.md: the measured drains take 8-12 h
    max_reservations: int = 2
    reservation_grace_s: float = 900.0  # a hold with a known expected start ends this long after it
    reservation_cooldown_s: float = 1800.0  # after an expired hold, before the same wait may reserve again
    # a narrower level of ``sameDomain`` is held only if it starts at most this much later (docs/multi-node.md)
    reservation_narrower_within_s: float = 1800.0


@dataclass(frozen=True)
class Outcome:
    """The result of one reconcile pass, turned into conditions and events."""

    ok: bool
    reason: str
    message: str
    template_name: str | None = None
    template_hash: str | None = None
    action: str = "unchanged"  # created | replaced | unchanged | none
    cpu: CpuReadiness | None = None  # profiles with alignCpus


# Pods that hold node CPU and memory: bound and not finished (the scheduler's cache holds the same; the
# selector only trims the list, ``fleet.hostres`` drops terminal and unbound pods itself).
HOLDING_PODS = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"


class Facts(Protocol):
    """Where a pass reads its Snapshot: ``SnapshotCache`` (lists, rate-limited) or ``controller.facts``'s
    ``WatchedFacts`` (watches; what ``topodra controller`` runs)."""

    def get(self, kube: Kube, host: bool = False) -> Snapshot | str: ...


@dataclass
class _Slot:
    """One cached read: its value (or why it failed), when it was read, and the read in flight."""

    value: Any = "not read yet"
    at: float = -1e18
    loading: threading.Event | None = None


class SnapshotCache:
    """Cluster facts for availability, re-read at most once per ``ttl`` (rate limit).

    The controller itself keeps them watched (``controller.facts.WatchedFacts``): at 2,048 nodes a re-read
    decodes ~24 MiB of JSON per pass. This listing cache stays for one-shot callers and tests.

    Two reads: the base (slices, claims, classes, nodes, DeviceTaintRules) for every profile, and the bound
    pods, only when a profile states its pods' CPU/memory (``controller/hostfit.py``): the pod list is the
    biggest one, so clusters without such profiles never pay for it.  The lock guards only the slots; the
    lists run outside it, one caller reads while the others wait on its Event (a read is never doubled).
    """

    def __init__(self, cfg: ControllerConfig, clock: Any = time.monotonic) -> None:
        self._cfg = cfg
        self._clock = clock
        self._lock = threading.Lock()
        self._base = _Slot()
        self._pods = _Slot()

    def get(self, kube: Kube, host: bool = False) -> Snapshot | str:
        """A snapshot, or why it could not be read (e.g. RBAC forbids listing claims).

        ``host``: with the free CPU and memory of each node (``Snapshot.host``); when the pods cannot be read
        the snapshot has no host view and ``host_error`` says why."""
        base = self._fresh(self._base, lambda: self._read_base(kube))
        if isinstance(base, str):
            return base
        snap: Snapshot = base[0]
        nodes: list[Obj] = base[1]
        if not host:
            return snap
        pods = self._fresh(self._pods, lambda: self._read_pods(kube, nodes))
        if isinstance(pods, str):
            return replace(snap, host_error=pods)
        return replace(snap, host=pods[0], pods=pods[1])

    def _fresh(self, slot: _Slot, read: Any) -> Any:
        with self._lock:
            if self._clock() - slot.at < self._cfg.snapshot_ttl_s:
                return slot.value
            wait, mine = slot.loading, None
            if wait is None:
                slot.loading = mine = threading.Event()
        if wait is not None:  # another thread is reading: wait for it, holding no lock
            wait.wait(60)
            with self._lock:
                return slot.value
        assert mine is not None
        try:
            value = read()
            with self._lock:
                slot.value, slot.at = value, self._clock()
            return value
        finally:  # an unexpected error propagates, as before, and the next caller reads again
            with self._lock:
                slot.loading = None
            mine.set()

    def _read_base(self, kube: Kube) -> tuple[Snapshot, list[Obj]] | str:
        with gc_paused():  # the decode's collections were half of a 2,048-node pass (informer.gc_paused)
            return self._list_base(kube)

    def _list_base(self, kube: Kube) -> tuple[Snapshot, list[Obj]] | str:
        try:
            slices = list(kube.list(slices_path(), field_selector=f"spec.driver={self._cfg.driver}"))
            claims = list(kube.list(claim_path()))
            classes = list(kube.list(device_class_path()))
            try:
                nodes = list(kube.list(node_path()))
            except KubeError as e:  # without node access, every node counts as schedulable
                log.warning("availability: cannot list nodes (%s); taints and cordons are ignored", e)
                nodes = []
            try:
                rules = list(kube.list(device_taint_rule_path()))
            except KubeError as e:  # no DeviceTaintRule API or no grant: slice taints still count
                log.warning("availability: cannot list DeviceTaintRules (%s); only slice taints count", e)
                rules = []
            return make_snapshot(slices, claims, classes, self._cfg.driver, nodes, rules), nodes
        except KubeError as e:
            why = f"cannot read cluster state: {e}"
            log.warning("availability: %s", why)
            return why

    def _read_pods(self, kube: Kube, nodes: list[Obj]) -> tuple[HostResources, tuple[Obj, ...]] | str:
        try:
            pods = list(kube.list(pod_path(), field_selector=HOLDING_PODS))
        except KubeError as e:  # no grant to list pods: fit counts devices only, and the status says so
            why = f"cannot list pods ({e}); free CPU and memory are not counted"
            log.warning("availability: %s", why)
            return why
        return host_resources(nodes, pods), tuple(pods)


def _owned_by_profile(tmpl: Obj, profile: ClaimProfile) -> bool:
    meta = tmpl.get("metadata") or {}
    if any(ref.get("uid") == profile.metadata.uid and ref.get("kind") == "ClaimProfile"
           for ref in meta.get("ownerReferences") or []):
        return True
    labels = meta.get("labels") or {}
    # A previous incarnation of a profile with this name (deleted and re-created before GC ran).
    return labels.get(MANAGED_BY[0]) == MANAGED_BY[1] and labels.get(PROFILE_LABEL) == profile.metadata.name


def reconcile(kube: Kube, body: Obj, cfg: ControllerConfig, alternative: str | None = None) -> Outcome:
    """Validate the profile and make its template current.  Raises KubeError on API failures.

    ``alternative``: render only that one (a multi-node profile's choice for the whole gang, controller/gang.py).
    """
    meta = body.get("metadata") or {}
    who = f"{meta.get('namespace')}/{meta.get('name')}"
    try:
        profile = ClaimProfile.from_api(body)
        if alternative is not None:
            profile = gang.restricted(profile, alternative)
        tmpl = render_template(profile, driver=cfg.driver, nic_class=cfg.nic_class,
                               reservations_on=cfg.reservations)
    except ProfileError as e:
        return Outcome(False, "InvalidSpec", str(e))
    cpu = readiness(kube, profile, cfg.cpu, cfg.driver)
    if cpu is not None:
        if not cpu.ok:
            return Outcome(False, cpu.reason, cpu.message, cpu=cpu)
        tmpl = render_template(profile, driver=cfg.driver, nic_class=cfg.nic_class, cpu=cpu.options,
                               reservations_on=cfg.reservations)
    return replace(_reconcile_template(kube, profile, tmpl, cfg, who), cpu=cpu)


def _reconcile_template(kube: Kube, profile: ClaimProfile, tmpl: Obj, cfg: ControllerConfig, who: str) -> Outcome:
    wanted = device_class_names(profile, cfg.nic_class)
    missing = [c for c in wanted if kube.get(device_class_path(c)) is None]
    if missing:
        return Outcome(False, "UnknownDeviceClass",
                       f"DeviceClass {', '.join(missing)} does not exist; install it (see deviceclasses/) "
                       "or fix spec.alternatives[].deviceClassName")
    ns, name = profile.metadata.namespace, profile.metadata.name
    new_hash = tmpl["metadata"]["annotations"][HASH_ANNOTATION]
    existing = kube.get(template_path(ns, name))
    action = "created"
    if existing is not None:
        if not _owned_by_profile(existing, profile):
            return Outcome(False, "TemplateConflict",
                           f"ResourceClaimTemplate {ns}/{name} exists and is not managed by this profile; "
                           "rename the profile or delete that template")
        if ((existing.get("metadata") or {}).get("annotations") or {}).get(HASH_ANNOTATION) == new_hash:
            return Outcome(True, "TemplateReady", f"ResourceClaimTemplate {name} is current", name, new_hash)
        uid = existing["metadata"].get("uid")
        kube.request("DELETE", template_path(ns, name), {"preconditions": {"uid": uid}} if uid else None)
        log.info("profile %s: deleted outdated ResourceClaimTemplate (hash %s -> %s)", who,
                 existing["metadata"].get("annotations", {}).get(HASH_ANNOTATION), new_hash)
        action = "replaced"
    kube.create(template_path(ns), tmpl)
    log.info("profile %s: %s ResourceClaimTemplate %s (hash %s)", who, action, name, new_hash)
    return Outcome(True, "TemplateReady", f"ResourceClaimTemplate {name} {action}", name, new_hash, action)


def _condition(existing: list[Obj], ctype: str, status: str, reason: str, message: str, generation: int,
               now: str) -> Obj:
    old = next((c for c in existing if c.get("type") == ctype), None)
    since = old.get("lastTransitionTime") if old and old.get("status") == status else None
    return {"type": ctype, "status": status, "reason": reason, "message": message[:1024],
            "observedGeneration": generation, "lastTransitionTime": since or now}


def build_status(existing: Obj | None, outcome: Outcome, generation: int,
                 alternatives: list[AlternativeStatus] | None, availability_note: str, now: datetime) -> Obj:
    """The full ``status`` for a profile (pure).  Transition times survive unchanged conditions."""
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    conds = list((existing or {}).get("conditions") or [])
    invalid = outcome.reason in INVALID_REASONS
    status: Obj = {
        "observedGeneration": generation,
        "conditions": [
            _condition(conds, "Ready", "True" if outcome.ok else "False", outcome.reason, outcome.message,
                       generation, stamp),
            _condition(conds, "Invalid", "True" if invalid else "False",
                       outcome.reason if invalid else "Valid", outcome.message if invalid else "",
                       generation, stamp),
        ],
        "lastRefresh": stamp,
        "message": availability_note,
        "templateName": outcome.template_name,
        "templateHash": outcome.template_hash,
    }
    if alternatives is not None:
        status["alternatives"] = [a.to_api() for a in alternatives]
    status["cpuAlignment"] = outcome.cpu.to_api() if outcome.cpu is not None else None
    if outcome.cpu is not None:
        status["conditions"].append(_condition(conds, "CpusAligned", "True" if outcome.cpu.aligned else "False",
                                               outcome.cpu.reason, outcome.cpu.message, generation, stamp))
    return status


def availability_note(alternatives: list[AlternativeStatus] | None, snapshot_error: str,
                      host_error: str = "") -> str:
    if alternatives is None:
        return snapshot_error
    unknown = [f"{a.name}: {a.message}" for a in alternatives if not a.known]
    fitting = [a.name for a in alternatives if a.known and (a.nodes_fit or 0) > 0]
    note = f"fits now: {', '.join(fitting) if fitting else 'none'}"
    # Why the scheduler falls back (or cannot place a claim at all): every known alternative ranked
    # above the first one that fits, with its reason.
    skipped: list[str] = []
    for a in alternatives:
        if a.known and (a.nodes_fit or 0) > 0:
            break
        if a.known:
            skipped.append(f"{a.name}: {a.message}")
    if skipped:
        note += f" ({'; '.join(skipped)})"
    # Nodes the GPUs alone would count but the pods' CPU/memory rule out, for alternatives that do fit
    # somewhere (for the others the reason above already says it).
    short = [f"{a.name}: {a.host_note}" for a in alternatives if a.host_note and (a.nodes_fit or 0) > 0]
    if short:
        note += f"; {'; '.join(short)}"
    if host_error:
        note += f"; {host_error}"
    return note + (f"; unknown: {'; '.join(unknown)}" if unknown else "")


def post_event(kube: Kube, body: Obj, etype: str, reason: str, message: str) -> None:
    """A core/v1 Event on the profile; failures are logged, never fatal."""
    meta = body.get("metadata") or {}
    ns = meta.get("namespace", "default")
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    event = {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta.get('name', 'claimprofile')}.", "namespace": ns},
        "involvedObject": {"apiVersion": API_VERSION, "kind": KIND,
                           "name": meta.get("name"), "namespace": ns, "uid": meta.get("uid")},
        "type": etype, "reason": reason, "message": message[:1024],
        "source": {"component": "topodra-controller"},
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }
    try:
        kube.create(event_path(ns), event)
    except KubeError as e:
        log.warning("profile %s/%s: could not post event %s: %s", ns, meta.get("name"), reason, e)


def process(kube: Kube, body: Obj, cfg: ControllerConfig, cache: Facts) -> Outcome:
    """Reconcile one profile, compute availability, write status, post an Event on a change.

    The snapshot is read before the pass lock is taken: its lists are the pass's biggest reads."""
    snap = cache.get(kube, host=wants_host(body))
    with _PROCESS_LOCK:
        return _process(kube, body, cfg, snap)


def wants_host(body: Obj) -> bool:
    """Whether the profile states its pods' CPU/memory, so availability needs the nodes' free CPU/memory."""
    try:
        return pod_shape(ClaimProfile.from_api(body)) is not None
    except ProfileError:
        return False


def _process(kube: Kube, body: Obj, cfg: ControllerConfig, snap: Snapshot | str) -> Outcome:
    meta = body.get("metadata") or {}
    ns, name = meta.get("namespace", ""), meta.get("name", "")
    gang_plan = _gang_plan(kube, body, cfg, snap)
    outcome = reconcile(kube, body, cfg, gang_plan.choice.alternative if gang_plan else None)
    alternatives: list[AlternativeStatus] | None = None
    note = ""
    if isinstance(snap, str):
        note = snap
    elif outcome.reason != "InvalidSpec":
        alternatives = profile_availability(ClaimProfile.from_api(body), snap, driver=cfg.driver,
                                            nic_class=cfg.nic_class)
    note = availability_note(alternatives, note, snap.host_error if isinstance(snap, Snapshot) else "")
    old_status = body.get("status") or {}
    status = build_status(old_status, outcome, int(meta.get("generation") or 0), alternatives, note,
                          datetime.now(UTC))
    _queueing(kube, body, outcome, status)
    if gang_plan is not None:
        gang_note = gang.apply(kube, ClaimProfile.from_api(body), gang_plan) if outcome.ok else outcome.message
        status["gang"] = gang.gang_status(ClaimProfile.from_api(body), gang_plan.choice, gang_plan.pods, snap,
                                          gang_note)
    else:
        status["gang"] = None
    _reservation_off(kube, body, cfg, status)
    kube.merge_patch(profile_path(ns, name) + "/status", {"status": status})
    old_ready: Obj = next((c for c in old_status.get("conditions") or [] if c.get("type") == "Ready"), {})
    if not outcome.ok and old_ready.get("reason") != outcome.reason:
        log.warning("profile %s/%s: %s: %s", ns, name, outcome.reason, outcome.message)
        post_event(kube, body, "Warning", outcome.reason, outcome.message)
    elif outcome.action in ("created", "replaced"):
        post_event(kube, body, "Normal", "Template" + outcome.action.capitalize(), outcome.message)
    return outcome


def _gang_plan(kube: Kube, body: Obj, cfg: ControllerConfig, snap: Snapshot | str) -> gang.GangPlan | None:
    """A multi-node profile's choice of alternative and level (None: not one, or invalid)."""
    try:
        profile = ClaimProfile.from_api(body)
    except ProfileError:
        return None
    if profile.spec.pods is None:
        return None
    return gang.plan(kube, profile, snap, driver=cfg.driver, nic_class=cfg.nic_class)


def _reservation_off(kube: Kube, body: Obj, cfg: ControllerConfig, status: Obj) -> None:
    """A profile whose reservation is off (or invalid) holds nothing: its rules go in the same pass as its
    template loses the toleration, so they never disagree for longer (controller/reserve.py owns the rest)."""
    try:
        on = reserves(ClaimProfile.from_api(body), cfg.reservations)
    except ProfileError:
        on = False
    if on or not (body.get("status") or {}).get("reservation"):
        return
    delete_rules_of(kube, str((body.get("metadata") or {}).get("uid", "")))
    status["reservation"] = None


def reservations_pass(kube: Kube, cfg: ControllerConfig, cache: Facts, profiles: list[Obj]) -> None:
    """Plan and write every reservation (controller/reserve.py) from the profiles just listed; at controller
    start this is also the garbage collection of rules whose profile is gone."""
    wanted = False
    for body in profiles:
        try:
            wanted = wanted or reserves(ClaimProfile.from_api(body), cfg.reservations)
        except ProfileError:
            continue
    snap: Snapshot | str = cache.get(kube, host=True) if wanted else "no profile reserves"
    with _PROCESS_LOCK:
        reconcile_reservations(kube, cfg, snap, profiles, post=post_event)


def _queueing(kube: Kube, body: Obj, outcome: Outcome, status: Obj) -> None:
    """Kueue mode: ``status.queueing`` and a ``KueueAdmissible`` condition (see controller/kueue.py)."""
    if outcome.reason == "InvalidSpec":
        return
    profile = ClaimProfile.from_api(body)
    if profile.spec.queueing != "Kueue":
        status["queueing"] = None
        return
    classes = [c for a in profile.spec.alternatives if (c := kube.get(device_class_path(a.device_class_name)))]
    q, ok, msg = queueing_status(profile, class_models_from(classes))
    status["queueing"] = q
    stamp = status["lastRefresh"]
    status["conditions"].append(_condition(list((body.get("status") or {}).get("conditions") or []),
                                           "KueueAdmissible", "True" if ok else "False",
                                           "Rendered" if ok else "KueueUnsupported", msg,
                                           int((body.get("metadata") or {}).get("generation") or 0), stamp))


def delete_template(kube: Kube, body: Obj) -> None:
    """Delete the profile's template if this profile owns it (GC would do it too)."""
    meta = body.get("metadata") or {}
    ns, name = meta.get("namespace", ""), meta.get("name", "")
    tmpl = kube.get(template_path(ns, name))
    if tmpl is None:
        return
    refs = (tmpl.get("metadata") or {}).get("ownerReferences") or []
    if any(r.get("uid") == meta.get("uid") for r in refs):
        kube.delete(template_path(ns, name))
        log.info("profile %s/%s deleted: deleted its ResourceClaimTemplate", ns, name)


def list_profiles(kube: Kube, namespaces: Iterable[str]) -> list[Obj]:
    nss = list(namespaces)
    if not nss:
        return list(kube.list(profile_path()))
    return [p for ns in nss for p in kube.list(profile_path(ns))]


def refresh_all(kube: Kube, cfg: ControllerConfig, cache: Facts) -> int:
    """One pass over every watched profile; returns how many failed (each is logged)."""
    failed = 0
    try:
        profiles = list_profiles(kube, cfg.namespaces)
    except KubeError as e:
        log.warning("refresh: cannot list ClaimProfiles: %s", e)
        return 1
    for body in profiles:
        meta = body.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        try:
            process(kube, body, cfg, cache)
        except KubeError as e:
            failed += 1
            log.warning("refresh: profile %s/%s: %s", meta.get("namespace"), meta.get("name"), e)
    try:
        reservations_pass(kube, cfg, cache, profiles)
    except KubeError as e:
        failed += 1
        log.warning("refresh: reservations: %s", e)
    return failed


@dataclass
class RefreshLoop:
    """Background thread: re-check every profile each ``refresh_interval_s`` (drift, new classes, status).

    Not a ``kopf.timer``: kopf registers every timer with ``requires_finalizer=True`` (kopf/on.py, no
    setting turns it off), so each ClaimProfile would carry kopf's finalizer, and deleting a profile (or
    its namespace) while the controller is down would hang until someone removed it by hand.  Measured on
    the real apiserver (v1.37.2, kopf 1.45.2; our handlers plus a 2 s ``kopf.timer``, operator then stopped,
    profile deleted): with the timer the profile carried ``kopf.zalando.org/KopfFinalizerMarker`` and was
    still there 30 s after the delete; with this thread instead it had no finalizer and was gone in 7 ms.
    """

    kube: Kube
    cfg: ControllerConfig
    cache: Facts
    stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="profile-refresh", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.stop.wait(max(self.cfg.refresh_interval_s, 1.0)):
            refresh_all(self.kube, self.cfg, self.cache)

    def join(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


def _plain(body: Any) -> Obj:
    """kopf's Body as a plain, independent dict."""
    return copy.deepcopy(dict(body))


def connection_info(kubeconfig: str | None) -> Any:
    """kopf credentials from the same kubeconfig our ``Kube`` client uses (no other discovery)."""
    import kopf

    c = load_configuration(kubeconfig)
    header = c.get_api_key_with_prefix("BearerToken") or c.get_api_key_with_prefix("authorization") or ""
    scheme, _sep, token = header.rpartition(" ")
    return kopf.ConnectionInfo(
        server=c.host, ca_path=c.ssl_ca_cert, insecure=not c.verify_ssl,
        username=c.username or None, password=c.password or None, scheme=scheme or None,
        token=token or None, certificate_path=c.cert_file, private_key_path=c.key_file,
    )


def build_registry(kube: Kube, kubeconfig: str | None, cfg: ControllerConfig, cache: Facts) -> Any:
    """A kopf registry with our login and ClaimProfile handlers (no global state)."""
    import kopf

    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_kw: Any) -> Any:
        return connection_info(kubeconfig)

    @kopf.on.resume(PROFILE_GROUP, PROFILE_VERSION, PROFILE_PLURAL, registry=registry)
    @kopf.on.create(PROFILE_GROUP, PROFILE_VERSION, PROFILE_PLURAL, registry=registry)
    @kopf.on.update(PROFILE_GROUP, PROFILE_VERSION, PROFILE_PLURAL, registry=registry)
    def on_change(body: Any, **_: Any) -> None:
        obj = _plain(body)
        try:
            process(kube, obj, cfg, cache)
        except KubeError as e:
            meta = obj.get("metadata") or {}
            delay = 30 if e.status in (401, 403) else 5
            raise kopf.TemporaryError(
                f"profile {meta.get('namespace')}/{meta.get('name')}: {e}", delay=delay) from None

    @kopf.on.delete(PROFILE_GROUP, PROFILE_VERSION, PROFILE_PLURAL, registry=registry, optional=True)
    def on_delete(body: Any, **_: Any) -> None:
        obj = _plain(body)
        try:
            delete_template(kube, obj)
            uid = (obj.get("metadata") or {}).get("uid")
            if uid:
                delete_rules_of(kube, str(uid))
        except KubeError as e:
            raise kopf.TemporaryError(str(e), delay=5) from None

    return registry


def kopf_settings() -> Any:
    """Progress and diff-base in annotations: the structural schema would prune ``status.kopf``."""
    import kopf

    settings = kopf.OperatorSettings()
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kopf.topodra.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kopf.topodra.io", key="last-handled-configuration")
    settings.posting.enabled = False  # we post our own Events, with profile context
    settings.execution.max_workers = 4
    return settings
