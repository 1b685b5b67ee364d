"""The prepare checkpoint: what this node has prepared, durable across restarts.

The kubelet calls NodeUnprepareResources with only ``{namespace, uid, name}``,
possibly after the ResourceClaim is deleted and after a plugin restart, so the
plugin must remember every prepared claim on disk.  The file is versioned,
checksummed and replaced atomically; it records the boot ID so a reboot (which
wipes the tmpfs CDI directory) is detected.  A corrupt file is never silently
discarded: losing it would leak devices and break unprepare.

Older versions are read through ``MIGRATIONS`` (a chain of pure payload
upgrades, checked against the file's checksum first); the next write stores the
current version.

On-disk shape (``version`` 2; version 1 had no ``mig`` and ``consumed_capacity``)::

    {"version": 1, "checksum": "<sha256 hex of canonical JSON of payload>",
     "payload": {"boot_id": "...", "claims": {"<uid>": {"uid": ..., "namespace": ...,
                 "name": ..., "state": "PrepareStarted"|"PrepareCompleted",
                 "devices": [{"request_names": [...], "pool_name": ..., "device_name": ...,
                              "cdi_device_ids": [...], "share_id": null,
                              "access": "exclusive"|"shared"|"admin",
                              "mig": null | {"parent_uuid": ..., "gpu_instance": 3, "compute_instance": 0,
                                             "uuid": "MIG-...", "profile_id": 19, "start": 2},
                              "consumed_capacity": {"memory": "20Gi"},
                              "sharing": null | {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"},
                                                 "mps": null}}]}}}}
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from topodra.atomicfile import Sync, remove_stale_temps, write_atomic
from topodra.sharing.config import Sharing
from topodra.sharing.instances import MigInstance

log = logging.getLogger(__name__)

VERSION = 2
FILE_NAME = "checkpoint.json"
OLDEST_READABLE = 1

Migration = Callable[[dict[str, Any]], dict[str, Any]]
# version N → the function that turns a verified version-N payload into a version-(N+1) payload (pure).
# Changing the format: bump VERSION, add MIGRATIONS[old] here, keep tests/fixtures/checkpoint-v<old>.json
# (a file the old code wrote) loading in tests/unit/state/test_checkpoint.py.  The file is rewritten in the new
# version at the next write; a downgrade then refuses the newer file (see ``decode``).
MIGRATIONS: dict[int, Migration] = {
    1: lambda payload: payload,  # v2 adds CheckpointDevice.mig (MIG instances, issue 11); absent means none
}


def migrate(version: int, payload: dict[str, Any]) -> dict[str, Any]:
    """A payload of ``version`` brought up to ``VERSION`` through every migration in turn (pure)."""
    for v in range(version, VERSION):
        payload = MIGRATIONS[v](payload)
    return payload

PREPARE_STARTED: Final = "PrepareStarted"
PREPARE_COMPLETED: Final = "PrepareCompleted"
ClaimStateName = Literal["PrepareStarted", "PrepareCompleted"]
Access = Literal["exclusive", "shared", "admin"]


class CheckpointCorrupt(Exception):
    """The checkpoint exists but cannot be trusted; the plugin must not start on it."""

    def __init__(self, path: Path, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(
            f"checkpoint {path} is unusable: {problem}. The file was left untouched. To start anyway, "
            "restart the plugin with --quarantine-corrupt-checkpoint (the file is then renamed to "
            f"{path.name}.corrupt-<timestamp> and the plugin starts empty: claims prepared before are "
            "forgotten, so drain the node's pods that use DRA devices first), or restore a good copy.")


class CheckpointDevice(BaseModel):
    """One prepared device of a claim, exactly as returned to the kubelet."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_names: list[str]
    pool_name: str
    device_name: str
    cdi_device_ids: list[str]
    share_id: str | None = None
    # How the allocation may overlap with other claims on the same device:
    # exclusive; shared (shareID / consumable capacity); admin (adminAccess, never conflicts).
    access: Access = "exclusive"
    # The MIG instance prepare created for this device (a MIG placement device), destroyed by unprepare.
    mig: MigInstance | None = None
    # consumedCapacity of a shared allocation (GPU memory shares): re-creates the share's limit env.
    consumed_capacity: dict[str, str] = Field(default_factory=dict)
    # The GpuConfig sharing in force for this device (time-slice level, MPS); absent in files before it existed,
    # which therefore still load as version 2 (an older reader refuses a file that has it: unknown field).
    sharing: Sharing | None = None


class ClaimEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    uid: str = Field(min_length=1)
    namespace: str
    name: str
    state: ClaimStateName
    devices: list[CheckpointDevice]

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"

    @property
    def mig_instances(self) -> list[MigInstance]:
        """The MIG instances prepare created for this claim's devices (what unprepare destroys)."""
        return [d.mig for d in self.devices if d.mig is not None]


class CheckpointData(BaseModel):
    """The checksummed payload."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    boot_id: str = ""
    claims: dict[str, ClaimEntry] = Field(default_factory=dict)

    def with_claim(self, entry: ClaimEntry) -> CheckpointData:
        return self.model_copy(update={"claims": {**self.claims, entry.uid: entry}})

    def without_claims(self, uids: set[str]) -> CheckpointData:
        return self.model_copy(update={"claims": {u: e for u, e in self.claims.items() if u not in uids}})


def canonical_json(payload: Any) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def checksum(payload: Any) -> str:
    return hashlib.sha256(canonical_json(payload)).hexdigest()


def encode(data: CheckpointData) -> bytes:
    """The file contents for ``data`` (pure).

    The payload is embedded in its canonical form, so it is serialized once, by the C
    encoder (indented output would take the pure-Python one, on every prepare).
    """
    body = canonical_json(data.model_dump(mode="json"))
    digest = hashlib.sha256(body).hexdigest()
    return b'{"version":%d,"checksum":"%s","payload":%s}\n' % (VERSION, digest.encode(), body)


def decode(raw: bytes, path: Path) -> CheckpointData:
    """Parse and verify file contents (pure); raises ``CheckpointCorrupt``."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointCorrupt(path, f"not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CheckpointCorrupt(path, "top level is not a JSON object")
    raw_version = doc.get("version")
    version = raw_version if isinstance(raw_version, int) and not isinstance(raw_version, bool) else -1
    if not OLDEST_READABLE <= version <= VERSION or any(v not in MIGRATIONS for v in range(version, VERSION)):
        raise CheckpointCorrupt(
            path, f"unknown version {raw_version!r} (this topodra reads versions {OLDEST_READABLE} to {VERSION}; a "
                  "newer topodra may have written it, and downgrades are not supported)")
    payload = doc.get("payload")
    want = doc.get("checksum")
    if not isinstance(want, str) or payload is None:
        raise CheckpointCorrupt(path, "missing checksum or payload")
    got = checksum(payload)
    if got != want:
        raise CheckpointCorrupt(path, f"checksum mismatch (file says {want[:12]}…, content is {got[:12]}…)")
    if not isinstance(payload, dict):
        raise CheckpointCorrupt(path, "payload is not a JSON object")
    try:
        data = CheckpointData.model_validate(migrate(version, payload))
    except ValidationError as e:
        raise CheckpointCorrupt(path, f"payload does not match the version {VERSION} schema: {e}") from None
    for uid, entry in data.claims.items():
        if uid != entry.uid:
            raise CheckpointCorrupt(path, f"claim key {uid!r} differs from its uid {entry.uid!r}")
    return data


LoadCache = dict[Path, tuple[bytes, CheckpointData]]
"""path → (the file's exact bytes, what they decode to): the version this process last read or wrote."""


def load(path: Path, cache: LoadCache | None = None) -> CheckpointData | None:
    """The checkpoint at ``path``; None when there is none yet.

    The file is always read.  With ``cache``, bytes identical to the version this process
    last read or wrote are not decoded again (JSON, checksum and schema checks cost about
    as much as the read's syscalls on every prepare and unprepare); any other content, a
    peer's write or a corruption, is decoded and checked in full.  ``CheckpointData`` is
    frozen, so handing out the cached object is safe.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if cache is not None:
            cache.pop(path, None)
        return None
    if cache is not None:
        known = cache.get(path)
        if known is not None and known[0] == raw:
            return known[1]
    data = decode(raw, path)
    if cache is not None:
        cache[path] = (raw, data)
    return data


def save(path: Path, data: CheckpointData, *, sync: Sync = "durable", cache: LoadCache | None = None) -> None:
    """Replace the checkpoint; ``sync="data"`` when the version need not survive a power loss.

    Never ``"none"``: the checkpoint is the source of truth, so a torn version must never
    reach the disk (see ``atomicfile``).  ``cache`` (see ``load``) then knows the new bytes;
    it is dropped when the write fails, as the file may hold either version.
    """
    if sync == "none":
        raise ValueError("the checkpoint is never written without fsync")
    raw = encode(data)
    if cache is not None:
        cache.pop(path, None)
    write_atomic(path, raw, mode=0o600, sync=sync)
    if cache is not None:
        cache[path] = (raw, data)


def quarantine(path: Path, now: float | None = None) -> Path:
    """Move a corrupt checkpoint aside (operator opt-in only) and return where it went."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
    os.rename(path, target)
    log.warning("quarantined corrupt checkpoint %s as %s; starting with an empty checkpoint", path, target)
    return target


def clean_temps(directory: Path) -> list[Path]:
    """Remove temp files of a checkpoint write that crashed (call with the state lock held)."""
    return remove_stale_temps(directory, FILE_NAME)
