"""The MIG intent journal: the placements topodra creates (or created) an instance at, until it destroys it.

Recovery must destroy an instance a crashed prepare made (created, not yet in the checkpoint) or a crashed
unprepare left (out of the checkpoint, not yet destroyed), and must leave every other one alone:
mig-manager's, an admin's ``nvidia-smi mig -cgi``, another driver's (finding 10).  NVML cannot say who made
an instance, so topodra writes down the placement before the ``create`` call and crosses it out once an
undo has destroyed the instance.  (Crossing it out as soon as the checkpoint records the instance would
lose unprepare's crash window: its checkpoint write comes before the destroy.)  At start an unrecorded
instance at a journalled placement is topodra's and is destroyed; any other is logged and left.

Writes are atomic with the data fsynced and the directory not: a kill -9 loses nothing the kernel has
(the rename is in its cache), and a lost rename after a power cut or kernel crash does not matter
because MIG instances do not survive a reboot either (the checkpoint's reboot rules re-make recorded
ones).  A journal that cannot be read is logged and treated as empty: unknown instances are then left,
which can leak an instance but never destroys someone else's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from topodra.atomicfile import remove, remove_stale_temps, write_atomic
from topodra.sharing.instances import PlacementKey

log = logging.getLogger(__name__)

FILE_NAME = "mig-intents.json"


class Intent(BaseModel):
    """One placement topodra is creating an instance at."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    parent_uuid: str
    profile_id: int
    start: int

    @property
    def key(self) -> PlacementKey:
        return self.parent_uuid, self.profile_id, self.start


class JournalFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = 1
    intents: list[Intent] = []


class MigJournal:
    """The journal file under the plugin's state directory; one owner (``MigEffect``), called under the node
    lock.  Read again on every call, as the checkpoint is: a second plugin process may share the directory."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.path = Path(state_dir) / FILE_NAME

    def _load(self) -> set[PlacementKey]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return set()
        except OSError as e:
            log.error("cannot read the MIG intent journal %s (unknown instances will be left alone): %s",
                      self.path, e)
            return set()
        try:
            return {i.key for i in JournalFile.model_validate_json(raw).intents}
        except ValidationError as e:
            log.error("MIG intent journal %s is corrupt (unknown instances will be left alone): %s", self.path, e)
            return set()

    def clean_temps(self) -> list[Path]:
        """Remove temp files of a journal write a kill cut short (at start, under the node lock)."""
        return remove_stale_temps(self.path.parent, FILE_NAME)

    def keys(self) -> frozenset[PlacementKey]:
        return frozenset(self._load())

    def record(self, keys: Iterable[PlacementKey]) -> None:
        """Before the creates: on disk when this returns (an OSError means nothing may be created)."""
        old = self._load()
        new = old | set(keys)
        if new != old:
            self._write(new)

    def forget(self, keys: Iterable[PlacementKey]) -> None:
        """Cross out placements whose instance the checkpoint records or an undo destroyed; never raises
        (a stale intent names a recorded or absent instance, which recovery keeps or skips)."""
        try:
            old = self._load()
            new = old - set(keys)
            if new == old:
                return
            self._write(new)
        except OSError as e:
            log.error("cannot update the MIG intent journal %s: %s", self.path, e)

    def settle(self, keys: Iterable[PlacementKey]) -> None:
        """Make the journal hold exactly ``keys`` (recovery's answer); never raises."""
        want = set(keys)
        try:
            if self._load() != want:
                self._write(want)
        except OSError as e:
            log.error("cannot update the MIG intent journal %s: %s", self.path, e)

    def _write(self, keys: set[PlacementKey]) -> None:
        if not keys:  # the usual state: no file, so the check after every checkpoint write is one failed open
            remove(self.path)
            return
        body = JournalFile(intents=[Intent(parent_uuid=p, profile_id=g, start=s) for p, g, s in sorted(keys)])
        write_atomic(self.path, body.model_dump_json().encode(), mode=0o600, sync="data")
