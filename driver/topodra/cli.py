"""The ``topodra`` command: a thin dispatcher to one module per subcommand.

Each subcommand module exposes ``configure(parser)`` and ``run(args) -> int``;
they are imported lazily so ``topodra kubelet-plugin`` never pays for the
controller's imports and vice versa.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "kubelet-plugin": ("topodra.plugin.main", "run the per-node kubelet DRA plugin"),
    "simulate": ("topodra.simulate", "publish ResourceSlices for a simulated cluster of kubelet-less nodes"),
    "controller": ("topodra.controller.main", "run the ClaimProfile controller"),
    "deviceclasses": ("topodra.deviceclasses", "generate DeviceClasses from the cluster's ResourceSlices"),
    "kueue": ("topodra.controller.kueuecli", "render a Kueue-mode ClaimProfile as ResourceFlavors and pod fields"),
    "discover": ("topodra.hardware.cli", "print the devices discovered on this host (or a mock profile)"),
    "placement-scorer": ("topodra.placement.main",
                         "run the fragmentation-aware kube-scheduler extender (prioritize only)"),
    "inventory": ("topodra.clusterview.main",
                  "show free/allocated/tainted GPUs per node, NVLink domain and rail (read-only; --png, --serve)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="topodra", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = next((a for a in argv if a in SUBCOMMANDS), None)
    modules = {}
    for name, (mod, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:
            modules[name] = importlib.import_module(mod)
            modules[name].configure(p)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    rc: int = modules[args.command].run(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
