"""What a ResourceClaim asks for, parsed once into a hashable ``Demand`` (pure).

Hashable so the scorer and the fragmentation measure can memoise per demand; the same
parse serves the request mix the inventory reports, so both read claims one way.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from topodra.fleet.cel import Selector, recognise
from topodra.fleet.taints import Tolerance, Toleration, toleration_tuple

Obj = dict[str, Any]
ANY_GPU = ""  # pseudo class of the prior's request classes: every GPU of the driver


class DemandError(ValueError):
    """A claim spec the scorer cannot read (it then ignores the claim: it never vetoes)."""


@dataclass(frozen=True, slots=True)
class Alternative:
    """One way to satisfy a request: ``exactly`` or one ``firstAvailable`` subrequest."""

    name: str  # "req" for exactly, "req/sub" for a subrequest (as constraints name them)
    device_class: str  # ANY_GPU for the prior's classes
    count: int  # devices; 0 means allocationMode All
    selectors: tuple[Selector, ...] = ()  # request-level CEL selectors the scorer evaluates (fleet.cel)
    ignored_selectors: int = 0  # request-level CEL selectors outside that subset: treated as matching
    # The request's (or subrequest's) ``tolerations`` of device taints (fleet.taints), in the order written:
    # ExactDeviceRequest.tolerations and DeviceSubRequest.tolerations (k8s.io/api@v0.37.2 resource/v1/types.go:1432,
    # 1577).
    tolerations: tuple[Toleration, ...] = ()


@dataclass(frozen=True, slots=True)
class Request:
    name: str
    alternatives: tuple[Alternative, ...]


@dataclass(frozen=True, slots=True)
class Constraint:
    """``matchAttribute``: all devices of the named requests share one value of ``attribute``."""

    requests: tuple[str, ...]  # empty: every request of the claim
    attribute: str  # fully qualified, e.g. gpu.topodra.io/nvlinkDomain

    def applies(self, request: str, alternative: str) -> bool:
        return not self.requests or request in self.requests or alternative in self.requests


@dataclass(frozen=True, slots=True)
class Demand:
    """What one ResourceClaim asks for; hashable so results can be memoised per demand."""

    requests: tuple[Request, ...]
    constraints: tuple[Constraint, ...] = ()
    # Demands key every memo and the request mix: hash once, not recursively per lookup.
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    # Whether any alternative carries tolerations: asked on every scorer call, so worked out once.
    _tolerant: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.requests, self.constraints)))
        object.__setattr__(self, "_tolerant", any(a.tolerations for r in self.requests for a in r.alternatives))

    def __hash__(self) -> int:
        return self._hash

    @property
    def has_selectors(self) -> bool:
        return any(a.selectors for r in self.requests for a in r.alternatives)

    @property
    def has_tolerations(self) -> bool:
        return self._tolerant

    def without_tolerations(self) -> Demand:
        """The same demand without its tolerations (how it enters the request mix: packing ignores them)."""
        if not self.has_tolerations:
            return self
        return Demand(requests=tuple(Request(r.name, tuple(replace(a, tolerations=()) for a in r.alternatives))
                                     for r in self.requests), constraints=self.constraints)

    def without_selectors(self) -> Demand:
        """The same demand judged by DeviceClasses only (how it enters the request mix)."""
        if not self.has_selectors:
            return self
        return Demand(requests=tuple(Request(r.name, tuple(replace(a, selectors=()) for a in r.alternatives))
                                     for r in self.requests), constraints=self.constraints)

    def label(self) -> str:
        """Short human form for logs and metrics, e.g. ``8xgpu.topodra.io|nvlinkDomain``."""
        parts = []
        for r in self.requests:
            alts = "/".join(f"{a.count or 'all'}x{a.device_class or 'gpu'}" for a in r.alternatives)
            parts.append(alts)
        attrs = sorted({c.attribute.rsplit("/", 1)[-1] for c in self.constraints})
        return "+".join(parts) + ("|" + ",".join(attrs) if attrs else "")


def _alternative(name: str, body: Obj) -> Alternative:
    cls = body.get("deviceClassName")
    if not isinstance(cls, str) or not cls:
        raise DemandError(f"request {name!r} has no deviceClassName")
    mode = body.get("allocationMode") or "ExactCount"
    if mode == "All":
        count = 0
    elif mode == "ExactCount":
        raw = body.get("count", 1)
        if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
            raise DemandError(f"request {name!r} has an invalid count {raw!r}")
        count = raw
    else:
        raise DemandError(f"request {name!r} has an unknown allocationMode {mode!r}")
    known: list[Selector] = []
    ignored = 0
    for sel in body.get("selectors") or []:
        expr = ((sel or {}).get("cel") or {}).get("expression")
        got = recognise(expr) if isinstance(expr, str) else None
        if got is None:
            ignored += 1
        else:
            known.append(got)
    tols = body.get("tolerations") or []
    if not isinstance(tols, list) or not all(isinstance(t, dict) for t in tols):
        raise DemandError(f"request {name!r} has tolerations that are not a list of objects")
    return Alternative(name=name, device_class=cls, count=count, selectors=tuple(known), ignored_selectors=ignored,
                       tolerations=tuple(toleration_tuple(t) for t in tols))


def parse_demand(spec: Obj) -> Demand:
    """A ResourceClaimSpec (``{"devices": {...}}``) as a Demand; DemandError when unreadable."""
    devices = (spec or {}).get("devices") or {}
    requests: list[Request] = []
    for req in devices.get("requests") or []:
        name = req.get("name")
        if not isinstance(name, str) or not name:
            raise DemandError("a request has no name")
        if req.get("exactly") is not None:
            alts: tuple[Alternative, ...] = (_alternative(name, req["exactly"]),)
        elif req.get("firstAvailable"):
            alts = tuple(_alternative(f"{name}/{sub.get('name', '')}", sub) for sub in req["firstAvailable"])
        else:
            raise DemandError(f"request {name!r} has neither exactly nor firstAvailable")
        requests.append(Request(name=name, alternatives=alts))
    if not requests:
        raise DemandError("the claim has no device requests")
    constraints = []
    for c in devices.get("constraints") or []:
        attr = c.get("matchAttribute")
        if isinstance(attr, str) and attr:
            constraints.append(Constraint(requests=tuple(c.get("requests") or ()), attribute=attr))
    return Demand(requests=tuple(requests), constraints=tuple(constraints))


def pod_tolerance(demands: tuple[Demand, ...] | list[Demand]) -> Tolerance:
    """Per alternative of the pod's claims its tolerations (``fleet.taints.tolerated`` reads them); empty
    when none of them has any: the pod is an ordinary one, and the cheap check says so first."""
    for d in demands:
        if d._tolerant:
            break
    else:
        return ()
    return tuple(a.tolerations for d in demands for r in d.requests for a in r.alternatives)


def demand_gpus(demand: Demand) -> int:
    """GPUs one placement of the demand takes: each request's first (preferred) alternative, summed;
    0 when a request takes all matching devices (its size is not known up front)."""
    total = 0
    for r in demand.requests:
        if not r.alternatives or r.alternatives[0].count == 0:
            return 0
        total += r.alternatives[0].count
    return total
