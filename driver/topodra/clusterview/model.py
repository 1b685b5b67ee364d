"""The inventory as plain data, built from raw API objects (JSON dicts) with no I/O.

Every number ``topodra inventory`` prints, draws or exports comes from ``build_view``:

* per node: each GPU and compute NIC with its state -- ``allocated`` (in some claim's
  ``status.allocation``), else ``reserved`` (its only blocking taints are reservation holds, issue 33:
  ``topodra.reservations``; the cell names the reserving profile), else ``tainted`` (a NoSchedule/NoExecute
  taint in its slice or from a DeviceTaintRule), else ``free`` -- and the free count per NVLink domain and
  per rail;
* per GPU model: total/free/allocated/tainted (reserved ones included: no ordinary claim gets them) and
  reserved, whole free NVLink domains, how many of the free
  GPUs sit on unschedulable nodes (cordoned, not Ready, NoSchedule/NoExecute node taint: free,
  yet no claim lands there now), and the largest claim placeable now on a schedulable node:
  any ``count`` GPUs, ``count`` GPUs on one NVLink domain, ``count`` rail-aligned GPUs (each with
  its own free NIC on its rail);
* fragmentation: the placement scorer's F_n (``topodra.fleet.fgd``, docs/placement.md):
  the expected number of a node's free GPUs the next request cannot use, over the scorer's
  request mix (its prior mixed with the claims seen). It is computed on the fleet state the
  scorer optimises (``topodra.fleet.state``): allocated and blocking-tainted devices unavailable;
* pending claims: unallocated claims with the scheduler's reason from their pod's
  ``PodScheduled`` condition, grouped by cause;
* what the allocated GPUs do (``clusterview.usage``): each GPU's activity and memory in use, and whether its
  claim is idle, from the summary and the ``Idle`` condition the kubelet plugin writes into the claim's
  ``status.devices``; per node the mean over its allocated GPUs, per namespace GPU-hours allocated against
  GPU-hours active, and the idle claims.
"""

from __future__ import annotations

import functools
import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from topodra import DEFAULT_DRIVER_NAME
from topodra.clusterview.hostcols import HostCols, host_columns
from topodra.clusterview.usage import DeviceUse, IdleClaim, NamespaceUse, device_uses, idle_claims, mean, namespace_uses

# The fleet state and measure (selectors, pydantic: ~0.1 s to import) are imported inside ``build_view``:
# the renderers and the ``--watch --png`` worker need only the dataclasses here, and a fork that happens
# before those imports leaves them to the process that builds the view. ``fleet.pools``, ``allocations``,
# ``taints`` and ``nodes`` import nothing heavy.
from topodra.fleet.allocations import holders
from topodra.fleet.nodes import why_unschedulable
from topodra.fleet.pools import newest_slices
from topodra.fleet.taints import BLOCKING_EFFECTS, blocking, device_taints, rule_matches, rule_taint, taint_text
from topodra.reservations import HOLD_EFFECT, PROFILE_NAME_LABEL, PROFILE_NS_LABEL, RESERVATION_TAINT_KEY

Obj = dict[str, Any]
MIG_PARENT_TYPE = "gpu-mig-parent"  # sharing.mig.MIG_PARENT_TYPE, not imported here: sharing.mig needs pydantic
DEFAULT_PRIOR_WEIGHT = 20.0  # the placement scorer's --prior-weight default (fleet.fgd)
DEFAULT_WINDOW = 200  # the placement scorer's --window default (fleet.fgd)
FREE, ALLOCATED, TAINTED, RESERVED = "free", "allocated", "tainted", "reserved"
NO_POD = "no pod uses the claim yet (DRA allocates a claim when a pod using it is scheduled)"
NOT_TRIED = "waiting for the scheduler (no scheduling attempt reported yet)"


# --------------------------------------------------------------------------- the result


@dataclass(frozen=True)
class Sources:
    """The raw API objects one view is built from."""

    slices: tuple[Obj, ...] = ()
    claims: tuple[Obj, ...] = ()
    classes: tuple[Obj, ...] = ()
    nodes: tuple[Obj, ...] = ()
    pods: tuple[Obj, ...] = ()
    taint_rules: tuple[Obj, ...] = ()


@dataclass(frozen=True)
class Cell:
    """One GPU or compute NIC."""

    name: str
    pool: str
    kind: str  # gpu | nic
    state: str  # free | allocated | reserved | tainted
    model: str | None = None
    domain: str | None = None  # nvlinkDomain
    rail: int | None = None
    namespace: str | None = None  # of the claim holding it
    claim: str | None = None
    taints: tuple[str, ...] = ()  # "key=value:Effect", blocking or not
    reservation: str | None = None  # reserved: the reserving profile, "namespace/name" (its uid without labels)
    activity: float | None = None  # allocated GPU: mean compute activity of the claim's last summary (0-1)
    memory_used: float | None = None  # ... and its memory in use (share of the GPU's)
    idle: bool = False  # allocated GPU whose claim carries the Idle condition


@dataclass(frozen=True)
class DomainCount:
    domain: str
    label: str  # short form for tables and pictures
    free: int
    total: int


@dataclass(frozen=True)
class RailCount:
    rail: int | None
    free: int
    total: int


@dataclass(frozen=True)
class NodeRow:
    name: str
    model: str  # the node's GPU model ("A+B" for mixed nodes, "" without GPUs)
    schedulable: bool  # Ready, not cordoned, no NoSchedule/NoExecute node taint
    gpus: tuple[Cell, ...]
    nics: tuple[Cell, ...]
    domains: tuple[DomainCount, ...]
    rails: tuple[RailCount, ...]
    fragmentation: float  # F_n: expected free GPUs the next request cannot use
    unschedulable_reason: str = ""  # why no pod lands here now ("cordoned", "not Ready", "tainted k:E")
    host: HostCols | None = None  # free CPU and memory, GPUs they strand (None: allocatable unknown)
    fabric: dict[str, str] = field(default_factory=dict)  # fabric tier key -> value (clusterview.domains)
    activity: float | None = None  # mean over its allocated GPUs with a summary (None: none has one)
    memory_used: float | None = None

    def count(self, state: str) -> int:
        return sum(1 for g in self.gpus if g.state == state)

    @property
    def tainted_devices(self) -> tuple[str, ...]:
        return tuple(d.name for d in (*self.gpus, *self.nics) if d.state == TAINTED)

    @property
    def reserved_gpus(self) -> dict[str, int]:
        """Reserved GPUs per reserving profile."""
        return dict(Counter(str(g.reservation) for g in self.gpus if g.state == RESERVED))


@dataclass(frozen=True)
class Largest:
    """The largest claim placeable now on one schedulable node."""

    count: int  # any GPUs of the model
    nvlink: int  # on one NVLink domain
    rail_aligned: int  # each GPU with its own free NIC on its rail


@dataclass(frozen=True)
class ModelSummary:
    model: str
    nodes: int
    total: int
    free: int
    allocated: int
    tainted: int  # blocked by a taint, reservations included
    largest: Largest
    nvlink_domains: int
    nvlink_domains_free: int  # every GPU of the domain free (multi-node domains: on every node)
    fragmentation: float  # sum of F_n over the model's nodes
    fragmentation_ratio: float  # fragmentation / free (0 when nothing is free)
    unschedulable_nodes: int = 0  # of ``nodes``, those no pod can land on now
    free_unschedulable: int = 0  # of ``free``, the GPUs on those nodes (no claim can get them now)
    reserved: int = 0  # of ``tainted``, those held by a reservation (issue 33)


@dataclass(frozen=True)
class PendingClaim:
    namespace: str
    name: str
    device_classes: tuple[str, ...]
    pod: str | None
    reason: str  # the scheduler's reason (grouped form)
    message: str  # the scheduler's message as written


@dataclass(frozen=True)
class PendingGroup:
    reason: str
    claims: tuple[str, ...]  # namespace/name


@dataclass(frozen=True)
class ClusterView:
    driver: str
    nodes: tuple[NodeRow, ...]
    models: tuple[ModelSummary, ...]
    pending: tuple[PendingClaim, ...]
    pending_groups: tuple[PendingGroup, ...]
    mix: tuple[tuple[str, float], ...] = field(default=())  # request classes of the fragmentation measure
    device_classes: tuple[str, ...] = ()  # every DeviceClass in the cluster (pending counts default to 0)
    namespaces: tuple[NamespaceUse, ...] = ()  # GPU-hours allocated and active, per namespace holding GPUs
    idle_claims: tuple[IdleClaim, ...] = ()

    @property
    def total(self) -> int:
        return sum(m.total for m in self.models)

    @property
    def free(self) -> int:
        return sum(m.free for m in self.models)

    @property
    def allocated(self) -> int:
        return sum(m.allocated for m in self.models)

    @property
    def tainted(self) -> int:
        return sum(m.tainted for m in self.models)

    @property
    def reserved(self) -> int:
        return sum(m.reserved for m in self.models)

    @property
    def fragmentation(self) -> float:
        return sum(n.fragmentation for n in self.nodes)

    @property
    def free_unschedulable(self) -> int:
        """Free GPUs on unschedulable nodes: counted in ``free``, yet no claim can get them now."""
        return sum(m.free_unschedulable for m in self.models)

    @property
    def stranded_by_host(self) -> tuple[int, int]:
        """Free GPUs stranded by CPU and by memory, over all nodes (``clusterview.hostcols``)."""
        hs = [n.host for n in self.nodes if n.host is not None]
        return sum(h.gpus_stranded_cpu for h in hs), sum(h.gpus_stranded_memory for h in hs)

    @property
    def idle_gpus(self) -> int:
        """Allocated GPUs whose claim is idle."""
        return sum(1 for n in self.nodes for g in n.gpus if g.idle)

    @property
    def usage_reported(self) -> bool:
        """Some allocated GPU has a summary or an Idle condition (a plugin with telemetry writes them)."""
        return any(ns.gpus_reporting for ns in self.namespaces) or bool(self.idle_claims)

    @property
    def unschedulable_nodes(self) -> int:
        """Nodes with GPUs of ours that no pod can land on now."""
        return sum(1 for n in self.nodes if not n.schedulable and n.gpus)

    def pending_by_class(self) -> dict[str, int]:
        """Pending claims per DeviceClass (a claim naming two classes counts under each)."""
        out: Counter[str] = Counter({c: 0 for c in self.device_classes})
        for p in self.pending:
            out.update(set(p.device_classes) or {""})
        return dict(sorted(out.items()))

    def to_dict(self) -> Obj:
        """Plain data for ``-o json|yaml``: the dataclasses plus the cluster totals."""
        out: Obj = plain(self)
        out["mix"] = [{"request_class": name, "probability": round(p, 4)} for name, p in self.mix]
        for row, node in zip(out["nodes"], self.nodes, strict=True):
            row.update(gpus_total=len(node.gpus), gpus_free=node.count(FREE), gpus_allocated=node.count(ALLOCATED),
                       gpus_tainted=node.count(TAINTED) + node.count(RESERVED), gpus_reserved=node.count(RESERVED),
                       reserved_by=node.reserved_gpus, tainted_devices=list(node.tainted_devices),
                       fragmentation=round(node.fragmentation, 4), gpus_idle=sum(1 for g in node.gpus if g.idle),
                       activity=_round4(node.activity), memory_used=_round4(node.memory_used))
        for m in out["models"]:
            m["fragmentation"] = round(m["fragmentation"], 4)
            m["fragmentation_ratio"] = round(m["fragmentation_ratio"], 4)
        for ns_row, ns in zip(out["namespaces"], self.namespaces, strict=True):
            ns_row.update(gpu_hours_allocated=round(ns.gpu_hours_allocated, 3),
                          gpu_hours_active=round(ns.gpu_hours_active, 3),
                          active_share=None if ns.active_share is None else round(ns.active_share, 4))
        for row in out["idle_claims"]:
            row["idle_seconds"] = round(row["idle_seconds"])
        out["summary"] = {"total": self.total, "free": self.free, "allocated": self.allocated,
                          "idle": self.idle_gpus, "idle_claims": len(self.idle_claims),
                          "gpu_hours_allocated": round(sum(n.gpu_hours_allocated for n in self.namespaces), 3),
                          "gpu_hours_active": round(sum(n.gpu_hours_active for n in self.namespaces), 3),
                          "tainted": self.tainted, "reserved": self.reserved,
                          "free_unschedulable": self.free_unschedulable,
                          "unschedulable_nodes": self.unschedulable_nodes,
                          "gpus_stranded_cpu": self.stranded_by_host[0],
                          "gpus_stranded_memory": self.stranded_by_host[1],
                          "fragmentation": round(self.fragmentation, 4),
                          "pending_claims": len(self.pending), "pending_by_device_class": self.pending_by_class()}
        return out


# --------------------------------------------------------------------------- helpers


def _round4(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


_FIELDS: dict[type, tuple[str, ...] | None] = {}  # a type's dataclass fields (None: not a dataclass)
_LEAVES = frozenset({str, int, float, bool, type(None)})


def plain(obj: Any) -> Any:
    """``dataclasses.asdict`` without its deep copies: dataclasses become dicts, tuples stay tuples, lists
    and dicts are rebuilt, leaves are shared. 32,768 devices took asdict ~0.8 s (2,048 nodes)."""
    cls = type(obj)
    if cls in _LEAVES:
        return obj
    try:
        names = _FIELDS[cls]
    except KeyError:
        names = _FIELDS[cls] = tuple(f.name for f in fields(obj)) if is_dataclass(obj) else None
    if names is not None:
        out = {}
        for n in names:
            v = getattr(obj, n)
            out[n] = v if type(v) in _LEAVES else plain(v)
        return out
    if isinstance(obj, tuple):
        return tuple([v if type(v) in _LEAVES else plain(v) for v in obj]) if obj else ()
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    if isinstance(obj, dict):
        return {plain(k): plain(v) for k, v in obj.items()}
    return obj


@functools.lru_cache(maxsize=16384)  # device names repeat on every node: gpu-0 .. gpu-7, nic-0 ..
def natural_key(name: str) -> tuple[Any, ...]:
    """``node-2`` before ``node-10``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def domain_label(domain: str) -> str:
    """Short, still distinct form of an nvlinkDomain: ``nvl-cab65b58`` or ``7c1f3a52.32766``."""
    tail = domain.rsplit("/", 1)[-1]
    if "." in tail and len(tail) > 16:  # <clusterUUID>.<cliqueId>
        uuid, _, clique = tail.rpartition(".")
        return f"{uuid[:8]}.{clique}"
    return tail[:12]


def claim_classes(claim: Obj) -> tuple[str, ...]:
    """DeviceClasses a claim's requests name (``exactly`` and every ``firstAvailable`` subrequest)."""
    out: list[str] = []
    for r in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
        bodies = [r["exactly"]] if r.get("exactly") else list(r.get("firstAvailable") or [])
        for b in bodies:
            cls = b.get("deviceClassName")
            if isinstance(cls, str) and cls and cls not in out:
                out.append(cls)
    return tuple(out)


def attribute(attrs: Mapping[str, Any], name: str, driver: str) -> Any:
    """A device attribute of the driver's own by its short name (``model`` or ``gpu.topodra.io/model``,
    as ``fleet.state.qualified_attributes`` reads both), as a plain value; None when absent."""
    val = attrs.get(f"{driver}/{name}") or attrs.get(name)
    return next(iter(val.values())) if isinstance(val, dict) and val else None


_AVAILABLE = re.compile(r"^\s*\d+/\d+ nodes are available:\s*")


def scheduler_causes(message: str) -> str:
    """The causes of a FailedScheduling message without node counts, for grouping.

    ``0/5 nodes are available: 1 node(s) were unschedulable, 4 cannot allocate all claims. preemption: ...``
    -> ``cannot allocate all claims; node(s) were unschedulable``.
    """
    text = message.split(" preemption:", 1)[0].strip()
    m = _AVAILABLE.match(text)
    if not m:
        return text.rstrip(".")
    causes = set()
    for part in re.split(r",\s+(?=\d+ )", text[m.end():].rstrip(".")):
        causes.add(re.sub(r"^\d+\s+", "", part.strip()))
    return "; ".join(sorted(c for c in causes if c))


def _pods_by_claim(pods: Iterable[Obj]) -> dict[tuple[str, str], Obj]:
    """(namespace, claim name) -> a pod that uses the claim (named or generated from a template)."""
    out: dict[tuple[str, str], Obj] = {}
    for pod in pods:
        ns = str((pod.get("metadata") or {}).get("namespace") or "default")
        for ref in (pod.get("spec") or {}).get("resourceClaims") or []:
            if ref.get("resourceClaimName"):
                out.setdefault((ns, str(ref["resourceClaimName"])), pod)
        for st in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
            if st.get("resourceClaimName"):
                out.setdefault((ns, str(st["resourceClaimName"])), pod)
    return out


def pending_claims(claims: Iterable[Obj], pods: Iterable[Obj]) -> list[PendingClaim]:
    """Unallocated claims with the scheduler's reason (from the using pod's PodScheduled condition)."""
    users = _pods_by_claim(pods)
    out = []
    for c in claims:
        if (c.get("status") or {}).get("allocation"):
            continue
        meta = c.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        ns, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
        pod = users.get((ns, name))
        message = ""
        if pod is None:
            reason = NO_POD
        else:
            cond = next((x for x in (pod.get("status") or {}).get("conditions") or []
                         if x.get("type") == "PodScheduled" and x.get("status") == "False"), None)
            if cond is None:
                reason = NOT_TRIED
            else:
                message = str(cond.get("message") or "")
                causes = scheduler_causes(message)
                reason = f"{cond.get('reason') or 'Unschedulable'}: {causes}" if causes else str(cond.get("reason"))
        out.append(PendingClaim(namespace=ns, name=name, device_classes=claim_classes(c),
                                pod=str((pod.get("metadata") or {}).get("name")) if pod else None,
                                reason=reason, message=message))
    out.sort(key=lambda p: (p.reason, p.namespace, p.name))
    return out


def group_pending(pending: Iterable[PendingClaim]) -> list[PendingGroup]:
    groups: dict[str, list[str]] = defaultdict(list)
    for p in pending:
        groups[p.reason].append(f"{p.namespace}/{p.name}")
    return [PendingGroup(reason=r, claims=tuple(sorted(cs))) for r, cs in
            sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))]


def _pairs_by_rail(gpus: Iterable[Cell], nics: Iterable[Cell]) -> int:
    """GPU+NIC pairs sharing a rail that can be formed from free devices (per-rail minimum)."""
    g = Counter(c.rail for c in gpus if c.rail is not None)
    n = Counter(c.rail for c in nics if c.rail is not None)
    return sum(min(k, n[r]) for r, k in g.items())


# --------------------------------------------------------------------------- the builder


def reservation_holder(taints: list[Obj], rules: list[Obj], driver: str, pool: str, device: str) -> str | None:
    """The profile holding the device when every blocking taint on it is a reservation hold (issue 33):
    ``namespace/name`` from the rule's labels, else the uid (the taint's value); None otherwise."""
    held = [t for t in taints if t.get("effect") in BLOCKING_EFFECTS]
    if not held or any(t.get("key") != RESERVATION_TAINT_KEY or t.get("effect") != HOLD_EFFECT for t in held):
        return None
    for r in rules:
        t = rule_taint(r) or {}
        if t.get("key") == RESERVATION_TAINT_KEY and t.get("effect") == HOLD_EFFECT and \
                rule_matches(r, driver, pool, device):
            labels = (r.get("metadata") or {}).get("labels") or {}
            if labels.get(PROFILE_NS_LABEL) and labels.get(PROFILE_NAME_LABEL):
                return f"{labels[PROFILE_NS_LABEL]}/{labels[PROFILE_NAME_LABEL]}"
            return str(t.get("value") or "")
    return str(held[0].get("value") or "")  # the slice's own taint: only its uid is known


def build_view(src: Sources, driver: str = DEFAULT_DRIVER_NAME, *,
               prior: Mapping[int, float] | None = None, prior_weight: float = DEFAULT_PRIOR_WEIGHT,
               window: int = DEFAULT_WINDOW, nodes: Iterable[str] | None = None,
               now: float | None = None) -> ClusterView:
    """The whole inventory. ``nodes`` limits the per-node part and the per-model sums to those nodes.
    ``now`` (default: the clock) is what idle claims' "idle for" counts up to.

    ``prior`` is the request mix prior of the fragmentation measure (None: the placement scorer's).
    Nodes without a Node object (slices only) are shown and treated as schedulable.
    """
    from topodra.clusterview.domains import fabric_of
    from topodra.clusterview.fleetinput import measure_inputs, slim_slices
    from topodra.fleet.fgd import DEFAULT_PRIOR, Fragmentation, make_mix
    from topodra.fleet.hostres import HostResources
    from topodra.fleet.state import ClusterState

    wanted = set(nodes) if nodes is not None else None
    node_objs = {str((n.get("metadata") or {}).get("name", "")): n for n in src.nodes}
    slices = newest_slices(src.slices, driver, node_local=True)
    held = holders(src.claims, driver)
    uses, claim_uses = device_uses(src.claims, driver)
    gpus_of: dict[tuple[str, str], list[str]] = {}  # claim -> the node of each of its GPUs shown
    ns_gpus: list[tuple[str, DeviceUse | None]] = []
    rules = [r for r in src.taint_rules if rule_taint(r) is not None]

    # The scorer's own state and measure: same parsing, same node views, same unavailable devices
    # (allocated or blocking-tainted), same request mix.
    state = ClusterState(driver, window=window)
    state.replace("claims", src.claims)
    state.replace("taintrules", rules)
    # The CPU and memory per GPU bound pods of each size asked for: the scorer's learned shares (fleet.shares),
    # which judge the stranded columns (clusterview.hostcols).
    state.observe_shares(src.pods)
    shares = state.shares.shares()
    observed = state.observed_mix()
    # Only the classes the observed claims name can enter the mix (make_mix drops demands naming a class
    # without a predicate): parsing just those leaves the mix as it was and, without claims, topodra.selectors
    # (pydantic) unimported.
    named = {a.device_class for d in observed for r in d.requests for a in r.alternatives}
    state.replace("classes", [c for c in src.classes if (c.get("metadata") or {}).get("name") in named])
    known = frozenset(k for k, m in state.classes.items() if m is not None)
    mix = make_mix(DEFAULT_PRIOR if prior is None else prior, prior_weight, observed, driver, known)
    # Only what the measure reads goes into the state's node views (clusterview.fleetinput): same F_n.
    state.classes, reads = measure_inputs(state.classes, mix, driver)
    state.replace("slices", slices if reads is None else slim_slices(slices, reads))
    measure = Fragmentation()
    hosts = HostResources()  # NodeResourcesFit's free CPU and memory per node
    hosts.replace_nodes(src.nodes)
    hosts.replace_pods(src.pods)

    by_node: dict[str, list[Obj]] = defaultdict(list)
    for s in slices:
        by_node[str(s["spec"]["nodeName"])].append(s)
    # The attribute keys of ``attribute`` (both spellings), looked up inline: 131,072 calls at 2,048 nodes.
    keys = {n: (f"{driver}/{n}", n) for n in ("type", "rail", "nvlinkDomain", "model")}
    (type_q, type_s), (rail_q, rail_s), (dom_q, dom_s), (model_q, model_s) = (keys[n] for n in keys)
    rows: list[NodeRow] = []
    for node in sorted(by_node, key=natural_key):
        if wanted is not None and node not in wanted:
            continue
        view = state.node_view(node)
        raw = {(str(sl["spec"]["pool"].get("name", "")), str(dev.get("name", ""))): dev
               for sl in by_node[node] for dev in sl["spec"].get("devices") or []}
        cells: dict[tuple[str, str], Cell] = {}
        # The state's device order; the attributes from the slices themselves (the state's copies are slim).
        for d in view.devices if view is not None else ():
            dev = raw[d.key]
            attrs = dev.get("attributes") or {}
            v = attrs.get(type_q) or attrs.get(type_s)
            kind = next(iter(v.values())) if isinstance(v, dict) and v else None
            if kind == MIG_PARENT_TYPE:  # a MIG-enabled GPU: still drawn as its GPU (slices are not drawn)
                kind = "gpu"
            if kind != "gpu" and kind != "nic":
                continue
            pool, name = d.key
            taints = device_taints(dev, rules, driver, pool) if rules or dev.get("taints") else []
            holder = held.get(d.key)
            st = ALLOCATED if holder else TAINTED if taints and blocking(taints) else FREE
            reserved_by = reservation_holder(taints, rules, driver, pool, name) if st == TAINTED else None
            if reserved_by is not None:
                st = RESERVED
            v = attrs.get(rail_q) or attrs.get(rail_s)
            rail = next(iter(v.values())) if isinstance(v, dict) and v else None
            v = attrs.get(dom_q) or attrs.get(dom_s)
            domain = next(iter(v.values())) if isinstance(v, dict) and v else None
            v = attrs.get(model_q) or attrs.get(model_s)
            model = next(iter(v.values())) if isinstance(v, dict) and v else None
            use = uses.get(d.key) if holder and kind == "gpu" else None
            if holder and kind == "gpu":
                gpus_of.setdefault((holder[0], holder[1]), []).append(node)
                ns_gpus.append((holder[0], use))
            cells[d.key] = Cell(
                name, pool, kind, st, str(model) if model is not None else None,
                str(domain) if domain is not None else None, int(rail) if isinstance(rail, int) else None,
                holder[0] if holder else None, holder[1] if holder else None,
                tuple(taint_text(t) for t in taints) if taints else (), reserved_by,
                use.activity if use else None, use.memory_used if use else None, use.idle if use else False)
        gpus = sorted((c for c in cells.values() if c.kind == "gpu"),
                      key=lambda c: (c.domain or "~", natural_key(c.name)))
        nics = sorted((c for c in cells.values() if c.kind == "nic"),
                      key=lambda c: (c.rail if c.rail is not None else 1 << 30, natural_key(c.name)))
        domains: dict[str, list[Cell]] = defaultdict(list)
        for g in gpus:
            if g.domain is not None:
                domains[g.domain].append(g)
        rails: dict[int | None, list[Cell]] = defaultdict(list)
        for n in nics:
            rails[n.rail].append(n)
        frag = 0.0 if view is None else measure.fragmentation(view, state.unavailable_indices(view), mix)
        models = Counter(g.model or "unknown" for g in gpus)
        unschedulable = why_unschedulable(node_objs[node]) if node in node_objs else ""
        free_gpus = sum(1 for g in gpus if g.state == FREE)
        rows.append(NodeRow(
            name=node, model="+".join(m for m, _ in models.most_common()),
            schedulable=not unschedulable, unschedulable_reason=unschedulable,
            gpus=tuple(gpus), nics=tuple(nics),
            domains=tuple(DomainCount(d, domain_label(d), sum(1 for g in gs if g.state == FREE), len(gs))
                          for d, gs in domains.items()),
            rails=tuple(RailCount(r, sum(1 for n in ns if n.state == FREE), len(ns))
                        for r, ns in sorted(rails.items(), key=lambda kv: -1 if kv[0] is None else kv[0])),
            fragmentation=frag,
            fabric=fabric_of(((node_objs.get(node) or {}).get("metadata") or {}).get("labels")),
            host=host_columns(hosts.room(node), free_gpus, len(gpus), shares),
            activity=mean(g.activity for g in gpus), memory_used=mean(g.memory_used for g in gpus)))

    pending = pending_claims(src.claims, src.pods)
    return ClusterView(driver=driver, nodes=tuple(rows), models=tuple(summarize_models(rows)),
                       pending=tuple(pending), pending_groups=tuple(group_pending(pending)),
                       mix=tuple((d.label(), p) for d, p in mix.classes),
                       device_classes=tuple(sorted(str((c.get("metadata") or {}).get("name", ""))
                                                   for c in src.classes)),
                       namespaces=tuple(namespace_uses(ns_gpus)),
                       idle_claims=tuple(idle_claims(claim_uses, gpus_of, time.time() if now is None else now)))


class _ModelSums:
    """One GPU model's running sums over the rows (``summarize_models``)."""

    def __init__(self) -> None:
        self.nodes = self.total = self.free = self.allocated = self.tainted = self.reserved = 0
        self.unschedulable_nodes = self.free_unschedulable = 0
        self.frag = 0.0
        self.best = [0, 0, 0]
        self.domains: dict[str, bool] = {}  # nvlinkDomain -> every GPU of it free


def summarize_models(rows: Iterable[NodeRow]) -> list[ModelSummary]:
    """Per GPU model: counts, whole free NVLink domains, largest placeable claim, fragmentation.

    One pass over the rows (a node's GPUs grouped by model), not one per model: 4 models x 2,048 nodes."""
    sums: dict[str, _ModelSums] = {}
    for r in rows:
        mine: dict[str, list[Cell]] = {}
        for g in r.gpus:
            mine.setdefault(g.model or "unknown", []).append(g)
        free_nics: list[Cell] | None = None
        for model, gs in mine.items():
            m = sums.get(model)
            if m is None:
                m = sums[model] = _ModelSums()
            m.nodes += 1
            m.total += len(gs)
            free_gpus = [g for g in gs if g.state == FREE]
            m.free += len(free_gpus)
            m.allocated += sum(1 for g in gs if g.state == ALLOCATED)
            reserved = sum(1 for g in gs if g.state == RESERVED)
            m.tainted += sum(1 for g in gs if g.state == TAINTED) + reserved
            m.reserved += reserved
            if r.model == model:
                m.frag += r.fragmentation
            for g in gs:
                if g.domain is not None:
                    m.domains[g.domain] = m.domains.get(g.domain, True) and g.state == FREE
            if not r.schedulable:
                m.unschedulable_nodes += 1
                m.free_unschedulable += len(free_gpus)
                continue
            per_domain = Counter(g.domain for g in free_gpus if g.domain is not None)
            if free_nics is None:
                free_nics = [n for n in r.nics if n.state == FREE]
            best = m.best
            best[0] = max(best[0], len(free_gpus))
            best[1] = max(best[1], max(per_domain.values(), default=0))
            best[2] = max(best[2], _pairs_by_rail(free_gpus, free_nics))
    out = []
    for model in sorted(sums):
        m = sums[model]
        out.append(ModelSummary(model=model, nodes=m.nodes, total=m.total, free=m.free, allocated=m.allocated,
                                tainted=m.tainted, largest=Largest(*m.best), nvlink_domains=len(m.domains),
                                nvlink_domains_free=sum(1 for f in m.domains.values() if f),
                                fragmentation=m.frag, fragmentation_ratio=m.frag / m.free if m.free else 0.0,
                                unschedulable_nodes=m.unschedulable_nodes, free_unschedulable=m.free_unschedulable,
                                reserved=m.reserved))
    return out
