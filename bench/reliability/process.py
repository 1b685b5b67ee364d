"""Crash runs on a real process over the real socket: SIGKILL from outside, the kubelet stub retries.

The fork-based runs (``crash.py``) are fast; these check the same thing
end to end with what the kubelet sees. Each run starts a plugin process
(``python -m bench.reliability.process serve``: the plugin's gRPC servicers,
``ClaimFetcher`` and ``DeviceState`` on a unix socket; the API server is a JSON
file of claim objects), sends concurrent NodePrepareResources and
NodeUnprepareResources calls through ``testkit.kubeletstub``, and kills the process
with SIGKILL after a random delay, or lets it die at a random ``TOPODRA_CRASH_POINT``.
Then it starts the process again and retries every call that got no answer, as the
kubelet does, until each succeeds; answered calls must still hold, and
``common.violations`` must be empty.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from bench.paths import REPO
from bench.reliability.common import DRIVER, NODE, Node, claim_obj, devices, violations
from testkit.kubeletstub import KubeletStub

HERE = REPO / "bench"

POINTS = ("prepare-before-write", "prepare-mid-cdi", "after-cdi-written", "after-checkpoint-written",
          "after-unprepare-cdi-removed", "after-unprepare-checkpoint-written")


def serve(root: Path) -> None:
    """The plugin process: real servicers on ``root/dra.sock``, claims read from ``root/api.json``."""
    from bench.reliability.common import quiet

    from topodra.pb.dra.v1 import api_pb2 as dra_v1
    from topodra.pb.dra.v1 import api_pb2_grpc as dra_v1_grpc
    from topodra.plugin.server import ClaimFetcher, DRAPluginServicer

    quiet()
    node = Node(root / "node")
    api_file = root / "api.json"

    def get(ns: str, name: str) -> dict[str, Any] | None:
        objs: dict[str, Any] = json.loads(api_file.read_text())
        return objs.get(f"{ns}/{name}")

    state = node.state()
    fetcher = ClaimFetcher(get, DRIVER, NODE)
    server = grpc.server(futures.ThreadPoolExecutor(8))
    add: Any = dra_v1_grpc.add_DRAPluginServicer_to_server
    add(DRAPluginServicer(state, fetcher, dra_v1, "v1"), server)
    sock = root / "dra.sock"
    sock.unlink(missing_ok=True)
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    (root / "ready").write_text(str(os.getpid()))
    server.wait_for_termination()


def _start(root: Path, point: str | None) -> subprocess.Popen[bytes]:
    (root / "ready").unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("TOPODRA_CRASH_POINT", None)
    if point:
        env["TOPODRA_CRASH_POINT"] = point
    proc = subprocess.Popen([sys.executable, "-m", "bench.reliability.process", "serve", str(root)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (root / "ready").exists():
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else b""
            raise RuntimeError(f"plugin process exited {proc.returncode}: {err!r}"[:2000])
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("plugin process did not start in 60 s")
        time.sleep(0.01)
    return proc


def _call(sock: Path, kind: str, claims: list[tuple[str, str, str]], answered: dict[str, str],
          lock: threading.Lock) -> None:
    """One kubelet call; records the claims it answered successfully (none if the process died)."""
    try:
        with KubeletStub(sock) as stub:
            resp = (stub.prepare if kind == "prepare" else stub.unprepare)(claims, timeout=20)
    except grpc.RpcError:
        return  # the process died: no answer, the kubelet will retry
    with lock:
        for _, uid, _ in claims:
            if not resp.claims[uid].error:
                answered[uid] = kind


def run(runs: int, seed: int = 3, root: Path | None = None) -> dict[str, Any]:
    rng = random.Random(seed)
    lost: list[str] = []
    crashed = 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="topodra-proc-", dir=root) as tmp:
        base = Path(tmp)
        Node(base / "node").setup()
        api: dict[str, Any] = {}
        held: dict[str, tuple[str, list[str]]] = {}  # uid → (name, devices) the kubelet believes prepared
        counter = 0
        for run_no in range(1, runs + 1):
            used = {d for _, devs in held.values() for d in devs}
            free = [d.name for d in devices() if d.name not in used]
            rng.shuffle(free)
            fresh: list[tuple[str, str, str]] = []
            for _ in range(rng.randint(1, 3)):
                if not free:
                    break
                n = min(len(free), rng.randint(1, 8))
                devs, free = free[:n], free[n:]
                counter += 1
                uid = f"{counter:08x}-9c0c-4000-8000-{rng.getrandbits(48):012x}"
                api[f"proc/p{counter}"] = claim_obj("proc", f"p{counter}", uid, devs)
                fresh.append(("proc", uid, f"p{counter}"))
            unprep = [("proc", u, name) for u, (name, _) in held.items() if rng.random() < 0.5]
            (base / "api.json").write_text(json.dumps(api))
            point = rng.choice(POINTS) if rng.random() < 0.5 else None
            proc = _start(base, point)
            answered: dict[str, str] = {}
            lock = threading.Lock()

            calls = [("prepare", [c]) for c in fresh] + [("unprepare", [c]) for c in unprep]
            threads = [threading.Thread(target=_call, args=(base / "dra.sock", kind, claims, answered, lock))
                       for kind, claims in calls]
            for t in threads:
                t.start()
            if point is None:
                time.sleep(rng.uniform(0, 0.03))
                proc.send_signal(signal.SIGKILL)
            for t in threads:
                t.join()
            proc.kill()
            if proc.wait() != 0:
                crashed += 1
            if proc.stderr:
                proc.stderr.close()

            proc = _start(base, None)  # the restart; the kubelet retries until every call succeeds
            try:
                with KubeletStub(base / "dra.sock") as stub:
                    todo_p = [c for c in fresh if answered.get(c[1]) != "prepare"]
                    todo_u = [c for c in unprep if answered.get(c[1]) != "unprepare"]
                    if todo_p:
                        r = stub.prepare(todo_p, timeout=20)
                        lost += [f"run {run_no} ({point or 'sigkill'}): retried prepare {u}: {r.claims[u].error}"
                                 for _, u, _ in todo_p if r.claims[u].error]
                    if todo_u:
                        r = stub.unprepare(todo_u, timeout=20)
                        lost += [f"run {run_no} ({point or 'sigkill'}): retried unprepare {u}: {r.claims[u].error}"
                                 for _, u, _ in todo_u if r.claims[u].error]
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait()
                if proc.stderr:
                    proc.stderr.close()
            for ns, uid, name in fresh:
                held[uid] = (name, [x["device"] for x in api[f"{ns}/{name}"]["status"]["allocation"]["devices"]
                                    ["results"]])
            for _, uid, name in unprep:
                held.pop(uid, None)
                api.pop(f"proc/{name}", None)
            node = Node(base / "node")
            lost += [f"run {run_no} ({point or 'sigkill'}): {v}" for v in violations(node)]
            if set(node.checkpoint().claims) != set(held):
                lost.append(f"run {run_no}: kubelet holds {sorted(held)}, node has {sorted(node.checkpoint().claims)}")
    return {"runs": runs, "crashed": crashed, "lost": lost, "seconds": round(time.monotonic() - start, 2)}


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(Path(sys.argv[2]))
