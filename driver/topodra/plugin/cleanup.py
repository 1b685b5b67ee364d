"""Release claims nothing uses any more, and sweep orphan CDI specs; on start and periodically.

The kubelet unprepares a claim when its last pod on the node is gone, but if the
plugin was down then (or the node was drained and the kubelet state lost), the
claim can stay in the checkpoint and keep its devices busy after the
ResourceClaim is deleted.  The same holds for an unprepare whose checkpoint
rename a power loss undid: unprepare fsyncs the checkpoint's data but not its
directory (docs/prepare.md, *Durability*), and the kubelet never repeats an
unprepare it saw succeed.  This loop reads each checkpointed claim from the API
server **outside the prepare lock**; ``claims.release_reason`` decides (deleted,
replaced, no longer allocated, or allocated other devices), and only those go
to ``DeviceState.cleanup``, which unprepares them the normal way and deletes
orphan specs under the lock, keeping any claim a prepare answered after the
reads began.  A claim whose read fails is left alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from topodra.claims import ClaimRef, HeldDevice, release_reason

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_SECONDS = 300.0

ClaimGetter = Callable[[str, str], dict[str, Any] | None]


class CleanableState(Protocol):
    """What the loop needs from ``topodra.state.DeviceState``."""

    driver_name: str

    def held_devices(self) -> dict[str, tuple[ClaimRef, frozenset[HeldDevice]]]: ...

    def prepare_mark(self) -> int: ...

    def cleanup(self, stale: Sequence[ClaimRef], since: int | None = None) -> tuple[dict[str, str], list[str]]: ...


@dataclass(frozen=True)
class CleanupReport:
    """One pass: what was unprepared, what could not be read, which orphan specs went."""

    unprepared: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)
    orphans_removed: list[str] = field(default_factory=list)


def cleanup_once(state: CleanableState, getter: ClaimGetter) -> CleanupReport:
    """One pass: API reads first, with no lock held; then the state acts on the stale claims."""
    stale: list[ClaimRef] = []
    reasons: dict[str, str] = {}
    unreadable: dict[str, str] = {}
    mark = state.prepare_mark()  # before the reads: a claim prepared again after them is kept
    for ref, held in state.held_devices().values():
        try:
            obj = getter(ref.namespace, ref.name)
        except Exception as e:  # apiserver down, forbidden, ...: decide next time
            unreadable[ref.uid] = str(e)
            continue
        reason = release_reason(ref, obj, held, state.driver_name)
        if reason is not None:
            stale.append(ref)
            reasons[ref.uid] = reason
    answers, orphans = state.cleanup(stale, since=mark)
    unprepared = sorted(uid for uid, err in answers.items() if not err)
    failed = {uid: err for uid, err in answers.items() if err}
    for ref in stale:
        if ref.uid in unprepared:
            log.warning("unprepared claim=%s while it was prepared: %s", ref, reasons[ref.uid])
    for uid, err in failed.items():
        log.error("cleanup could not unprepare claim uid=%s: %s", uid, err)
    if unreadable:
        log.info("cleanup skipped claims it could not read: %s", unreadable)
    return CleanupReport(unprepared=unprepared, failed=failed, unreadable=unreadable, orphans_removed=orphans)


class CleanupLoop:
    """Runs ``cleanup_once`` now and every ``interval`` seconds in a daemon thread until ``stop``."""

    def __init__(self, state: CleanableState, getter: ClaimGetter, interval: float) -> None:
        self._state = state
        self._getter = getter
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="claim-cleanup", daemon=True)
        self.passes = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                cleanup_once(self._state, self._getter)
            except Exception:  # a corrupt checkpoint or a bug: log, keep serving the kubelet, try again later
                log.exception("claim cleanup pass failed")
            self.passes += 1
            if not self._interval or self._stop.wait(self._interval):
                return
