"""One list + watch loop per kind, feeding a caller's store: the scorer's cache and the controller's facts.

Each source's thread lists its kind (remembering the list's resourceVersion), hands the items to the
store's ``replace``, then watches from that version and hands each event to ``apply``, resuming from the
last event's version when the server ends a watch.  A 410 Gone (the version fell out of the apiserver's
window) relists at once; other errors relist after a capped backoff.  Bookmarks only move the resume
version forward.  Both callbacks run under the informer's lock, so the store needs no lock of its own.

An ``optional`` source (an API served only with a feature gate, or not granted: DeviceTaintRules,
PodGroups) whose list answers 403/404 counts as listed with no objects and is retried every
``optional_retry`` seconds, so a reader that waits for the sync still becomes ready.

This lives below ``placement/`` and ``controller/`` so both watch with the same code (one informer).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from topodra.kube import Kube, KubeError, Obj

log = logging.getLogger(__name__)

OPTIONAL_RETRY = 60.0  # seconds between tries of an optional kind's API that was missing or forbidden


@dataclass(frozen=True)
class Source:
    kind: str
    path: str
    field_selector: str | None = None
    optional: bool = False  # 403/404 on list: no objects of this kind (older clusters, narrower RBAC)


def settle_heap() -> None:
    """After a relist the listed objects are long-lived: move everything alive now out of the cyclic
    collector's sight (``gc.freeze``, O(1)). Else a full collection walks them all in the middle of some
    later request: 260 ms at 2,048 nodes, the whole of the scorer's p99 there (issue 22). Frozen
    objects are still freed by reference counting when a later relist or event drops them."""
    gc.freeze()


_pause_lock = threading.Lock()
_pauses = 0
_resume = False  # whether the collector was enabled when the first pause began


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection while a big list is decoded and parsed (threads may overlap: the last one out
    re-enables it, if it was enabled). Decoding creates millions of dicts, each allocation burst triggers a
    collection that walks the young ones: replaying a 2,048-node controller list (24 MiB of slices), 1,178
    collections took 0.6-1.0 s of the 1.6-2.0 s CPU; paused, 0.57-0.97 s in all (tmp replay, load 7)."""
    global _pauses, _resume
    with _pause_lock:
        if _pauses == 0:
            _resume = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _resume:
                gc.enable()


Replace = Callable[[str, Sequence[Obj]], None]
Apply = Callable[[str, str, Obj], None]


class Informer:
    """Watched kinds behind one lock, fed by one daemon thread per source.

    ``replace(kind, items)``: a fresh list of the kind; ``apply(kind, event_type, obj)``: one ADDED,
    MODIFIED or DELETED event.  ``after_relist(kind)`` runs after each list, outside the lock.
    Sources may be added after ``start`` (``add``): a kind only some readers need is watched from then on.
    """

    def __init__(self, kube: Kube, sources: Iterable[Source], replace: Replace, apply: Apply,
                 watch_timeout: int = 300, after_relist: Callable[[str], None] | None = None,
                 optional_retry: float = OPTIONAL_RETRY, clock: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.clock = clock
        # kind -> when its list/watch started failing (clock()); gone at its next successful list. A watch that
        # ends quietly is no failure: a kind with no changes for an hour is as fresh as one with many.
        self._failing: dict[str, float] = {}
        self.lock = threading.Lock()
        self.watch_timeout = watch_timeout
        self.optional_retry = optional_retry
        self.stop = threading.Event()
        self.events = 0
        self.errors: dict[str, str] = {}  # kind -> why its last list or watch failed (until it lists again)
        self._replace = replace
        self._apply = apply
        self._after_relist = after_relist
        self._sources: dict[str, Source] = {}
        self._synced: dict[str, threading.Event] = {}
        self._threads: list[threading.Thread] = []
        self._started = False
        for src in sources:
            self._register(src)

    def _register(self, src: Source) -> None:
        if src.kind in self._sources:
            raise ValueError(f"kind {src.kind!r} is watched already")
        self._sources[src.kind] = src
        self._synced[src.kind] = threading.Event()

    def _spawn(self, src: Source) -> None:
        t = threading.Thread(target=self._run, args=(src,), name=f"watch-{src.kind}", daemon=True)
        t.start()
        self._threads.append(t)

    def start(self) -> None:
        self._started = True
        for src in list(self._sources.values()):
            self._spawn(src)

    def add(self, src: Source) -> None:
        """Watch one more kind (started at once when the informer runs already)."""
        self._register(src)
        if self._started:
            self._spawn(src)

    def watches(self, kind: str) -> bool:
        return kind in self._sources

    def synced(self, kinds: Iterable[str] | None = None) -> bool:
        return all(self._synced[k].is_set() for k in (self._synced if kinds is None else kinds))

    def wait_synced(self, timeout: float, kinds: Iterable[str] | None = None) -> bool:
        deadline = time.monotonic() + timeout
        events = [self._synced[k] for k in (self._synced if kinds is None else kinds)]
        return all(e.wait(max(0.0, deadline - time.monotonic())) for e in events)

    def stale(self, max_age: float) -> dict[str, float]:
        """Kind -> seconds its list/watch has been failing, for the kinds failing longer than ``max_age``: the view
        of those kinds may be that old (or older: the last event seen before the failure)."""
        now = self.clock()
        return {k: now - t for k, t in sorted(self._failing.items()) if now - t > max_age}

    def close(self) -> None:
        self.stop.set()

    def join(self, timeout: float = 5.0) -> None:
        for t in self._threads:
            t.join(timeout)

    def _run(self, src: Source) -> None:
        backoff = 1.0
        while not self.stop.is_set():
            try:
                with gc_paused():
                    items, version = self.kube.list_snapshot(src.path, src.field_selector)
                    with self.lock:
                        self._replace(src.kind, items)
                if self._after_relist:
                    self._after_relist(src.kind)
                self.errors.pop(src.kind, None)
                self._failing.pop(src.kind, None)
                self._synced[src.kind].set()
                log.info("listed %d %s at resourceVersion %s", len(items), src.kind, version)
                while not self.stop.is_set():
                    for event in self.kube.watch(src.path, version, self.watch_timeout, src.field_selector):
                        obj = event.get("object") or {}
                        version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                        if event.get("type") == "BOOKMARK":
                            continue
                        with self.lock:
                            self._apply(src.kind, str(event.get("type")), obj)
                            self.events += 1
                        if self.stop.is_set():
                            return
                    backoff = 1.0
            except KubeError as e:
                if self.stop.is_set():
                    return  # closed: the server going away now is no failure to report or retry
                self.errors[src.kind] = str(e)
                if src.optional and e.status in (403, 404):
                    with self.lock:
                        self._replace(src.kind, [])
                    if not self._synced[src.kind].is_set():
                        log.info("%s: API not available (%s); counting none, retrying every %.0fs",
                                 src.kind, e.status, self.optional_retry)
                    self._synced[src.kind].set()
                    self.stop.wait(self.optional_retry)
                    continue
                if e.status == 410:
                    log.info("%s: resourceVersion expired (410 Gone); relisting", src.kind)
                    continue
                self._failing.setdefault(src.kind, self.clock())
                log.warning("%s: list/watch failed (%s); retrying in %.0fs", src.kind, e, backoff)
                self.stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
