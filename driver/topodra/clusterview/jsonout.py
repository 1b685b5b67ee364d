"""``-o json`` text: indented like ``json.dumps(indent=2)`` down to the node level, one line per device. Pure.

With ``indent`` set, CPython's json module encodes in Python, not C: 13.5 MB for 2,048 nodes took ~0.8 s.
Objects nested ``COMPACT_DEPTH`` deep (each GPU, NIC, NVLink domain and rail of a node) are written by the
C encoder on one line instead, which also makes a 32,768-device report one screen line per device rather
than twelve. The value is the same JSON document (``json.loads`` gives what ``json.dumps`` would).

The levels above the devices are ~19 keys and values per node, 80,000 small strings at 2,048 nodes: each
``json.dumps`` call there cost more in its Python layers (argument checks, a new C encoder per call) than in
encoding. So keys are encoded once per run, strings, integers, booleans and ``None`` by the C string
encoder or ``repr`` as ``json.dumps`` writes them, and devices by one reused C encoder: 0.30 s -> 0.13 s of
CPU for that report (the same text, byte for byte; a unit test compares with the plain writer).
"""

from __future__ import annotations

import json
import json.encoder
from collections.abc import Callable
from typing import Any

COMPACT_DEPTH = 4  # the top object 0, "nodes" 1, a node 2, its "gpus" 3, a GPU 4
INDENT = "  "

_encode_str: Callable[[str], str] = json.encoder.encode_basestring_ascii  # json.dumps' default (ensure_ascii)


def _compact_encoder() -> Callable[[Any], str]:
    """``json.dumps`` with its defaults, as one reused C encoder (``json.dumps`` makes one per call)."""
    make = getattr(json.encoder, "c_make_encoder", None)  # not in typeshed: the C accelerator's factory
    if make is None:  # no C accelerator: json.dumps itself
        return json.dumps
    defaults = json.JSONEncoder()
    markers: dict[int, Any] = {}
    enc = make(markers, defaults.default, _encode_str, None, defaults.key_separator, defaults.item_separator,
               defaults.sort_keys, defaults.skipkeys, defaults.allow_nan)

    def encode(obj: Any) -> str:
        try:
            return "".join(enc(obj, 0))
        except Exception:
            markers.clear()
            return json.dumps(obj)  # raises what json.dumps raises
    return encode


def json_text(obj: Any) -> str:
    out: list[str] = []
    _Writer().write(obj, 0, out)
    out.append("\n")
    return "".join(out)


class _Writer:
    def __init__(self) -> None:
        self.compact = _compact_encoder()
        self.keys: dict[Any, str] = {}

    def scalar(self, v: Any) -> str:
        """``json.dumps(v)`` for a value that is not expanded; exact types only take the short cuts."""
        t = type(v)
        if t is str:
            return _encode_str(v)
        if t is int:
            return int.__repr__(v)
        if t is bool:
            return "true" if v else "false"
        if v is None:
            return "null"
        return self.compact(v)

    def key(self, k: Any) -> str:
        got = self.keys.get(k) if type(k) is str else None
        if got is None:
            got = json.dumps(k if isinstance(k, str) else _key(k))
            if type(k) is str:
                self.keys[k] = got
        return got

    def write(self, obj: Any, depth: int, out: list[str]) -> None:
        if depth >= COMPACT_DEPTH:
            out.append(self.compact(obj))
            return
        if not isinstance(obj, dict | list | tuple) or not obj:
            out.append(self.scalar(obj))
            return
        pad = "\n" + INDENT * (depth + 1)
        sep = "," + pad
        deeper = depth + 1
        leaf = deeper >= COMPACT_DEPTH
        if isinstance(obj, dict):
            out.append("{")
            first = True
            for k, v in obj.items():
                out.append(pad if first else sep)
                first = False
                out.append(self.key(k))
                out.append(": ")
                if leaf:
                    out.append(self.compact(v))
                else:
                    self.write(v, deeper, out)
            out.append("\n" + INDENT * depth + "}")
        else:
            out.append("[")
            for i, v in enumerate(obj):
                out.append(pad if i == 0 else sep)
                if leaf:
                    out.append(self.compact(v))
                else:
                    self.write(v, deeper, out)
            out.append("\n" + INDENT * depth + "]")


def _key(k: Any) -> str:
    """A non-string key as json.dumps writes it (numbers, booleans, None)."""
    text: str = json.dumps(k)
    return text.strip('"')
