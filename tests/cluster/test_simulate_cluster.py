"""Simulated clusters: every mock profile published through the real apiserver with the documented topology.

Split by tier; the rest: tests/unit/slices/test_simulate.py.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import pytest
from testkit.handle import ClusterHandle
from testkit.paths import REPO

from topodra.apipaths import slices_path
from topodra.simulate import SimulatedCluster, Simulation, load_cluster

DRIVER = "gpu.topodra.io"


def attr(dev: dict[str, Any], name: str) -> Any:
    v = dev.get("attributes", {}).get(name)
    return None if v is None else next(iter(v.values()))


def _devices_by_node(cluster: ClusterHandle, prefix: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for sl in cluster.kube.list(slices_path(), field_selector=f"spec.driver={DRIVER}"):
        if sl["spec"]["nodeName"].startswith(prefix):
            out[sl["spec"]["nodeName"]].extend(sl["spec"]["devices"])
    return out


@pytest.mark.cluster
def test_every_profile_publishes_documented_topology(cluster: ClusterHandle) -> None:
    spec = SimulatedCluster.model_validate({"groups": [
        {"namePrefix": "p-a100-", "count": 1, "profile": "dgx-a100-80gb"},
        {"namePrefix": "p-h100-", "count": 1, "profile": "dgx-h100"},
        {"namePrefix": "p-h200-", "count": 1, "profile": "dgx-h200"},
        {"namePrefix": "p-b200-", "count": 1, "profile": "hgx-b200"},
        {"namePrefix": "p-nvl-", "count": 1, "profile": "h100-nvl"},
        {"namePrefix": "p-l40s-", "count": 1, "profile": "l40s"},
        {"namePrefix": "p-l4-", "count": 1, "profile": "l4"},
        {"namePrefix": "p-gb200-", "count": 18, "profile": "gb200-nvl72", "nodesPerRack": 18},
    ]})
    sim = Simulation(cluster.kube, spec)
    sim.setup()
    assert sim.reconcile_all() == 25  # the apiserver accepted every pool
    by_node = _devices_by_node(cluster, "p-")
    assert len(by_node) == 25

    def gpus(node: str) -> list[dict[str, Any]]:
        return [d for d in by_node[node] if attr(d, "type") == "gpu"]

    def nics(node: str) -> list[dict[str, Any]]:
        return [d for d in by_node[node] if attr(d, "type") == "nic"]

    models = {n: {attr(d, "model") for d in gpus(n)} for n in by_node if not n.startswith("p-gb200")}
    assert models == {"p-a100-0": {"A100-SXM4-80GB"}, "p-h100-0": {"H100-SXM5-80GB"},
                      "p-h200-0": {"H200-SXM5-141GB"}, "p-b200-0": {"B200-SXM6-180GB"},
                      "p-nvl-0": {"H100-NVL-94GB"}, "p-l40s-0": {"L40S"}, "p-l4-0": {"L4"}}

    # HGX boards: one node-wide NVSwitch domain of 8.
    for n in ("p-a100-0", "p-h100-0", "p-h200-0", "p-b200-0"):
        assert len({attr(d, "nvlinkDomain") for d in gpus(n)}) == 1
        assert {attr(d, "nvlinkDomainSize") for d in gpus(n)} == {8}
    # H100 NVL: exactly 4 bridged pairs.
    nvl = Counter(attr(d, "nvlinkDomain") for d in gpus("p-nvl-0"))
    assert len(nvl) == 4 and set(nvl.values()) == {2}
    assert {attr(d, "nvlinkDomainSize") for d in gpus("p-nvl-0")} == {2}
    # No NVLink on L40S / L4.
    for n in ("p-l40s-0", "p-l4-0"):
        assert all(attr(d, "nvlinkDomain") is None for d in gpus(n))
    # DGX H100: GPU i pairs with NIC i on rail i; storage NICs are not published.
    h100 = sorted(gpus("p-h100-0"), key=lambda d: int(d["name"].split("-")[1]))
    assert [attr(d, "rail") for d in h100] == list(range(8))
    nic_by_rail = {attr(d, "rail"): d for d in nics("p-h100-0")}
    assert len(nics("p-h100-0")) == 8
    for k, g in enumerate(h100):
        assert attr(g, "nicName") == attr(nic_by_rail[k], "rdmaDevice")  # real DGX names skip storage NICs
        assert attr(g, "resource.kubernetes.io/pcieRoot") == attr(nic_by_rail[k], "resource.kubernetes.io/pcieRoot")
    # GB200 NVL72: 18 trays x 4 GPUs, all in one multi-node NVLink domain <clusterUUID>.<cliqueID>.
    rack = [d for n in by_node if n.startswith("p-gb200") for d in gpus(n)]
    assert len(rack) == 72
    domains = {attr(d, "nvlinkDomain") for d in rack}
    assert len(domains) == 1
    dom = domains.pop()
    assert "." in dom and dom.split(".")[1].isdigit()
    assert {attr(d, "nvlinkDomainSize") for d in rack} == {72}
    # Capacity is a quantity the apiserver accepted.
    assert {d["capacity"]["memory"]["value"] for d in gpus("p-h200-0")} == {"141Gi"} or \
        all(d["capacity"]["memory"]["value"].endswith(("Gi", "Mi")) for d in gpus("p-h200-0"))
    sim.delete()
    assert not _devices_by_node(cluster, "p-")


@pytest.mark.cluster
def test_enterprise_400_publishes_400_gpus(cluster: ClusterHandle) -> None:
    sim = Simulation(cluster.kube, load_cluster(REPO / "hack/clusters/enterprise-400.yaml"))
    sim.setup()
    sim.reconcile_all()
    by_node = _devices_by_node(cluster, "")
    ours = {n: d for n, d in by_node.items() if n.startswith(("a100-su", "h100-su", "h200-su"))}
    assert len(ours) == 50
    assert sum(1 for ds in ours.values() for d in ds if attr(d, "type") == "gpu") == 400
    # A second pass writes nothing: the simulation is a stable reconciler.
    assert sim.reconcile_all() == 0
    sim.delete()


@pytest.mark.cluster
def test_once_returns_only_when_every_simulated_node_is_schedulable(cluster: ClusterHandle, tmp_path: Any) -> None:
    """``topodra simulate --once`` (the CLI, as the demo and users run it) exits after kube-controller-manager
    lifted ``node.kubernetes.io/not-ready`` from every new Node (issue 31: it returned with them tainted)."""
    import subprocess
    import sys

    import yaml

    from topodra.apipaths import node_path

    prefix = f"once-{tmp_path.name[-6:].lower().replace('_', '-')}"
    spec = {"apiVersion": "topodra.io/v1alpha1", "kind": "SimulatedCluster",
            "groups": [{"namePrefix": f"{prefix}-", "count": 6, "profile": "dgx-h100"}]}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(spec))
    try:
        p = subprocess.run([sys.executable, "-m", "topodra.cli", "simulate", str(path), "--once",
                            "--kubeconfig", cluster.kubeconfig],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        ours = [n for n in cluster.kube.list(node_path()) if n["metadata"]["name"].startswith(prefix)]
        assert len(ours) == 6
        assert [n["metadata"]["name"] for n in ours
                if any(t.get("key") == "node.kubernetes.io/not-ready" for t in n["spec"].get("taints") or [])] == []
        assert "all 6 nodes schedulable" in p.stderr + p.stdout
    finally:
        subprocess.run([sys.executable, "-m", "topodra.cli", "simulate", str(path), "--delete",
                        "--kubeconfig", cluster.kubeconfig], capture_output=True, timeout=300)
