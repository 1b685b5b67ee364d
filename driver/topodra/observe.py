"""How core modules report what they did, without importing the plugin's metrics.

``state`` and ``publisher`` are core: they must not import the plugin (the edge).
They take an ``Observer`` and call it; the plugin's metrics module implements it
(``MetricsObserver``) with Prometheus metrics, and ``NO_OBSERVER`` (the default)
drops the calls, e.g. inside ``topodra simulate`` or in tests.
"""

from __future__ import annotations

from typing import Protocol


class Observer(Protocol):
    """Events the core reports; every method must be cheap and must not raise."""

    def prepared(self, claims: int, devices: int) -> None:
        """The checkpoint now holds ``claims`` prepared claims using ``devices`` devices."""

    def lock_held(self, operation: str, seconds: float) -> None:
        """The node-wide prepare lock was held for ``seconds`` by ``operation`` (prepare/unprepare/recover)."""

    def published(self, devices: int) -> None:
        """A ResourceSlice write for ``devices`` devices succeeded just now."""


class _NoObserver:
    def prepared(self, claims: int, devices: int) -> None:
        pass

    def lock_held(self, operation: str, seconds: float) -> None:
        pass

    def published(self, devices: int) -> None:
        pass


NO_OBSERVER: Observer = _NoObserver()
