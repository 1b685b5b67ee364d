"""The "big jobs alone" floor of bench/placement/floor.py: arrival order, whole servers, one unit, model choice."""

from __future__ import annotations

import json

import pytest
from bench.placement import floor as fl
from bench.placement import model as pm


def _inv(groups: list[tuple[str, str, int]]) -> tuple[list[fl.Server], pm.NodeCapacity]:
    """(model, unit, count) groups of 8-GPU servers; classes as in the bench: one per model, mem80 = all."""
    gpus: dict[tuple[str, str], pm.Gpu] = {}
    su: dict[str, str] = {}
    servers = []
    for model, unit, count in groups:
        for k in range(count):
            name = f"{model}-{unit}-{k}"
            su[name] = unit
            servers.append(fl.Server(name, model, unit))
            for g in range(8):
                gpus[(name, f"gpu-{g}")] = pm.Gpu(name, f"gpu-{g}", model, "d", g)
    models = {m for m, _u, _c in groups}
    accepts = {f"gpu-{m}": frozenset({m}) for m in models}
    accepts["gpu-mem-80gi"] = frozenset(models)
    inv = pm.NodeCapacity(gpus=gpus, su=su, accepts=accepts, busbw_nic={n: 48.0 for n in su})
    return servers, inv


def _job(i: int, arrival: float, duration: float, gpus: int, prefs: str) -> pm.Job:
    return pm.Job(id=i, arrival=arrival, duration=duration, gpus=gpus, prefs=prefs)


def test_two_jobs_of_the_one_scarce_model_run_one_after_the_other() -> None:
    servers, inv = _inv([("h200", "su2", 10), ("h100", "su2", 10)])
    jobs = [_job(0, 0.0, 5000.0, 64, "h200"), _job(1, 1000.0, 100.0, 64, "h200")]
    starts = fl.floor_starts(jobs, servers, inv)
    assert starts == {0: 0.0, 1: 5000.0}
    assert fl.floor_waits(jobs, starts) == [0.0, 4000.0]


def test_a_flexible_job_takes_its_preferred_model_or_the_scarce_one_leaves_it() -> None:
    servers, inv = _inv([("h200", "su2", 10), ("h100", "su2", 10)])
    jobs = [_job(0, 0.0, 5000.0, 32, "h200>h100"), _job(1, 10.0, 100.0, 64, "h200")]
    pref = fl.floor_starts(jobs, servers, inv, min_gpus=32, choice="preference")
    assert pref[1] == 5000.0  # the 32-GPU job took 4 of the 10 H200 servers: 6 left, 8 needed
    scarce = fl.floor_starts(jobs, servers, inv, min_gpus=32, choice="scarce")
    assert scarce[1] == 10.0  # H100: one list of the stream accepts it, H200 two
    assert fl.floor_starts(jobs, servers, inv, min_gpus=64) == {1: 10.0}  # smaller jobs assumed away


def test_arrival_order_kept_a_later_job_only_fills_gaps_it_cannot_delay() -> None:
    servers, inv = _inv([("h100", "su1", 8)])
    jobs = [_job(0, 0.0, 1000.0, 32, "h200>h100"),  # 4 servers until 1000
            _job(1, 10.0, 3000.0, 64, "h200>h100"),  # needs all 8: from 1000 to 4000
            _job(2, 20.0, 500.0, 32, "h200>h100"),   # fits the other 4 servers before 1000: starts at once
            _job(3, 30.0, 2000.0, 32, "h200>h100")]  # would delay job 1: after it, at 4000
    starts = fl.floor_starts(jobs, servers, inv, min_gpus=32)
    assert starts == {0: 0.0, 1: 1000.0, 2: 20.0, 3: 4000.0}


def test_a_gang_stays_in_one_unit() -> None:
    servers, inv = _inv([("h100", "su1", 4), ("h100", "su2", 4)])
    jobs = [_job(0, 0.0, 100.0, 64, "h200>h100")]
    assert fl.floor_starts(jobs, servers, inv) == {}  # 8 servers, but 4 per unit: never


def test_bad_min_gpus_is_refused() -> None:
    servers, inv = _inv([("h100", "su1", 8)])
    with pytest.raises(ValueError, match="at least 8"):
        fl.floor_starts([], servers, inv, min_gpus=4)
    with pytest.raises(ValueError, match="choice"):
        fl.floor_starts([_job(0, 0.0, 1.0, 64, "h200>h100")], servers, inv, choice="fastest")


def test_the_bench_cluster_and_its_streams() -> None:
    servers, _ = fl.servers_of("bench/placement/fabric-400.yaml")
    assert len(servers) == 50
    h200 = [s for s in servers if "H200" in s.model]
    assert len(h200) == 10 and {s.unit for s in h200} == {"su2"}
    result = {"args": {"multinode": True, "adversarial": False, "trace": None, "shapes": "fixed", "jobs": 160,
                       "load": 1.0, "burst_load": 1.5, "cluster": "bench/placement/fabric-400.yaml"},
              "runs": [{"seed": 2, "policy": "f", "metrics": {"wait_p95_s": {"64": 44659.0}}}]}
    jobs = fl.streams(result)[2]
    assert len(jobs) == 160 and sum(1 for j in jobs if j.gpus == 64) == 9
    rep = fl.report(result, [64])
    row = rep["rows"][2]
    assert row["(f)"] == 44659.0
    assert 0 < row["floor >= 64 GPUs, preference"] < row["(f)"]
    json.dumps(rep)


def test_cli_refuses_a_result_of_another_stream(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"args": {"multinode": False}, "runs": []}))
    assert fl.main([str(p)]) == 2
    assert "--multinode" in capsys.readouterr().err
