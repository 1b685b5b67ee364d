"""A scripted API for informer tests (``topodra.informer``): lists and watch streams per path, no server.

Unit tests of the scorer's cache and the controller's watched facts drive the same list + watch loop with it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from topodra.kube import Kube, KubeError, Obj


class ScriptedKube(Kube):
    """An API stand-in for the informer loop: lists and watch streams are scripted per path."""

    def __init__(self, script: dict[str, list[Any]]) -> None:  # no transport: nothing is sent
        self.script = script
        self.calls: list[tuple[str, str]] = []
        self.idle = threading.Event()

    def _next(self, path: str) -> Any:
        steps = self.script.get(path) or []
        if not steps:
            self.idle.wait()  # nothing more scripted: block like a quiet watch
            raise KubeError(0, "Closed", "test over")
        return steps.pop(0)

    def list_snapshot(self, path: str, field_selector: str | None = None) -> tuple[tuple[Obj, ...], str]:
        self.calls.append(("list", path))
        step = self._next(path)
        if step[0] == "fail":  # ("fail", status): the API server answers an error
            raise KubeError(step[1], "Failed", f"scripted failure {step[1]}")
        assert step[0] == "list", (path, step)
        return tuple(step[1]), step[2]

    def watch(self, path: str, resource_version: str, timeout_seconds: int = 300,
              field_selector: str | None = None) -> Iterator[Obj]:
        self.calls.append((f"watch@{resource_version}", path))
        step = self._next(path)
        if step[0] == "gone":
            raise KubeError(410, "Expired", "too old resource version")
        assert step[0] == "watch", (path, step)
        yield from step[1]
