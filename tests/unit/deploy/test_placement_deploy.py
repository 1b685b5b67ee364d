"""deploy/placement agrees with the code: the scorer's args parse, ports line up, RBAC only reads,
and both scheduler configs carry the same prioritize-only, ignorable extender as the test harness."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml
from testkit import cluster as localcluster
from testkit.paths import REPO

from topodra.placement import main as scorer_main

DEPLOY = REPO / "deploy" / "placement"
Obj = dict[str, Any]


def docs(name: str) -> list[Obj]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def kind(objs: list[Obj], k: str, name: str | None = None) -> Obj:
    found = [o for o in objs if o["kind"] == k and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, (k, name, len(found))
    return found[0]


def test_deployment_args_parse_and_ports_line_up() -> None:
    objs = docs("deployment.yaml")
    dep, svc = kind(objs, "Deployment"), kind(objs, "Service")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["topodra", "placement-scorer"]
    p = argparse.ArgumentParser()
    scorer_main.configure(p)
    args = p.parse_args(c["args"])
    _host, port = scorer_main.parse_listen(args.listen)
    assert port < 32768  # below the ephemeral range
    assert {x["containerPort"] for x in c["ports"]} == {port}
    assert [x["port"] for x in svc["spec"]["ports"]] == [port]
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    sc = dep["spec"]["template"]["spec"]["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "topodra-placement-scorer"


def test_rbac_only_lists_and_watches() -> None:
    objs = docs("rbac.yaml")
    role = kind(objs, "ClusterRole", "topodra-placement-scorer")
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    dra = ("resourceslices", "resourceclaims", "resourceclaimtemplates", "deviceclasses", "devicetaintrules")
    assert granted == {("resource.k8s.io", r) for r in dra} | {("", "nodes"), ("", "pods")}
    assert all(sorted(rule["verbs"]) == ["list", "watch"] for rule in role["rules"])
    binding = kind(objs, "ClusterRoleBinding", "topodra-placement-scorer")
    (subject,) = binding["subjects"]
    sa = kind(objs, "ServiceAccount")
    assert (subject["name"], subject["namespace"]) == (sa["metadata"]["name"], sa["metadata"]["namespace"])


def test_scheduler_configs_use_the_harness_extender_stanza() -> None:
    snippet = yaml.safe_load((DEPLOY / "scheduler-config.yaml").read_text())
    cm = kind(docs("second-scheduler.yaml"), "ConfigMap")
    second = yaml.safe_load(cm["data"]["config.yaml"])
    for cfg in (snippet, second):
        assert cfg["apiVersion"] == localcluster.SCHEDULER_CONFIG_API
        (ext,) = cfg["extenders"]
        expected = localcluster.extender_stanza(ext["urlPrefix"])
        assert ext == expected
        assert "filterVerb" not in ext and "bindVerb" not in ext
        assert ext["urlPrefix"].endswith(":9417")
    assert [p["schedulerName"] for p in second["profiles"]] == ["topodra-scheduler"]


def test_docs_name_the_shipped_files() -> None:
    text = (REPO / "docs" / "placement.md").read_text()
    for f in sorted(Path(DEPLOY).glob("*.yaml")):
        assert f"deploy/placement/{f.name}" in text, f.name
