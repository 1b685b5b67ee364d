"""``bench/run telemetry_flags``: does the idle rule flag idle claims in time and busy ones never (issue 32: "An idle
claim is flagged within interval + 1 sample after the idle time has passed; a busy one never is (0 false flags
over a 30-minute mixed scenario)").

The plugin's own ``Sampler`` runs on the C NVML stand-in of a dgx-h100 driver tree (real pynvml binding, the
production load path), one claim per GPU, with the default rule (5% activity, 10% memory, ``--idle-seconds``) and
``--interval``. Time is **virtual**: the sampler's clock is the scenario's, advanced one interval per round, and
before each round the scenario file is rewritten with every GPU's figures at that instant; so 30 minutes take
seconds. The stand-in's GPM activity over a round is the rate at the sample (it integrates at the current rate),
so a window that mixes busy and idle time, which real GPM would average, is not modelled: the measured latency
is the rule's, and the bound allows one more sample for that window.

Claims (8 GPUs):
- busy: steady training (90% SM, 60% memory); inference at low activity (8% SM, 30% memory); a data-starved job
  (SM 6-30%, memory 40%); a job that pauses for 20 minutes with its model in memory (0% SM, 50% memory): none
  may be flagged (memory keeps it busy by the rule);
- bursty: 2-minute bursts every 12 minutes with memory freed in between (gaps of 10 minutes, under a 15-minute
  idle time): never flagged;
- idle: idle from 3 minutes 3 s in (memory freed), then busy again at 25 minutes 7 s: flagged, then cleared; idle
  from the start: flagged (transitions fall between samples, so the wait for the first idle sample counts);
- a GPU that stops answering for 3 samples during an idle run: the clock restarts (never flagged on missing
  data), then flagged later.

A recording writer stands in for the API write (the decision is the sampler's ``_maybe_write``; the write itself
is ``ClaimStatusWriter``, tested against a real API server elsewhere).

    bench/run telemetry_flags [--minutes 30] [--interval 10] [--idle-seconds 900] [--label NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.paths import REPO, result_file

GIB = 1 << 30
MEMORY = 80 * GIB  # the dgx-h100 stand-in's GPUs


@dataclass(frozen=True)
class Figures:
    sm: float  # percent
    memory: float  # ratio of the GPU's memory
    lost: bool = False


@dataclass(frozen=True)
class Claim:
    name: str
    kind: str  # busy, bursty, idle
    at: Callable[[float], Figures]  # the GPU's figures at t seconds
    idle_from: tuple[tuple[float, float], ...] = ()  # (start, end) of idle runs long enough to flag


def _busy(sm: float, mem: float) -> Callable[[float], Figures]:
    return lambda t: Figures(sm, mem)


def _starved(t: float) -> Figures:
    return Figures(6.0 + 24.0 * ((int(t) // 30) % 5) / 4, 0.40)


def _paused(t: float) -> Figures:
    return Figures(0.0, 0.50) if 300 <= t < 1500 else Figures(85.0, 0.50)


def _bursty(t: float) -> Figures:
    return Figures(95.0, 0.70) if ((t - 47) % 720) < 120 else Figures(0.0, 0.005)


def _idle_then_busy(t: float) -> Figures:
    return Figures(0.0, 0.005) if 183 <= t < 1507 else Figures(80.0, 0.45)


def _idle(t: float) -> Figures:
    return Figures(0.5, 0.007)


def _flaky_idle(t: float) -> Figures:
    return Figures(0.0, 0.0, lost=401 <= t < 433)


def claims() -> list[Claim]:
    return [
        Claim("train", "busy", _busy(90.0, 0.60)),
        Claim("infer-low", "busy", _busy(8.0, 0.30)),
        Claim("starved", "busy", _starved),
        Claim("paused-with-model", "busy", _paused),
        Claim("bursty", "bursty", _bursty),
        Claim("idle-then-busy", "idle", _idle_then_busy, ((183.0, 1507.0),)),
        Claim("idle", "idle", _idle, ((0.0, 1e12),)),
        Claim("idle-gpu-lost-briefly", "idle", _flaky_idle, ((433.0, 1e12),)),
    ]


def scenario(cs: list[Claim], t: float) -> dict[str, Any]:
    gpus: dict[str, Any] = {}
    for i, c in enumerate(cs):
        f = c.at(t)
        if f.lost:
            gpus[str(i)] = {"lost": True}
            continue
        gpus[str(i)] = {"telemetry": {"utilGpu": min(100.0, f.sm * 1.2), "smActivity": f.sm,
                                      "graphicsActivity": f.sm, "tensorActivity": f.sm / 2,
                                      "memoryUsed": int(f.memory * MEMORY)}}
    return {"gpus": gpus}


def judge(cs: list[Claim], writes: list[tuple[float, str, bool]], minutes: float, idle_s: float,
          interval: float) -> dict[str, Any]:
    """Per claim: its flags and clears, the false flags, and each idle run's flag latency against the bound."""
    bound = idle_s + 2 * interval  # the idle time, one interval to the first idle sample, one more sample
    out: dict[str, Any] = {"false_flags": 0, "missed": 0, "late": 0, "bound_s": bound, "claims": {}}
    end = minutes * 60
    for c in cs:
        mine = [(t, idle) for t, name, idle in writes if name == c.name]
        flags = [t for t, idle in mine if idle]
        row: dict[str, Any] = {"kind": c.kind, "flags_at_s": flags, "clears_at_s": [t for t, idle in mine if not idle],
                               "runs": []}
        if c.kind != "idle":
            out["false_flags"] += len(flags)
        for start, stop in c.idle_from:
            due = start + idle_s
            if due > min(stop, end):
                continue  # too short (or past the run's end) to be flagged
            hit = [t for t in flags if start <= t <= stop]
            latency = hit[0] - due if hit else None
            ok = latency is not None and 0 <= latency <= 2 * interval
            row["runs"].append({"idle_from_s": start, "due_s": due, "flagged_at_s": hit[0] if hit else None,
                                "latency_after_idle_time_s": latency, "within_bound": ok})
            if latency is None:
                out["missed"] += 1
            elif not ok:
                out["late"] += 1
        out["claims"][c.name] = row
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench/run telemetry_flags", description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="virtual minutes of the mixed scenario (default 30)")
    ap.add_argument("--interval", type=float, default=10.0, help="sampling interval, virtual seconds (default 10)")
    ap.add_argument("--idle-seconds", type=float, default=900.0, help="the rule's idle time (default 900)")
    ap.add_argument("--label", default="standin-dgx-h100", help="result file label")
    ap.add_argument("--out", default=None, help="result file (default bench/results/telemetry/<UTC>-flags-<label>)")
    a = ap.parse_args(argv)
    if a.interval <= 0 or a.minutes * 60 < a.interval:
        ap.error("need 0 < --interval <= the scenario")
    out = Path(a.out) if a.out else result_file("telemetry", f"flags-{a.label}")
    work = Path(tempfile.mkdtemp(prefix="topodra-bench-flags."))
    try:
        return _run(a, out, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(a: argparse.Namespace, out: Path, work: Path) -> int:
    from topodra.claims import ClaimRef
    from topodra.hardware import load_backend
    from topodra.hardware.mockprofile import build_tree, load_profile
    from topodra.inventory import Inventory
    from topodra.telemetry.idle import IdleRule
    from topodra.telemetry.sampler import Sampler

    r = subprocess.run([str(REPO / "hack" / "driver-tree"), "--profile", "dgx-h100", str(work / "root"), "--node",
                        "n1", "--no-dev-nodes"], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        sys.stderr.write(r.stderr)
        return 1
    root = Path(r.stdout.strip())
    faults = next(root.glob("usr/lib/*/libnvidia-ml.so.1")).parent / "nvml-standin-faults.json"
    sysfs = work / "sysfs"
    build_tree(load_profile("dgx-h100"), frozenset()).materialize(str(sysfs))
    be = load_backend("nvml", "n1", sysfs_root=str(sysfs), nvidia_driver_root=str(root))
    inv = Inventory(be.discover())
    cs = claims()
    gpus = sorted((d for d in inv.devices if d.kind == "gpu"), key=lambda d: int(str(d.attributes["index"].value)))
    held = {f"uid-{c.name}": (ClaimRef("bench", f"uid-{c.name}", c.name), frozenset({("n1", g.name, None)}))
            for c, g in zip(cs, gpus, strict=False)}
    objs = {c.name: {"metadata": {"uid": f"uid-{c.name}"}, "status": {}} for c in cs}
    now = [0.0]
    writes: list[tuple[float, str, bool]] = []

    class Recorder:
        def write(self, ns: str, name: str, uid: str, devices: Any, idle: bool, pods: Any, msg: str) -> None:
            writes.append((now[0], name, idle))

    sampler = Sampler(inv, be.nvml, be.sysfs, pool="n1", driver="gpu.topodra.io", held=lambda: held,
                      get_claim=lambda ns, n: objs[n], writer=Recorder(), interval=a.interval,  # type: ignore[arg-type]
                      rule=IdleRule(idle_seconds=a.idle_seconds), clock=lambda: now[0], claim_refresh=1e12)
    rounds = int(a.minutes * 60 / a.interval) + 1
    wall0 = time.monotonic()
    for k in range(rounds):
        now[0] = k * a.interval
        tmp = faults.with_suffix(".tmp")
        tmp.write_text(json.dumps(scenario(cs, now[0])))
        os.replace(tmp, faults)
        sampler.round()
        time.sleep(0.002)  # GPM samples must differ in time (the stand-in refuses a zero interval)
    wall = time.monotonic() - wall0
    errors = dict(sampler.snapshot.errors)
    sampler.stop()
    verdict = judge(cs, writes, a.minutes, a.idle_seconds, a.interval)
    result: dict[str, Any] = {
        "bench": "telemetry_flags", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "time": "virtual (the sampler's clock advanced one interval per round)", "minutes": a.minutes,
        "interval_s": a.interval, "idle_seconds": a.idle_seconds, "rounds": rounds, "wall_s": round(wall, 2),
        "rule": IdleRule(idle_seconds=a.idle_seconds).model_dump(), "writes": writes, "read_errors": errors,
        **verdict,
    }
    result["meets_targets"] = verdict["false_flags"] == 0 and verdict["missed"] == 0 and verdict["late"] == 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("rounds", "false_flags", "missed", "late", "bound_s", "meets_targets")}))
    for name, row in verdict["claims"].items():
        print(f"  {name:24s} {row['kind']:7s} flags {row['flags_at_s']} clears {row['clears_at_s']} "
              f"runs {[(x['due_s'], x['latency_after_idle_time_s']) for x in row['runs']]}")
    print(f"wrote {out}")
    return 0
