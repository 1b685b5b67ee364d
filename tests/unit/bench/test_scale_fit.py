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


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--rows", "simulate,nope"])
    with pytest.raises(SystemExit):
        parse_args(["--sizes", "64,x"])
    assert parse_args(["--sizes", "256,64"]).size_list == [64, 256]
