"""Claims deleted, replaced or deallocated while the plugin was down: the cleanup pass at start unprepares those.

Each round prepares 1-6 claims, "stops the plugin", deletes some ResourceClaims,
re-creates some under the same name (a new UID), deallocates some (what the
resourceclaim controller does once a claim's pods are done: the state an unprepare
lost in a power loss leaves), makes the API unreadable for some, restarts (a fresh
``DeviceState``) and runs ``cleanup.cleanup_once``. Lost: a deleted, replaced or
deallocated claim still prepared, a live or unreadable one unprepared, an API read
made while the prepare lock was held, or a broken invariant.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.reliability.common import DRIVER, NODE, Node, claim_obj, devices, quiet, violations

from topodra.claims import ClaimRef
from topodra.plugin.cleanup import cleanup_once
from topodra.plugin.server import ClaimFetcher


def one_round(node: Node, r: int, rng: random.Random, counts: dict[str, int]) -> list[str]:
    """Prepare, change the API while "down", restart, one cleanup pass; returns what went wrong."""
    api: dict[tuple[str, str], dict[str, Any]] = {}
    names = [d.name for d in devices()]
    rng.shuffle(names)
    refs = []
    for k in range(rng.randint(1, 6)):
        uid = f"c1ea{r:04x}-0000-4000-8000-{k:012d}"
        api[("ns", f"c{k}")] = claim_obj("ns", f"c{k}", uid, [names.pop()])
        refs.append(ClaimRef("ns", uid, f"c{k}"))
    fetcher = ClaimFetcher(lambda ns, n: api.get((ns, n)), DRIVER, NODE, max_workers=2)
    node.state().prepare(fetcher.fetch(refs))
    fetcher.close()
    fate = {ref.uid: rng.choice(list(counts)) for ref in refs}
    by_name = {ref.name: ref for ref in refs}
    for ref in refs:
        counts[fate[ref.uid]] += 1
        if fate[ref.uid] == "deleted":
            del api[(ref.namespace, ref.name)]
        elif fate[ref.uid] == "replaced":
            api[(ref.namespace, ref.name)] = claim_obj(ref.namespace, ref.name, f"new-{ref.uid}", ["gpu-0"])
        elif fate[ref.uid] == "deallocated":
            api[(ref.namespace, ref.name)]["status"] = {}
    st = node.state()  # the restart
    under_lock: list[bool] = []

    def getter(ns: str, name: str) -> dict[str, Any] | None:
        under_lock.append(st._lock.locked())
        if fate[by_name[name].uid] == "unreadable":
            raise ConnectionError("apiserver unavailable")
        return api.get((ns, name))

    cleanup_once(st, getter)
    lost = []
    kept = set(node.checkpoint().claims)
    want = {u for u, f in fate.items() if f in ("live", "unreadable")}
    if kept != want:
        lost.append(f"round {r}: kept {sorted(kept)}, want {sorted(want)} ({fate})")
    if any(under_lock):
        lost.append(f"round {r}: an API read ran under the prepare lock")
    lost.extend(f"round {r}: {v}" for v in violations(node))
    return lost


def run(rounds: int, seed: int = 5, root: Path | None = None) -> dict[str, Any]:
    quiet()
    rng = random.Random(seed)
    lost: list[str] = []
    counts = {"deleted": 0, "replaced": 0, "deallocated": 0, "unreadable": 0, "live": 0}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="topodra-cleanup-", dir=root) as tmp:
        for r in range(rounds):
            lost += one_round(Node(Path(tmp) / f"r{r}").setup(), r, rng, counts)
    return {"rounds": rounds, "claims": counts, "lost": lost, "seconds": round(time.monotonic() - start, 2)}
