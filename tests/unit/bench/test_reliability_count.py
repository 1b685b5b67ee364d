"""The count column of ``bench/run reliability`` says what each part did, read from that part's own result.

It used to print a constant 4 for the API faults whenever the kube-apiserver part was present.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bench.reliability import main as reliability_main


def test_apifaults_count_is_the_scenarios_that_ran() -> None:
    done = ["deleted-while-down", "kube-apiserver/prepare", "kube-apiserver/publishing"]
    result: dict[str, Any] = {"kube-apiserver": {}, "scenarios": done, "lost": [], "seconds": 1.0}
    assert reliability_main.count_of("apifaults", result) == (3, "scenarios")
    done += ["etcd/prepare", "etcd/publishing"]
    assert reliability_main.count_of("apifaults", result) == (5, "scenarios")


def test_every_part_reports_its_own_unit() -> None:
    assert reliability_main.count_of("fuzz", {"requests": 250}) == (250, "requests")
    assert reliability_main.count_of("disk", {"rounds_per_target": 3, "targets": ["cdi", "state"]}) == (6, "rounds")
    assert reliability_main.count_of("cleanup", {"rounds": 20}) == (20, "rounds")
    assert reliability_main.count_of("process", {"runs": 4}) == (4, "runs")
    with pytest.raises(ValueError, match="unknown part"):
        reliability_main.count_of("nothing", {})


def test_the_printed_table_shows_a_real_run_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert reliability_main.main(["--only", "crash", "--crash-runs", "7", "--workdir", str(tmp_path),
                                  "--out", str(out)]) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("crash"))
    assert row[:4] == ["crash", "7", "runs", "0"]
