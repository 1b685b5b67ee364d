"""Discovery's error type and the knobs an operator can turn.

There is one backend (``nvml.py``): it reads NVML and sysfs.  Mock hardware and
replayed captures build that same backend with a fake ``pynvml`` and a
generated sysfs tree, so there is exactly one discovery code path.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class DiscoveryError(RuntimeError):
    """Discovery cannot produce a trustworthy device list (e.g. a mandatory NVML call failed)."""


class DiscoveryConfig(BaseModel):
    """Operator overrides for topology facts that cannot be read locally.

    Keys use the camelCase spelling of the config file / ``overrides`` dict.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    rails: dict[str, int] = Field(
        default_factory=dict,
        description="RDMA device name (e.g. mlx5_0) -> rail index; replaces the index in compute-NIC order",
    )
    exclude_nics: tuple[str, ...] = Field(
        default=(),
        alias="excludeNics",
        description="RDMA names, netdevs or PCI BDFs that are never compute NICs",
    )
    compute_nics: tuple[str, ...] | None = Field(
        default=None,
        alias="computeNics",
        description="if set, exactly these NICs (names, netdevs, BDFs) are compute NICs",
    )
    min_nic_rate_gbps: int = Field(default=100, alias="minNicRateGbps", ge=0, description="slower NICs are excluded")
    exclude_multi_port: bool = Field(
        default=True,
        alias="excludeMultiPort",
        description="exclude RDMA functions sharing sys_image_guid (dual-port storage cards)",
    )
    share_gpu_memory: bool = Field(
        default=False,
        alias="shareGpuMemory",
        description="publish whole GPUs (MIG off) as shareable by memory (consumable capacity, docs/sharing.md)",
    )
    nvlink_domain_size: int | None = Field(
        default=None,
        alias="nvlinkDomainSize",
        ge=1,
        description="size of a multi-node NVLink domain (e.g. 72); NVML cannot tell it from one node",
    )

    @field_validator("rails")
    @classmethod
    def _rails_non_negative(cls, v: dict[str, int]) -> dict[str, int]:
        bad = {k: r for k, r in v.items() if r < 0}
        if bad:
            raise ValueError(f"rail indexes must be >= 0, got {bad}")
        return v
