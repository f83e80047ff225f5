"""The router bench's workload in the fleet simulator: when does ``cache_aware`` beat round robin?

    python -m bench.router_sim                       # G1 1,800-8,000 tokens, two engine speeds
    python -m bench.router_sim --g1 2400,3600 --seeds 100 --speed 3

``bench/serve_router.py`` runs two real engines once (20 requests: its TTFT
p99 is nearly the slowest request, one run says little). This runs the same
shape of workload many times on two simulated engines (``bench/fleet``: the
engines' step loop and G1, routed by the shipped ``kvtier.router.policy``),
one seed per run, for every G1 size and engine speed given:

* 5 users share a 300-token system prompt, each has 900 tokens of context
  and asks 4 rounds (30 new tokens each, 16-token answers); every round
  re-sends the history. Round ``r`` of user ``u`` is the ``u + 5r``-th of
  Poisson arrivals at ``--qps``; the simulation starts a round a think time
  after the previous answer (the gap between the two scheduled arrivals), so
  a slow fleet also slows its users, as the bench's closed loop does.
* ``--speed``: the engines' step costs are the ``cpu-smollm2`` profile's
  (2 threads, bf16) times this factor: 2 is about one thread on an idle
  host, 6-10 the bench's engines on a busy 2-vCPU host.
* Policies: ``round_robin``; ``cache_aware`` as shipped; and
  ``cache_aware_no_memory`` — the same without the G1-memory terms
  (``memory_wait_tokens=0``: the policy before issue 21);
  ``cache_aware_wait160`` — waiting priced at a decode step's full compute
  (~170 prompt tokens on this profile) instead of the shipped 16.

Per (G1, speed, policy): the mean over seeds of the G1 hit rate and of the
TTFT p50 / p99 of each run, how often a run's p99 was no higher than round
robin's on the same seed, and two diagnostics of *why*: ``lost`` — prompt
tokens the router counted as a G1 hit that were evicted before the request
was admitted (a stale view: the engine had to make room for the requests
queued before it), ``max_share`` — the busier engine's share of the
requests (hot-spotting), and ``admit_wait_s`` — mean seconds from a request's
arrival to its admission (behind other prefills, or waiting for G1 blocks
while the requests admitted before it finish). A table, then one JSON line
last.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvtier.bench.fleet.costs import TERMS, EngineSpec, load_profile
from kvtier.bench.fleet.model import Fleet, FleetSpec
from kvtier.bench.fleet.workload import Session, Turn
from kvtier.bench.lib.common import emit, table
from kvtier.router.policy import Weights

POLICIES: dict[str, tuple[str, Weights]] = {
    "round_robin": ("round_robin", Weights()),
    "cache_aware": ("cache_aware", Weights()),
    "cache_aware_no_memory": ("cache_aware", Weights(memory_wait_tokens=0)),
    "cache_aware_wait160": ("cache_aware", Weights(memory_wait_tokens=160)),
}


@dataclass(frozen=True)
class Shape:
    """The bench's multi-round workload (``bench/serve_router.py``'s defaults)."""

    users: int = 5
    rounds: int = 4
    system_tokens: int = 300
    context_tokens: int = 900
    question_tokens: int = 30
    answer_tokens: int = 16
    qps: float = 1.0


def sessions(shape: Shape, seed: int) -> list[Session]:
    """One run's users as simulator sessions (the system prompt is their shared prefix)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / shape.qps, shape.users * shape.rounds))
    out = []
    for u in range(shape.users):
        times = arrivals[u :: shape.users]
        turns = []
        for r in range(shape.rounds):
            gap = float(times[r + 1] - times[r]) if r + 1 < shape.rounds else 0.0
            first = shape.context_tokens if r == 0 else 0
            turns.append(Turn(first + shape.question_tokens, shape.answer_tokens, gap))
        out.append(Session(u, float(times[0]), 0, shape.system_tokens, tuple(turns)))
    return out


def engine_spec(g1_tokens: int, speed: float) -> EngineSpec:
    spec = load_profile("cpu-smollm2", None).engine
    costs = replace(spec.costs, **{t: getattr(spec.costs, t) * speed for t in TERMS})
    return replace(spec, costs=costs, g1_capacity_tokens=g1_tokens)


def run_once(
    policy: str, g1_tokens: int, speed: float, seed: int, shape: Shape
) -> dict[str, float]:
    name, weights = POLICIES[policy]
    profile = load_profile("cpu-smollm2", None)
    fleet = FleetSpec(engines=2, mode="colocated", policy=name, weights=weights)
    res = Fleet(engine_spec(g1_tokens, speed), profile.tier, fleet, sessions(shape, seed)).run()
    reqs = res.requests
    prompt = sum(r.prompt_tokens for r in reqs)
    ttft = [r.first_token_s - r.arrival_s for r in reqs]
    counted = [r.prompt_tokens - r.est_tokens for r in reqs]  # the router's G1 + shared hit
    lost = sum(max(0, c - r.g1_tokens) for c, r in zip(counted, reqs, strict=True))
    waits = [r.admitted_s - r.arrival_s for r in reqs]
    return {
        "hit_rate": sum(r.g1_tokens for r in reqs) / prompt,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "lost": lost / prompt,
        "admit_wait_s": statistics.mean(waits),
        # the busier engine's share of the requests (0.5: even)
        "max_share": max(e.requests for e in res.engines) / len(reqs),
    }


def compare(g1_tokens: int, speed: float, seeds: int, shape: Shape) -> dict[str, dict[str, Any]]:
    runs = {p: [run_once(p, g1_tokens, speed, s, shape) for s in range(seeds)] for p in POLICIES}
    rr = runs["round_robin"]
    out = {}
    for p, rows in runs.items():
        out[p] = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
        out[p]["p99_le_round_robin"] = sum(
            1 for a, b in zip(rows, rr, strict=True) if a["ttft_p99_s"] <= b["ttft_p99_s"] + 1e-9
        ) / len(rows)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--g1", default="1800,2400,3000,3600,8000", help="G1 tokens per engine")
    ap.add_argument("--speed", default="3,10", help="step-cost factors (see the docstring)")
    ap.add_argument("--seeds", type=int, default=40)
    args = ap.parse_args(argv)
    args.g1_list = [int(x) for x in args.g1.split(",") if x.strip()]
    args.speed_list = [float(x) for x in args.speed.split(",") if x.strip()]
    if args.seeds < 1 or not args.g1_list or not args.speed_list:
        raise SystemExit("give --seeds >= 1, --g1 and --speed")
    if min(args.g1_list) < 1700:  # the last round's prompt and answer must fit one engine
        raise SystemExit("--g1 below 1,700 tokens cannot hold one request of this workload")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shape = Shape()
    t0 = time.perf_counter()
    results: list[dict[str, Any]] = []
    rows = []
    for g1 in args.g1_list:
        for speed in args.speed_list:
            res = compare(g1, speed, args.seeds, shape)
            rr = res["round_robin"]
            for p, r in res.items():
                rows.append([
                    g1, f"{speed:g}", p, f"{r['hit_rate']:.2f}", f"{r['hit_rate'] - rr['hit_rate']:+.2f}",
                    f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p99_s']:.2f}",
                    f"{r['ttft_p99_s'] / rr['ttft_p99_s']:.2f}", f"{r['p99_le_round_robin']:.0%}",
                    f"{r['lost']:.3f}", f"{r['max_share']:.2f}", f"{r['admit_wait_s']:.2f}",
                ])  # fmt: skip
            results.append({"g1_tokens": g1, "speed": speed, "policies": res})
    print((__doc__ or "").split("\n")[0])
    print(f"{args.seeds} seeds per cell; workload {shape}")
    headers = ["G1 tokens", "speed", "policy", "hit", "vs RR", "TTFT p50 s", "TTFT p99 s",
               "p99 / RR", "p99 <= RR", "lost", "share", "admit wait s"]  # fmt: skip
    print(table(headers, rows))
    emit(
        {
            "bench": "router_sim",
            "seeds": args.seeds,
            "workload": vars(shape),
            "results": results,
            "wall_s": time.perf_counter() - t0,
        }
    )


if __name__ == "__main__":
    main()
