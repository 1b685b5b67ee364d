"""The kit's one user-facing failure, shared by every module so none has to import the cluster."""

from __future__ import annotations


class ClusterError(RuntimeError):
    """A clear, user-facing failure: which component, what happened, the log tail."""
