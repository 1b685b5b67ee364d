"""SliceWatch's store (pure part): events and our own writes merged by resourceVersion, per node.

The list+watch against the real apiserver: tests/cluster/test_publisher_watch_cluster.py.
"""

from __future__ import annotations

from typing import Any

from topodra.kube import Kube
from topodra.slicewatch import SliceWatch


def sl(name: str, node: str, rv: int, gen: int = 1) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": str(rv)},
            "spec": {"driver": "gpu.topodra.io", "nodeName": node, "pool": {"name": node, "generation": gen}}}


def watch() -> tuple[SliceWatch, list[str]]:
    w = SliceWatch(Kube.__new__(Kube), "gpu.topodra.io")  # never started: fed directly
    heard: list[str] = []
    w.subscribe(heard.append)
    return w, heard


def feed(w: SliceWatch, kind: str, obj: dict[str, Any]) -> None:
    """What the watch loop does with one event."""
    node = w._apply(kind, obj)
    w._notify(() if node is None else (node,))


def gens(w: SliceWatch, node: str) -> dict[str, int]:
    return {s["metadata"]["name"]: int(s["spec"]["pool"]["generation"]) for s in w.pool(node)}


def test_events_are_kept_by_node_and_subscribers_hear_which_node() -> None:
    w, heard = watch()
    feed(w, "ADDED", sl("a-0", "a", 10))
    feed(w, "ADDED", sl("b-0", "b", 11))
    feed(w, "MODIFIED", sl("a-0", "a", 12, gen=2))
    assert gens(w, "a") == {"a-0": 2} and gens(w, "b") == {"b-0": 1}
    feed(w, "DELETED", sl("b-0", "b", 13))
    assert w.pool("b") == [] and w.nodes() == ["a"]
    assert heard == ["a", "b", "a", "b"]


def test_our_write_is_not_undone_by_the_older_echo_of_an_event() -> None:
    w, heard = watch()
    feed(w, "ADDED", sl("a-0", "a", 10))
    w.stored(sl("a-0", "a", 20, gen=2))  # our replace returned resourceVersion 20
    feed(w, "MODIFIED", sl("a-0", "a", 15))  # someone's update from before it, arriving late
    assert gens(w, "a") == {"a-0": 2}
    feed(w, "MODIFIED", sl("a-0", "a", 20, gen=2))  # the watch's echo of our write
    feed(w, "MODIFIED", sl("a-0", "a", 25, gen=3))  # a newer change wins
    assert gens(w, "a") == {"a-0": 3}
    assert heard == ["a", "a", "a"]  # the stale event was no change


def test_a_slice_we_recreated_survives_the_late_delete_event_that_caused_it() -> None:
    w, _ = watch()
    feed(w, "ADDED", sl("a-0", "a", 10))
    w.stored(sl("a-0", "a", 30, gen=2))  # re-created after an admin's delete (at 20), before its event came
    feed(w, "DELETED", sl("a-0", "a", 20))
    assert gens(w, "a") == {"a-0": 2}


def test_a_slice_we_deleted_is_not_resurrected_by_older_events() -> None:
    w, _ = watch()
    feed(w, "ADDED", sl("a-1", "a", 10))
    w.removed("a-1")
    feed(w, "MODIFIED", sl("a-1", "a", 10))  # older than the deletion
    assert w.pool("a") == []
    feed(w, "DELETED", sl("a-1", "a", 40))
    feed(w, "ADDED", sl("a-1", "a", 41))  # created again by someone, later: it is there
    assert gens(w, "a") == {"a-1": 1}


def test_relist_replaces_the_store_keeps_newer_writes_and_names_changed_nodes() -> None:
    w, heard = watch()
    feed(w, "ADDED", sl("a-0", "a", 10))
    feed(w, "ADDED", sl("b-0", "b", 11))
    feed(w, "ADDED", sl("c-0", "c", 12))
    heard.clear()
    w.stored(sl("d-0", "d", 60))  # written after the list below was served (at 50)
    changed = w._replace([sl("a-0", "a", 10), sl("b-0", "b", 44, gen=2)], "50")
    assert changed == {"b", "c"}  # a unchanged; b newer; c gone; d kept (newer than the list)
    assert gens(w, "b") == {"b-0": 2} and w.pool("c") == [] and gens(w, "d") == {"d-0": 1}
    assert w._version == "50"


def test_nameless_or_unknown_versions_never_lose_the_newest_report() -> None:
    w, _ = watch()
    feed(w, "ADDED", {"metadata": {}, "spec": {"nodeName": "a"}})
    assert w.nodes() == []
    feed(w, "ADDED", sl("a-0", "a", 10))
    odd = sl("a-0", "a", 0, gen=5)
    odd["metadata"]["resourceVersion"] = "not-a-number"
    feed(w, "MODIFIED", odd)  # cannot be ordered: the event wins, as an unordered store would have it
    assert gens(w, "a") == {"a-0": 5}
