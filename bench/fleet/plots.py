"""Plots of ``bench/fleet_sim.py``'s JSON summary: TTFT per mode and policy, hit rate vs fleet size.

python -m bench.fleet_sim --quick | tail -1 > /tmp/fleet.json
python -m bench.fleet.plots /tmp/fleet.json --out bench/plots
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvtier.bench.fleet.model import MODES
from kvtier.bench.fleet.router import POLICIES

COLORS = {"round_robin": "tab:gray", "least_loaded": "tab:blue", "cache_aware": "tab:orange"}
MARKERS = {"round_robin": "s", "least_loaded": "^", "cache_aware": "o"}


def _split(name: str) -> tuple[str, str]:
    mode, policy = name.split("/")
    return mode, policy


def _ordered(names: list[str], known: tuple[str, ...]) -> list[str]:
    """``names`` without repeats, known ones in their canonical order (JSON sorts keys)."""
    unique = list(dict.fromkeys(names))
    return sorted(unique, key=lambda n: known.index(n) if n in known else len(known))


def plot_ttft(summary: dict[str, Any], out: Path) -> Path:
    """``fleet-ttft.png``: TTFT p50 (solid) and p99 (light) per mode, one bar per policy."""
    results = summary["results"]
    modes = _ordered([_split(k)[0] for k in results], MODES)
    policies = _ordered([_split(k)[1] for k in results], POLICIES)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        xs, p50, p99 = [], [], []
        for j, mode in enumerate(modes):
            r = results.get(f"{mode}/{policy}")
            if r is None:
                continue
            xs.append(j + (i - (len(policies) - 1) / 2) * width)
            p50.append(r["ttft"]["p50_ms"])
            p99.append(r["ttft"]["p99_ms"])
        color = COLORS.get(policy)
        ax.bar(xs, p99, width * 0.9, color=color, alpha=0.3)
        bars = ax.bar(xs, p50, width * 0.9, color=color, label=policy)
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
    ax.set_yscale("log")
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel("TTFT, ms (log) — solid p50, light p99")
    cfg = summary["config"]
    ax.set_title(
        f"Fleet simulation: {cfg['fleet']['engines']} engines, profile {cfg['profile']}, "
        f"{summary['results'][next(iter(results))]['requests']} requests"
    )
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path = out / "fleet-ttft.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_hit_rate(summary: dict[str, Any], out: Path) -> Path:
    """``fleet-hit-rate.png``: hit rate vs engine count per policy, without and with the tier."""
    sweep = summary["sweep"]
    modes = _ordered([_split(k)[0] for k in sweep["results"]], MODES)
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4), sharey=True, squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        for policy in _ordered([_split(k)[1] for k in sweep["results"]], POLICIES):
            points = sweep["results"].get(f"{mode}/{policy}")
            if points is None:
                continue
            xs = [p["engines"] for p in points]
            color, marker = COLORS.get(policy), MARKERS.get(policy, "o")
            total = [p["hit_rate"]["total"] for p in points]
            ax.plot(xs, total, marker=marker, ls="-", color=color, label=policy, alpha=0.85)
            if any(p["hit_rate"]["tier"] > 0 for p in points):
                g1 = [p["hit_rate"]["g1"] for p in points]
                ax.plot(xs, g1, marker=marker, ls="--", color=color, alpha=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sweep["engines"], [str(n) for n in sweep["engines"]])
        ax.set_ylim(0, 1)
        ax.set_xlabel("engines (sessions scale with them)")
        title = "G1 only" if mode == "colocated" else "G1 + shared tier (dashed: G1 part)"
        ax.set_title(f"{mode}: {title}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("prompt-token hit rate")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Hit rate vs fleet size, profile {summary['config']['profile']}", fontsize=11)
    fig.tight_layout()
    path = out / "fleet-hit-rate.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("summary", help="a file whose last line is fleet_sim.py's JSON")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "plots"))
    args = ap.parse_args()
    summary = json.loads(Path(args.summary).read_text().strip().splitlines()[-1])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(plot_ttft(summary, out))
    if summary.get("sweep"):
        print(plot_hit_rate(summary, out))


if __name__ == "__main__":
    main()
