"""Plots from the benchmarks' JSON lines (the last line each script prints).

python -m bench.ttft --quick | tail -1 > /tmp/ttft.json
python -m bench.store --quick --tiers server | tail -1 > /tmp/server.json
python -m bench.lib.plot --ttft /tmp/ttft.json --store /tmp/server.json --out bench/plots
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
    """TTFT p50 at random prompt lengths per path (min-max as whiskers), one bar per phase."""
    paths = [
        ("cold", "cold"),
        ("g1", "G1 hit (same engine)"),
        ("kvtier_cpu_raw", "kvtier CPU tier, raw"),
        ("disk", "kvtier disk, new process"),
        ("disk_dropped", "kvtier disk, new process,\npage cache dropped"),
    ]
    phases = sorted(summary["phases"].values(), key=lambda p: p["contended"])  # quiet first
    fig, ax = plt.subplots(figsize=(8, 4.5))
    height = 0.8 / len(phases)
    for i, phase in enumerate(phases):
        stats = [phase["paths"][p]["random"] for p, _ in paths]
        p50 = [s["p50_s"] * 1e3 for s in stats]
        err = [
            [v - s["min_s"] * 1e3 for v, s in zip(p50, stats, strict=True)],
            [s["max_s"] * 1e3 - v for v, s in zip(p50, stats, strict=True)],
        ]
        ys = [j + i * height for j in range(len(paths))]
        label = "one core busy" if phase["contended"] else "quiet"
        bars = ax.barh(ys, p50, height, xerr=err, label=label, capsize=2)
        ax.bar_label(bars, fmt="%.0f ms", padding=3, fontsize=8)
    ax.set_yticks([j + height * (len(phases) - 1) / 2 for j in range(len(paths))])
    ax.set_yticklabels([label for _, label in paths])
    ax.set_xscale("log")
    ax.invert_yaxis()
    lengths = phases[0]["groups"]["random"]
    ax.set_xlabel("time to first token, ms (log scale; p50, whiskers min-max)")
    ax.set_title(
        f"TTFT on {summary['model']}, 2 vCPU, {len(lengths)} prompts of "
        f"{min(lengths)}-{max(lengths)} tokens",
        fontsize=10,
    )
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
