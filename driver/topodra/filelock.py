"""Exclusive advisory file locks (``fcntl.flock``) for cross-process serialization.

During a rolling upgrade two kubelet-plugin processes run on one node at the
same time and both receive NodePrepareResources/NodeUnprepareResources calls.
They share the checkpoint and the CDI directory, so every read-modify-write of
that state must hold one node-wide lock.  ``flock`` locks die with the process
(even on kill -9), so a crashed holder never leaves the node wedged.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from types import TracebackType

log = logging.getLogger(__name__)


class LockTimeout(Exception):
    """The lock was not acquired within the allowed time."""


class FileLock:
    """An exclusive ``flock`` on ``path``; use as a context manager.

    The lock file is created if needed and never deleted: deleting it would let
    a later process lock a fresh inode while an older one still holds the old.
    Not re-entrant; callers that need thread safety pair it with a
    ``threading.Lock`` (two ``open()`` calls in one process do conflict).
    """

    def __init__(self, path: str | os.PathLike[str], timeout: float | None = None,
                 poll_interval: float = 0.05) -> None:
        self.path = os.fspath(path)
        self.timeout = timeout
        self.poll_interval = poll_interval
        self._fd: int | None = None

    @property
    def locked(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Block until the lock is held (or raise ``LockTimeout`` after ``timeout`` s)."""
        if self._fd is not None:
            raise RuntimeError(f"lock {self.path} is already held by this object")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if self.timeout is None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            else:
                self._acquire_polling(fd, self.timeout)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _acquire_polling(self, fd: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeout(
                        f"could not lock {self.path} within {timeout:.1f}s; another topodra "
                        "plugin process on this node holds it") from None
                time.sleep(self.poll_interval)

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
