"""Plots from the benchmarks' JSON lines (the last line each script prints).

python bench/ttft.py --quick | tail -1 > /tmp/ttft.json
python bench/store.py --quick --tiers server | tail -1 > /tmp/server.json
python bench/plot.py --ttft /tmp/ttft.json --store /tmp/server.json --out bench/plots
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _load(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text().strip().splitlines()[-1])


def plot_ttft(summary: dict[str, Any], out: Path) -> Path:
    paths = [
        ("cold", "cold"),
        ("g1", "G1 hit (same engine)"),
        ("kvtier_cpu_raw", "kvtier CPU tier, raw"),
        ("kvtier_cpu_int8", "kvtier CPU tier, int8"),
        ("kvtier_disk_xproc_raw", "kvtier disk, new process, raw"),
        ("kvtier_disk_xproc_int8", "kvtier disk, new process, int8"),
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    for n, r in summary["sizes"].items():
        values = [r[f"{k}_s"] * 1e3 for k, _ in paths]
        bars = ax.barh([label for _, label in paths], values, label=f"{n} tokens")
        ax.bar_label(bars, fmt="%.0f ms", padding=3)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel(f"time to first token, ms (log scale; clock: {summary.get('clock', 'wall')})")
    ax.set_title(f"TTFT on {summary['model']}, 2 vCPU")
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = out / "ttft.png"
    fig.savefig(path, dpi=120)
    return path


def plot_store(summary: dict[str, Any], out: Path, name: str) -> Path:
    rows = [r for r in summary["results"] if r["op"] == "get"]
    tiers = sorted({r["tier"] for r in rows}, key=lambda t: [r["tier"] for r in rows].index(t))
    sizes = sorted({r["block_bytes"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(tiers)
    for i, tier in enumerate(tiers):
        vals = [
            next(r["gbps"] for r in rows if r["tier"] == tier and r["block_bytes"] == s)
            for s in sizes
        ]
        xs = [j + i * width for j in range(len(sizes))]
        bars = ax.bar(xs, vals, width, label=tier)
        ax.bar_label(bars, fmt="%.2f", padding=2, fontsize=8)
    ax.set_xticks([j + width * (len(tiers) - 1) / 2 for j in range(len(sizes))])
    ax.set_xticklabels([f"{s >> 10} KiB" if s < 1 << 20 else f"{s >> 20} MiB" for s in sizes])
    ax.set_ylabel("get, GB/s")
    ax.set_title("Block get throughput (same run, same blocks)")
    ax.legend()
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ttft")
    ap.add_argument("--store", action="append", default=[])
    ap.add_argument("--out", default="bench/plots")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.ttft:
        print(plot_ttft(_load(args.ttft), out))
    for i, path in enumerate(args.store):
        print(plot_store(_load(path), out, f"store-{i}" if len(args.store) > 1 else "store"))


if __name__ == "__main__":
    main()
