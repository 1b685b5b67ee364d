"""The telemetry rules (deploy/prometheus/topodra-rules.yaml) under real promtool, and the chart shipping them.

promtool is Debian's pinned Prometheus 2.42.0 package (hack/prometheus-bin). The rule tests
(tests/unit/deploy/promtool/topodra-rules.test.yaml) feed series named as the plugin exports them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml
from testkit.paths import REPO
from testkit.prometheus import bin_dir

RULES = REPO / "deploy" / "prometheus" / "topodra-rules.yaml"
TESTS = REPO / "tests" / "unit" / "deploy" / "promtool" / "topodra-rules.test.yaml"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(bin_dir() / "promtool"), *args], capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip


def test_rules_parse_and_pass_their_promtool_tests() -> None:
    r = promtool("check", "rules", str(RULES))
    assert r.returncode == 0 and "SUCCESS: 7 rules found" in r.stdout, r.stdout + r.stderr
    r = promtool("test", "rules", str(TESTS))
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_promtool_rule_tests_fail_when_a_rule_is_broken(tmp_path: Path) -> None:
    """The tests can fail: the starved alert without its activity bound fires for the busy GPU too."""
    broken = tmp_path / "deploy" / "prometheus" / "topodra-rules.yaml"
    broken.parent.mkdir(parents=True)
    broken.write_text(RULES.read_text().replace("{dra_claim_uid!=\"\"} < 0.5)", "{dra_claim_uid!=\"\"} < 1.0)"))
    tests = tmp_path / "tests" / "unit" / "deploy" / "promtool" / "t.yaml"
    tests.parent.mkdir(parents=True)
    tests.write_text(TESTS.read_text())
    r = promtool("test", "rules", str(tests))
    assert r.returncode != 0 and "TopodraGpuStarved" in r.stdout + r.stderr


def test_the_chart_ships_this_file() -> None:
    """The chart's rules (PrometheusRule or ConfigMap, templates/prometheus-rules.yaml) are this very file."""
    linked = REPO / "deploy" / "helm" / "topodra" / "files" / "prometheus-rules.yaml"
    assert linked.resolve() == RULES.resolve()
    template = (REPO / "deploy" / "helm" / "topodra" / "templates" / "prometheus-rules.yaml").read_text()
    assert template.count('.Files.Get "files/prometheus-rules.yaml"') == 2
    assert 'Capabilities.APIVersions.Has "monitoring.coreos.com/v1/PrometheusRule"' in template
    groups = yaml.safe_load(RULES.read_text())["groups"]
    assert {r.get("alert") for g in groups for r in g["rules"]} >= {"TopodraClaimIdle", "TopodraGpuStarved",
                                                                     "TopodraXidBurst"}
