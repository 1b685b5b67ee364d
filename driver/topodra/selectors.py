"""Device predicates shared by our DeviceClasses and the controller's availability report.

A neutral module (imports nothing of topodra): ``deviceclasses`` renders
classes from it, ``controller.availability`` evaluates them.

Each topodra DeviceClass is generated from one ``DeviceMatch``: the same
object renders the class's CEL selector *and* is stored as JSON in the class's
``topodra.io/match`` annotation.  The controller evaluates that annotation in
Python to count matching devices, so it never has to interpret CEL; a class
without the annotation (a foreign class) is reported as "unknown".
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MATCH_ANNOTATION = "topodra.io/match"
QUANTITY = re.compile(
    r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)|[eE]([+-]?\d+))?$")
SUFFIX: dict[str, Decimal] = {
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": Decimal("1e3"),
    "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"), "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$")


def parse_semver(value: str) -> tuple[int, int, int]:
    """Major/minor/patch of a semver string; pre-release and build parts are ignored."""
    m = SEMVER.match(value)
    if not m:
        raise ValueError(f"{value!r} is not a semantic version (e.g. 9.0.0)")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def parse_quantity(value: str) -> Decimal:
    """A Kubernetes quantity string (``80Gi``, ``1.5G``, ``2e3``) as a number; ValueError when malformed."""
    m = QUANTITY.match(value.strip()) if isinstance(value, str) else None
    if not m:
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 80Gi)")
    number = Decimal(m.group(1))
    if m.group(2):
        return number * SUFFIX[m.group(2)]
    if m.group(3):
        return number.scaleb(int(m.group(3)))
    return number


class DeviceMatch(BaseModel):
    """What a DeviceClass selects, in a form both CEL and Python can evaluate.

    All set fields must hold (logical AND).  ``minMemory`` compares the
    ``memory`` capacity with a quantity; ``minComputeCapability`` compares the
    ``cudaComputeCapability`` version attribute with a semver, inclusively.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    type: Literal["gpu", "nic", "mig", "gpu-shared"]
    models: tuple[str, ...] | None = None
    compute_slices: int | None = Field(default=None, alias="computeSlices", ge=1)  # MIG slices (type "mig")
    min_memory: str | None = Field(default=None, alias="minMemory")
    min_compute_capability: str | None = Field(default=None, alias="minComputeCapability")

    @field_validator("models")
    @classmethod
    def _models(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is not None:
            if not v:
                raise ValueError("models must not be empty when set")
            for m in v:
                if not m or '"' in m or "\\" in m or len(m) > 64:
                    raise ValueError(f"model name {m!r} is not a valid attribute string")
        return v

    @field_validator("min_memory")
    @classmethod
    def _memory(cls, v: str | None) -> str | None:
        if v is not None:
            parse_quantity(v)
        return v

    @field_validator("min_compute_capability")
    @classmethod
    def _cc(cls, v: str | None) -> str | None:
        if v is not None:
            parse_semver(v)
        return v

    def to_annotation(self) -> str:
        return json.dumps(self.model_dump(by_alias=True, exclude_none=True, mode="json"), sort_keys=True,
                          separators=(",", ":"))

    @classmethod
    def from_annotation(cls, text: str) -> DeviceMatch:
        return cls.model_validate(json.loads(text))

    def to_cel(self, driver: str) -> str:
        """The CEL selector: typed comparisons only (quantity, semver), guarded by has()."""
        attrs = f'device.attributes["{driver}"]'
        caps = f'device.capacity["{driver}"]'
        terms = [f'device.driver == "{driver}"', f'has({attrs}.type)', f'{attrs}.type == "{self.type}"']
        if self.models is not None:
            listed = ", ".join(f'"{m}"' for m in self.models)
            terms += [f"has({attrs}.model)", f"{attrs}.model in [{listed}]"]
        if self.compute_slices is not None:
            terms += [f"has({attrs}.computeSlices)", f"{attrs}.computeSlices == {self.compute_slices}"]
        if self.min_memory is not None:
            terms += [f"has({caps}.memory)", f'{caps}.memory.compareTo(quantity("{self.min_memory}")) >= 0']
        if self.min_compute_capability is not None:
            cc = f"{attrs}.cudaComputeCapability"
            terms += [f"has({cc})", f'{cc}.compareTo(semver("{self.min_compute_capability}")) >= 0']
        return "\n&& ".join(terms)

    def matches(self, device: dict[str, Any], driver: str) -> bool:
        """Evaluate against one ResourceSlice device (API JSON), like the CEL would."""
        return self.matches_attributes(_attributes(device, driver), device, driver)

    def matches_attributes(self, attrs: Mapping[str, Any], device: dict[str, Any], driver: str) -> bool:
        """``matches`` with the device's ``domain_attributes`` already parsed: a pass over a whole fleet
        parses each device once, not once per class (issue 22: most of a 2,048-node controller pass)."""
        if attrs.get("type") != self.type:
            return False
        if self.models is not None and attrs.get("model") not in self.models:
            return False
        if self.compute_slices is not None and attrs.get("computeSlices") != self.compute_slices:
            return False
        if self.min_memory is not None:
            mem = _capacity(device, driver, "memory")
            if mem is None or mem < parse_quantity(self.min_memory):
                return False
        if self.min_compute_capability is not None:
            cc = attrs.get("cudaComputeCapability")
            if not isinstance(cc, str):
                return False
            try:
                if parse_semver(cc) < parse_semver(self.min_compute_capability):
                    return False
            except ValueError:
                return False
        return True


def domain_attributes(device: dict[str, Any], driver: str) -> dict[str, Any]:
    """The device's attributes of ``driver``'s domain, unqualified (what ``matches_attributes`` reads)."""
    return _attributes(device, driver)


def _attributes(device: dict[str, Any], driver: str) -> dict[str, Any]:
    """Attribute values of our domain, unqualified (as CEL sees them under ``attributes[driver]``)."""
    out: dict[str, Any] = {}
    prefix = driver + "/"
    for key, val in (device.get("attributes") or {}).items():
        if "/" in key and not key.startswith(prefix):
            continue
        name = key[len(prefix):] if key.startswith(prefix) else key
        if isinstance(val, dict) and val:
            out[name] = next(iter(val.values()))
    return out


def attribute(device: dict[str, Any], name: str, driver: str) -> Any:
    """One attribute's plain value (``gpu.topodra.io/rail`` or ``resource.kubernetes.io/numaNode``)."""
    if name.startswith(driver + "/"):
        return _attributes(device, driver).get(name[len(driver) + 1:])
    val = (device.get("attributes") or {}).get(name)
    if isinstance(val, dict) and val:
        return next(iter(val.values()))
    return None


def _capacity(device: dict[str, Any], driver: str, name: str) -> Decimal | None:
    caps = device.get("capacity") or {}
    raw = caps.get(name) or caps.get(f"{driver}/{name}")
    if not isinstance(raw, dict) or "value" not in raw:
        return None
    try:
        return parse_quantity(str(raw["value"]))
    except ValueError:
        return None
