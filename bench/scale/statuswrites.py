"""``bench/run scale --rows status-writes``: the claim-status writes the telemetry of N nodes x 8 GPUs sends.

No cluster: every node's plugin is simulated by the very objects its sampler keeps per claim
(``topodra.telemetry.summary.ClaimTrack``: accounts, ``write_reason``) and the idle rule
(``topodra.telemetry.idle``), stepped at the real sampling interval (10 s) over ``warmup + minutes`` virtual
minutes. Only the GPUs' readings are made up, per claim, by a scenario:

* ``busy`` (50%): activity 0.7 +- 0.08 and memory 0.6 per sample (Gaussian noise);
* ``idle`` (30%): activity 0-2%, memory 1% (a notebook holding its GPUs);
* ``flapping`` (20%): busy and idle phases of exponential length (mean 10 min), so some idle phases outlast the
  15-minute idle time and flip the Idle condition, most do not;

claims end after an exponential lifetime (mean 4 h) and a new claim of the same size and a fresh behaviour takes
their GPUs (its first summary is a write). Every claim exists at the start, as when topodra is installed on a
running cluster: the warm-up shows that install (writes spread by the claims' slots, ``slot_of``), the minutes after it
the steady state. ``layout`` says how each node's 8 GPUs are split into claims:
``mixed`` (per node, one of 8 / 4+4 / 4+2+2 / 2+2+2+1+1 / 1 x 8, equally likely) or ``one-gpu`` (8 one-GPU
claims per node: the most claims, the worst case for the bound).

Counted: summary applies (``topodra-telemetry-summary``) and Idle condition applies (``topodra-telemetry``, each
with its pod Event) per virtual minute after the warm-up, as writes per second cluster-wide; median, p99 and max
over the minutes, and the per-minute series. The bound: a claim writes its summary only in the first round after
each of its slot times, one per ``min_interval`` (``topodra.telemetry.summary``), so any ``min_interval``-long
window (sliding by one round, install included) holds at most one write per claim alive in it
(``window_max_ratio`` <= 1; claims replaced during the window count too), and a minute about
claims x 60 / ``min_interval`` (``minute_max_ratio``: the busiest minute over that).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from topodra.telemetry import idle as idlerule
from topodra.telemetry.summary import ClaimTrack, SummaryPolicy, slot_of

GPUS_PER_NODE = 8
LAYOUTS = {"mixed": ((8,), (4, 4), (4, 2, 2), (2, 2, 2, 1, 1), (1,) * 8), "one-gpu": ((1,) * 8,)}
KINDS = (("busy", 0.5), ("idle", 0.3), ("flapping", 0.2))
PHASE_MEAN_S = 600.0
LIFETIME_MEAN_S = 4 * 3600.0


@dataclass
class SimClaim:
    gpus: int
    kind: str
    ends_at: float
    busy: bool = True  # the current phase (flapping), or the kind's steady state
    phase_ends: float = math.inf
    track: ClaimTrack = field(default_factory=ClaimTrack)
    idle_state: idlerule.IdleState = field(default_factory=idlerule.IdleState)
    condition: bool | None = None  # the Idle condition as last written (None: never)


def _new_claim(rng: random.Random, gpus: int, now: float, policy: SummaryPolicy) -> SimClaim:
    kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
    uid = f"{rng.getrandbits(64):016x}"
    c = SimClaim(gpus, kind, now + rng.expovariate(1 / LIFETIME_MEAN_S), busy=kind != "idle",
                 track=ClaimTrack(slot=slot_of(uid, policy)))
    if kind == "flapping":
        c.busy = rng.random() < 0.5
        c.phase_ends = now + rng.expovariate(1 / PHASE_MEAN_S)
    return c


def _levels(rng: random.Random, c: SimClaim, rule: idlerule.IdleRule) -> tuple[dict[str, tuple[float, float, bool]],
                                                                               bool]:
    out = {}
    for g in range(c.gpus):
        if c.busy:
            act = min(1.0, max(0.0, rng.gauss(0.7, 0.08)))
            mem = min(1.0, max(0.0, rng.gauss(0.6, 0.02)))
        else:
            act, mem = rng.uniform(0.0, 0.02), 0.01
        below = act < rule.activity_below and mem < rule.memory_below
        out[f"gpu-{g}"] = (act, mem, not below)
    return out, all(not active for _a, _m, active in out.values())


def simulate(nodes: int, layout: str = "mixed", minutes: float = 30.0, warmup: float = 30.0,
             interval: float = 10.0, policy: SummaryPolicy | None = None, rule: idlerule.IdleRule | None = None,
             seed: int = 1) -> dict[str, Any]:
    """Run the scenario; per-minute write rates after the warm-up, and the bound."""
    policy = policy or SummaryPolicy()
    rule = rule or idlerule.IdleRule()
    rng = random.Random(seed)
    t0 = 1_800_000_000.0
    claims: list[SimClaim] = []
    for _n in range(nodes):
        for size in rng.choice(LAYOUTS[layout]):
            claims.append(_new_claim(rng, size, t0, policy))
    steps = round((warmup + minutes) * 60 / interval)
    counted_from = t0 + warmup * 60
    per_minute: dict[str, Counter[int]] = {"summary": Counter(), "condition": Counter()}
    per_step: Counter[int] = Counter()  # summary writes per sampling round, the whole run (install included)
    born: Counter[int] = Counter()  # claims replaced per round (a new claim has a slot of its own)
    reasons: Counter[str] = Counter()
    churn = 0
    started = time.process_time()
    for i in range(1, steps + 1):
        now = t0 + i * interval
        minute = int((now - counted_from - 1e-9) // 60)
        counted = now > counted_from
        for k, c in enumerate(claims):
            if now >= c.ends_at:
                c = claims[k] = _new_claim(rng, c.gpus, now, policy)
                churn += counted
                born[i] += 1
            if now >= c.phase_ends:
                c.busy = not c.busy
                c.phase_ends = now + rng.expovariate(1 / PHASE_MEAN_S)
            levels, all_below = _levels(rng, c, rule)
            c.idle_state = idlerule.step(c.idle_state, all_below, now)
            is_idle = c.idle_state.idle(rule, now)
            # The sampler's Idle condition rule (sampler._idle_round/_maybe_write): True once idle, False only on a
            # sample above the thresholds, nothing for a claim never flagged.
            want = True if is_idle else (False if not all_below else None)
            if want is not None and c.condition is not want and not (c.condition is None and not want):
                c.condition = want
                if counted:
                    per_minute["condition"][minute] += 1
            summary = c.track.observe(now, levels, is_idle, c.idle_state.below_since, policy, 3 * interval)
            why = c.track.due(policy, summary)
            if why is not None:
                c.track.wrote(summary)
                per_step[i] += 1
                if counted:
                    per_minute["summary"][minute] += 1
                    reasons[why] += 1
    cpu_s = time.process_time() - started
    n_minutes = round(minutes)
    out: dict[str, Any] = {"nodes": nodes, "gpus": nodes * GPUS_PER_NODE, "layout": layout, "claims": len(claims),
                           "interval_s": interval, "minutes": minutes, "warmup_minutes": warmup, "seed": seed,
                           "policy": policy.model_dump(), "idle_seconds": rule.idle_seconds,
                           "claims_replaced": churn, "summary_reasons": dict(reasons), "sim_cpu_s": round(cpu_s, 1)}
    for what, counts in per_minute.items():
        rates = sorted(counts.get(m, 0) / 60 for m in range(n_minutes))
        out[what] = {"per_second_median": statistics.median(rates), "per_second_p99": _p99(rates),
                     "per_second_max": rates[-1], "total": sum(counts.values()),
                     "per_minute": [counts.get(m, 0) for m in range(n_minutes)]}
    both = sorted((per_minute["summary"].get(m, 0) + per_minute["condition"].get(m, 0)) / 60 for m in range(n_minutes))
    out["all"] = {"per_second_median": statistics.median(both), "per_second_p99": _p99(both),
                  "per_second_max": both[-1]}
    # The guarantee: at most one summary write per claim in any min_interval-long window, install included.
    span = round(policy.min_interval / interval)
    windows = [(sum(per_step.get(j, 0) for j in range(i, i + span)),
                len(claims) + sum(born.get(j, 0) for j in range(i, i + span)))
               for i in range(1, steps - span + 2)]
    out["window_max_per_second"] = max(w for w, _c in windows) / policy.min_interval
    out["window_max_ratio"] = max(w / c for w, c in windows)  # writes / claims alive in the window: <= 1
    per_min = round(60 / interval)
    install = sorted(sum(per_step.get(j, 0) for j in range(1 + m * per_min, 1 + (m + 1) * per_min)) / 60
                     for m in range(round(warmup)))
    out["install"] = {"per_second_median": statistics.median(install), "per_second_max": install[-1],
                      "minutes": round(warmup)} if install else {}
    out["bound_per_second"] = len(claims) / policy.min_interval
    out["naive_per_second"] = len(claims) / interval  # a write per claim per sample, for scale
    out["minute_max_ratio"] = out["summary"]["per_second_max"] / out["bound_per_second"]
    out["within_bound"] = out["window_max_ratio"] <= 1.0
    return out


def _p99(sorted_values: list[float]) -> float:
    """Nearest-rank p99."""
    return sorted_values[max(0, math.ceil(0.99 * len(sorted_values)) - 1)]
