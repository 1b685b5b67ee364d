"""API faults on the real control plane (bench/reliability_apifaults.py at a reduced pause).

A claim deleted while the real plugin was down is unprepared by its cleanup pass at start. Then
kube-apiserver, then etcd, stopped (SIGSTOP) while the real plugin prepares and while it publishes:
per-claim errors within the kubelet's deadline, retries succeed after resuming, and the node's
ResourceSlices converge within 30 s with no duplicates.
"""

from __future__ import annotations

import pytest
from bench.reliability import apifaults as reliability_apifaults
from testkit.handle import ClusterHandle

pytestmark = pytest.mark.cluster


def test_apiserver_and_etcd_stopped_during_prepare_and_publishing(cluster: ClusterHandle) -> None:
    out = reliability_apifaults.run(cluster.lc, pause_s=5.0)
    assert out["lost"] == []
    assert out["scenarios"] == ["deleted-while-down", "kube-apiserver/prepare", "kube-apiserver/publishing",
                                "etcd/prepare", "etcd/publishing"]
    assert out["deleted_while_down"]["unprepared_after_start_s"] < 60
    for component in ("kube-apiserver", "etcd"):
        r = out[component]
        assert r["prepare_error"] and r["prepare_error_after_s"] < reliability_apifaults.KUBELET_DEADLINE
        assert r["slices_converged_after_resume_s"] is not None
