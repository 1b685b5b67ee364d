"""``bench/run prepare``: NodePrepareResources / NodeUnprepareResources latency and plugin memory, on a real cluster.

What runs (all loopback, all real except the kubelet):

* A private ``hack/testkit/cluster.py`` instance (``Cluster.private("bench-prepare")``: own state
  directory, ports picked free): etcd, kube-apiserver, kube-controller-manager, kube-scheduler, one
  kubelet-less Ready node ``fake-bench-0`` and the DeviceClass ``gpu.topodra.io``. Runs of this
  bench queue on that instance's lock (``LOCK_FILE``; two at once on 2 cores would measure each
  other), never on the test sessions' cluster lock; the cluster is always torn down.
* The real plugin process (``topodra kubelet-plugin --hardware mock:dgx-h100``, 8 GPUs + 8 NICs;
  ``plugin.py``) with its own plugin, registry and CDI directories: it publishes its ResourceSlice
  through the apiserver and serves its real DRA socket. No kubelet watches its registry directory.
* ResourceClaims referenced by pods pinned to the node (``claims.py``): the real scheduler allocates
  them from the plugin's slice (the pods never run: there is no kubelet).
* This process plays the kubelet (``hack/testkit/kubeletstub.py``) and times prepare+unprepare cycles over
  the socket (``cycles.py``), with a device-health stream held open. Every answer is checked: no
  error, the right device count, the CDI spec written after prepare and gone after unprepare, and the
  plugin's own request counter must count every timed call.

What one cycle costs the plugin (docs/prepare.md, "Durability"): prepare GETs the claim, checks its
allocation, writes the CDI spec (not fsynced) and then the checkpoint (one data fsync, then the
rename); unprepare removes the spec and writes the checkpoint (data and directory fsync).

Default run (``scenarios.py``): sequential cycles on one exclusive 1-GPU claim and one exclusive
8-GPU claim; 8 concurrent callers on 8 exclusive 1-GPU claims (a full node of single-GPU pods
starting at once); ``--concurrency`` (32) callers on as many admin-access claims of 1 and of 8 GPUs
(admin access is the only way to have 32 claims allocated on the same 8 GPUs; the plugin does the
same work for them). The plugin's memory (VmRSS, VmHWM) is read idle, sampled during the runs and
read after; the verdicts compare with the targets (prepare p99 <= 20 ms for the sequential 8-GPU
claim, RSS <= 80 MB). Missing a target is reported, not an error.

``--compare-with BINARY`` (``compare.py``, ``other.py``): the three exclusive scenarios against
topodra and another DRA kubelet plugin at once, each on its own kubelet-less node, in interleaved
blocks (A B, B A, ...; ``--rounds``), and a side-by-side table of topodra / other.

Results: ``bench/results/prepare/<UTC time>[-compare].json`` unless ``--out``; bench/README.md has
the options, docs/benchmarks.md the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from bench.paths import REPO, result_file
from bench.prepare.common import DRIVER, HARDWARE, NODE, BenchError, log
from bench.prepare.compare import compare_bench, format_comparison
from bench.prepare.other import EXAMPLE_ARGS, PLACEHOLDERS, expand_template
from bench.prepare.scenarios import bench, print_table, verdicts
from testkit import cluster as localcluster

INSTANCE = "bench-prepare"
LOCK_FILE = localcluster.instance_lock_file(INSTANCE)

cluster_lock = localcluster.cluster_lock  # one implementation, shared with the other benchmarks


@contextlib.contextmanager
def lock_held_by_caller() -> Iterator[None]:
    """For ``--lock-held``: the caller (e.g. ``flock LOCK_FILE sh -c '...'`` around several runs) holds
    the lock; refuse to run when nobody does, since two runs would then share the CPUs unknowingly."""
    fd = os.open(LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield
            return
        raise BenchError(f"--lock-held, but nobody holds {LOCK_FILE}")
    finally:
        os.close(fd)


class Timeout(Exception):
    pass


def _on_alarm(_signum: int, _frame: FrameType | None) -> None:
    raise Timeout("benchmark exceeded --timeout")


def host_info() -> dict[str, Any]:
    return {"python": platform.python_version(), "kernel": platform.release(), "cpus": os.cpu_count(),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "kubernetes": localcluster.K8S_VERSION}


def env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/run prepare", description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=300, help="timed prepare+unprepare cycles per sequential scenario")
    p.add_argument("--concurrency", type=int, default=32, help="callers in the admin-access concurrent scenarios")
    p.add_argument("--concurrent-cycles", type=int, default=10, help="timed cycles per concurrent caller")
    p.add_argument("--warmup", type=int, default=20, help="untimed cycles before a sequential scenario")
    p.add_argument("--settle", type=float, default=3.0, help="seconds to let the idle plugin settle before "
                   "measuring idle memory")
    p.add_argument("--plugin-env", action="append", default=[], type=env_pair, metavar="NAME=VALUE",
                   help="extra environment of the plugin process (repeatable), e.g. MALLOC_ARENA_MAX=2")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON result file (default bench/results/prepare/<UTC time>[-compare].json)")
    p.add_argument("--timeout", type=int, default=1200, help="give up (and clean up) after this many seconds")
    p.add_argument("--lock-timeout", type=float, default=1800, help="seconds to wait for the cluster lock")
    p.add_argument("--lock-held", action="store_true",
                   help=f"the caller already holds {LOCK_FILE} (several runs in one turn: "
                        f"flock {LOCK_FILE} sh -c 'bench/run prepare --lock-held ...; "
                        "bench/run prepare --lock-held ...')")
    c = p.add_argument_group("side by side with another DRA kubelet plugin")
    c.add_argument("--compare-with", type=Path, metavar="PLUGIN_BINARY",
                   help="run the exclusive-claim scenarios against this kubelet plugin too, in interleaved blocks "
                        "(topodra and it at once, each on its own kubelet-less node)")
    c.add_argument("--compare-args", default=EXAMPLE_ARGS, metavar="TEMPLATE",
                   help="its command-line arguments; placeholders: "
                        + "; ".join(f"{{{k}}} {v}" for k, v in PLACEHOLDERS.items())
                        + f". Default (kubernetes-sigs/dra-example-driver's kubelet plugin): {EXAMPLE_ARGS}")
    c.add_argument("--compare-env", action="append", default=[], type=env_pair, metavar="NAME=VALUE",
                   help="extra environment of the other plugin (repeatable)")
    c.add_argument("--compare-label", default=None, help="its name in the table (default: the binary's file name)")
    c.add_argument("--rounds", type=int, default=6, help="interleaved rounds (one block per plugin each) per scenario")
    args = p.parse_args(argv)
    for name in ("cycles", "concurrency", "concurrent_cycles", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.compare_with is not None:
        if not (args.compare_with.is_file() and os.access(args.compare_with, os.X_OK)):
            p.error(f"--compare-with {args.compare_with}: not an executable file")
        args.compare_with = args.compare_with.resolve()
        try:
            expand_template(args.compare_args, dict.fromkeys(PLACEHOLDERS, "x"))
        except BenchError as e:
            p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        log("the local cluster needs root (it binds fixed ports and writes /etc/hosts)")
        return 2
    previous = {s: signal.getsignal(s) for s in (signal.SIGALRM, signal.SIGTERM)}
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGTERM, lambda *_: _on_alarm(0, None))
    started = time.time()
    failed = True
    try:
        with lock_held_by_caller() if args.lock_held else cluster_lock(args.lock_timeout, LOCK_FILE):
            signal.alarm(args.timeout)
            started = time.time()
            kind = "prepare" if args.compare_with is None else "prepare-compare"
            out: Path = args.out or result_file("prepare", "" if args.compare_with is None else "compare",
                                                when=started)
            workdir = Path(tempfile.mkdtemp(prefix="topodra-bench-"))
            lc = localcluster.Cluster.private(INSTANCE)
            try:
                log("starting the control plane (etcd, apiserver, controller-manager, scheduler)")
                lc.up(node=False, build=True)
                result: dict[str, Any] = {"benchmark": kind, "started": time.strftime(
                    "%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "host": host_info(),
                    "config": {"node": NODE, "hardware": HARDWARE, "driver": DRIVER, "cycles": args.cycles,
                               "concurrency": args.concurrency, "concurrent_cycles": args.concurrent_cycles,
                               "warmup": args.warmup, "plugin_env": dict(args.plugin_env),
                               "workdir_fs": fs_type(workdir)}}
                if args.compare_with is None:
                    result.update(bench(args, lc, workdir))
                    result["verdicts"] = verdicts(result)
                else:
                    result["config"].update({"compare_with": str(args.compare_with), "rounds": args.rounds,
                                             "compare_env": dict(args.compare_env)})
                    result.update(compare_bench(args, lc, workdir))
                result["duration_s"] = round(time.time() - started, 1)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(result, indent=2) + "\n")
                if args.compare_with is None:
                    print_table(result)
                else:
                    print(format_comparison(result["comparison"], result["a"]["label"], result["b"]["label"]))
                log(f"results written to {out}")
                failed = False
            finally:
                signal.alarm(0)
                os.environ.setdefault("TOPODRA_LOG_ARCHIVE", str(REPO / ".run" / "bench-logs"))
                lc.down(quiet=True, keep_logs=failed)
                shutil.rmtree(workdir, ignore_errors=True)
    except (BenchError, Timeout, localcluster.ClusterError) as e:
        log(f"FAILED: {e}")
        return 1
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 0


def fs_type(path: Path) -> str:
    """Filesystem type of the mount holding ``path`` (fsync cost depends on it)."""
    best, kind = "", "?"
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if str(path).startswith(parts[1]) and len(parts[1]) >= len(best):
            best, kind = parts[1], parts[2]
    return kind


if __name__ == "__main__":
    sys.exit(main())
