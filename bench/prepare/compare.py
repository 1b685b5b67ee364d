"""``--compare-with``: the exclusive-claim scenarios on topodra and another plugin, in interleaved blocks.

Each scenario runs in blocks A B, B A, A B, ... (``block_order``), so load on a shared machine falls
on both plugins alike; the table is topodra / other per scenario and statistic (``compare_rows``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import shlex
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.prepare.claims import Claim, make_claims, release_claims
from bench.prepare.common import DRIVER, NODE, BenchError, R, log, wait_until
from bench.prepare.cycles import CycleChecker, Scenario, drive, first_cycle, health_stream
from bench.prepare.other import OTHER_CLASS, OTHER_NODE, OtherPlugin
from bench.prepare.plugin import BenchPlugin, RssSampler, Sample, memory_point, nodes_with_gpu_class, server_totals
from testkit import cluster as localcluster
from testkit.kubeletstub import KubeletStub

from topodra.cdi import spec_path
from topodra.kube import Kube

BLOCK_WARMUP = 2  # untimed cycles per caller at the start of every block (the other side just ran)
COMPARE_STATS = (("prepare_ms", "median"), ("prepare_ms", "p99"), ("unprepare_ms", "median"), ("unprepare_ms", "p99"))


def block_order(rounds: int) -> list[tuple[str, str]]:
    """Side order of each round, A B then B A alternately, so neither side always runs first."""
    return [("a", "b") if i % 2 == 0 else ("b", "a") for i in range(rounds)]


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b rounded to 0.01; None when either is missing or b is not positive."""
    if a is None or b is None or not b > 0 or math.isnan(a):
        return None
    return round(a / b, 2)


def compare_rows(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Side-by-side rows (scenario, metric, a, b, a/b) from two results of the same scenarios, plus peak RSS."""
    b_by_name = {s["name"]: s for s in b["scenarios"]}
    rows = []
    for sa in a["scenarios"]:
        sb = b_by_name.get(sa["name"])
        if sb is None:
            raise BenchError(f"scenario {sa['name']!r} ran for one plugin only")
        for op, stat in COMPARE_STATS:
            va, vb = sa[op].get(stat), sb[op].get(stat)
            rows.append({"scenario": sa["name"], "metric": f"{op.removesuffix('_ms')} {stat} ms", "a": va, "b": vb,
                         "ratio": ratio(va, vb)})
    ha, hb = a["memory"]["peak_VmHWM_MiB"], b["memory"]["peak_VmHWM_MiB"]
    rows.append({"scenario": "whole run", "metric": "peak RSS (VmHWM) MiB", "a": ha, "b": hb, "ratio": ratio(ha, hb)})
    return rows


def format_comparison(rows: list[dict[str, Any]], a_label: str, b_label: str) -> str:
    """The side-by-side table as text; ratio is a / b (below 1: ``a_label`` is faster or smaller)."""
    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    width = max(len(r["scenario"]) for r in rows)
    head = f"{'scenario':{width}s}  {'metric':22s} {a_label[:12]:>12s} {b_label[:12]:>12s} {'ratio':>6s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['scenario']:{width}s}  {r['metric']:22s} {num(r['a']):>12s} {num(r['b']):>12s} "
                     f"{num(r['ratio']):>6s}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Side:
    """One plugin under comparison, as the scenarios see it."""

    label: str
    stub: KubeletStub
    checker: CycleChecker
    node: str
    driver: str
    device_class: str
    pools: frozenset[str]
    server_totals: Callable[[], dict[str, tuple[float, float]]] | None = None  # topodra's own request metrics


def timed_block(name: str, side: Side, claims: list[Claim], concurrency: int, cycles_per_caller: int,
                ) -> tuple[list[float], list[float], float, dict[str, tuple[float, float]]]:
    """One block on one side: (prepare s, unprepare s, wall s, the plugin's own (sum s, count) per method
    during the timed part, when it exports them)."""
    before: dict[str, tuple[float, float]] = {}

    def read_before() -> None:
        if side.server_totals is not None:
            before.update(side.server_totals())

    p, u, wall = drive(name, side.stub, claims, side.checker, concurrency, cycles_per_caller, BLOCK_WARMUP,
                       read_before)
    if side.server_totals is None:
        return p, u, wall, {}
    after = side.server_totals()
    return p, u, wall, {m: (after[m][0] - before[m][0], after[m][1] - before[m][1]) for m in after}


def interleaved(name: str, devices: int, concurrency: int, cycles_per_caller: int, sides: dict[str, Side],
                claims: dict[str, list[Claim]], rounds: int, warmup: int) -> dict[str, Scenario]:
    """One scenario on both sides: a first cycle and ``warmup`` untimed cycles each, then ``rounds``
    rounds of one block per side (order from ``block_order``), ``cycles_per_caller`` split over them."""
    per_block = max(1, math.ceil(cycles_per_caller / rounds))
    out = {}
    server: dict[str, dict[str, list[float]]] = {k: {} for k in sides}
    for key, side in sides.items():
        sc = out[key] = Scenario(name, devices, "exclusive", concurrency, per_block * rounds)
        sc.first_prepare_s = first_cycle(side.stub, claims[key][0], side.checker)
        drive(f"{side.label} {name} warm-up", side.stub, claims[key], side.checker, concurrency, 0, warmup)
    for order in block_order(rounds):
        for key in order:
            sc = out[key]
            p, u, wall, delta = timed_block(f"{sides[key].label} {name}", sides[key], claims[key], concurrency,
                                            per_block)
            for method, (total, count) in delta.items():
                acc = server[key].setdefault(method, [0.0, 0.0])
                acc[0] += total
                acc[1] += count
            sc.prepare_s += p
            sc.unprepare_s += u
            sc.wall_s += wall
            sc.blocks.append({"prepare": round(statistics.median(p) * 1000, 3),
                              "unprepare": round(statistics.median(u) * 1000, 3)})
    for key, sc in out.items():
        for method, (total, count) in server[key].items():
            if int(count) != len(sc.prepare_s):
                raise BenchError(f"{name}: {sides[key].label} counted {count:.0f} {method} calls, we made "
                                 f"{len(sc.prepare_s)}")
            sc.server["prepare" if method == "NodePrepareResources" else "unprepare"] = round(total / count * 1000, 3)
        p, u = sc.result()["prepare_ms"], sc.result()["unprepare_ms"]
        log(f"{sides[key].label} {name}: prepare median {p['median']} p99 {p['p99']} ms; unprepare median "
            f"{u['median']} p99 {u['p99']} ms ({len(sc.prepare_s)} cycles)")
    return out


def compare_bench(args: argparse.Namespace, lc: localcluster.Cluster, workdir: Path) -> dict[str, Any]:
    kube = Kube.from_kubeconfig(str(lc.admin_kubeconfig))
    try:
        return _compare(args, lc, kube, workdir)
    finally:
        kube.close()


def _compare(args: argparse.Namespace, lc: localcluster.Cluster, kube: Kube, workdir: Path) -> dict[str, Any]:
    nodes_with_gpu_class(lc, [NODE, OTHER_NODE])
    a = BenchPlugin(lc.admin_kubeconfig, workdir / "a", lc.logs / "topodra-bench-plugin.log",
                    extra_env=dict(args.plugin_env))
    b = OtherPlugin(args.compare_with, args.compare_args, lc.admin_kubeconfig, workdir / "b",
                    lc.logs / "compare-plugin.log", dict(args.compare_env))
    log(f"other plugin: {shlex.join(b.argv)}")
    a.start(wait=False)
    b.start()
    try:
        # Both start at once; each one's ready time (serving and published) is waited for in its own thread.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            a_wait = pool.submit(a.wait_ready, 90)
            b_wait = pool.submit(b.ready, kube, 90)
            other_driver, other_socket, pools, b_ready_s = b_wait.result()
            a_ready_s = a_wait.result()
        log(f"topodra ready in {a_ready_s:.1f}s; {other_driver} ready in {b_ready_s:.1f}s (socket {other_socket})")
        kube.create(f"{R}/deviceclasses", {
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": OTHER_CLASS},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == {json.dumps(other_driver)}"}}]}})
        ns = f"bench-{os.getpid()}"
        kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        wait_until(lambda: kube.get(f"/api/v1/namespaces/{ns}/serviceaccounts/default"), 60, "default SA")
        labels = {"a": "topodra", "b": args.compare_label or args.compare_with.name}
        memory: dict[str, dict[str, Any]] = {"a": {}, "b": {}}
        samples: dict[str, Sample] = {"a": a.sample_rss, "b": b.sample_rss}
        results: dict[str, list[Scenario]] = {"a": [], "b": []}
        with KubeletStub(a.socket) as sa, KubeletStub(other_socket) as sb:
            sides = {
                "a": Side(labels["a"], sa, CycleChecker(lambda uid: spec_path(a.cdi_root, DRIVER, uid).exists()),
                          NODE, DRIVER, DRIVER, frozenset([NODE]), lambda: server_totals(a)),
                "b": Side(labels["b"], sb, CycleChecker(b.spec_exists), OTHER_NODE, other_driver, OTHER_CLASS,
                          pools)}
            streams = [health_stream(sa), health_stream(sb)]  # the other may not serve health; then it just ends
            time.sleep(args.settle)
            for k in memory:
                memory[k]["idle"] = memory_point(samples[k])
            with RssSampler(a.sample_rss) as rss_a, RssSampler(b.sample_rss) as rss_b:

                def claims_for(prefix: str, count: int, devices: int) -> dict[str, list[Claim]]:
                    return {k: make_claims(kube, ns, f"{k}-{prefix}", count, devices, admin=False, timeout=120,
                                           node=s.node, driver=s.driver, device_class=s.device_class,
                                           pools=s.pools) for k, s in sides.items()}

                excl1 = claims_for("excl1", 8, 1)
                for name, conc, cycles in (("sequential 1-GPU exclusive", 1, args.cycles),
                                           ("8 concurrent 1-GPU exclusive", 8, max(1, args.concurrent_cycles * 4))):
                    for k, sc in interleaved(name, 1, conc, cycles, sides, excl1, args.rounds,
                                             args.warmup if conc == 1 else 1).items():
                        results[k].append(sc)
                release_claims(kube, excl1["a"] + excl1["b"], 120)
                excl8 = claims_for("excl8", 1, 8)
                for k, sc in interleaved("sequential 8-GPU exclusive", 8, 1, args.cycles, sides, excl8,
                                         args.rounds, args.warmup).items():
                    results[k].append(sc)
                release_claims(kube, excl8["a"] + excl8["b"], 120)
                for k, sampler in (("a", rss_a), ("b", rss_b)):
                    memory[k]["after_runs"] = memory_point(samples[k])
                    memory[k]["sampled_max_VmRSS_MiB"] = round(sampler.max_kib / 1024, 1)
                    memory[k]["peak_VmHWM_MiB"] = memory[k]["after_runs"]["VmHWM_MiB"]
            for call, reader in streams:
                call.cancel()
                reader.join(5)
        leftovers = sorted(p.name for p in a.cdi_root.glob("*.json"))
        leftovers += sorted(p.name for p in b.cdi_root.iterdir()
                            if any(c.uid in p.name for c in excl1["b"] + excl8["b"]))
        if leftovers:
            raise BenchError(f"CDI specs left after the runs: {leftovers}")
        out = {k: {"label": labels[k], "scenarios": [s.result() for s in results[k]], "memory": memory[k]}
               for k in ("a", "b")}
        out["a"]["plugin_ready_s"], out["b"]["plugin_ready_s"] = round(a_ready_s, 2), round(b_ready_s, 2)
        out["b"].update({"driver": other_driver, "argv": b.argv})
        rc_a, rc_b = a.stop(), b.stop()
        if rc_a != 0:
            raise BenchError(f"topodra exited with {rc_a} on SIGTERM:\n{a.tail()}")
        out["b"]["exit_code_on_sigterm"] = rc_b
        return {"a": out["a"], "b": out["b"], "comparison": compare_rows(out["a"], out["b"])}
    finally:
        a.stop()
        b.stop()

