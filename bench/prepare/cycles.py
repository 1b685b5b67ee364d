"""The measurement: timed prepare+unprepare cycles over the DRA socket, every answer checked.

One ``KubeletStub`` channel is shared by all callers, as the kubelet shares one; a health stream is
held open beside them, as the kubelet holds one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.prepare.claims import Claim
from bench.prepare.common import BenchError, log
from bench.prepare.plugin import BenchPlugin, server_totals
from bench.prepare.stats import summarize
from testkit.kubeletstub import KubeletStub


@dataclass
class Scenario:
    name: str
    devices: int
    access: str  # exclusive | admin
    concurrency: int
    cycles_per_caller: int
    prepare_s: list[float] = field(default_factory=list)
    unprepare_s: list[float] = field(default_factory=list)
    first_prepare_s: float | None = None
    wall_s: float = 0.0
    server: dict[str, float] = field(default_factory=dict)
    blocks: list[dict[str, float]] = field(default_factory=list)  # per interleaved block (compare mode)

    def result(self) -> dict[str, Any]:
        n = len(self.prepare_s)
        extra = {"block_medians_ms": self.blocks} if self.blocks else {}
        return {
            "name": self.name, "devices_per_claim": self.devices, "access": self.access,
            "concurrency": self.concurrency, "cycles_per_caller": self.cycles_per_caller,
            "prepare_ms": summarize(self.prepare_s), "unprepare_ms": summarize(self.unprepare_s),
            "first_prepare_ms": None if self.first_prepare_s is None else round(self.first_prepare_s * 1000, 3),
            "wall_s": round(self.wall_s, 3),
            "prepares_per_s": round(n / self.wall_s, 1) if self.wall_s else None,
            "server_mean_ms": self.server,
            **extra,
        }


class CycleChecker:
    """Checks each answer: no error, the right number of devices, CDI spec there / gone.

    ``spec_exists(claim_uid)`` says whether the plugin's CDI spec for a claim is on disk.
    """

    def __init__(self, spec_exists: Callable[[str], bool]) -> None:
        self.spec_exists = spec_exists

    def prepared(self, claim: Claim, resp: Any) -> None:
        entry = resp.claims.get(claim.uid)
        if entry is None or entry.error:
            raise BenchError(f"prepare of {claim.namespace}/{claim.name} failed: "
                             f"{entry.error if entry is not None else 'no entry'}")
        if len(entry.devices) != claim.devices:
            raise BenchError(f"prepare of {claim.name} returned {len(entry.devices)} devices, "
                             f"expected {claim.devices}")
        if not self.spec_exists(claim.uid):
            raise BenchError(f"no CDI spec for {claim.name} after a successful prepare")

    def unprepared(self, claim: Claim, resp: Any) -> None:
        entry = resp.claims.get(claim.uid)
        if entry is None or entry.error:
            raise BenchError(f"unprepare of {claim.name} failed: {entry.error if entry is not None else 'no entry'}")
        if self.spec_exists(claim.uid):
            raise BenchError(f"CDI spec of {claim.name} still there after unprepare")


def drive(name: str, stub: KubeletStub, claims: list[Claim], checker: CycleChecker, concurrency: int,
          cycles_per_caller: int, warmup: int, on_ready: Callable[[], None] | None = None,
          ) -> tuple[list[float], list[float], float]:
    """Timed prepare+unprepare cycles; returns (prepare seconds, unprepare seconds, wall seconds).

    ``concurrency`` callers share one channel (as the kubelet does); each cycles its own claim.
    Every caller warms up, then all wait at a barrier; ``on_ready`` runs while they wait (the
    plugin's own counters are read there) and all callers are released at once.
    """
    if len(claims) < concurrency:
        raise BenchError(f"{name}: {concurrency} callers need as many claims, have {len(claims)}")
    lock = threading.Lock()
    errors: list[BaseException] = []
    prepare_s: list[float] = []
    unprepare_s: list[float] = []
    ready = threading.Barrier(concurrency + 1)
    go = threading.Event()

    def cycle(claim: Claim, record: bool) -> None:
        t0 = time.perf_counter()
        resp = stub.prepare([claim.ref])
        t1 = time.perf_counter()
        checker.prepared(claim, resp)
        t2 = time.perf_counter()
        resp = stub.unprepare([claim.ref])
        t3 = time.perf_counter()
        checker.unprepared(claim, resp)
        if record:
            with lock:
                prepare_s.append(t1 - t0)
                unprepare_s.append(t3 - t2)

    def caller(claim: Claim) -> None:
        try:
            for _ in range(warmup):
                cycle(claim, record=False)
            ready.wait(120)
            go.wait(120)
            for _ in range(cycles_per_caller):
                cycle(claim, record=True)
        except BaseException as e:
            errors.append(e)
            ready.abort()

    threads = [threading.Thread(target=caller, args=(c,), name=f"caller-{i}", daemon=True)
               for i, c in enumerate(claims[:concurrency])]
    for t in threads:
        t.start()
    released = False
    try:
        ready.wait(180)
        if on_ready is not None:
            on_ready()
        released = True
    except threading.BrokenBarrierError:
        pass
    finally:
        t0 = time.perf_counter()
        go.set()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - t0
    if errors:
        raise BenchError(f"{name}: {errors[0]}") from errors[0]
    if any(t.is_alive() for t in threads) or not released:
        raise BenchError(f"{name}: callers did not finish (barrier broken or still running after 600 s)")
    return prepare_s, unprepare_s, wall


def first_cycle(stub: KubeletStub, claim: Claim, checker: CycleChecker) -> float:
    """One untimed-by-the-stats cycle (the plugin's first prepare of a claim); returns the prepare seconds."""
    t0 = time.perf_counter()
    resp = stub.prepare([claim.ref])
    took = time.perf_counter() - t0
    checker.prepared(claim, resp)
    checker.unprepared(claim, stub.unprepare([claim.ref]))
    return took


def run_scenario(sc: Scenario, stub: KubeletStub, claims: list[Claim], checker: CycleChecker,
                 plugin: BenchPlugin, warmup: int) -> Scenario:
    """One scenario against topodra; the plugin's own latency totals must count every timed call."""
    sc.first_prepare_s = first_cycle(stub, claims[0], checker)
    before: dict[str, tuple[float, float]] = {}

    def read_before() -> None:
        before.update(server_totals(plugin))

    sc.prepare_s, sc.unprepare_s, sc.wall_s = drive(sc.name, stub, claims, checker, sc.concurrency,
                                                    sc.cycles_per_caller, warmup, read_before)
    after = server_totals(plugin)
    for method, short in (("NodePrepareResources", "prepare"), ("NodeUnprepareResources", "unprepare")):
        dsum, dcount = after[method][0] - before[method][0], after[method][1] - before[method][1]
        if int(dcount) != len(sc.prepare_s):
            raise BenchError(f"{sc.name}: the plugin counted {dcount:.0f} {method} calls, we made "
                             f"{len(sc.prepare_s)}")
        sc.server[short] = round(dsum / dcount * 1000, 3)
    p, u = sc.result()["prepare_ms"], sc.result()["unprepare_ms"]
    log(f"{sc.name}: prepare median {p['median']} ms p99 {p['p99']} ms; unprepare median {u['median']} ms "
        f"p99 {u['p99']} ms; {len(sc.prepare_s)} cycles in {sc.wall_s:.1f}s")
    return sc


def health_stream(stub: KubeletStub) -> tuple[Any, threading.Thread]:
    """Hold a NodeWatchResources stream open like the kubelet; returns (call, reader thread)."""
    call = stub.watch_health()

    def read() -> None:
        with contextlib.suppress(Exception):
            for _ in call:
                pass

    t = threading.Thread(target=read, name="health-stream", daemon=True)
    t.start()
    return call, t
