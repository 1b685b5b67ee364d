"""The kube-scheduler configuration the harness runs: a user's KubeSchedulerConfiguration, our credentials,
and optionally topodra's placement scorer as a prioritize-only extender. Pure."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from testkit.errors import ClusterError

SCHEDULER_CONFIG_API = "kubescheduler.config.k8s.io/v1"
# Extender scores are 0..10 and the scheduler multiplies them by weight * 10 (MaxNodeScore /
# MaxExtenderPriority). With weight 5 one step of the scorer's scale is worth 50 points: more than the
# whole spread LeastAllocated + BalancedAllocation put between nodes that differ by one GPU job's
# CPU/memory share (a few points each), yet the full 0..10 range (500) does not outweigh a required
# filter -- extenders never override filters -- only the default scores.
SCHEDULER_EXTENDER_WEIGHT = 5


def extender_stanza(url: str, weight: int = SCHEDULER_EXTENDER_WEIGHT) -> dict[str, Any]:
    """The ``extenders[]`` entry for topodra's placement scorer: prioritize only, never a veto."""
    if not url.startswith(("http://", "https://")):
        raise ClusterError(f"scheduler extender URL must start with http:// or https://, got {url!r}")
    return {"urlPrefix": url.rstrip("/"), "prioritizeVerb": "prioritize", "weight": weight,
            "nodeCacheCapable": True, "ignorable": True, "httpTimeout": "1s", "enableHTTPS": False}


def scheduler_configuration(base: dict[str, Any] | None, kubeconfig: Path,
                            extender: str | None = None) -> dict[str, Any]:
    """The KubeSchedulerConfiguration the harness runs: ``base`` plus our kubeconfig (and extender).

    ``base`` may tune ``clientConnection`` (``qps``, ``burst``) but not set its
    ``kubeconfig``: the harness owns the credentials.
    """
    cfg: dict[str, Any] = copy.deepcopy(base) if base else {
        "apiVersion": SCHEDULER_CONFIG_API, "kind": "KubeSchedulerConfiguration"}
    if not isinstance(cfg, dict) or cfg.get("kind") != "KubeSchedulerConfiguration" \
            or cfg.get("apiVersion") != SCHEDULER_CONFIG_API:
        raise ClusterError(f"scheduler config must be a KubeSchedulerConfiguration of apiVersion "
                           f"{SCHEDULER_CONFIG_API}, got kind={cfg.get('kind') if isinstance(cfg, dict) else cfg!r} "
                           f"apiVersion={cfg.get('apiVersion') if isinstance(cfg, dict) else None!r}")
    conn = cfg.get("clientConnection") or {}
    if not isinstance(conn, dict) or "kubeconfig" in conn:
        raise ClusterError("scheduler config must not set clientConnection.kubeconfig: the harness fills it in")
    cfg["clientConnection"] = {**conn, "kubeconfig": str(kubeconfig)}
    cfg.setdefault("leaderElection", {"leaderElect": False})
    if extender:
        cfg["extenders"] = [*(cfg.get("extenders") or []), extender_stanza(extender)]
    return cfg
