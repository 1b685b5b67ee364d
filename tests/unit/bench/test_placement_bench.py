"""bench/placement: the pure parts (workloads, objects, clock, metrics) and a smoke replay on the real cluster.

The smoke replay runs policies (b) and (c) of a short synthetic stream through the real
kube-scheduler on 12 simulated DGX nodes and checks what the benchmark reports: every job placed or
accounted for, no GPU of a type the job did not list, metrics within their ranges.

Split by tier; the rest: tests/cluster/test_placement_bench_cluster.py.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
from bench.placement import main as pb
from bench.placement import model as pm

from topodra.classcatalog import catalog

# --------------------------------------------------------------------------- workloads


def test_synthetic_stream_is_seeded_and_has_the_requested_shape() -> None:
    spec = pm.SyntheticSpec(jobs=2000)
    a, b, c = pm.synthetic_jobs(spec, 7), pm.synthetic_jobs(spec, 7), pm.synthetic_jobs(spec, 8)
    assert a == b and a != c
    assert {j.gpus for j in a} == {1, 2, 4, 8, 16}
    assert {j.prefs for j in a} == {"h200>h100>a100", "h200>h100", "mem80", "h200"}
    assert all(x.arrival <= y.arrival for x, y in itertools.pairwise(a))
    # Offered load: 1.0 outside the burst, 1.5 inside it (20% of the jobs), so ~1.1 over the stream.
    assert 0.95 < pm.offered_load(a, 400) < 1.3
    durations = sorted(j.duration for j in a)
    assert 0.8 * 3600 < durations[len(durations) // 2] < 1.25 * 3600  # lognormal median


def test_burst_arrives_faster() -> None:
    jobs = pm.synthetic_jobs(pm.SyntheticSpec(jobs=4000, burst=(0.5, 1.0)), 3)
    first, second = jobs[:2000], jobs[2000:]
    rate1 = len(first) / (first[-1].arrival - first[0].arrival)
    rate2 = len(second) / (second[-1].arrival - second[0].arrival)
    assert 1.3 < rate2 / rate1 < 1.7


def test_synthetic_rejects_bad_parameters() -> None:
    with pytest.raises(pm.WorkloadError):
        pm.synthetic_jobs(pm.SyntheticSpec(load=0), 1)
    with pytest.raises(pm.WorkloadError, match="unknown preference"):
        pm.synthetic_jobs(pm.SyntheticSpec(prefs=(("tpu", 1.0),)), 1)


def write_trace(path: Path, rows: list[tuple[int, int, int, int | str]]) -> Path:
    lines = ["name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,"
             "scheduled_time"]
    lines += [f"p{i},1000,1024,{n},{milli},,LS,Running,{c},{d},{c}" for i, (n, milli, c, d) in enumerate(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_alibaba_mapping(tmp_path: Path) -> None:
    f = write_trace(tmp_path / "t.csv", [
        (1, 1000, 100, 200), (0, 0, 110, 300),  # CPU-only: skipped
        (1, 500, 120, 220),  # fractional
        (8, 1000, 130, 1130), (2, 1000, 140, ""),  # no deletion time: skipped
        (4, 1000, 150, 550)])
    jobs = pm.alibaba_jobs(f, 10, capacity_gpus=16, load=1.0)
    assert [j.gpus for j in jobs] == [1, 1, 8, 4]
    assert [j.duration for j in jobs] == [100, 100, 1000, 400]
    assert all(j.prefs == "any" for j in jobs)
    assert jobs[0].arrival == 0 and [j.arrival for j in jobs] == sorted(j.arrival for j in jobs)
    # Offered load 1.0 on 16 GPUs, durations counted up to their 90th percentile (820 s here)...
    cap = pm.percentile([j.duration for j in jobs], pm.TRIM_PERCENTILE)
    assert cap == pytest.approx(820)
    assert jobs[-1].arrival == pytest.approx(sum(j.gpus * min(j.duration, cap) for j in jobs) / 16)
    # ...so one task of a whole year does not stretch the gaps of all the others to months.
    year = write_trace(tmp_path / "y.csv", [(1, 1000, 0, 365 * 86400), *[(1, 1000, 10 * i, 10 * i + 600)
                                                                          for i in range(1, 40)]])
    long = pm.alibaba_jobs(year, 100, capacity_gpus=8)
    assert long[-1].arrival == pytest.approx(40 * 600 / 8, rel=0.05)
    assert long[0].duration == 365 * 86400  # the replay still runs it whole
    skipped = pm.alibaba_jobs(f, 10, capacity_gpus=16, fractional="skip")
    assert [j.gpus for j in skipped] == [1, 8, 4]
    assert [j.gpus for j in pm.alibaba_jobs(f, 2, 16, skip=1)] == [1, 8]


def test_alibaba_bad_input_is_named(tmp_path: Path) -> None:
    with pytest.raises(pm.WorkloadError, match="cannot read"):
        pm.alibaba_jobs(tmp_path / "missing.csv", 1, 8)
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(pm.WorkloadError, match="not an openb pod list"):
        pm.alibaba_jobs(tmp_path / "x.csv", 1, 8)
    f = write_trace(tmp_path / "t.csv", [(3, 1000, 1, 5)])
    with pytest.raises(pm.WorkloadError, match="3 GPUs"):
        pm.alibaba_jobs(f, 1, 8)
    with pytest.raises(pm.WorkloadError, match="fractional"):
        pm.alibaba_jobs(f, 1, 8, fractional="half")


# --------------------------------------------------------------------------- policies as objects


def test_policy_objects() -> None:
    big = pm.Job(1, 0, 10, 16, "h200>h100>a100")
    assert (big.pods, big.per_pod, big.pod_names()) == (2, 8, ["j00001-0", "j00001-1"])
    a = pm.pod_for(big, 1, "a", "r1", {"k": "v"})
    res = a["spec"]["containers"][0]["resources"]
    assert res["limits"] == {pm.EXTENDED_RESOURCE: "8"} and "resourceClaims" not in a["spec"]
    term = a["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["topologyKey"] == pm.SU_LABEL and term["labelSelector"]["matchLabels"][pm.JOB_LABEL] == "1"
    assert pm.claim_for(big, 0, "a", "r1") is None

    b = pm.claim_for(big, 0, "b", "r1")
    assert b is not None
    assert b["spec"]["devices"]["requests"] == [{"name": "gpus", "exactly": {
        "deviceClassName": "gpu-h200", "allocationMode": "ExactCount", "count": 8}}]
    c = pm.claim_for(big, 0, "c", "r1")
    assert c is not None and c == pm.claim_for(big, 0, "d", "r1")
    req = c["spec"]["devices"]["requests"][0]
    assert [s["deviceClassName"] for s in req["firstAvailable"]] == ["gpu-h200", "gpu-h100", "gpu-a100-80gb"]
    assert [s["name"] for s in req["firstAvailable"]] == pm.alternative_names(big)
    assert c["spec"]["devices"]["constraints"] == [{"requests": ["gpus"],
                                                    "matchAttribute": "gpu.topodra.io/nvlinkDomain"}]
    pod = pm.pod_for(pm.Job(2, 0, 1, 4, "h200"), 0, "c", "r1", {})
    assert pod["spec"]["resourceClaims"] == [{"name": "gpus", "resourceClaimName": "j00002-0"}]
    assert "affinity" not in pod["spec"]
    assert pod["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "48", "memory": "384Gi"}
    with pytest.raises(ValueError, match="unknown policy"):
        pm.claim_spec_for(big, "z")


def test_scheduler_config_per_policy() -> None:
    a = pm.scheduler_config("a")
    fit = a["profiles"][0]["pluginConfig"][0]
    assert fit["name"] == "NodeResourcesFit"
    assert fit["args"]["scoringStrategy"] == {"type": "MostAllocated",
                                              "resources": [{"name": pm.EXTENDED_RESOURCE, "weight": 1}]}
    for p in "bcd":
        assert "pluginConfig" not in pm.scheduler_config(p)["profiles"][0]
    assert {pm.scheduler_config(p)["podMaxBackoffSeconds"] for p in "abcd"} == {1}
    assert pm.extended_device_class()["spec"]["extendedResourceName"] == pm.EXTENDED_RESOURCE


# --------------------------------------------------------------------------- inventory and metrics

MODELS = {"h200": ("H200-SXM5-141GB", 143771, 400), "h100": ("H100-SXM5-80GB", 81559, 400),
          "a100": ("A100-SXM4-80GB", 81920, 200)}


def fake_slices(nodes: dict[str, str]) -> list[dict[str, Any]]:
    """node -> kind (h200/h100/a100): 8 GPUs on one NVSwitch, rails 0..7, one NIC."""
    out = []
    for node, kind in nodes.items():
        model, mem, rate = MODELS[kind]
        devs: list[dict[str, Any]] = [{"name": f"gpu-{i}", "attributes": {
            "type": {"string": "gpu"}, "model": {"string": model}, "nvlinkDomain": {"string": f"{node}/nvl"},
            "rail": {"int": i}}, "capacity": {"memory": {"value": f"{mem}Mi"}}} for i in range(8)]
        devs.append({"name": "nic-0", "attributes": {"type": {"string": "nic"}, "linkRate": {"int": rate}}})
        out.append({"spec": {"driver": pm.DRIVER, "nodeName": node, "devices": devs}})
    out.append({"spec": {"driver": "other", "nodeName": "x", "devices": []}})
    return out


def inventory(nodes: dict[str, str], su: dict[str, str] | None = None) -> pm.NodeCapacity:
    matches = {s.name: s.match for s in catalog()}
    return pm.inventory_from_slices(fake_slices(nodes), su or dict.fromkeys(nodes, "su1"), matches)


def test_inventory_reads_models_and_class_acceptance() -> None:
    inv = inventory({"n1": "h200", "n2": "h100", "n3": "a100"})
    assert inv.total() == 24 and inv.nodes == ["n1", "n2", "n3"]
    assert inv.accepts["gpu-h200"] == {"H200-SXM5-141GB"}
    assert inv.accepts["gpu-mem-80gi"] == {"H200-SXM5-141GB", "H100-SXM5-80GB", "A100-SXM4-80GB"}
    assert inv.busbw_nic == {"n1": 48.0, "n2": 48.0, "n3": 24.0}
    with pytest.raises(ValueError, match="no GPUs published"):
        pm.inventory_from_slices(fake_slices({"n1": "h200"}), {"n1": "a", "n9": "b"}, {})


def test_stranded_and_fgd() -> None:
    inv = inventory({"n1": "h200", "n2": "h100", "n3": "a100"})
    used = {("n1", f"gpu-{i}") for i in range(4)} | {("n2", f"gpu-{i}") for i in range(7)}
    free = pm.free_by_node(inv, used)
    assert free == {"n1": 4, "n2": 1, "n3": 8}
    waiting = [pm.Job(1, 0, 1, 8, "h200>h100")]
    # An 8-GPU H200/H100 job fits nowhere: all 13 free GPUs are stranded; the A100 server too (wrong type).
    assert pm.stranded_gpus(inv, free, waiting, "c") == 13
    # Count-only (a) accepts the A100 server: only n1 and n2 strand.
    assert pm.stranded_gpus(inv, free, waiting, "a") == 5
    assert pm.stranded_gpus(inv, free, [pm.Job(2, 0, 1, 1, "h200")], "c") == 9  # n2 (H100) + n3 (A100)
    assert pm.stranded_gpus(inv, free, [], "c") == 0
    mix = {("h200>h100", 8): 0.5, ("mem80", 1): 0.5}
    # class (h200>h100, 8) fits nowhere -> 13 * 0.5; (mem80, 1) fits everywhere -> 0.
    assert pm.fgd_fragmentation(inv, free, mix, "c") == pytest.approx(6.5)
    assert pm.fgd_fragmentation(inv, {"n1": 0, "n2": 0, "n3": 8}, {("h200", 1): 1.0}, "b") == 8


def test_choice_rank_violation_locality_rails_and_goodput() -> None:
    inv = inventory({"h2": "h200", "h1": "h100", "a1": "a100", "h1b": "h100"},
                    su={"h2": "su2", "h1": "su1", "a1": "su1", "h1b": "su2"})
    job = pm.Job(1, 0, 100, 8, "h200>h100")
    on = {n: pm.Placement(n, tuple(f"gpu-{i}" for i in range(8)), None) for n in inv.nodes}
    assert pm.choice_rank(job, inv, [on["h2"]]) == 0
    assert pm.choice_rank(job, inv, [on["h1"]]) == 1
    assert pm.choice_rank(job, inv, [on["a1"]]) is None  # A100 was not listed: a violation
    assert pm.nvlink_local(inv, on["h1"])
    assert pm.slowdown(job, inv, [on["h2"]]) == 1.0
    # Fallback to H100: busbw 370 vs ideal 475 -> 1 + 0.2 * (475/370 - 1)
    assert pm.slowdown(job, inv, [on["h1"]]) == pytest.approx(1 + 0.2 * (475 / 370 - 1))
    assert pm.slowdown(pm.Job(2, 0, 1, 1, "h200>h100"), inv, [pm.Placement("a1", ("gpu-0",), None)]) == 1.0
    big = pm.Job(3, 0, 1, 16, "h200>h100")
    assert pm.rail_aligned(inv, [on["h2"], on["h1b"]])  # same unit, same rails
    assert not pm.rail_aligned(inv, [on["h2"], on["h1"]])  # two units
    same_su = pm.slowdown(big, inv, [on["h2"], on["h1b"]])
    cross = pm.slowdown(big, inv, [on["h2"], on["h1"]])
    assert 1.0 <= same_su < cross
    half = pm.Placement("h1", ("gpu-0", "gpu-1", "gpu-2", "gpu-3"), None)
    assert not pm.rail_aligned(inv, [half, pm.Placement("h1b", ("gpu-4", "gpu-5", "gpu-6", "gpu-7"), None)])


def test_placement_from_claim() -> None:
    pod = {"spec": {"nodeName": "n1"}}
    claim = {"status": {"allocation": {"devices": {"results": [
        {"driver": pm.DRIVER, "pool": "n1", "device": "gpu-1", "request": "gpus/h100"},
        {"driver": pm.DRIVER, "pool": "n1", "device": "gpu-0", "request": "gpus/h100"}]}}}}
    assert pm.placement_from(pod, claim) == pm.Placement("n1", ("gpu-0", "gpu-1"), "h100")
    assert pm.placement_from({"spec": {}}, claim) is None
    assert pm.placement_from(pod, {"status": {}}) is None
    exact = {"status": {"allocation": {"devices": {"results": [
        {"driver": pm.DRIVER, "pool": "n1", "device": "gpu-0", "request": "gpus"}]}}}}
    assert pm.placement_from(pod, exact) == pm.Placement("n1", ("gpu-0",), None)


def test_virtual_clock_orders_events_and_groups_by_tick() -> None:
    jobs = [pm.Job(0, 0, 100, 1, "h200"), pm.Job(1, 10, 50, 1, "h200"), pm.Job(2, 500, 10, 1, "h200")]
    clk = pm.VirtualClock(jobs)
    assert clk.next_time() == 0
    clk.advance(0)
    assert [j.id for j in clk.due_arrivals()] == [0]
    clk.started(0, [])
    assert clk.next_time() == 10
    clk.advance(10)
    assert [j.id for j in clk.due_arrivals()] == [1]
    assert [j.id for j in clk.waiting()] == [1]
    assert clk.next_time() == 100  # job 0 ends at 0 + 100; job 1 still waits
    clk.advance(100)
    assert [j.id for j in clk.due_completions()] == [0]
    clk.started(1, [])
    clk.started(1, [])  # idempotent: the start time stays
    assert clk.states[1].start == 100 and clk.states[1].end == 150
    assert not clk.all_started()
    with pytest.raises(ValueError, match="go back"):
        clk.advance(50)
    grouped = pm.VirtualClock(jobs, tick=20)
    grouped.advance(0)
    assert [j.id for j in grouped.due_arrivals()] == [0, 1]
    with pytest.raises(ValueError):
        pm.VirtualClock(jobs, tick=-1)


def test_time_average_percentiles_and_intervals() -> None:
    def snap(t: float, used: int) -> pm.Snapshot:
        return pm.Snapshot(t=t, used=used, stranded=0, fgd=0, goodput=0, waiting=0, waiting_gpus=0,
                           free_per_node={})

    snaps = [snap(0, 10), snap(10, 20), snap(30, 0)]
    assert pm.time_average(snaps, "used", 0, 30) == pytest.approx((10 * 10 + 20 * 20) / 30)
    assert pm.time_average(snaps, "used", 10, 40) == pytest.approx(20 * 20 / 30)
    assert pm.percentile([1, 2, 3, 4], 50) == 2.5 and math.isnan(pm.percentile([], 50))
    iv = pm.interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert iv["mean"] == 3 and iv["lo"] == pytest.approx(3 - 2.776 * math.sqrt(2.5) / math.sqrt(5))
    assert pm.interval([math.nan])["n"] == 0
    agg = pm.aggregate([{"a": 1, "w": {"8": 2.0}, "s": "x"}, {"a": 3, "w": {"8": 4.0}}])
    assert agg["a"]["mean"] == 2 and agg["w.8"]["mean"] == 3 and "s" not in agg


def test_run_metrics_counts_every_job() -> None:
    inv = inventory({"n1": "h200", "n2": "a100"})
    jobs = [pm.Job(0, 0, 100, 8, "h200"), pm.Job(1, 10, 100, 8, "h200"), pm.Job(2, 20, 100, 1, "h200>h100")]
    clk = pm.VirtualClock(jobs)

    def full(n: str) -> pm.Placement:
        return pm.Placement(n, tuple(f"gpu-{i}" for i in range(8)), None)

    snaps = []
    clk.advance(0)
    clk.due_arrivals()
    clk.started(0, [full("n1")])
    snaps.append(pm.snapshot(0, inv, {("n1", f"gpu-{i}") for i in range(8)}, clk, pm.job_classes(jobs), "b"))
    clk.advance(20)
    clk.due_arrivals()
    clk.started(2, [pm.Placement("n2", ("gpu-0",), None)])  # an A100: not listed -> violation
    s = pm.snapshot(20, inv, {("n1", f"gpu-{i}") for i in range(8)} | {("n2", "gpu-0")}, clk,
                    pm.job_classes(jobs), "b")
    assert s.waiting == 1 and s.stranded == 7  # job 1 (8x H200) waits; n2's 7 free A100s strand
    snaps.append(s)
    m = pm.run_metrics(clk, snaps, inv)
    assert (m["jobs"], m["placed"], m["unplaced"]) == (3, 2, 1)
    assert m["type_violations"] == 1 and m["choice"] == {"1": 1, "violation": 1}
    assert 0 < m["utilisation"] <= 1 and m["stranded_gpus"] == 0  # window [0, 20]: nobody waited before 20
    assert m["wait_p50_s"] == {"1": 0.0, "8": 0.0}


# --------------------------------------------------------------------------- harness helpers


METRICS = """# HELP scheduler_pending_pods x
scheduler_pending_pods{queue="active"} 0
scheduler_pending_pods{queue="backoff"} 2
scheduler_pending_pods{queue="unschedulable"} 7
scheduler_goroutines{operation="binding"} 0
scheduler_schedule_attempts_total{profile="default-scheduler",result="scheduled"} 40
scheduler_schedule_attempts_total{profile="default-scheduler",result="unschedulable"} 5
scheduler_queue_incoming_pods_total{event="PodAdd",queue="active"} 45
topodra_prioritize_seconds_bucket{le="0.001"} 50
topodra_prioritize_seconds_bucket{le="0.005"} 90
topodra_prioritize_seconds_bucket{le="+Inf"} 100
"""


def test_scheduler_state_and_histograms() -> None:
    st = pb.SchedulerState.of(METRICS)
    assert st.busy and st.signature == (45, 45)
    assert not pb.SchedulerState.of(METRICS.replace('"backoff"} 2', '"backoff"} 0')).busy
    q = pb.histogram_quantiles(METRICS, "prioritize")
    assert q["count"] == 100 and q["p50_ms"] == pytest.approx(1.0)
    assert q["p99_ms"] == pytest.approx(5.0)  # in the +Inf bucket: its lower edge
    assert pb.histogram_quantiles(METRICS, "nothing") == {}


def test_histogram_quantiles_over_a_window() -> None:
    before = METRICS.replace('le="0.001"} 50', 'le="0.001"} 40').replace('le="0.005"} 90', 'le="0.005"} 40') \
        .replace('le="+Inf"} 100', 'le="+Inf"} 40')
    q = pb.histogram_quantiles(METRICS, "prioritize", before=before)
    # 60 new observations: 10 <= 1 ms, 40 in (1, 5] ms, 10 above.
    assert q["count"] == 60 and q["p50_ms"] == pytest.approx(1 + 4 * (30 - 10) / 40)


# --------------------------------------------------------------------------- schedule throughput (pure parts)


def test_throughput_slope_between_10_and_90_percent() -> None:
    from bench.schedule_throughput import main as st

    samples = [(0.0, 0.0), (1.0, 0.0), (2.0, 50.0), (4.0, 150.0), (5.0, 200.0)]
    # 20 pods at t=1.4, 180 pods at t=4.6: 160 pods in 3.2 s
    assert st.throughput(samples, 200) == pytest.approx(50.0)
    assert math.isnan(st.throughput(samples[:3], 200))  # 90% never reached


def test_cpu_per_pod_in_the_10_to_90_percent_window() -> None:
    from bench.schedule_throughput import main as st

    samples = [(0.0, 0.0), (1.0, 5.0), (2.0, 20.0), (3.0, 60.0), (4.0, 95.0), (5.0, 100.0)]
    cpu = [[0.0, 1.0], [0.5, 1.0], [1.0, 2.0], [3.0, 2.5], [5.0, 4.0], [5.1, 4.0]]
    # first samples at >= 10 (index 2: 20 pods) and >= 90 (index 4: 95 pods): 75 pods
    assert st.cpu_per_pod(samples, cpu, 100) == pytest.approx([4.0 / 75, 2.0 / 75])
    assert all(math.isnan(x) for x in st.cpu_per_pod(samples[:3], cpu[:3], 100))  # 90% never reached
    assert st.cpu_per_pod([(0.0, 0.0)], [], 100) == []


def test_node_slices_in_both_forms() -> None:
    from bench.schedule_throughput import main as st

    devices = st.template_devices()
    full = st.node_slices(devices, "n1", "uid-1", stripped=False)
    stripped = st.node_slices(devices, "n1", "uid-1", stripped=True)
    assert [s["metadata"]["name"] for s in full] == [s["metadata"]["name"] for s in stripped]  # patched in place
    gpu = next(d for d in full[0]["spec"]["devices"] if d["attributes"]["type"]["string"] == "gpu")
    sgpu = next(d for d in stripped[0]["spec"]["devices"] if d["name"] == gpu["name"])
    assert set(sgpu["attributes"]) == set(st.STRIPPED_KEEP) < set(gpu["attributes"])
    assert sgpu["capacity"] == gpu["capacity"]
    assert gpu["attributes"]["nvlinkDomain"]["string"].startswith("n1/")


def test_cloned_and_stripped_slices() -> None:
    from bench.schedule_throughput import main as st

    from topodra.devices import AttributeValue, Device

    tmpl = [Device(name="gpu-0", kind="gpu", capacity={"memory": "80Gi"}, attributes={
        "type": AttributeValue(string="gpu"), "model": AttributeValue(string="H100-SXM5-80GB"),
        "nvlinkDomain": AttributeValue(string=f"{st.TEMPLATE_NODE}/nvl-1"), "rail": AttributeValue(int=0),
        "uuid": AttributeValue(string="GPU-x"), "numaNode": AttributeValue(int=0)})]
    a, b = st.clone_devices(tmpl, st.TEMPLATE_NODE, "n1"), st.clone_devices(tmpl, st.TEMPLATE_NODE, "n2")
    assert a[0].attributes["nvlinkDomain"].string == "n1/nvl-1"
    assert a[0].attributes["uuid"] != b[0].attributes["uuid"] != tmpl[0].attributes["uuid"]
    stripped = st.strip_devices(a)
    assert set(stripped[0].attributes) == {"type", "model", "nvlinkDomain", "rail"}
    assert stripped[0].capacity == {"memory": "80Gi"}


def test_throughput_claims_and_mix() -> None:
    from bench.schedule_throughput import main as st

    one, eight = st.claim_specs("full")
    assert one["devices"]["requests"][0]["exactly"]["count"] == 1 and "constraints" not in one["devices"]
    assert eight["devices"]["constraints"][0]["matchAttribute"] == pm.NVLINK_ATTR
    assert st.claim_specs("stripped") == (one, eight)
    t1, t8 = st.claim_specs("topology")
    assert len(t8["devices"]["requests"]) == 16  # a GPU and a NIC request per GPU
    assert sum(c["matchAttribute"].endswith("/rail") for c in t8["devices"]["constraints"]) == 8
    assert len(t1["devices"]["requests"]) == 2
    with pytest.raises(ValueError):
        st.claim_specs("x")
    mix = st.pod_mix(10, 3, seed=4)
    assert sorted(mix) == [1] * 10 + [8] * 3 and mix == st.pod_mix(10, 3, seed=4)


def test_subrequest_rank() -> None:
    job = pm.Job(1, 0, 1, 16, "h200>h100>a100")
    on = [pm.Placement("n1", ("gpu-0",), "h200"), pm.Placement("n2", ("gpu-0",), "a100-80gb")]
    assert pm.subrequest_rank(job, on) == 2
    assert pm.subrequest_rank(job, [pm.Placement("n1", ("gpu-0",), None)]) is None


# --------------------------------------------------------------------------- the harness's scheduler configuration


def test_scheduler_client_settings_reach_the_harness_config() -> None:
    from testkit import cluster as localcluster

    cfg = localcluster.scheduler_configuration(pm.scheduler_config("c"), Path("/k"))
    assert cfg["clientConnection"] == {**pm.SCHEDULER_CLIENT, "kubeconfig": "/k"}
    assert pm.scheduler_config("c", client={"qps": 50, "burst": 100})["clientConnection"]["qps"] == 50
