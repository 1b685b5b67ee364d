"""``topodra discover``: print what discovery finds on this host, a mock profile or a replay.

``--capture FILE`` records this host's NVML answers and sysfs facts as a replay
fixture (tests/fixtures/hardware/README.md) instead of printing devices.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Any

import yaml

from topodra.devices import Device
from topodra.hardware import DiscoveryError, load_backend


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hardware", default="nvml", help="nvml | mock:<profile or path> | replay:<path>")
    parser.add_argument("--node-name", default=os.environ.get("NODE_NAME") or socket.gethostname())
    parser.add_argument("--output", choices=("yaml", "json", "table"), default="table")
    parser.add_argument("--sysfs-root", default=None, help="root of the sysfs tree to read (default /)")
    parser.add_argument("--nvidia-driver-root", default=None, metavar="DIR",
                        help="--hardware nvml: load libnvidia-ml.so.1 from this driver root (default /)")
    parser.add_argument("--overrides", default=None, help="YAML/JSON file with discovery overrides")
    parser.add_argument("--capture", default=None, metavar="FILE", help="write a replay fixture of this host")


def _as_dict(d: Device) -> dict[str, Any]:
    return {
        "name": d.name,
        "kind": d.kind,
        "attributes": {k: v.to_api() for k, v in d.attributes.items()},
        "capacity": {k: {"value": v} for k, v in d.capacity.items()},
    }


def table(devices: list[Device]) -> str:
    cols = ("name", "model", "pciBusID", "numaNode", "nvlinkDomain", "rail", "nicName", "nicDistance")
    rows: list[tuple[str, ...]] = [cols]
    for d in devices:
        a = {k.rsplit("/", 1)[-1]: str(v.value) for k, v in d.attributes.items()}
        model = a.get("model", a.get("rdmaDevice", ""))
        rows.append((d.name, model, *(a.get(c, "-") for c in cols[2:])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _capture(args: argparse.Namespace) -> int:
    import pynvml

    from topodra.hardware import nvmllib
    from topodra.hardware.nvml import normalize_bus_id
    from topodra.hardware.replay import ReplayFixture, capture_nvml, capture_sysfs, dump_fixture

    nvmllib.load(args.nvidia_driver_root or "/", pynvml)
    facts = capture_nvml(pynvml)
    bdfs = [normalize_bus_id(g.pci.busId) for g in facts.gpus if not hasattr(g.pci, "error")]
    fx = ReplayFixture(
        synthetic=False,
        description=f"captured by topodra discover --capture on {args.node_name}",
        node=args.node_name,
        nvml=facts,
        sysfs=capture_sysfs(args.sysfs_root or "/", bdfs),
    )
    with open(args.capture, "w", encoding="utf-8") as f:
        f.write(dump_fixture(fx))
    print(f"wrote {args.capture}: {len(facts.gpus)} GPU(s)")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        if args.capture:
            return _capture(args)
        overrides: dict[str, Any] | None = None
        if args.overrides:
            with open(args.overrides, encoding="utf-8") as f:
                loaded = yaml.safe_load(f)
            if not isinstance(loaded, dict):
                raise ValueError(f"{args.overrides}: overrides must be a mapping")
            overrides = loaded
        backend = load_backend(args.hardware, args.node_name, sysfs_root=args.sysfs_root, overrides=overrides,
                               nvidia_driver_root=args.nvidia_driver_root)
        devices = backend.discover()
    except (DiscoveryError, ValueError, OSError) as e:
        print(f"topodra discover: {e}", file=sys.stderr)
        return 1
    if args.output == "json":
        print(json.dumps([_as_dict(d) for d in devices], indent=2))
    elif args.output == "yaml":
        print(yaml.safe_dump([_as_dict(d) for d in devices], sort_keys=False), end="")
    else:
        print(table(devices))
    return 0
