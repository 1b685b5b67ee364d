"""The extender's reply, a ``HostPriorityList``, encoded straight from names and scores.

``json.dumps([{"Host": n, "Score": s}, ...], separators=(",", ":"))`` byte for byte, without the dicts:
at 2,048 candidates building them was ~0.3 ms of a call and, being 2,048 objects the cyclic collector
tracks, set off ~3 young-generation collections per call (0.1-0.3 ms each on the 2-core machine, issue
22); encoding them took another ~1-2 ms. Here each node's ``{"Host":"<name>","Score":`` is encoded once
and kept, and a reply is one join of bytes (untracked by the collector).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from operator import add

_SCORES = {s: f"{s}}}".encode() for s in range(11)}  # the extender's scores are 0..10


class _Prefixes(dict[str, bytes]):
    """Node name -> its entry's encoded head, filled on first use (``__missing__``: no second lookup)."""

    def __missing__(self, name: str) -> bytes:
        got = self[name] = b'{"Host":' + json.dumps(name).encode() + b',"Score":'
        return got


class ReplyEncoder:
    """Encodes replies; keeps the heads of at most ``max_names`` names (then starts over)."""

    def __init__(self, max_names: int = 100_000) -> None:
        self._heads = _Prefixes()
        self._max = max_names

    def encode(self, names: Sequence[str], scores: Sequence[int]) -> bytes:
        """The reply for ``names`` with ``scores`` (0..10 each, same length); ValueError otherwise."""
        if len(names) != len(scores):
            raise ValueError(f"{len(names)} names but {len(scores)} scores")
        if len(self._heads) > self._max:
            self._heads.clear()
        try:
            parts = list(map(add, map(self._heads.__getitem__, names), map(_SCORES.__getitem__, scores)))
        except KeyError:
            raise ValueError(f"a score outside 0..10 in {sorted(set(scores))}") from None
        return b"[" + b",".join(parts) + b"]"
