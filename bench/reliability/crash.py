"""Crash campaign: kill -9 the prepare state mid-operation, restart, let the kubelet retry, check invariants.

Each run forks a "plugin" process from this one (no interpreter start: a run costs
milliseconds) that starts a ``DeviceState`` (recovery included) and serves
concurrent kubelet calls from threads: prepares of new claims of 1-8 devices and
unprepares of prepared ones, one or two claims per call. The process dies by
``os._exit(137)`` at a random instrumented point (``TOPODRA_CRASH_POINT``, see
``state.CRASH_POINTS``), or by a real ``SIGKILL`` sent from here after a random delay.
The child reports each successful answer on a pipe before it would reach the
kubelet. Then, as after a real crash:

1. the plugin restarts (a fresh ``DeviceState``: recovery);
2. every answered prepare must still be prepared, every answered unprepare gone;
3. the kubelet retries what got no answer, and each retry must succeed, with the
   same devices as the first answer where there was one;
4. ``common.violations`` must be empty.

The model of what the kubelet believes carries over to the next run, so later
runs crash with many claims prepared. Anything else is counted as lost.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.reliability.common import DRIVER, NODE, Node, claim_obj, devices, quiet, violations

from topodra.claims import ClaimError, ClaimRef, FetchedClaim, UnavailableClaim, allocated_claim
from topodra.state import DeviceState

PREPARE_POINTS = ("prepare-before-write", "prepare-mid-cdi", "after-cdi-written", "after-checkpoint-written")
UNPREPARE_POINTS = ("after-unprepare-cdi-removed", "after-unprepare-checkpoint-written")
EXTERNAL_KILL = "sigkill-after-random-delay"


@dataclass
class Totals:
    runs: int = 0
    crashed: int = 0  # the process died before it answered every call
    by_point: dict[str, int] = field(default_factory=dict)
    prepares_retried: int = 0
    unprepares_retried: int = 0
    claims_prepared: int = 0
    lost: list[str] = field(default_factory=list)  # every broken invariant or failed retry, with its run


def fetch(api: dict[tuple[str, str], dict[str, Any]], ref: ClaimRef) -> FetchedClaim:
    """What the gRPC layer's ClaimFetcher does, without its thread pool (we fork)."""
    try:
        return allocated_claim(ref, api.get((ref.namespace, ref.name)), DRIVER, pool_name=NODE, node_name=NODE)
    except ClaimError as e:
        return UnavailableClaim(ref, str(e))


def _child(node: Node, point: str | None, api: dict[tuple[str, str], dict[str, Any]],
           prep_calls: Sequence[Sequence[ClaimRef]], unprep_calls: Sequence[Sequence[ClaimRef]], wfd: int) -> None:
    """The plugin process: serve the calls concurrently, report each success on the pipe, exit."""
    lock = threading.Lock()

    def report(line: dict[str, Any]) -> None:
        with lock:
            os.write(wfd, (json.dumps(line) + "\n").encode())

    try:
        st = node.state(crash_point=point)

        def prep(refs: Sequence[ClaimRef]) -> None:
            out = st.prepare([fetch(api, r) for r in refs])
            report({"prepared": {u: sorted(d.device_name for d in r.devices) for u, r in out.items() if not r.error}})

        def unprep(refs: Sequence[ClaimRef]) -> None:
            out = st.unprepare(refs)
            report({"unprepared": [u for u, e in out.items() if not e]})

        threads = [threading.Thread(target=prep, args=(c,)) for c in prep_calls]
        threads += [threading.Thread(target=unprep, args=(c,)) for c in unprep_calls]
        random.shuffle(threads)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        os._exit(0)
    except BaseException:
        os._exit(3)


def _chunks(rng: random.Random, items: list[ClaimRef]) -> list[list[ClaimRef]]:
    out: list[list[ClaimRef]] = []
    while items:
        n = rng.randint(1, 2)
        out.append(items[:n])
        items = items[n:]
    return out


class Campaign:
    """The kubelet's view across runs: which claims it believes prepared, on one node.

    Subclasses (``gpueffects``) change the node, the claims each run makes, the crash point it picks and the
    checks after the restart and after the retries."""

    def __init__(self, root: Path, seed: int, node: Node | None = None) -> None:
        self.node = node if node is not None else Node(root).setup()
        self.rng = random.Random(seed)
        self.api: dict[tuple[str, str], dict[str, Any]] = {}
        self.prepared: dict[str, tuple[ClaimRef, list[str]]] = {}  # uid → (ref, devices) the kubelet holds
        self.counter = 0
        self.totals = Totals()

    def _new_claims(self) -> list[ClaimRef]:
        used = {d for _, devs in self.prepared.values() for d in devs}
        free = [d.name for d in devices() if d.name not in used]
        self.rng.shuffle(free)
        refs = []
        for _ in range(self.rng.randint(1, 4)):
            if not free:
                break
            n = min(len(free), self.rng.randint(1, 8))
            devs, free = free[:n], free[n:]
            self.counter += 1
            uid = f"{self.counter:08x}-5e1f-4c00-8000-{self.rng.getrandbits(48):012x}"
            name = f"claim-{self.counter}"
            self.api[("crash", name)] = claim_obj("crash", name, uid, devs)
            refs.append(ClaimRef("crash", uid, name))
        return refs

    def run_once(self) -> None:
        t = self.totals
        t.runs += 1
        run = t.runs
        rng = self.rng
        unprep = [ref for ref, _ in self.prepared.values() if rng.random() < 0.5]
        fresh = self._new_claims()
        point = self._choose_point(unprep, fresh)
        t.by_point[point] = t.by_point.get(point, 0) + 1
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            _child(self.node, None if point == EXTERNAL_KILL else point, self.api,
                   _chunks(rng, list(fresh)), _chunks(rng, list(unprep)), wfd)
        os.close(wfd)
        if point == EXTERNAL_KILL:
            time.sleep(rng.uniform(0, self.kill_delay_s))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # the plugin process only: a helper it runs finishes on its own
        raw = b""
        while chunk := os.read(rfd, 65536):
            raw += chunk
        os.close(rfd)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code not in (0, 137, -signal.SIGKILL):
            t.lost.append(f"run {run}: plugin process failed with exit code {code}")
        answered_prep: dict[str, list[str]] = {}
        answered_unprep: set[str] = set()
        for line in raw.decode().splitlines():
            msg = json.loads(line)
            answered_prep.update(msg.get("prepared", {}))
            answered_unprep.update(msg.get("unprepared", []))
        if code != 0:
            t.crashed += 1
        self._ran(point, fresh, unprep, died=code != 0)

        st = self.node.state()  # the restart
        data = self.node.checkpoint()
        for uid in answered_prep:
            if uid not in data.claims:
                t.lost.append(f"run {run} ({point}): claim {uid} was answered prepared, gone after restart")
        for uid in answered_unprep:
            if uid in data.claims:
                t.lost.append(f"run {run} ({point}): claim {uid} was answered unprepared, back after restart")
        t.lost.extend(f"run {run} ({point}) after restart: {v}" for v in self._check(point, fresh, unprep))

        self._kubelet_retries(st, run, point, fresh, unprep, answered_prep, answered_unprep)
        t.lost.extend(f"run {run} ({point}) after retries: {v}" for v in self._check(point, fresh, unprep))
        want = set(self.prepared)
        got = set(self.node.checkpoint().claims)
        if want != got:
            t.lost.append(f"run {run} ({point}): kubelet holds {sorted(want)}, node has {sorted(got)}")

    kill_delay_s = 0.012  # the external kill comes 0 to this many seconds after the fork

    def _choose_point(self, unprep: list[ClaimRef], fresh: list[ClaimRef]) -> str:
        """Where this run's plugin dies: an external SIGKILL, or an instrumented point of the operation."""
        roll = self.rng.random()
        if roll < 0.3:
            return EXTERNAL_KILL
        if unprep and (roll < 0.5 or not fresh):
            return self.rng.choice(UNPREPARE_POINTS)
        return self.rng.choice(PREPARE_POINTS)

    def _ran(self, point: str, fresh: list[ClaimRef], unprep: list[ClaimRef], died: bool) -> None:
        """Hook: a run's plugin process ended (``died``: before answering every call)."""

    def _check(self, point: str, fresh: list[ClaimRef], unprep: list[ClaimRef]) -> list[str]:
        """The node's broken invariants now (after the restart, and after the kubelet's retries)."""
        return violations(self.node)

    def _kubelet_retries(self, st: DeviceState, run: int, point: str, fresh: list[ClaimRef],
                         unprep: list[ClaimRef], answered_prep: dict[str, list[str]],
                         answered_unprep: set[str]) -> None:
        """Retry everything unanswered; repeat one answered prepare (idempotency); update the model."""
        t = self.totals
        retry = [r for r in fresh if r.uid not in answered_prep]
        repeat = [r for r in fresh if r.uid in answered_prep][:1]
        if retry or repeat:
            t.prepares_retried += len(retry)
            out = st.prepare([fetch(self.api, r) for r in retry + repeat])
            for r in retry + repeat:
                res = out.get(r.uid)
                if res is None or res.error:
                    t.lost.append(f"run {run} ({point}): retried prepare of {r.uid} failed: "
                                  f"{res.error if res else 'no answer'}")
                    continue
                devs = sorted(d.device_name for d in res.devices)
                if r.uid in answered_prep and answered_prep[r.uid] != devs:
                    t.lost.append(f"run {run} ({point}): {r.uid} answered {answered_prep[r.uid]}, then {devs}")
        for r in fresh:
            api_devs = sorted(x["device"] for x in
                              self.api[(r.namespace, r.name)]["status"]["allocation"]["devices"]["results"])
            self.prepared[r.uid] = (r, api_devs)
        t.claims_prepared += len(fresh)
        retry_un = [r for r in unprep if r.uid not in answered_unprep]
        if retry_un:
            t.unprepares_retried += len(retry_un)
            for uid, err in st.unprepare(retry_un).items():
                if err:
                    t.lost.append(f"run {run} ({point}): retried unprepare of {uid} failed: {err}")
        for r in unprep:
            self.prepared.pop(r.uid, None)
            self.api.pop((r.namespace, r.name), None)


def run(runs: int, seed: int = 1, root: Path | None = None) -> dict[str, Any]:
    """``runs`` crash runs on one node; the JSON-ready summary (``lost`` lists every failure)."""
    quiet()
    with tempfile.TemporaryDirectory(prefix="topodra-crash-", dir=root) as tmp:
        c = Campaign(Path(tmp), seed)
        start = time.monotonic()
        for _ in range(runs):
            c.run_once()
        t = c.totals
        return {"runs": t.runs, "crashed": t.crashed, "by_point": dict(sorted(t.by_point.items())),
                "prepares_retried": t.prepares_retried, "unprepares_retried": t.unprepares_retried,
                "claims_prepared": t.claims_prepared, "lost": t.lost, "seconds": round(time.monotonic() - start, 2)}
