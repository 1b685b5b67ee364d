"""Prepare/unprepare: every error path leaves no trace, idempotency, crash and reboot recovery, locking.

The claim getter returns realistic ``resource.k8s.io/v1`` ResourceClaim JSON as
the API server would; claims go through the plugin's real ``ClaimFetcher`` (read
and checked before the lock) into the state, as in the plugin.  The CDI
directory and checkpoint are real files in tmp dirs.  Crash tests run a real
subprocess that dies at the crash point.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from topodra import cdi, checkpoint
from topodra.checkpoint import CheckpointCorrupt
from topodra.claims import ClaimRef, base_request_name
from topodra.devices import Device, string_attr
from topodra.inventory import Inventory
from topodra.plugin.server import ClaimFetcher
from topodra.state import DeviceState, PreparedDevice, PrepareResult

DRIVER = "gpu.topodra.io"
NODE = "node-a"
KIND = "k8s.gpu.topodra.io/claim"

UID1 = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
UID2 = "9c7d0a44-6c1e-4f0e-8a7b-2d3c4e5f6a71"
UID3 = "d2a8e6b0-3c4d-4e5f-9a6b-7c8d9e0f1a2b"


def gpu(n: int, nodes: bool = False) -> Device:
    return Device(
        name=f"gpu-{n}", kind="gpu", attributes={"model": string_attr("H100-SXM5-80GB")}, capacity={"memory": "80Gi"},
        uuid=f"GPU-{n:08d}-1111-2222-3333-444444444444",
        device_nodes=(f"/dev/nvidia{n}", "/dev/nvidiactl") if nodes else (),
    )


def nic(n: int) -> Device:
    return Device(name=f"nic-{n}", kind="nic", uuid=f"mlx5_{n}")


DEVICES = [gpu(0), gpu(1), gpu(2), gpu(3), nic(0), nic(1)]


def result(device: str, request: str = "gpus", pool: str = NODE, driver: str = DRIVER,
           **extra: Any) -> dict[str, Any]:
    return {"request": request, "driver": driver, "pool": pool, "device": device, **extra}


def claim_json(ns: str, name: str, uid: str, results: list[dict[str, Any]] | None,
               node: str = NODE) -> dict[str, Any]:
    """A v1 ResourceClaim as the API server returns it (allocated unless results is None)."""
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name, "namespace": ns, "uid": uid, "resourceVersion": "4711",
            "creationTimestamp": "2026-11-29T10:00:00Z",
            "finalizers": ["resource.kubernetes.io/delete-protection"],
            "annotations": {"resource.kubernetes.io/pod-claim-name": "gpus"},
        },
        "spec": {"devices": {"requests": [
            {"name": "gpus", "exactly": {"deviceClassName": "gpu.topodra.io", "allocationMode": "ExactCount",
                                         "count": 1}},
        ]}},
        "status": {},
    }
    if results is not None:
        obj["status"] = {
            "allocation": {
                "devices": {"results": results},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
                "allocationTimestamp": "2026-11-29T10:00:01Z",
            },
            "reservedFor": [{"resource": "pods", "name": f"{name}-pod", "uid": "0c9a1b2c-pod"}],
        }
    return obj


@dataclass
class FakeAPI:
    """Stand-in for ``lambda ns, n: kube.get(claim_path(ns, n))``; counts calls."""

    claims: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    calls: int = 0
    fail_with: Exception | None = None

    def add(self, ns: str, name: str, uid: str, results: list[dict[str, Any]] | None) -> ClaimRef:
        self.claims[(ns, name)] = claim_json(ns, name, uid, results)
        return ClaimRef(namespace=ns, uid=uid, name=name)

    def __call__(self, ns: str, name: str) -> dict[str, Any] | None:
        self.calls += 1
        if self.fail_with is not None:
            raise self.fail_with
        return self.claims.get((ns, name))


@dataclass
class Env:
    root: Path
    api: FakeAPI
    boot: Path

    @property
    def cdi_root(self) -> Path:
        return self.root / "cdi"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    def state(self, devices: list[Device] | None = None, **kw: Any) -> DeviceState:
        """A fresh DeviceState (a plugin (re)start) on its own inventory."""
        kw.setdefault("nvidia_spec_dirs", [])
        return DeviceState(DRIVER, NODE, Inventory(DEVICES if devices is None else devices), self.cdi_root,
                           self.state_dir, boot_id_path=str(self.boot), **kw)

    def prepare(self, st: DeviceState, refs: list[ClaimRef]) -> dict[str, PrepareResult]:
        """What the gRPC layer does: read and check the claims (no lock), then prepare them."""
        return st.prepare(ClaimFetcher(self.api, DRIVER, NODE, max_workers=2).fetch(refs))

    def snapshot(self) -> dict[str, bytes]:
        """Every file under cdi/ and the checkpoint, byte for byte."""
        files = {f"cdi/{p.name}": p.read_bytes() for p in sorted(self.cdi_root.glob("*")) if p.is_file()}
        cp = self.state_dir / checkpoint.FILE_NAME
        if cp.exists():
            files["checkpoint"] = cp.read_bytes()
        return files

    def checkpoint(self) -> checkpoint.CheckpointData:
        data = checkpoint.load(self.state_dir / checkpoint.FILE_NAME)
        assert data is not None
        return data


@pytest.fixture
def env(tmp_path: Path) -> Env:
    boot = tmp_path / "boot_id"
    boot.write_text("11111111-aaaa-bbbb-cccc-000000000001\n")
    return Env(tmp_path, FakeAPI(), boot)


def spec_path(env: Env, uid: str) -> Path:
    return env.cdi_root / f"k8s.gpu.topodra.io-claim_{uid}.json"


# ---------------------------------------------------------------- prepare


def test_prepare_writes_spec_and_checkpoint(env: Env) -> None:
    ref = env.api.add("team-a", "train", UID1, [result("gpu-0"), result("gpu-1"), result("nic-0", "nics")])
    st = env.state()
    out = env.prepare(st, [ref])
    assert out == {UID1: PrepareResult([
        PreparedDevice(["gpus"], NODE, "gpu-0", [f"{KIND}={UID1}-gpu-0"], None),
        PreparedDevice(["gpus"], NODE, "gpu-1", [f"{KIND}={UID1}-gpu-1"], None),
        PreparedDevice(["nics"], NODE, "nic-0", [f"{KIND}={UID1}-nic-0"], None),
    ])}
    spec = json.loads(spec_path(env, UID1).read_text())
    assert spec["kind"] == KIND
    assert [d["name"] for d in spec["devices"]] == [f"{UID1}-gpu-0", f"{UID1}-gpu-1", f"{UID1}-nic-0"]
    assert "TOPODRA_VISIBLE_DEVICES=gpu-0,gpu-1,nic-0" in spec["containerEdits"]["env"]
    entry = env.checkpoint().claims[UID1]
    assert entry.state == "PrepareCompleted"
    assert (entry.namespace, entry.name) == ("team-a", "train")
    assert env.checkpoint().boot_id == "11111111-aaaa-bbbb-cccc-000000000001"


def test_subrequest_names_are_stripped(env: Env) -> None:
    ref = env.api.add("ns", "fallback", UID1, [result("gpu-2", request="gpus/h100")])
    out = env.prepare(env.state(), [ref])
    assert out[UID1].devices[0].request_names == ["gpus"]
    assert base_request_name("a/b") == "a" and base_request_name("a") == "a"


def test_other_drivers_results_are_ignored(env: Env) -> None:
    ref = env.api.add("ns", "mixed", UID1, [result("eth0", driver="dra.net", pool="node-a-net"),
                                            result("gpu-0")])
    out = env.prepare(env.state(), [ref])
    assert [d.device_name for d in out[UID1].devices] == ["gpu-0"]


@dataclass
class BadCase:
    setup: Callable[[FakeAPI], ClaimRef]
    needle: str


BAD_CASES: dict[str, BadCase] = {
    "not-found": BadCase(lambda api: ClaimRef("ns", UID2, "ghost"), "not found"),
    "uid-mismatch": BadCase(
        lambda api: (api.add("ns", "re", UID3, [result("gpu-1")]), ClaimRef("ns", UID2, "re"))[1],
        f"replaced (the API has UID {UID3})"),
    "not-allocated": BadCase(lambda api: api.add("ns", "pending", UID2, None), "not allocated"),
    "no-results-for-driver": BadCase(
        lambda api: api.add("ns", "net", UID2, [result("eth0", driver="dra.net")]),
        "no devices allocated from driver gpu.topodra.io (allocated drivers: ['dra.net'])"),
    "other-node": BadCase(
        lambda api: api.add("ns", "far", UID2, [result("gpu-1", pool="node-b")]),
        "claim is for another node"),
    "unknown-device": BadCase(
        lambda api: api.add("ns", "odd", UID2, [result("gpu-9")]), "device gpu-9 is unknown on node node-a"),
    "held-exclusively": BadCase(
        lambda api: api.add("ns", "thief", UID2, [result("gpu-1"), result("gpu-0")]),
        "device gpu-0 on node node-a is already in use by claim ns/first"),
    "shared-onto-exclusive": BadCase(
        lambda api: api.add("ns", "sharer", UID2, [result("gpu-0", shareID="a0b1c2d3-0000-4000-8000-000000000001")]),
        "already in use by claim ns/first"),
    "same-device-twice": BadCase(
        lambda api: api.add("ns", "twice", UID2, [result("gpu-1"), result("gpu-1", request="more")]),
        "allocated twice in this claim"),
    "partially-bad": BadCase(
        lambda api: api.add("ns", "partial", UID2, [result("gpu-2"), result("gpu-7")]),
        "device gpu-7 is unknown"),
}


@pytest.mark.parametrize("case", list(BAD_CASES), ids=list(BAD_CASES))
def test_failing_claim_changes_nothing(env: Env, case: str) -> None:
    st = env.state()
    first = env.api.add("ns", "first", UID1, [result("gpu-0")])
    assert env.prepare(st, [first])[UID1].error == ""
    before = env.snapshot()
    ref = BAD_CASES[case].setup(env.api)
    out = env.prepare(st, [ref])
    assert set(out) == {ref.uid}
    err = out[ref.uid].error
    assert BAD_CASES[case].needle in err
    assert f"{ref.namespace}/{ref.name} ({ref.uid})" in err  # names the claim
    assert out[ref.uid].devices == []
    assert env.snapshot() == before


def test_getter_exception_is_a_claim_error(env: Env) -> None:
    ref = env.api.add("ns", "c", UID1, [result("gpu-0")])
    env.api.fail_with = RuntimeError("503 ServiceUnavailable: etcd leader changed")
    st = env.state()
    out = env.prepare(st, [ref])
    assert "cannot read the ResourceClaim: 503" in out[UID1].error
    assert env.snapshot() == {}
    env.api.fail_with = None
    assert env.prepare(st, [ref])[UID1].error == ""  # retry works


def test_batch_answers_every_claim_and_isolates_failures(env: Env) -> None:
    good1 = env.api.add("ns", "a", UID1, [result("gpu-0")])
    bad = env.api.add("ns", "b", UID2, [result("gpu-0")])  # same exclusive device as a, same batch
    good2 = env.api.add("ns", "c", UID3, [result("gpu-1")])
    out = env.prepare(env.state(), [good1, bad, good2])
    assert set(out) == {UID1, UID2, UID3}
    assert out[UID1].error == "" and out[UID3].error == ""
    assert "already in use by claim ns/a" in out[UID2].error
    assert set(env.checkpoint().claims) == {UID1, UID3}
    assert not spec_path(env, UID2).exists()


def test_sharing_with_share_ids_and_admin_access(env: Env) -> None:
    st = env.state()
    s1 = env.api.add("ns", "s1", UID1, [result("gpu-0", shareID="aaaaaaaa-0000-4000-8000-000000000001",
                                               consumedCapacity={"memory": "10Gi"})])
    s2 = env.api.add("ns", "s2", UID2, [result("gpu-0", shareID="aaaaaaaa-0000-4000-8000-000000000002",
                                               consumedCapacity={"memory": "20Gi"})])
    out = env.prepare(st, [s1, s2])
    assert out[UID1].error == "" and out[UID2].error == ""
    assert out[UID2].devices[0].share_id == "aaaaaaaa-0000-4000-8000-000000000002"
    assert out[UID2].devices[0].cdi_device_ids == [f"{KIND}={UID2}-gpu-0-aaaaaaaa-0000-4000-8000-000000000002"]
    excl = env.api.add("ns", "excl", UID3, [result("gpu-0")])
    before = env.snapshot()
    assert "already in use by claim ns/s1" in env.prepare(st, [excl])[UID3].error
    assert env.snapshot() == before
    admin_uid = "e0e0e0e0-0000-4000-8000-00000000ad00"
    admin = env.api.add("ns", "monitor", admin_uid, [result("gpu-0", adminAccess=True)])
    assert env.prepare(st, [admin])[admin_uid].error == ""


def test_prepare_is_idempotent_and_survives_claim_deletion(env: Env) -> None:
    ref = env.api.add("ns", "c", UID1, [result("gpu-2"), result("nic-1", "nics")])
    st = env.state()
    first = env.prepare(st, [ref])
    snap = env.snapshot()
    del env.api.claims[("ns", "c")]  # the kubelet may repeat prepare; the object is not needed again
    assert env.prepare(st, [ref]) == first
    env.api.fail_with = RuntimeError("API server down")
    assert env.prepare(st, [ref]) == first
    env.api.fail_with = None
    assert env.snapshot() == snap
    spec_path(env, UID1).unlink()  # someone wiped the CDI file: a repeat brings it back
    assert env.prepare(env.state(), [ref]) == first
    assert env.snapshot() == snap


def test_repeat_fails_cleanly_if_spec_cannot_be_rebuilt(env: Env) -> None:
    ref = env.api.add("ns", "c", UID1, [result("gpu-3")])
    st = env.state()
    env.prepare(st, [ref])
    spec_path(env, UID1).unlink()
    st.inventory.set([d for d in DEVICES if d.name != "gpu-3"])
    out = env.prepare(st, [ref])
    assert "gpu-3 is no longer present" in out[UID1].error
    assert UID1 in env.checkpoint().claims  # still prepared: unprepare must still work
    assert st.unprepare([ref]) == {UID1: ""}


def test_set_devices_changes_what_can_be_prepared(env: Env) -> None:
    st = env.state(devices=[gpu(0)])
    ref = env.api.add("ns", "c", UID1, [result("gpu-1")])
    assert "unknown" in env.prepare(st, [ref])[UID1].error
    assert st.inventory.set([gpu(0), gpu(1)])
    assert env.prepare(st, [ref])[UID1].error == ""
    assert not st.inventory.set([gpu(0), gpu(1)])  # no change, no notification


def test_empty_batches() -> None:
    # No IO at all for empty calls; dirs are never touched.
    st = DeviceState.__new__(DeviceState)
    assert st.prepare([]) == {}
    assert st.unprepare([]) == {}


def test_nvidia_toolkit_ids_compose(env: Env) -> None:
    nv = env.root / "etc-cdi"
    nv.mkdir()
    g = gpu(1, nodes=True)
    (nv / "nvidia.yaml").write_text(textwrap.dedent(f"""\
        cdiVersion: 0.5.0
        kind: nvidia.com/gpu
        devices:
        - name: "{g.uuid}"
          containerEdits:
            deviceNodes: [{{path: /dev/nvidia1}}]
        """))
    st = env.state(devices=[g], nvidia_spec_dirs=[nv, env.cdi_root])
    ref = env.api.add("ns", "c", UID1, [result("gpu-1")])
    out = env.prepare(st, [ref])
    assert out[UID1].devices[0].cdi_device_ids == [f"{KIND}={UID1}-gpu-1", f"nvidia.com/gpu={g.uuid}"]
    edits = json.loads(spec_path(env, UID1).read_text())["devices"][0]["containerEdits"]
    assert {"path": "/dev/nvidia1"} in edits["deviceNodes"]


def test_write_failures_roll_back(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    st = env.state()
    ref = env.api.add("ns", "c", UID1, [result("gpu-0")])

    def no_space(*_a: Any, **_k: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cdi, "write_spec", no_space)
    out = env.prepare(st, [ref])
    assert "cannot write CDI spec" in out[UID1].error and "ns/c" in out[UID1].error
    assert not (env.state_dir / checkpoint.FILE_NAME).exists()  # nothing was written at all
    assert not spec_path(env, UID1).exists()
    monkeypatch.undo()

    def save_fails(path: Path, data: checkpoint.CheckpointData, **kw: Any) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(checkpoint, "save", save_fails)
    out = env.prepare(st, [ref])
    assert "cannot write checkpoint" in out[UID1].error
    assert not spec_path(env, UID1).exists()  # the spec written before the checkpoint is taken back
    monkeypatch.undo()
    assert env.prepare(st, [ref])[UID1].error == ""
    assert env.checkpoint().claims[UID1].state == "PrepareCompleted"


@dataclass
class Recorder:
    """An ``Observer`` that keeps what it is told."""

    counts: list[tuple[int, int]] = field(default_factory=list)
    holds: list[tuple[str, float]] = field(default_factory=list)

    def prepared(self, claims: int, devices: int) -> None:
        self.counts.append((claims, devices))

    def lock_held(self, operation: str, seconds: float) -> None:
        self.holds.append((operation, seconds))

    def published(self, devices: int) -> None:
        raise AssertionError("the state publishes nothing")


def test_observer_follows_prepared_state_and_lock_holds(env: Env) -> None:
    rec = Recorder()
    st = env.state(observer=rec)
    assert rec.counts == [(0, 0)] and [op for op, _ in rec.holds] == ["recover"]
    ref = env.api.add("ns", "c", UID1, [result("gpu-0"), result("gpu-1")])
    env.prepare(st, [ref])
    assert rec.counts[-1] == (1, 2) and len(rec.counts) == 2  # one checkpoint write per prepare
    st.unprepare([ref])
    assert rec.counts[-1] == (0, 0)
    assert [op for op, _ in rec.holds] == ["recover", "prepare", "unprepare"]
    assert all(0 <= t < 5 for _, t in rec.holds)


def test_fsyncs_per_call(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint is the only fsynced file, once per call, its data only: the kubelet prepares again
    after a reboot, and an unprepare lost in one is released by the cleanup pass (test_lost_unprepare_*).

    CDI specs are never fsynced (re-created from the checkpoint at start); a batch costs
    the same as one claim.
    """
    st = env.state()
    synced: list[str] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    one = env.api.add("ns", "one", UID1, [result("gpu-0")])
    env.prepare(st, [one])
    state_dir = str(env.state_dir)
    assert len(synced) == 1 and synced[0].startswith(f"{state_dir}/.checkpoint.json.tmp-"), synced
    synced.clear()
    st.unprepare([one])
    assert len(synced) == 1 and synced[0].startswith(f"{state_dir}/.checkpoint.json.tmp-"), synced
    synced.clear()
    batch = [env.api.add("ns", "a", UID1, [result("gpu-0")]), env.api.add("ns", "b", UID2, [result("gpu-1")]),
             env.api.add("ns", "c", UID3, [result("nic-0", "nics")])]
    assert all(r.error == "" for r in env.prepare(st, batch).values())
    assert len(synced) == 1
    synced.clear()
    st.unprepare(batch)
    assert len(synced) == 1


def test_calls_queued_behind_the_lock_are_served_together(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Group commit: while one call holds the lock, the others queue and share one checkpoint write sequence.

    A UID asked for by two concurrent calls is prepared once and both get its answer.
    """
    st = env.state()
    refs = [env.api.add("ns", f"c{k}", f"{k:08d}-0000-4000-8000-000000000000", [result(f"gpu-{k}")])
            for k in range(4)]
    fetched = {r.uid: ClaimFetcher(env.api, DRIVER, NODE).fetch([r]) for r in refs}
    first_write = threading.Event()
    release = threading.Event()
    real_write = cdi.write_spec

    def held_write(*args: Any, **kwargs: Any) -> Path:
        if not first_write.is_set():
            first_write.set()
            assert release.wait(10)
        return real_write(*args, **kwargs)

    saves: list[int] = []
    real_save = checkpoint.save

    def counting_save(path: Path, data: checkpoint.CheckpointData, **kw: Any) -> None:
        saves.append(len(data.claims))
        real_save(path, data, **kw)

    monkeypatch.setattr(cdi, "write_spec", held_write)
    monkeypatch.setattr(checkpoint, "save", counting_save)
    answers: dict[int, dict[str, PrepareResult]] = {}

    def call(k: int, claims: list[Any]) -> None:
        answers[k] = st.prepare(claims)

    holder = threading.Thread(target=call, args=(0, fetched[refs[0].uid]))
    holder.start()
    assert first_write.wait(10)  # call 0 holds the lock, inside its CDI write
    waiters = [threading.Thread(target=call, args=(k, fetched[refs[k].uid])) for k in (1, 2, 3)]
    waiters.append(threading.Thread(target=call, args=(4, fetched[refs[3].uid])))  # the same claim again
    for t in waiters:
        t.start()
    deadline = time.monotonic() + 10
    while len(st._queues["prepare"]) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    for t in [holder, *waiters]:
        t.join(20)
    assert all(r.error == "" for a in answers.values() for r in a.values()), answers
    assert [set(answers[k]) for k in range(5)] == [{refs[k].uid} for k in (0, 1, 2, 3, 3)]
    assert answers[3] == answers[4]
    assert saves == [1, 4]  # call 0: one checkpoint write; calls 1-4 together: one write
    assert set(env.checkpoint().claims) == {r.uid for r in refs}


# ---------------------------------------------------------------- unprepare


def test_unprepare_removes_spec_and_entry_and_is_idempotent(env: Env) -> None:
    st = env.state()
    a = env.api.add("ns", "a", UID1, [result("gpu-0")])
    b = env.api.add("ns", "b", UID2, [result("gpu-1")])
    env.prepare(st, [a, b])
    env.api.claims.clear()  # claim objects deleted before unprepare: normal
    assert st.unprepare([a]) == {UID1: ""}
    assert not spec_path(env, UID1).exists() and spec_path(env, UID2).exists()
    assert set(env.checkpoint().claims) == {UID2}
    assert st.unprepare([a]) == {UID1: ""}  # again: ok
    unknown = ClaimRef("ns", UID3, "never")
    assert st.unprepare([unknown, b]) == {UID3: "", UID2: ""}
    assert env.checkpoint().claims == {}
    assert list(env.cdi_root.iterdir()) == []
    # gpu-0 is free again
    env.api.add("ns", "next", UID3, [result("gpu-0")])
    assert env.prepare(st, [ClaimRef("ns", UID3, "next")])[UID3].error == ""


def test_unprepare_after_restart_uses_only_checkpoint(env: Env) -> None:
    ref = env.api.add("ns", "a", UID1, [result("gpu-0")])
    env.prepare(env.state(), [ref])
    env.api.claims.clear()
    env.api.fail_with = RuntimeError("API server down")
    assert env.state().unprepare([ref]) == {UID1: ""}
    assert env.api.calls == 1  # only the original prepare talked to the API
    assert list(env.cdi_root.iterdir()) == []


# ---------------------------------------------------------------- restart / reboot / corruption


def test_cdi_dir_wiped_specs_come_back_on_restart(env: Env) -> None:
    st = env.state()
    refs = [env.api.add("ns", "a", UID1, [result("gpu-0")]), env.api.add("ns", "b", UID2, [result("nic-0")])]
    env.prepare(st, refs)
    before = env.snapshot()
    for p in env.cdi_root.iterdir():
        p.unlink()
    st2 = env.state()
    assert sorted(st2.last_recovery.recreated) == sorted([UID1, UID2])
    assert not st2.last_recovery.rebooted
    assert env.snapshot() == before  # identical specs, checkpoint untouched


def test_reboot_recreates_all_specs_from_current_devices(env: Env) -> None:
    st = env.state(devices=[gpu(0, nodes=True)])
    ref = env.api.add("ns", "a", UID1, [result("gpu-0")])
    first = env.prepare(st, [ref])
    path = spec_path(env, UID1)
    path.write_text(path.read_text().replace("/dev/nvidia0", "/dev/nvidia7"))  # stale content from old boot
    env.boot.write_text("22222222-aaaa-bbbb-cccc-000000000002\n")
    # After the reboot device nodes were renumbered; specs must be re-derived, not replayed.
    moved = Device(**{**gpu(0).model_dump(), "device_nodes": ("/dev/nvidia3", "/dev/nvidiactl")})
    st2 = env.state(devices=[moved])
    assert st2.last_recovery.rebooted and st2.last_recovery.recreated == [UID1]
    nodes = json.loads(path.read_text())["devices"][0]["containerEdits"]["deviceNodes"]
    assert nodes == [{"path": "/dev/nvidia3"}, {"path": "/dev/nvidiactl"}]
    assert env.checkpoint().boot_id == "22222222-aaaa-bbbb-cccc-000000000002"
    assert env.prepare(st2, [ref]) == first  # kubelet re-prepares after reboot: same answer
    assert not env.state(devices=[moved]).last_recovery.rebooted  # recorded: next start is no reboot


def test_reboot_with_missing_device_keeps_claim_for_unprepare(env: Env) -> None:
    ref = env.api.add("ns", "a", UID1, [result("gpu-2")])
    env.prepare(env.state(), [ref])
    for p in env.cdi_root.iterdir():
        p.unlink()
    env.boot.write_text("33333333-aaaa-bbbb-cccc-000000000003\n")
    st = env.state(devices=[gpu(0)])
    assert UID1 in st.last_recovery.unrecoverable
    assert "gpu-2 is no longer present" in st.last_recovery.unrecoverable[UID1]
    assert UID1 in env.checkpoint().claims
    assert st.unprepare([ref]) == {UID1: ""}


def test_corrupt_checkpoint_refuses_to_start_unless_quarantined(env: Env) -> None:
    ref = env.api.add("ns", "a", UID1, [result("gpu-0")])
    env.prepare(env.state(), [ref])
    cp = env.state_dir / checkpoint.FILE_NAME
    raw = cp.read_bytes().replace(b"gpu-0", b"gpu-1")
    cp.write_bytes(raw)
    with pytest.raises(CheckpointCorrupt, match="checksum mismatch"):
        env.state()
    assert cp.read_bytes() == raw  # untouched
    assert spec_path(env, UID1).exists()
    st = env.state(quarantine_corrupt=True)
    q = st.last_recovery.quarantined
    assert q is not None and Path(q).read_bytes() == raw and ".corrupt-" in q
    assert not cp.exists()
    assert st.last_recovery.orphan_specs == [UID1]  # reported, left for the operator
    assert spec_path(env, UID1).exists()


def test_unexpected_error_under_the_lock_answers_every_claim(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    st = env.state()
    ref = env.api.add("ns", "a", UID1, [result("gpu-0")])
    def bug(*_a: Any) -> dict[str, Any]:
        raise KeyError("bug")

    monkeypatch.setattr(cdi, "valid_spec", bug)
    out = env.prepare(st, [ref])
    assert "prepare failed on node node-a: 'bug'" in out[UID1].error and "ns/a" in out[UID1].error
    assert env.snapshot() == {}
    monkeypatch.undo()
    assert env.prepare(st, [ref])[UID1].error == ""  # the lock was released


def test_corruption_after_start_fails_calls_not_process(env: Env) -> None:
    st = env.state()
    (env.state_dir / checkpoint.FILE_NAME).write_text("{not json")
    ref = env.api.add("ns", "a", UID1, [result("gpu-0")])
    out = env.prepare(st, [ref])
    assert "is unusable: not valid JSON" in out[UID1].error
    assert "is unusable" in st.unprepare([ref])[UID1]
    assert not spec_path(env, UID1).exists()


def test_unknown_crash_point_is_rejected(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown crash point"):
        env.state(crash_point="sometime")
    monkeypatch.setenv("TOPODRA_CRASH_POINT", "after-cdi-written")
    assert env.state().crash_point == "after-cdi-written"


# ---------------------------------------------------------------- real crashes (subprocess)

CHILD = textwrap.dedent("""\
    import json, sys
    from topodra.claims import ClaimRef
    from topodra.devices import Device
    from topodra.inventory import Inventory
    from topodra.plugin.server import ClaimFetcher
    from topodra.state import DeviceState
    cfg = json.load(open(sys.argv[1]))
    claims = {(c["metadata"]["namespace"], c["metadata"]["name"]): c for c in cfg["claims"]}
    st = DeviceState("gpu.topodra.io", "node-a", Inventory(Device.model_validate(d) for d in cfg["devices"]),
                     cfg["cdi_root"], cfg["state_dir"], boot_id_path=cfg["boot"], nvidia_spec_dirs=[])
    fetcher = ClaimFetcher(lambda ns, n: claims.get((ns, n)), "gpu.topodra.io", "node-a")
    out = st.prepare(fetcher.fetch([ClaimRef(**r) for r in cfg["refs"]]))
    print(json.dumps({u: r.error for u, r in out.items()}))
""")


def run_child(env: Env, refs: list[ClaimRef], crash_point: str) -> subprocess.CompletedProcess[str]:
    cfg = {"devices": [d.model_dump(mode="json") for d in DEVICES], "claims": list(env.api.claims.values()),
           "refs": [r.__dict__ for r in refs], "cdi_root": str(env.cdi_root), "state_dir": str(env.state_dir),
           "boot": str(env.boot)}
    cfg_path = env.root / "child.json"
    cfg_path.write_text(json.dumps(cfg))
    child_env = {**os.environ, "TOPODRA_CRASH_POINT": crash_point}
    return subprocess.run([sys.executable, "-c", CHILD, str(cfg_path)], capture_output=True, text=True,
                          env=child_env, timeout=120, check=False)


@pytest.mark.parametrize("point", ["prepare-before-write", "after-cdi-written", "after-checkpoint-written"])
def test_crash_mid_prepare_then_recovery(env: Env, tmp_path: Path, point: str) -> None:
    keep = env.api.add("ns", "keep", UID2, [result("gpu-3")])
    env.prepare(env.state(), [keep])
    refs = [env.api.add("ns", "a", UID1, [result("gpu-0"), result("nic-0", "nics")])]
    proc = run_child(env, refs, point)
    assert proc.returncode == 137, proc.stderr
    durable = point == "after-checkpoint-written"
    assert (UID1 in env.checkpoint().claims) == durable
    assert spec_path(env, UID1).exists() == (point != "prepare-before-write")

    st = env.state()
    # Before the checkpoint write, the spec is an orphan (the kubelet got no answer): removed.
    assert st.last_recovery.orphans_removed == ([UID1] if point == "after-cdi-written" else [])
    assert spec_path(env, UID1).exists() == durable  # no leaked spec, no lost one
    assert set(env.checkpoint().claims) == ({UID1, UID2} if durable else {UID2})  # the other is untouched
    again = env.prepare(st, refs)  # the kubelet's retry: prepared again, or answered from the checkpoint

    clean = Env(tmp_path / "clean", env.api, env.boot)  # the same claim prepared without a crash
    assert again == env.prepare(clean.state(), refs)
    assert spec_path(env, UID1).read_bytes() == spec_path(clean, UID1).read_bytes()
    assert sorted(p.name for p in env.cdi_root.iterdir()) == sorted(
        [spec_path(env, UID1).name, spec_path(env, UID2).name])


def test_crash_without_restart_is_repaired_by_peer_under_lock(env: Env) -> None:
    """A rolling-upgrade peer that keeps running: the dead prepare held nothing, its orphan spec is swept."""
    st = env.state()  # started before the crash: its startup recovery saw nothing
    refs = [env.api.add("ns", "a", UID1, [result("gpu-0")])]
    assert run_child(env, refs, "after-cdi-written").returncode == 137
    other = env.api.add("ns", "b", UID2, [result("gpu-0")])  # wants the device the dead prepare planned
    assert env.prepare(st, [other])[UID2].error == ""
    assert set(env.checkpoint().claims) == {UID2}
    assert spec_path(env, UID1).exists()  # the orphan waits for the periodic cleanup
    assert st.cleanup([]) == ({}, [UID1])
    assert not spec_path(env, UID1).exists() and spec_path(env, UID2).exists()


def test_started_entry_of_an_older_plugin_is_rolled_back(env: Env) -> None:
    """PrepareStarted stays in the format (issue 11 writes it before MIG changes): still rolled back."""
    ref = env.api.add("ns", "a", UID1, [result("gpu-0")])
    env.prepare(env.state(), [ref])
    data = env.checkpoint()
    started = data.claims[UID1].model_copy(update={"state": "PrepareStarted"})
    checkpoint.save(env.state_dir / checkpoint.FILE_NAME, data.with_claim(started))
    st = env.state()
    assert st.last_recovery.rolled_back == [UID1]
    assert not spec_path(env, UID1).exists() and env.checkpoint().claims == {}
    assert env.prepare(st, [ref])[UID1].error == ""


# ---------------------------------------------------------------- two processes contend for the lock


def _contender(root: str, ns_name_uid: tuple[str, str, str], device: str, log_path: str,
               barrier: Any) -> None:
    """Run in a separate process: prepare one claim with a slow CDI write inside the lock."""
    ns, name, uid = ns_name_uid
    claim = claim_json(ns, name, uid, [result(device)])
    real_write = cdi.write_spec

    def slow_write(*args: Any, **kwargs: Any) -> Path:
        with open(log_path, "a") as f:
            f.write(f"enter {name}\n")
        time.sleep(0.4)
        with open(log_path, "a") as f:
            f.write(f"exit {name}\n")
        return real_write(*args, **kwargs)

    cdi.write_spec = slow_write  # a separate process: nothing to undo
    st = DeviceState(DRIVER, NODE, Inventory(DEVICES), Path(root) / "cdi", Path(root) / "state",
                     boot_id_path=str(Path(root) / "boot_id"), nvidia_spec_dirs=[])
    fetched = ClaimFetcher(lambda _ns, _n: claim, DRIVER, NODE).fetch([ClaimRef(ns, uid, name)])
    barrier.wait()
    out = st.prepare(fetched)
    if out[uid].error:
        raise SystemExit(out[uid].error)


def test_two_processes_serialize(env: Env) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    log_path = env.root / "order.log"
    procs = [
        ctx.Process(target=_contender, args=(str(env.root), ("ns", "one", UID1), "gpu-0", str(log_path), barrier)),
        ctx.Process(target=_contender, args=(str(env.root), ("ns", "two", UID2), "gpu-1", str(log_path), barrier)),
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    lines = log_path.read_text().split()
    events = list(zip(lines[::2], lines[1::2], strict=True))
    # Each critical section finishes before the other starts: enter X, exit X, enter Y, exit Y.
    assert [e[0] for e in events] == ["enter", "exit", "enter", "exit"]
    assert events[0][1] == events[1][1] and events[2][1] == events[3][1] != events[0][1]
    # No lost update: both processes' claims are in the one checkpoint.
    assert set(env.checkpoint().claims) == {UID1, UID2}
    assert {spec_path(env, UID1).exists(), spec_path(env, UID2).exists()} == {True}


def test_lock_timeout_is_a_per_claim_error(env: Env) -> None:
    from topodra.filelock import FileLock

    st = env.state(lock_timeout=0.2)
    ref = env.api.add("ns", "a", UID1, [result("gpu-0")])
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""\
            import sys, time
            from topodra.filelock import FileLock
            with FileLock({str(env.state_dir / 'serialize.lock')!r}):
                print("locked", flush=True)
                time.sleep(30)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        out = env.prepare(st, [ref])
        assert "another topodra plugin process" in out[UID1].error and "ns/a" in out[UID1].error
    finally:
        holder.kill()
        holder.wait()
    assert env.prepare(st, [ref])[UID1].error == ""
    with FileLock(env.state_dir / "serialize.lock", timeout=1):
        pass


def test_prepared_uid_under_another_name_is_refused(env: Env) -> None:
    st = env.state()
    ref = env.api.add("ns", "a", UID1, [result("gpu-0")])
    assert env.prepare(st, [ref])[UID1].error == ""
    before = env.snapshot()
    for ns, name in (("other", "a"), ("ns", "b")):
        env.api.add(ns, name, UID1, [result("gpu-1")])
        err = env.prepare(st, [ClaimRef(namespace=ns, uid=UID1, name=name)])[UID1].error
        assert "is prepared on node" in err and "ns/a" in err
    assert env.snapshot() == before


@pytest.mark.parametrize(("ns", "uid", "name", "bad"), [
    ("ns", "../etc", "a", "uid"), ("ns", "a/b", "a", "uid"), ("ns", "a..b", "a", "uid"), ("ns", "x\0", "a", "uid"),
    ("ns", "u" * 129, "a", "uid"), ("Ns", UID1, "a", "namespace"), ("n/s", UID1, "a", "namespace"),
    ("ns", UID1, "A", "name"), ("ns", UID1, "a/../b", "name"), ("ns", UID1, "a" * 254, "name"),
    ("ns", UID1, "ünï", "name")])
def test_claim_refs_that_cannot_exist_are_named(ns: str, uid: str, name: str, bad: str) -> None:
    from topodra.claims import ref_problem

    problem = ref_problem(ns, uid, name)
    assert problem is not None and problem.startswith(bad) and len(problem) < 300


def test_real_claim_refs_pass() -> None:
    from topodra.claims import ref_problem

    assert ref_problem("team-a", UID1, "train-0.gpus-x7k2p") is None
    assert ref_problem("a" * 63, "u" * 128, "b" * 253) is None
