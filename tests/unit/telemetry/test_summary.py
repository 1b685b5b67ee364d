"""The per-device summary in a claim's status: the accounts, when to write, the data object and reading it back."""

from __future__ import annotations

import json

from topodra.telemetry.summary import (
    CHANGE,
    DATA_MAX_BYTES,
    FIRST,
    REFRESH,
    STATE,
    ClaimSummary,
    ClaimTrack,
    DeviceAccount,
    DeviceFigures,
    SummaryPolicy,
    device_data,
    next_slot,
    read_data,
    slot_of,
    summary_apply,
    write_reason,
    written_summaries,
)

P = SummaryPolicy(min_interval=300, max_interval=1800, delta=0.1, window=60)
T0 = 1_800_000_000.0


def s(at: float, act: float | None = 0.5, mem: float | None = 0.3, idle: bool = False, **more: float) -> ClaimSummary:
    return ClaimSummary(at, idle, at - 1000 if idle else None,
                        {"gpu-0": DeviceFigures(act, mem, more.get("alloc", 0.0), more.get("active", 0.0))})


def test_account_counts_held_and_active_seconds_and_keeps_a_window() -> None:
    a = DeviceAccount()
    a.add(T0, 0.9, 0.5, True, window=60, max_gap=30)
    a.add(T0 + 10, 0.8, 0.5, True, window=60, max_gap=30)
    a.add(T0 + 20, 0.0, 0.0, False, window=60, max_gap=30)  # below: held, not active
    a.add(T0 + 30, None, None, None, window=60, max_gap=30)  # unread: held, not active
    a.add(T0 + 130, 0.2, 0.1, True, window=60, max_gap=30)  # a 100 s stall counts as 30 s
    f = a.figures()
    assert (f.allocated_seconds, f.active_seconds) == (60.0, 40.0)
    assert (f.activity, f.memory) == (0.2, 0.1)  # only the last 60 s are in the window
    a.add(T0 + 140, 0.4, 0.3, True, window=60, max_gap=30)
    assert abs((a.figures().activity or 0) - 0.3) < 1e-9
    empty = DeviceAccount()
    empty.add(T0, None, None, None, window=60, max_gap=30)
    assert (empty.figures().activity, empty.figures().memory) == (None, None)


def test_write_reason_first_state_change_refresh() -> None:
    assert write_reason(P, None, s(T0)) == FIRST
    last = s(T0)
    assert write_reason(P, last, s(T0 + 300, act=0.0, mem=0.0, idle=True)) == STATE
    assert write_reason(P, last, s(T0 + 300, act=0.61)) == CHANGE
    assert write_reason(P, last, s(T0 + 300, mem=0.41)) == CHANGE
    assert write_reason(P, last, s(T0 + 300, act=None)) == CHANGE  # a GPU no longer read
    # Small moves are not written until the refresh, at the slot nearest max_interval.
    assert write_reason(P, last, s(T0 + 1649, act=0.55, mem=0.35)) is None
    assert write_reason(P, last, s(T0 + 1650, act=0.55, mem=0.35)) == REFRESH
    other = ClaimSummary(T0 + 300, False, None, {"gpu-1": DeviceFigures(0.5, 0.3, 0, 0)})
    assert write_reason(P, last, other) == CHANGE


def test_a_claim_writes_only_at_its_slots_once_per_min_interval() -> None:
    t = ClaimTrack(slot=100.0)
    levels: dict[str, tuple[float | None, float | None, bool | None]] = {"gpu-0": (0.5, 0.3, True)}
    got = []
    for i in range(0, 230):  # T0 is a multiple of 300: slots at T0 + 100 + k x 300
        now = T0 + i * 10
        act = 0.5 if i < 20 else 0.0  # the job stops at T0 + 200: a change, held until the next slot
        sm = t.observe(now, {"gpu-0": (act, 0.3, act > 0.05)}, False, None, P, 30)
        why = t.due(P, sm)
        if why is not None:
            t.wrote(sm)
            got.append((now - T0, why))
    assert got == [(100, FIRST), (400, CHANGE), (2200, REFRESH)]  # 1,900: only 1,500 s after the last
    # A round that misses the slot time writes in the first round after it; a failed write waits for the next slot.
    t2 = ClaimTrack(slot=105.0)
    assert t2.due(P, t2.observe(T0 + 100, levels, False, None, P, 30)) is None
    assert t2.due(P, t2.observe(T0 + 110, levels, False, None, P, 30)) == FIRST  # not written: it failed
    assert t2.due(P, t2.observe(T0 + 120, levels, False, None, P, 30)) is None
    assert t2.due(P, t2.observe(T0 + 405, levels, False, None, P, 30)) == FIRST


def test_data_object_round_trips_and_fits_the_api_limit() -> None:
    sm = ClaimSummary(T0, True, T0 - 1000.4, {"gpu-3": DeviceFigures(0.01234, 0.0456, 7200.6, 3600.2)})
    d = device_data(sm, "gpu-3", 60)
    assert d == {"kind": "GPUTelemetrySummary", "version": 1, "observedAt": "2027-01-15T08:00:00Z",
                 "windowSeconds": 60, "idle": True, "allocatedSeconds": 7201, "activeSeconds": 3600,
                 "activity": 0.012, "memoryUsed": 0.046, "idleSince": "2027-01-15T07:43:19Z"}
    assert len(json.dumps(d)) < DATA_MAX_BYTES // 20
    got = read_data(d)
    assert got is not None and got.idle and got.allocated_seconds == 7201 and got.memory_used == 0.046
    assert got.observed == T0 and got.idle_since_s == T0 - 1001
    assert read_data({**d, "version": 2}) is None
    assert read_data({**d, "kind": "Other"}) is None
    assert read_data({**d, "observedAt": "yesterday"}) is None
    assert read_data({**d, "activity": 3}) is None
    assert read_data("x") is None


def test_summary_apply_names_this_drivers_devices_with_their_share() -> None:
    sm = ClaimSummary(T0, False, None, {"gpu-1": DeviceFigures(0.5, 0.5, 10, 5),
                                         "gpu-0": DeviceFigures(None, None, 0, 0)})
    body = summary_apply("ns", "c", "u", "gpu.topodra.io", "n1", sm, 60, {"gpu-1": "s-1"})
    assert body["metadata"] == {"name": "c", "namespace": "ns", "uid": "u"}
    entries = body["status"]["devices"]
    assert [(e["pool"], e["device"], e.get("shareID")) for e in entries] == [("n1", "gpu-0", None),
                                                                              ("n1", "gpu-1", "s-1")]
    assert "activity" not in entries[0]["data"] and entries[1]["data"]["activity"] == 0.5
    assert all("conditions" not in e for e in entries)  # the Idle condition is another manager's
    claim = {"status": {"devices": [*entries, {"driver": "other", "pool": "n1", "device": "gpu-0",
                                               "data": entries[1]["data"]}]}}
    assert set(written_summaries(claim, "gpu.topodra.io", "n1")) == {"gpu-0", "gpu-1"}
    assert written_summaries(claim, "gpu.topodra.io", "n2") == {}


def test_slots_spread_claims_evenly_the_same_on_every_plugin() -> None:
    slots = [slot_of(f"uid-{i}", P) for i in range(3000)]
    assert all(0 <= x < 300 for x in slots) and slot_of("uid-7", P) == slots[7]
    per_round = [sum(1 for x in slots if k * 10 <= x < (k + 1) * 10) for k in range(30)]
    assert max(per_round) < 1.4 * 100 and min(per_round) > 0.6 * 100  # 100 expected per 10 s round
    assert slot_of("uid-7", P.model_copy(update={"spread": 0.0})) == 0.0
    assert next_slot(T0 + 5, 100, 300, after=False) == T0 + 100
    assert next_slot(T0 + 100, 100, 300, after=False) == T0 + 100
    assert next_slot(T0 + 100, 100, 300, after=True) == T0 + 400
