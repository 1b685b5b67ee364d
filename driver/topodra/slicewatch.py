"""One list+watch of a driver's ResourceSlices, kept by node: what the publisher compares against.

Listing a pool on a timer costs a request per node every resync (360 per node per hour at 10 s) to learn,
almost always, that nothing changed.  Like the ``resourceslice`` controller of
``k8s.io/dynamic-resource-allocation`` (an informer with a ``spec.driver``/``spec.nodeName`` field selector,
no resync), this lists once, then watches from the list's resourceVersion and tells subscribers which node's
slices changed.  A kubelet plugin watches its own node; ``topodra simulate`` runs one for every node of a
driver and fans the events out, so thousands of pools cost one stream, not one thread each.

The store is merged by resourceVersion (integers, as etcd's are; client-go's integer mutation cache does
the same): a publisher records what its own writes returned (``stored``/``removed``), so a pass that runs
before the watch echoes the write sees it, and a late, older event never overwrites a newer object.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterable
from typing import Any

from topodra.apipaths import slices_path
from topodra.kube import Kube, KubeError, Obj

log = logging.getLogger(__name__)

# The server ends each watch after this many seconds (drawn per watch, as client-go's reflector does:
# 5-10 min); it is resumed from the last resourceVersion seen, one request, no list.
WATCH_TIMEOUT_S = (300, 600)
MAX_BACKOFF_S = 30.0


def _rv(obj: Obj) -> int | None:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or "")
    except ValueError:
        return None


def _older(a: int | None, b: int | None) -> bool:
    """a is known to be older than b (unknown versions are never older: the newest report wins)."""
    return a is not None and b is not None and a < b


class SliceWatch:
    """ResourceSlices of ``driver`` (on ``node`` only, when given), listed once and then watched."""

    def __init__(self, kube: Kube, driver: str, node: str | None = None, *,
                 watch_timeout: tuple[int, int] = WATCH_TIMEOUT_S) -> None:
        self.kube = kube
        self.driver = driver
        self.node = node
        self.watch_timeout = watch_timeout
        self.field_selector = f"spec.driver={driver}" + (f",spec.nodeName={node}" if node else "")
        self._lock = threading.Lock()
        self._by_node: dict[str, dict[str, Obj]] = {}
        self._node_of: dict[str, str] = {}  # slice name -> node it is stored under
        self._gone: dict[str, int] = {}  # slice name -> resourceVersion it was deleted at (or after)
        self._version = ""  # where the watch resumes
        self._subscribers: list[Callable[[str], None]] = []
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._changed = threading.Condition()
        # Counters (read by tests and bench/scale): lists, watch requests, bookmarks and object events seen.
        self.lists = 0
        self.watches = 0
        self.bookmarks = 0
        self.events = 0

    # ----- public

    def subscribe(self, callback: Callable[[str], None]) -> None:
        """``callback(node)`` runs on the watch thread whenever that node's slices change: keep it quick."""
        self._subscribers.append(callback)

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def wait_synced(self, timeout: float) -> bool:
        return self._synced.wait(timeout)

    def relist(self) -> None:
        """List now and replace the store (subscribers hear of every node whose slices differ)."""
        items, version = self.kube.list_snapshot(slices_path(), self.field_selector)
        self.lists += 1
        changed = self._replace(items, version)
        self._synced.set()
        self._notify(changed)

    def start(self) -> None:
        """Watch in the background: from the last list's version, or after a list of its own."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"slicewatch-{self.node or self.driver}",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop after the current watch request ends (at the latest ``watch_timeout``); the thread is a daemon."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()

    def pool(self, node: str) -> list[Obj]:
        """The node's slices as last seen (a copy of the list; the objects are shared: do not modify)."""
        with self._lock:
            return list(self._by_node.get(node, {}).values())

    def nodes(self) -> list[str]:
        with self._lock:
            return [n for n, s in self._by_node.items() if s]

    def stored(self, obj: Obj) -> None:
        """What a create or update of ours returned: newer than the store until the watch says otherwise."""
        self._apply("MODIFIED", obj)

    def removed(self, name: str) -> None:
        """A slice we deleted: gone, whatever older event for it still arrives."""
        with self._lock:
            node = self._node_of.pop(name, None)
            old = self._by_node.get(node or "", {}).pop(name, None)
            if old is not None and (rv := _rv(old)) is not None:
                self._gone[name] = rv

    def wait_for(self, pred: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``pred()`` (checked after every event, bookmark and list) holds; for tests and benches."""
        with self._changed:
            return self._changed.wait_for(lambda: pred() or self._stop.is_set(), timeout) and not self._stop.is_set()

    # ----- store

    def _replace(self, items: Iterable[Obj], version: str) -> set[str]:
        fresh: dict[str, dict[str, Obj]] = {}
        for obj in items:
            node = str((obj.get("spec") or {}).get("nodeName") or "")
            fresh.setdefault(node, {})[str(obj["metadata"]["name"])] = obj
        listed = int(version) if version.isdigit() else None
        with self._lock:
            # A write of ours that the list (begun earlier) missed stays until the watch reports on it.
            for n, objs in self._by_node.items():
                for name, obj in objs.items():
                    if _older(listed, _rv(obj)) and name not in fresh.get(n, {}):
                        fresh.setdefault(n, {})[name] = obj
            changed = {n for n in set(fresh) | set(self._by_node)
                       if {k: _rv(v) for k, v in fresh.get(n, {}).items()}
                       != {k: _rv(v) for k, v in self._by_node.get(n, {}).items()}}
            self._by_node = fresh
            self._node_of = {name: n for n, objs in fresh.items() for name in objs}
            self._gone.clear()
            self._version = version
        return changed

    def _apply(self, kind: str, obj: Obj) -> str | None:
        """Merge one event (or our own write); returns the node whose slices changed, None for a stale one."""
        meta = obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        if not name:
            return None
        node = str((obj.get("spec") or {}).get("nodeName") or "")
        rv = _rv(obj)
        with self._lock:
            where = self._node_of.get(name)
            have = self._by_node.get(where, {}).get(name) if where is not None else None
            if have is not None and _older(rv, _rv(have)):
                return None  # an echo of something we already stored a newer version of
            if kind == "DELETED":
                if where is not None:
                    self._by_node[where].pop(name, None)
                    del self._node_of[name]
                if rv is not None:
                    self._gone[name] = rv
                return node if have is not None else None
            if name in self._gone and not _older(self._gone[name], rv):
                return None  # older than its deletion
            self._gone.pop(name, None)
            if where is not None and where != node:
                self._by_node[where].pop(name, None)
            self._by_node.setdefault(node, {})[name] = obj
            self._node_of[name] = node
        return node

    def _notify(self, nodes: Iterable[str]) -> None:
        for node in nodes:
            for cb in self._subscribers:
                try:
                    cb(node)
                except Exception:
                    log.exception("slice watch subscriber failed for node %s", node)
        with self._changed:
            self._changed.notify_all()

    # ----- the watch

    def _run(self) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            try:
                if not self._version:
                    self.relist()
                    log.debug("listed slices %s at resourceVersion %s", self.field_selector, self._version)
                self._watch_once()
                backoff = 1.0
            except KubeError as e:
                if e.status == 410:
                    log.info("slices %s: resourceVersion expired (410 Gone); listing again", self.field_selector)
                    self._version = ""
                    continue
                log.warning("watching ResourceSlices %s failed (%s); retrying in %.0fs", self.field_selector, e,
                            backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
            except Exception:
                log.exception("unexpected error watching ResourceSlices %s", self.field_selector)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _watch_once(self) -> None:
        """One watch request, until the server ends it; every event moves the resume version on."""
        self.watches += 1
        timeout = random.randint(*self.watch_timeout)
        for event in self.kube.watch(slices_path(), self._version, timeout, self.field_selector):
            obj: dict[str, Any] = event.get("object") or {}
            version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
            kind = str(event.get("type"))
            if kind == "BOOKMARK":
                self.bookmarks += 1
                self._version = version or self._version
                self._notify(())
            elif kind in ("ADDED", "MODIFIED", "DELETED"):
                self.events += 1
                node = self._apply(kind, obj)
                self._version = version or self._version
                self._notify(() if node is None else (node,))
            if self._stop.is_set():
                return
