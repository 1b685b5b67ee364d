"""``topodra kueue render``: a Kueue-mode ClaimProfile as the objects and pod fields Kueue needs.

Prints YAML: one ResourceFlavor per GPU model the profile allows (in preference order, the order to list
them in a ClusterQueue), then the pod template with the queue label, the ``gpu.topodra.io/gpu`` request
and the model affinity.  What Kueue mode cannot honour goes to stderr; a profile Kueue cannot admit at
all exits 1 with the reason.  Reads nothing from a cluster unless ``--kubeconfig`` is given (then the
cluster's DeviceClasses add models for classes outside the catalog).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from topodra.controller.kueue import KueueUnsupported, class_models_from, plan, resource_flavor
from topodra.controller.profile import ClaimProfile, ProfileError


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    r = sub.add_parser("render", help="print ResourceFlavors and the pod template for a Kueue-mode ClaimProfile")
    r.add_argument("profile", help="ClaimProfile YAML file (spec.queueing: Kueue)")
    r.add_argument("--pod-template", help="pod template YAML to add the fields to (default: one busybox container)")
    r.add_argument("--kubeconfig", help="read DeviceClasses from this cluster for classes outside the catalog")


def _load(path: str) -> dict[str, Any]:
    try:
        obj = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ProfileError(f"cannot read {path}: {e}") from None
    if not isinstance(obj, dict):
        raise ProfileError(f"{path} holds no YAML object")
    return obj


def _cluster_classes(kubeconfig: str) -> list[dict[str, Any]]:
    from topodra.apipaths import device_class_path
    from topodra.kube import Kube

    kube = Kube.from_kubeconfig(kubeconfig)
    try:
        return list(kube.list(device_class_path()))
    finally:
        kube.close()


def run(args: argparse.Namespace) -> int:
    try:
        body = _load(args.profile)
        meta = body.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        profile = ClaimProfile.from_api(body)
        template = _load(args.pod_template) if args.pod_template else {"spec": {"containers": [
            {"name": "main", "image": "busybox", "command": ["sleep", "infinity"]}]}}
        classes = _cluster_classes(args.kubeconfig) if args.kubeconfig else []
        p = plan(profile, class_models_from(classes))
        pod = p.pod_template(template)
    except (ProfileError, KueueUnsupported, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # the client raises ConfigException, OSError, KubeError...
        print(f"error: cannot read DeviceClasses: {e}", file=sys.stderr)
        return 1
    for note in p.unsupported:
        print(f"note: {note}", file=sys.stderr)
    docs = [resource_flavor(m) for m in p.models] + [pod]
    sys.stdout.write("---\n".join(yaml.safe_dump(d, sort_keys=False) for d in docs))
    return 0
