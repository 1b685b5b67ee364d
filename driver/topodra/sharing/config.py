"""``GpuConfig``: typed sharing config that DeviceClasses and claims hand to prepare as opaque parameters (pure).

A DeviceClass (``spec.config``) or a claim (``spec.devices.config``) may carry::

    opaque:
      driver: gpu.topodra.io
      parameters:
        apiVersion: gpu.topodra.io/v1alpha1
        kind: GpuConfig
        sharing:
          strategy: TimeSlicing            # or MPS
          timeSlicing: {interval: Short}   # Default | Short | Medium | Long
          # mps: {defaultActiveThreadPercentage: 50, defaultPinnedDeviceMemoryLimit: 10Gi}

The scheduler copies both into ``status.allocation.devices.config`` (``source``
FromClass or FromClaim, optional ``requests`` scoping).  ``resolve`` picks the
config of each allocated request: class configs first, then claim configs, the
last matching one wins (a claim overrides its class).  Another driver's opaque
config is none of our business and is skipped; a bad one of ours is an error
that names the claim, so prepare refuses the claim before changing anything.
NVIDIA's DRA driver's ``GpuConfig``/``MigDeviceConfig`` (``resource.nvidia.com/v1beta1``)
is accepted as another spelling of this one (``nvidiaconfig``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from topodra.selectors import parse_quantity
from topodra.sharing import nvidiaconfig

API_VERSION = "gpu.topodra.io/v1alpha1"
KIND = "GpuConfig"
Interval = Literal["Default", "Short", "Medium", "Long"]
# ``nvidia-smi compute-policy --set-timeslice`` levels (NVML's timeslice scheduler levels).
TIMESLICE_LEVEL: dict[str, int] = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
# Claim-level configs are applied after class-level ones, so they override them.
_SOURCE_ORDER = {"FromClass": 0, "FromClaim": 1}


class ConfigError(ValueError):
    """An opaque config of our driver that prepare cannot use; the message says which entry and why."""


class TimeSlicing(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    interval: Interval = "Default"


class Mps(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    defaultActiveThreadPercentage: int | None = Field(default=None, ge=1, le=100)
    defaultPinnedDeviceMemoryLimit: str | None = None

    @field_validator("defaultPinnedDeviceMemoryLimit")
    @classmethod
    def _quantity(cls, v: str | None) -> str | None:
        if v is not None and parse_quantity(v) <= 0:
            raise ValueError(f"{v!r} must be a positive memory quantity (e.g. 10Gi)")
        return v

    def pinned_limit_bytes(self) -> int | None:
        return None if self.defaultPinnedDeviceMemoryLimit is None \
            else int(parse_quantity(self.defaultPinnedDeviceMemoryLimit))


class Sharing(BaseModel):
    """How the processes of the claim (and of other claims on the same GPU) share it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    strategy: Literal["TimeSlicing", "MPS"]
    timeSlicing: TimeSlicing | None = None
    mps: Mps | None = None

    @model_validator(mode="after")
    def _one_block(self) -> Sharing:
        if self.strategy == "TimeSlicing" and self.mps is not None:
            raise ValueError("strategy TimeSlicing takes a timeSlicing block, not mps")
        if self.strategy == "MPS" and self.timeSlicing is not None:
            raise ValueError("strategy MPS takes an mps block, not timeSlicing")
        return self

    @property
    def interval(self) -> Interval:
        return self.timeSlicing.interval if self.timeSlicing is not None else "Default"


class GpuConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    apiVersion: Literal["gpu.topodra.io/v1alpha1"]
    kind: Literal["GpuConfig"]
    sharing: Sharing | None = None


def _problems(e: ValidationError, nvidia: bool = False) -> str:
    def path(err: Any) -> str:
        p = ".".join(str(x) for x in err["loc"]) or "(top)"
        return nvidiaconfig.nvidia_path(p) if nvidia else p

    def msg(err: Any) -> str:
        return nvidiaconfig.nvidia_words(str(err["msg"])) if nvidia else str(err["msg"])

    return "; ".join(f"{path(err)}: {msg(err)}" for err in e.errors())


def parse(parameters: Any) -> GpuConfig:
    """One opaque ``parameters`` object of our driver as a GpuConfig; ConfigError listing every problem.

    NVIDIA's spelling (apiVersion ``resource.nvidia.com/v1beta1``, ``nvidiaconfig``) is translated first and then
    validated as ours; its problems are reported with NVIDIA's field names and kind.
    """
    if not isinstance(parameters, Mapping):
        raise ConfigError(f"parameters must be an object with apiVersion {API_VERSION} and kind {KIND}")
    nvidia = nvidiaconfig.is_nvidia(parameters)
    kind = str(parameters.get("kind")) if nvidia else KIND
    try:
        raw = nvidiaconfig.translate(parameters, API_VERSION, KIND) if nvidia else dict(parameters)
        return GpuConfig.model_validate(raw)
    except nvidiaconfig.NvidiaConfigError as e:
        raise ConfigError(f"invalid {kind} ({nvidiaconfig.API_VERSION}): {e}") from None
    except ValidationError as e:
        suffix = f" ({nvidiaconfig.API_VERSION})" if nvidia else ""
        raise ConfigError(f"invalid {kind}{suffix}: {_problems(e, nvidia)}") from None


def _applies(requests: Sequence[str], request: str) -> bool:
    """A config with no ``requests`` applies to all; ``gpus`` also covers subrequest ``gpus/h100``."""
    return not requests or request in requests or request.split("/", 1)[0] in requests


def resolve(configs: Sequence[Mapping[str, Any]], driver_name: str, requests: Sequence[str]
            ) -> dict[str, Sharing | None]:
    """Each allocated request name (as in the results) -> its sharing config (None: none given).

    ``configs``: ``status.allocation.devices.config``.  ConfigError names the bad entry.
    """
    ours: list[tuple[int, int, list[str], GpuConfig]] = []
    for i, c in enumerate(configs):
        opaque = c.get("opaque") if isinstance(c, Mapping) else None
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver_name:
            continue  # another driver's config (or a non-opaque kind we do not know)
        source = str(c.get("source", ""))
        if source not in _SOURCE_ORDER:
            raise ConfigError(f"config entry {i}: unknown source {source!r} (FromClass or FromClaim)")
        scope = c.get("requests") or []
        if not isinstance(scope, list) or not all(isinstance(r, str) for r in scope):
            raise ConfigError(f"config entry {i}: requests must be a list of request names")
        try:
            cfg = parse(opaque.get("parameters"))
        except ConfigError as e:
            raise ConfigError(f"config entry {i} ({source}): {e}") from None
        ours.append((_SOURCE_ORDER[source], i, scope, cfg))
    ours.sort(key=lambda t: (t[0], t[1]))
    out: dict[str, Sharing | None] = {}
    for r in requests:
        chosen: Sharing | None = None
        for _o, _i, scope, cfg in ours:
            if _applies(scope, r):
                chosen = cfg.sharing
        out[r] = chosen
    return out
