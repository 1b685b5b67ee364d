"""NVIDIA's ``GpuConfig``/``MigDeviceConfig`` spelling of topodra's GpuConfig, translated at the boundary (pure).

A claim written for NVIDIA's DRA driver (kubernetes-sigs/dra-driver-nvidia-gpu) carries, once its driver name is
renamed to ours::

    opaque:
      driver: gpu.topodra.io
      parameters:
        apiVersion: resource.nvidia.com/v1beta1
        kind: GpuConfig                       # or MigDeviceConfig
        sharing:
          strategy: TimeSlicing               # or MPS
          timeSlicingConfig: {interval: Long}
          # mpsConfig: {defaultActiveThreadPercentage: 50, defaultPinnedDeviceMemoryLimit: 10Gi}

The models below follow that driver's Go types, not its examples (api/nvidia.com/resource/v1beta1: gpuconfig.go
``GpuConfig{Sharing *GpuSharing}``, migconfig.go ``MigDeviceConfig{Sharing *MigDeviceSharing}``, sharing.go
``GpuSharing{Strategy, TimeSlicingConfig, MpsConfig}``, ``MigDeviceSharing{Strategy, MpsConfig}``,
``TimeSlicingConfig{Interval}``, ``MpsConfig{DefaultActiveThreadPercentage, DefaultPinnedDeviceMemoryLimit,
DefaultPerDevicePinnedMemoryLimit, MultiUser}``).  It decodes claim configs strictly, so an unknown field is an
error there too.  ``translate`` returns topodra's own spelling, which ``config.parse`` then validates exactly as a
topodra config: the same checks and the same effects.  A field topodra cannot honour is refused with its path;
so are NVIDIA's kinds topodra has no equivalent for (VFIO passthrough, ComputeDomains).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

API_VERSION = "resource.nvidia.com/v1beta1"
GPU_KIND = "GpuConfig"
MIG_KIND = "MigDeviceConfig"
# NVIDIA's other config kinds (api.go) and why topodra refuses them.
UNSUPPORTED_KINDS: dict[str, str] = {
    "VfioDeviceConfig": "topodra does not hand GPUs to VMs through VFIO passthrough",
    "ComputeDomainChannelConfig": "topodra has no ComputeDomains (IMEX channels)",
    "ComputeDomainDaemonConfig": "topodra has no ComputeDomains (IMEX daemons)",
}
# NVIDIA's field names -> topodra's, for paths in error messages read back in NVIDIA's spelling.
_RENAMES = {"timeSlicingConfig": "timeSlicing", "mpsConfig": "mps"}
_BACK = {v: k for k, v in _RENAMES.items()}


class NvidiaConfigError(ValueError):
    """An NVIDIA-spelled config topodra refuses; the message names the field (or kind) and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TimeSlicingConfig(_Strict):
    interval: str | None = None


class MpsConfig(_Strict):
    defaultActiveThreadPercentage: int | None = None
    defaultPinnedDeviceMemoryLimit: str | int | None = None  # a resource.Quantity: "10Gi" or a number of bytes
    defaultPerDevicePinnedMemoryLimit: dict[str, str | int] | None = None
    multiUser: bool | None = None


class GpuSharing(_Strict):
    strategy: str
    timeSlicingConfig: TimeSlicingConfig | None = None
    mpsConfig: MpsConfig | None = None


class MigDeviceSharing(_Strict):
    strategy: str
    mpsConfig: MpsConfig | None = None


class GpuConfig(_Strict):
    apiVersion: str
    kind: str
    sharing: GpuSharing | None = None


class MigDeviceConfig(_Strict):
    apiVersion: str
    kind: str
    sharing: MigDeviceSharing | None = None


def is_nvidia(parameters: Mapping[str, Any]) -> bool:
    return parameters.get("apiVersion") == API_VERSION


def topodra_path(path: str) -> str:
    """``sharing.timeSlicingConfig.interval`` -> ``sharing.timeSlicing.interval``."""
    return ".".join(_RENAMES.get(p, p) for p in path.split("."))


def nvidia_path(path: str) -> str:
    """The reverse of ``topodra_path``, for messages about an NVIDIA-spelled config."""
    return ".".join(_BACK.get(p, p) for p in path.split("."))


def nvidia_words(message: str) -> str:
    """A validation message of topodra's model with its block names as NVIDIA spells them."""
    return re.sub(r"\b(timeSlicing|mps)\b", lambda m: _BACK[m.group(1)], message)


def _problems(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}" for err in e.errors())


def _mps(m: MpsConfig, at: str) -> dict[str, Any]:
    if m.defaultPerDevicePinnedMemoryLimit:
        raise NvidiaConfigError(f"{at}.defaultPerDevicePinnedMemoryLimit: topodra cannot honour per-device pinned "
                                "memory limits; set defaultPinnedDeviceMemoryLimit (one limit for every device)")
    if m.multiUser:
        raise NvidiaConfigError(f"{at}.multiUser: topodra cannot honour multiUser: true (its MPS daemon serves the "
                                "claim's containers only, as one user); leave it out or set false")
    out: dict[str, Any] = {}
    if m.defaultActiveThreadPercentage is not None:
        out["defaultActiveThreadPercentage"] = m.defaultActiveThreadPercentage
    if m.defaultPinnedDeviceMemoryLimit is not None:
        out["defaultPinnedDeviceMemoryLimit"] = str(m.defaultPinnedDeviceMemoryLimit)
    return out


def translate(parameters: Mapping[str, Any], api_version: str, kind: str) -> dict[str, Any]:
    """NVIDIA's parameters as topodra's (``api_version``/``kind`` of topodra); NvidiaConfigError names the field.

    ``MigDeviceConfig`` maps to the same GpuConfig (topodra's applies to GPUs and MIG slices alike).  Its
    ``TimeSlicing`` strategy sets nothing in NVIDIA's driver (``MigDeviceSharing.GetTimeSlicingConfig`` returns
    none: a MIG slice has its own compute), so it translates to no sharing config.
    """
    k = parameters.get("kind")
    if k in UNSUPPORTED_KINDS:
        raise NvidiaConfigError(f"kind {k}: {UNSUPPORTED_KINDS[k]}")
    if k not in (GPU_KIND, MIG_KIND):
        raise NvidiaConfigError(f"kind: {k!r} is not one of NVIDIA's sharing configs ({GPU_KIND}, {MIG_KIND})")
    model: type[GpuConfig] | type[MigDeviceConfig] = GpuConfig if k == GPU_KIND else MigDeviceConfig
    try:
        cfg = model.model_validate(dict(parameters))
    except ValidationError as e:
        raise NvidiaConfigError(_problems(e)) from None
    out: dict[str, Any] = {"apiVersion": api_version, "kind": kind}
    s = cfg.sharing
    if s is None:
        return out
    if isinstance(s, MigDeviceSharing) and s.strategy == "TimeSlicing":
        return out
    sharing: dict[str, Any] = {"strategy": s.strategy}
    if isinstance(s, GpuSharing) and s.timeSlicingConfig is not None:
        ts = s.timeSlicingConfig
        sharing["timeSlicing"] = {} if ts.interval is None else {"interval": ts.interval}
    if s.mpsConfig is not None:
        sharing["mps"] = _mps(s.mpsConfig, "sharing.mpsConfig")
    out["sharing"] = sharing
    return out
