"""Reservations' effects (issue 33): the one owner of reservation DeviceTaintRules and ``status.reservation``.

Each pass (``reconcile_reservations``, after every refresh of all profiles, and at controller start, which makes
it the garbage collection of rules whose profile is gone) reads:

* our rules (``app.kubernetes.io/managed-by=topodra-controller`` with a ``topodra.io/reservation-uid`` label),
  listed from the API server, not from a cache, so a pass sees its own writes;
* each profile whose reservation is on (``render.reserves``): its waiting pods (a gang's members,
  ``gang.plan``; a whole-server profile's pods naming its template) and, from the controller's facts
  (``controller/facts.py``, the fleet model), the nodes that could run it with their free devices of its class
  and the running pods holding the others (``startTime`` + ``activeDeadlineSeconds`` as their end);

then asks the pure planner (``controller/reservation.py``) and makes the rules match: one rule per reserved node
selecting ``{driver, pool: node}`` (topodra's pool is the node), taint ``topodra.io/reservation=<profile uid>``
with effect NoSchedule (held) or None (hint). Rules no plan asks for are deleted: a released, expired or hinted-
elsewhere reservation, a profile whose reservation was turned off, and a rule whose profile is gone (a restart
or a missed delete leaves nothing behind: every rule names its profile's uid, and only profiles listed now count).

Backfill windows (``topodra.reservations``): every held node also gets a rule with taint
``topodra.io/backfill-window=<bucket>`` (NoSchedule), the largest bucket that ends before the hold's expected
start less a margin covering how late a pass can be (``window_margin_s``: the refresh interval plus the facts'
TTL), or ``closed``. The bucket is in the rule's name, so a new value is a new rule, created before the old one
goes: while both exist a backfill claim must tolerate both (the stricter one). Order of the writes
(``apply_order``): window rules are created first and deleted last, holds in between, so a held device never
lacks its window taint (a backfill claim tolerates every hold, only its window keeps it off the wrong nodes).

The taint matters only to claims without a toleration: the reserving profile's template tolerates it from the
start (``render.with_tolerations``), so rules, PodGroup and template never disagree beyond one pass.
DeviceTaintRule and the tolerations: k8s.io/api v0.37.2 resource/v1/types.go (DeviceTaintRule, DeviceToleration,
ExactDeviceRequest.Tolerations, DeviceSubRequest.Tolerations); NoSchedule keeps running pods and their
allocations, and only new allocations need the toleration (DeviceTaintEffectNoSchedule's comment there).
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from topodra import reservations as vocab
from topodra.apipaths import device_taint_rule_path, pod_path, profile_path
from topodra.controller import gang, gangspec
from topodra.controller.availability import PublishedDevice, Snapshot, class_match
from topodra.controller.profile import ClaimProfile, ProfileError
from topodra.controller.render import reserves
from topodra.controller.reservation import (
    EXPIRED,
    HELD,
    HINT,
    Existing,
    Job,
    NodeState,
    Plan,
    Reservation,
    RunningPod,
    plan,
)
from topodra.fleet.taints import blocking, device_taints
from topodra.kube import Kube, KubeError

log = logging.getLogger(__name__)

Obj = dict[str, Any]

RULE_API = "resource.k8s.io/v1"
DOMAIN_ANNOTATION = "topodra.io/reservation-domain"
EXPECTED_ANNOTATION = "topodra.io/reservation-expected-start"  # on a hold rule: the start it was made with
NARROWED_ANNOTATION = "topodra.io/reservation-narrowed"  # a hold on a narrower level: its index (Place.narrowed)
PREFIX = {HELD: "topodra-hold-", HINT: "topodra-hint-"}
WINDOW_PREFIX = "topodra-backfill-"
OURS = f"{vocab.MANAGED_LABEL}={vocab.MANAGED_VALUE},{vocab.UID_LABEL}"
UNKNOWN_HOLDER = "(a claim of no running pod)"
WAITING = "Waiting"  # status only: the job waits and holds nothing (the message says why)


# --- pure: times, rules, status --------------------------------------------------------------------------------

def parse_time(stamp: str | None) -> float | None:
    """Epoch seconds of an RFC 3339 timestamp as the API server writes it; None when absent or unreadable."""
    if not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def stamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _label_value(text: str) -> str:
    """A label value (63 characters at most, alphanumeric at both ends) naming ``text``; the uid label is the key."""
    return text[:63].rstrip("-_.")


def rule_name(state: str, uid: str, node: str) -> str:
    name = f"{PREFIX[state]}{uid}.{node}"
    if len(name) > 253:
        name = f"{PREFIX[state]}{uid}.{hashlib.sha256(node.encode()).hexdigest()[:20]}"
    return name


def window_rule_name(uid: str, node: str, value: str) -> str:
    name = f"{WINDOW_PREFIX}{uid}.{node}.{value}"
    if len(name) > 253:
        name = f"{WINDOW_PREFIX}{uid}.{hashlib.sha256(node.encode()).hexdigest()[:20]}.{value}"
    return name


def _labels(r: Reservation) -> dict[str, str]:
    return {vocab.MANAGED_LABEL: vocab.MANAGED_VALUE, vocab.PROFILE_NS_LABEL: _label_value(r.namespace),
            vocab.PROFILE_NAME_LABEL: _label_value(r.name), vocab.UID_LABEL: r.uid}


def render_rule(r: Reservation, node: str, driver: str) -> Obj:
    """The DeviceTaintRule that holds (or hints) every device of ``driver`` on ``node`` for ``r``'s profile."""
    annotations = {DOMAIN_ANNOTATION: r.place.domain}
    if r.state == HELD and r.place.expected_start is not None:
        annotations[EXPECTED_ANNOTATION] = stamp(r.place.expected_start)
    if r.place.narrowed is not None:
        annotations[NARROWED_ANNOTATION] = str(r.place.narrowed)
    return {
        "apiVersion": RULE_API, "kind": "DeviceTaintRule",
        "metadata": {"name": rule_name(r.state, r.uid, node), "labels": _labels(r), "annotations": annotations},
        "spec": {
            "deviceSelector": {"driver": driver, "pool": node},
            "taint": {"key": vocab.RESERVATION_TAINT_KEY, "value": r.uid,
                      "effect": vocab.HOLD_EFFECT if r.state == HELD else vocab.HINT_EFFECT},
        },
    }


def render_window_rule(r: Reservation, node: str, driver: str, value: str) -> Obj:
    """The backfill window of a held node: which runtime bounds may use its held devices (module docstring)."""
    return {
        "apiVersion": RULE_API, "kind": "DeviceTaintRule",
        "metadata": {"name": window_rule_name(r.uid, node, value), "labels": _labels(r),
                     "annotations": {DOMAIN_ANNOTATION: r.place.domain}},
        "spec": {"deviceSelector": {"driver": driver, "pool": node},
                 "taint": {"key": vocab.BACKFILL_WINDOW_KEY, "value": value, "effect": vocab.HOLD_EFFECT}},
    }


def wanted_rules(p: Plan, driver: str, now: float, window_margin_s: float) -> dict[str, Obj]:
    """Every rule the plan asks for: per reserved node its hold (or hint), and per held node its backfill window
    (``reservations.window`` of the hold's expected start at ``now`` less ``window_margin_s``)."""
    out: dict[str, Obj] = {}
    for r in p.reservations:
        value = vocab.window(r.place.expected_start, now, window_margin_s)
        for node in r.place.nodes:
            rule = render_rule(r, node, driver)
            out[rule["metadata"]["name"]] = rule
            if r.state == HELD:
                w = render_window_rule(r, node, driver, value)
                out[w["metadata"]["name"]] = w
    return out


def is_window(rule: Obj) -> bool:
    return ((rule.get("spec") or {}).get("taint") or {}).get("key") == vocab.BACKFILL_WINDOW_KEY


def deletion_order(rules: Iterable[Obj]) -> list[Obj]:
    """Rules to delete, holds before backfill windows (a held device never lacks its window taint)."""
    return sorted(rules, key=lambda r: (is_window(r), str((r.get("metadata") or {}).get("name", ""))))


def apply_order(have: Mapping[str, Obj], want: Mapping[str, Obj]) -> list[tuple[str, Obj]]:
    """``rule_changes`` as ("create" | "delete", rule) in a safe order: windows created, holds and hints deleted,
    holds and hints created, windows deleted. A held device so always has a window taint, and a changed window
    value is the new (stricter or not) rule first, the old one after."""
    delete, create = rule_changes(have, want)
    gone = [have[n] for n in delete]
    return ([("create", r) for r in create if is_window(r)] + [("delete", r) for r in gone if not is_window(r)]
            + [("create", r) for r in create if not is_window(r)] + [("delete", r) for r in gone if is_window(r)])


def same_rule(have: Obj, want: Obj) -> bool:
    """Whether a rule read back selects and taints as ``want`` does (the API server adds ``timeAdded``)."""
    def key(r: Obj) -> tuple[Any, ...]:
        spec = r.get("spec") or {}
        taint = spec.get("taint") or {}
        return (spec.get("deviceSelector"), taint.get("key"), taint.get("value"), taint.get("effect"))
    return key(have) == key(want)


def rule_changes(have: Mapping[str, Obj], want: Mapping[str, Obj]) -> tuple[list[str], list[Obj]]:
    """(rule names to delete, rules to create) that make ``have`` (read back, by name) match ``want`` (pure): a
    rule whose selector or taint changed is deleted and created again; one that only gained the API server's
    ``timeAdded`` is kept (``same_rule``). The operator and ``bench/placement`` (policy (g)) both apply it."""
    delete = sorted(n for n, r in have.items() if n not in want or not same_rule(r, want[n]))
    create = [dict(r) for n, r in sorted(want.items()) if n not in have or not same_rule(have[n], r)]
    return delete, create


def ours(rule: Obj) -> bool:
    labels = (rule.get("metadata") or {}).get("labels") or {}
    return labels.get(vocab.MANAGED_LABEL) == vocab.MANAGED_VALUE and bool(labels.get(vocab.UID_LABEL))


def rule_uid(rule: Obj) -> str:
    return str(((rule.get("metadata") or {}).get("labels") or {}).get(vocab.UID_LABEL, ""))


def existing_reservations(rules: Iterable[Obj], now: float) -> dict[str, Existing]:
    """uid -> the reservation its rules make now (held when any of its rules holds); a rule without a
    creationTimestamp (the API server always writes one) counts from ``now``."""
    by_uid: dict[str, list[Obj]] = defaultdict(list)
    for r in rules:
        if ours(r) and not is_window(r):
            by_uid[rule_uid(r)].append(r)
    out: dict[str, Existing] = {}
    for uid, rs in by_uid.items():
        held = [r for r in rs if ((r.get("spec") or {}).get("taint") or {}).get("effect") == vocab.HOLD_EFFECT]
        use = held or rs
        nodes = tuple(sorted(str(((r.get("spec") or {}).get("deviceSelector") or {}).get("pool", "")) for r in use))
        since = min((t for r in use if (t := parse_time((r.get("metadata") or {}).get("creationTimestamp")))
                     is not None), default=now)
        notes = (use[0].get("metadata") or {}).get("annotations") or {}
        domain = str(notes.get(DOMAIN_ANNOTATION, ""))
        starts = [t for r in held if (t := parse_time(((r.get("metadata") or {}).get("annotations") or {})
                                                       .get(EXPECTED_ANNOTATION))) is not None]
        narrowed = str(notes.get(NARROWED_ANNOTATION, ""))
        out[uid] = Existing(HELD if held else HINT, nodes, domain, since, min(starts, default=None),
                            int(narrowed) if narrowed.isdigit() else None)
    return out


def reservation_status(r: Reservation | None, job: Job, note: str, expired_now: bool, levels: tuple[str, ...],
                       now: float, window_margin_s: float) -> Obj | None:
    """``status.reservation`` of one profile (None: nothing held, hinted or expired); ``levels``: the narrower
    levels' names, then the job's own (``job_of``)."""
    level = levels[-1]
    if r is not None:
        if r.place.narrowed is not None and r.place.narrowed < len(levels) - 1:
            level = levels[r.place.narrowed]
        out: Obj = {"state": r.state, "domain": r.place.domain, "level": level, "nodes": list(r.place.nodes),
                    "since": stamp(r.since), "waitingSince": stamp(r.waiting_since),
                    "gpusHeldIdle": r.place.gpus_free if r.state == HELD else 0,
                    "podsToWaitFor": len(r.place.waits),
                    "message": (f"holding {len(r.place.nodes)} node(s) of {level} {r.place.domain}"
                                if r.state == HELD else f"would reserve {level} {r.place.domain} next")
                    + (f", counting on {len(r.place.after)} node(s) held for jobs before it once they end"
                       if r.place.after else "")}
        if r.place.expected_start is not None:
            out["expectedStart"] = stamp(r.place.expected_start)
        if r.state == HELD:
            out["backfillWindow"] = vocab.window(r.place.expected_start, now, window_margin_s)
        return out
    if (expired_now or job.cooling(now)) and job.waiting_since is not None:
        at = now if expired_now or job.expired_at is None else job.expired_at
        return {"state": EXPIRED, "waitingSince": stamp(job.waiting_since), "expiredAt": stamp(at), "message": note}
    if job.waiting and job.waiting_since is not None and note:
        return {"state": WAITING, "waitingSince": stamp(job.waiting_since), "message": note}
    return None


# --- the facts one job is planned from -------------------------------------------------------------------------

def declared_deadline(pod: Obj) -> int | None:
    """A pod's ``spec.activeDeadlineSeconds`` when it declares a valid one (a positive integer), else None."""
    deadline = (pod.get("spec") or {}).get("activeDeadlineSeconds")
    if not isinstance(deadline, int) or isinstance(deadline, bool) or deadline <= 0:
        return None
    return deadline


def pod_end(pod: Obj) -> float | None:
    """When a running pod ends at the latest: ``status.startTime`` + ``spec.activeDeadlineSeconds`` (None: no bound)."""
    deadline = declared_deadline(pod)
    start = parse_time((pod.get("status") or {}).get("startTime"))
    if deadline is None or start is None:
        return None
    return start + deadline


def pod_claims(pod: Obj) -> list[tuple[str, str]]:
    """(namespace, claim) of every ResourceClaim a pod uses (generated ones from ``status.resourceClaimStatuses``)."""
    ns = str((pod.get("metadata") or {}).get("namespace", ""))
    names = [c.get("resourceClaimName") for c in (pod.get("spec") or {}).get("resourceClaims") or []]
    names += [c.get("resourceClaimName") for c in (pod.get("status") or {}).get("resourceClaimStatuses") or []]
    return [(ns, str(n)) for n in dict.fromkeys(names) if n]


def holders_by_device(snap: Snapshot) -> dict[tuple[str, str], tuple[str, float | None]]:
    """(pool, device) -> (namespace/pod, its end) for the devices bound pods' claims hold."""
    out: dict[tuple[str, str], tuple[str, float | None]] = {}
    for pod in snap.pods or ():
        meta = pod.get("metadata") or {}
        who = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        end = pod_end(pod)
        for key in pod_claims(pod):
            for dev in snap.claim_devices.get(key, ()):
                out[dev] = (who, end)
    return out


def node_states(profile: ClaimProfile, alternative: str, key: str | None, whole_server: bool, snap: Snapshot,
                driver: str, holders: dict[tuple[str, str], tuple[str, float | None]],
                narrower_keys: tuple[str, ...] = ()) -> tuple[NodeState, ...]:
    """The schedulable nodes publishing the alternative's class, each with its free devices (the job's own
    reservation does not block them), the running pods holding the rest, its values of the narrower
    levels' keys (``narrower_keys``, narrowest first), and the devices only another job's reservation keeps."""
    alt = next(a for a in profile.spec.alternatives if a.effective_name == alternative)
    match, _why = class_match(snap.classes.get(alt.device_class_name))
    if match is None:
        return ()
    uid = profile.metadata.uid
    others = [r for r in snap.rules if not (ours(r) and rule_uid(r) == uid)]
    not_reservations = [r for r in others if not ours(r)]
    free: dict[str, list[PublishedDevice]] = defaultdict(list)
    reserved: dict[str, list[PublishedDevice]] = defaultdict(list)
    held: dict[str, dict[str, list[PublishedDevice]]] = defaultdict(lambda: defaultdict(list))
    ends: dict[str, float | None] = {}
    nodes: set[str] = set()
    for d in snap.matching(match, driver):
        if d.node in snap.unavailable_nodes:
            continue
        nodes.add(d.node)
        if (d.pool, d.name) in snap.allocated:
            who, end = holders.get((d.pool, d.name), (UNKNOWN_HOLDER, None))
            held[d.node][who].append(d)
            ends[who] = end
        elif not blocking(device_taints(d.raw, others, driver, d.pool)):
            free[d.node].append(d)
        elif not blocking(device_taints(d.raw, not_reservations, driver, d.pool)):
            reserved[d.node].append(d)  # kept only by another job's reservation: free when that job ends
    out = []
    for node in sorted(nodes):
        if whole_server:
            domain: str | None = node
        elif key is None:
            domain = gang.WHOLE_CLUSTER
        else:
            domain = (snap.node_labels.get(node) or {}).get(key)
        running = tuple(RunningPod(who, tuple(devs), ends.get(who)) for who, devs in sorted(held[node].items()))
        labels = snap.node_labels.get(node) or {}
        out.append(NodeState(node, domain, tuple(free[node]), running, tuple(labels.get(k) for k in narrower_keys),
                             tuple(reserved[node])))
    return tuple(out)


def _capacity(profile: ClaimProfile, alternative: str, driver: str) -> Any:
    """How many job pods a set of one node's devices holds (``gang.pods_on_node``, Required placement honoured).

    A RailAligned profile is counted without its NICs: a reserved node's NICs are held with its GPUs (the rule
    selects the node's whole pool), so they free up with them."""
    alt = next(a for a in profile.spec.alternatives if a.effective_name == alternative)
    plain = profile
    if profile.spec.topology.nic == "RailAligned":
        topo = profile.spec.topology.model_copy(update={"nic": "None"})
        plain = profile.model_copy(update={"spec": profile.spec.model_copy(update={"topology": topo})})

    def capacity(devices: Any) -> int:
        return gang.pods_on_node(list(devices), [], alt.count, plain, driver)

    return capacity


def _names_template(pod: Obj, template: str) -> bool:
    return any(c.get("resourceClaimTemplateName") == template
               for c in (pod.get("spec") or {}).get("resourceClaims") or [])


def runtime_bound(pods: Iterable[Obj]) -> float | None:
    """The longest ``activeDeadlineSeconds`` of a job's pending pods, or None when one declares none (or none
    is pending): how long the job runs at most once bound, for the jobs planned after it."""
    bounds = [declared_deadline(p) for p in pods]
    if not bounds or None in bounds:
        return None
    return float(max(b for b in bounds if b is not None))


def _pending(pods: Iterable[Obj]) -> list[Obj]:
    return [p for p in pods if not (p.get("spec") or {}).get("nodeName")
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            and not (p.get("metadata") or {}).get("deletionTimestamp")]


def job_of(kube: Kube, body: Obj, profile: ClaimProfile, snap: Snapshot, cfg: Any,
           holders: dict[tuple[str, str], tuple[str, float | None]],
           existing: Existing | None) -> tuple[Job, tuple[str, ...]]:
    """The planner's view of one profile's job, and its levels' names for the status: the narrower levels the
    job prefers (``sameDomain`` entries before the level its gang got), narrowest first, then its own."""
    spec = profile.spec
    r = spec.reservation
    assert r is not None
    after = r.after_waiting_s if r.after_waiting_s is not None else cfg.reservation_after_s
    hold = r.max_hold_s if r.max_hold_s is not None else cfg.reservation_max_hold_s
    grace = cfg.reservation_grace_s
    within = r.narrower_within_s if r.narrower_within_s is not None else cfg.reservation_narrower_within_s
    ns, name = profile.metadata.namespace, profile.metadata.name
    narrower: tuple[str, ...] = ()
    if spec.pods is not None:
        gp = gang.plan(kube, profile, snap, driver=cfg.driver, nic_class=cfg.nic_class)
        pending = _pending(gp.pods)
        bound = len(gp.pods) - len(pending)
        needed = spec.pods - bound if pending else 0
        alternative, key, whole = gp.choice.alternative, gp.choice.key, False
        level = gp.choice.level or gang.WHOLE_CLUSTER
        listed = list(spec.across_nodes.same_domain) if spec.across_nodes else []
        if gp.choice.level in listed:
            narrower = tuple(listed[:listed.index(gp.choice.level)])
    else:
        pending = _pending(p for p in kube.list(pod_path(ns)) if _names_template(p, name))
        needed = 1 if pending else 0
        alternative, key, whole, level = spec.alternatives[0].effective_name, None, True, "node"
    since = min((t for p in pending if (t := parse_time((p.get("metadata") or {}).get("creationTimestamp")))
                 is not None), default=None)
    old = ((body.get("status") or {}).get("reservation") or {})
    expired_at = None
    if old.get("state") == EXPIRED and since is not None and old.get("waitingSince") == stamp(since):
        expired_at = parse_time(old.get("expiredAt")) or parse_time(old.get("waitingSince"))
    nodes = node_states(profile, alternative, key, whole, snap, cfg.driver, holders,
                        tuple(gangspec.level_key(lv) for lv in narrower))
    job = Job(ns, name, profile.metadata.uid, max(needed, 0), since if needed > 0 else None, float(after),
              float(hold), nodes, _capacity(profile, alternative, cfg.driver), existing, expired_at,
              float(cfg.reservation_cooldown_s), float(grace), float(within), runtime_bound(pending))
    return job, (*narrower, level)


# --- effects ---------------------------------------------------------------------------------------------------

def list_rules(kube: Kube) -> list[Obj]:
    return [r for r in kube.list(device_taint_rule_path(), label_selector=OURS) if ours(r)]


def delete_rules_of(kube: Kube, uid: str) -> int:
    """Delete every rule naming this profile uid (its deletion, or its reservation turned off); how many."""
    gone = 0
    for r in deletion_order(kube.list(device_taint_rule_path(),
                                      label_selector=f"{vocab.MANAGED_LABEL}={vocab.MANAGED_VALUE},"
                                                     f"{vocab.UID_LABEL}={uid}")):
        kube.delete(device_taint_rule_path(r["metadata"]["name"]))
        gone += 1
    if gone:
        log.info("reservation of profile uid %s: deleted %d DeviceTaintRule(s)", uid, gone)
    return gone


def _managed_here(rule: Obj, namespaces: tuple[str, ...]) -> bool:
    """A namespaced controller touches only rules of profiles in its namespaces."""
    if not namespaces:
        return True
    return ((rule.get("metadata") or {}).get("labels") or {}).get(vocab.PROFILE_NS_LABEL) in namespaces


def reconcile_reservations(kube: Kube, cfg: Any, snap: Snapshot | str, profiles: list[Obj],
                           now: float | None = None, post: Any = None) -> Plan | None:
    """One pass: plan every reserving profile's job, make the rules match, write ``status.reservation``.

    ``profiles``: every profile this controller watches, listed now (a rule whose uid is not among them is
    deleted). ``snap``: the facts with bound pods (``get(host=True)``); when they cannot be read, only rules of
    gone profiles and holds past their maxHold are deleted, nothing is made. ``post``: the Event writer
    (``operator.post_event``; None posts none)."""
    now = datetime.now(UTC).timestamp() if now is None else now
    try:
        rules = [r for r in list_rules(kube) if _managed_here(r, cfg.namespaces)]
    except KubeError as e:
        if e.status != 404:
            raise
        log.warning("reservations: DeviceTaintRules are not served (%s); nothing is reserved", e)
        return None
    existing = existing_reservations(rules, now)
    parsed: list[tuple[Obj, ClaimProfile]] = []
    for body in profiles:
        if (body.get("metadata") or {}).get("deletionTimestamp"):
            continue
        try:
            parsed.append((body, ClaimProfile.from_api(body)))
        except ProfileError:
            continue
    live = {p.metadata.uid for _b, p in parsed}
    reserving = [(b, p) for b, p in parsed if reserves(p, cfg.reservations)]
    if not reserving:
        for r in deletion_order(rules):
            kube.delete(device_taint_rule_path(r["metadata"]["name"]))
        return None
    if isinstance(snap, str):
        keep = {p.metadata.uid for _b, p in reserving}
        for r in deletion_order(rules):
            uid = rule_uid(r)
            ex = existing.get(uid)
            hold = next((p.spec.reservation for _b, p in reserving if p.metadata.uid == uid), None)
            max_hold = (hold.max_hold_s if hold is not None and hold.max_hold_s is not None
                        else cfg.reservation_max_hold_s)
            if uid not in keep or (ex is not None and now - ex.since >= max_hold):
                kube.delete(device_taint_rule_path(r["metadata"]["name"]))
        log.warning("reservations: %s; only rules of gone profiles and expired holds were released", snap)
        return None
    holders = holders_by_device(snap)
    jobs: list[Job] = []
    levels: dict[str, tuple[str, ...]] = {}
    bodies: dict[str, Obj] = {}
    for body, profile in reserving:
        try:
            job, level = job_of(kube, body, profile, snap, cfg, holders, existing.get(profile.metadata.uid))
        except KubeError as e:
            log.warning("reservation of %s/%s: %s", profile.metadata.namespace, profile.metadata.name, e)
            continue
        jobs.append(job)
        levels[job.uid], bodies[job.uid] = level, body
    result = plan(jobs, now, cfg.max_reservations)
    margin = window_margin_s(cfg)
    want = wanted_rules(result, cfg.driver, now, margin)
    have = {r["metadata"]["name"]: r for r in rules}
    for op, r in apply_order(have, want):
        name = r["metadata"]["name"]
        if op == "delete":
            kube.delete(device_taint_rule_path(name))
            if rule_uid(r) not in live:
                log.info("reservations: deleted DeviceTaintRule %s of a profile that no longer exists", name)
            continue
        try:
            kube.create(device_taint_rule_path(), r)
        except KubeError as e:
            if e.status != 409:
                raise
    expired_now = {j.uid for j in result.expired}
    for job in jobs:
        body = bodies[job.uid]
        res = result.of(job.uid)
        new = reservation_status(res, job, result.notes.get(job.uid, ""), job.uid in expired_now, levels[job.uid],
                                 now, margin)
        old = (body.get("status") or {}).get("reservation")
        _events(kube, post, body, job, res, old, result.notes.get(job.uid, ""), job.uid in expired_now)
        if _differs(old, new):
            kube.merge_patch(profile_path(job.namespace, job.name) + "/status", {"status": {"reservation": new}})
    return result


def window_margin_s(cfg: Any) -> float:
    """How late a backfill window can be rewritten: one refresh interval, plus the facts' TTL."""
    return float(cfg.refresh_interval_s) + float(cfg.snapshot_ttl_s)


def _differs(old: Obj | None, new: Obj | None) -> bool:
    if old is None or new is None:
        return old != new
    return {k: v for k, v in old.items() if v is not None} != new


def _events(kube: Kube, post: Any, body: Obj, job: Job, res: Reservation | None, old: Obj | None, note: str,
            expired: bool) -> None:
    """An Event and a log line when a hold is made, released or runs out."""
    if post is None:
        def post(*_a: Any) -> None:
            return None
    was_held = (old or {}).get("state") == HELD
    who = f"{job.namespace}/{job.name}"
    if res is not None and res.state == HELD and (not was_held or (old or {}).get("nodes") != list(res.place.nodes)):
        start = (f", expected start {stamp(res.place.expected_start)}" if res.place.expected_start is not None
                 else ", start unknown (a pod to wait for declares no activeDeadlineSeconds)")
        msg = (f"reserved {', '.join(res.place.nodes)} in {res.place.domain} after waiting "
               f"{int(res.since - res.waiting_since)}s: {res.place.gpus_free} GPU(s) held idle, "
               f"{len(res.place.waits)} running pod(s) to wait for{start}")
        log.info("reservation %s: %s", who, msg)
        post(kube, body, "Normal", "Reserved", msg)
    elif was_held and (res is None or res.state != HELD):
        if expired:
            log.warning("reservation %s: %s", who, note)
            post(kube, body, "Warning", "ReservationExpired", note)
        else:
            why = note or ("the job is bound" if not job.waiting else "released")
            log.info("reservation %s released: %s", who, why)
            post(kube, body, "Normal", "ReservationReleased", why)
