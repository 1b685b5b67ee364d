"""The pure parts of ``bench/prepare --compare-with``: argument templates, block order, ratios, table.

The measurement itself needs the real cluster and another plugin binary; it is run by hand
(bench/README.md), never timed in tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bench.prepare import common, compare, main, other

VALUES = {"node": "n1", "kubeconfig": "/k/admin.conf", "plugins_dir": "/tmp/my plugins", "registry_dir": "/r",
          "cdi_root": "/c", "state_dir": "/s", "metrics_port": "20001", "health_port": "20002"}


def test_template_fills_each_word_and_keeps_paths_with_spaces_whole() -> None:
    argv = other.expand_template("--node-name={node} --dir={plugins_dir} --addr=127.0.0.1:{metrics_port} -v 5", VALUES)
    assert argv == ["--node-name=n1", "--dir=/tmp/my plugins", "--addr=127.0.0.1:20001", "-v", "5"]


def test_template_quotes_and_doubled_braces_are_literal() -> None:
    argv = other.expand_template("'--json={{\"a\": 1}}' \"--x={cdi_root}/y z\"", VALUES)
    assert argv == ['--json={"a": 1}', "--x=/c/y z"]


@pytest.mark.parametrize("template, needle", [
    ("--node={nodename}", "{nodename}"),      # unknown placeholder
    ("--x={}", "{}"),                        # positional field
    ("--x={node.upper}", "{node.upper}"),    # attribute access
    ("--x={node!r}", "{node!r}"),            # conversion
    ("--x={node:>9}", "{node:>9}"),          # format spec
])
def test_template_rejects_anything_but_known_bare_placeholders(template: str, needle: str) -> None:
    with pytest.raises(common.BenchError) as e:
        other.expand_template(template, VALUES)
    assert needle in str(e.value) and "{kubeconfig}" in str(e.value)  # says what is allowed


@pytest.mark.parametrize("template", ["--x='unterminated", "--x={node", "--x=node}"])
def test_template_syntax_errors_are_bench_errors(template: str) -> None:
    with pytest.raises(common.BenchError, match="--compare-args"):
        other.expand_template(template, VALUES)


def test_the_example_driver_default_uses_every_local_path_and_lifts_the_rate_limit() -> None:
    argv = other.expand_template(other.EXAMPLE_ARGS, dict(VALUES, plugins_dir="/p"))
    assert {"--node-name=n1", "--kubeconfig=/k/admin.conf", "--kubelet-plugins-directory-path=/p",
            "--kubelet-registrar-directory-path=/r", "--cdi-root=/c", "--num-devices=8"} <= set(argv)
    qps = [float(a.split("=")[1]) for a in argv if a.startswith("--kube-api-qps=")]
    assert qps and qps[0] >= 1000


def test_plugin_values_cover_exactly_the_documented_placeholders(tmp_path: Path) -> None:
    plugin = other.OtherPlugin(Path("/bin/true"), " ".join(f"{{{k}}}" for k in other.PLACEHOLDERS),
                               tmp_path / "kubeconfig", tmp_path / "root", tmp_path / "log", {})
    assert len(plugin.argv) == 1 + len(other.PLACEHOLDERS)
    assert plugin.argv[1] == other.OTHER_NODE
    assert all((tmp_path / "root" / d).is_dir() for d in ("plugins", "registry", "cdi", "state"))


def test_blocks_alternate_which_side_goes_first() -> None:
    order = compare.block_order(5)
    assert order == [("a", "b"), ("b", "a"), ("a", "b"), ("b", "a"), ("a", "b")]
    flat = [k for pair in order for k in pair]
    assert flat.count("a") == flat.count("b") == 5
    assert all(flat[i] != flat[i + 1] or i % 2 == 1 for i in range(len(flat) - 1))  # a repeat only across rounds


@pytest.mark.parametrize("a, b, expected", [(10.0, 6.25, 1.6), (3.0, 6.0, 0.5), (1.0, 0.0, None),
                                            (None, 1.0, None), (1.0, None, None), (float("nan"), 1.0, None)])
def test_ratio(a: float | None, b: float | None, expected: float | None) -> None:
    assert compare.ratio(a, b) == expected


def result(scenarios: dict[str, tuple[float, float, float, float]], peak: float) -> dict[str, Any]:
    return {"scenarios": [{"name": n, "prepare_ms": {"median": pm, "p99": pp},
                           "unprepare_ms": {"median": um, "p99": up}} for n, (pm, pp, um, up) in scenarios.items()],
            "memory": {"peak_VmHWM_MiB": peak}}


def test_compare_rows_pair_scenarios_by_name_and_divide_a_by_b() -> None:
    a = result({"seq": (10.0, 20.0, 3.0, 4.0), "conc": (40.0, 90.0, 30.0, 60.0)}, 62.0)
    b = result({"conc": (20.0, 30.0, 30.0, 80.0), "seq": (6.25, 12.5, 2.0, 5.0)}, 48.0)
    rows = compare.compare_rows(a, b)
    by = {(r["scenario"], r["metric"]): (r["a"], r["b"], r["ratio"]) for r in rows}
    assert by[("seq", "prepare median ms")] == (10.0, 6.25, 1.6)
    assert by[("seq", "prepare p99 ms")] == (20.0, 12.5, 1.6)
    assert by[("seq", "unprepare median ms")] == (3.0, 2.0, 1.5)
    assert by[("conc", "prepare p99 ms")] == (90.0, 30.0, 3.0)
    assert by[("conc", "unprepare p99 ms")] == (60.0, 80.0, 0.75)
    assert by[("whole run", "peak RSS (VmHWM) MiB")] == (62.0, 48.0, 1.29)
    assert len(rows) == 2 * 4 + 1
    assert [r["scenario"] for r in rows[:4]] == ["seq"] * 4  # a's order


def test_compare_rows_refuse_a_scenario_only_one_side_ran() -> None:
    with pytest.raises(common.BenchError, match="'conc'"):
        compare.compare_rows(result({"seq": (1, 1, 1, 1), "conc": (1, 1, 1, 1)}, 1), result({"seq": (1, 1, 1, 1)}, 1))


def test_table_shows_labels_values_and_ratios() -> None:
    rows = compare.compare_rows(result({"sequential 1-GPU exclusive": (10.0, 20.0, 3.0, 0.0)}, 62.0),
                           result({"sequential 1-GPU exclusive": (6.25, 12.5, 2.0, 0.0)}, 48.0))
    text = compare.format_comparison(rows, "topodra", "dra-example-kubeletplugin")
    lines = text.splitlines()
    assert "topodra" in lines[0] and "dra-example-" in lines[0] and "ratio" in lines[0]
    assert len(lines) == 2 + len(rows)
    seq_median = next(line for line in lines if "prepare median ms" in line and "unprepare" not in line)
    assert seq_median.split()[-3:] == ["10.00", "6.25", "1.60"]
    assert lines[-1].split()[-3:] == ["62.00", "48.00", "1.29"]
    assert next(line for line in lines if "unprepare p99" in line).split()[-1] == "-"  # b is 0: no ratio


def refused(argv: list[str], why: str, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's usage error (exit code 2) with ``why`` on stderr."""
    with pytest.raises(SystemExit) as e:
        main.parse_args(argv)
    assert e.value.code == 2
    assert why in capsys.readouterr().err


def test_default_run_is_unchanged_and_compare_flags_are_checked(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main.parse_args([]).compare_with is None
    not_exec = tmp_path / "plugin"
    not_exec.write_text("")
    refused(["--compare-with", str(not_exec)], "not an executable file", capsys)
    refused(["--compare-with", str(tmp_path / "missing")], "not an executable file", capsys)
    not_exec.chmod(0o755)
    # "=": a value starting with "--" is otherwise taken for an option (the old test passed on that error)
    refused(["--compare-with", str(not_exec), "--compare-args=--n={nod}"], "{nod}", capsys)
    refused(["--compare-with", str(not_exec), "--rounds", "0"], "--rounds must be at least 1", capsys)
    args = main.parse_args(["--compare-with", str(not_exec), "--rounds", "4"])
    assert args.compare_with == not_exec.resolve() and args.rounds == 4 and args.compare_args == other.EXAMPLE_ARGS


def test_lock_held_runs_only_while_someone_holds_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl
    import os

    lock = tmp_path / "cluster.lock"
    monkeypatch.setattr(main, "LOCK_FILE", str(lock))
    with pytest.raises(common.BenchError, match="nobody holds"), main.lock_held_by_caller():
        pass
    fd = os.open(lock, os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        ran = []
        with main.lock_held_by_caller():
            ran.append(True)
        assert ran == [True]
    finally:
        os.close(fd)
