"""The fabric a simulated cluster file declares, as tier names per node. Pure.

A 512-node file should not hand-write 1,500 labels, and a 50-node one should still say exactly which
leaf group each rack row is in.  Two ways, never both in one file:

* per group, ``fabric: {scalableUnit: su1, leafGroupSize: 8}`` (or ``leafGroup: <name>``, ``spineGroup``):
  the group's nodes are cut into leaf groups of that size, named ``<scalableUnit>-leaf<k>`` with ``k``
  counting on across the groups of that unit in file order;
* once for the file, ``fabric: {leafGroupSize: 8, scalableUnitSize: 32, spineGroupSize: 128}``: consecutive
  nodes in file order (groups in order, then index) form ``su<j>-leaf<k>``, ``su<j>`` and ``sg<i>``.

The tiers must nest (a leaf group in one scalable unit, a unit in one spine group); topodra's own fabric keys
written by hand in a group's ``labels`` (the old way) count too, but not alongside ``fabric`` for the same key.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from itertools import pairwise

from pydantic import BaseModel, ConfigDict, Field, model_validator

from topodra.fabric import TIERS
from topodra.nodelabels import LEAF_GROUP, SCALABLE_UNIT, SPINE_GROUP

NAME = r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"  # a label value


class GroupFabric(BaseModel):
    """Where one group's nodes sit in the fabric; names are label values."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    scalable_unit: str | None = Field(default=None, alias="scalableUnit", pattern=NAME)
    spine_group: str | None = Field(default=None, alias="spineGroup", pattern=NAME)
    leaf_group: str | None = Field(default=None, alias="leafGroup", pattern=NAME,
                                   description="all of the group's nodes in this one leaf group")
    leaf_group_size: int | None = Field(default=None, alias="leafGroupSize", ge=1,
                                        description="consecutive nodes of the group per leaf group")

    @model_validator(mode="after")
    def _check(self) -> GroupFabric:
        if self.leaf_group is not None and self.leaf_group_size is not None:
            raise ValueError("fabric: give leafGroup (one name) or leafGroupSize (numbered), not both")
        if self.leaf_group_size is not None and self.scalable_unit is None:
            raise ValueError("fabric: leafGroupSize needs scalableUnit (leaf groups are named <scalableUnit>-leaf<k>)")
        if not self.model_fields_set:
            raise ValueError("fabric: empty; give scalableUnit, leafGroup, leafGroupSize or spineGroup")
        return self


class ClusterFabric(BaseModel):
    """A uniform fabric over all nodes in file order; each size a multiple of the finer one."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    leaf_group_size: int | None = Field(default=None, alias="leafGroupSize", ge=1)
    scalable_unit_size: int | None = Field(default=None, alias="scalableUnitSize", ge=1)
    spine_group_size: int | None = Field(default=None, alias="spineGroupSize", ge=1)

    @model_validator(mode="after")
    def _check(self) -> ClusterFabric:
        sizes = [(n, s) for n, s in (("leafGroupSize", self.leaf_group_size),
                                     ("scalableUnitSize", self.scalable_unit_size),
                                     ("spineGroupSize", self.spine_group_size)) if s is not None]
        if not sizes:
            raise ValueError("fabric: give at least one of leafGroupSize, scalableUnitSize, spineGroupSize")
        for (fine, a), (coarse, b) in pairwise(sizes):
            if b % a:
                raise ValueError(f"fabric: {coarse} ({b}) must be a multiple of {fine} ({a}), so that tiers nest")
        return self

    def tiers(self, i: int) -> dict[str, str]:
        """The tier names of the ``i``-th node (0-based, file order)."""
        out: dict[str, str] = {}
        if self.spine_group_size:
            out[SPINE_GROUP] = f"sg{i // self.spine_group_size + 1}"
        if self.scalable_unit_size:
            su = f"su{i // self.scalable_unit_size + 1}"
            out[SCALABLE_UNIT] = su
            if self.leaf_group_size:
                out[LEAF_GROUP] = f"{su}-leaf{i % self.scalable_unit_size // self.leaf_group_size + 1}"
        elif self.leaf_group_size:
            out[LEAF_GROUP] = f"leaf{i // self.leaf_group_size + 1}"
        return out


def group_tiers(groups: Sequence[tuple[int, GroupFabric | None]]) -> list[list[dict[str, str]]]:
    """Per group (count, fabric), the tier names of each of its nodes."""
    leaves_in: dict[str, int] = defaultdict(int)  # leaf groups numbered so far per scalable unit
    out = []
    for count, fab in groups:
        nodes: list[dict[str, str]] = []
        for k in range(count):
            t: dict[str, str] = {}
            if fab is not None:
                if fab.spine_group:
                    t[SPINE_GROUP] = fab.spine_group
                if fab.scalable_unit:
                    t[SCALABLE_UNIT] = fab.scalable_unit
                if fab.leaf_group:
                    t[LEAF_GROUP] = fab.leaf_group
                elif fab.leaf_group_size and fab.scalable_unit:
                    number = leaves_in[fab.scalable_unit] + k // fab.leaf_group_size + 1
                    t[LEAF_GROUP] = f"{fab.scalable_unit}-leaf{number}"
            nodes.append(t)
        if fab is not None and fab.leaf_group_size and fab.scalable_unit:
            leaves_in[fab.scalable_unit] += -(-count // fab.leaf_group_size)
        out.append(nodes)
    return out


def check_nesting(nodes: Sequence[tuple[str, Mapping[str, str]]]) -> None:
    """ValueError when a leaf group spans scalable units or a unit spans spine groups (names, labels)."""
    problems = []
    for fine, coarse in pairwise(TIERS):
        parents: dict[str, set[str]] = defaultdict(set)
        for _, labels in nodes:
            if fine in labels:
                parents[labels[fine]].add(labels.get(coarse, "(none)"))
        problems += [f"{fine}={v} spans {coarse} {sorted(p)}" for v, p in sorted(parents.items()) if len(p) > 1]
    if problems:
        raise ValueError("fabric tiers do not nest: " + "; ".join(problems[:5]))
