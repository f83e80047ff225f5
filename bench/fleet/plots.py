"""Plots of ``bench/fleet_sim.py``'s JSON summary: TTFT per mode and policy, hit rate vs fleet
size, the scaling comparison.

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


SCALER_COLORS = {"signals": "tab:orange", "utilization": "tab:blue"}


def plot_scaling(summary: dict[str, Any], out: Path) -> Path:
    """``fleet-scaling.png``: replicas and TTFT over the spike per autoscaler, and the frontier
    of replica-minutes against TTFT p99 in the spike over each autoscaler's target sweep."""
    sc = summary["scaling"]
    start, end, factor = sc["config"]["spike"]
    fig, (ax_n, ax_t, ax_f) = plt.subplots(1, 3, figsize=(15, 4.2))
    for kind, color in SCALER_COLORS.items():
        r = sc[kind]
        tl, knob = r["timeline"], next(k for k in r if k.endswith("utilization"))
        label = f"{kind} ({knob} {r[knob]:g})"
        n0 = sc["config"]["autoscaler"]["initial_replicas"]  # the fleet before the first sync
        ts = [0.0, *tl["t"]]
        ax_n.step(ts, [n0, *tl["provisioned"]], where="post", color=color, label=label)
        ax_n.step(ts, [n0, *tl["ready"]], where="post", color=color, ls=":", alpha=0.7)
        b = r["ttft_p99_by_arrival"]
        ax_t.plot(b["t"], b["p99_s"], color=color, marker=".", label=kind)
        pts = sc["sweep"][kind]
        xs = [p["replica_minutes"] for p in pts]
        ys = [p["ttft_p99_spike_s"] for p in pts]
        ax_f.plot(xs, ys, color=color, marker="o", label=kind)
        for p, x, y in zip(pts, xs, ys, strict=True):
            ax_f.annotate(f"{p[knob]:g}", (x, y), fontsize=7, xytext=(3, 3),
                          textcoords="offset points")  # fmt: skip
        ax_f.plot([r["replica_minutes"]], [r["ttft_p99_spike_s"]], color=color, marker="*",
                  markersize=14)  # fmt: skip
    for ax in (ax_n, ax_t):
        ax.axvspan(start, end, color="tab:red", alpha=0.08)
        ax.set_xlabel(f"time, s (shaded: arrivals x{factor:g})")
        ax.grid(alpha=0.3)
    ax_n.set_ylabel("replicas (solid: paid for, dotted: ready)")
    ax_n.legend(fontsize=8)
    ax_n.set_title("Replicas (first seed)", fontsize=10)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("TTFT p99 of arrivals per sync period, s (log)")
    ax_t.axhline(sc["config"]["autoscaler"]["ttft_target_s"], color="k", ls="--", lw=0.8)
    ax_t.set_title("TTFT (first seed; dashed: the router's target)", fontsize=10)
    ax_f.set_yscale("log")
    ax_f.set_xlabel("replica-minutes (mean over seeds)")
    ax_f.set_ylabel("TTFT p99 in the spike, s (log)")
    ax_f.set_title("Cost vs spike TTFT over each target (star: default)", fontsize=10)
    ax_f.grid(alpha=0.3)
    ax_f.legend(fontsize=8)
    fig.suptitle(
        f"Autoscaling on the router's signals vs on utilisation, profile {summary['config']['profile']}, "
        f"start-up {sc['config']['autoscaler']['startup_s']:g} s",
        fontsize=11,
    )
    fig.tight_layout()
    path = out / "fleet-scaling.png"
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
    if summary.get("scaling"):
        print(plot_scaling(summary, out))


if __name__ == "__main__":
    main()
