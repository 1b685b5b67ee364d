"""``python -m bench NAME [args]`` (or ``bench/run NAME [args]``): run one bench; ``--help`` lists them.

Each bench's module is imported only when it is asked for: most need a cluster's harness or
optional libraries the others do not.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

Main = Callable[[list[str]], int]


def _prepare(argv: list[str]) -> int:
    from bench.prepare.main import main

    return main(argv)


def _placement(argv: list[str]) -> int:
    from bench.placement.main import exit_on_sigterm, main

    exit_on_sigterm()
    return main(argv)


def _placement_plots(argv: list[str]) -> int:
    from bench.placement.plots import main

    return main(argv)


def _reliability(argv: list[str]) -> int:
    from bench.reliability.main import main

    return main(argv)


def _schedule_throughput(argv: list[str]) -> int:
    from bench.schedule_throughput.main import main

    return main(argv)


def _scale(argv: list[str]) -> int:
    from bench.scale.main import main

    return main(argv)


def _inventory(argv: list[str]) -> int:
    from bench.inventory.main import main

    return main(argv)


def _simulate(argv: list[str]) -> int:
    from bench.simulate.main import main

    return main(argv)


def _scorer_latency(argv: list[str]) -> int:
    from bench.scorer_latency.main import main

    return main(argv)


def _kueue_latency(argv: list[str]) -> int:
    from bench.kueue_latency.main import main

    return main(argv)


def _scorer_memory(argv: list[str]) -> int:
    from bench.scorer_memory.main import main

    return main(argv)


def _cel_engines(argv: list[str]) -> int:
    from bench.cel_engines.main import main

    return main(argv)


def _import_rss(argv: list[str]) -> int:
    from bench.import_rss.main import main

    return main(argv)


# name -> (entry, what it answers); the same order as the table in bench/README.md.
def _telemetry(argv: list[str]) -> int:
    from bench.telemetry.main import main

    return main(argv)


def _telemetry_flags(argv: list[str]) -> int:
    from bench.telemetry.flags import main

    return main(argv)


def _telemetry_pairs(argv: list[str]) -> int:
    from bench.telemetry.pairs import main

    return main(argv)


BENCHES: dict[str, tuple[Main, str]] = {
    "prepare": (_prepare, "NodePrepareResources latency and plugin memory (root, private cluster)"),
    "import_rss": (_import_rss, "memory each plugin dependency adds (no cluster)"),
    "telemetry": (_telemetry, "CPU and RSS of the telemetry sampler, 8 GPUs + 8 NICs (no cluster)"),
    "telemetry_flags": (_telemetry_flags, "idle-claim flag latency and false flags over a mixed scenario (no cluster)"),
    "telemetry_pairs": (_telemetry_pairs, "prepare/unprepare p50, sampling on vs off, from two swapped prepare runs"),
    "reliability": (_reliability, "crash points, fuzzing, disk full, deleted while down, API faults (root)"),
    "placement": (_placement, "placement quality of four policies through the real kube-scheduler (root)"),
    "placement_plots": (_placement_plots, "re-plot a placement result as PNGs"),
    "scorer_latency": (_scorer_latency, "the placement scorer's prioritize latency alone (no cluster)"),
    "scorer_memory": (_scorer_memory, "the placement scorer's view with its Pods watch, 500 nodes x 20 pods"),
    "cel_engines": (_cel_engines, "the scorer's CEL evaluator against CEL libraries (no cluster; libraries by hand)"),
    "schedule_throughput": (_schedule_throughput, "kube-scheduler pods/s at 500 nodes x 8 GPUs (root)"),
    "simulate": (_simulate, "topodra simulate --once on 50 nodes / 400 GPUs, quiet and loaded"),
    "scale": (_scale, "every part from 64 to 2,048 nodes: simulate, etcd, scheduler, scorer, controller, inventory"),
    "inventory": (_inventory, "topodra inventory (table, -o json/yaml, --png) as an operator runs it"),
    "kueue_latency": (_kueue_latency, "job creation to GPUs allocated, with and without Kueue (root)"),
}


def usage() -> str:
    width = max(map(len, BENCHES))
    rows = "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in BENCHES.items())
    return f"usage: bench/run NAME [args]   (NAME --help for its options)\n\n{rows}\n"


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(usage())
        return 0 if argv else 2
    name = argv[0].replace("-", "_")
    if name not in BENCHES:
        sys.stderr.write(f"bench/run: no bench {argv[0]!r}\n\n{usage()}")
        return 2
    return BENCHES[name][0](list(argv[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
