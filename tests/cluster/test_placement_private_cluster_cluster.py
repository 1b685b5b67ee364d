"""Benchmarks run on a private cluster instance (own state, own free ports, own lock), so they never
hold the shared fixed-port cluster's lock that every test session waits for.

Split by tier; the rest: tests/unit/testkit/test_placement_private_cluster.py.
"""

from __future__ import annotations

import json

import pytest
from testkit import cluster as localcluster
from testkit.handle import ClusterHandle


@pytest.mark.cluster
def test_private_cluster_runs_beside_the_shared_one_and_leaves_it_alone(cluster: ClusterHandle) -> None:
    """While the session's fixed-port cluster runs, a private instance comes up on its own ports,
    schedules on its own nodes, restarts its scheduler, and goes down without touching the shared one."""
    lc = localcluster.Cluster.private("pytest-private")
    with localcluster.cluster_lock(600, localcluster.instance_lock_file("pytest-private")):
        try:
            lc.up(build=False)
            meta = json.loads(lc.meta_path.read_text())
            assert meta["ports"]["apiserver"] == lc.ports.apiserver
            cfg = json.loads(lc.admin_kubeconfig.read_text())
            assert cfg["clusters"][0]["cluster"]["server"] == f"https://127.0.0.1:{lc.ports.apiserver}"
            lc.create_fake_nodes(["private-only-0"])
            names = {n["metadata"]["name"] for n in lc.kube().list("/api/v1/nodes")}
            assert names == {"private-only-0"}
            assert cluster.kube.get("/api/v1/nodes/private-only-0") is None
            lc.restart_scheduler(None, None)
            assert "scheduler_pending_pods" in lc.scheduler_metrics()
            pids = dict(lc.running())
            assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"}
        finally:
            lc.down(quiet=True)
    assert not lc.state_dir.exists()
    assert not any(localcluster.pid_alive(p) for p in pids.values())
    # the shared cluster still answers
    assert cluster.kube.request("GET", "/api/v1/namespaces/default")["metadata"]["name"] == "default"
