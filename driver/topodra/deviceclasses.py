"""``topodra deviceclasses generate``: the DeviceClass catalog (``topodra.classcatalog``) as YAML.

The files under ``deviceclasses/`` are the output of
``topodra deviceclasses generate --all --write-dir deviceclasses``; a test keeps them in sync with the
catalog.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from topodra import DEFAULT_DRIVER_NAME
from topodra.classcatalog import (
    catalog,
    classes_for_models,
    inventory,
    mig_sizes,
    shared_gpus_published,
    to_device_class,
)

log = logging.getLogger(__name__)

class _Dumper(yaml.SafeDumper):
    """Multi-line strings (our CEL) as literal blocks, so the files read naturally."""


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str_presenter)


def dump(obj: dict[str, Any]) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=120)


def dump_all(objs: Iterable[dict[str, Any]]) -> str:
    return "---\n".join(dump(o) for o in objs)


def file_name(obj: dict[str, Any]) -> str:
    return f"{obj['metadata']['name']}.yaml"


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    gen = sub.add_parser("generate", help="print DeviceClass YAML for the GPU models in the cluster")
    gen.add_argument("--kubeconfig", help="kubeconfig of the cluster to read ResourceSlices from")
    gen.add_argument("--driver-name", default=DEFAULT_DRIVER_NAME)
    gen.add_argument("--all", action="store_true", help="the whole catalog; do not read the cluster")
    gen.add_argument("--write-dir", help="write one file per class into this directory instead of stdout")


def run(args: argparse.Namespace) -> int:
    if args.all:
        objs = [to_device_class(s, args.driver_name) for s in catalog(args.driver_name)]
    else:
        from topodra.apipaths import slices_path
        from topodra.kube import Kube, KubeError

        try:
            kube = Kube.from_kubeconfig(args.kubeconfig)
        except Exception as e:  # the client raises ConfigException, OSError, ValueError...
            print(f"error: cannot list ResourceSlices: bad kubeconfig: {e}", file=sys.stderr)
            return 1
        try:
            slices = list(kube.list(slices_path(), field_selector=f"spec.driver={args.driver_name}"))
        except KubeError as e:
            print(f"error: cannot list ResourceSlices: {e}", file=sys.stderr)
            return 1
        finally:
            kube.close()
        models, has_nic = inventory(slices, args.driver_name)
        if not models:
            print(f"error: no GPUs of driver {args.driver_name} are published (no ResourceSlices); "
                  "use --all for the whole catalog", file=sys.stderr)
            return 1
        log.info("models present: %s; NICs: %s", ", ".join(sorted(models)), has_nic)
        objs = classes_for_models(models, with_nic=has_nic, mig_sizes=mig_sizes(slices, args.driver_name),
                                  with_shared=shared_gpus_published(slices, args.driver_name),
                                  driver=args.driver_name)
    if args.write_dir:
        out = Path(args.write_dir)
        out.mkdir(parents=True, exist_ok=True)
        for obj in objs:
            (out / file_name(obj)).write_text(dump(obj))
        print(f"wrote {len(objs)} DeviceClasses to {out}", file=sys.stderr)
    else:
        sys.stdout.write(dump_all(objs))
    return 0
