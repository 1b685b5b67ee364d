"""When a claim is idle (pure): its GPUs stay below both thresholds for the idle time.

A sample is *below* when every GPU of the claim was read and has compute activity under ``activity_below`` and
memory in use under ``memory_below`` of its total. Activity is GPM SM activity where the GPU has GPM (Hopper and
later), else NVML's time-occupancy utilisation, which is higher for the same work (one kernel on one SM reads
100%), so the rule errs towards busy. A GPU that could not be read makes the sample *unknown*, which restarts
the clock: a claim is never flagged on missing data.

Defaults: activity below 5% (a training or inference job keeps SMs far busier; an idle CUDA context and
monitoring tools stay under 1%), memory below 10% of the GPU (a CUDA context takes ~0.5 GiB, 0.6% of an 80 GB GPU;
a loaded model takes far more, so a job that holds a model in memory is not flagged by default: set
``memory_below`` to 1.0 to flag on activity alone), and 15 minutes, the warning time idle policies in use pick.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_ACTIVITY_BELOW = 0.05
DEFAULT_MEMORY_BELOW = 0.10
DEFAULT_IDLE_SECONDS = 900.0


class IdleRule(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    activity_below: float = Field(default=DEFAULT_ACTIVITY_BELOW, gt=0, le=1)
    memory_below: float = Field(default=DEFAULT_MEMORY_BELOW, gt=0, le=1)
    idle_seconds: float = Field(default=DEFAULT_IDLE_SECONDS, ge=0)


@dataclass(frozen=True)
class GpuLevel:
    """What the rule reads of one GPU in one sample; ``None``: not read."""

    activity: float | None
    memory_ratio: float | None


def below(rule: IdleRule, gpus: Sequence[GpuLevel]) -> bool | None:
    """True when every GPU is below both thresholds, False when one is not, None when one was not read."""
    if not gpus:
        return None
    if any(g.activity is None or g.memory_ratio is None for g in gpus):
        return None
    return all(g.activity < rule.activity_below and g.memory_ratio < rule.memory_below  # type: ignore[operator]
               for g in gpus)


@dataclass(frozen=True)
class IdleState:
    below_since: float | None = None  # start of the current run of below samples

    def idle(self, rule: IdleRule, now: float) -> bool:
        return self.below_since is not None and now - self.below_since >= rule.idle_seconds

    def idle_for(self, now: float) -> float:
        return 0.0 if self.below_since is None else max(0.0, now - self.below_since)


def step(state: IdleState, is_below: bool | None, now: float) -> IdleState:
    """The claim's state after one sample taken at ``now``."""
    if is_below is not True:
        return IdleState()
    return state if state.below_since is not None else IdleState(below_since=now)
