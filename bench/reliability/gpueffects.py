"""Crash campaign with GPU effects: MIG, MPS, time-sliced and shared-memory claims through the C NVML stand-in.

``crash.py``'s kill -9 campaign (fork a plugin, kill it, restart, let the kubelet retry) on nodes whose claims
change the GPUs: each node is a driver tree from ``hack/driver-tree`` (the stand-in ``libnvidia-ml.so.1``,
``nvidia-smi`` and MPS control binaries; MIG instances, compute modes and time-slice levels live in the
stand-in's state file, so they outlive a killed process as on a GPU), loaded the production way
(``nvmllib.load``) and discovered by the ``nvml`` backend.  The effects are the plugin's own
(``effects.standard`` with ``MigInstances``, ``NvidiaSmiTimeSlice``, ``MpsDaemons`` in process mode with
``NvidiaSmiComputeMode``, all from the driver root).  Claims carry their GpuConfig in
``status.allocation.devices.config`` and are read by ``claims.allocated_claim``, as the plugin reads them.

Three nodes, because MIG mode is per GPU and the profiles set it per node, and because a node shares its
GPUs by memory or not at all:

* ``mig`` (dgx-a100-80gb-mig): MIG placements, alone or with an MPS daemon serving the MIG UUID;
* ``whole`` (dgx-a100-80gb): whole GPUs with a time-slice level, or with MPS (EXCLUSIVE_PROCESS);
* ``shared`` (dgx-a100-80gb, ``shareGpuMemory``): memory shares of a GPU (shareID, consumedCapacity), plain,
  time-sliced (the GPU's one level) or with MPS (a daemon per claim, the GPU stays DEFAULT).

Every run goes to the next crash point in turn (each node's list: the points its prepare and unprepare
reach, and a SIGKILL of the plugin process after a random delay up to the longest run seen), so
a small run count covers every point.  Each run prepares one new claim of each kind of its node, sometimes one
more (in calls of one or two claims, merged when they queue: then ``prepare-mid-cdi`` is reached).  After the
restart and after the retries: ``common.violations`` and
``gpustate.findings`` (no MIG instance, MPS daemon, pipe, tmpfs, exclusive compute mode or time-slice level
that no entry records; every recorded one there).  Counted per effect and crash point.

Run in a fresh interpreter per node (``python -m bench.reliability.gpueffects --node KIND``): a process
holds one NVML library.  MPS mounts tmpfs, so it needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid as uuidlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.paths import REPO
from bench.reliability import crash, gpustate
from bench.reliability.common import DRIVER, NODE, Node, quiet, violations

from topodra.claims import ClaimRef
from topodra.devices import Device
from topodra.state import DeviceState

EFFECTS = ("mig", "mps", "timeslice", "shared-memory")
PREPARE = ("prepare-before-write", "prepare-mid-cdi", "after-cdi-written", "after-checkpoint-written")
UNPREPARE = crash.UNPREPARE_POINTS
NODES: dict[str, tuple[str, dict[str, Any]]] = {
    "mig": ("dgx-a100-80gb-mig", {}),
    "whole": ("dgx-a100-80gb", {}),
    "shared": ("dgx-a100-80gb", {"shareGpuMemory": True}),
}
KINDS = {"mig": ("mig", "mig+mps"), "whole": ("timeslice", "mps"),
         "shared": ("shared", "shared+timeslice", "shared+mps")}  # the claims each node makes
SHARE = "10Gi"  # each memory share; 8 fit on an 80 GB GPU
SHARES_PER_GPU = 8
INTERVALS = ("Short", "Medium", "Long")


def points(kind: str) -> tuple[str, ...]:
    """The crash points a run on this node goes through, in turn (MIG's own point only where MIG is)."""
    mig = ("after-mig-created",) if kind == "mig" else ()
    return (crash.EXTERNAL_KILL, *mig, *PREPARE, *UNPREPARE)


def gpu_config(sharing: dict[str, Any]) -> list[dict[str, Any]]:
    """``status.allocation.devices.config`` with one claim config of ours for the request ``gpus``."""
    return [{"source": "FromClaim", "requests": ["gpus"],
             "opaque": {"driver": DRIVER, "parameters": {"apiVersion": "gpu.topodra.io/v1alpha1",
                                                         "kind": "GpuConfig", "sharing": sharing}}}]


def claim_obj(name: str, uid: str, devs: Sequence[str], sharing: dict[str, Any] | None,
              share: bool) -> dict[str, Any]:
    """An allocated ResourceClaim of request ``gpus`` (memory shares: with shareID and consumedCapacity)."""
    results = []
    for d in devs:
        r: dict[str, Any] = {"request": "gpus", "driver": DRIVER, "pool": NODE, "device": d}
        if share:
            r.update(shareID=str(uuidlib.uuid4()), consumedCapacity={"memory": SHARE})
        results.append(r)
    devices: dict[str, Any] = {"results": results}
    if sharing is not None:
        devices["config"] = gpu_config(sharing)
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "gpu", "uid": uid}, "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": devices}}}


@dataclass(frozen=True)
class Tree:
    """One node's driver tree and hardware: built once, then loaded into this process's pynvml."""

    kind: str
    tree: Path
    devices: tuple[Device, ...]

    @staticmethod
    def build(kind: str, root: Path) -> Tree:
        from testkit.standin import driver_tree

        from topodra.hardware import load_backend
        from topodra.hardware.mockprofile import build_tree, load_profile

        profile, overrides = NODES[kind]
        tree = driver_tree(root / "tree", profile, node=NODE)
        build_tree(load_profile(profile), frozenset()).materialize(str(root / "sysfs"))
        devs = load_backend("nvml", NODE, sysfs_root=str(root / "sysfs"), overrides=overrides,
                            nvidia_driver_root=str(tree)).discover()
        return Tree(kind, tree, tuple(devs))


class GpuNode(Node):
    """A node whose plugin has the production GPU effects over the tree's stand-in."""

    def __init__(self, root: Path, hw: Tree) -> None:
        super().__init__(root)
        self.hw = hw

    def state(self, crash_point: str | None = None) -> DeviceState:
        import pynvml

        from topodra import effects
        from topodra.inventory import Inventory
        from topodra.sharing.computemode import NvidiaSmiComputeMode
        from topodra.sharing.instances import MigInstances
        from topodra.sharing.mps import MpsDaemons
        from topodra.sharing.timeslice import NvidiaSmiTimeSlice

        tree = self.hw.tree
        daemons = MpsDaemons(self.state_dir, driver_root=tree, compute_mode=NvidiaSmiComputeMode(driver_root=tree),
                             shm_size=1 << 20)
        fx = effects.standard(self.state_dir, mig=MigInstances(pynvml, proc_root=str(tree / "proc")),
                              timeslice=NvidiaSmiTimeSlice(driver_root=tree), mps=daemons)
        return DeviceState(DRIVER, NODE, Inventory(list(self.hw.devices)), self.cdi_root, self.state_dir,
                           boot_id_path=str(self.boot), crash_point=crash_point, nvidia_spec_dirs=[],
                           gpu_effects=fx)


@dataclass
class Cell:
    """One effect at one crash point: runs with its claims in the operation, those that died, what broke."""

    runs: int = 0
    died: int = 0
    leaked: int = 0
    lost: int = 0


class GpuCampaign(crash.Campaign):
    """``crash.Campaign`` with GPU-effect claims, crash points in turn and the GPU-state checks."""

    def __init__(self, root: Path, seed: int, hw: Tree) -> None:
        import pynvml

        super().__init__(root, seed, node=GpuNode(root / "node", hw).setup())
        self.hw = hw
        self.by_name = {d.name: d for d in hw.devices}
        self.points = points(hw.kind)
        self.effects_of: dict[str, frozenset[str]] = {}
        self.cells: dict[tuple[str, str], Cell] = {}
        self.probe = gpustate.Probe(pynvml, hw.tree, self.node.state_dir, hw.devices)
        self.findings: list[str] = []
        # Recorded state found in place, summed over every look: MIG instances, MPS daemons (with pipe and
        # mount), GPUs at a non-default time-slice level.
        self.checked = {"mig": 0, "mps": 0, "timeslice": 0}
        self._durations: list[float] = [0.05]
        self._shares: dict[str, int] = {}  # GPU -> shares in prepared claims

    # ---- the claims ----

    def _used(self) -> tuple[set[str], set[tuple[str, str]], dict[str, int]]:
        """Devices held whole, MIG memory slices in use, memory shares per GPU (of the prepared claims)."""
        held: set[str] = set()
        slices: set[tuple[str, str]] = set()
        shares: dict[str, int] = {}
        for _ref, devs in self.prepared.values():
            for n in devs:
                dev = self.by_name[n]
                if dev.allow_multiple_allocations:
                    shares[n] = shares.get(n, 0) + 1
                else:
                    held.add(n)
                    slices |= _memory_slices(dev)
        return held, slices, shares

    def _pick(self, kind: str, held: set[str], slices: set[tuple[str, str]], shares: dict[str, int]) -> list[str]:
        """Devices for a new claim of ``kind`` that no prepared claim holds (as the scheduler would allocate);
        the sets are updated."""
        rng = self.rng
        out: list[str] = []
        if kind in ("mig", "mig+mps"):  # 1g.10gb placements: 7 per GPU, never more compute than the GPU has
            small = [d for d in self.hw.devices if d.kind == "mig" and d.attributes["placementSize"].value == 1]
            rng.shuffle(small)
            want = rng.randint(1, 2) if kind == "mig" else 1
            for d in small:
                if len(out) < want and not _memory_slices(d) & slices:
                    out.append(d.name)
                    slices |= _memory_slices(d)
            return out
        gpus = [d.name for d in self.hw.devices if d.kind == "gpu"]
        if kind.startswith("shared"):
            free = [g for g in gpus if shares.get(g, 0) < SHARES_PER_GPU
                    and (kind != "shared+timeslice" or self._level(g) is not None)]
            if free:
                out = [rng.choice(free)]
                shares[out[0]] = shares.get(out[0], 0) + 1
            return out
        free = [g for g in gpus if g not in held]
        rng.shuffle(free)
        out = free[:rng.randint(1, 2) if kind == "mps" else 1]
        held.update(out)
        return out

    def _level(self, gpu: str) -> str | None:
        """The one interval shared time-sliced claims on ``gpu`` ask for (the odd GPUs have none)."""
        n = int(gpu.rsplit("-", 1)[1])
        return None if n % 2 else INTERVALS[(n // 2) % len(INTERVALS)]

    def _new_claims(self) -> list[ClaimRef]:
        """One claim of each kind this node has, in random order, and sometimes one more of any kind."""
        kinds = list(KINDS[self.hw.kind])
        if self.rng.random() < 0.5:
            kinds.append(self.rng.choice(kinds))
        self.rng.shuffle(kinds)
        held, slices, shares = self._used()
        refs = []
        for kind in kinds:
            devs = self._pick(kind, held, slices, shares)
            if not devs:
                continue
            sharing: dict[str, Any] | None = None
            if kind.endswith("mps"):
                sharing = {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 50}}
            elif kind == "timeslice":
                sharing = {"strategy": "TimeSlicing", "timeSlicing": {"interval": self.rng.choice(INTERVALS)}}
            elif kind == "shared+timeslice":
                sharing = {"strategy": "TimeSlicing", "timeSlicing": {"interval": self._level(devs[0])}}
            self.counter += 1
            uid = f"{self.counter:08x}-6e1f-4c00-8000-{self.rng.getrandbits(48):012x}"
            name = f"claim-{self.counter}"
            self.api[("gpu", name)] = claim_obj(name, uid, devs, sharing, share=kind.startswith("shared"))
            self.effects_of[uid] = effects_of_kind(kind)
            refs.append(ClaimRef("gpu", uid, name))
        return refs

    # ---- the runs ----

    @property
    def kill_delay_s(self) -> float:  # type: ignore[override]
        """Up to the longest of the last runs (to their crash point or end), so a kill lands anywhere in
        recovery, prepare or unprepare."""
        return max(self._durations[-20:])

    def _choose_point(self, unprep: list[ClaimRef], fresh: list[ClaimRef]) -> str:
        """The next point in turn; at an unprepare point the unprepare takes a claim of each effect prepared."""
        point = self.points[(self.totals.runs - 1) % len(self.points)]
        if point in UNPREPARE:
            have = set().union(*(self.effects_of[r.uid] for r in unprep)) if unprep else set()
            for ref, _devs in list(self.prepared.values()):
                if ref not in unprep and self.effects_of[ref.uid] - have:
                    unprep.append(ref)
                    have |= self.effects_of[ref.uid]
        self._started = time.monotonic()
        return point

    def _in_flight(self, point: str, fresh: list[ClaimRef], unprep: list[ClaimRef]) -> set[str]:
        refs = fresh if point in PREPARE or point == "after-mig-created" else unprep if point in UNPREPARE \
            else fresh + unprep
        return set().union(*(self.effects_of[r.uid] for r in refs)) if refs else set()

    def _ran(self, point: str, fresh: list[ClaimRef], unprep: list[ClaimRef], died: bool) -> None:
        if point != crash.EXTERNAL_KILL:  # how long an operation runs, to its crash point or its end
            self._durations.append(time.monotonic() - self._started)
        for effect in self._in_flight(point, fresh, unprep):
            cell = self.cells.setdefault((effect, point), Cell())
            cell.runs += 1
            cell.died += died

    def _check(self, point: str, fresh: list[ClaimRef], unprep: list[ClaimRef]) -> list[str]:
        out = violations(self.node)
        try:
            seen = self.probe.look()
        except Exception as e:  # NVML or nvidia-smi failed: that is a finding too
            return [*out, f"cannot look at the GPUs: {e}"]
        data = self.node.checkpoint()
        found = gpustate.findings(seen, data, self.by_name, self._journal())
        self._count_checked(seen, data)
        in_flight = self._in_flight(point, fresh, unprep)
        for f in found:
            effects = {f.effect} | (set(self.effects_of.get(f.claim, ())) & {"shared-memory"} if f.claim else set())
            if self.hw.kind == "shared" and f.claim is None:
                effects.add("shared-memory")
            for effect in effects | (in_flight & {f.effect}):
                cell = self.cells.setdefault((effect, point), Cell())
                if f.kind == "leaked":
                    cell.leaked += 1
                else:
                    cell.lost += 1
        self.findings += [str(f) for f in found]
        return out + [str(f) for f in found]

    def _journal(self) -> Any:
        from topodra.effects.migjournal import MigJournal

        return MigJournal(self.node.state_dir)

    def _count_checked(self, seen: gpustate.Observed, data: Any) -> None:
        """How many recorded states one look found in place (the table's denominator of "lost")."""
        for e in data.claims.values():
            self.checked["mig"] += len(e.mig_instances)
            if e.uid in seen.daemons and e.uid in seen.pipes and e.uid in seen.mounts:
                self.checked["mps"] += 1
        self.checked["timeslice"] += sum(1 for lv in seen.levels.values() if lv)

    def finish(self) -> list[str]:
        """Unprepare everything, check that nothing is left, then remove by force what is (so the host stays
        clean); the problems found on the way."""
        st = self.node.state()
        problems = [f"final unprepare of {u}: {e}" for u, e in
                    st.unprepare([ref for ref, _ in self.prepared.values()]).items() if e]
        self.prepared.clear()
        seen = self.probe.look()
        left = gpustate.findings(seen, self.node.checkpoint(), self.by_name)
        problems += [f"after the final unprepare: {f}" for f in left]
        problems += [f"after the final unprepare: {v}" for v in violations(self.node)]
        for pids in seen.daemons.values():
            for pid in pids:
                with _suppress():
                    os.kill(pid, signal.SIGKILL)
        from topodra.sharing import mpsshm

        for uid in seen.mounts:
            with _suppress():
                mpsshm.unmount(self.node.state_dir / "mps" / uid / "shm")
        return problems


def effects_of_kind(kind: str) -> frozenset[str]:
    """The effects a claim of ``kind`` (``KINDS``) has."""
    return frozenset({"mig"} if kind.startswith("mig") else set()) | ({"mps"} if kind.endswith("mps") else set()) \
        | ({"timeslice"} if kind.endswith("timeslice") else set()) \
        | ({"shared-memory"} if kind.startswith("shared") else set())


def _memory_slices(dev: Device) -> set[tuple[str, str]]:
    """(counter set, memory-slice counter) a MIG placement consumes."""
    return {(cs, k) for cs, use in dev.consumes_counters.items() for k in use if k.startswith("memory-slice-")}


def _suppress() -> Any:
    import contextlib

    return contextlib.suppress(Exception)


def run_node(kind: str, rounds: int, seed: int, root: Path) -> dict[str, Any]:
    """``rounds`` passes over this node's crash points, in this process (which must not have loaded another
    NVML library); the JSON-ready summary."""
    quiet()
    start = time.monotonic()
    hw = Tree.build(kind, root)
    c = GpuCampaign(root, seed, hw)
    try:
        for _ in range(rounds * len(c.points)):
            c.run_once()
    finally:
        final = c.finish()
    t = c.totals
    return {"node": kind, "profile": NODES[kind][0], "runs": t.runs, "crashed": t.crashed,
            "by_point": dict(sorted(t.by_point.items())), "claims_prepared": t.claims_prepared,
            "prepares_retried": t.prepares_retried, "unprepares_retried": t.unprepares_retried,
            "cells": [{"effect": e, "point": p, **vars(cell)} for (e, p), cell in sorted(c.cells.items())],
            "checked": c.checked, "lost": t.lost + final, "seconds": round(time.monotonic() - start, 2)}


def run(rounds: int, seed: int = 1, root: Path | None = None, nodes: Sequence[str] = tuple(NODES),
        timeout: float = 3600) -> dict[str, Any]:
    """Each node in a fresh interpreter (one NVML library per process); the merged summary."""
    start = time.monotonic()
    per_node: list[dict[str, Any]] = []
    lost: list[str] = []
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD", "TOPODRA_MPS_CONTROL", "TOPODRA_CRASH_POINT")}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for i, kind in enumerate(nodes):
        with tempfile.TemporaryDirectory(prefix=f"topodra-gpucrash-{kind}-", dir=root) as tmp:
            r = subprocess.run([sys.executable, "-m", "bench.reliability.gpueffects", "--node", kind,
                                "--rounds", str(rounds), "--seed", str(seed + i), "--root", tmp],
                               capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO, check=False)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode != 0 or not lines:
            lost.append(f"node {kind}: campaign failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
            continue
        out = json.loads(lines[-1])
        per_node.append(out)
        lost += [f"node {kind}: {x}" for x in out["lost"]]
    cells: dict[tuple[str, str], Cell] = {}
    for out in per_node:
        for c in out["cells"]:
            cell = cells.setdefault((c["effect"], c["point"]), Cell())
            for k in ("runs", "died", "leaked", "lost"):
                setattr(cell, k, getattr(cell, k) + c[k])
    return {"runs": sum(o["runs"] for o in per_node), "crashed": sum(o["crashed"] for o in per_node),
            "nodes": per_node, "cells": [{"effect": e, "point": p, **vars(c)} for (e, p), c in sorted(cells.items())],
            "lost": lost, "seconds": round(time.monotonic() - start, 2)}


def table(result: dict[str, Any]) -> str:
    """Markdown: one row per effect and crash point (runs with that effect's claims in the operation, how many
    died there, leaked, lost)."""
    order = {p: i for i, p in enumerate(points("mig"))}
    rows = sorted(result["cells"], key=lambda c: (EFFECTS.index(c["effect"]), order[c["point"]]))
    lines = ["| Effect | Crash point | Runs | Died there | Leaked | Lost |", "|---|---|---|---|---|---|"]
    lines += [f"| {c['effect']} | `{c['point']}` | {c['runs']} | {c['died']} | {c['leaked']} | {c['lost']} |"
              for c in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.reliability.gpueffects", description=__doc__.split("\n")[0])
    p.add_argument("--node", choices=sorted(NODES), required=True)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--root", type=Path, required=True)
    args = p.parse_args(argv)
    print(json.dumps(run_node(args.node, args.rounds, args.seed, args.root)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
