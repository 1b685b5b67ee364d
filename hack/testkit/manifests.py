"""What the deploy tests read from deploy/: the shipped objects by kind and name.

Shared by the offline checks (tests/unit/deploy) and the ones that apply the same objects to the real
cluster (tests/cluster), so both look at exactly the same documents."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from testkit.paths import REPO

Obj = dict[str, Any]
DEPLOY = REPO / "deploy"


def docs(*paths: Path) -> list[Obj]:
    """Every YAML document of the files (or of a directory's *.yaml files)."""
    out: list[Obj] = []
    for p in paths:
        files = sorted(p.glob("*.yaml")) if p.is_dir() else [p]
        for f in files:
            out += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def env_of(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container.get("env", [])}


def plugin_ds() -> Obj:
    return one(docs(DEPLOY / "plugin"), "DaemonSet", "topodra-kubelet-plugin")


def controller_deploy() -> Obj:
    return one(docs(DEPLOY / "controller"), "Deployment", "topodra-controller")
