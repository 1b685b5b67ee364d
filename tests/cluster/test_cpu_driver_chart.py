"""The chart's cpuDriver values: what each dra-driver-cpu release sets on the plugin and the controller.

In the cluster tier because it runs the pinned helm binary (as test_helm_chart.py, whose helpers it uses); the
policy it installs is proven on the real apiserver in test_numa_cpu_cluster.py.
"""

from __future__ import annotations

import argparse

import pytest
from test_helm_chart import CHART, container, env_of, helm, render

from topodra.controller import main as controller_main

pytestmark = pytest.mark.cluster


def controller_args(objs: list[dict[str, object]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    controller_main.configure(parser)
    args = container(objs, "Deployment")["args"]
    return parser.parse_args([a.replace("$(POD_NAMESPACE)", "ns").replace("$(POD_NAME)", "p") for a in args])


def kinds(objs: list[dict[str, object]]) -> set[object]:
    return {o["kind"] for o in objs}


def test_default_installs_no_cpu_alignment() -> None:
    objs = render()
    args = controller_args(objs)
    assert (args.cpu_numa_attribute, args.allow_unaligned_cpus) == ("resource.kubernetes.io/numaNode", False)
    assert "TOPODRA_NUMA_ALIAS" not in env_of(container(objs, "DaemonSet"))
    assert not kinds(objs) & {"MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"}


def test_v020_aliases_the_numa_attribute_on_plugin_and_controller() -> None:
    objs = render("cpuDriver.release=v0.2.0", "cpuDriver.allowUnaligned=true")
    assert env_of(container(objs, "DaemonSet"))["TOPODRA_NUMA_ALIAS"]["value"] == "dra.net/numaNode"
    args = controller_args(objs)
    assert (args.cpu_numa_attribute, args.allow_unaligned_cpus) == ("dra.net/numaNode", True)
    assert {"MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"} <= kinds(objs)


def test_main_keeps_the_standard_attribute_and_installs_the_policy() -> None:
    objs = render("cpuDriver.release=main")
    assert "TOPODRA_NUMA_ALIAS" not in env_of(container(objs, "DaemonSet"))
    assert controller_args(objs).cpu_numa_attribute == "resource.kubernetes.io/numaNode"
    assert {"MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"} <= kinds(objs)


def test_an_unknown_release_is_refused_by_the_schema() -> None:
    r = helm("template", "t", str(CHART), "--set", "cpuDriver.release=v0.3.0")
    assert r.returncode != 0 and "cpuDriver" in r.stderr, r.stderr
