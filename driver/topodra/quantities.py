"""Kubernetes quantities (``80Gi``) and semantic versions (``9.0.0``) as numbers. Stdlib only.

Split out of ``topodra.selectors`` so that what reads quantities without needing ``DeviceMatch`` (the fleet
model's CEL subset and host resources, and with them ``topodra inventory``) does not import pydantic:
about 0.1 s of a fresh process's start, most of it pydantic's plugin loader reading package metadata.
"""

from __future__ import annotations

import re
from decimal import Decimal

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
