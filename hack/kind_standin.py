"""Give each kind plugin node a host NVIDIA driver tree, so the chart's real-GPU branch (hardware nvml) runs on kind.

    hack/kind-standin CONFIG CLUSTER DIR > GENERATED_CONFIG

For every node of the kind config labelled ``topodra.io/mock-profile: <profile>``, under ``DIR/<node name>``:

- ``driver/``: ``hack/driver-tree --profile <profile> --node <node name>``: the NVML stand-in, the libcuda stub,
  the tool stand-ins, ``proc/devices`` and the char nodes (needs root);
- ``sys/``: the profile's sysfs tree (PCI locality, NUMA, RDMA NICs), as mock hardware generates it, so NVML
  discovery through the stand-in publishes the same devices as ``mock:<profile>``;
- ``uverbs``: the ``uverbsN`` names of the tree's RDMA NICs, one a line: hack/kind-up creates those char nodes
  in the node's own ``/dev``, which the container runtime stats for a NIC's CDI edit.

``DIR/<node name>`` is mounted at NODE_DIR in that node (an extraMount added to the config printed on stdout).
Node names follow kind's rule: ``<cluster>-<role>``, a number from the second node of a role on.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

HACK = Path(__file__).resolve().parent
REPO = HACK.parent
PROFILE_LABEL = "topodra.io/mock-profile"
NODE_DIR = "/var/lib/kubelet/plugins/topodra-standin"  # deploy/kind/values.yaml points the chart here


def node_names(config: dict[str, Any], cluster: str) -> list[str]:
    """The names kind gives the config's nodes, in order (kind's nodeNamer: a counter per role)."""
    seen: dict[str, int] = {}
    names: list[str] = []
    for node in config.get("nodes") or [{"role": "control-plane"}]:
        role = str(node.get("role", "control-plane"))
        seen[role] = seen.get(role, 0) + 1
        names.append(f"{cluster}-{role}" + (str(seen[role]) if seen[role] > 1 else ""))
    return names


def plugin_nodes(config: dict[str, Any], cluster: str) -> list[tuple[int, str, str]]:
    """(index in nodes, node name, profile) of every node that carries the profile label."""
    out = []
    for i, (node, name) in enumerate(zip(config.get("nodes") or [], node_names(config, cluster), strict=False)):
        profile = (node.get("labels") or {}).get(PROFILE_LABEL)
        if profile:
            out.append((i, name, str(profile)))
    return out


def with_mounts(config: dict[str, Any], cluster: str, base: Path) -> dict[str, Any]:
    """The config with each plugin node's ``base/<node name>`` mounted at NODE_DIR (pure)."""
    nodes = [dict(n) for n in config.get("nodes") or []]
    for i, name, _ in plugin_nodes(config, cluster):
        # No propagation option: rslave needs the host's / shared, and these hosts' is private. Inside the node
        # kind's entrypoint makes / rshared, which the chart's HostToContainer mount of the tree needs.
        mount = {"hostPath": str(base / name), "containerPath": NODE_DIR}
        nodes[i]["extraMounts"] = [*(nodes[i].get("extraMounts") or []), mount]
    return {**config, "nodes": nodes}


def build_node(profile: str, name: str, dest: Path) -> None:
    """Write dest/{driver,sys,uverbs} for one node (the effects; replaces what an earlier run left)."""
    from topodra.hardware.mockprofile import build_tree, load_profile

    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(HACK / "driver-tree"), "--profile", profile, "--node", name, str(dest / "driver")],
                   check=True, stdout=subprocess.DEVNULL)
    tree = build_tree(load_profile(profile), frozenset())
    tree.materialize(str(dest))
    verbs = sorted((d.rsplit("/", 1)[1] for d in tree.dirs if "/infiniband_verbs/" in d),
                   key=lambda v: int(v.removeprefix("uverbs")))
    (dest / "uverbs").write_text("".join(f"{v}\n" for v in verbs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hack/kind-standin", description=__doc__.splitlines()[0])
    ap.add_argument("config", type=Path, help="kind cluster config (deploy/kind/kind-config*.yaml)")
    ap.add_argument("cluster", help="kind cluster name")
    ap.add_argument("dir", type=Path, help="where the nodes' trees go (DIR/<node name>)")
    args = ap.parse_args(argv)
    config = yaml.safe_load(args.config.read_text())
    nodes = plugin_nodes(config, args.cluster)
    if not nodes:
        print(f"kind-standin: no node of {args.config} has the label {PROFILE_LABEL}", file=sys.stderr)
        return 2
    base = args.dir.resolve()
    for _, name, profile in nodes:
        try:
            build_node(profile, name, base / name)
        except (subprocess.CalledProcessError, ValueError, OSError) as e:
            print(f"kind-standin: node {name} (profile {profile}): {e}", file=sys.stderr)
            return 1
    yaml.safe_dump(with_mounts(config, args.cluster, base), sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
