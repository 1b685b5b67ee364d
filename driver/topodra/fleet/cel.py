"""The CEL device selectors the scorer can evaluate without a CEL engine. Pure.

A selector is recognised when it is a conjunction (``&&``) of these terms, where ``A`` is
``device.attributes["DOMAIN"].NAME`` (or ``["NAME"]``) and ``C`` the same under ``device.capacity``:

* ``device.driver == "D"`` (either side), ``has(A)``, ``has(C)``
* ``A == L``, ``A != L`` with ``L`` a string, integer or boolean literal; ``A in [L, ...]``
* ``A < N``, ``A <= N``, ``A > N``, ``A >= N`` with an integer ``N``
* ``C.compareTo(quantity("Q")) OP N`` and ``A.compareTo(semver("V")) OP N`` (``OP`` any comparison)

That covers what topodra's own DeviceClasses render (``DeviceMatch.to_cel``) and the usual
hand-written model, memory and compute-capability filters. Anything else (``||``, ``!``,
ternaries, other functions, maps, string methods) is *not recognised*: the caller then ignores
that selector, which can only make the scorer's prediction too generous, never veto a node.

Evaluation follows the DRA CEL environment where it matters: an absent attribute or capacity
makes a comparison false (the scheduler treats the runtime error as "no match"), a quantity
compares by value, a version by its major/minor/patch.

Why hand-written and not a CEL library: the scorer evaluates every claim selector on every device
of every candidate node in each ``prioritize`` call, so the per-device cost is the budget. Measured
with ``bench/run cel_engines`` (enterprise-400: 50 nodes, 800 devices; process CPU time per
evaluation on a 2-core machine at load 9-14, 2026-12-01), all engines giving the same answer on
every (selector, device) pair:

* this module: 1.1-2.9 us per evaluation;
* ``common-expression-language`` 0.10.0 (Rust bindings) behind this interface, the device converted
  to a CEL map per evaluation: 74-88 us (about 50x); with one prebuilt ``cel.Context`` per device,
  reused across selectors (the best the library allows; it has no quantity or semver type, so
  ``compareTo`` runs as a Python callback on tagged strings): 9-15 us (about 6x);
* ``cel-python`` 0.5.0: 430-960 us (timed per selector only).

A ``prioritize`` call for a pod whose claim carries two selectors took 3.5 ms CPU at p50 (9.4 ms
p99) with this module, 130 ms (209 ms) with the library per evaluation and 17 ms (25 ms) with
cached contexts, against the scorer's 5 ms p99 target at 50 nodes. What a library would add,
selectors outside the subset (``||``, ``!``, string functions), is worth less than that: such a
selector is ignored, which only makes the prediction more generous (the scheduler still filters).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from topodra.quantities import parse_quantity, parse_semver

_REF = r'device\.(attributes|capacity)\["([^"\\]+)"\](?:\.([A-Za-z_][A-Za-z0-9_]*)|\["([^"\\]+)"\])'
_LIT = r'"(?:[^"\\]|\\.)*"|-?\d+|true|false'
_OP = r"==|!=|<=|>=|<|>"
_DRIVER = re.compile(r'^(?:device\.driver\s*==\s*"([^"\\]+)"|"([^"\\]+)"\s*==\s*device\.driver)$')
_HAS = re.compile(rf"^has\(\s*{_REF}\s*\)$")
_CMP = re.compile(rf"^{_REF}\s*({_OP})\s*({_LIT})$")
_IN = re.compile(rf"^{_REF}\s+in\s+\[\s*((?:{_LIT})(?:\s*,\s*(?:{_LIT}))*)?\s*\]$")
_COMPARE_TO = re.compile(
    rf'^{_REF}\.compareTo\(\s*(quantity|semver)\(\s*"([^"\\]+)"\s*\)\s*\)\s*({_OP})\s*(-?\d+)$')
_LIST_ITEM = re.compile(_LIT)


@dataclass(frozen=True, slots=True)
class Term:
    """One recognised comparison. ``kind``: driver, has, cmp, in, quantity, semver."""

    kind: str
    source: str = ""  # "attributes" or "capacity"
    name: str = ""  # fully qualified, e.g. gpu.topodra.io/model
    op: str = ""
    value: Any = None  # literal; tuple of literals; (Decimal or (major, minor, patch), N) for compareTo


@dataclass(frozen=True, slots=True)
class Selector:
    """A recognised CEL selector: all terms must hold. Hashable (part of a request's identity)."""

    expression: str
    terms: tuple[Term, ...]

    def matches(self, driver: str, attrs: Mapping[str, Any], capacity: Mapping[str, Decimal]) -> bool:
        """Evaluate on one device of ``driver``: qualified attribute values and capacities."""
        return all(_holds(t, driver, attrs, capacity) for t in self.terms)


def _literal(text: str) -> Any:
    if text.startswith('"'):
        return re.sub(r"\\(.)", r"\1", text[1:-1])
    if text in ("true", "false"):
        return text == "true"
    return int(text)


def _qualified(domain: str, dotted: str | None, indexed: str | None) -> str:
    return f"{domain}/{dotted if dotted is not None else indexed}"


def _compare(a: Any, op: str, b: Any) -> bool:
    if op == "==":
        return bool(a == b)
    if op == "!=":
        return bool(a != b)
    if type(a) is not type(b) or isinstance(a, bool):
        return False  # CEL has no ordering across types (no such overload: no match)
    return bool({"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op])


def _holds(t: Term, driver: str, attrs: Mapping[str, Any], capacity: Mapping[str, Decimal]) -> bool:
    if t.kind == "driver":
        return bool(t.value == driver)
    table: Mapping[str, Any] = attrs if t.source == "attributes" else capacity
    if t.name not in table:
        return False
    v = table[t.name]
    if t.kind == "has":
        return True
    if t.kind == "cmp":
        if isinstance(v, bool) != isinstance(t.value, bool):
            return t.op == "!="  # CEL: values of different types are never equal
        return _compare(v, t.op, t.value)
    if t.kind == "in":
        return any(type(v) is type(x) and v == x for x in t.value)
    rhs, n = t.value
    if t.kind == "quantity":
        if not isinstance(v, Decimal):
            return False
        return _compare(int(v > rhs) - int(v < rhs), t.op, n)
    try:
        got = parse_semver(str(v))
    except ValueError:
        return False
    return _compare(int(got > rhs) - int(got < rhs), t.op, n)


def _split(expression: str) -> list[str] | None:
    """Top-level ``&&`` operands, outer parentheses removed; None for anything but a conjunction."""
    text = " ".join(expression.split())
    if "||" in text or "?" in text:
        return None
    parts = []
    for raw in text.split("&&"):
        part = raw.strip()
        while part.startswith("(") and part.endswith(")") and _balanced(part[1:-1]):
            part = part[1:-1].strip()
        if not part or not _balanced(part) or (part.startswith("!") and not part.startswith("!=")):
            return None
        parts.append(part)
    return parts


def _balanced(text: str) -> bool:
    depth, quoted = 0, False
    for i, ch in enumerate(text):
        if ch == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        elif not quoted and ch in "([":
            depth += 1
        elif not quoted and ch in ")]":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0 and not quoted


def _term(part: str) -> Term | None:
    if m := _DRIVER.match(part):
        return Term("driver", value=m.group(1) or m.group(2))
    if m := _HAS.match(part):
        return Term("has", m.group(1), _qualified(m.group(2), m.group(3), m.group(4)))
    if m := _CMP.match(part):
        lit = _literal(m.group(6))
        if m.group(5) not in ("==", "!=") and (isinstance(lit, bool) or not isinstance(lit, int)):
            return None
        return Term("cmp", m.group(1), _qualified(m.group(2), m.group(3), m.group(4)), m.group(5), lit)
    if m := _IN.match(part):
        items = tuple(_literal(x) for x in _LIST_ITEM.findall(m.group(5) or ""))
        return Term("in", m.group(1), _qualified(m.group(2), m.group(3), m.group(4)), value=items)
    if m := _COMPARE_TO.match(part):
        func, arg = m.group(5), m.group(6)
        try:
            value: Any = parse_quantity(arg) if func == "quantity" else parse_semver(arg)
        except ValueError:
            return None
        if (func == "quantity") != (m.group(1) == "capacity"):
            return None  # quantities are capacities, versions attributes, in topodra's slices
        return Term(func, m.group(1), _qualified(m.group(2), m.group(3), m.group(4)), m.group(7),
                    (value, int(m.group(8))))
    return None


def recognise(expression: str) -> Selector | None:
    """The selector as a ``Selector``, or None when it uses anything outside the supported subset."""
    parts = _split(expression)
    if not parts:
        return None
    terms = []
    for part in parts:
        t = _term(part)
        if t is None:
            return None
        terms.append(t)
    return Selector(expression=expression, terms=tuple(terms))


def qualified_capacity(device: Mapping[str, Any], driver: str) -> dict[str, Decimal]:
    """Capacity values of a ResourceSlice device by fully qualified name, as numbers."""
    out: dict[str, Decimal] = {}
    for key, raw in (device.get("capacity") or {}).items():
        if isinstance(raw, dict) and "value" in raw:
            try:
                out[key if "/" in key else f"{driver}/{key}"] = parse_quantity(str(raw["value"]))
            except ValueError:
                continue
    return out
