"""Whether an ordinary pod can land on a node now (pure).

The inventory and the controller's availability report both leave a node's free GPUs out of "what fits
now" when it cannot take pods, so both ask here.
"""

from __future__ import annotations

from typing import Any

from topodra.fleet.taints import BLOCKING_EFFECTS

Obj = dict[str, Any]


def node_schedulable(node: Obj) -> bool:
    """Ready, not cordoned, no NoSchedule/NoExecute node taint (a pod without special tolerations fits)."""
    return not why_unschedulable(node)


def why_unschedulable(node: Obj) -> str:
    """The first reason a node takes no pods (``""`` when it is schedulable): cordoned, not Ready, tainted."""
    spec, status = node.get("spec") or {}, node.get("status") or {}
    if spec.get("unschedulable"):
        return "cordoned"
    if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []):
        return "not Ready"
    for t in spec.get("taints") or []:
        if t.get("effect") in BLOCKING_EFFECTS:
            return f"tainted {t.get('key', '')}:{t.get('effect')}"
    return ""
