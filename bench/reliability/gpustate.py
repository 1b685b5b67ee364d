"""The GPU-effect sibling of ``common.violations``: what the GPUs and the host hold against what the checkpoint records.

Read from the outside, the way an admin would look, never through topodra's own effect code: MIG instances
as the NVML library reports them (``nvmlDeviceGetGpuInstances`` / ``nvmlGpuInstanceGetComputeInstances``),
MPS control daemons as processes (``/proc``: the control binary run with ``-d``, its
``CUDA_MPS_PIPE_DIRECTORY`` under the node's state directory) and as pipe directories, the claims' tmpfs
mounts (``/proc/self/mountinfo``), compute modes (``nvmlDeviceGetComputeMode``) and time-slice levels
(``nvidia-smi compute-policy -l``, the driver tool's own listing).  For each, two directions:

* **leaked**: state that no checkpoint entry records (an instance, daemon, pipe, mount, an exclusive compute
  mode or a time-slice level of no prepared claim);
* **lost**: state that an entry records and that is not there.

Plus one MIG rule that keeps a later crash from leaking: every recorded instance's placement is in the intent
journal (``effects.migjournal``), which is what recovery destroys unrecorded instances by.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from topodra.checkpoint import CheckpointData
from topodra.devices import Device
from topodra.effects.migjournal import MigJournal
from topodra.sharing.config import TIMESLICE_LEVEL

EXCLUSIVE_PROCESS = 3  # nvmlComputeMode_t
MPS_CONTROL = "nvidia-cuda-mps-control"
_LEVEL_LINE = re.compile(r"^GPU (\S+): Timeslice: (\d+)$")
MAX_INSTANCES = 8  # a GPU has at most 7 GPU instances (A100/H100), each at most 7 compute instances


@dataclass(frozen=True)
class Finding:
    """One broken GPU-effect invariant: which effect's state, leaked or lost, the claim it belongs to
    (None: a GPU-wide state no claim owns, or that of an unknown claim), and what exactly."""

    effect: str  # "mig", "mps", "timeslice"
    kind: str    # "leaked" or "lost"
    claim: str | None
    what: str

    def __str__(self) -> str:
        return f"{self.kind} {self.effect}: {self.what}"


@dataclass(frozen=True)
class Observed:
    """What one look at the node found."""

    mig: frozenset[tuple[str, int, int | None]]  # (parent UUID, GPU instance id, compute instance id or None)
    daemons: Mapping[str, list[int]]           # claim UID -> pids of MPS control daemons with its pipe directory
    pipes: frozenset[str]                        # claim UIDs with an MPS pipe directory
    mounts: frozenset[str]                       # claim UIDs with a mount at their MPS shm directory
    exclusive: frozenset[str]                    # GPU UUIDs in EXCLUSIVE_PROCESS compute mode
    levels: Mapping[str, int]                    # GPU UUID -> time-slice level


class Probe:
    """Looks at one node: its driver tree (tools, NVML already loaded into ``pynvml``) and its state directory."""

    def __init__(self, pynvml: Any, tree: Path, state_dir: Path, devices: Iterable[Device]) -> None:
        self.nvml = pynvml
        self.tree = tree
        self.mps_root = (state_dir / "mps").resolve()
        devs = list(devices)
        self.gpus = sorted({d.uuid for d in devs if d.kind == "gpu" and d.uuid})
        self.mig_parents = sorted({str(d.attributes["parentUUID"].value) for d in devs if d.kind == "mig"})
        self.gi_profiles = sorted({int(d.attributes["migProfileID"].value) for d in devs if d.kind == "mig"})
        self.nvml.nvmlInit()

    def look(self) -> Observed:
        return Observed(mig=frozenset(self._mig()), daemons=self._daemons(), pipes=frozenset(self._dirs("pipe")),
                        mounts=frozenset(self._mounts()), exclusive=frozenset(self._exclusive()),
                        levels=self._levels())

    def _mig(self) -> set[tuple[str, int, int | None]]:
        n = self.nvml
        out: set[tuple[str, int, int | None]] = set()
        for parent in self.mig_parents:
            h = n.nvmlDeviceGetHandleByUUID(parent)
            for pid in self.gi_profiles:
                gis = (n.c_nvmlGpuInstance_t * MAX_INSTANCES)()
                count = ctypes.c_uint(MAX_INSTANCES)  # in: the array size, out: how many
                n.nvmlDeviceGetGpuInstances(h, pid, gis, ctypes.byref(count))
                for gi in gis[:count.value]:
                    gi_id = int(n.nvmlGpuInstanceGetInfo(gi).id)
                    cis: list[int | None] = list(self._cis(gi)) or [None]  # None: a GPU instance without one
                    out.update((parent, gi_id, c) for c in cis)
        return out

    def _cis(self, gi: Any) -> list[int]:
        n = self.nvml
        found: list[int] = []
        for index in range(8):  # NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE .. _COUNT; the listing takes the profile id
            cis = (n.c_nvmlComputeInstance_t * MAX_INSTANCES)()
            count = ctypes.c_uint(MAX_INSTANCES)  # in: the array size, out: how many
            try:
                profile = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, index, 0)  # engine profile SHARED
                n.nvmlGpuInstanceGetComputeInstances(gi, profile.id, cis, ctypes.byref(count))
            except n.NVMLError:  # a profile this GPU instance does not offer
                continue
            found += [int(n.nvmlComputeInstanceGetInfo(c).id) for c in cis[:count.value]]
        return found

    def _uid_of(self, path: str) -> str | None:
        """The claim UID of a path ``<state>/mps/<uid>/...``, else None."""
        try:
            rel = Path(path).resolve().relative_to(self.mps_root)
        except ValueError:
            return None
        return rel.parts[0] if rel.parts else None

    def _daemons(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                argv = (p / "cmdline").read_bytes().split(b"\0")
                if not argv or os.path.basename(argv[0]) != MPS_CONTROL.encode() or b"-d" not in argv[1:]:
                    continue
                env = dict(kv.split(b"=", 1) for kv in (p / "environ").read_bytes().split(b"\0") if b"=" in kv)
                state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, ValueError):  # gone meanwhile
                continue
            if state == "Z":
                continue
            uid = self._uid_of(os.fsdecode(env.get(b"CUDA_MPS_PIPE_DIRECTORY", b"")))
            if uid is not None:
                out.setdefault(uid, []).append(int(p.name))
        return out

    def _dirs(self, name: str) -> set[str]:
        try:
            return {d.name for d in self.mps_root.iterdir() if (d / name).is_dir()}
        except FileNotFoundError:
            return set()

    def _mounts(self) -> set[str]:
        out = set()
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            uid = self._uid_of(fields[4]) if len(fields) > 4 else None
            if uid is not None:
                out.add(uid)
        return out

    def _exclusive(self) -> set[str]:
        n = self.nvml
        return {u for u in self.gpus + self.mig_parents
                if n.nvmlDeviceGetComputeMode(n.nvmlDeviceGetHandleByUUID(u)) == EXCLUSIVE_PROCESS}

    def _levels(self) -> dict[str, int]:
        lib = self.tree / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
        env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")}
        r = subprocess.run([str(self.tree / "usr/bin/nvidia-smi"), "compute-policy", "-l"], capture_output=True,
                           text=True, timeout=30, check=False, env={**env, "LD_PRELOAD": str(lib)})
        if r.returncode != 0:
            raise RuntimeError(f"nvidia-smi compute-policy -l failed ({r.returncode}): {r.stderr.strip()}")
        out = {}
        for line in r.stdout.splitlines():
            m = _LEVEL_LINE.match(line.strip())
            if m:
                out[m.group(1)] = int(m.group(2))
        return out


def expected_levels(data: CheckpointData, devices: Mapping[str, Device]) -> dict[str, int]:
    """GPU UUID -> the time-slice level its prepared claims ask for (absent: Default)."""
    out: dict[str, int] = {}
    for e in data.claims.values():
        for d in e.devices:
            dev = devices.get(d.device_name)
            if dev is None or not dev.uuid or d.sharing is None or d.sharing.strategy != "TimeSlicing":
                continue
            level = TIMESLICE_LEVEL[d.sharing.interval]
            if level:
                out[dev.uuid] = max(out.get(dev.uuid, 0), level)
    return out


def findings(seen: Observed, data: CheckpointData, devices: Mapping[str, Device],
             journal: MigJournal | None = None) -> list[Finding]:
    """Every leaked or lost piece of GPU-effect state (pure but for the journal read)."""
    out: list[Finding] = []
    owner: dict[tuple[str, int, int | None], str] = {}
    for e in data.claims.values():
        for d in e.devices:
            if d.mig is not None:
                owner[(d.mig.parent_uuid, d.mig.gpu_instance, d.mig.compute_instance)] = e.uid
    for key in sorted(seen.mig - set(owner), key=str):
        out.append(Finding("mig", "leaked", None, f"MIG instance GPU {key[0]} GI {key[1]} CI {key[2]}: no entry"))
    for key in sorted(set(owner) - seen.mig, key=str):
        out.append(Finding("mig", "lost", owner[key],
                           f"claim {owner[key]} records MIG instance GPU {key[0]} GI {key[1]} CI {key[2]}: gone"))
    if journal is not None:
        intents = journal.keys()
        for e in data.claims.values():
            for m in e.mig_instances:
                if m.placement_key not in intents:
                    out.append(Finding("mig", "leaked", e.uid, f"claim {e.uid}'s MIG instance at {m.placement_key} "
                                       "is not in the intent journal (a crashed unprepare would leak it)"))

    mps = {e.uid for e in data.claims.values() if any(d.sharing is not None and d.sharing.strategy == "MPS"
                                                      for d in e.devices)}
    for what, uids in (("control daemon process", set(seen.daemons)), ("pipe directory", set(seen.pipes)),
                       ("shm tmpfs mount", set(seen.mounts))):
        out += [Finding("mps", "leaked", u, f"MPS {what} of claim {u}: no entry") for u in sorted(uids - mps)]
        out += [Finding("mps", "lost", u, f"claim {u} records an MPS daemon; its {what} is gone")
                for u in sorted(mps - uids)]
    out += [Finding("mps", "leaked", u, f"claim {u} has {len(p)} MPS control daemons: {p}")
            for u, p in sorted(seen.daemons.items()) if len(p) > 1]
    whole = {devices[d.device_name].uuid for e in data.claims.values() for d in e.devices
             if d.sharing is not None and d.sharing.strategy == "MPS" and d.mig is None and d.access == "exclusive"
             and d.device_name in devices}
    out += [Finding("mps", "leaked", None, f"GPU {u} in EXCLUSIVE_PROCESS: no MPS claim holds it whole")
            for u in sorted(seen.exclusive - whole)]
    out += [Finding("mps", "lost", None, f"GPU {u} held whole by an MPS claim is not in EXCLUSIVE_PROCESS")
            for u in sorted(whole - seen.exclusive)]

    want = expected_levels(data, devices)
    for uuid in sorted(set(want) | {u for u, lv in seen.levels.items() if lv}):
        have, need = seen.levels.get(uuid, 0), want.get(uuid, 0)
        if have != need:
            kind = "leaked" if need == 0 or have > need else "lost"
            out.append(Finding("timeslice", kind, None, f"GPU {uuid} runs time-slice level {have}; the "
                                                        f"checkpoint's claims ask for {need}"))
    return out
