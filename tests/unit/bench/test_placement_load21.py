"""bench/placement at a load where pods wait (issue 21 part 2): the trace's node shape, the window-end stop and
the wait that counts jobs still waiting."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from bench.placement import main as pmain
from bench.placement import model as pm
from bench.placement import shapes

from topodra.simulate import load_cluster

REPO = Path(__file__).resolve().parents[3]


def test_parse_allocatable_accepts_quantities_and_refuses_the_rest() -> None:
    assert shapes.parse_allocatable("96,384Gi") == ("96", "384Gi")
    assert shapes.parse_allocatable(" 95500m , 2Ti ") == ("95500m", "2Ti")
    assert shapes.parse_allocatable(",".join(shapes.TRACE_NODE)) == shapes.TRACE_NODE
    for bad in ("96", "96,384Gi,1", "x,384Gi", "96,lots", "0,384Gi", "96,", "-4,1Gi"):
        with pytest.raises(ValueError, match="--node-allocatable"):
            shapes.parse_allocatable(bad)


def test_bad_node_allocatable_fails_before_any_cluster_starts(capsys: pytest.CaptureFixture[str]) -> None:
    # main returns 2 from its argument checks: no lock taken, no cluster started (run_matrix is after them)
    assert pmain.main(["--node-allocatable", "96", "--plots", ""]) == 2
    assert "CPUS,MEMORY" in capsys.readouterr().err


def test_small_cluster_file_is_valid_16_servers_in_two_units() -> None:
    cluster = load_cluster(REPO / "bench" / "placement" / "alibaba-128.yaml")
    assert sum(g.count for g in cluster.groups) == 16
    assert {t["topodra.io/scalable-unit"] for t in cluster.tiers()} == {"su1", "su2"}


def _clock_with_one_waiting() -> pm.VirtualClock:
    jobs = [pm.Job(0, 0.0, 1000.0, 1, "any"), pm.Job(1, 10.0, 1000.0, 8, "any"), pm.Job(2, 20.0, 50.0, 0, "any")]
    clock = pm.VirtualClock(jobs, tick=0)
    clock.advance(0.0)
    clock.due_arrivals()
    clock.started(0, [])
    clock.advance(20.0)
    clock.due_arrivals()
    clock.started(2, [])  # job 1 (8 GPUs) still waits at t=20, job 2 is CPU-only
    clock.advance(100.0)
    return clock


def test_wait_mean_all_counts_waiting_gpu_jobs_up_to_the_end() -> None:
    clock = _clock_with_one_waiting()
    states = list(clock.states.values())
    # job 0 waited 0 s, job 1 still waits: 100 - 10 = 90 s so far; the CPU-only job is not a GPU job
    assert pm.wait_mean_all(states, clock.now) == pytest.approx(45.0)
    assert pm.wait_mean_all([s for s in states if not s.job.gpus], clock.now) == 0.0


def test_run_metrics_report_jobs_still_waiting() -> None:
    clock = _clock_with_one_waiting()
    inv = pm.NodeCapacity(gpus={("n1", f"gpu-{i}"): pm.Gpu("n1", f"gpu-{i}", "H100", "d", i) for i in range(8)},
                          su={"n1": "su1"}, accepts={}, busbw_nic={"n1": 48.0})
    snaps = [pm.Snapshot(t=0.0, used=1, stranded=0, fgd=0.0, goodput=1.0, waiting=0, waiting_gpus=0,
                         free_per_node={"n1": 7}),
             pm.Snapshot(t=10.0, used=1, stranded=7, fgd=0.0, goodput=1.0, waiting=1, waiting_gpus=8,
                         free_per_node={"n1": 7}, stranded_cpu=7)]
    m = pm.run_metrics(clock, snaps, inv)
    assert (m["unplaced"], m["waiting_at_end"]) == (1, 1)
    assert m["wait_mean_s_all"] == pytest.approx(45.0)
    # window [0, 20]: 7 GPUs stranded (all by CPU) for the second half
    assert m["stranded_gpus"] == pytest.approx(3.5) and m["stranded_gpus_cpu"] == pytest.approx(3.5)
    assert "8" not in m["wait_p95_s"] and not math.isnan(m["wait_p95_s"]["1"])


def test_checkpoint_of_finished_runs_merges_into_a_result(tmp_path: Path) -> None:
    def run(policy: str, seed: int, util: float) -> pmain.RunResult:
        return pmain.RunResult(policy=policy, seed=seed, workload="w",
                               metrics={"utilisation": util, "stranded_gpus": 2.0}, steps=1, events=2,
                               wall_s=1.0, scheduler={}, scorer={}, series=[], peak_free_per_node={},
                               waits={}, gpus=128, phases_s={}, missed=[])

    part = tmp_path / "x.partial.json"
    head = {"args": {"jobs": 320, "load": 4.0, "shapes": "trace", "node_allocatable": "96,384Gi"},
            "policies": {"d": pm.POLICIES["d"], "dr": pm.POLICIES["dr"]}}
    pmain.write_checkpoint(part, head, [run("d", 1, 0.7)])
    pmain.write_checkpoint(part, head, [run("d", 1, 0.7), run("dr", 1, 0.8)])  # replaced whole, not appended
    assert not part.with_name(part.name + ".tmp").exists()
    out = tmp_path / "merged.json"
    assert pmain.main(["--merge", str(part), "--out", str(out), "--plots", ""]) == 0
    doc = json.loads(out.read_text())
    assert [(r["policy"], r["seed"]) for r in doc["runs"]] == [("d", 1), ("dr", 1)]
    assert doc["summary"]["dr"]["utilisation"]["mean"] == pytest.approx(0.8)
    assert doc["args"]["node_allocatable"] == "96,384Gi"


def test_merge_compares_reservation_settings_only_for_policy_g(tmp_path: Path) -> None:
    """Seeds added later merge with earlier ones when only a setting that steers (g) alone changed default (the
    hold's maxHold, session 10); a changed workload setting still refuses (two files that both ran (g) with other
    reservation settings: ``test_merge_compares_reservation_settings_only_between_files_that_reserve``)."""
    def part(name: str, policies: str, seed: int, **args: object) -> str:
        f = tmp_path / name
        f.write_text(json.dumps({"args": {"jobs": 320, "load": 4.0, "policies": policies, **args},
                                 "policies": {p: pm.POLICIES[p] for p in policies.split(",")},
                                 "runs": [{"policy": p, "seed": seed, "metrics": {"stranded_gpus": 1.0 + seed}}
                                          for p in policies.split(",")]}))
        return str(f)

    old = part("old.json", "d,dh", 1, reserve_max_hold=7200.0, cpu_nodes="nodes.csv")
    new = part("new.json", "d,dh", 2, reserve_max_hold=86400.0, cpu_nodes="nodes.csv")
    out = tmp_path / "merged.json"
    assert pmain.main(["--merge", old, new, "--out", str(out), "--plots", ""]) == 0
    assert [(r["policy"], r["seed"]) for r in json.loads(out.read_text())["runs"]] == \
        [("d", 1), ("d", 2), ("dh", 1), ("dh", 2)]
    with_g = part("g.json", "d,g", 3, reserve_max_hold=86400.0, cpu_nodes="nodes.csv")
    assert pmain.main(["--merge", old, with_g, "--out", str(out), "--plots", ""]) == 0  # only g reads maxHold
    assert json.loads(out.read_text())["args"]["reserve_max_hold"] == 86400.0
    other_nodes = part("cpu.json", "d,dh", 4, reserve_max_hold=7200.0, cpu_nodes=None)
    assert pmain.main(["--merge", old, other_nodes, "--out", str(out), "--plots", ""]) == 2


def test_cpu_only_task_has_no_fabric_slowdown() -> None:
    # a bound CPU-only pod has a placement without devices: the gang metrics' goodput must not ask its busbw
    from bench.placement import gang

    inv = pm.NodeCapacity(gpus={("n1", "gpu-0"): pm.Gpu("n1", "gpu-0", "H100-SXM5-80GB", "d", 0)},
                          su={"n1": "su1"}, accepts={}, busbw_nic={"n1": 48.0})
    cpu_only = pm.Job(0, 0.0, 10.0, 0, "any", cpu_milli=4000, memory_mib=1024)
    assert gang.fabric_slowdown(cpu_only, inv, {}, [pm.Placement("n1", (), None)]) == 1.0


def _run(policy: str, seed: int, stranded: float, series: list[tuple[float, int, int]]) -> dict[str, object]:
    return {"policy": policy, "seed": seed, "gpus": 10,
            "metrics": {"stranded_gpus": stranded, "window_s": [0.0, 100.0]},
            "series": [{"t": t, "used": used, "waiting": waiting} for t, used, waiting in series]}


def test_utilisation_while_waiting_averages_only_the_steps_where_jobs_wait() -> None:
    from bench.placement import paired

    # 0-50 s: 2 of 10 used, nobody waits; 50-80 s: 9 used, jobs wait; 80-100 s: 10 used, jobs wait
    run = _run("d", 1, 0.0, [(0.0, 2, 0), (50.0, 9, 3), (80.0, 10, 1)])
    assert paired.utilisation_while_waiting(run) == pytest.approx((30 * 0.9 + 20 * 1.0) / 50)
    assert math.isnan(paired.utilisation_while_waiting(_run("d", 1, 0.0, [(0.0, 2, 0)])))


def test_paired_difference_is_per_seed_and_table_names_the_change() -> None:
    from bench.placement import paired

    flat = [(0.0, 5, 1)]
    runs = [_run("d", 1, 10.0, flat), _run("d", 2, 20.0, flat), _run("d", 3, 30.0, flat),
            _run("dr", 1, 6.0, flat), _run("dr", 2, 15.0, flat), _run("dr", 3, 24.0, flat)]
    got = paired.compare(runs, "d", ["dr"], ["stranded_gpus"])
    assert got["dr-d"]["stranded_gpus"]["mean"] == pytest.approx(-5.0)  # -4, -5, -6
    assert got["dr-d"]["stranded_gpus"]["hi"] < 0  # paired: the window variance is gone
    assert got["d"]["stranded_gpus"]["lo"] < got["dr"]["stranded_gpus"]["hi"]  # unpaired intervals overlap
    table = paired.markdown({"runs": runs}, "d", ["dr"], [("stranded_gpus", "stranded", 1)])
    assert "| stranded | 20.0 [" in table and "-5.0 [" in table and "[-25%]" in table
    with pytest.raises(ValueError, match=r"no runs of policy \(c\)"):
        paired.compare(runs, "c", ["dr"], ["stranded_gpus"])


def test_paired_compares_only_the_seeds_every_policy_ran() -> None:
    from bench.placement import paired

    flat = [(0.0, 5, 1)]
    runs = [_run("d", 1, 10.0, flat), _run("d", 2, 20.0, flat), _run("dr", 1, 6.0, flat)]
    got = paired.compare(runs, "d", ["dr"], ["stranded_gpus"])
    assert got["d"]["stranded_gpus"]["mean"] == 10.0 and got["d"]["stranded_gpus"]["n"] == 1


def test_merge_compares_reservation_settings_only_between_files_that_reserve(tmp_path: Path) -> None:
    def doc(policy: str, seed: int, max_hold: float) -> Path:
        f = tmp_path / f"{policy}{seed}-{int(max_hold)}.json"
        f.write_text(json.dumps({"args": {"jobs": 160, "multinode": True, "reserve_max_hold": max_hold},
                                 "policies": {policy: pm.POLICIES.get(policy, policy)},
                                 "runs": [{"policy": policy, "seed": seed, "metrics": {"utilisation": 0.5}}]}))
        return f

    out = tmp_path / "merged.json"
    # (f) never reads maxHold: its file may say another one than the (g) file's.
    f1, g1 = doc("f", 1, 7200.0), doc("g", 1, 86400.0)
    assert pmain.main(["--merge", str(f1), str(g1), "--out", str(out), "--plots", ""]) == 0
    assert json.loads(out.read_text())["args"]["reserve_max_hold"] == 86400.0  # the (g) runs' setting
    # Two (g) files with different holds are not one experiment.
    assert pmain.main(["--merge", str(g1), str(doc("g", 2, 7200.0)), "--out", str(out), "--plots", ""]) == 2
