"""``bench/run NAME`` (``python -m bench NAME``): every bench folder has an entry, and bad input is refused."""

from __future__ import annotations

import subprocess

import pytest
from bench import __main__ as entry
from bench.paths import REPO


def test_every_bench_folder_has_an_entry() -> None:
    folders = {p.parent.name for p in (REPO / "bench").glob("*/main.py")}
    # placement_plots and the telemetry_* entries are more entries of the placement and telemetry folders
    assert folders == set(entry.BENCHES) - {"placement_plots", "telemetry_flags", "telemetry_pairs"}


def test_help_lists_every_bench_and_an_unknown_name_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert entry.main(["--help"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()[2:] if line.strip()}
    assert listed == set(entry.BENCHES)
    assert entry.main(["no-such-bench"]) == 2
    assert "no bench 'no-such-bench'" in capsys.readouterr().err
    assert entry.main([]) == 2


def test_dashes_name_the_same_bench(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        entry.main(["schedule-throughput", "--help"])
    assert e.value.code == 0 and "bench/run schedule_throughput" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["placement", "simulate"])
def test_a_label_that_is_no_file_name_is_refused_before_anything_runs(name: str) -> None:
    with pytest.raises(SystemExit) as e:
        entry.main([name, "--label", "../elsewhere"])
    assert e.value.code == 2


def test_the_script_runs_from_any_directory() -> None:
    out = subprocess.run([str(REPO / "bench" / "run"), "--help"], cwd="/", capture_output=True, text=True, check=True)
    assert "schedule_throughput" in out.stdout
