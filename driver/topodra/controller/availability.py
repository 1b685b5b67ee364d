"""How much of each ClaimProfile alternative is available right now (pure).

Input is what the API server holds: ResourceSlices of our driver, allocated
ResourceClaims, DeviceClasses, Nodes and DeviceTaintRules, read through the fleet
model (``topodra.fleet``).  A class is evaluated through its
``topodra.io/match`` annotation (see ``topodra.selectors``); a class without one is a
foreign class whose CEL we do not interpret, so its alternative is reported
with ``known: false`` and no counts rather than with a guess.

* ``devicesTotal``: published devices the class selects (newest pool generation).
* ``devicesFree``: of those, not in any claim's allocation and without a
  NoSchedule/NoExecute taint (in the slice or from a DeviceTaintRule): the fleet
  model's "unavailable" (``topodra.fleet``), the same the inventory and the scorer use.
* ``nodesFit``: nodes where ``count`` free devices satisfy the Required
  placement (same NVLink domain / NUMA node; RailAligned: one free NIC on each
  GPU's rail).  Preferred placement never reduces it (there is a fallback).  When the profile states what its
  pods request (``podRequests``, ``alignCpus``: ``controller/hostfit.py``), only nodes whose free CPU and memory
  (``fleet.hostres``: allocatable minus bound pods' requests, as NodeResourcesFit sees them) hold the pod count;
  ``nodesShortOfCpu``/``nodesShortOfMemory`` count the nodes that have the devices but not the room.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from topodra import DEFAULT_DRIVER_NAME
from topodra.controller.hostfit import PodShape, pod_shape, short_note, verdict
from topodra.controller.profile import Alternative, ClaimProfile
from topodra.controller.render import attribute_for
from topodra.fleet.allocations import allocated_keys, holders
from topodra.fleet.hostres import HostResources
from topodra.fleet.nodes import node_schedulable
from topodra.fleet.pools import newest_slices
from topodra.fleet.taints import blocking, device_taints, rule_taint
from topodra.selectors import MATCH_ANNOTATION, DeviceMatch, attribute, domain_attributes

Obj = dict[str, Any]


@dataclass(frozen=True)
class PublishedDevice:
    node: str
    pool: str
    name: str
    raw: Obj
    blocked: bool = False  # a NoSchedule/NoExecute taint, the slice's or a DeviceTaintRule's
    # The driver's attributes of ``raw``, parsed once when the snapshot is built (``selectors.domain_attributes``):
    # parsing them per class and per attribute read was 2 s of a 2,048-node pass. None: parse on use.
    attrs: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    def matches(self, match: DeviceMatch, driver: str) -> bool:
        """``match.matches(self.raw, driver)``, from the parsed attributes."""
        attrs = self.attrs if self.attrs is not None else domain_attributes(self.raw, driver)
        return match.matches_attributes(attrs, self.raw, driver)

    def attribute(self, name: str, driver: str) -> Any:
        """``selectors.attribute(self.raw, name, driver)``, from the parsed attributes."""
        if self.attrs is not None and name.startswith(driver + "/"):
            return self.attrs.get(name[len(driver) + 1:])
        return attribute(self.raw, name, driver)


@dataclass(frozen=True)
class AlternativeStatus:
    name: str
    device_class_name: str
    count: int
    known: bool
    devices_total: int | None = None
    devices_free: int | None = None
    nodes_fit: int | None = None
    message: str = ""
    # Set only when the pods' CPU/memory were counted: nodes with the devices but too little free CPU / memory.
    nodes_short_cpu: int | None = None
    nodes_short_memory: int | None = None
    host_note: str = ""  # "N node(s) have ... but too little free CPU ..." ('' when none is short)

    def to_api(self) -> Obj:
        out: Obj = {"name": self.name, "deviceClassName": self.device_class_name, "count": self.count,
                    "known": self.known}
        if self.known:
            out.update(devicesTotal=self.devices_total, devicesFree=self.devices_free,
                       nodesFit=self.nodes_fit)
            if self.nodes_short_cpu is not None:
                out.update(nodesShortOfCpu=self.nodes_short_cpu, nodesShortOfMemory=self.nodes_short_memory)
        return out


@dataclass(frozen=True)
class Snapshot:
    """The cluster facts one availability pass reads; shared by all profiles of one refresh."""

    devices: tuple[PublishedDevice, ...]
    allocated: frozenset[tuple[str, str]]  # (pool, device)
    classes: dict[str, Obj]
    # Nodes no ordinary pod can land on now (cordoned, not Ready, NoSchedule/NoExecute taints):
    # their free devices still count as free, but the node does not count in nodesFit.
    unavailable_nodes: frozenset[str] = frozenset()
    # Node name -> labels: where each node sits in the fabric (multi-node profiles, controller/gang.py).
    node_labels: dict[str, dict[str, str]] = field(default_factory=dict)
    # Free CPU and memory per node (allocatable minus bound pods' requests); None: pods were not read, so
    # nodesFit counts devices only, and ``host_error`` says why when a read was asked for and failed.
    host: HostResources | None = field(default=None, compare=False)
    host_error: str = ""
    # DeviceTaintRules with an effect (reservations tell their own rules apart, controller/reserve.py).
    rules: tuple[Obj, ...] = field(default=(), compare=False, repr=False)
    # (namespace, claim) -> the (pool, device) pairs its allocation holds: who holds an allocated device.
    claim_devices: Mapping[tuple[str, str], tuple[tuple[str, str], ...]] = field(
        default_factory=dict, compare=False, repr=False)
    # The bound, unfinished pods the host view was built from (None: pods were not read).
    pods: tuple[Obj, ...] | None = field(default=None, compare=False, repr=False)
    # The devices each class predicate selects, by (driver, predicate), filled on first use. Snapshots with the
    # same ``devices`` share it (``controller.facts``: a pass after a claim or node change matches no device
    # again); matching every device against every alternative's class was 0.2 of 0.3 s CPU at 2,048 nodes.
    matched: dict[tuple[str, DeviceMatch], tuple[PublishedDevice, ...]] = field(
        default_factory=dict, compare=False, repr=False)
    # How to fill ``matched`` when not by testing every device (``controller.facts``: from what each slice's
    # devices matched before, so a slice event re-matches that slice alone). Same result, in ``devices`` order.
    match_source: Callable[[DeviceMatch, str], tuple[PublishedDevice, ...]] | None = field(
        default=None, compare=False, repr=False)

    def matching(self, match: DeviceMatch, driver: str) -> tuple[PublishedDevice, ...]:
        """The devices ``match`` selects, in ``devices`` order."""
        got = self.matched.get((driver, match))
        if got is None:
            got = (self.match_source(match, driver) if self.match_source is not None
                   else tuple(d for d in self.devices if d.matches(match, driver)))
            self.matched[(driver, match)] = got
        return got


def published_devices(slices: Iterable[Obj], driver: str, taint_rules: Iterable[Obj] = ()) -> list[PublishedDevice]:
    """Devices of ``driver`` from the newest generation of each pool, each with whether a taint blocks it."""
    rules = [r for r in taint_rules if rule_taint(r) is not None]
    out: list[PublishedDevice] = []
    for s in newest_slices(slices, driver):
        spec = s["spec"]
        name = str((spec.get("pool") or {}).get("name", ""))
        node = spec.get("nodeName") or name
        for dev in spec.get("devices") or []:
            out.append(PublishedDevice(node=str(node), pool=name, name=str(dev.get("name", "")), raw=dev,
                                       attrs=domain_attributes(dev, driver),
                                       blocked=blocking(device_taints(dev, rules, driver, name))))
    return out


def allocated_devices(claims: Iterable[Obj], driver: str) -> frozenset[tuple[str, str]]:
    """(pool, device) pairs held by allocated claims of ``driver``."""
    return frozenset(holders(claims, driver))


def claim_devices(claims: Iterable[Obj], driver: str) -> dict[tuple[str, str], tuple[tuple[str, str], ...]]:
    """(namespace, claim) -> the (pool, device) pairs of ``driver`` its allocation holds (allocated claims only)."""
    out: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {}
    for c in claims:
        held = allocated_keys(c, driver)
        if held:
            meta = c.get("metadata") or {}
            out[(str(meta.get("namespace", "")), str(meta.get("name", "")))] = held
    return out


def unavailable_nodes(nodes: Iterable[Obj]) -> frozenset[str]:
    """Nodes a pod without special tolerations cannot be scheduled to right now."""
    return frozenset(str((n.get("metadata") or {}).get("name", "")) for n in nodes if not node_schedulable(n))


def host_resources(nodes: Iterable[Obj], pods: Iterable[Obj]) -> HostResources:
    """The scorer's NodeResourcesFit view (``fleet.hostres``) of these nodes and pods."""
    host = HostResources()
    host.replace_nodes(nodes)
    host.replace_pods(pods)
    return host


def make_snapshot(slices: Iterable[Obj], claims: Iterable[Obj], classes: Iterable[Obj],
                  driver: str = DEFAULT_DRIVER_NAME, nodes: Iterable[Obj] = (),
                  taint_rules: Iterable[Obj] = (), pods: Iterable[Obj] | None = None) -> Snapshot:
    """``pods`` None: CPU and memory are not counted (no profile asked, or pods could not be read)."""
    nodes = list(nodes)
    claims = list(claims)
    taint_rules = [r for r in taint_rules if rule_taint(r) is not None]
    pods = list(pods) if pods is not None else None
    return Snapshot(
        devices=tuple(published_devices(slices, driver, taint_rules)),
        allocated=allocated_devices(claims, driver),
        rules=tuple(taint_rules),
        claim_devices=claim_devices(claims, driver),
        pods=tuple(pods) if pods is not None else None,
        classes={(c.get("metadata") or {}).get("name", ""): c for c in classes},
        unavailable_nodes=unavailable_nodes(nodes),
        node_labels={str((n.get("metadata") or {}).get("name", "")): dict((n.get("metadata") or {}).get("labels") or {})
                     for n in nodes},
        host=host_resources(nodes, pods) if pods is not None else None,
    )


def class_match(device_class: Obj | None) -> tuple[DeviceMatch | None, str]:
    """The class's predicate, or None and why it cannot be evaluated."""
    if device_class is None:
        return None, "DeviceClass not found"
    text = ((device_class.get("metadata") or {}).get("annotations") or {}).get(MATCH_ANNOTATION)
    if not text:
        return None, f"DeviceClass has no {MATCH_ANNOTATION} annotation (not a topodra class)"
    try:
        return DeviceMatch.from_annotation(text), ""
    except (ValueError, ValidationError) as e:
        return None, f"DeviceClass annotation {MATCH_ANNOTATION} is invalid: {e}"


def _pairs_by_rail(gpus: list[PublishedDevice], nics: list[PublishedDevice], driver: str) -> int:
    """How many GPU+NIC pairs sharing a rail can be formed (exact: per-rail minimum)."""
    rail_attr = f"{driver}/rail"
    g = Counter(d.attribute(rail_attr, driver) for d in gpus)
    n = Counter(d.attribute(rail_attr, driver) for d in nics)
    return sum(min(cnt, n[r]) for r, cnt in g.items() if r is not None)


def placement_groups(gpus: list[PublishedDevice], count: int, profile: ClaimProfile,
                     driver: str) -> tuple[list[list[PublishedDevice]], bool]:
    """The free GPUs of one node split by the attributes a Required placement must match (NVLink domain,
    NUMA node; with RailAligned and count > 1 the model too), and whether NICs must pair by rail."""
    topo = profile.spec.topology
    attrs = [attribute_for(d, driver) for d in ("nvlink", "numa") if getattr(topo, d) == "Required"]
    rail = topo.nic == "RailAligned"
    if rail and count > 1:
        attrs.append(f"{driver}/model")
    groups: dict[tuple[Any, ...], list[PublishedDevice]] = defaultdict(list)
    for d in gpus:
        key = tuple(d.attribute(a, driver) for a in attrs)
        if None in key:
            continue  # a device lacking the attribute cannot satisfy matchAttribute
        groups[key].append(d)
    return list(groups.values()), rail


def node_fits(gpus: list[PublishedDevice], nics: list[PublishedDevice], count: int, profile: ClaimProfile,
              driver: str) -> bool:
    """Whether ``count`` of these free GPUs (one node) satisfy the Required placement."""
    groups, rail = placement_groups(gpus, count, profile, driver)
    for members in groups:
        have = _pairs_by_rail(members, nics, driver) if rail else len(members)
        if have >= count:
            return True
    return False


def alternative_status(alt: Alternative, profile: ClaimProfile, snap: Snapshot, driver: str,
                       nic_match: DeviceMatch | None) -> AlternativeStatus:
    match, why = class_match(snap.classes.get(alt.device_class_name))
    name, cls, count = alt.effective_name, alt.device_class_name, alt.count
    if match is None:
        return AlternativeStatus(name, cls, count, known=False, message=why)
    if profile.spec.topology.nic == "RailAligned" and nic_match is None:
        return AlternativeStatus(name, cls, count, known=False, message="the NIC class cannot be evaluated")
    chosen = snap.matching(match, driver)
    free = [d for d in chosen if (d.pool, d.name) not in snap.allocated and not d.blocked]
    free_by_node: dict[str, list[PublishedDevice]] = defaultdict(list)
    for d in free:
        free_by_node[d.node].append(d)
    nics_by_node: dict[str, list[PublishedDevice]] = defaultdict(list)
    if nic_match is not None:
        for d in snap.matching(nic_match, driver):
            if (d.pool, d.name) not in snap.allocated and not d.blocked:
                nics_by_node[d.node].append(d)
    device_fit = [node for node, gpus in free_by_node.items()
                  if node not in snap.unavailable_nodes
                  and node_fits(gpus, nics_by_node.get(node, []), alt.count, profile, driver)]
    shape = pod_shape(profile)
    if shape is None or snap.host is None:
        fit = len(device_fit)
        why = "" if fit else why_not(profile, cls, count, len(chosen), len(free))
        return AlternativeStatus(name, cls, count, known=True, devices_total=len(chosen), devices_free=len(free),
                                 nodes_fit=fit, message=why)
    return _with_host(AlternativeStatus(name, cls, count, known=True, devices_total=len(chosen),
                                        devices_free=len(free)), profile, device_fit, snap.host, shape)


def _with_host(base: AlternativeStatus, profile: ClaimProfile, device_fit: list[str], host: HostResources,
               shape: PodShape) -> AlternativeStatus:
    """``base`` with nodesFit counting only the device-fitting nodes whose free CPU and memory hold the pod."""
    verdicts = [verdict(host, node, shape) for node in device_fit]
    fit = sum(1 for v in verdicts if v.fits)
    short_cpu = sum(1 for v in verdicts if v.short_cpu)
    short_mem = sum(1 for v in verdicts if v.short_memory)
    note = short_note(len(verdicts) - fit, short_cpu, short_mem, shape,
                      f"the {base.count} free device(s){placement_words(profile)}")
    why = ""
    if not fit:
        why = note if device_fit else why_not(profile, base.device_class_name, base.count, base.devices_total or 0,
                                              base.devices_free or 0)
    return replace(base, nodes_fit=fit, message=why, nodes_short_cpu=short_cpu, nodes_short_memory=short_mem,
                   host_note=note)


def why_not(profile: ClaimProfile, device_class: str, count: int, total: int, free: int) -> str:
    """One line on why an alternative fits on no node now (shown in the profile's status.message)."""
    if total == 0:
        return f"no published device matches DeviceClass {device_class}"
    if free < count:
        return f"{free} of {total} devices free, {count} needed"
    return f"{free} of {total} devices free, but no node has {count} free{placement_words(profile)}"


def placement_words(profile: ClaimProfile) -> str:
    """`` in one NVLink domain, each with a free NIC on its rail``: the Required placement, for messages."""
    topo = profile.spec.topology
    where = [text for dim, text in (("nvlink", " in one NVLink domain"), ("numa", " on one NUMA node"))
             if getattr(topo, dim) == "Required"]
    if topo.nic == "RailAligned":
        where.append(" each with a free NIC on its rail")
    return ",".join(where)


def profile_availability(profile: ClaimProfile, snap: Snapshot, *, driver: str = DEFAULT_DRIVER_NAME,
                         nic_class: str = "nic.topodra.io") -> list[AlternativeStatus]:
    """One status entry per alternative, in the profile's order."""
    nic_match = None
    if profile.spec.topology.nic == "RailAligned":
        nic_match, _ = class_match(snap.classes.get(nic_class))
    return [alternative_status(a, profile, snap, driver, nic_match) for a in profile.spec.alternatives]
