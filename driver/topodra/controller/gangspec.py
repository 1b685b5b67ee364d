"""The multi-node part of a ClaimProfile: ``pods`` and ``acrossNodes`` (pydantic).

Kept apart from ``profile.py`` so the single-claim model stays as it was; ``profile.py`` only hooks these in.
A level is a fabric tier name (the node label keys other parts of topodra write) or a node label key of the
user's own, e.g. Topograph's ``fabric.topograph.run/tier-0``, because kube-scheduler's topology constraint
takes any label key.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The fabric tiers as node labels (the fabric work fixes these names; do not rename).
LEVEL_KEYS: dict[str, str] = {
    "leafGroup": "topodra.io/leaf-group",
    "scalableUnit": "topodra.io/scalable-unit",
    "spineGroup": "topodra.io/spine-group",
}
MAX_LEVELS = 4
# A PodGroup's minCount is int32; a gang past a few thousand pods is not what one profile describes.
MAX_PODS = 4096
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_LABEL_NAME}$")


def level_key(level: str) -> str:
    """The node label key of a level (a tier name, else the level is already a key)."""
    return LEVEL_KEYS.get(level, level)


class AcrossNodes(BaseModel):
    """Where the pods of one job go relative to each other."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    # Narrowest first: the controller takes the first level that can hold the whole job now.
    same_domain: tuple[str, ...] = Field(alias="sameDomain", min_length=1, max_length=MAX_LEVELS)

    @model_validator(mode="after")
    def _levels(self) -> AcrossNodes:
        for level in self.same_domain:
            if level in LEVEL_KEYS:
                continue
            if "/" not in level or not _LABEL_KEY.match(level) or len(level) > 316:
                raise ValueError(f"sameDomain level {level!r} is neither one of {sorted(LEVEL_KEYS)} "
                                 "nor a qualified node label key (prefix/name, e.g. fabric.topograph.run/tier-0)")
        keys = [level_key(lv) for lv in self.same_domain]
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        if dupes:
            raise ValueError(f"sameDomain levels must be distinct, {dupes} repeat")
        return self

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(level_key(lv) for lv in self.same_domain)
