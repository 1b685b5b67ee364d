"""The sampler writes the per-device summary on the mock node: first sight, then only on change and only at the
claim's slots (once per ``min_interval`` at most), never per sample; a restarted sampler continues from what the
claim shows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from topodra.claims import ClaimRef
from topodra.hardware import load_backend
from topodra.inventory import Inventory
from topodra.telemetry.idle import IdleRule
from topodra.telemetry.sampler import Sampler
from topodra.telemetry.summary import SummaryPolicy

GIB = 1 << 30
BUSY = {"utilGpu": 90, "memoryUsed": 20 * GIB, "smActivity": 70.0}
HELD = {"uid-1": (ClaimRef(namespace="team-a", uid="uid-1", name="train"),
                  frozenset({("n1", "gpu-0", None), ("n1", "gpu-1", None)}))}
POLICY = SummaryPolicy(min_interval=300, max_interval=1800, delta=0.1, window=30, spread=0)  # slots: k x 300 s


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


class Recorder:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def apply_summary(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        assert (namespace, name) == ("team-a", "train")
        self.bodies.append(body)


def setup(tmp_path: Path, claim: dict[str, Any]) -> tuple[Sampler, Clock, Recorder, Path]:
    tmp_path.mkdir(exist_ok=True)
    faults = tmp_path / "faults.json"
    faults.write_text("{}")
    be = load_backend("mock:dgx-h100", "n1", overrides={"faultsFile": str(faults)})
    clock, rec = Clock(), Recorder()
    s = Sampler(Inventory(be.discover()), be.nvml, be.sysfs, pool="n1", driver="gpu.topodra.io",
                held=lambda: HELD, get_claim=lambda ns, n: claim, interval=10.0,
                rule=IdleRule(idle_seconds=600), clock=clock, summary_writer=rec,  # type: ignore[arg-type]
                summary_policy=POLICY)
    return s, clock, rec, faults


def run(s: Sampler, clock: Clock, seconds: float) -> None:
    end = clock.t + seconds
    while clock.t < end:
        clock.t += 10
        s.round()


def data(body: dict[str, Any], device: str) -> dict[str, Any]:
    got: dict[str, Any] = next(e["data"] for e in body["status"]["devices"] if e["device"] == device)
    return got


def test_written_on_change_at_a_bounded_rate(tmp_path: Path) -> None:
    claim = {"metadata": {"uid": "uid-1"}, "status": {}}
    s, clock, rec, faults = setup(tmp_path, claim)
    faults.write_text(json.dumps({"gpus": {"0": {"telemetry": BUSY}, "1": {"telemetry": BUSY}}}))
    s.round()
    assert len(rec.bodies) == 1  # first sight
    assert [e["device"] for e in rec.bodies[0]["status"]["devices"]] == ["gpu-0", "gpu-1"]
    assert data(rec.bodies[0], "gpu-0")["activity"] == 0.9  # NVML utilisation: GPM needs two samples
    run(s, clock, 290)  # SM activity (0.7) from the second sample on: a change, written after min_interval
    assert len(rec.bodies) == 1
    run(s, clock, 20)
    assert len(rec.bodies) == 2 and data(rec.bodies[1], "gpu-0")["activity"] == 0.7
    run(s, clock, 1780)  # busy and steady: nothing until the refresh, max_interval after the last write
    assert len(rec.bodies) == 2
    run(s, clock, 20)
    assert len(rec.bodies) == 3
    d = data(rec.bodies[2], "gpu-0")
    assert d["activity"] == 0.7 and d["idle"] is False and 2090 <= d["allocatedSeconds"] <= 2110
    assert d["activeSeconds"] == d["allocatedSeconds"]
    faults.write_text("{}")  # the job stops: activity drops at once, but the next write waits min_interval
    run(s, clock, 280)
    assert len(rec.bodies) == 3
    run(s, clock, 20)
    assert len(rec.bodies) == 4
    d = data(rec.bodies[3], "gpu-1")
    assert d["activity"] == 0.0 and d["idle"] is False  # below, not yet idle (600 s)
    run(s, clock, 300)  # idle after 600 s below (at 2,720 s): not yet at the slot of 2,700 s
    assert len(rec.bodies) == 4
    run(s, clock, 300)  # the state change is written at the next slot, 3,000 s
    assert len(rec.bodies) == 5
    d = data(rec.bodies[4], "gpu-0")
    assert d["idle"] is True and "idleSince" in d and d["activeSeconds"] < d["allocatedSeconds"] - 600
    rounds = s.snapshot.samples
    assert rounds > 250 and len(rec.bodies) == 5 == s.summary_writes == s.snapshot.summary_writes


def test_a_restarted_sampler_continues_the_seconds_and_the_schedule(tmp_path: Path) -> None:
    claim = {"metadata": {"uid": "uid-1"}, "status": {}}
    s, clock, rec, faults = setup(tmp_path, claim)
    faults.write_text(json.dumps({"gpus": {"0": {"telemetry": BUSY}, "1": {"telemetry": BUSY}}}))
    run(s, clock, 310)
    assert len(rec.bodies) == 1  # first sight, at the first slot (300 s)
    first = rec.bodies[-1]
    claim["status"] = first["status"]  # what the API shows after the apply
    s2, clock2, rec2, faults2 = setup(tmp_path / "2", claim)
    faults2.write_text(faults.read_text())
    clock2.t = clock.t
    run(s2, clock2, 100)
    assert rec2.bodies == []  # the last write was < min_interval ago: the restart does not write at once
    run(s2, clock2, 1800)
    assert len(rec2.bodies) == 1  # the refresh, max_interval after the last write before the restart
    got = data(rec2.bodies[0], "gpu-0")
    assert got["allocatedSeconds"] > data(first, "gpu-0")["allocatedSeconds"] + 1000  # continued, not restarted
