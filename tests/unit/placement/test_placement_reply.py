"""``placement.reply``: the reply's JSON equals ``json.dumps`` of the HostPriorityList byte for byte."""

from __future__ import annotations

import json

import pytest

from topodra.placement.reply import ReplyEncoder


def dumps(names: list[str], scores: list[int]) -> bytes:
    return json.dumps([{"Host": n, "Score": s} for n, s in zip(names, scores, strict=True)],
                      separators=(",", ":")).encode()


def test_reply_is_the_dumps_of_the_list_byte_for_byte() -> None:
    enc = ReplyEncoder()
    names = [f"sp-h200-{i:04d}" for i in range(50)] + ['quote"and\\slash', "ünïcode-node", "tab\tnode", ""]
    for shift in range(3):  # the kept heads serve later replies with other scores and another order
        scores = [(i + shift) % 11 for i in range(len(names))]
        assert enc.encode(names, scores) == dumps(names, scores)
        names.reverse()
    assert enc.encode([], []) == b"[]"
    assert json.loads(enc.encode(["a", "a"], [3, 4])) == [{"Host": "a", "Score": 3}, {"Host": "a", "Score": 4}]


def test_kept_heads_are_bounded() -> None:
    enc = ReplyEncoder(max_names=10)
    for k in range(5):
        names = [f"n{k}-{i}" for i in range(8)]
        assert enc.encode(names, [1] * 8) == dumps(names, [1] * 8)
        assert len(enc._entries) <= 10 + 8


@pytest.mark.parametrize(("names", "scores"), [(["a"], [11]), (["a"], [-1]), (["a", "b"], [1])])
def test_bad_scores_are_errors(names: list[str], scores: list[int]) -> None:
    with pytest.raises(ValueError):
        ReplyEncoder().encode(names, scores)
