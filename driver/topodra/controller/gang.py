"""Multi-node profiles: one PodGroup per profile, one GPU type and one fabric level for the whole gang.

kube-scheduler 1.37 gangs on a ``scheduling.k8s.io/v1beta1`` PodGroup that pods name in
``spec.schedulingGroup.podGroupName``.  Nothing in kube-controller-manager turns a Workload into PodGroups
(only the Job controller does, for its own Jobs, behind the alpha ``WorkloadWithJob``), so the controller
writes the PodGroup itself, named like the profile: one profile is one job instance, and every pod of the
job names both the profile's ResourceClaimTemplate and its PodGroup.

Why the controller chooses instead of the scheduler: ``firstAvailable`` is decided per claim, so the pods of
one gang could get different GPU types, and the PodGroup's topology constraint takes exactly one label key
with no preferred mode.  So the controller picks, from the fleet's free devices, the first (alternative,
level) that can hold the *whole* job now, renders the template with that alternative only and the PodGroup
with that level's key.  When nothing fits, it renders the first alternative with the widest level (the
scheduler keeps the gang waiting) and re-evaluates on every pass.  Once a pod of the job exists, its claim
came from the template as it was, so the choice is fixed until those pods are gone.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from topodra.apipaths import pod_path
from topodra.controller.availability import PublishedDevice, Snapshot, class_match, placement_groups
from topodra.controller.gangspec import level_key
from topodra.controller.hostfit import fewer_note, pod_shape, verdict
from topodra.controller.profile import API_VERSION, KIND, Alternative, ClaimProfile
from topodra.controller.render import MANAGED_BY, PROFILE_LABEL
from topodra.kube import Kube, KubeError
from topodra.selectors import DeviceMatch, attribute

Obj = dict[str, Any]

PODGROUP_API = "scheduling.k8s.io/v1beta1"
ALT_ANNOTATION = "topodra.io/gang-alternative"
LEVEL_ANNOTATION = "topodra.io/gang-level"
WHOLE_CLUSTER = "cluster"  # the level name shown when a profile has pods but no acrossNodes
NOT_SERVED = ("scheduling.k8s.io/v1beta1 PodGroups are not served: turn on GenericWorkload (apiserver, scheduler, "
              "controller-manager), TopologyAwareWorkloadScheduling for acrossNodes, and "
              "--runtime-config=scheduling.k8s.io/v1beta1=true (docs/multi-node.md)")


def podgroup_path(namespace: str, name: str | None = None) -> str:
    base = f"/apis/{PODGROUP_API}/namespaces/{namespace}/podgroups"
    return f"{base}/{name}" if name else base


@dataclass(frozen=True)
class Choice:
    """Which alternative and which level the whole job gets."""

    alternative: str  # effective name
    level: str | None  # as written in sameDomain; None: no topology constraint
    fits: bool | None  # None: the cluster state could not be evaluated
    domains: int = 0  # domains of that level that hold the whole job now
    fixed: bool = False  # pods of the job exist: the choice stays
    message: str = ""

    @property
    def key(self) -> str | None:
        return level_key(self.level) if self.level else None


# --- pure: capacity and the choice ----------------------------------------------------------------------------

def pods_on_node(gpus: list[PublishedDevice], nics: list[PublishedDevice], count: int, profile: ClaimProfile,
                 driver: str) -> int:
    """How many claims of ``count`` of these free devices (one node) fit at once, honouring Required placement."""
    groups, rail = placement_groups(gpus, count, profile, driver)
    total = 0
    rail_attr = f"{driver}/rail"
    nic_rails: dict[Any, int] = defaultdict(int)
    for n in nics:
        nic_rails[attribute(n.raw, rail_attr, driver)] += 1
    for members in groups:
        if rail:
            have: dict[Any, int] = defaultdict(int)
            for g in members:
                have[attribute(g.raw, rail_attr, driver)] += 1
            usable = 0
            for r, cnt in have.items():
                if r is None:
                    continue
                take = min(cnt, nic_rails[r])
                nic_rails[r] -= take  # a NIC pairs with one GPU only
                usable += take
            total += usable // count
        else:
            total += len(members) // count
    return total


@dataclass(frozen=True)
class Capacity:
    """Node -> pods of one alternative it takes now, and how many nodes the free CPU/memory cut down."""

    per_node: dict[str, int]
    short_cpu: int = 0  # nodes whose free devices hold a pod but whose free CPU holds fewer (or none)
    short_memory: int = 0
    short: int = 0  # nodes short of either


def free_capacity(alt: Alternative, profile: ClaimProfile, snap: Snapshot, driver: str,
                  nic_match: DeviceMatch | None) -> dict[str, int] | None:
    """Node -> how many pods of this alternative it can take now; None when the class cannot be evaluated."""
    cap = capacity(alt, profile, snap, driver, nic_match)
    return None if cap is None else cap.per_node


def capacity(alt: Alternative, profile: ClaimProfile, snap: Snapshot, driver: str,
             nic_match: DeviceMatch | None) -> Capacity | None:
    """``free_capacity`` with the count of nodes whose free CPU or memory holds fewer pods than their devices.

    With a stated pod shape (``controller/hostfit.py``) and a host view in the snapshot, a node takes at most
    as many pods as its free CPU and memory hold (``fleet.hostres``, the scorer's NodeResourcesFit view)."""
    match, _why = class_match(snap.classes.get(alt.device_class_name))
    if match is None or (profile.spec.topology.nic == "RailAligned" and nic_match is None):
        return None
    free: dict[str, list[PublishedDevice]] = defaultdict(list)
    nics: dict[str, list[PublishedDevice]] = defaultdict(list)
    for d in snap.devices:
        if (d.pool, d.name) in snap.allocated or d.blocked or d.node in snap.unavailable_nodes:
            continue
        if match.matches(d.raw, driver):
            free[d.node].append(d)
        elif nic_match is not None and nic_match.matches(d.raw, driver):
            nics[d.node].append(d)
    by_devices = {node: n for node, gpus in free.items()
                  if (n := pods_on_node(gpus, nics.get(node, []), alt.count, profile, driver)) > 0}
    shape = pod_shape(profile)
    if shape is None or snap.host is None:
        return Capacity(by_devices)
    per_node: dict[str, int] = {}
    short_cpu = short_mem = short = 0
    for node, n in by_devices.items():
        v = verdict(snap.host, node, shape)
        room = n if v.pods is None else min(n, v.pods)
        if room < n:  # the free CPU or memory, not the devices, limits this node
            short += 1
            short_cpu += int(v.pods_by_cpu is not None and v.pods_by_cpu < n)
            short_mem += int(v.pods_by_memory is not None and v.pods_by_memory < n)
        if room > 0:
            per_node[node] = room
    return Capacity(per_node, short_cpu, short_mem, short)


def domain_capacity(capacity: dict[str, int], node_labels: dict[str, dict[str, str]],
                    key: str | None) -> dict[str, int]:
    """Domain value -> pods it can take; nodes without the label are in no domain (the scheduler skips them)."""
    if key is None:
        return {WHOLE_CLUSTER: sum(capacity.values())}
    out: dict[str, int] = defaultdict(int)
    for node, n in capacity.items():
        value = (node_labels.get(node) or {}).get(key)
        if value is not None:
            out[value] += n
    return dict(out)


def choose(profile: ClaimProfile, snap: Snapshot, *, driver: str, nic_class: str) -> Choice:
    """The first (alternative, level) in preference order that can hold the whole job now."""
    spec = profile.spec
    pods = spec.pods or 1
    levels: list[str | None] = list(spec.across_nodes.same_domain) if spec.across_nodes else [None]
    nic_match = class_match(snap.classes.get(nic_class))[0] if spec.topology.nic == "RailAligned" else None
    full = {a.effective_name: capacity(a, profile, snap, driver, nic_match) for a in spec.alternatives}
    caps = {name: (c.per_node if c is not None else None) for name, c in full.items()}
    shape = pod_shape(profile)
    if spec.topology.order == "TopologyFirst":
        pairs = [(a, lv) for lv in levels for a in spec.alternatives]
    else:
        pairs = [(a, lv) for a in spec.alternatives for lv in levels]
    tried: list[str] = []
    for alt, level in pairs:
        cap = caps[alt.effective_name]
        if cap is None:
            continue
        per_domain = domain_capacity(cap, snap.node_labels, level_key(level) if level else None)
        holding = sorted(d for d, n in per_domain.items() if n >= pods)
        where = f"one {level}" if level else "the cluster"
        if holding:
            return Choice(alt.effective_name, level, True, len(holding),
                          message=f"{alt.effective_name} in {where}: {len(holding)} domain(s) hold all {pods} pods "
                                  f"now ({', '.join(holding[:5])}{', ...' if len(holding) > 5 else ''})"
                                  + (f"; preferred but too small now: {'; '.join(tried)}" if tried else ""))
        c = full[alt.effective_name]
        host = (f" ({fewer_note(c.short, c.short_cpu, c.short_memory, shape)})"
                if c is not None and c.short and shape is not None else "")
        tried.append(f"{alt.effective_name} in {where}: at most {max(per_domain.values(), default=0)} of {pods}"
                     + host)
    known = [a for a in spec.alternatives if caps[a.effective_name] is not None]
    first = (known or list(spec.alternatives))[0]
    if not known:
        return Choice(first.effective_name, levels[-1], None,
                      message="no alternative's DeviceClass can be evaluated (not topodra classes); "
                              "rendered the first alternative with the widest level")
    return Choice(first.effective_name, levels[-1], False,
                  message=f"nothing holds the whole job now ({'; '.join(tried)}); rendered "
                          f"{first.effective_name} in {f'one {levels[-1]}' if levels[-1] else 'the cluster'} "
                          "and re-evaluating")


def restricted(profile: ClaimProfile, alternative: str) -> ClaimProfile:
    """The profile with only the chosen alternative: every pod's claim asks for the same GPU type."""
    alts = tuple(a for a in profile.spec.alternatives if a.effective_name == alternative)
    if not alts:
        raise ValueError(f"profile has no alternative {alternative!r}")
    return profile.model_copy(update={"spec": profile.spec.model_copy(update={"alternatives": alts})})


def render_podgroup(profile: ClaimProfile, choice: Choice) -> Obj:
    """The PodGroup: gang of ``pods``, the chosen level's key as its one topology constraint."""
    meta = profile.metadata
    spec: Obj = {"schedulingPolicy": {"gang": {"minCount": profile.spec.pods}}}
    if choice.key:
        spec["schedulingConstraints"] = {"topology": [{"key": choice.key}]}
    return {
        "apiVersion": PODGROUP_API, "kind": "PodGroup",
        "metadata": {
            "name": meta.name, "namespace": meta.namespace,
            "labels": {PROFILE_LABEL: meta.name, MANAGED_BY[0]: MANAGED_BY[1]},
            "annotations": {ALT_ANNOTATION: choice.alternative, LEVEL_ANNOTATION: choice.level or ""},
            "ownerReferences": [{"apiVersion": API_VERSION, "kind": KIND, "name": meta.name, "uid": meta.uid,
                                 "controller": True, "blockOwnerDeletion": False}],
        },
        "spec": spec,
    }


def recorded_choice(podgroup: Obj | None, profile: ClaimProfile) -> Choice | None:
    """The choice an existing PodGroup of ours was rendered with, if it still names this profile's options."""
    if podgroup is None:
        return None
    ann = (podgroup.get("metadata") or {}).get("annotations") or {}
    alt, level = ann.get(ALT_ANNOTATION), ann.get(LEVEL_ANNOTATION)
    levels = list(profile.spec.across_nodes.same_domain) if profile.spec.across_nodes else []
    if alt not in {a.effective_name for a in profile.spec.alternatives} or level is None:
        return None
    if (level in levels) if level else not levels:
        return Choice(alt, level or None, None, fixed=True)
    return None


def members(pods: list[Obj], group: str) -> list[Obj]:
    """Pods (not finished) that name this PodGroup."""
    return [p for p in pods
            if ((p.get("spec") or {}).get("schedulingGroup") or {}).get("podGroupName") == group
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            and not (p.get("metadata") or {}).get("deletionTimestamp")]


def gang_status(profile: ClaimProfile, choice: Choice, pods: list[Obj], snap: Snapshot | str, note: str) -> Obj:
    """``status.gang``: the alternative and level the job got, and once bound, the domain value(s)."""
    alt = next(a for a in profile.spec.alternatives if a.effective_name == choice.alternative)
    bound = [str(p["spec"]["nodeName"]) for p in pods if (p.get("spec") or {}).get("nodeName")]
    domains: list[str] = []
    if choice.key and isinstance(snap, Snapshot):
        domains = sorted({v for n in bound if (v := (snap.node_labels.get(n) or {}).get(choice.key)) is not None})
    out: Obj = {"podGroup": profile.metadata.name, "pods": profile.spec.pods, "alternative": choice.alternative,
                "deviceClassName": alt.device_class_name, "level": choice.level or WHOLE_CLUSTER,
                "topologyKey": choice.key, "fixed": choice.fixed, "podsCreated": len(pods), "podsBound": len(bound),
                "domain": ",".join(domains) or None, "message": "; ".join(m for m in (choice.message, note) if m)}
    if choice.fits is not None:
        out["fitsNow"] = choice.fits
        out["domainsFit"] = choice.domains
    return out


# --- effects: read what exists, write the PodGroup ------------------------------------------------------------

@dataclass(frozen=True)
class GangPlan:
    choice: Choice
    podgroup: Obj | None  # as read
    pods: list[Obj]  # members, as read


def plan(kube: Kube, profile: ClaimProfile, snap: Snapshot | str, *, driver: str, nic_class: str) -> GangPlan:
    """Read the PodGroup and its pods; keep a fixed choice, else choose from the fleet now."""
    ns, name = profile.metadata.namespace, profile.metadata.name
    pg = kube.get(podgroup_path(ns, name))
    pods = members(list(kube.list(pod_path(ns))), name)
    old = recorded_choice(pg, profile) if pg is not None and owned(pg, profile) else None
    if old is not None and pods:
        msg = f"fixed while {len(pods)} pod(s) of the job exist"
        return GangPlan(Choice(old.alternative, old.level, None, fixed=True, message=msg), pg, pods)
    if isinstance(snap, str):
        keep = old or Choice(profile.spec.alternatives[0].effective_name,
                             (profile.spec.across_nodes.same_domain[-1] if profile.spec.across_nodes else None), None)
        return GangPlan(Choice(keep.alternative, keep.level, None, message=snap), pg, pods)
    return GangPlan(choose(profile, snap, driver=driver, nic_class=nic_class), pg, pods)


def owned(obj: Obj, profile: ClaimProfile) -> bool:
    meta = obj.get("metadata") or {}
    if any(r.get("uid") == profile.metadata.uid and r.get("kind") == KIND for r in meta.get("ownerReferences") or []):
        return True
    labels = meta.get("labels") or {}
    return labels.get(MANAGED_BY[0]) == MANAGED_BY[1] and labels.get(PROFILE_LABEL) == profile.metadata.name


def apply(kube: Kube, profile: ClaimProfile, gp: GangPlan) -> str:
    """Make the PodGroup match the plan; returns a note for the status ('' when nothing to say)."""
    ns, name = profile.metadata.namespace, profile.metadata.name
    want = render_podgroup(profile, gp.choice)
    pg = gp.podgroup
    if pg is not None and not owned(pg, profile):
        return (f"PodGroup {ns}/{name} exists and is not managed by this profile; the gang is not scheduled "
                "as rendered: rename the profile or delete that PodGroup")
    if pg is not None and (pg.get("metadata") or {}).get("deletionTimestamp"):
        return f"waiting for the previous PodGroup {name} to be deleted (pods still name it)"
    if pg is not None:
        ann = (pg.get("metadata") or {}).get("annotations") or {}
        same = (ann.get(ALT_ANNOTATION) == want["metadata"]["annotations"][ALT_ANNOTATION]
                and ann.get(LEVEL_ANNOTATION) == want["metadata"]["annotations"][LEVEL_ANNOTATION]
                and (pg.get("spec") or {}).get("schedulingConstraints") == want["spec"].get("schedulingConstraints"))
        if same:
            if ((pg.get("spec") or {}).get("schedulingPolicy") or {}) != want["spec"]["schedulingPolicy"]:
                policy = want["spec"]["schedulingPolicy"]  # minCount is the one mutable field
                kube.merge_patch(podgroup_path(ns, name), {"spec": {"schedulingPolicy": policy}})
            return ""
        if gp.pods:  # pods exist but name a PodGroup rendered for other options (profile edited): leave it
            return ("the PodGroup was rendered for options the profile no longer has; "
                    "it changes once the job's pods are gone")
        # schedulingConstraints is immutable: replace the PodGroup (no pod names it yet).
        uid = (pg.get("metadata") or {}).get("uid")
        kube.request("DELETE", podgroup_path(ns, name), {"preconditions": {"uid": uid}} if uid else None)
    try:
        kube.create(podgroup_path(ns), want)
    except KubeError as e:
        if e.status == 409:  # the old one is still finalizing; the next pass creates it
            return f"PodGroup {name} is being replaced"
        if e.status == 404:  # the API is not served: nothing gangs these pods
            return NOT_SERVED
        raise
    return ""
