"""The reliability campaign (bench/reliability) at a reduced size, plus the cleanup loop.

Each campaign counts what it lost (a broken invariant, a failed retry, a changed
file); the target is zero.  The full sizes and their numbers: docs/reliability.md.

Split by tier; the rest: tests/node/test_reliability_node.py.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from bench.reliability import cleanup as reliability_cleanup
from bench.reliability import common as rcom
from bench.reliability import crash as reliability_crash
from bench.reliability import fuzz as reliability_fuzz
from bench.reliability import main as reliability_main
from bench.reliability import process as reliability_process

from topodra.claims import ClaimRef
from topodra.plugin.cleanup import CleanupLoop, cleanup_once
from topodra.plugin.server import ClaimFetcher
from topodra.state import DeviceState


def test_crash_points_lose_nothing(tmp_path: Path) -> None:
    out = reliability_crash.run(80, seed=7, root=tmp_path)
    assert out["lost"] == []
    assert out["crashed"] >= 40  # most runs really die mid-operation
    assert set(out["by_point"]) == {*reliability_crash.PREPARE_POINTS, *reliability_crash.UNPREPARE_POINTS,
                                    reliability_crash.EXTERNAL_KILL}
    assert out["prepares_retried"] > 0 and out["unprepares_retried"] > 0


def test_kill_9_of_a_real_plugin_process_over_its_socket(tmp_path: Path) -> None:
    out = reliability_process.run(4, seed=11, root=tmp_path)
    assert out["lost"] == [] and out["crashed"] == 4


def test_crash_checker_catches_a_leaked_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The campaign can fail: without the orphan sweep, specs of crashed prepares leak and are reported."""
    monkeypatch.setattr(DeviceState, "_remove_orphans", lambda self, data: [])
    out = reliability_crash.run(40, seed=7, root=tmp_path)
    assert any("CDI spec without a prepared claim" in x for x in out["lost"]), out["lost"][:3]


def test_fuzzed_requests_get_clear_errors_and_change_nothing(tmp_path: Path) -> None:
    out = reliability_fuzz.run(250, big_calls=1, seed=3, root=tmp_path)
    assert out["lost"] == []
    assert out["by_kind"]["10000-claims"] == 1 and out["by_kind"]["random-bytes"] == 50
    assert out["requests"] == 251


def test_fuzz_checker_catches_a_claim_without_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fuzz checks can fail: if malformed names were let through, unprepare would answer them as done."""
    monkeypatch.setattr("topodra.plugin.server.ref_problem", lambda *a: None)
    out = reliability_fuzz.run(60, big_calls=0, seed=3, root=tmp_path)
    assert any("got no error" in x for x in out["lost"]), out["lost"][:3]


def test_path_traversal_in_uid_cannot_name_a_file(tmp_path: Path) -> None:
    from topodra import cdi

    for uid in ("../x", "a/b", "..", ".", "", "x\0y"):
        with pytest.raises(ValueError, match="cannot name a CDI spec file"):
            cdi.spec_path(tmp_path, rcom.DRIVER, uid)


# ---------------------------------------------------------------- claims deleted while the plugin was down


def _prepared_node(tmp_path: Path) -> tuple[rcom.Node, dict[tuple[str, str], Any], list[ClaimRef]]:
    node = rcom.Node(tmp_path).setup()
    api: dict[tuple[str, str], Any] = {}
    refs = []
    for k, devs in enumerate([["gpu-0"], ["gpu-1", "nic-1"], ["gpu-2"], ["gpu-3"]]):
        uid = f"c1ea0000-0000-4000-8000-{k:012d}"
        api[("ns", f"c{k}")] = rcom.claim_obj("ns", f"c{k}", uid, devs)
        refs.append(ClaimRef("ns", uid, f"c{k}"))
    st = node.state()
    out = st.prepare(ClaimFetcher(lambda ns, n: api.get((ns, n)), rcom.DRIVER, rcom.NODE).fetch(refs))
    assert all(not r.error for r in out.values())
    return node, api, refs


def test_cleanup_unprepares_claims_deleted_or_replaced_while_down(tmp_path: Path) -> None:
    node, api, refs = _prepared_node(tmp_path)
    # The plugin is down: c0 deleted, c1 deleted and re-created (new UID), c2 unreadable, c3 still there.
    del api[("ns", "c0")]
    api[("ns", "c1")] = rcom.claim_obj("ns", "c1", "c1ea0000-0000-4000-8000-0000000000ff", ["gpu-1"])
    st = node.state()
    reads: list[bool] = []

    def getter(ns: str, name: str) -> Any:
        reads.append(st._lock.locked())  # no API call while the prepare lock is held
        if name == "c2":
            raise ConnectionError("apiserver unreachable")
        return api.get((ns, name))

    report = cleanup_once(st, getter)
    assert report.unprepared == sorted([refs[0].uid, refs[1].uid])
    assert set(report.unreadable) == {refs[2].uid} and report.failed == {}
    assert set(node.checkpoint().claims) == {refs[2].uid, refs[3].uid}
    assert reads and not any(reads)
    assert rcom.violations(node) == []
    assert cleanup_once(st, getter).unprepared == []  # idempotent


def test_cleanup_loop_runs_at_start_and_periodically(tmp_path: Path) -> None:
    node, api, refs = _prepared_node(tmp_path)
    del api[("ns", "c0")]
    st = node.state()
    loop = CleanupLoop(st, lambda ns, n: api.get((ns, n)), interval=0.05)
    loop.start()
    try:
        deadline = time.monotonic() + 10
        while refs[0].uid in node.checkpoint().claims and time.monotonic() < deadline:
            time.sleep(0.01)
        assert refs[0].uid not in node.checkpoint().claims  # the pass at start
        del api[("ns", "c3")]  # deleted while running, and the kubelet never unprepared it
        while refs[3].uid in node.checkpoint().claims and time.monotonic() < deadline:
            time.sleep(0.01)
        assert set(node.checkpoint().claims) == {refs[1].uid, refs[2].uid}
        # `passes` counts a pass once it returned; its checkpoint write is seen just before that.
        while loop.passes < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.passes >= 2
    finally:
        loop.stop()
    assert not any(t.name == "claim-cleanup" for t in threading.enumerate())


def test_cleanup_campaign(tmp_path: Path) -> None:
    out = reliability_cleanup.run(20, seed=2, root=tmp_path)
    assert out["lost"] == [] and all(n > 0 for n in out["claims"].values())


def test_entry_point_writes_json_and_fails_on_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    args = ["--only", "crash,cleanup", "--crash-runs", "5", "--cleanup-rounds", "3", "--workdir", str(tmp_path),
            "--out", str(out)]
    assert reliability_main.main(args) == 0
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"crash", "cleanup"} and doc["results"]["crash"]["runs"] == 5
    monkeypatch.setattr(DeviceState, "_remove_orphans", lambda self, data: [])
    assert reliability_main.main([*args[:4], "--crash-runs", "30", *args[6:]]) == 1
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        reliability_main.parse(["--only", "crash,nothing"])
    assert e.value.code == 2
    assert "--only: unknown parts ['nothing']" in capsys.readouterr().err
