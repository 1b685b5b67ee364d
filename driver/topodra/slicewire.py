"""ResourceSlices in the API server's protobuf wire form, for the publisher's writes.

Why: at 2,048 nodes, about 7 % of kube-apiserver's CPU while `topodra simulate` publishes went to decoding the
slices' JSON bodies (`json.(*Serializer).Decode`, 1.7-2.0 of 24-27 s in a pprof CPU profile; docs/benchmarks.md,
*Where the API server's CPU goes*). A protobuf body is decoded by generated code instead. The responses stay
JSON: the publisher keeps the written object as a dict, and building dicts from protobuf in Python took 1.1-1.4 s
for 2,048 slices against 0.3 s for ``json.loads``.

``encode`` knows exactly the fields ``topodra.slices.build_slices`` writes (proto/kubewire/v1/resourceslice.proto,
field numbers of Kubernetes v1.37.2). Anything else (a key it does not know, a value of the wrong type, a
timestamp that is not whole seconds in UTC) raises ``NotEncodable`` and the caller sends JSON: a field is never
dropped silently.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from topodra.pb.kubewire.v1 import resourceslice_pb2 as pb

CONTENT_TYPE = "application/vnd.kubernetes.protobuf"
MAGIC = b"k8s\x00"  # k8s.io/apimachinery runtime/serializer/protobuf: every object is prefixed with it
API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"

_TOP = frozenset({"apiVersion", "kind", "metadata", "spec"})
_META = frozenset({"name", "resourceVersion", "labels", "annotations", "ownerReferences"})
_OWNER = frozenset({"apiVersion", "kind", "name", "uid", "controller", "blockOwnerDeletion"})
_SPEC = frozenset({"driver", "pool", "nodeName", "devices", "sharedCounters"})
_POOL = frozenset({"name", "generation", "resourceSliceCount"})
_DEVICE = frozenset({"name", "attributes", "capacity", "consumesCounters", "taints", "allowMultipleAllocations"})
_CAPACITY = frozenset({"value", "requestPolicy"})
_POLICY = frozenset({"default", "validRange"})
_RANGE = frozenset({"min", "max", "step"})
_TAINT = frozenset({"key", "value", "effect", "timeAdded"})
_COUNTER_SET = frozenset({"name", "counters"})
_CONSUMPTION = frozenset({"counterSet", "counters"})
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


class NotEncodable(ValueError):
    """The object has something this encoder does not write; send it as JSON."""


def encode(obj: Mapping[str, Any]) -> bytes:
    """The request body for POST/PUT of ``obj`` (a ResourceSlice as ``build_slices`` makes it)."""
    _only(obj, _TOP, "")
    if obj.get("apiVersion", API_VERSION) != API_VERSION or obj.get("kind", KIND) != KIND:
        raise NotEncodable(f"not a {API_VERSION} {KIND}: {obj.get('apiVersion')} {obj.get('kind')}")
    msg = pb.ResourceSlice()
    _meta(msg.metadata, obj.get("metadata") or {})
    _spec(msg.spec, obj.get("spec") or {})
    env = pb.Unknown(raw=msg.SerializeToString())
    env.typeMeta.apiVersion = API_VERSION
    env.typeMeta.kind = KIND
    return MAGIC + env.SerializeToString()


def _only(d: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    if not isinstance(d, Mapping):
        raise NotEncodable(f"{where or 'object'} is not an object")
    extra = d.keys() - allowed
    if extra:
        raise NotEncodable(f"{where or 'object'} has fields the protobuf form does not carry: {sorted(extra)}")


def _str(v: Any, where: str) -> str:
    if type(v) is not str:
        raise NotEncodable(f"{where} is not a string: {v!r}")
    return v


def _int(v: Any, where: str) -> int:
    if type(v) is not int:
        raise NotEncodable(f"{where} is not an integer: {v!r}")
    return v


def _bool(v: Any, where: str) -> bool:
    if type(v) is not bool:
        raise NotEncodable(f"{where} is not a boolean: {v!r}")
    return v


def _set(target: Any, d: Mapping[str, Any], fields: tuple[str, ...], check: Callable[[Any, str], Any],
         where: str) -> None:
    """``target.f = d[f]`` for each of ``fields`` that ``d`` has, each value checked by ``check``."""
    for f in fields:
        if f in d:
            setattr(target, f, check(d[f], f"{where}.{f}"))


def _meta(m: pb.ObjectMeta, d: Mapping[str, Any]) -> None:
    _only(d, _META, "metadata")
    _set(m, d, ("name", "resourceVersion"), _str, "metadata")
    for field in ("labels", "annotations"):
        target = getattr(m, field)
        for k, v in (d.get(field) or {}).items():
            target[_str(k, f"metadata.{field}")] = _str(v, f"metadata.{field}[{k}]")
    for o in d.get("ownerReferences") or ():
        _only(o, _OWNER, "metadata.ownerReferences[]")
        r = m.ownerReferences.add()
        _set(r, o, ("apiVersion", "kind", "name", "uid"), _str, "ownerReferences[]")
        _set(r, o, ("controller", "blockOwnerDeletion"), _bool, "ownerReferences[]")


def _spec(s: pb.ResourceSliceSpec, d: Mapping[str, Any]) -> None:
    _only(d, _SPEC, "spec")
    _set(s, d, ("driver", "nodeName"), _str, "spec")
    if "pool" in d:
        _only(d["pool"], _POOL, "spec.pool")
        _set(s.pool, d["pool"], ("name",), _str, "spec.pool")
        _set(s.pool, d["pool"], ("generation", "resourceSliceCount"), _int, "spec.pool")
    for dev in d.get("devices") or ():
        _device(s.devices.add(), dev)
    for cs in d.get("sharedCounters") or ():
        _only(cs, _COUNTER_SET, "spec.sharedCounters[]")
        out = s.sharedCounters.add()
        out.name = _str(cs.get("name"), "sharedCounters[].name")
        _counters(out.counters, cs.get("counters") or {}, "sharedCounters[].counters")


def _device(out: pb.Device, d: Mapping[str, Any]) -> None:
    _only(d, _DEVICE, "spec.devices[]")
    out.name = _str(d.get("name"), "devices[].name")
    where = f"device {out.name}"
    for k, a in (d.get("attributes") or {}).items():
        if not isinstance(a, Mapping) or len(a) != 1:
            raise NotEncodable(f"{where}: attribute {k} must have exactly one value: {a!r}")
        (field, v), = a.items()
        target = out.attributes[_str(k, f"{where}: attribute name")]
        if field == "int":
            target.int = _int(v, f"{where}: attribute {k}")
        elif field == "bool":
            target.bool = _bool(v, f"{where}: attribute {k}")
        elif field in ("string", "version"):
            setattr(target, field, _str(v, f"{where}: attribute {k}"))
        else:
            raise NotEncodable(f"{where}: attribute {k} has a {field!r} value")
    for k, c in (d.get("capacity") or {}).items():
        _only(c, _CAPACITY, f"{where}: capacity {k}")
        cap = out.capacity[_str(k, f"{where}: capacity name")]
        cap.value.string = _str(c.get("value"), f"{where}: capacity {k}")
        if "requestPolicy" in c:
            p = c["requestPolicy"]
            _only(p, _POLICY, f"{where}: capacity {k} requestPolicy")
            if "default" in p:
                cap.requestPolicy.default.string = _str(p["default"], f"{where}: {k} requestPolicy.default")
            if "validRange" in p:
                r = p["validRange"]
                _only(r, _RANGE, f"{where}: capacity {k} validRange")
                for field in ("min", "max", "step"):
                    if field in r:
                        getattr(cap.requestPolicy.validRange, field).string = _str(r[field], f"{where}: {k} {field}")
    for cc in d.get("consumesCounters") or ():
        _only(cc, _CONSUMPTION, f"{where}: consumesCounters[]")
        c = out.consumesCounters.add()
        c.counterSet = _str(cc.get("counterSet"), f"{where}: consumesCounters[].counterSet")
        _counters(c.counters, cc.get("counters") or {}, f"{where}: consumesCounters[].counters")
    for t in d.get("taints") or ():
        _only(t, _TAINT, f"{where}: taints[]")
        taint = out.taints.add()
        taint.key = _str(t.get("key"), f"{where}: taint key")
        _set(taint, t, ("value",), _str, f"{where}: taint")
        taint.effect = _str(t.get("effect"), f"{where}: taint effect")
        if "timeAdded" in t:
            taint.timeAdded.seconds = _seconds(t["timeAdded"], f"{where}: taint timeAdded")
    if "allowMultipleAllocations" in d:
        out.allowMultipleAllocations = _bool(d["allowMultipleAllocations"], f"{where}: allowMultipleAllocations")


def _counters(target: Any, counters: Mapping[str, Any], where: str) -> None:
    for k, c in counters.items():
        if not isinstance(c, Mapping) or set(c) != {"value"}:
            raise NotEncodable(f"{where}[{k}] must be {{'value': quantity}}: {c!r}")
        target[_str(k, where)].value.string = _str(c["value"], f"{where}[{k}]")


def _seconds(v: Any, where: str) -> int:
    """RFC 3339 in whole seconds and UTC, as metav1.Time writes JSON; anything finer is not ours to round."""
    try:
        t = datetime.strptime(_str(v, where), _TIME_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        raise NotEncodable(f"{where} is not YYYY-MM-DDTHH:MM:SSZ: {v!r}") from None
    return int(t.timestamp())
