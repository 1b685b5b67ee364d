#!/usr/bin/env python3
"""What a CEL library would cost the placement scorer, against ``placement.cel``'s own evaluator.

The scorer evaluates claim-level CEL selectors on every device of every candidate node in each
``prioritize`` call (``score.selector_mask``), so the engine's per-device cost is paid
``selectors x devices`` times per call. This bench takes enterprise-400's 50 nodes (the view of
bench/scorer_latency.py, half allocated), then for each engine:

* checks that it gives the same answer as ``placement.cel`` on every (selector, device) pair;
* times one evaluation (process CPU time, median of runs over all devices) of each selector;
* times whole ``Placement.prioritize`` calls for a pod whose claim carries two of these selectors,
  with ``Selector.matches`` routed through the engine.

Engines: ``hand`` (``placement.cel``), ``cel-rust`` (common-expression-language 0.10.0: the device is
converted to a CEL map on each evaluation, as a drop-in behind ``Selector.matches`` must), and
``cel-rust-cached`` (one prebuilt ``cel.Context`` per device, reused for every selector: the best case
the library allows). ``cel-python`` (0.5.0) is timed on the per-selector step only when installed.

Usage: .venv/bin/python bench/run cel_engines [--calls N] [--json FILE]
(needs ``pip install common-expression-language==0.10.0``; not a dependency of topodra)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

from bench.scorer_latency.main import build
from testkit.views import claim

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.fleet import cel as handcel
from topodra.fleet.fgd import DEFAULT_PRIOR
from topodra.kube import Kube
from topodra.placement.cache import Cache
from topodra.placement.server import Placement
from topodra.selectors import parse_quantity, parse_semver

A = f'device.attributes["{DRIVER}"]'
C = f'device.capacity["{DRIVER}"]'
SELECTORS = [
    f'{A}.model == "H100-SXM5-80GB"',
    f'{A}.model in ["A100-SXM4-80GB", "H100-SXM5-80GB", "H200-SXM5-141GB"]',
    f'{A}.nvlinkDomainSize >= 8 && {A}.migCapable == true',
    f'{C}.memory.compareTo(quantity("79Gi")) >= 0',
    f'{A}.cudaComputeCapability.compareTo(semver("9.0.0")) >= 0',
    f'device.driver == "{DRIVER}" && has({A}.rail)',
]
CLAIM_SELECTORS = [SELECTORS[2], SELECTORS[3]]

Matcher = Callable[[str, Mapping[str, Any], Mapping[str, Decimal]], bool]


# ---- the library behind Selector.matches, as adoption would need it (DRA's quantity/semver via Python)

_Q, _V = "\x00q:", "\x00v:"  # tagged strings: the library has no custom types; compareTo dispatches on the tag


def _compare_to(a: Any, b: Any) -> int:
    if isinstance(b, str) and b.startswith(_Q) and isinstance(a, str) and a.startswith(_Q):
        x, y = Decimal(a[len(_Q):]), Decimal(b[len(_Q):])
    elif isinstance(b, str) and b.startswith(_V) and isinstance(a, str):
        x, y = parse_semver(a), parse_semver(b[len(_V):])  # type: ignore[assignment]
    else:
        raise TypeError("no such overload")
    return int(x > y) - int(x < y)


def _device(driver: str, attrs: Mapping[str, Any], capacity: Mapping[str, Decimal]) -> dict[str, Any]:
    out: dict[str, Any] = {"driver": driver, "attributes": {}, "capacity": {}}
    for key, value in attrs.items():
        domain, name = key.rsplit("/", 1)
        out["attributes"].setdefault(domain, {})[name] = value
    for key, q in capacity.items():
        domain, name = key.rsplit("/", 1)
        out["capacity"].setdefault(domain, {})[name] = f"{_Q}{q}"
    return out


def rust_engine(expr: str, cached: dict[int, Any] | None) -> Matcher:
    import cel

    program = cel.compile(expr)
    base = cel.Context()
    base.add_function("compareTo", _compare_to)
    base.add_function("quantity", lambda s: f"{_Q}{parse_quantity(s)}")
    base.add_function("semver", lambda s: f"{_V}{s}")

    def matches(driver: str, attrs: Mapping[str, Any], capacity: Mapping[str, Decimal]) -> bool:
        if cached is not None:
            ctx = cached.get(id(attrs))
            if ctx is None:
                ctx = cel.Context()
                ctx.add_function("compareTo", _compare_to)
                ctx.add_function("quantity", lambda s: f"{_Q}{parse_quantity(s)}")
                ctx.add_function("semver", lambda s: f"{_V}{s}")
                ctx.add_variable("device", _device(driver, attrs, capacity))
                cached[id(attrs)] = ctx
        else:
            ctx = base
            ctx.add_variable("device", _device(driver, attrs, capacity))
        try:
            return program.execute(ctx) is True
        except Exception:  # DRA: an evaluation error is "no match"
            return False

    return matches


def celpy_engine(expr: str) -> Matcher | None:
    try:
        import celpy
    except ImportError:
        return None
    env = celpy.Environment()
    prog = env.program(env.compile(expr),
                       functions={"compareTo": lambda a, b: celpy.celtypes.IntType(_compare_to(a, b)),
                                  "quantity": lambda s: celpy.celtypes.StringType(
                                      f"{_Q}{parse_quantity(str(s))}"),
                                  "semver": lambda s: celpy.celtypes.StringType(f"{_V}{s}")})

    def matches(driver: str, attrs: Mapping[str, Any], capacity: Mapping[str, Decimal]) -> bool:
        try:
            got = prog.evaluate({"device": celpy.adapter.json_to_cel(_device(driver, attrs, capacity))})
            return isinstance(got, celpy.celtypes.BoolType) and bool(got)  # errors come back as values
        except Exception:
            return False

    return matches


def engines(expr: str, cache: dict[int, Any]) -> dict[str, Matcher | None]:
    sel = handcel.recognise(expr)
    assert sel is not None, expr
    return {"hand": sel.matches, "cel-rust": rust_engine(expr, None), "cel-rust-cached": rust_engine(expr, cache),
            "cel-python": celpy_engine(expr)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200, help="prioritize calls per engine (default 200)")
    p.add_argument("--runs", type=int, default=5, help="timed passes over all devices per selector (default 5)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        import cel  # noqa: F401
    except ImportError:
        print("needs the library under test: .venv/bin/pip install common-expression-language==0.10.0",
              file=sys.stderr)
        return 2
    st, _rng = build(50, 1)
    names = sorted(st.nodes)
    devices = [d for n in names if (v := st.node_view(n)) is not None for d in v.devices]
    print(f"{len(names)} nodes, {len(devices)} devices")
    out: dict[str, Any] = {"nodes": len(names), "devices": len(devices), "per_eval_us": {}, "prioritize_ms": {}}
    cache: dict[int, Any] = {}
    for expr in SELECTORS:
        row = {}
        got = engines(expr, cache)
        want = [got["hand"](d.driver, d.attrs, d.capacity) for d in devices]  # type: ignore[misc]
        for name, fn in got.items():
            if fn is None:
                continue
            answers = [fn(d.driver, d.attrs, d.capacity) for d in devices]  # also fills the cached contexts
            assert answers == want, (name, expr)
            times = []
            for _ in range(args.runs if name != "cel-python" else 1):
                t0 = time.process_time()
                for d in devices:
                    fn(d.driver, d.attrs, d.capacity)
                times.append((time.process_time() - t0) / len(devices) * 1e6)
            row[name] = round(statistics.median(times), 2)
        out["per_eval_us"][expr] = row
        print(f"{expr[:70]:70s} " + "  ".join(f"{k} {v:7.2f} us" for k, v in row.items()))

    spec = {"devices": {"requests": [{"name": "gpus", "exactly": {
        "deviceClassName": "gpu.topodra.io", "count": 2,
        "selectors": [{"cel": {"expression": e}} for e in CLAIM_SELECTORS]}}]}}
    placement = Placement(Cache(Kube.__new__(Kube), st), DEFAULT_PRIOR, 20)
    original = handcel.Selector.matches
    for name in ("hand", "cel-rust", "cel-rust-cached"):
        per = {e: engines(e, cache)[name] for e in CLAIM_SELECTORS}

        def routed(self: handcel.Selector, driver: str, attrs: Mapping[str, Any],
                   capacity: Mapping[str, Decimal], per: dict[str, Any] = per) -> bool:
            return bool(per[self.expression](driver, attrs, capacity))

        handcel.Selector.matches = routed  # type: ignore[method-assign]
        try:
            cpu = []
            for k in range(args.calls):
                st.set_claim(claim(f"cel{k}", spec))
                pod = {"metadata": {"name": f"p{k}", "namespace": "ns"},
                       "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimName": f"cel{k}"}]}}
                t0 = time.thread_time()
                placement.prioritize({"Pod": pod, "NodeNames": names})
                cpu.append((time.thread_time() - t0) * 1e3)
                st.delete_claim("ns", f"cel{k}", forget=False)
        finally:
            handcel.Selector.matches = original  # type: ignore[method-assign]
        cpu.sort()
        res = {"p50": round(cpu[len(cpu) // 2], 2), "p99": round(cpu[min(len(cpu) - 1, int(0.99 * len(cpu)))], 2)}
        out["prioritize_ms"][name] = res
        print(f"prioritize, claim with 2 selectors, {name:16s} CPU p50 {res['p50']:.2f} ms  p99 {res['p99']:.2f} ms")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
