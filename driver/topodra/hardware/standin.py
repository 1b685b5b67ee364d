"""The NVML stand-in's config: a mock profile's NVML answers in the form ``hack/nvml-standin`` (C) reads.

The stand-in ``libnvidia-ml.so.1`` serves the same ``NvmlFacts`` that ``FakeNvml`` serves, so one profile
gives the same hardware through both; this module only changes the shape (flat per-GPU keys, errors as
``{"error": Name}``). The facts already hold what real NVML answers (NVLink versions are the
``nvmlNvlinkVersion_t`` enum, mapped once in ``mockprofile.NVLINK_ENUM``), so nothing is translated here.

``python -m topodra.hardware.standin --profile dgx-h100 --node n1`` prints the config.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pydantic import BaseModel

from topodra.hardware.facts import NvmlErr, NvmlFacts
from topodra.hardware.mockprofile import Fabric, build_facts, load_profile

DEFAULT_FAULTS_FILE = "nvml-standin-faults.json"
DEFAULT_STATE_FILE = "nvml-standin.state"
# Where the driver's MIG capability files go, from the config's directory in a driver tree
# (DEST/usr/lib/x86_64-linux-gnu -> DEST/proc/driver/nvidia/capabilities).
DEFAULT_CAPABILITIES_DIR = "../../../proc/driver/nvidia/capabilities"


def _answer(v: Any) -> Any:
    if isinstance(v, NvmlErr):
        return {"error": v.error}
    if isinstance(v, BaseModel):
        return v.model_dump()
    if isinstance(v, tuple):
        return list(v)
    return v


def standin_config(
    facts: NvmlFacts, *, faults_file: str | None = DEFAULT_FAULTS_FILE, state_file: str | None = DEFAULT_STATE_FILE,
    capabilities_dir: str | None = DEFAULT_CAPABILITIES_DIR,
) -> dict[str, Any]:
    """The stand-in's JSON config for ``facts``; file paths relative to the config's own directory."""
    gpus: list[dict[str, Any]] = []
    for g in facts.gpus:
        pci = g.pci
        out: dict[str, Any] = {
            "uuid": _answer(g.uuid),
            "name": _answer(g.name),
            "memoryTotal": _answer(g.memoryTotal),
            "busId": {"error": pci.error} if isinstance(pci, NvmlErr) else pci.busId,
            "pciDeviceId": 0 if isinstance(pci, NvmlErr) else pci.pciDeviceId,
            "pciSubSystemId": 0 if isinstance(pci, NvmlErr) else pci.pciSubSystemId,
            "minor": _answer(g.minor),
            "brand": _answer(g.brand),
            "architecture": _answer(g.architecture),
            "computeCapability": _answer(g.computeCapability),
            "migMode": _answer(g.migMode),
            "numaNodeId": _answer(g.numaNodeId),
            "fabric": _answer(g.fabric),
            "migProfiles": [p.model_dump() for p in g.migProfiles],
        }
        if isinstance(g.nvlinks, NvmlErr):
            out["nvlinks"] = {"error": g.nvlinks.error}
        else:
            out["nvlinks"] = [
                {"state": _answer(lk.state), "remoteBusId": _answer(lk.remoteBusId),
                 "remoteType": _answer(lk.remoteType), "version": _answer(lk.version)}
                for lk in g.nvlinks
            ]  # fmt: skip
        gpus.append(out)
    driver = facts.driverVersion
    return {
        "init": None if facts.init is None else {"error": facts.init.error},
        "driverVersion": _answer(driver),
        "nvmlVersion": _answer(driver if isinstance(driver, NvmlErr) else f"12.{driver}"),
        "cudaDriverVersion": _answer(facts.cudaDriverVersion),
        "faultsFile": faults_file,
        "stateFile": state_file,
        "capabilitiesDir": capabilities_dir,
        "gpus": gpus,
    }


def profile_config(
    profile: str, node: str, *, hidden: frozenset[int] = frozenset(), faults_file: str | None = DEFAULT_FAULTS_FILE,
    state_file: str | None = DEFAULT_STATE_FILE,
) -> dict[str, Any]:
    """The config for mock ``profile`` (name or path) as ``node``'s hardware: the facts ``mock:<profile>`` serves."""
    p = load_profile(profile)
    facts = build_facts(p, node, hidden, Fabric(clusterUUID=p.fabric.clusterUUID, cliqueId=p.fabric.cliqueId))
    return standin_config(facts, faults_file=faults_file, state_file=state_file)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m topodra.hardware.standin", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="mock profile name or YAML path")
    ap.add_argument("--node", default="standin-node", help="node name the GPU UUIDs derive from")
    ap.add_argument("--hide", type=int, action="append", default=[], help="GPU slot gone from the bus (repeat)")
    args = ap.parse_args(argv)
    try:
        cfg = profile_config(args.profile, args.node, hidden=frozenset(args.hide))
    except (ValueError, OSError) as e:
        print(f"standin: {e}", file=sys.stderr)
        return 2
    json.dump(cfg, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
