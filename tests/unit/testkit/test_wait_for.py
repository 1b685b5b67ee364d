"""``wait_for``: a predicate's AssertionError is its verdict and ends the wait at once; other errors are
transient and retried until the timeout, which names the last one."""

from __future__ import annotations

import time

import pytest
from testkit.handle import KubectlError, wait_for

from topodra.kube import KubeError


def test_assertion_in_the_predicate_fails_at_once_not_after_the_timeout() -> None:
    calls: list[float] = []

    def pod_failed() -> bool:
        calls.append(time.monotonic())
        if len(calls) == 2:
            raise AssertionError("pod ns/p Failed: exit code 1")
        return False

    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="pod ns/p Failed") as info:
        wait_for(pod_failed, 600, "pod ns/p running", interval=0.01)
    assert len(calls) == 2, "polled after the verdict"
    assert "timed out" not in str(info.value)
    assert time.monotonic() - t0 < 60  # the 600 s timeout did not run out


def test_transient_errors_are_retried_until_the_predicate_holds() -> None:
    errors = [KubeError(0, "ConnectionRefusedError", "connection refused"), KubectlError("NotFound")]

    def ready() -> str | None:
        if errors:
            raise errors.pop(0)
        return "ready"

    assert wait_for(ready, 30, "ready", interval=0.01) == "ready"
    assert errors == []


def test_timeout_names_what_was_awaited_and_the_last_error() -> None:
    def never() -> None:
        raise KubeError(503, "Service Unavailable", "etcd leader changed")

    with pytest.raises(AssertionError, match=r"timed out after 0.2s waiting for the slice .*etcd leader changed"):
        wait_for(never, 0.2, "the slice", interval=0.01)


def test_a_failed_kubectl_is_transient_not_a_verdict() -> None:
    """ClusterHandle.kubectl raises KubectlError: inside wait_for a lookup of a not-yet-created object retries."""
    assert not issubclass(KubectlError, AssertionError)
