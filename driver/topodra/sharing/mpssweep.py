"""Stray MPS daemon pods: this node's daemon pods whose claim no checkpoint entry records any more.

Which pods unprepare still has to delete lives in the plugin's memory only (``MpsDaemons._doomed``), and a
daemon that could not be stopped is not in it at all.  So a crash between a daemon's ``quit`` and its pod's
delete, an API error that outlasts the process, or a failed stop leaves a pod that nothing deletes, holding its
``/dev/shm`` files and, if still serving, GPU memory.  The plugin sweeps them at start (recovery) and after an
unprepare failed, outside the node lock (these are API calls).

Only pods that carry topodra's own daemon-pod labels for this node, are bound to it, and are named after their
claim are touched; everything else in the namespace is left alone.  The pods are listed before the checkpoint
is read: a pod exists only after its claim was recorded (``launch_pod`` runs after the prepare's commit), so a
claim prepared meanwhile is in the checkpoint read afterwards and its pod is kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable

from topodra.kube import KubeError
from topodra.sharing.mpspod import APP_LABEL, CLAIM_LABEL, NODE_LABEL, Obj, PodApi, node_label, pod_name, pods_path

log = logging.getLogger(__name__)


def selector(node: str) -> str:
    """The label selector of this node's daemon pods."""
    return f"{APP_LABEL[0]}={APP_LABEL[1]},{NODE_LABEL}={node_label(node)}"


def strays(pods: Iterable[Obj], node: str, recorded: Collection[str]) -> list[tuple[str, str]]:
    """(claim UID, pod name) of the daemon pods of ``node`` whose claim is not in ``recorded`` (pure).  A pod
    without every mark of ours (labels, binding, name) is not ours to delete, whatever the selector matched."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        uid = labels.get(CLAIM_LABEL)
        ours = (labels.get(APP_LABEL[0]) == APP_LABEL[1] and labels.get(NODE_LABEL) == node_label(node)
                and (pod.get("spec") or {}).get("nodeName") == node and uid and meta.get("name") == pod_name(uid))
        if ours and uid not in recorded:
            out.append((str(uid), str(meta["name"])))
    return sorted(out)


def sweep(api: PodApi, namespace: str, node: str,
          recorded: Callable[[], Collection[str]]) -> tuple[list[str], dict[str, str]]:
    """Delete this node's stray daemon pods; (claim UIDs whose pod was deleted, claim UID -> error).  A list
    that fails is the error of key ``""``.  Never raises: the caller logs and tries again later."""
    try:
        pods = list(api.list(pods_path(namespace), label_selector=selector(node)))
        keep = set(recorded())  # after the list, never before it (see above)
    except Exception as e:  # KubeError, or an unreadable checkpoint
        return [], {"": f"cannot list the MPS daemon pods of node {node} in {namespace}: {e}"}
    deleted: list[str] = []
    errors: dict[str, str] = {}
    pod_uids = {(p.get("metadata") or {}).get("name"): (p.get("metadata") or {}).get("uid") for p in pods}
    for uid, name in strays(pods, node, keep):
        try:
            # Only the pod that was listed: a claim unprepared and prepared again (same claim UID, so the same
            # pod name) between the list and the checkpoint read has a new daemon pod, which is not stray.
            api.delete(pods_path(namespace, name), uid=pod_uids.get(name) or None)
        except KubeError as e:
            if e.conflict:
                log.info("claim %s: MPS daemon pod %s/%s was re-created since the sweep listed it; kept", uid,
                         namespace, name)
                continue
            errors[uid] = f"cannot delete stray MPS daemon pod {namespace}/{name}: {e}"
            continue
        except Exception as e:
            errors[uid] = f"cannot delete stray MPS daemon pod {namespace}/{name}: {e}"
            continue
        log.warning("claim %s: deleted stray MPS daemon pod %s/%s (no prepared claim records it)", uid,
                    namespace, name)
        deleted.append(uid)
    return deleted, errors
