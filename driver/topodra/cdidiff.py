"""Compare what two CDI specs do to a container: topodra's claim spec against the NVIDIA toolkit's.

A container that names CDI devices gets the spec-level edits of every spec it draws a device from plus each
named device's own edits. :func:`resolve` computes that union for one spec and some of its devices, and
:func:`diff` says where two such unions differ in device nodes, mounts, hooks and environment. This lets a
test (or ``hack/gpu-check`` on a real node) prove topodra's specs against ``nvidia-ctk cdi generate``
instead of against topodra's own idea of a driver. Pure: specs are the parsed JSON/YAML dicts.

What counts as the same:
- device nodes by container path; host path (default: the container path), type, major, minor, fileMode,
  permissions, uid and gid must agree where both sides state them. A side that omits type/major/minor lets
  the runtime stat the host node, so "unstated" is not a difference; :attr:`EditsDiff.unstated_nodes` lists
  them.
- mounts by container path; host path, type and the option set must agree.
- hooks by (hookName, program basename, args after argv[0]): the hook binary may live elsewhere.
- env by variable name; values must agree.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_NODE_FIELDS = ("hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid")


class SpecShapeError(ValueError):
    """A spec is not shaped like a CDI spec, or names a device it does not have."""


@dataclass(frozen=True)
class Edits:
    """The container edits one container gets from one spec, keyed for comparison."""

    device_nodes: Mapping[str, Mapping[str, Any]]
    mounts: Mapping[str, Mapping[str, Any]]
    hooks: Counter[tuple[str, str, tuple[str, ...]]]
    env: Mapping[str, str]


@dataclass
class EditsDiff:
    """Differences between ``ours`` and ``theirs``; each entry is a short human-readable line."""

    missing: list[str] = field(default_factory=list)   # in theirs, not in ours
    extra: list[str] = field(default_factory=list)     # in ours, not in theirs
    differing: list[str] = field(default_factory=list)  # in both, with different values
    unstated_nodes: list[str] = field(default_factory=list)  # node fields one side leaves to the runtime

    @property
    def same(self) -> bool:
        return not (self.missing or self.extra or self.differing)

    def lines(self) -> list[str]:
        return ([f"missing {m}" for m in self.missing] + [f"extra {e}" for e in self.extra]
                + [f"differs {d}" for d in self.differing])


def _as_list(block: Mapping[str, Any], key: str, where: str) -> list[Any]:
    value = block.get(key) or []
    if not isinstance(value, list):
        raise SpecShapeError(f"{where}: {key} must be a list, got {type(value).__name__}")
    return value


def _edit_blocks(spec: Mapping[str, Any], device_names: Sequence[str]) -> list[tuple[str, Mapping[str, Any]]]:
    if not isinstance(spec, Mapping) or not isinstance(spec.get("devices"), list):
        raise SpecShapeError("not a CDI spec: no devices list")
    by_name: dict[str, Mapping[str, Any]] = {}
    for d in spec["devices"]:
        if not isinstance(d, Mapping) or not isinstance(d.get("name"), str):
            raise SpecShapeError(f"device entry without a name: {d!r}")
        by_name[d["name"]] = d.get("containerEdits") or {}
    unknown = [n for n in device_names if n not in by_name]
    if unknown:
        raise SpecShapeError(f"spec {spec.get('kind')!r} has no device {unknown}; it has {sorted(by_name)}")
    blocks: list[tuple[str, Mapping[str, Any]]] = [("spec", spec.get("containerEdits") or {})]
    blocks.extend((f"device {n}", by_name[n]) for n in dict.fromkeys(device_names))
    for where, b in blocks:
        if not isinstance(b, Mapping):
            raise SpecShapeError(f"{where}: containerEdits must be an object")
    return blocks


def _hook_key(h: Mapping[str, Any], where: str) -> tuple[str, str, tuple[str, ...]]:
    if not isinstance(h, Mapping) or not isinstance(h.get("path"), str) or not isinstance(h.get("hookName"), str):
        raise SpecShapeError(f"{where}: hook needs hookName and path: {h!r}")
    args = [str(a) for a in h.get("args") or []]
    program = os.path.basename(args[0] if args else h["path"])
    return (h["hookName"], program, tuple(args[1:]))


def resolve(spec: Mapping[str, Any], device_names: Sequence[str]) -> Edits:
    """The edits a container naming ``device_names`` (names within this spec) gets from ``spec``.

    Later blocks win for the same device node, mount or env name, as the CDI library applies them in order.
    """
    nodes: dict[str, Mapping[str, Any]] = {}
    mounts: dict[str, Mapping[str, Any]] = {}
    hooks: Counter[tuple[str, str, tuple[str, ...]]] = Counter()
    env: dict[str, str] = {}
    for where, block in _edit_blocks(spec, device_names):
        for n in _as_list(block, "deviceNodes", where):
            if not isinstance(n, Mapping) or not isinstance(n.get("path"), str):
                raise SpecShapeError(f"{where}: device node without a path: {n!r}")
            nodes[n["path"]] = {"hostPath": n.get("hostPath") or n["path"],
                                **{k: n[k] for k in _NODE_FIELDS[1:] if n.get(k) is not None}}
        for m in _as_list(block, "mounts", where):
            if not isinstance(m, Mapping) or not isinstance(m.get("containerPath"), str):
                raise SpecShapeError(f"{where}: mount without a containerPath: {m!r}")
            mounts[m["containerPath"]] = {"hostPath": m.get("hostPath"), "type": m.get("type"),
                                          "options": tuple(sorted(m.get("options") or []))}
        for h in _as_list(block, "hooks", where):
            hooks[_hook_key(h, where)] += 1
        for e in _as_list(block, "env", where):
            if not isinstance(e, str):
                raise SpecShapeError(f"{where}: env entry must be NAME=VALUE, got {e!r}")
            name, _, value = e.partition("=")
            env[name] = value
    return Edits(nodes, mounts, hooks, env)


def _diff_nodes(ours: Mapping[str, Mapping[str, Any]], theirs: Mapping[str, Mapping[str, Any]], d: EditsDiff) -> None:
    for path in sorted(theirs.keys() - ours.keys()):
        d.missing.append(f"device node {path}")
    for path in sorted(ours.keys() - theirs.keys()):
        d.extra.append(f"device node {path}")
    for path in sorted(ours.keys() & theirs.keys()):
        o, t = ours[path], theirs[path]
        for k in _NODE_FIELDS:
            if k in o and k in t and o[k] != t[k]:
                d.differing.append(f"device node {path}: {k} {o[k]!r} != {t[k]!r}")
            elif (k in o) != (k in t):
                side = "ours" if k not in o else "theirs"
                d.unstated_nodes.append(f"device node {path}: {k} unstated in {side}")


def _diff_keyed(what: str, ours: Mapping[str, Any], theirs: Mapping[str, Any], d: EditsDiff) -> None:
    for k in sorted(theirs.keys() - ours.keys()):
        d.missing.append(f"{what} {k}")
    for k in sorted(ours.keys() - theirs.keys()):
        d.extra.append(f"{what} {k}")
    for k in sorted(ours.keys() & theirs.keys()):
        if ours[k] != theirs[k]:
            d.differing.append(f"{what} {k}: {ours[k]!r} != {theirs[k]!r}")


def _fmt_hook(key: tuple[str, str, tuple[str, ...]]) -> str:
    return f"hook {key[0]}: {' '.join((key[1], *key[2]))}"


def _diff_hooks(ours: Counter[tuple[str, str, tuple[str, ...]]],
                theirs: Counter[tuple[str, str, tuple[str, ...]]], d: EditsDiff) -> None:
    only_theirs = list((theirs - ours).elements())
    only_ours = list((ours - theirs).elements())
    # The same hook (name, program, subcommand) on both sides with other arguments is one difference.
    for t in sorted(only_theirs):
        match = next((o for o in only_ours if o[:2] == t[:2] and o[2][:1] == t[2][:1]), None)
        if match is None:
            d.missing.append(_fmt_hook(t))
        else:
            only_ours.remove(match)
            d.differing.append(f"{_fmt_hook(match)} != {' '.join((t[1], *t[2]))}")
    d.extra.extend(_fmt_hook(o) for o in sorted(only_ours))


def diff(ours: Edits, theirs: Edits, ignore_env: Iterable[str] = ()) -> EditsDiff:
    """Where ``ours`` differs from ``theirs``; ``ignore_env`` names variables only one side is meant to set."""
    d = EditsDiff()
    _diff_nodes(ours.device_nodes, theirs.device_nodes, d)
    _diff_keyed("mount", ours.mounts, theirs.mounts, d)
    _diff_hooks(ours.hooks, theirs.hooks, d)
    skip = set(ignore_env)
    _diff_keyed("env", {k: v for k, v in ours.env.items() if k not in skip},
                {k: v for k, v in theirs.env.items() if k not in skip}, d)
    return d
