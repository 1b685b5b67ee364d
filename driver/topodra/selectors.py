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
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Quantities and versions live in a module without pydantic (fleet.cel, fleet.hostres and the inventory
# read them without importing pydantic); re-exported here for the modules that always took them from here.
from topodra.quantities import QUANTITY, SEMVER, SUFFIX, parse_quantity, parse_semver

__all__ = ["MATCH_ANNOTATION", "QUANTITY", "SEMVER", "SUFFIX", "DeviceMatch", "parse_quantity", "parse_semver"]

MATCH_ANNOTATION = "topodra.io/match"
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
