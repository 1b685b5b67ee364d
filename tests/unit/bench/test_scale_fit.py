"""bench/scale's pure parts: the growth verdict and the sub-cluster of the first N nodes."""

from __future__ import annotations

import math

import pytest
from bench.paths import REPO
from bench.scale.clusters import first_nodes
from bench.scale.fit import growth
from bench.scale.main import parse_args

from topodra.simulate import load_cluster

SIZES = [64, 256, 512, 1024, 2048]


def test_linear_with_a_fixed_cost_is_at_most_linear() -> None:
    g = growth(SIZES, [2.0 + 0.01 * n for n in SIZES])
    assert g is not None and g.at_most_linear
    assert g.exponent < 1.0
    assert math.isclose(g.slope_per_node, 0.01, rel_tol=1e-9)
    assert g.max_rel_residual < 1e-9


def test_quadratic_is_not() -> None:
    g = growth(SIZES, [1e-4 * n * n for n in SIZES])
    assert g is not None and not g.at_most_linear
    assert math.isclose(g.exponent, 2.0, rel_tol=1e-9)


def test_too_few_points_give_no_fit() -> None:
    assert growth([64], [1.0]) is None
    assert growth([64, 64], [1.0, 2.0]) is None
    assert growth([64, 256], [0.0, 1.0]) is None  # a zero has no logarithm: one usable point


def test_first_nodes_keeps_whole_units_and_the_model_mix() -> None:
    big = load_cluster(REPO / "hack" / "clusters" / "superpod-16k.yaml")
    assert sum(g.count for g in big.groups) == 2048
    sub = first_nodes(big, 64)
    names = [n for n, _ in sub.expand()]
    assert len(names) == 64
    assert {g.labels["topodra.io/scalable-unit"] for g in sub.groups} == {"su00", "su01"}
    assert len({g.profile for g in first_nodes(big, 256).groups}) == 4
    cut = first_nodes(big, 20)
    assert [g.count for g in cut.groups] == [16, 4]


def test_first_nodes_refuses_more_than_the_file_has() -> None:
    big = load_cluster(REPO / "hack" / "clusters" / "superpod-16k.yaml")
    with pytest.raises(ValueError, match="cannot take 4096 nodes of a cluster of 2048"):
        first_nodes(big, 4096)


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, why in ((["--rows", "simulate,nope"], "unknown rows ['nope']"),
                      (["--sizes", "64,x"], "--sizes must be integers")):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2  # argparse's usage error, not a run that ended
        assert why in capsys.readouterr().err
    assert parse_args(["--sizes", "256,64"]).size_list == [64, 256]


def test_scheduler_row_caps_the_pods_and_pairs_the_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_scheduler's bookkeeping, with the cluster part (run_variants) replaced by canned results."""
    from bench.scale import main as scale
    from bench.schedule_throughput import main as st

    seen: dict[str, object] = {}
    rates = {("stripped", False): 20.0, ("full", False): 18.0, ("full", True): 16.0, ("stripped", True): 15.0}

    def fake(args: object, variants: list[tuple[str, bool]], devices: object) -> list[st.Result]:
        seen["args"], seen["variants"] = args, list(variants)
        pods = args.one_gpu_pods + args.eight_gpu_pods  # type: ignore[attr-defined]
        return [st.Result(scenario=sc, scorer=on, pods=pods, scheduled=pods, pods_per_s=rates[(sc, on)],
                          pods_per_s_overall=rates[(sc, on)], seconds=1.0, mean_attempt_ms=1.0,
                          scorer_latency={"p99_ms": 2.0} if on else {}, samples=[], gpu_attributes=4,
                          cpu_ms_per_pod={"scheduler": 100.0 / rates[(sc, on)]}) for sc, on in variants]

    monkeypatch.setattr(st, "run_variants", fake)
    monkeypatch.setattr(st, "template_devices", lambda: [])
    out = scale.run_scheduler(2048, seed=1, qps=500, max_pods=512)
    args = seen["args"]
    assert (args.nodes, args.one_gpu_pods, args.eight_gpu_pods) == (2048, 512, 64)  # type: ignore[attr-defined]
    assert seen["variants"] == list(scale.SCHEDULER_VARIANTS)
    assert out["pods"] == 576 and out["order"] == ["stripped", "full", "full_scorer", "stripped_scorer"]
    assert out["stripped_ratio"] == pytest.approx(18 / 20) and out["scorer_ratio"] == pytest.approx(16 / 18)
    assert out["cpu_stripped_ratio"] == pytest.approx(18 / 20) and out["cpu_scorer_ratio"] == pytest.approx(16 / 18)
    assert out["full_prioritize_p99_ms"] is None and out["full_scorer_prioritize_p99_ms"] == 2.0
    small = scale.run_scheduler(64, seed=1, qps=500)
    assert small["one_gpu_pods"] == 64 and small["eight_gpu_pods"] == 8
