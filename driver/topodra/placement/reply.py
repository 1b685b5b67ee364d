"""The extender's reply, a ``HostPriorityList``, encoded straight from names and scores.

``json.dumps([{"Host": n, "Score": s}, ...], separators=(",", ":"))`` byte for byte, without the dicts:
at 2,048 candidates building them was ~0.3 ms of a call and encoding them ~1-1.5 ms more (issue 22, on
the 2-core machine). Node names are DNS subdomains, which JSON writes as they are: when every name is
printable ASCII without a quote or backslash, the reply is the names joined with the text between them
(which depends only on the score), 0.25-0.45 ms at 2,048 nodes. Other names take ``json.dumps``.

Measured in the scorer's process (``bench/scorer_latency``, load 6-7): this 0.44-0.47 ms per reply, a
cache of each name's encoded entries 0.49-0.74 ms (its 2,048 objects are scattered in memory and miss
the CPU caches, which a microbenchmark on fresh objects does not show), ``json.dumps`` of dicts 1-1.5 ms.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import chain

_BETWEEN = {s: f'","Score":{s}}},{{"Host":"' for s in range(11)}  # after a name scored s, before the next
_END = {s: f'","Score":{s}}}]' for s in range(11)}


def _plain(names: Sequence[str]) -> bool:
    """Whether JSON writes every name as it is (with ``ensure_ascii``, as ``json.dumps`` by default)."""
    text = "".join(names)
    return text.isascii() and text.isprintable() and '"' not in text and "\\" not in text


def encode_reply(names: Sequence[str], scores: Sequence[int]) -> bytes:
    """The reply for ``names`` with ``scores`` (0..10 each, same length); ValueError otherwise."""
    if len(names) != len(scores):
        raise ValueError(f"{len(names)} names but {len(scores)} scores")
    if not names:
        return b"[]"
    try:
        between = list(map(_BETWEEN.__getitem__, scores))
        between[-1] = _END[scores[-1]]
    except KeyError:
        raise ValueError(f"a score outside 0..10 in {sorted(set(scores))}") from None
    if not _plain(names):
        return json.dumps([{"Host": n, "Score": s} for n, s in zip(names, scores, strict=True)],
                          separators=(",", ":")).encode()
    return ('[{"Host":"' + "".join(chain.from_iterable(zip(names, between, strict=True)))).encode()
