"""What ``bench/serve.py`` prints: tables, ratios, the bars of the serving issue, plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.bench.lib.common import table

# (key in the JSON line, numerator system, denominator system, figure)
RATIOS = (
    ("kvtier_over_vllm_ttft_p50", "kvtier", "vllm", "ttft_p50_s"),
    ("kvtier_over_vllm_ttft_p99", "kvtier", "vllm", "ttft_p99_s"),
    ("kvtier_over_vllm_itl_p50", "kvtier", "vllm", "itl_p50_s"),
    (
        "cpu_tier_over_small_g1_ttft_p99",
        "kvtier_small_g1_cpu_tier",
        "kvtier_small_g1",
        "ttft_p99_s",
    ),
    (
        "cpu_tier_over_vllm_small_kv_ttft_p99",
        "kvtier_small_g1_cpu_tier",
        "vllm_small_kv",
        "ttft_p99_s",
    ),
    (
        "cpu_tier_over_lmcache_ttft_p99",
        "kvtier_small_g1_cpu_tier",
        "vllm_small_kv_lmcache",
        "ttft_p99_s",
    ),
    (
        "slow_tier_over_cpu_tier_itl_p99",
        "kvtier_small_g1_cpu_tier_slow",
        "kvtier_small_g1_cpu_tier",
        "itl_p99_s",
    ),
)


SUSTAINED_CDF = "serve-sustained-ttft-cdf.png"
# The bars of the serving issue (docs/engine.md, "Sustained load"): ratio key -> the most it may be.
# ``kvtier`` at most vLLM on TTFT p50, TTFT p99 and ITL p50; the CPU tier below the small G1
# alone and below vLLM at the same small budget on TTFT p99.
BARS = {
    "kvtier_over_vllm_ttft_p50": (1.0, True),
    "kvtier_over_vllm_ttft_p99": (1.0, True),
    "kvtier_over_vllm_itl_p50": (1.0, True),
    "cpu_tier_over_small_g1_ttft_p99": (1.0, False),
    "cpu_tier_over_vllm_small_kv_ttft_p99": (1.0, False),
}  # key -> (limit, may equal it)


def bars(systems: dict[str, dict[str, Any]], rat: dict[str, float]) -> dict[str, bool | None]:
    """Each bar met (True), missed (False) or not measurable in this run (None)."""
    out: dict[str, bool | None] = {}
    for key, (limit, inclusive) in BARS.items():
        v = rat.get(key)
        out[key] = None if v is None else (v <= limit if inclusive else v < limit)
    a = systems.get("kvtier", {}).get("pending_at_end")
    b = systems.get("vllm", {}).get("pending_at_end")
    out["kvtier_pending_at_end_le_vllm"] = None if a is None or b is None else a <= b
    return out


def bar_lines(systems: dict[str, dict[str, Any]], rat: dict[str, float]) -> list[str]:
    marks = {True: "met", False: "MISSED", None: "not measured"}
    return [f"bar {key}: {marks[ok]}" for key, ok in bars(systems, rat).items()]


def print_ratios(rat: dict[str, float]) -> None:
    for key, num, den, fig in RATIOS:
        if key in rat:
            print(f"{num} / {den} {fig.removesuffix('_s')}: {rat[key]:.2f}x")


def sustained_table(systems: dict[str, dict[str, Any]]) -> str:
    headers = [
        "system", "users/s", "req", "err", "pending", "busy", "TTFT p50 ms", "p90", "p99",
        "ITL p50 ms", "p99", "e2e p50 s", "prompt tok/s", "hit",
    ]  # fmt: skip
    rows = [
        [
            name,
            _num(s.get("user_rate")),
            s["requests"],
            s["errors"],
            s["pending_at_end"],
            _pct(s["busy_fraction"]),
            _ms(s["ttft_p50_s"]),
            _ms(s["ttft_p90_s"]),
            _ms(s["ttft_p99_s"]),
            _ms(s["itl_p50_s"]),
            _ms(s["itl_p99_s"]),
            _num(s["e2e_p50_s"]),
            _num(s["prompt_tokens_per_s"]),
            _pct(s["hit_rate"]),
        ]
        for name, s in systems.items()
    ]
    return table(headers, rows)


def _ms(v: float | None) -> float | str:
    return v * 1e3 if v is not None else "-"


def _num(v: float | None) -> float | str:
    return v if v is not None else "-"


def _pct(v: float | None) -> str:
    return f"{v:.1%}" if v is not None else "-"


def report_table(sweeps: dict[str, list[dict[str, Any]]]) -> str:
    headers = [
        "system", "qps", "req", "err", "TTFT p50 ms", "p90", "p99", "ITL p50 ms", "p90", "p99",
        "e2e p50 s", "req/s", "prompt tok/s", "out tok/s", "hit", "hit (usage)",
    ]  # fmt: skip
    rows = []
    for name, points in sweeps.items():
        for s in points:
            rows.append(
                [
                    name, s["qps"], s["requests"], s["errors"],
                    _ms(s["ttft_p50_s"]), _ms(s["ttft_p90_s"]), _ms(s["ttft_p99_s"]),
                    _ms(s["itl_p50_s"]), _ms(s["itl_p90_s"]), _ms(s["itl_p99_s"]),
                    _num(s["e2e_p50_s"]), _num(s["requests_per_s"]),
                    _num(s["prompt_tokens_per_s"]), _num(s["output_tokens_per_s"]),
                    _pct(s["hit_rate"]), _pct(s["hit_rate_usage"]),
                ]
            )  # fmt: skip
    return table(headers, rows)


def ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    out = {}
    for key, num, den, fig in RATIOS:
        a = systems.get(num, {}).get(fig)
        b = systems.get(den, {}).get(fig)
        if a is not None and b:
            out[key] = a / b
    return out


def plot_cdf(points: dict[str, dict[str, Any]], title: str, path: Path) -> str:
    """The TTFT CDF of each system's run (``ttft_samples_s``) into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, s in points.items():
        xs = s["ttft_samples_s"]
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def plot(sweeps: dict[str, list[dict[str, Any]]], main_qps: float, out_dir: Path) -> list[str]:
    """The TTFT CDF per system (at ``main_qps``) and, with several rates, TTFT against QPS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    at_main = {
        name: min(points, key=lambda p: abs(p["qps"] - main_qps)) for name, points in sweeps.items()
    }
    written = [plot_cdf(at_main, f"TTFT CDF at {main_qps:g} req/s", out_dir / "serve-ttft-cdf.png")]
    if any(len(points) > 1 for points in sweeps.values()):
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, points in sweeps.items():
            qps = [p["qps"] for p in points]
            line = ax.plot(qps, [p["ttft_p50_s"] for p in points], marker="o", label=f"{name} p50")
            color = line[0].get_color()
            ax.plot(
                qps,
                [p["ttft_p99_s"] for p in points],
                marker="x",
                ls="--",
                color=color,
                label=f"{name} p99",
            )
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel("TTFT (s)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / "serve-ttft-vs-qps.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    return written
