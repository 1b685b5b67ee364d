"""The MPS control daemon of a claim in a pod of its own (``--mps-daemon=pod``), the way NVIDIA's DRA driver runs it.

A daemon started by the plugin lives in the plugin container's cgroup, so stopping that container (a restart or a
DaemonSet upgrade) kills it.  A pod per claim, bound to this node (``nodeName``, no scheduler), with no owner
reference (deleting or upgrading the plugin's DaemonSet must not delete it), runs ``<control> -f`` in the
foreground with the claim's pipe, log and tmpfs directories as hostPath mounts at the CUDA defaults, so the
claim's containers (the same host directories by CDI) and the daemon share one pipe and one ``/dev/shm``.

The plugin creates and deletes these pods through the API server, which it must never do holding the node lock:
the local half (dirs, tmpfs, compute mode, ``quit`` through the pipe) stays in ``MpsDaemons`` under the lock, and
this module is the other half, run after it (``effects.mps``).  Readiness is the pipe answering, as for a process.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from topodra.sharing.mpscontrol import MpsError

log = logging.getLogger(__name__)

CLAIM_LABEL = "topodra.io/mps-claim-uid"
APP_LABEL = ("app.kubernetes.io/name", "topodra-mps-daemon")
NODE_LABEL = "topodra.io/node"
CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"
CONTAINER_LOG_DIR = "/var/log/nvidia-mps"
CONTAINER_SHM_DIR = "/dev/shm"
READY_TIMEOUT_S = 30.0  # below the kubelet's prepare timeout; a slow pull fails this try, and the retry finds the pod
GONE_TIMEOUT_S = 60.0

Obj = dict[str, Any]


class PodApi(Protocol):
    """What this module needs of ``topodra.kube.Kube``."""

    def get(self, path: str) -> Obj | None: ...
    def create(self, path: str, obj: Obj) -> Obj: ...
    def delete(self, path: str, missing_ok: bool = True, uid: str | None = None) -> None: ...
    def list(self, path: str, label_selector: str | None = None,
             field_selector: str | None = None) -> Iterator[Obj]: ...  # the stray sweep (mpssweep)


def node_label(node: str) -> str:
    """The ``NODE_LABEL`` value of ``node``'s daemon pods: the name itself when it fits a label value (63
    characters), else ``sha256-`` and the first 56 hex digits of its SHA-256. A node name is a DNS subdomain of
    up to 253 characters, and a label value over 63 makes the API server refuse the pod (issue 31). The sweep
    also checks ``spec.nodeName``, so the label only narrows the list."""
    if len(node) <= 63:
        return node
    return "sha256-" + hashlib.sha256(node.encode()).hexdigest()[:56]


def pod_name(claim_uid: str) -> str:
    return f"topodra-mps-{claim_uid}"


def pods_path(namespace: str, name: str | None = None) -> str:
    base = f"/api/v1/namespaces/{namespace}/pods"
    return f"{base}/{name}" if name else base


def manifest(claim_uid: str, *, namespace: str, node: str, image: str, argv: Sequence[str],
             env: Mapping[str, str], pipe: Path, logs: Path, shm: Path,
             driver_root: tuple[str, str] | None = None, binary_file: str | None = None) -> Obj:
    """The daemon pod of one claim (pure).  ``driver_root``: (host path, path in the pod), mounted read-only with
    HostToContainer propagation so the binary path and preload the plugin computed hold inside the pod too.
    ``binary_file``: a control program named outside the driver root (``TOPODRA_MPS_CONTROL``), mounted
    read-only at its own path, so the pod runs the program the plugin was told to use."""
    mounts: list[Obj] = [{"name": "pipe", "mountPath": CONTAINER_PIPE_DIR},
                         {"name": "log", "mountPath": CONTAINER_LOG_DIR},
                         {"name": "shm", "mountPath": CONTAINER_SHM_DIR}]
    volumes: list[Obj] = [{"name": n, "hostPath": {"path": str(p), "type": "Directory"}}
               for n, p in (("pipe", pipe), ("log", logs), ("shm", shm))]
    if driver_root is not None:
        mounts.append({"name": "driver-root", "mountPath": driver_root[1], "readOnly": True,
                       "mountPropagation": "HostToContainer"})
        volumes.append({"name": "driver-root", "hostPath": {"path": driver_root[0], "type": "Directory"}})
    if binary_file is not None:
        mounts.append({"name": "control-binary", "mountPath": binary_file, "readOnly": True})
        volumes.append({"name": "control-binary", "hostPath": {"path": binary_file, "type": "File"}})
    full_env = {**env, "CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE_DIR, "CUDA_MPS_LOG_DIRECTORY": CONTAINER_LOG_DIR}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod_name(claim_uid), "namespace": namespace,
                     "labels": {APP_LABEL[0]: APP_LABEL[1], CLAIM_LABEL: claim_uid, NODE_LABEL: node_label(node)}},
        "spec": {
            "nodeName": node,
            "restartPolicy": "OnFailure",  # ``quit`` ends it for good; a crash is restarted by the kubelet
            "hostPID": True,  # the pid file then means what it says on the host (logs only: liveness is the pipe)
            "hostNetwork": True,  # it talks through the pipe only: no pod network (nor a CNI) needed
            "priorityClassName": "system-node-critical",
            "tolerations": [{"operator": "Exists"}],  # wherever the claim's GPU is, tainted or not
            "terminationGracePeriodSeconds": 10,
            "automountServiceAccountToken": False,  # the daemon never talks to the API server
            "containers": [{
                "name": "mps-control-daemon", "image": image, "imagePullPolicy": "IfNotPresent",
                "command": list(argv),
                "env": [{"name": k, "value": v} for k, v in sorted(full_env.items())],
                # root, as the plugin runs: the image's own user cannot make the control FIFO in the pipe dir
                "securityContext": {"privileged": True, "runAsUser": 0, "runAsGroup": 0},
                "volumeMounts": mounts,
            }],
            "volumes": volumes,
        },
    }


class MpsPods:
    """Create, find and delete the daemon pods of this node's claims (call without the node lock)."""

    def __init__(self, api: PodApi, namespace: str, node: str, image: str,
                 ready_timeout: float = READY_TIMEOUT_S, gone_timeout: float = GONE_TIMEOUT_S) -> None:
        self.api, self.namespace, self.node, self.image = api, namespace, node, image
        self.ready_timeout, self.gone_timeout = ready_timeout, gone_timeout

    def _path(self, claim_uid: str) -> str:
        return pods_path(self.namespace, pod_name(claim_uid))

    def ensure(self, claim_uid: str, pod: Obj, ready: Callable[[], bool | None]) -> None:
        """The claim's pod exists and its daemon answers (``ready``: the pipe; None = no answer yet).  A pod
        there already is kept (a retried prepare); one whose daemon ended (Succeeded/Failed) is made again."""
        try:
            current = self.api.get(self._path(claim_uid))
            if current is not None and (current.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                log.warning("claim %s: its MPS daemon pod ended (%s); making it again", claim_uid,
                            current["status"]["phase"])
                self.delete(claim_uid)
                current = None
            if current is None:
                try:
                    self.api.create(pods_path(self.namespace), pod)
                    log.info("claim %s: created MPS daemon pod %s/%s", claim_uid, self.namespace, pod_name(claim_uid))
                except Exception as e:  # a concurrent retry made it: keep that one
                    if not getattr(e, "conflict", False):
                        raise
        except MpsError:
            raise
        except Exception as e:  # KubeError: the message says which call failed
            raise MpsError(f"claim {claim_uid}: MPS daemon pod {self.namespace}/{pod_name(claim_uid)}: {e}") from e
        _wait(lambda: ready() is True, self.ready_timeout,
              f"claim {claim_uid}: the MPS daemon of pod {self.namespace}/{pod_name(claim_uid)} did not answer "
              "on its pipe")

    def delete(self, claim_uid: str) -> None:
        """Delete the claim's pod and wait until the API server no longer has it (missing: nothing to do)."""
        path = self._path(claim_uid)
        try:
            self.api.delete(path)
            _wait(lambda: self.api.get(path) is None, self.gone_timeout,
                  f"claim {claim_uid}: MPS daemon pod {self.namespace}/{pod_name(claim_uid)} is not gone")
        except MpsError:
            raise
        except Exception as e:
            raise MpsError(f"claim {claim_uid}: cannot delete MPS daemon pod {self.namespace}/"
                           f"{pod_name(claim_uid)}: {e}") from e
        log.info("claim %s: MPS daemon pod %s/%s deleted", claim_uid, self.namespace, pod_name(claim_uid))


def _wait(done: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise MpsError(f"{what} within {timeout:.0f} s")
        time.sleep(0.2)
