"""PNG plots of a ``bench/placement`` result document (matplotlib; ``pip install -e '.[bench]'``).

``plot_all(doc, out_dir)`` writes:

* ``utilisation-stranded.png``: GPU utilisation and stranded GPUs over virtual time, one line per
  policy (first seed);
* ``wait-cdf.png``: CDF of job wait time per policy, all jobs and 8/16-GPU jobs (all seeds pooled);
* ``free-heatmap.png``: free GPUs per node at each policy's peak utilisation (first seed);
* ``stranded-host.png`` (runs with ``--shapes trace`` only): GPUs stranded by CPU and by memory over virtual
  time, one colour per policy (first seed).

Re-plot a stored result: ``bench/run placement_plots bench/results/placement/<file>.json [OUT_DIR]``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from bench.paths import REPO

COLORS = {"a": "tab:gray", "b": "tab:orange", "c": "tab:blue", "d": "tab:green", "dr": "tab:red", "dh": "tab:purple"}


def _first_seed_runs(doc: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    out: dict[str, Mapping[str, Any]] = {}
    for r in doc["runs"]:
        if r["policy"] not in out or r["seed"] < out[r["policy"]]["seed"]:
            out[r["policy"]] = r
    return out


def _label(doc: Mapping[str, Any], p: str) -> str:
    return f"({p}) {doc['policies'].get(p, '')}"[:60]


def plot_timeseries(doc: Mapping[str, Any], path: Path) -> Path:
    runs = _first_seed_runs(doc)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for p, r in sorted(runs.items()):
        t = [s["t"] / 3600 for s in r["series"]]
        total = r["gpus"]
        ax1.step(t, [s["used"] / total for s in r["series"]], where="post", color=COLORS.get(p), label=_label(doc, p))
        ax2.step(t, [s["stranded"] for s in r["series"]], where="post", color=COLORS.get(p))
        t1 = r["metrics"]["window_s"][1] / 3600
        ax1.axvline(t1, color="k", lw=0.5, ls=":")
        ax2.axvline(t1, color="k", lw=0.5, ls=":")
    ax1.set_ylabel("GPU utilisation")
    ax1.set_ylim(0, 1.02)
    ax2.set_ylabel("stranded GPUs")
    ax2.set_xlabel("virtual time (h); dotted: last arrival")
    ax1.legend(fontsize=7, loc="lower right")
    ax1.set_title(f"{doc['runs'][0]['workload']}, seed {min(r['seed'] for r in runs.values())}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_wait_cdf(doc: Mapping[str, Any], path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, sizes, title in ((axes[0], None, "all jobs"), (axes[1], {"8", "16"}, "8- and 16-GPU jobs")):
        for p in sorted({r["policy"] for r in doc["runs"]}):
            waits = sorted(w / 3600 for r in doc["runs"] if r["policy"] == p
                           for size, ws in r["waits"].items() if sizes is None or size in sizes for w in ws)
            if waits:
                ax.step(waits, [(i + 1) / len(waits) for i in range(len(waits))], where="post",
                        color=COLORS.get(p), label=f"({p})")
        ax.set_title(title)
        ax.set_xlabel("wait (virtual hours)")
        ax.set_ylabel("fraction of jobs")
        ax.set_xscale("symlog", linthresh=0.1)
        ax.legend(fontsize=8)
    fig.suptitle("wait-time CDF (all seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_heatmap(doc: Mapping[str, Any], path: Path) -> Path:
    runs = _first_seed_runs(doc)
    policies = sorted(runs)
    nodes = sorted({n for r in runs.values() for n in r["peak_free_per_node"]})
    grid = [[runs[p]["peak_free_per_node"].get(n, 0) for n in nodes] for p in policies]
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * len(policies)))
    im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=8)
    ax.set_yticks(range(len(policies)), [f"({p})" for p in policies])
    ax.set_xticks(range(len(nodes)), nodes, rotation=90, fontsize=6)
    fig.colorbar(im, ax=ax, label="free GPUs")
    ax.set_title("free GPUs per node at peak utilisation (first seed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_host_stranding(doc: Mapping[str, Any], path: Path) -> Path:
    runs = _first_seed_runs(doc)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)
    for p, r in sorted(runs.items()):
        t = [s["t"] / 3600 for s in r["series"]]
        ax1.step(t, [s.get("stranded_cpu", 0) for s in r["series"]], where="post", color=COLORS.get(p),
                 label=_label(doc, p))
        ax2.step(t, [s.get("stranded_memory", 0) for s in r["series"]], where="post", color=COLORS.get(p))
    ax1.set_ylabel("GPUs stranded by CPU")
    ax2.set_ylabel("GPUs stranded by memory")
    ax2.set_xlabel("virtual time (h)")
    ax1.legend(fontsize=7, loc="upper left")
    ax1.set_title(f"{doc['runs'][0]['workload']}, seed {min(r['seed'] for r in runs.values())}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(doc: Mapping[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    out = [plot_timeseries(doc, out_dir / "utilisation-stranded.png"),
           plot_wait_cdf(doc, out_dir / "wait-cdf.png"),
           plot_heatmap(doc, out_dir / "free-heatmap.png")]
    if (doc.get("args") or {}).get("shapes") == "trace":
        out.append(plot_host_stranding(doc, out_dir / "stranded-host.png"))
    return out


def main(argv: list[str]) -> int:
    """``bench/run placement_plots RESULT.json [OUT_DIR]`` (default OUT_DIR: docs/placement)."""
    if len(argv) not in (1, 2) or argv[0] in ("-h", "--help"):
        print("usage: bench/run placement_plots RESULT.json [OUT_DIR]", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    result = json.loads(Path(argv[0]).read_text())
    target = Path(argv[1]) if len(argv) == 2 else REPO / "docs" / "placement"
    for f in plot_all(result, target):
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
