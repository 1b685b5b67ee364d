"""bench/placement on real shapes (shapes.py): the trace's CPU/memory, CPU-only tasks, stranding by CPU/memory."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench.placement import model as pm
from bench.placement import shapes
from test_placement_bench import inventory

GI = 1 << 30

DEFAULT = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,"
           "scheduled_time\n") + """p0,12000,16384,1,1000,,LS,Running,0,100,0
p1,4000,8192,0,0,,BE,Running,10,50,10
p2,88000,327680,8,1000,,LS,Running,20,2000,20
p3,6000,8192,1,460,,LS,Running,30,,30
p4,32000,131072,4,1000,,LS,Running,40,400,40
"""
MULTI = """name,cpu_milli,memory_mib,num_gpu,gpu_milli
p0,12000,16384,1,1000
p1,4000,8192,0,0
p2,88000,327680,8,1000
p3,6000,8192,1,460
p4,32000,131072,4,1000
p9,90000,300000,8,1000
"""


def write(tmp: Path) -> tuple[Path, Path]:
    d, m = tmp / shapes.DEFAULT_LIST, tmp / "openb_pod_list_multigpu50.csv"
    d.write_text(DEFAULT)
    m.write_text(MULTI)
    return d, m


def test_trace_jobs_keep_requests_and_cpu_only_tasks(tmp_path: Path) -> None:
    d, _m = write(tmp_path)
    jobs = shapes.trace_jobs(d, 10, 16)
    assert [(j.gpus, j.cpu_milli, j.memory_mib) for j in jobs] == [
        (1, 12000, 16384), (0, 4000, 8192), (8, 88000, 327680), (4, 32000, 131072)]  # p3 never ended
    cpu_only = jobs[1]
    assert pm.claim_for(cpu_only, 0, "dr", "r") is None
    pod = pm.pod_for(cpu_only, 0, "dr", "r", {})
    assert "resourceClaims" not in pod["spec"]
    assert pod["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "4000m", "memory": "8192Mi"}
    assert pm.claim_for(jobs[2], 0, "dr", "r") is not None
    assert pm.pod_for(jobs[2], 0, "a", "r", {})["spec"]["containers"][0]["resources"]["requests"][
        pm.EXTENDED_RESOURCE] == "8"
    assert pm.job_classes(jobs) == {("any", 1): 1 / 3, ("any", 8): 1 / 3, ("any", 4): 1 / 3}


def test_multigpu50_takes_times_from_the_default_list_deterministically(tmp_path: Path) -> None:
    _d, m = write(tmp_path)
    a, b = shapes.read_tasks(m), shapes.read_tasks(m)
    assert a == b
    by = {t.name: t for t in a}
    assert (by["p2"].created, by["p2"].duration) == (20, 1980)
    assert by["p9"].duration == 1980  # the only 8-GPU default task
    assert by["p9"].created in {0, 10, 20, 40}
    (tmp_path / shapes.DEFAULT_LIST).unlink()
    with pytest.raises(pm.WorkloadError, match="no creation/deletion times"):
        shapes.read_tasks(m)


def test_bad_trace_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "x.csv"
    bad.write_text("name,num_gpu\nq,1\n")
    with pytest.raises(pm.WorkloadError, match="not an openb pod list"):
        shapes.read_tasks(bad)
    bad.write_text(DEFAULT.replace("p4,32000,131072,4", "p4,32000,131072,3"))
    with pytest.raises(pm.WorkloadError, match="3 GPUs"):
        shapes.read_tasks(bad)


def test_cpu_only_pods_bind_without_claims() -> None:
    pod = {"spec": {"nodeName": "n1", "containers": [{"resources": {"requests": {"cpu": "1"}}}]}}
    assert pm.placement_from(pod, None) == pm.Placement("n1", (), None)
    gpu = {"spec": {"nodeName": "n1", "resourceClaims": [{"name": "gpus"}], "containers": []}}
    assert pm.placement_from(gpu, None) is None  # bound, claim not seen yet: not placed


def test_stranded_split_by_cpu_and_memory() -> None:
    inv = inventory({"n1": "h100", "n2": "h100"})
    inv.host = {"n1": (224_000, 2048 * GI), "n2": (224_000, 2048 * GI)}
    free = {"n1": 8, "n2": 8}
    wait8 = pm.Job(1, 0, 1, 8, "any", cpu_milli=96_000, memory_mib=768 * 1024)
    cpu_only = pm.Job(2, 0, 1, 0, "any", cpu_milli=1000, memory_mib=1)
    # n1: a CPU-only pod takes 200 CPU; n2: another takes 1.5Ti of memory
    placements = {"c1": pm.Placement("n1", (), None), "c2": pm.Placement("n2", (), None)}
    jobs = {"c1": pm.Job(3, 0, 1, 0, "any", cpu_milli=200_000, memory_mib=1),
            "c2": pm.Job(4, 0, 1, 0, "any", cpu_milli=1, memory_mib=1536 * 1024)}
    room = shapes.host_free(inv, shapes.host_used(placements, jobs))
    got = shapes.stranded_split(inv, free, [wait8, cpu_only], "dr", room)
    assert got == shapes.Stranded(total=16, by_cpu=8, by_memory=8)
    assert shapes.stranded_split(inv, free, [cpu_only], "dr", room) == shapes.Stranded(0, 0, 0)
    roomy = shapes.host_free(inv, {})
    assert shapes.stranded_split(inv, free, [wait8], "dr", roomy) == shapes.Stranded(0, 0, 0)
    assert shapes.cpu_only_on_gpu_nodes(placements, jobs, inv) == 2
    snap = pm.Snapshot(0, 0, 0, 0.0, 0.0, 1, 8, free)
    with_host = shapes.with_host(snap, inv, placements, jobs, [wait8], "dr")
    assert (with_host.stranded, with_host.stranded_cpu, with_host.stranded_memory,
            with_host.cpu_only_on_gpu_nodes) == (16, 8, 8, 2)


def test_node_allocatable_of_the_benchmark_nodes() -> None:
    nodes = [{"metadata": {"name": "n1"}, "status": {"allocatable": {"cpu": "224", "memory": "2Ti"}}},
             {"metadata": {"name": "other"}, "status": {"allocatable": {"cpu": "1"}}}]
    assert shapes.node_allocatable(nodes, ["n1"]) == {"n1": (224_000, 2 << 40)}


def test_profiles_carry_the_dgx_allocatable() -> None:
    from topodra.simulate import profile_allocatable

    assert profile_allocatable("dgx-h100") == ("224", "2Ti")
    assert profile_allocatable("dgx-h200") == ("224", "2Ti")
    assert profile_allocatable("dgx-a100-80gb") == ("256", "2Ti")
    assert profile_allocatable("l4") == ("128", "2Ti")  # no hostMemory: the old default


NODES = """sn,cpu_milli,memory_mib,gpu,model
n0,32000,262144,0,
n1,32000,262144,0,
n2,32000,262144,0,
n3,96000,524288,0,
n4,96000,393216,8,G2
n5,96000,393216,8,G2
n6,96000,393216,8,G2
n7,96000,393216,8,G2
"""


def test_cpu_node_group_keeps_the_trace_proportion_and_shapes(tmp_path: Path) -> None:
    f = tmp_path / "openb_node_list_all_node.csv"
    f.write_text(NODES)
    # 4 CPU-only nodes per 4 GPU nodes: 8 GPU servers get 8, three of every four the most common shape.
    assert shapes.cpu_node_group(f, 8) == [("32000m", "262144Mi")] * 6 + [("96000m", "524288Mi")] * 2
    assert shapes.cpu_node_group(f, 3) == [("32000m", "262144Mi")] * 2 + [("96000m", "524288Mi")]
    assert shapes.cpu_node_group(f, 0) == []
    (tmp_path / "gpus-only.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\nn4,96000,393216,8,G2\n")
    with pytest.raises(pm.WorkloadError, match="CPU-only"):
        shapes.cpu_node_group(tmp_path / "gpus-only.csv", 8)
    with pytest.raises(pm.WorkloadError, match="node list"):
        shapes.cpu_node_group(write(tmp_path)[0], 8)  # a pod list


def test_servers_with_8_free_gpus_and_waits_of_jobs_still_waiting() -> None:
    assert pm.whole_free_servers({"a": 8, "b": 7, "c": 0, "d": 8}) == 2
    states = [pm.JobState(pm.Job(id=0, arrival=0.0, duration=10.0, gpus=8, prefs="any"), submitted=True, start=20.0),
              pm.JobState(pm.Job(id=1, arrival=5.0, duration=10.0, gpus=8, prefs="any"), submitted=True),
              pm.JobState(pm.Job(id=2, arrival=500.0, duration=10.0, gpus=8, prefs="any"))]  # not arrived
    got = pm.waits_all_p95(states, 105.0)
    assert got["8"] == pytest.approx(20 + 0.95 * (100 - 20))  # the waiting job counts 100 s so far
