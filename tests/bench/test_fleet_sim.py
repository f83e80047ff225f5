"""The fleet simulation (bench/fleet_*.py): sanity properties of its model and its event loop."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvtier.bench.fleet.costs import (
    CPU_SMOLLM2_FIGURES,
    EngineSpec,
    StepCosts,
    StepFigure,
    TierSpec,
    chunk_pairs,
    cpu_smollm2,
    fit_step_costs,
    gpu_8b,
)
from kvtier.bench.fleet.g1 import G1Cache
from kvtier.bench.fleet.metrics import summarize, weighted_percentile, windowed_gbps
from kvtier.bench.fleet.model import MODES, Fleet, FleetSpec, SimResult, SimulationError, run_fleet
from kvtier.bench.fleet.request import Phase
from kvtier.bench.fleet.router import POLICIES, KvIndex
from kvtier.bench.fleet.scaling import AUTOSCALERS, AutoscalerSpec, ScalingFleet, run_scaling
from kvtier.bench.fleet.tier import Network
from kvtier.bench.fleet.workload import Session, Turn, WorkloadSpec, build_sessions
from kvtier.router.policy import Weights

PROFILE = cpu_smollm2()
ENGINE = PROFILE.engine
TIER = PROFILE.tier


def zipf_sessions(n: int = 60, rate: float = 1.0, seed: int = 0, **kw: object) -> list[Session]:
    spec = WorkloadSpec(
        sessions=n,
        session_rate=rate,
        prefixes=kw.pop("prefixes", 30),  # type: ignore[arg-type]
        answer_tokens=(8, 32),
        think_s=2.0,
        seed=seed,
        **kw,  # type: ignore[arg-type]
    )
    return build_sessions(spec)


def run(
    sessions: list[Session],
    engines: int,
    mode: str,
    policy: str,
    tier: TierSpec = TIER,
    engine: EngineSpec = ENGINE,
    **kw: object,
) -> SimResult:
    return run_fleet(engine, tier, FleetSpec(engines, mode, policy, **kw), sessions)  # type: ignore[arg-type]


# ---- sanity properties of the model ---------------------------------------------------------


@pytest.mark.parametrize("mode", ["colocated", "colocated+tier"])
def test_one_engine_gives_identical_results_under_every_policy(mode: str) -> None:
    sessions = zipf_sessions(25, rate=0.5)
    summaries = [summarize(run(sessions, 1, mode, p)) for p in POLICIES]
    assert summaries[0]["requests"] > 25
    assert summaries[0] == summaries[1] == summaries[2]


@pytest.mark.parametrize("mode", ["colocated", "colocated+tier", "pd+tier"])
def test_without_prefix_reuse_cache_aware_hits_no_more_than_round_robin(mode: str) -> None:
    sessions = zipf_sessions(40, rate=2.0, unique_prefixes=True, turns_mean=1, turns_max=1)
    rr = summarize(run(sessions, 4, mode, "round_robin"))["hit_rate"]
    ca = summarize(run(sessions, 4, mode, "cache_aware"))["hit_rate"]
    assert ca == rr == {"g1": 0.0, "tier": 0.0, "total": 0.0}


@pytest.mark.parametrize("mode", ["colocated", "colocated+tier", "pd+tier", "pd-direct"])
def test_cache_aware_g1_hit_rate_beats_round_robin_on_zipf(mode: str) -> None:
    sessions = zipf_sessions(80, rate=1.5, seed=3)
    rr = summarize(run(sessions, 8, mode, "round_robin"))
    ca = summarize(run(sessions, 8, mode, "cache_aware"))
    # NOTE: in P/D only 2 of the 8 engines prefill, so round robin already hits often there.
    margin = 0.02 if mode.startswith("pd") else 0.2
    assert ca["hit_rate"]["g1"] >= rr["hit_rate"]["g1"] + margin
    assert ca["hit_rate"]["total"] >= rr["hit_rate"]["total"]


def two_sessions_on_one_prefix(prefix: int = 1024) -> list[Session]:
    """Session 1 arrives long after session 0 finished; both start with the same prefix."""
    return [
        Session(0, 0.0, 7, prefix, (Turn(300, 4, 0.0),)),
        Session(1, 60.0, 7, prefix, (Turn(200, 4, 0.0),)),
    ]


def ttft(result: SimResult, rid: int) -> float:
    r = result.requests[rid]
    return r.first_token_s - r.arrival_s


def test_an_infinite_zero_latency_tier_hit_costs_what_a_g1_hit_costs() -> None:
    sessions = two_sessions_on_one_prefix()
    g1 = run(sessions, 1, "colocated", "round_robin")
    free = TierSpec(math.inf, math.inf, 0.0, 1000.0)
    tier = run(sessions, 2, "colocated+tier", "round_robin", tier=free)
    assert (g1.requests[1].g1_tokens, g1.requests[1].tier_tokens) == (1024, 0)
    assert (tier.requests[1].g1_tokens, tier.requests[1].tier_tokens) == (0, 1024)
    assert tier.requests[1].prefill_engine != tier.requests[0].prefill_engine
    assert ttft(tier, 1) <= ttft(g1, 1)
    assert ttft(tier, 1) == pytest.approx(ttft(g1, 1))


def test_a_tier_hit_costs_latency_plus_bytes_over_bandwidth_more() -> None:
    sessions = two_sessions_on_one_prefix()
    g1 = run(sessions, 1, "colocated", "round_robin")
    slow = TierSpec(2.0, 1.0, 0.004, 1000.0)  # the link (1 GB/s) is the bottleneck
    tier = run(sessions, 2, "colocated+tier", "round_robin", tier=slow)
    nbytes = 1024 * ENGINE.kv_bytes_per_token
    assert ttft(tier, 1) - ttft(g1, 1) == pytest.approx(0.004 + nbytes / 1e9)


@pytest.mark.parametrize("mode", MODES)
def test_ttft_is_never_below_the_compute_of_the_uncached_tokens(mode: str) -> None:
    sessions = zipf_sessions(50, rate=3.0, seed=5)
    costs, budget = ENGINE.costs, ENGINE.max_batched_tokens
    for policy in POLICIES:
        for r in run(sessions, 6, mode, policy).requests:
            cached = r.g1_tokens + r.tier_tokens
            floor = costs.prefill_floor_s(cached, r.prompt_tokens - cached, budget)
            assert r.first_token_s - r.arrival_s >= floor - 1e-9, (policy, r.rid)


def hot_prefix_burst(n: int = 200) -> list[Session]:
    """One prefix; session 0 warms one engine, then a burst of n-1 sessions on that prefix."""
    spec = WorkloadSpec(
        sessions=n,
        session_rate=20.0,
        prefixes=1,
        turns_mean=1,
        turns_max=1,
        answer_tokens=(16, 64),
        seed=1,
    )
    return [
        dataclasses.replace(s, arrival_s=0.0 if s.session_id == 0 else 10.0 + s.arrival_s)
        for s in build_sessions(spec)
    ]


@pytest.mark.parametrize("mode", ["colocated", "colocated+tier"])
def test_a_hot_prefix_does_not_melt_one_engine_under_cache_aware(mode: str) -> None:
    """The simulation runs the shipped router (``kvtier.router.policy``): its load terms
    spread a burst on one cached prefix, and so does its queued-prefill term alone."""
    sessions = hot_prefix_burst()
    weighed = summarize(run(sessions, 8, mode, "cache_aware"))
    queued_only = summarize(
        run(sessions, 8, mode, "cache_aware", weights=Weights(0, 0.8, max_imbalance=10**9))
    )
    turns = summarize(run(sessions, 8, mode, "round_robin"))
    assert weighed["max_engine_share"] <= 0.25
    assert queued_only["max_engine_share"] <= 0.25
    assert weighed["ttft"]["p50_ms"] < 1.5 * turns["ttft"]["p50_ms"]


def test_pd_hands_every_request_from_the_prefill_pool_to_the_decode_pool() -> None:
    sessions = zipf_sessions(40, rate=2.0, seed=2)
    spec = FleetSpec(8, "pd+tier", "cache_aware", prefill_fraction=0.25)
    res = Fleet(ENGINE, TIER, spec, sessions).run()
    for r in res.requests:
        assert r.prefill_engine < 2 <= r.decode_engine
        assert r.handoff_tokens == r.prompt_tokens - r.decode_g1_tokens
        assert r.finish_s >= r.first_token_s + r.handoff_gap_s - 1e-9
    assert sum(e.requests for e in res.engines[:2]) == len(res.requests)
    reads = sum(t.nbytes for t in res.transfers if t.kind == "read")
    handoff = sum(r.handoff_tokens for r in res.requests) * ENGINE.kv_bytes_per_token
    loads = sum(r.tier_tokens for r in res.requests) * ENGINE.kv_bytes_per_token
    assert reads == handoff + loads


# ---- determinism and event-loop invariants ---------------------------------------------------


def test_output_is_deterministic_for_a_seed() -> None:
    a = summarize(run(zipf_sessions(40, rate=2.0, seed=9), 6, "pd+tier", "cache_aware"))
    b = summarize(run(zipf_sessions(40, rate=2.0, seed=9), 6, "pd+tier", "cache_aware"))
    c = summarize(run(zipf_sessions(40, rate=2.0, seed=10), 6, "pd+tier", "cache_aware"))
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert a != c


@pytest.mark.parametrize("mode", MODES)
def test_time_never_goes_backwards_and_every_request_finishes_once(mode: str) -> None:
    sessions = zipf_sessions(40, rate=4.0, seed=4)
    for policy in POLICIES:
        res = Fleet(ENGINE, TIER, FleetSpec(6, mode, policy), sessions, trace=True).run()
        assert res.trace is not None and len(res.trace) == res.events
        assert all(a <= b for a, b in zip(res.trace, res.trace[1:], strict=False))
        assert len(res.requests) == sum(len(s.turns) for s in sessions)
        assert all(r.finishes == 1 and r.phase is Phase.DONE for r in res.requests)
        assert len({r.rid for r in res.requests}) == len(res.requests)
        for r in res.requests:
            assert r.arrival_s <= r.admitted_s <= r.first_token_s <= r.finish_s
            assert r.generated == r.answer_tokens
        for e in res.engines:  # drained: nothing queued, held or reserved
            e.check_integrity()
            assert e.in_flight == 0 and not e.g1.refs and e.g1.reserved == 0


def test_macro_steps_change_no_result() -> None:
    sessions = zipf_sessions(40, rate=3.0, seed=6)
    for mode in ("colocated+tier", "pd+tier"):
        fast = run(sessions, 5, mode, "cache_aware")
        slow = run(sessions, 5, mode, "cache_aware", macro_steps=False)
        assert fast.events < slow.events
        for a, b in zip(fast.requests, slow.requests, strict=True):
            assert (a.g1_tokens, a.tier_tokens, a.decode_engine) == (
                b.g1_tokens,
                b.tier_tokens,
                b.decode_engine,
            )
            assert a.first_token_s == pytest.approx(b.first_token_s, rel=1e-9, abs=1e-9)
            assert a.finish_s == pytest.approx(b.finish_s, rel=1e-9, abs=1e-9)
        fs, ss = summarize(fast), summarize(slow)
        assert fs["itl"]["samples"] == ss["itl"]["samples"]
        assert fs["itl"]["p99_ms"] == pytest.approx(ss["itl"]["p99_ms"], rel=1e-9)


def test_an_event_in_the_past_is_refused() -> None:
    fleet = Fleet(ENGINE, TIER, FleetSpec(1, "colocated", "round_robin"), [])
    fleet.now = 5.0
    with pytest.raises(SimulationError):
        fleet.schedule(4.0, print, None)


def test_bad_fleet_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="mode"):
        FleetSpec(4, "pd", "round_robin")
    with pytest.raises(ValueError, match="two engines"):
        FleetSpec(1, "pd+tier", "round_robin")
    with pytest.raises(ValueError, match="policy"):
        Fleet(ENGINE, TIER, FleetSpec(2, "colocated", "random"), [])


def test_a_request_larger_than_g1_is_refused() -> None:
    small = dataclasses.replace(ENGINE, g1_capacity_tokens=512)
    with pytest.raises(ValueError, match="more than engine G1 holds"):
        run(
            [Session(0, 0.0, 0, 600, (Turn(10, 4, 0.0),))],
            1,
            "colocated",
            "round_robin",
            engine=small,
        )


# ---- the parts ----------------------------------------------------------------------------------


def test_g1_keeps_the_head_of_a_released_request_longest() -> None:
    evicted: list[int] = []
    g1 = G1Cache(4, on_evicted=evicted.append)
    g1.allocate([], 4)
    for k in (10, 11, 12, 13):
        assert g1.register(k)
    g1.release([10, 11, 12, 13], 0)
    g1.check_integrity()
    assert g1.match([10, 11, 12, 99], 4) == 3
    assert g1.can_allocate([10], 3) and not g1.can_allocate([], 5)
    g1.allocate([10], 3)  # pins 10, evicts the two least recent: the tail first
    assert evicted == [13, 12]
    assert not g1.register(11)  # already cached: the new block stays a private copy
    g1.check_integrity()
    g1.release([10], 2)
    assert g1.reserved == 0 and not g1.refs
    with pytest.raises(RuntimeError):
        g1.allocate([], 5)


def test_kv_index_matches_the_longest_prefix_per_engine() -> None:
    idx = KvIndex()
    for k in (1, 2, 3):
        idx.stored(0, k)
    for k in (1, 2):
        idx.stored(1, k)
    idx.stored(2, 2)
    assert idx.match([1, 2, 3, 4], 4, {0, 1, 2}) == {0: 3, 1: 2}
    assert idx.match([1, 2, 3, 4], 2, {0, 1, 2}) == {0: 2, 1: 2}
    assert idx.match([1, 2, 3], 3, {1}) == {1: 2}
    idx.evicted(0, 2)
    assert idx.match([1, 2, 3], 3, {0, 1}) == {0: 1, 1: 2}


def test_sessions_resend_their_history_and_share_only_the_prefix() -> None:
    sessions = zipf_sessions(30, seed=1, prefixes=2)
    a = next(s for s in sessions if len(s.turns) >= 2)
    b = next(s for s in sessions if s.prefix_id == a.prefix_id and s is not a)
    t0 = a.turns[0]
    assert a.prompt_tokens(1) == a.prompt_tokens(0) + t0.answer_tokens + a.turns[1].question_tokens
    k0 = a.block_keys(a.prompt_tokens(0), 16)
    k1 = a.block_keys(a.prompt_tokens(1), 16)
    assert k1[: len(k0)] == k0  # a later turn extends the earlier one's keys
    kb = b.block_keys(b.prompt_tokens(0), 16)
    shared = a.prefix_tokens // 16
    assert kb[:shared] == k0[:shared] and kb[shared] != k0[shared]
    assert zipf_sessions(30, seed=1, prefixes=2) == sessions


def test_fit_recovers_step_costs_and_matches_the_measured_cpu_figures() -> None:
    truth = StepCosts(0.01, 2e-4, 1e-7, 1e-3, 1e-6)
    shapes = [(256, 0, 0, 0), (1024, 0, 0, 0), (2048, 0, 0, 0), (0, 0, 1, 100), (0, 0, 8, 900)]
    shapes.append((0, 0, 4, 8000))
    figs = [
        StepFigure(
            "x", "synthetic", n, chunk_pairs(0, n), b, c, truth.step_s(n, chunk_pairs(0, n), b, c)
        )
        for n, _, b, c in shapes
    ]
    fitted = fit_step_costs(figs)
    for name in ("base_s", "prefill_s_per_token", "attn_s_per_pair", "decode_s_per_seq"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    # The cpu-smollm2 profile reproduces the figures it was fitted to within 2 %.
    costs = ENGINE.costs
    for f in CPU_SMOLLM2_FIGURES:
        model = costs.step_s(f.prefill_tokens, f.pairs, f.decode_seqs, f.decode_ctx)
        model += (f.steps - 1) * costs.base_s
        assert model == pytest.approx(f.seconds, rel=0.02), f.label


def test_a_busy_link_does_not_hold_the_tier_back_for_other_engines() -> None:
    net = Network(TierSpec(100.0, 1.0, 0.0, 1.0), engines=2)
    first = net.tier(0, 10**9, 0.0, "read")  # 1 s on engine 0's 1 GB/s link
    second = net.tier(0, 10**9, 0.0, "read")  # queued behind it on that link
    other = net.tier(1, 10**9, 0.0, "write")  # its own link; the tier has room
    assert (first, second, other) == pytest.approx((1.0, 2.0, 1.0))
    shared = Network(TierSpec(1.0, 100.0, 0.001, 1.0), engines=2)  # the tier is the bottleneck
    assert shared.tier(0, 10**9, 0.0, "read") == pytest.approx(1.001)
    assert shared.tier(1, 10**9, 0.0, "read") == pytest.approx(2.001)
    gbps = windowed_gbps([(t.start_s, t.end_s, t.nbytes) for t in shared.log], 0.0, 3.0, 1.0)
    assert gbps == pytest.approx([1.0, 1.0, 0.0])  # one GB after the other
    peers = Network(TierSpec(1.0, 100.0, 0.001, 1.0), engines=2)
    assert peers.peer(0, 1, 10**9, 0.0) == pytest.approx(0.011)  # peers skip the tier


def test_windowed_bandwidth_spreads_a_transfer_over_its_duration() -> None:
    gbps = windowed_gbps([(0.5, 2.5, 2 * 10**9), (2.2, 2.2, 10**8)], 0.0, 3.0, 1.0)
    assert gbps == pytest.approx([0.5, 1.0, 0.6])


def test_weighted_percentile_counts_weights() -> None:
    values, weights = np.array([1.0, 2.0, 3.0]), np.array([1.0, 3.0, 1.0])
    assert weighted_percentile(values, weights, 50) == 2.0
    assert weighted_percentile(values, weights, 99) == 3.0
    assert weighted_percentile(values, weights, 10) == 1.0


def test_profiles_label_their_sources() -> None:
    for profile in (cpu_smollm2(), gpu_8b()):
        assert profile.sources
    assert all(
        v.startswith(("measured", "engine defaults", "kvtier defaults", "assumed", "chosen"))
        for v in cpu_smollm2().sources.values()
    )
    assert all(not v.startswith("measured") for v in gpu_8b().sources.values())


def test_the_cli_prints_a_table_then_one_json_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvtier.bench.fleet_sim import main

    main(["--engines", "4", "--sessions", "12", "--sweep", "2,4", "--plots", str(tmp_path),
          "--scale-duration", "240", "--scale-spike", "60,150,3", "--scale-seeds", "0"])  # fmt: skip
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert set(summary["results"]) == {f"{m}/{p}" for m in MODES for p in POLICIES}
    assert "mode/policy" in "\n".join(out[:-1])
    assert summary["sweep"]["engines"] == [2, 4]
    assert (tmp_path / "fleet-ttft.png").stat().st_size > 0
    assert (tmp_path / "fleet-hit-rate.png").stat().st_size > 0
    r = summary["results"]["pd+tier/cache_aware"]
    assert r["handoff"]["p50_ms"] > 0 and r["tier"]["read"]["gb"] > 0
    assert summary["results"]["colocated/round_robin"]["tier"]["read"]["gb"] == 0
    # the scaling comparison ran: both autoscalers on the same spike, each over its sweep
    scaling = summary["scaling"]
    assert (tmp_path / "fleet-scaling.png").stat().st_size > 0
    assert "autoscaler (* default)" in "\n".join(out[:-1])
    for kind in AUTOSCALERS:
        r = scaling[kind]
        assert r["ttft_p99_spike_s"] > 0 and r["replica_minutes"] > 0
        assert r["requests"] == scaling["signals"]["requests"]  # the same workload
        assert len(r["timeline"]["t"]) >= 10 and len(scaling["sweep"][kind]) == 4
    assert scaling["signals"]["max_replicas"] > 2  # it scaled up for the spike
    assert (
        scaling["replica_start"]["tier"]["new_replicas"]["hit_rate"]
        > (scaling["replica_start"]["no_tier"]["new_replicas"]["hit_rate"])
    )


# ---- the scaling comparison -----------------------------------------------------------------


def spiked(duration: float, spike: tuple[float, float, float], seed: int = 0) -> list[Session]:
    wl = WorkloadSpec(sessions=1, session_rate=0.5, answer_tokens=(16, 64), spike=spike, seed=seed)
    return build_sessions(dataclasses.replace(wl, sessions=round(wl.sessions_until(duration))))


def test_a_spike_multiplies_the_arrival_rate_in_its_window() -> None:
    sessions = spiked(600, (200.0, 300.0, 3.0))
    arrivals = np.array([s.arrival_s for s in sessions])
    before = np.sum(arrivals < 200) / 200
    during = np.sum((arrivals >= 200) & (arrivals < 300)) / 100
    assert 2.2 < during / before < 3.8
    wl = WorkloadSpec(sessions=1, session_rate=0.5, spike=(200.0, 300.0, 3.0))
    assert wl.sessions_until(600) == pytest.approx(0.5 * 600 + 0.5 * 2 * 100)
    with pytest.raises(ValueError, match="spike"):
        WorkloadSpec(sessions=1, session_rate=1.0, spike=(10.0, 5.0, 2.0))


def test_the_simulated_autoscaler_runs_the_routers_own_recommendation() -> None:
    import kvtier.bench.fleet.scaling as sim_scaling
    import kvtier.router.scaling as router_scaling
    import kvtier.router.signals as router_signals

    assert sim_scaling.recommend_replicas is router_scaling.recommend_replicas
    assert sim_scaling.SignalTracker is router_signals.SignalTracker
    assert sim_scaling.ScalingFleet.__mro__[1] is Fleet  # the fleet model, routed by the router


def test_a_fixed_fleet_pays_replicas_times_span() -> None:
    sessions = spiked(200, (50.0, 100.0, 2.0))
    spec = AutoscalerSpec("signals", initial_replicas=3, min_replicas=3, max_replicas=3)
    fleet = ScalingFleet(ENGINE, TIER, "colocated+tier", "cache_aware", sessions, spec)
    result = fleet.run()
    end = max(r.finish_s for r in result.requests)
    assert fleet.replica_minutes(end) == pytest.approx(3 * end / 60)
    assert {r.prefill_engine for r in result.requests} <= {0, 1, 2}
    assert set(fleet.timeline.provisioned) == {3}


@pytest.mark.parametrize("kind", AUTOSCALERS)
def test_autoscalers_grow_for_a_spike_and_shrink_after(kind: str) -> None:
    spike = (120.0, 300.0, 4.0)
    sessions = spiked(500, spike)
    spec = AutoscalerSpec(kind, initial_replicas=2, min_replicas=1, max_replicas=24,
                          startup_s=30.0, scale_down_window_s=60.0)  # fmt: skip
    r = run_scaling(ENGINE, TIER, "colocated+tier", "cache_aware", sessions, spec, spike)
    tl = r["timeline"]
    during = [n for t, n in zip(tl["t"], tl["ready"], strict=True) if 200 <= t < 300]
    after = [n for t, n in zip(tl["t"], tl["provisioned"], strict=True) if t >= 480]
    assert max(during) > 2 and after and after[-1] < max(during)
    assert r["new_replicas"]["requests"] > 0  # replicas that joined served requests
    # every request was routed to a ready engine and answered once (Fleet.run checks it)
    assert r["requests"] == sum(len(s.turns) for s in sessions)


def test_autoscaler_specs_are_checked() -> None:
    with pytest.raises(ValueError, match="autoscaler"):
        AutoscalerSpec("cpu")
    with pytest.raises(ValueError, match="min_replicas"):
        AutoscalerSpec("signals", initial_replicas=1, min_replicas=2)
    with pytest.raises(ValueError, match="colocated"):
        ScalingFleet(ENGINE, TIER, "pd+tier", "cache_aware", [], AutoscalerSpec("signals"))
