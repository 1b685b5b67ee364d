"""The default run: topodra alone through six scenarios, its memory, and the verdict against the targets."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from bench.prepare.claims import make_claims, release_claims
from bench.prepare.common import (
    ADMIN_LABEL,
    DRIVER,
    NODE,
    TARGET_P99_MS_8DEV,
    TARGET_RSS_MB,
    BenchError,
    MiB,
    log,
    wait_until,
)
from bench.prepare.cycles import CycleChecker, Scenario, health_stream, run_scenario
from bench.prepare.plugin import BenchPlugin, RssSampler, memory_point, nodes_with_gpu_class
from testkit import cluster as localcluster
from testkit.kubeletstub import KubeletStub

from topodra.apipaths import slices_path
from topodra.cdi import spec_path
from topodra.kube import Kube


def bench(args: argparse.Namespace, lc: localcluster.Cluster, workdir: Path) -> dict[str, Any]:
    kube = Kube.from_kubeconfig(str(lc.admin_kubeconfig))
    try:
        return _bench(args, lc, kube, workdir)
    finally:
        kube.close()


def _bench(args: argparse.Namespace, lc: localcluster.Cluster, kube: Kube, workdir: Path) -> dict[str, Any]:
    nodes_with_gpu_class(lc, [NODE])
    plugin = BenchPlugin(lc.admin_kubeconfig, workdir, lc.logs / "topodra-bench-plugin.log",
                         extra_env=dict(args.plugin_env))
    plugin.start(wait=False)  # no kubelet registers the bench node's plugin
    try:
        ready_s = plugin.wait_ready(90)
        log(f"plugin ready in {ready_s:.1f}s (socket {plugin.socket})")
        slices = list(kube.list(slices_path(), field_selector=f"spec.driver={DRIVER},spec.nodeName={NODE}"))
        if sum(len(s["spec"]["devices"]) for s in slices) != 16:
            raise BenchError(f"expected 16 published devices on {NODE}, got slices {slices}")
        ns = f"bench-{os.getpid()}"
        kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                           "metadata": {"name": ns, "labels": {ADMIN_LABEL: "true"}}})
        wait_until(lambda: kube.get(f"/api/v1/namespaces/{ns}/serviceaccounts/default"), 60, "default SA")
        checker = CycleChecker(lambda uid: spec_path(plugin.cdi_root, DRIVER, uid).exists())
        memory: dict[str, Any] = {"after_start": memory_point(plugin.sample_rss)}
        scenarios: list[Scenario] = []
        with KubeletStub(plugin.socket) as stub:
            call, reader = health_stream(stub)
            time.sleep(args.settle)
            memory["idle"] = memory_point(plugin.sample_rss)
            log(f"idle plugin memory: {memory['idle']}")
            with RssSampler(plugin.sample_rss) as sampler:
                # 1) exclusive 1-GPU claims: one sequentially, then 8 at once (a full node).
                excl1 = make_claims(kube, ns, "excl1", 8, 1, admin=False, timeout=120)
                scenarios.append(run_scenario(Scenario("sequential 1-GPU exclusive", 1, "exclusive", 1, args.cycles),
                                              stub, excl1, checker, plugin, args.warmup))
                scenarios.append(run_scenario(Scenario("8 concurrent 1-GPU exclusive", 1, "exclusive", 8,
                                                       max(1, args.concurrent_cycles * 4)),
                                              stub, excl1, checker, plugin, 1))
                release_claims(kube, excl1, 120)
                # 2) one exclusive 8-GPU claim.
                excl8 = make_claims(kube, ns, "excl8", 1, 8, admin=False, timeout=120)
                scenarios.append(run_scenario(Scenario("sequential 8-GPU exclusive", 8, "exclusive", 1, args.cycles),
                                              stub, excl8, checker, plugin, args.warmup))
                release_claims(kube, excl8, 120)
                # 3) 32 concurrent callers: admin-access claims may share devices.
                c = args.concurrency
                adm1 = make_claims(kube, ns, "adm1", c, 1, admin=True, timeout=180)
                adm8 = make_claims(kube, ns, "adm8", c, 8, admin=True, timeout=180)
                scenarios.append(run_scenario(Scenario("sequential 8-GPU admin-access", 8, "admin", 1, args.cycles),
                                              stub, adm8, checker, plugin, args.warmup))
                scenarios.append(run_scenario(Scenario(f"{c} concurrent 1-GPU admin-access", 1, "admin", c,
                                                       args.concurrent_cycles),
                                              stub, adm1, checker, plugin, 1))
                scenarios.append(run_scenario(Scenario(f"{c} concurrent 8-GPU admin-access", 8, "admin", c,
                                                       args.concurrent_cycles),
                                              stub, adm8, checker, plugin, 1))
                memory["after_runs"] = memory_point(plugin.sample_rss)
                memory["sampled_max_VmRSS_MiB"] = round(sampler.max_kib / 1024, 1)
                release_claims(kube, adm1 + adm8, 180)
            call.cancel()
            reader.join(5)
        leftovers = sorted(p.name for p in plugin.cdi_root.glob("*.json"))
        if leftovers:
            raise BenchError(f"CDI specs left after the runs: {leftovers}")
        prepared = plugin.metric("topodra_plugin_prepared_claims")
        errors = plugin.metric("topodra_plugin_request_errors_total")
        if prepared != 0.0:
            raise BenchError(f"plugin reports {prepared} prepared claims after the runs")
        memory["process_resident_memory_bytes_metric_MiB"] = round(
            (plugin.metric("process_resident_memory_bytes") or 0) / MiB, 1)
        rc = plugin.stop()
        if rc != 0:
            raise BenchError(f"plugin exited with {rc} on SIGTERM:\n{plugin.tail()}")
        return {"plugin_ready_s": round(ready_s, 2), "scenarios": [s.result() for s in scenarios],
                "memory": memory, "plugin_request_errors": errors}
    finally:
        plugin.stop()


def verdicts(result: dict[str, Any]) -> dict[str, Any]:
    by_name = {s["name"]: s for s in result["scenarios"]}
    seq8 = by_name["sequential 8-GPU exclusive"]["prepare_ms"]
    hwm = result["memory"]["after_runs"]["VmHWM_MiB"] * MiB / 1e6
    idle = result["memory"]["idle"]["VmRSS_MiB"] * MiB / 1e6
    return {
        "prepare_p99_8gpu_sequential_ms": seq8["p99"],
        "prepare_p99_target_ms": TARGET_P99_MS_8DEV,
        "prepare_p99_ratio": round(seq8["p99"] / TARGET_P99_MS_8DEV, 3),
        "prepare_p99_ok": seq8["p99"] <= TARGET_P99_MS_8DEV,
        "rss_idle_MB": round(idle, 1),
        "rss_peak_MB": round(hwm, 1),
        "rss_target_MB": TARGET_RSS_MB,
        "rss_peak_ratio": round(hwm / TARGET_RSS_MB, 3),
        "rss_ok": hwm <= TARGET_RSS_MB,
    }


def print_table(result: dict[str, Any]) -> None:
    head = (f"{'scenario':36s} {'n':>5s} {'prep med':>9s} {'prep p99':>9s} {'unprep med':>10s} "
            f"{'unprep p99':>10s} {'srv prep':>9s} {'prep/s':>7s}")
    print(head)
    print("-" * len(head))
    for s in result["scenarios"]:
        p, u = s["prepare_ms"], s["unprepare_ms"]
        print(f"{s['name']:36s} {p['n']:>5d} {p['median']:>9.2f} {p['p99']:>9.2f} {u['median']:>10.2f} "
              f"{u['p99']:>10.2f} {s['server_mean_ms']['prepare']:>9.2f} {s['prepares_per_s'] or 0:>7.1f}")
    m = result["memory"]
    print(f"\nplugin memory (MiB): idle VmRSS {m['idle']['VmRSS_MiB']} (anon {m['idle']['RssAnon_MiB']}, file "
          f"{m['idle']['RssFile_MiB']}), after runs VmRSS {m['after_runs']['VmRSS_MiB']}, "
          f"VmHWM {m['after_runs']['VmHWM_MiB']}, threads {m['after_runs']['Threads']}")
    v = result["verdicts"]
    print(f"target prepare p99 (8 GPUs, sequential) <= {v['prepare_p99_target_ms']} ms: "
          f"{v['prepare_p99_8gpu_sequential_ms']} ms (ratio {v['prepare_p99_ratio']}) "
          f"{'OK' if v['prepare_p99_ok'] else 'MISSED'}")
    print(f"target RSS <= {v['rss_target_MB']} MB: idle {v['rss_idle_MB']} MB, peak {v['rss_peak_MB']} MB "
          f"(ratio {v['rss_peak_ratio']}) {'OK' if v['rss_ok'] else 'MISSED'}")

