"""The telemetry benches' pure parts: the sign-test interval of the paired prepare runs, and the flag verdicts."""

from __future__ import annotations

import pytest
from bench.telemetry.flags import Claim, Figures, judge
from bench.telemetry.pairs import analyse, sign_test_rank


def test_sign_test_rank_keeps_at_least_95_percent() -> None:
    # 1 - 2 P(Bin(n, 1/2) < k): n=6 only the extremes reach 95%; n=10 the 2nd; n=20 the 6th (95.9%)
    k, coverage = sign_test_rank(6)
    assert k == 1 and coverage == pytest.approx(1 - 2 / 64)
    assert sign_test_rank(10)[0] == 2 and sign_test_rank(20)[0] == 6
    assert sign_test_rank(20)[1] == pytest.approx(0.9586, abs=1e-4)


def _run(on_a: list[float], on_b: list[float]) -> dict[str, object]:
    def side(vals: list[float]) -> dict[str, object]:
        return {"scenarios": [{"name": "s", "block_medians_ms": [{"prepare": v, "unprepare": v} for v in vals]}]}
    return {"a": side(on_a), "b": side(on_b)}


def test_pairs_cancel_a_side_bias_and_keep_an_effect() -> None:
    n = 10
    bias, effect = 5.0, 0.0
    base = [10.0 + (i % 3) * 0.1 for i in range(n)]
    # run 1: A samples; run 2: B samples; side A is 5 ms faster in both
    run1 = _run([b - bias + effect for b in base], base)
    run2 = _run([b - bias for b in base], [b + effect for b in base])
    (row, _u) = analyse(run1, run2)
    assert row["run1_sampling_on_side_a"]["unchanged"] is False  # the bias alone looks like an effect...
    assert row["unchanged"] is True and row["diff_median_ms"] == pytest.approx(0.0)  # ...and cancels
    slow = analyse(_run([b - bias + 3 for b in base], base), _run([b - bias for b in base], [b + 3 for b in base]))
    assert slow[0]["unchanged"] is False and slow[0]["diff_median_ms"] == pytest.approx(3.0)


def test_flag_verdicts_count_false_missed_and_late_flags() -> None:
    cs = [Claim("busy", "busy", lambda t: Figures(90, 0.5)),
          Claim("idle", "idle", lambda t: Figures(0, 0), ((100.0, 1e12),))]
    ok = judge(cs, [(1000.0, "idle", True)], minutes=30, idle_s=900, interval=10)
    assert (ok["false_flags"], ok["missed"], ok["late"]) == (0, 0, 0)
    bad = judge(cs, [(50.0, "busy", True), (1030.0, "idle", True)], minutes=30, idle_s=900, interval=10)
    assert (bad["false_flags"], bad["missed"], bad["late"]) == (1, 0, 1)  # 30 s after the idle time: over 20 s
    assert judge(cs, [], minutes=30, idle_s=900, interval=10)["missed"] == 1
