"""Fleet simulation: routing policies and P/D disaggregation over a shared KV tier, at scale.

    python -m bench.fleet_sim --quick        # 64 engines, ~2,900 requests (~25 s on a 2-core CPU)
    python -m bench.fleet_sim                # 256 engines, ~11,600 requests (minutes)
    python -m bench.fleet_sim --profile gpu-8b --quick --sessions 3000   # ASSUMED GPU constants
    python -m bench.fleet_sim --calibration calib.json    # engine constants from fleet_calibrate.py

A discrete-event simulation (``fleet_model.py``) of N engines behind a router,
each a continuous-batching step loop over its own KV memory (G1), optionally
sharing a KV tier of given bandwidth, latency and capacity. Per-engine costs
come from this project's measurements (``fleet_costs.py``; docs/fleet.md has
every constant and its source). The workload is multi-turn sessions over
Zipf-popular prefixes (``fleet_workload.py``), the same for every
configuration. Every mode (``colocated``, ``colocated+tier``, ``pd+tier``,
``pd-direct``) runs with every policy (``round_robin``, ``least_loaded``,
``cache_aware``); a sweep over engine counts (sessions scaled alike) gives the
hit-rate plot. Then the scaling comparison (``fleet/scaling.py``): a traffic
spike (``--scale-spike``) met by an autoscaler on the router's scaling
signals (``kvtier.router.scaling``, the function the router serves) and by
one on engine utilisation, each at its default and over a sweep of its
target. Plots go to ``bench/plots/fleet-ttft.png``, ``fleet-hit-rate.png``
and ``fleet-scaling.png``. Tables, then one JSON line last.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvtier.bench.fleet.costs import PROFILES, Profile, load_profile
from kvtier.bench.fleet.metrics import summarize
from kvtier.bench.fleet.model import MODES, FleetSpec, run_fleet
from kvtier.bench.fleet.router import POLICIES
from kvtier.bench.fleet.scaling import (
    SWEEPS,
    AutoscalerSpec,
    ScalingScenario,
    compare_autoscalers,
)
from kvtier.bench.fleet.workload import WorkloadSpec, build_sessions
from kvtier.bench.lib.common import emit, table
from kvtier.router.policy import Weights

SWEEP_MODES = ("colocated", "colocated+tier")


def _csv(text: str, known: tuple[str, ...]) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in known]
    if bad:
        raise SystemExit(f"unknown {bad}; known: {', '.join(known)}")
    return items


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 engines, 1,000 sessions")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="cpu-smollm2")
    ap.add_argument("--calibration", type=Path, help="bench/fleet_calibrate.py output")
    ap.add_argument("--engines", type=int, help="default 64 (--quick) / 256")
    ap.add_argument("--sessions", type=int, help="default 1,000 (--quick) / 4,000")
    ap.add_argument("--rate", type=float, help="new sessions per second per engine")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--sweep", help="engine counts for the hit-rate plot, or 'none'")
    ap.add_argument("--prefixes", type=int, default=200)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--prefill-fraction", type=float, default=0.25)
    w = Weights()
    ap.add_argument("--decode-cost-tokens", type=int, default=w.decode_cost_tokens,
                    help="the router's cache_aware weight (RouterConfig)")  # fmt: skip
    ap.add_argument("--shared-hit-weight", type=float, default=w.shared_hit_weight)
    ap.add_argument("--max-imbalance", type=int, default=w.max_imbalance)
    ap.add_argument("--save-decode", action="store_true")
    ap.add_argument("--tier-gbps", type=float, help="aggregate tier bandwidth (inf allowed)")
    ap.add_argument("--link-gbps", type=float, help="per-engine link bandwidth")
    ap.add_argument("--tier-latency-ms", type=float)
    ap.add_argument("--tier-gb", type=float, help="tier capacity")
    ap.add_argument("--seed", type=int, default=0)
    sc = ap.add_argument_group("scaling comparison")
    sc.add_argument("--no-scaling", action="store_true", help="skip the scaling comparison")
    sc.add_argument("--scale-engines", type=int, default=4,
                    help="the steady rate is what this many engines get by default")  # fmt: skip
    sc.add_argument("--scale-duration", type=float, default=600.0, help="seconds of arrivals")
    sc.add_argument("--scale-spike", default="180,360,3", help="START_S,END_S,FACTOR")
    sc.add_argument("--scale-startup-s", type=float, default=60.0, help="replica start-up delay")
    sc.add_argument("--scale-ttft-target", type=float, default=2.5, help="the router's target")
    sc.add_argument("--scale-seeds", help="default 0,1 (--quick) / 0,1,2,3,4")
    ap.add_argument("--plots", default=str(Path(__file__).resolve().parent / "plots"))
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    args.engines = args.engines or (64 if args.quick else 256)
    args.sessions = args.sessions or (1000 if args.quick else 4000)
    if args.sweep is None:
        args.sweep = "8,16,32,64" if args.quick else "32,64,128,256"
    args.sweep_engines = [] if args.sweep == "none" else [int(s) for s in args.sweep.split(",")]
    args.mode_list = _csv(args.modes, MODES)
    args.policy_list = _csv(args.policies, POLICIES)
    try:
        start, end, factor = (float(x) for x in args.scale_spike.split(","))
        args.spike = (start, end, factor)
        seeds = args.scale_seeds or ("0,1" if args.quick else "0,1,2,3,4")
        args.scale_seed_list = tuple(int(x) for x in seeds.split(","))
    except ValueError:
        raise SystemExit(
            "--scale-spike is START_S,END_S,FACTOR; --scale-seeds is N,N,..."
        ) from None
    return args


def scaling_scenario(args: argparse.Namespace, profile: Profile) -> ScalingScenario:
    """The spike of the scaling comparison (colocated with the tier, cache-aware routing)."""
    rate = args.rate if args.rate is not None else profile.session_rate_per_engine
    wl = WorkloadSpec(
        sessions=1,
        session_rate=rate * args.scale_engines,
        prefixes=args.prefixes,
        zipf_s=args.zipf,
        answer_tokens=profile.answer_tokens,
    )
    return ScalingScenario(wl, args.scale_duration, args.spike, args.scale_seed_list)


def scaling_table(scaling: dict[str, Any]) -> str:
    """Each autoscaler over its target sweep (the default starred)."""
    rows = []
    for kind, (knob, _) in SWEEPS.items():
        default = scaling[kind][knob]
        for p in scaling["sweep"][kind]:
            star = " *" if p[knob] == default else ""
            cap = p["capacity_range"]
            caps = f"{cap[0]:.0f}-{cap[1]:.0f}" if cap else "-"
            rows.append([f"{kind} {knob}={p[knob]:g}{star}", p["ttft_p99_spike_s"],
                         p["replica_minutes"], p["max_replicas"], caps])  # fmt: skip
    headers = ["autoscaler (* default)", "TTFT p99 in spike s", "replica-min", "max",
               "capacity tok/s"]  # fmt: skip
    return table(headers, rows)


def build_profile(args: argparse.Namespace) -> Profile:
    """The profile with the command line's tier overrides applied."""
    profile = load_profile(args.profile, args.calibration)
    tier = profile.tier
    overrides = {
        "aggregate_gbps": args.tier_gbps,
        "link_gbps": args.link_gbps,
        "latency_s": None if args.tier_latency_ms is None else args.tier_latency_ms / 1e3,
        "capacity_gb": args.tier_gb,
    }
    given = {k: v for k, v in overrides.items() if v is not None}
    if given:
        tier = replace(tier, **given)
        profile = replace(profile, tier=tier)
    return profile


def workload(args: argparse.Namespace, profile: Profile, engines: int) -> WorkloadSpec:
    """Sessions for ``engines`` engines: count and arrival rate scale with the fleet."""
    rate = args.rate if args.rate is not None else profile.session_rate_per_engine
    return WorkloadSpec(
        sessions=max(1, round(args.sessions * engines / args.engines)),
        session_rate=rate * engines,
        prefixes=args.prefixes,
        zipf_s=args.zipf,
        answer_tokens=profile.answer_tokens,
        seed=args.seed,
    )


def fleet_spec(args: argparse.Namespace, engines: int, mode: str, policy: str) -> FleetSpec:
    return FleetSpec(
        engines=engines,
        mode=mode,
        policy=policy,
        prefill_fraction=args.prefill_fraction,
        weights=Weights(args.decode_cost_tokens, args.shared_hit_weight, args.max_imbalance),
        save_decode=args.save_decode,
    )


def run_grid(
    args: argparse.Namespace, profile: Profile, engines: int, modes: list[str]
) -> dict[str, dict[str, Any]]:
    """Every (mode, policy) on one workload for ``engines`` engines."""
    sessions = build_sessions(workload(args, profile, engines))
    out = {}
    for mode in modes:
        for policy in args.policy_list:
            res = run_fleet(
                profile.engine, profile.tier, fleet_spec(args, engines, mode, policy), sessions
            )
            out[f"{mode}/{policy}"] = summarize(res)
    return out


def _row(name: str, r: dict[str, Any]) -> list[Any]:
    t = r["tier"]
    return [
        name,
        r["requests_per_s"],
        r["hit_rate"]["g1"],
        r["hit_rate"]["tier"],
        r["hit_rate"]["total"],
        r["ttft"]["p50_ms"],
        r["ttft"]["p99_ms"],
        r["itl"]["p50_ms"],
        r["itl"]["p99_ms"],
        f"{t['read']['mean_gbps']:.2f} / {t['read']['p99_gbps']:.2f}",
        f"{t['write']['mean_gbps']:.2f} / {t['write']['p99_gbps']:.2f}",
        f"{t['peer']['mean_gbps']:.2f} / {t['peer']['p99_gbps']:.2f}",
        f"{r['handoff']['p50_ms']:.0f} / {r['handoff']['p99_ms']:.0f}" if "handoff" in r else "-",
        r["utilisation"]["mean"],
        r["max_engine_share"],
    ]


HEADERS = [
    "mode/policy",
    "req/s",
    "hit G1",
    "hit tier",
    "hit total",
    "TTFT p50 ms",
    "TTFT p99",
    "ITL p50 ms",
    "ITL p99",
    "tier read GB/s mean/p99",
    "tier write",
    "peer (P/D direct)",
    "handoff ms p50/p99",
    "util",
    "max share",
]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    profile = build_profile(args)
    t0 = time.perf_counter()
    results = run_grid(args, profile, args.engines, args.mode_list)
    sweep: dict[str, list[dict[str, Any]]] = {}
    sweep_modes = [m for m in SWEEP_MODES if m in args.mode_list]
    for n in args.sweep_engines:
        grid = (
            {k: v for k, v in results.items() if k.split("/")[0] in sweep_modes}
            if n == args.engines
            else run_grid(args, profile, n, sweep_modes)
        )
        for name, r in grid.items():
            sweep.setdefault(name, []).append(
                {"engines": n, "hit_rate": r["hit_rate"], "ttft": r["ttft"]}
            )
    scaling = None
    if not args.no_scaling:
        base = AutoscalerSpec(
            "signals",
            initial_replicas=max(2, args.scale_engines),
            min_replicas=2,
            max_replicas=max(8, 8 * args.scale_engines),
            startup_s=args.scale_startup_s,
            ttft_target_s=args.scale_ttft_target,
        )
        scaling = compare_autoscalers(
            profile.engine, profile.tier, scaling_scenario(args, profile), base
        )
    wall = time.perf_counter() - t0

    wl = workload(args, profile, args.engines)
    e, tier = profile.engine, profile.tier
    print((__doc__ or "").split("\n")[0])
    print(
        f"profile {profile.name}: step = {e.costs.base_s * 1e3:.1f} ms + "
        f"{e.costs.prefill_s_per_token * 1e6:.1f} us/prompt token + "
        f"{e.costs.attn_s_per_pair * 1e9:.3g} ns/attention pair + "
        f"{e.costs.decode_s_per_seq * 1e3:.2f} ms/decode seq + "
        f"{e.costs.decode_s_per_ctx * 1e9:.3g} ns/context token; KV {e.kv_bytes_per_token} B/token, "
        f"G1 {e.g1_capacity_tokens} tokens"
    )
    print(
        f"tier: {tier.aggregate_gbps:g} GB/s aggregate, {tier.link_gbps:g} GB/s per engine, "
        f"{tier.latency_s * 1e3:g} ms per transfer, {tier.capacity_gb:g} GB"
    )
    first = next(iter(results.values()))
    print(
        f"{args.engines} engines; {wl.sessions} sessions at {wl.session_rate:.3g}/s, "
        f"{first['requests']} requests; {wl.prefixes} prefixes, Zipf {wl.zipf_s:g}; "
        f"P/D prefill pool {fleet_spec(args, args.engines, 'pd+tier', 'round_robin').prefill_engines} "
        f"engines; simulated in {wall:.1f} s"
    )
    print(table(HEADERS, [_row(k, v) for k, v in results.items()]))
    if sweep:
        print("\nhit rate (total, G1) vs engines:")
        rows = [
            [name] + [f"{p['hit_rate']['total']:.2f} ({p['hit_rate']['g1']:.2f})" for p in pts]
            for name, pts in sweep.items()
        ]
        print(table(["mode/policy"] + [str(n) for n in args.sweep_engines], rows))

    summary: dict[str, Any] = {
        "bench": "fleet_sim",
        "quick": args.quick,
        "wall_s": wall,
        "config": {
            "profile": profile.name,
            "engine": asdict(e),
            "tier": asdict(tier),
            "sources": dict(profile.sources),
            "workload": asdict(wl),
            "fleet": {
                k: v
                for k, v in asdict(
                    fleet_spec(args, args.engines, "colocated", "cache_aware")
                ).items()
                if k not in ("mode", "policy")
            },
        },
        "results": results,
        "sweep": {"engines": args.sweep_engines, "results": sweep} if sweep else None,
        "scaling": scaling,
    }
    if scaling is not None:
        c = scaling["config"]
        print(
            f"\nscaling: {c['sessions']} sessions per seed over {c['duration_s']:g} s, arrivals "
            f"x{c['spike'][2]:g} from {c['spike'][0]:g} to {c['spike'][1]:g} s; start-up "
            f"{c['autoscaler']['startup_s']:g} s, sync {c['autoscaler']['sync_s']:g} s, "
            f"seeds {list(c['seeds'])}; TTFT target {c['autoscaler']['ttft_target_s']:g} s"
        )
        print(scaling_table(scaling))
        rs = scaling["replica_start"]
        print(
            "new replicas' first minute (signals): hit rate "
            f"{rs['tier']['new_replicas']['hit_rate']:.2f} with the shared tier, "
            f"{rs['no_tier']['new_replicas']['hit_rate']:.2f} without; TTFT p99 "
            f"{rs['tier']['new_replicas']['ttft_p99_s']:.2f} s vs "
            f"{rs['no_tier']['new_replicas']['ttft_p99_s']:.2f} s"
        )
    if not args.no_plots:
        from kvtier.bench.fleet.plots import plot_hit_rate, plot_scaling, plot_ttft

        out = Path(args.plots)
        out.mkdir(parents=True, exist_ok=True)
        paths = [plot_ttft(summary, out)]
        if sweep:
            paths.append(plot_hit_rate(summary, out))
        if scaling is not None:
            paths.append(plot_scaling(summary, out))
        summary["plots"] = [str(p) for p in paths]
        print("\nplots: " + ", ".join(str(p) for p in paths))
    emit(summary)


if __name__ == "__main__":
    main()
