"""``placement.reply``: the reply's JSON equals ``json.dumps`` of the HostPriorityList byte for byte."""

from __future__ import annotations

import json

import pytest

from topodra.placement.reply import encode_reply


def dumps(names: list[str], scores: list[int]) -> bytes:
    return json.dumps([{"Host": n, "Score": s} for n, s in zip(names, scores, strict=True)],
                      separators=(",", ":")).encode()


@pytest.mark.parametrize("odd", [None, 'quote"d', "back\\slash", "ünïcode", "tab\tnode", "del\x7f", ""])
def test_reply_is_the_dumps_of_the_list_byte_for_byte(odd: str | None) -> None:
    names = [f"sp-h200-{i:04d}" for i in range(50)] + ([odd] if odd is not None else [])
    for shift in range(11):
        scores = [(i + shift) % 11 for i in range(len(names))]
        assert encode_reply(names, scores) == dumps(names, scores)
        names.reverse()


def test_small_replies() -> None:
    assert encode_reply([], []) == b"[]" == dumps([], [])
    for s in range(11):
        assert encode_reply(["a"], [s]) == dumps(["a"], [s])
    assert json.loads(encode_reply(["a", "a"], [3, 4])) == [{"Host": "a", "Score": 3}, {"Host": "a", "Score": 4}]


@pytest.mark.parametrize(("names", "scores"), [(["a"], [11]), (["a"], [-1]), (["a", "b"], [1]), (["a", "b"], [1, 12])])
def test_bad_scores_are_errors(names: list[str], scores: list[int]) -> None:
    with pytest.raises(ValueError):
        encode_reply(names, scores)
