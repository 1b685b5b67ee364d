"""Benchmarks run on a private cluster instance (own state, own free ports, own lock), so they never
hold the shared fixed-port cluster's lock that every test session waits for.

Split by tier; the rest: tests/cluster/test_placement_private_cluster_cluster.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from testkit import cluster as localcluster


def test_private_ports_are_free_distinct_and_off_the_fixed_ones() -> None:
    fixed = {p for ports in localcluster.PORTS.values() for p in ports}
    for _ in range(20):
        ports = localcluster.Ports.free()
        got = list(ports.by_component().items())
        control = [p for comp, ps in got if comp != "kubelet" for p in ps]
        assert len(set(control)) == 5
        lo, hi = localcluster.FREE_PORT_RANGE
        assert all(lo <= p < hi for p in control)
        assert not set(control) & fixed
        assert not ports.is_default
    assert localcluster.Ports().is_default


def test_private_cluster_refuses_a_node_before_starting_anything() -> None:
    lc = localcluster.Cluster.private("pytest-refuse")
    with pytest.raises(localcluster.ClusterError, match="cannot run a node"):
        lc.up(node=True, build=False)
    assert not lc.state_dir.exists()


@pytest.mark.parametrize("bad", ["", "../etc", "a b", "x/y"])
def test_instance_names_are_checked(bad: str) -> None:
    with pytest.raises(localcluster.ClusterError, match="instance name"):
        localcluster.instance_lock_file(bad)
    with pytest.raises(localcluster.ClusterError, match="instance name"):
        localcluster.Cluster.private(bad)


def test_attach_reads_the_recorded_ports(tmp_path: Path) -> None:
    ports = localcluster.Ports.free()
    lc = localcluster.Cluster(state_dir=tmp_path, ports=ports)
    lc._save({"pids": {}, "ports": {"etcd": ports.etcd, "etcd_peer": ports.etcd_peer, "apiserver": ports.apiserver,
                                    "controller_manager": ports.controller_manager, "scheduler": ports.scheduler}})
    assert localcluster.Cluster.attach(tmp_path).ports == ports
    assert localcluster.Cluster.attach(tmp_path / "none").ports.is_default


def test_instance_lock_is_not_the_shared_lock_and_excludes_a_second_holder() -> None:
    path = localcluster.instance_lock_file("pytest-lock")
    assert path != localcluster.CLUSTER_LOCK_FILE
    with localcluster.cluster_lock(5, path):
        t0 = time.monotonic()
        # flock locks belong to the open file description: a second open waits like another process
        with pytest.raises(localcluster.ClusterError, match="still held"), localcluster.cluster_lock(1, path):
            pass
        assert time.monotonic() - t0 >= 0.9


def test_bench_retries_a_private_start_on_new_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.placement import main as pb

    tried: list[localcluster.Ports] = []

    def up(self: localcluster.Cluster, **_kw: object) -> None:
        tried.append(self.ports)
        if len(tried) < 3:
            raise localcluster.ClusterError("etcd exited during startup")

    monkeypatch.setattr(localcluster.Cluster, "up", up)
    lc = pb.start_private_cluster(attempts=3)
    assert len(tried) == 3 and lc.ports == tried[-1] and len(set(tried)) == 3
    tried.clear()
    with pytest.raises(localcluster.ClusterError):
        pb.start_private_cluster(attempts=2)
    assert len(tried) == 2
