"""An unprepare whose checkpoint rename a power loss undid: the cleanup pass releases the claim.

Unprepare fsyncs the checkpoint's data, not its directory (docs/prepare.md, *Durability*), so a power
loss or kernel crash may bring the previous checkpoint back: the claim is still recorded after the
reboot, and the kubelet never repeats an unprepare it saw succeed. Each test plays that crash for
real on disk (the checkpoint file as it was before the unprepare is put back, the boot ID changes),
starts a fresh ``DeviceState`` (the plugin after the reboot) and runs the plugin's cleanup pass over
a fake API server: the claim is released as soon as its allocation no longer names these devices,
and kept while it does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_state import UID1, UID2, Env, claim_json, env, result, spec_path

from topodra import checkpoint
from topodra.claims import ClaimRef
from topodra.plugin.cleanup import cleanup_once

__all__ = ["env"]  # the fixture

REBOOTED = "44444444-aaaa-bbbb-cccc-000000000004\n"


def lost_unprepare(env: Env, ref: ClaimRef) -> None:
    """Prepare ``ref``, unprepare it (the kubelet gets success), then lose that rename in a reboot."""
    st = env.state()
    assert env.prepare(st, [ref])[ref.uid].error == ""
    cp = env.state_dir / checkpoint.FILE_NAME
    before = cp.read_bytes()
    assert st.unprepare([ref]) == {ref.uid: ""}
    assert ref.uid not in env.checkpoint().claims and not spec_path(env, ref.uid).exists()
    cp.write_bytes(before)  # the rename never reached the disk: the old checkpoint is back
    env.boot.write_text(REBOOTED)


def allocate(env: Env, ref: ClaimRef, results: list[dict[str, Any]] | None) -> None:
    env.api.claims[(ref.namespace, ref.name)] = claim_json(ref.namespace, ref.name, ref.uid, results)


def test_lost_unprepare_is_released_once_the_claim_is_deallocated(env: Env) -> None:
    a = env.api.add("ns", "a", UID1, [result("gpu-0")])
    lost_unprepare(env, a)
    st = env.state()  # the plugin after the reboot
    assert st.last_recovery.rebooted and st.last_recovery.recreated == [UID1]  # recorded, so re-made
    b = env.api.add("ns", "b", UID2, [result("gpu-0")])
    refused = env.prepare(st, [b])[UID2].error
    assert "already in use by claim ns/a" in refused  # what the lost rename costs until the cleanup pass
    allocate(env, a, None)  # the resourceclaim controller cleared the allocation: its pod is done
    report = cleanup_once(st, env.api)
    assert report.unprepared == [UID1] and report.failed == {} and report.unreadable == {}
    assert UID1 not in env.checkpoint().claims and not spec_path(env, UID1).exists()
    assert env.prepare(st, [b])[UID2].error == ""  # the kubelet's retry
    assert cleanup_once(st, env.api).unprepared == []  # b is allocated these devices: kept


def test_lost_unprepare_is_released_when_allocated_elsewhere(env: Env) -> None:
    a = env.api.add("ns", "a", UID1, [result("gpu-1")])
    lost_unprepare(env, a)
    st = env.state()
    allocate(env, a, [result("gpu-1", pool="node-b")])  # deallocated, then allocated on another node
    assert cleanup_once(st, env.api).unprepared == [UID1]
    assert env.checkpoint().claims == {}


def test_lost_unprepare_of_a_claim_allocated_again_here_never_answers_the_old_devices(env: Env) -> None:
    a = env.api.add("ns", "a", UID1, [result("gpu-0")])
    lost_unprepare(env, a)
    st = env.state()
    allocate(env, a, [result("gpu-2")])  # the same claim, allocated again on this node, other devices
    err = env.prepare(st, [a])[UID1].error
    assert "prepared on node node-a with other devices" in err
    assert [d.device_name for d in env.checkpoint().claims[UID1].devices] == ["gpu-0"]  # nothing changed
    assert cleanup_once(st, env.api).unprepared == [UID1]
    out = env.prepare(st, [a])[UID1]  # the kubelet's retry: the new allocation
    assert out.error == "" and [d.device_name for d in out.devices] == ["gpu-2"]


def test_claim_still_allocated_the_same_devices_is_kept(env: Env) -> None:
    """After the reboot the claim is still allocated (its pod restarts here): nothing is released."""
    a = env.api.add("ns", "a", UID1, [result("gpu-0"), result("nic-0", "nics")])
    lost_unprepare(env, a)
    st = env.state()
    report = cleanup_once(st, env.api)
    assert report.unprepared == [] and UID1 in env.checkpoint().claims and spec_path(env, UID1).exists()
    assert [d.device_name for d in env.prepare(st, [a])[UID1].devices] == ["gpu-0", "nic-0"]


def test_claim_prepared_again_between_the_read_and_the_release_is_kept(env: Env) -> None:
    """The pass read "deallocated", then the claim was allocated here again and the kubelet prepared it
    before the pass took the lock: the pass must not take it away."""
    a = env.api.add("ns", "a", UID1, [result("gpu-0")])
    lost_unprepare(env, a)
    st = env.state()
    allocate(env, a, None)
    seen = {}

    def getter(ns: str, name: str) -> dict[str, Any] | None:
        obj = env.api(ns, name)
        seen[name] = obj
        allocate(env, a, [result("gpu-0")])  # allocated here again right after that read
        assert env.prepare(st, [a])[UID1].error == ""  # and prepared (the kubelet starts its new pod)
        return obj

    report = cleanup_once(st, getter)
    assert seen["a"] is not None and "allocation" not in seen["a"]["status"]
    assert report.unprepared == [] and report.failed == {}
    assert UID1 in env.checkpoint().claims and spec_path(env, UID1).exists()
    assert cleanup_once(st, env.api).unprepared == []  # allocated these devices: kept on later passes too


def test_unprepare_of_a_released_claim_is_a_no_op_success(env: Env) -> None:
    """The kubelet may still unprepare a claim the cleanup pass released (it had not seen its pod end)."""
    a = env.api.add("ns", "a", UID1, [result("gpu-3")])
    st = env.state()
    assert env.prepare(st, [a])[UID1].error == ""
    allocate(env, a, None)
    assert cleanup_once(st, env.api).unprepared == [UID1]
    before = {p.name: p.read_bytes() for p in Path(env.state_dir).iterdir() if p.is_file()}
    assert st.unprepare([a]) == {UID1: ""}
    assert {p.name: p.read_bytes() for p in Path(env.state_dir).iterdir() if p.is_file()} == before
