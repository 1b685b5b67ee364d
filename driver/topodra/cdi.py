"""Per-claim CDI specs: how prepared devices reach the container.

The kubelet hands the CDI device IDs we return at prepare time to the
container runtime, which resolves them against spec files in the CDI
directories at container creation.  We write one transient spec per claim
(``<cdi_root>/k8s.<driver>-claim_<claimUID>.json``, kind
``k8s.<driver>/claim``) whose device names embed the claim UID, so IDs are
unique per claim and a spec can be dropped as a whole on unprepare.

Spec-level edits (applied once when any device of the claim is injected):
``TOPODRA_VISIBLE_DEVICES`` (device names) and ``TOPODRA_VISIBLE_UUIDS``
(GPU/MIG UUIDs) list every device of the claim; ``NVIDIA_VISIBLE_DEVICES=void``
when it has GPUs, as the toolkit's own specs set it: a UUID list there would make
the ``nvidia`` runtime (jit-cdi) inject every GPU of the claim into every
container.  On a real host (``hostdriver.HostDriver``) the driver's control
nodes and libraries go in too, with the toolkit's ``nvidia-cdi-hook`` hooks when
the host has that binary (``cdihooks``).  Per-device edits carry
``TOPODRA_DEVICE_<NAME>_*`` variables, the device's own env and its device
nodes; those stay exact even when a container uses only some requests of a
claim.  When the NVIDIA Container Toolkit has generated its own CDI spec
(kind ``nvidia.com/gpu``), the matching ``nvidia.com/gpu=<name>`` IDs are
returned too, so the toolkit injects driver libraries while we add topodra's
environment.

Building and validation are pure; only ``write_spec``/``remove_spec``/
``spec_exists``/``claim_spec_uids``/``load_specs`` touch the filesystem.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from topodra import cdihooks
from topodra.atomicfile import remove, remove_stale_temps, write_atomic
from topodra.devices import Device
from topodra.hostdriver import HostDriver, HostDriverError
from topodra.sharing.memory import limit_env

log = logging.getLogger(__name__)

CDI_CLASS = "claim"
NVIDIA_GPU_KIND = "nvidia.com/gpu"
DEFAULT_SPEC_DIRS: tuple[str, ...] = ("/etc/cdi", "/var/run/cdi")

# Released CDI spec versions we can emit, oldest first.
KNOWN_VERSIONS: tuple[str, ...] = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0")
BASE_VERSION = "0.3.0"

_VENDOR_OR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_NVIDIA_MINOR_NODE = re.compile(r"^/dev/nvidia[0-9]+$")
# A whole GPU under the toolkit's index (``3``) or type-index (``gpu3``) naming strategy.
_TOOLKIT_INDEX_NAME = re.compile(r"^(gpu)?[0-9]+$")
_DEVICE_NODE_TYPES = {"", "b", "c", "u", "p"}
_DEVICE_NODE_KEYS = {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"}
_SUPPORTED_EDIT_KEYS = {"env", "deviceNodes", "mounts", "hooks"}
_HOOK_KEYS = {"hookName", "path", "args", "env", "timeout"}
_MOUNT_KEYS = {"hostPath", "containerPath", "options", "type"}


class CDISpecInvalid(ValueError):
    """A spec we built breaks the CDI rules; it is never written."""


@dataclass(frozen=True)
class SpecDevice:
    """One allocated device of a claim as it goes into the spec."""

    device: Device
    share_id: str | None = None
    consumed: Mapping[str, str] = dataclasses.field(default_factory=dict)  # consumedCapacity of a share
    extra_env: tuple[str, ...] = ()  # KEY=VALUE from the device's sharing config (topodra.sharing)


def vendor(driver_name: str) -> str:
    return f"k8s.{driver_name}"


def kind(driver_name: str) -> str:
    return f"{vendor(driver_name)}/{CDI_CLASS}"


def spec_file_prefix(driver_name: str) -> str:
    return f"{vendor(driver_name)}-{CDI_CLASS}_"


def spec_file_name(driver_name: str, claim_uid: str) -> str:
    return f"{spec_file_prefix(driver_name)}{claim_uid}.json"


def spec_path(cdi_root: Path, driver_name: str, claim_uid: str) -> Path:
    """The claim's spec file; refuses a UID that could leave ``cdi_root`` (the gRPC layer rejects those first)."""
    if not claim_uid or "/" in claim_uid or "\0" in claim_uid or claim_uid in (".", ".."):
        raise ValueError(f"claim UID {claim_uid[:80]!r} cannot name a CDI spec file")
    return cdi_root / spec_file_name(driver_name, claim_uid)


def device_name(claim_uid: str, device: str, share_id: str | None = None) -> str:
    """CDI device name: claim UID first (unique per claim), share ID last when shared."""
    return f"{claim_uid}-{device}" + (f"-{share_id}" if share_id else "")


def qualified_id(driver_name: str, name: str) -> str:
    return f"{kind(driver_name)}={name}"


def env_fragment(device: str) -> str:
    """``gpu-0`` → ``GPU_0`` for per-device variable names."""
    return re.sub(r"[^A-Za-z0-9]", "_", device).upper()


def _device_env(sd: SpecDevice, claim_uid: str) -> list[str]:
    d = sd.device
    frag = env_fragment(d.name)
    env = [f"TOPODRA_DEVICE_{frag}_KIND={d.kind}", f"TOPODRA_DEVICE_{frag}_CLAIM_UID={claim_uid}"]
    if d.uuid:
        env.append(f"TOPODRA_DEVICE_{frag}_UUID={d.uuid}")
    model = d.attributes.get("model") or d.attributes.get("productName")
    if model is not None:
        env.append(f"TOPODRA_DEVICE_{frag}_MODEL={model.value}")
    if sd.share_id:
        env.append(f"TOPODRA_DEVICE_{frag}_SHARE_ID={sd.share_id}")
    env.extend(limit_env(frag, sd.consumed))
    env.extend(sd.extra_env)
    env.extend(f"{k}={v}" for k, v in sorted(d.env.items()))
    return env


def _node_edits(d: Device, host: HostDriver | None) -> list[dict[str, Any]]:
    if host is None:  # mock hardware: paths only (it has no nodes but tests' NICs)
        return [{"path": p} for p in d.device_nodes]
    try:
        return [host.node(p, d.device_node_modes.get(p)) for p in d.device_nodes]
    except HostDriverError as e:
        raise CDISpecInvalid(f"device {d.name}: {e}") from e


def build_spec(driver_name: str, claim_uid: str, devices: Sequence[SpecDevice], claim_env: Sequence[str] = (),
               claim_mounts: Sequence[tuple[str, str]] = (), host: HostDriver | None = None) -> dict[str, Any]:
    """The CDI spec for one claim (pure). ``cdiVersion`` is the lowest that supports what is used.

    ``claim_env`` / ``claim_mounts`` ((host path, container path), bind-mounted read-write): spec-level
    edits for what belongs to the claim as a whole (its MPS daemon's directories).  ``host``: the node's
    NVIDIA driver (None on mock hardware); a claim with GPUs then gets its control nodes and libraries.
    """
    if not devices:
        raise CDISpecInvalid(f"claim {claim_uid}: a CDI spec needs at least one device")
    names: list[str] = []
    uuids: list[str] = []
    cdi_devices: list[dict[str, Any]] = []
    for sd in devices:
        d = sd.device
        if d.name not in names:
            names.append(d.name)
            if d.kind in ("gpu", "mig") and d.uuid:  # a MIG device's uuid is its MIG UUID once created
                uuids.append(d.uuid)
        edits: dict[str, Any] = {"env": _device_env(sd, claim_uid)}
        if d.device_nodes:
            edits["deviceNodes"] = _node_edits(d, host)
        _add_hooks(edits, cdihooks.device_hooks(d, host))
        cdi_devices.append({"name": device_name(claim_uid, d.name, sd.share_id), "containerEdits": edits})
    spec_env = [f"TOPODRA_VISIBLE_DEVICES={','.join(names)}"]
    if uuids:
        spec_env += [f"TOPODRA_VISIBLE_UUIDS={','.join(uuids)}", "NVIDIA_VISIBLE_DEVICES=void"]
    spec_edits: dict[str, Any] = {"env": [*spec_env, *claim_env]}
    mounts = [{"hostPath": h, "containerPath": c, "options": ["rbind", "rw"]} for h, c in claim_mounts]
    if host is not None and uuids:
        nodes = host.control_nodes()
        if nodes:
            spec_edits["deviceNodes"] = nodes
        mounts += host.mounts()
        spec_edits["env"] += host.env()
        _add_hooks(spec_edits, cdihooks.spec_hooks(host))
    if mounts:
        spec_edits["mounts"] = mounts
    spec: dict[str, Any] = {
        "cdiVersion": BASE_VERSION,
        "kind": kind(driver_name),
        "devices": cdi_devices,
        "containerEdits": spec_edits,
    }
    spec["cdiVersion"] = minimum_version(spec)
    return spec


def _add_hooks(edits: dict[str, Any], hooks: list[dict[str, Any]]) -> None:
    if hooks:
        edits["hooks"] = hooks


def valid_spec(driver_name: str, claim_uid: str, devices: Sequence[SpecDevice], claim_env: Sequence[str] = (),
               claim_mounts: Sequence[tuple[str, str]] = (), host: HostDriver | None = None) -> dict[str, Any]:
    """``build_spec`` checked by ``validate_spec``: the one way prepare and recovery get a spec."""
    spec = build_spec(driver_name, claim_uid, devices, claim_env, claim_mounts, host)
    validate_spec(spec)
    return spec


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def _all_edits(spec: dict[str, Any]) -> list[dict[str, Any]]:
    edits = [spec.get("containerEdits") or {}]
    edits.extend((d.get("containerEdits") or {}) for d in spec.get("devices") or [])
    return edits


def minimum_version(spec: dict[str, Any]) -> str:
    """Lowest CDI version whose rules allow every feature ``spec`` may use and ``validate_spec`` accepts.

    Features that validation rejects anyway (additionalGids, intelRdt) need no rule; mounts and hooks are
    in 0.3.0, a mount's ``type`` came with 0.4.0.
    """
    need = BASE_VERSION
    edits = _all_edits(spec)
    if any(not str(d.get("name", "a"))[:1].isalpha() for d in spec.get("devices") or []) or any(
            n.get("hostPath") for e in edits for n in e.get("deviceNodes") or []):
        need = "0.5.0"  # device names starting with a digit; deviceNodes hostPath
    elif any(m.get("type") for e in edits for m in e.get("mounts") or [] if isinstance(m, dict)):
        need = "0.4.0"
    cls = str(spec.get("kind", "")).partition("/")[2]
    if spec.get("annotations") or any(d.get("annotations") for d in spec.get("devices") or []) or "." in cls:
        need = "0.6.0"  # annotations; dots in the class
    return need


def _list_field(edits: dict[str, Any], key: str, where: str, problems: list[str]) -> list[Any]:
    """``edits[key]`` as a list (empty when absent); a non-list is a problem and reads as empty."""
    value = edits.get(key) or []
    if isinstance(value, list):
        return value
    problems.append(f"{where}: {key} must be a list")
    return []


def _check_edits(where: str, edits: Any, problems: list[str]) -> bool:
    """Append problems with one containerEdits block; True when it edits something."""
    if not isinstance(edits, dict):
        problems.append(f"{where}: containerEdits must be an object")
        return False
    unsupported = set(edits) - _SUPPORTED_EDIT_KEYS
    if unsupported:
        problems.append(f"{where}: unsupported containerEdits fields {sorted(unsupported)}")
    env = _list_field(edits, "env", where, problems)
    for item in env:
        key, sep, value = item.partition("=") if isinstance(item, str) else ("", "", "")
        if not sep or not _ENV_KEY.match(key) or "\0" in value:
            problems.append(f"{where}: env entry {item!r} is not KEY=VALUE with a valid KEY")
    nodes = _list_field(edits, "deviceNodes", where, problems)
    for node in nodes:
        if not isinstance(node, dict):
            problems.append(f"{where}: device node {node!r} must be an object")
            continue
        extra = set(node) - _DEVICE_NODE_KEYS
        if extra:
            problems.append(f"{where}: device node has unknown fields {sorted(extra)}")
        for field in ("path", "hostPath"):
            p = node.get(field)
            if (field == "path" or p is not None) and not (isinstance(p, str) and p.startswith("/")):
                problems.append(f"{where}: device node {field} {p!r} must be an absolute path")
        if node.get("type", "") not in _DEVICE_NODE_TYPES:
            problems.append(f"{where}: device node type {node.get('type')!r} is not one of b, c, u, p")
        perms = node.get("permissions", "")
        if not isinstance(perms, str) or set(perms) - set("rwm"):
            problems.append(f"{where}: device node permissions {perms!r} may only contain r, w, m")
    mounts = _list_field(edits, "mounts", where, problems)
    for m in mounts:
        if not isinstance(m, dict):
            problems.append(f"{where}: mount {m!r} must be an object")
            continue
        if set(m) - _MOUNT_KEYS:
            problems.append(f"{where}: mount has unknown fields {sorted(set(m) - _MOUNT_KEYS)}")
        for field in ("hostPath", "containerPath"):
            p = m.get(field)
            if not (isinstance(p, str) and p.startswith("/")):
                problems.append(f"{where}: mount {field} {p!r} must be an absolute path")
        opts = m.get("options", [])
        if not isinstance(opts, list) or not all(isinstance(o, str) for o in opts):
            problems.append(f"{where}: mount options must be a list of strings")
    hooks = _list_field(edits, "hooks", where, problems)
    for h in hooks:
        _check_hook(where, h, problems)
    return bool(env or nodes or mounts or hooks)


def _check_hook(where: str, h: Any, problems: list[str]) -> None:
    if not isinstance(h, dict):
        problems.append(f"{where}: hook {h!r} must be an object")
        return
    if set(h) - _HOOK_KEYS:
        problems.append(f"{where}: hook has unknown fields {sorted(set(h) - _HOOK_KEYS)}")
    if h.get("hookName") not in cdihooks.HOOK_NAMES:
        problems.append(f"{where}: hookName {h.get('hookName')!r} is not one of {sorted(cdihooks.HOOK_NAMES)}")
    path = h.get("path")
    if not (isinstance(path, str) and path.startswith("/")):
        problems.append(f"{where}: hook path {path!r} must be an absolute path")
    for field in ("args", "env"):
        value = h.get(field, [])
        if not isinstance(value, list) or not all(isinstance(a, str) and "\0" not in a for a in value):
            problems.append(f"{where}: hook {field} must be a list of strings")
        elif field == "env" and not all(_ENV_KEY.match(e.partition("=")[0]) and "=" in e for e in value):
            problems.append(f"{where}: hook env entries must be KEY=VALUE with a valid KEY")
    timeout = h.get("timeout")
    if timeout is not None and (not isinstance(timeout, int) or isinstance(timeout, bool) or timeout <= 0):
        problems.append(f"{where}: hook timeout {timeout!r} must be a positive integer")


def validate_spec(spec: dict[str, Any]) -> None:
    """Raise ``CDISpecInvalid`` listing every way ``spec`` breaks the CDI rules (pure)."""
    problems: list[str] = []
    version = spec.get("cdiVersion")
    if version not in KNOWN_VERSIONS:
        problems.append(f"cdiVersion {version!r} is not one of {', '.join(KNOWN_VERSIONS)}")
    else:
        need = minimum_version(spec)
        if _version_key(str(version)) < _version_key(need):
            problems.append(f"cdiVersion {version} is too old for the features used (needs {need})")
    knd = spec.get("kind")
    ven, slash, cls = str(knd).partition("/") if isinstance(knd, str) else ("", "", "")
    if not slash or not _VENDOR_OR_CLASS.match(ven) or not _VENDOR_OR_CLASS.match(cls):
        problems.append(f"kind {knd!r} is not vendor/class (letters, digits, '_', '-', '.'; "
                        "starting with a letter, ending with a letter or digit)")
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        problems.append("devices must be a non-empty list")
        devices = []
    seen: set[str] = set()
    for d in devices:
        name = d.get("name") if isinstance(d, dict) else None
        if not isinstance(name, str) or not _DEVICE_NAME.match(name):
            problems.append(f"device name {name!r} is invalid (letters, digits, '_', '-', '.', ':'; "
                            "starting and ending with a letter or digit)")
            continue
        if name in seen:
            problems.append(f"device name {name!r} appears twice")
        seen.add(name)
        if not _check_edits(f"device {name}", d.get("containerEdits"), problems):
            problems.append(f"device {name}: containerEdits are empty")
    if "containerEdits" in spec:
        _check_edits("spec", spec["containerEdits"], problems)
    extra = set(spec) - {"cdiVersion", "kind", "devices", "containerEdits", "annotations"}
    if extra:
        problems.append(f"unknown top-level fields {sorted(extra)}")
    if problems:
        raise CDISpecInvalid("invalid CDI spec: " + "; ".join(problems))


# ---- NVIDIA Container Toolkit composition (pure) ----

def nvidia_gpu_ids(specs: Iterable[dict[str, Any]], devices: Iterable[Device]) -> dict[str, str]:
    """Map our GPU names to the toolkit's ``nvidia.com/gpu=...`` IDs.

    ``nvidia-ctk cdi generate --device-name-strategy`` names a whole GPU ``<uuid>`` (``uuid``), ``<N>``
    (``index``, the default with ``uuid``) or ``gpu<N>`` (``type-index``), N being NVML's index, not
    the minor (toolkit v1.20 ``pkg/nvcdi/namer.go``; MIG devices are ``N:M``/``migN:M``/``MIG-...``,
    which topodra never uses: its instances are made at prepare).  A device named after the GPU UUID
    wins; otherwise an index-style name whose device nodes contain the GPU's ``/dev/nvidiaN`` (the
    index cannot be trusted to equal the minor).  GPUs with no match get no entry.
    """
    by_name = _toolkit_gpu_devices(specs)
    out: dict[str, str] = {}
    for dev in devices:
        if dev.kind != "gpu":
            continue
        if dev.uuid and dev.uuid in by_name:
            out[dev.name] = f"{NVIDIA_GPU_KIND}={dev.uuid}"
            continue
        minors = [p for p in dev.device_nodes if _NVIDIA_MINOR_NODE.match(p)]
        for name, paths in sorted(by_name.items()):
            if _TOOLKIT_INDEX_NAME.match(name) and minors and minors[0] in paths:
                out[dev.name] = f"{NVIDIA_GPU_KIND}={name}"
                break
    return out


def unmatched_gpus(specs: Iterable[dict[str, Any]], devices: Iterable[Device], ids: Mapping[str, str]) -> list[str]:
    """This host's GPUs (with device nodes) that get no toolkit ID although a ``nvidia.com/gpu`` spec
    names devices: they lose the toolkit's injection, which deserves a warning, not silence."""
    if not _toolkit_gpu_devices(specs):
        return []
    return [d.name for d in devices if d.kind == "gpu" and d.device_nodes and d.name not in ids]


def _toolkit_gpu_devices(specs: Iterable[dict[str, Any]]) -> dict[str, set[str]]:
    """Device name -> its device node paths, over the toolkit's ``nvidia.com/gpu`` specs."""
    by_name: dict[str, set[str]] = {}
    for spec in specs:
        if spec.get("kind") != NVIDIA_GPU_KIND:
            continue
        for d in spec.get("devices") or []:
            if not isinstance(d, dict) or not isinstance(d.get("name"), str):
                continue
            nodes = ((d.get("containerEdits") or {}).get("deviceNodes")) or []
            by_name[d["name"]] = {n.get("path", "") for n in nodes if isinstance(n, dict)}
    return by_name


# ---- filesystem edges ----

def write_spec(cdi_root: Path, driver_name: str, claim_uid: str, spec: dict[str, Any]) -> Path:
    """Write the claim's spec (already validated, see ``valid_spec``) atomically; returns its path.

    Not fsynced: the checkpoint is the source of truth and the plugin re-creates
    missing specs from it at start (see ``atomicfile``).
    """
    path = spec_path(cdi_root, driver_name, claim_uid)
    # Compact: indented JSON takes the pure-Python encoder, on every prepare.
    raw = json.dumps(spec, separators=(",", ":")).encode() + b"\n"
    try:
        write_atomic(path, raw, mode=0o644, sync="none")
    except FileNotFoundError:  # the directory was removed (e.g. a wiped tmpfs): make it, once, not on every write
        cdi_root.mkdir(parents=True, exist_ok=True)
        write_atomic(path, raw, mode=0o644, sync="none")
    return path


def remove_spec(cdi_root: Path, driver_name: str, claim_uid: str) -> bool:
    """Delete the claim's spec; False when it was already gone."""
    return remove(spec_path(cdi_root, driver_name, claim_uid))


def spec_exists(cdi_root: Path, driver_name: str, claim_uid: str) -> bool:
    return spec_path(cdi_root, driver_name, claim_uid).is_file()


def claim_spec_uids(cdi_root: Path, driver_name: str) -> set[str]:
    """Claim UIDs that have a spec file of ours in ``cdi_root``."""
    prefix = spec_file_prefix(driver_name)
    try:
        names = [p.name for p in cdi_root.iterdir()]
    except FileNotFoundError:
        return set()
    return {n[len(prefix):-len(".json")] for n in names if n.startswith(prefix) and n.endswith(".json")}


def clean_temps(cdi_root: Path, driver_name: str) -> list[Path]:
    """Remove temp files of spec writes that crashed (call with the state lock held)."""
    return remove_stale_temps(cdi_root, spec_file_prefix(driver_name))


SpecCache = dict[Path, tuple[tuple[int, int], dict[str, Any] | None]]


def load_specs(dirs: Iterable[str | Path], skip_prefix: str = "",
               cache: SpecCache | None = None) -> list[dict[str, Any]]:
    """Parse every CDI spec (JSON or YAML) in ``dirs``; unreadable ones are logged and skipped.

    With ``cache`` (path -> ((mtime_ns, size), parsed)), unchanged files are not parsed again:
    this runs on every prepare, and the NVIDIA toolkit's spec can be large YAML.
    """
    specs: list[dict[str, Any]] = []
    for directory in dirs:
        try:
            paths = sorted(Path(directory).iterdir())
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        for path in paths:
            ours = bool(skip_prefix) and path.name.startswith(skip_prefix)
            if path.suffix not in (".json", ".yaml", ".yml") or ours:
                continue
            try:
                st = path.stat()
            except OSError:
                continue
            stamp = (st.st_mtime_ns, st.st_size)
            hit = cache.get(path) if cache is not None else None
            if hit is not None and hit[0] == stamp:
                doc = hit[1]
            else:
                try:
                    loaded = yaml.safe_load(path.read_text())
                except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
                    log.warning("skipping unreadable CDI spec %s: %s", path, e)
                    loaded = None
                doc = loaded if isinstance(loaded, dict) else None
                if cache is not None:
                    cache[path] = (stamp, doc)
            if doc is not None:
                specs.append(doc)
    return specs


class ToolkitIds:
    """The NVIDIA toolkit's CDI IDs of a node's GPUs: its specs parsed again only when they change (this runs
    on every prepare that needs them), and one warning per GPU that none of its devices names."""

    def __init__(self, spec_dirs: Iterable[str | os.PathLike[str]], driver_name: str, node: str) -> None:
        self.spec_dirs = [Path(d) for d in spec_dirs]
        self.skip_prefix = spec_file_prefix(driver_name)
        self.node = node
        self._cache: SpecCache = {}
        self._warned: set[str] = set()

    def __call__(self, devices: Sequence[Device]) -> dict[str, str]:
        specs = load_specs(self.spec_dirs, skip_prefix=self.skip_prefix, cache=self._cache)
        ids = nvidia_gpu_ids(specs, devices)
        for name in unmatched_gpus(specs, devices, ids):
            if name not in self._warned:
                self._warned.add(name)
                log.warning("node %s: GPU %s matches no device of the NVIDIA toolkit's CDI spec (by UUID, index "
                            "or type-index name): its containers get topodra's edits only", self.node, name)
        return ids
