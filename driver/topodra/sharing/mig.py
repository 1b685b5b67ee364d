"""MIG as partitionable devices: pure "GPU + its GPU-instance profiles -> counter set + placement devices".

Each MIG-enabled GPU owns one counter set: one counter per memory slice
(``memory-slice-<i>``, value 1) and ``compute-slices`` (the largest profile's
compute slices, 7 on A100/H100).  Every possible placement (profile x start
slot) is a device consuming the memory slices it covers and its compute
slices, so two placements that overlap, or that together need more compute
than the GPU has, can never both be allocated.  The whole GPU consumes all of
them: it cannot be handed out while any slice of it is, nor the reverse.

With MIG mode on, CUDA sees no device on the whole GPU (only on its instances),
so, as NVIDIA's DRA driver does not offer such a GPU whole, its whole device is
published with ``type: gpu-mig-parent``: the GPU DeviceClasses (``type ==
"gpu"``) never hand it out.  It stays published, owning the counter set, for an
admin's own class (tools such as nvidia-smi or DCGM that want the whole GPU).

Device names are DNS labels, so the profile's dot becomes a dash:
``gpu-3-mig-1g-10gb-0`` is the 1g.10gb instance starting at memory slice 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from topodra.devices import AttributeValue, Device, int_attr, string_attr

COMPUTE_COUNTER = "compute-slices"
MIG_PARENT_TYPE = "gpu-mig-parent"  # the whole device of a MIG-enabled GPU: no GPU class selects it
STD_PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
# Parent attributes that describe the whole GPU, not a slice of it.
# ``index`` is the GPU's NVML index: a MIG device carries it as ``parentIndex``, as NVIDIA's driver did.
_PARENT_ONLY = frozenset({"type", "uuid", "minor", "index", "migCapable", STD_PCI_BUS_ID})
# NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE index for a compute instance spanning n compute slices.
CI_PROFILE_INDEX: dict[int, int] = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}


class MigProfile(BaseModel):
    """One GPU-instance profile as NVML describes it (name without the "MIG " prefix)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(pattern=r"^[0-9]+g\.[0-9]+gb$")
    profile_id: int = Field(ge=0)
    compute_slices: int = Field(ge=1)
    memory_mib: int = Field(ge=1)
    multiprocessors: int = Field(ge=1)
    placements: tuple[tuple[int, int], ...]  # (start, size) in memory slices


class MigPlacement(BaseModel):
    """What prepare needs to create one placement device's instances (read back from its attributes)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    parent_uuid: str
    profile: str
    profile_id: int
    start: int
    size: int
    compute_slices: int

    @property
    def ci_profile_index(self) -> int:
        """The compute-instance profile spanning the whole GPU instance."""
        return CI_PROFILE_INDEX[self.compute_slices]


def memory_counter(i: int) -> str:
    return f"memory-slice-{i}"


def counter_set_name(gpu_name: str) -> str:
    return f"{gpu_name}-mig"


def mig_device_name(gpu_name: str, profile: str, start: int) -> str:
    return f"{gpu_name}-mig-{profile.replace('.', '-')}-{start}"


def mib_quantity(mib: int) -> str:
    """MiB as the apiserver writes the quantity back (canonical: 80896Mi is "79Gi"), so re-reads compare equal."""
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


def gpu_counters(profiles: Sequence[MigProfile]) -> dict[str, str]:
    """The counter set of one GPU: every memory slice any placement covers, and the compute slices."""
    if not profiles:
        raise ValueError("a MIG-enabled GPU needs at least one GPU-instance profile")
    slots = max(start + size for p in profiles for start, size in p.placements)
    out = {memory_counter(i): "1" for i in range(slots)}
    out[COMPUTE_COUNTER] = str(max(p.compute_slices for p in profiles))
    return out


def partition(gpu: Device, profiles: Sequence[MigProfile]) -> list[Device]:
    """The whole GPU (owning and consuming its counter set, typed ``gpu-mig-parent`` so GPU classes skip it)
    followed by one device per MIG placement."""
    if gpu.kind != "gpu":
        raise ValueError(f"{gpu.name} is not a GPU")
    counters = gpu_counters(profiles)
    cset = counter_set_name(gpu.name)
    whole = gpu.model_copy(update={"shared_counters": {cset: counters}, "consumes_counters": {cset: counters},
                                   "attributes": {**gpu.attributes, "type": string_attr(MIG_PARENT_TYPE)}})
    inherited = {k: v for k, v in gpu.attributes.items() if k not in _PARENT_ONLY}
    out = [whole]
    for p in sorted(profiles, key=lambda p: (p.compute_slices, p.memory_mib, p.name)):
        if p.compute_slices not in CI_PROFILE_INDEX:
            raise ValueError(f"{gpu.name}: profile {p.name} has {p.compute_slices} compute slices; no CI profile")
        for start, size in p.placements:
            attrs: dict[str, AttributeValue] = {
                **inherited,
                "type": string_attr("mig"),
                "profile": string_attr(p.name),
                "parentUUID": string_attr(gpu.uuid),
                "parentDevice": string_attr(gpu.name),
                **({"parentIndex": gpu.attributes["index"]} if "index" in gpu.attributes else {}),
                "migProfileID": int_attr(p.profile_id),
                "placementStart": int_attr(start),
                "placementSize": int_attr(size),
                "computeSlices": int_attr(p.compute_slices),
            }
            use = {memory_counter(i): "1" for i in range(start, start + size)}
            use[COMPUTE_COUNTER] = str(p.compute_slices)
            out.append(Device(
                name=mig_device_name(gpu.name, p.name, start),
                kind="mig",
                attributes=attrs,
                capacity={"memory": mib_quantity(p.memory_mib), "multiprocessors": str(p.multiprocessors)},
                consumes_counters={cset: use},
                device_nodes=gpu.device_nodes,  # MIG access goes through the parent's /dev/nvidiaN
            ))  # fmt: skip
    return out


def placement_of(device: Device) -> MigPlacement:
    """The instance a MIG placement device stands for; ValueError for any other device."""
    a = device.attributes
    try:
        if a["type"].value != "mig":
            raise KeyError("type")
        return MigPlacement(
            parent_uuid=str(a["parentUUID"].value),
            profile=str(a["profile"].value),
            profile_id=int(a["migProfileID"].value),
            start=int(a["placementStart"].value),
            size=int(a["placementSize"].value),
            compute_slices=int(a["computeSlices"].value),
        )
    except KeyError as e:
        raise ValueError(f"device {device.name} is not a MIG placement (missing {e})") from e
