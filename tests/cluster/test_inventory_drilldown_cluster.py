"""``topodra inventory --domain/--node`` and the picture by domain on the real local cluster.

``hack/clusters/mixed-8.yaml`` (8 kubelet-less nodes of four profiles, no fabric labels) is published with
``topodra simulate``'s code, so the nodes fall back to their name pools (``sim-h200``, ``sim-h100``, ...);
one Node then gets a Topograph tier label, which puts it in that domain instead. The CLI runs as a
subprocess: each filter keeps exactly the nodes worked out here from the names and labels, and a name
that selects nothing exits 2 with a suggestion and writes nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from testkit.handle import ClusterHandle
from testkit.paths import REPO

from topodra.apipaths import node_path
from topodra.simulate import Simulation, load_cluster

pytestmark = pytest.mark.cluster


def inventory(cluster: ClusterHandle, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "topodra.cli", "inventory", "--kubeconfig", cluster.kubeconfig,
                           *args], capture_output=True, text=True, timeout=120, check=False)


def nodes_of(r: subprocess.CompletedProcess[str]) -> list[str]:
    assert r.returncode == 0, r.stderr
    return [n["name"] for n in json.loads(r.stdout)["nodes"]]


def png_size(path: Path) -> tuple[int, int]:
    import matplotlib.image as mpimg

    img = mpimg.imread(path)
    return int(img.shape[1]), int(img.shape[0])


def test_domain_and_node_filters_and_bad_names(cluster: ClusterHandle, tmp_path: Path) -> None:
    sim = Simulation(cluster.kube, load_cluster(REPO / "hack/clusters/mixed-8.yaml"))
    sim.setup()
    try:
        sim.reconcile_all()
        cluster.kube.merge_patch(node_path("sim-h100-1"),
                                 {"metadata": {"labels": {"fabric.topograph.run/tier-1": "su-t"}}})

        assert nodes_of(inventory(cluster, "-o", "json", "--domain", "sim-h200")) == ["sim-h200-0", "sim-h200-1"]
        assert nodes_of(inventory(cluster, "-o", "json", "--domain", "su-t")) == ["sim-h100-1"]
        # With a tier label the node left its name pool.
        assert nodes_of(inventory(cluster, "-o", "json", "--domain", "sim-h100")) == ["sim-h100-0"]
        one = inventory(cluster, "-o", "json", "--node", "sim-a100-1", "--png", str(tmp_path / "node.png"))
        assert nodes_of(one) == ["sim-a100-1"]
        data = json.loads(one.stdout)
        assert [(m["model"], m["total"]) for m in data["models"]] == [("A100-SXM4-80GB", 8)]
        node_w, node_h = png_size(tmp_path / "node.png")  # the per-node picture of one node: small
        assert node_h < 400, (node_w, node_h)
        assert json.loads(inventory(cluster, "-o", "json", "--domain", "su-t").stdout)["nodes"][0]["fabric"] == \
            {"topodra.io/scalable-unit": "su-t"}

        table = inventory(cluster, "--domain", "sim-h100nvl")
        assert table.returncode == 0, table.stderr
        assert "sim-h100nvl-0" in table.stdout and "sim-h200-0" not in table.stdout

        dom = inventory(cluster, "--domain", "sim-h200", "--picture", "domains", "--png", str(tmp_path / "d.png"))
        assert dom.returncode == 0, dom.stderr
        assert png_size(tmp_path / "d.png")[1] < 600  # one bar: sim-h200 / H200

        for args, hints in ((("--domain", "sim-h20"), ("no fabric domain 'sim-h20'", "did you mean", "sim-h200")),
                            (("--node", "sim-h100-7"), ("no node 'sim-h100-7'", "did you mean", "sim-h100-0")),
                            (("--domain", "su-t", "--node", "sim-h100-0"),
                             ("no node 'sim-h100-0' in fabric domain 'su-t'", "sim-h100-1"))):
            bad = inventory(cluster, *args, "-o", "json", "--png", str(tmp_path / "bad.png"))
            assert bad.returncode == 2 and not bad.stdout and all(h in bad.stderr for h in hints), (args, bad)
            assert not (tmp_path / "bad.png").exists()
        serve = inventory(cluster, "--serve", "127.0.0.1:1", "--domain", "sim-h200")
        assert serve.returncode == 2 and "--serve" in serve.stderr, serve
    finally:
        sim.delete()
