"""Two engines behind ``kvtier router``: routing policies, failover, warm start and P/D.

    python -m bench.serve_router --quick                 # also: python -m bench.serve --quick --router
    python -m bench.serve_router --quick --engine vllm   # two vLLM-CPU engines (.venv-vllm)
    python -m bench.serve_router --quick --dtype float32 # a host without native bf16
    python -m bench.serve_router --quick --phases policies --kv-tokens 8000

``--engine``: ``kvtier`` (``kvtier engine serve``) or ``vllm`` (vLLM-CPU
0.32; its KV events reach the router over ZMQ, ``--vllm-kv-events``).
``--dtype``: every engine's weights and KV (``auto``: bf16 only on a host
with native bf16). Budgets are tokens (``--kv-tokens`` of G1 per engine),
converted to each engine's bytes or blocks at its own dtype
(``bench/lib/router_fleet.py``), so float32 holds the same tokens as bf16.

**Policies** (``policies``): ``round_robin`` then ``cache_aware`` on the
multi-round workload (``bench/lib/serve_workloads.py``: users share a
system prompt, each has a context, every round re-sends the history), the
same two engines (no connector: G1 only) one policy after the other. Each
policy gets its own seed for its texts (no text of one run is in the other's)
and the same arrival times (a tail set by a burst of arrivals is the same
burst for both; before, the seed drew the arrivals too, and the two policies'
TTFT p99 compared different bursts), and
``round_robin`` goes first, so it starts with empty caches and
``cache_aware`` with the caches full of the other run's text. With the
default ``--kv-tokens`` 3,600 about half the users fit in one engine's G1
(tight); what one engine holds depends on where the router sent them. An
odd number of users keeps round robin from sending a user to the same
engine every round by accident. **Hit rate** = prompt tokens found in G1 /
prompt tokens looked up, summed over both engines' ``/metrics`` over the run.

**Failover** (``failover``, ``bench/lib/router_failover.py``): two engines
with the kvtier connector on one ``kvtier serve`` cache server, streamed
requests with long answers; once two streams are mid-stream on one engine,
its process group is killed by PID. Counts from the router (``GET
/failover``) and the client.

**Warm start** (``warm_start``, ``bench/lib/router_warm.py``): a fresh
replica joins the router (``POST /engines``) without, then with warm-up,
and replaces the engine before it; TTFT of the requests it serves in its
first minute. The fleet's hot set: ``--warm-documents`` (8) documents of
``--warm-document-tokens`` (3,000) on engines of ``--warm-kv-tokens``
(64,000); the first design was ``--warm-documents 4 --warm-document-tokens
1200 --warm-prime-rounds 4 --warm-kv-tokens 16000 --warm-qps 2``. Both
replicas get the same arrivals: ``--warm-load`` (0.5) x what the primed
fleet engine completes of the phase's requests (measured first, 4 at a
time; ``bench/lib/router_capacity.py``), unless ``--warm-qps`` is given.

**P/D** (``pd``, bundled engine only; the same two engines started again
for each mode, the kvtier connector on a new ``kvtier serve`` each):
``colocated`` (both ``--role both``, router ``least_loaded``) then ``pd``
(``--role prefill`` + ``--role decode``) on unique long documents, Poisson
arrivals. ITL = gaps between streamed chunks.

A table, the bars, then one JSON line last: ``policies.{round_robin,
cache_aware}.{hit_rate,ttft_p50_s,ttft_p99_s}``, ``failover.{streams_interrupted,
streams_completed,failed_requests,tokens_loaded_from_tier,tokens_recomputed}``,
``warm_start.{with,without}.{ttft_p50_s,ttft_p99_s}``, ``pd``, ``bars``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from kvtier.bench.lib.common import emit, load_average, machine, table
from kvtier.bench.lib.router_fleet import (
    EngineProcess,
    FleetOptions,
    RouterProcess,
    engine_process,
    shared_tier,
)
from kvtier.bench.lib.serve_calibrate import cpu_flags, host_fastest_dtype
from kvtier.bench.lib.serve_client import Limits, run_workload, warm_up
from kvtier.bench.lib.serve_metrics import Samples, delta, run_metrics, scrape
from kvtier.bench.lib.serve_stats import summarize
from kvtier.bench.lib.serve_systems import SystemStartError
from kvtier.bench.lib.serve_workloads import (
    Lane,
    MultiRoundConfig,
    SingleTurn,
    TextMaker,
    Workload,
    build_multi_round,
    poisson_arrivals,
    warmup_messages,
)

POLICIES = ("round_robin", "cache_aware")
PHASES = ("policies", "failover", "warm_start", "pd")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the reduced workloads (~15 min)")
    ap.add_argument("--engine", choices=("kvtier", "vllm"), default="kvtier")
    ap.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="every engine's dtype (auto: bf16 only on a host with native bf16)",
    )
    ap.add_argument(
        "--phases",
        default=None,
        help=f"comma-separated, of {','.join(PHASES)} (default: all; vllm: all but pd)",
    )
    ap.add_argument("--no-pd", action="store_true", help="all phases but pd")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--users", type=int, default=None, help="default 7 (--quick 5); odd")
    ap.add_argument("--rounds", type=int, default=None, help="default 5 (--quick 4)")
    ap.add_argument("--system-tokens", type=int, default=300)
    ap.add_argument("--context-tokens", type=int, default=900)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--qps", type=float, default=1.0)
    ap.add_argument(
        "--kv-tokens", type=int, default=3600, help="G1 of each engine in the policy runs, tokens"
    )
    ap.add_argument(
        "--fleet-kv-tokens",
        type=int,
        default=16_000,
        help="G1 of each engine in the failover, warm-start and P/D runs, tokens",
    )
    ap.add_argument(
        "--warm-qps",
        type=float,
        default=None,
        help="arrivals while a joined replica is measured (default: --warm-load x the fleet "
        "engine's measured capacity; the first design had 2)",
    )
    ap.add_argument(
        "--warm-load",
        type=float,
        default=0.5,
        help="share of the fleet engine's measured capacity the warm-start window offers",
    )
    ap.add_argument(
        "--warm-documents",
        type=int,
        default=8,
        help="hot documents (shared prefixes) of the warm-start phase",
    )
    ap.add_argument(
        "--warm-document-tokens",
        type=int,
        default=3000,
        help="tokens of each (the first design: 4 documents of 1,200)",
    )
    ap.add_argument(
        "--warm-prime-rounds",
        type=int,
        default=3,
        help="times each document is asked while priming the fleet",
    )
    ap.add_argument(
        "--warm-window-s",
        type=float,
        default=60.0,
        help="the measured window after each join (the bar: its first minute)",
    )
    ap.add_argument("--warm-kv-tokens", type=int, default=64_000,
                    help="G1 of each engine in the warm-start phase, tokens (first design: "
                    "16,000)")  # fmt: skip
    ap.add_argument("--pd-requests", type=int, default=None, help="default 16 (--quick 10)")
    ap.add_argument("--pd-prompt-tokens", type=int, default=1500)
    ap.add_argument("--pd-answer-tokens", type=int, default=48)
    ap.add_argument("--pd-qps", type=float, default=0.4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads / OpenMP CPUs per engine")
    ap.add_argument("--duration-s", type=float, default=120.0, help="sending time per run")
    ap.add_argument("--request-timeout-s", type=float, default=180.0)
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--tokenizer", default="smollm2")
    args = ap.parse_args(argv)
    if args.users is None:
        args.users = 5 if args.quick else 7
    if args.rounds is None:
        args.rounds = 4 if args.quick else 5
    if args.pd_requests is None:
        args.pd_requests = 10 if args.quick else 16
    if args.phases is None:
        default = [p for p in PHASES if not (p == "pd" and (args.no_pd or args.engine == "vllm"))]
        args.phase_list = default
    else:
        args.phase_list = [p.strip() for p in args.phases.split(",") if p.strip()]
        bad = [p for p in args.phase_list if p not in PHASES]
        if bad:
            ap.error(f"unknown phases {bad}; known: {', '.join(PHASES)}")
    if (args.warm_qps is not None and args.warm_qps <= 0) or not 0 < args.warm_load <= 1:
        ap.error("--warm-qps must be positive and --warm-load in (0, 1]")
    if args.engine == "vllm" and "pd" in args.phase_list:
        ap.error("the pd phase runs the bundled engine's --role prefill/decode: not with vllm")
    return args


def fleet_options(args: argparse.Namespace) -> FleetOptions:
    dtype = host_fastest_dtype() if args.dtype == "auto" else args.dtype
    return FleetOptions(
        engine=args.engine,
        dtype=dtype,
        threads=args.threads,
        start_timeout_s=args.start_timeout_s,
    )


def summed(samples: list[Samples | None]) -> Samples:
    out: Samples = {}
    for s in samples:
        for k, v in (s or {}).items():
            out[k] = out.get(k, 0.0) + v
    return out


def measure(
    router_url: str, engine_urls: list[str], workload: Workload, args: argparse.Namespace
) -> dict[str, Any]:
    """One workload through the router: client figures + both engines' counters summed."""
    before = summed([scrape(u) for u in engine_urls])
    limits = Limits(args.duration_s, None, args.request_timeout_s)
    result = asyncio.run(run_workload(router_url, "smollm2", workload, limits))
    time.sleep(1.0)  # the engines publish the counters of their last step
    after = summed([scrape(u) for u in engine_urls])
    out = summarize(result)
    server = run_metrics(delta(before, after))
    out["hit_rate"] = server.get("g1_hit_rate", server.get("hit_rate"))
    out["server_metrics"] = server
    routed = scrape(router_url) or {}
    out["router_decisions"] = {
        dict(labels).get("reason", "?"): v
        for (name, labels), v in routed.items()
        if name == "kvtier_router_decisions_total"
    }
    return out


def multi_round(args: argparse.Namespace, count: Callable[[str], int], seed: int) -> Workload:
    """The policies' workload: texts from ``seed``, arrivals from ``--seed`` (every policy
    gets the same arrival times)."""
    cfg = MultiRoundConfig(
        users=args.users,
        rounds=args.rounds,
        system_tokens=args.system_tokens,
        context_tokens=args.context_tokens,
        answer_tokens=args.answer_tokens,
        qps=args.qps,
        seed=seed,
        arrival_seed=args.seed,
    )
    return build_multi_round(cfg, count)


def long_prompts(args: argparse.Namespace, count: Callable[[str], int], seed: int) -> Workload:
    """Unique documents (no cache hit anywhere), one request each, Poisson arrivals."""
    maker = TextMaker(count)
    rng = random.Random(f"{seed}:pd")
    arrivals = poisson_arrivals(args.pd_qps, args.pd_requests, random.Random(f"{seed}:pd-arrivals"))
    lanes = []
    for i, at in enumerate(arrivals):
        doc = maker.text(args.pd_prompt_tokens, rng)
        msgs = [{"role": "user", "content": f"{doc}\n\nSummarize the text above."}]
        lanes.append(Lane(f"doc{i}", SingleTurn(msgs), [at]))
    params = {
        "workload": "long-prompts",
        "requests": args.pd_requests,
        "prompt_tokens": args.pd_prompt_tokens,
        "answer_tokens": args.pd_answer_tokens,
        "qps": args.pd_qps,
        "seed": seed,
    }
    return Workload("long-prompts", lanes, args.pd_answer_tokens, params)


def _warm(router_url: str, count: Callable[[str], int], say: Callable[[str], None]) -> None:
    warm = asyncio.run(warm_up(router_url, "smollm2", warmup_messages(count)))
    if warm.error:
        say(f"  note: warm-up failed: {warm.error}")


def run_policies(
    args: argparse.Namespace,
    opts: FleetOptions,
    count: Callable[[str], int],
    workdir: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with ExitStack() as stack:
        engines = [
            stack.enter_context(engine_process(opts, workdir, f"policy-engine{i}", args.kv_tokens))
            for i in range(2)
        ]
        urls = [e.url for e in engines]
        say(f"policies: {opts.engine} engines up at {urls} ({engines[0].info['g1_tokens']} tokens)")
        for i, policy in enumerate(POLICIES):
            router = RouterProcess(
                [(e, "both") for e in engines], policy, workdir / f"router-{policy}.log"
            )
            with router:
                _warm(router.url, count, say)
                workload = multi_round(args, count, args.seed + 100 * (i + 1))
                say(f"  {policy}: {workload.planned} requests")
                out[policy] = measure(router.url, urls, workload, args)
                out[policy]["workload"] = workload.params
        out["engines"] = [e.info for e in engines]
    return out


def run_failover(
    args: argparse.Namespace,
    opts: FleetOptions,
    count: Callable[[str], int],
    workdir: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:
    from kvtier.bench.lib.router_failover import FailoverLoad
    from kvtier.bench.lib.router_failover import run_failover as drive

    phase_dir = workdir / "failover"
    phase_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        config = stack.enter_context(shared_tier(phase_dir))
        engines = [
            stack.enter_context(
                engine_process(
                    opts, phase_dir, f"engine{i}", args.fleet_kv_tokens, connector=config
                )
            )
            for i in range(2)
        ]
        say(f"failover: {opts.engine} engines up at {[e.url for e in engines]}")
        router = RouterProcess(
            [(e, "both") for e in engines], "cache_aware", phase_dir / "router.log"
        )
        with router:
            _warm(router.url, count, say)
            load = FailoverLoad(seed=args.seed)
            say(f"  {load.requests} streams; one engine is killed mid-stream")
            out = drive(router.url, engines, load, count, timeout_s=args.request_timeout_s)
            say(f"  killed {out['killed_engine']} with {out['streams_mid_stream_at_kill']} streams")
        out["engines"] = [e.info for e in engines]
    return out


def run_warm_start(
    args: argparse.Namespace,
    opts: FleetOptions,
    count: Callable[[str], int],
    workdir: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:
    from kvtier.bench.lib.router_warm import WarmLoad
    from kvtier.bench.lib.router_warm import run_warm_start as drive

    load = WarmLoad(
        documents=args.warm_documents,
        document_tokens=args.warm_document_tokens,
        prime_rounds=args.warm_prime_rounds,
        qps=args.warm_qps,
        load=args.warm_load,
        kv_tokens=args.warm_kv_tokens,
        window_s=args.warm_window_s,
        seed=args.seed,
    )
    return drive(opts, workdir / "warm-start", load, count, args, say)


@contextmanager
def pd_engines(
    args: argparse.Namespace, opts: FleetOptions, workdir: Path, mode: str
) -> Iterator[list[tuple[EngineProcess, str]]]:
    roles = ("prefill", "decode") if mode == "pd" else ("both", "both")
    mode_dir = workdir / mode
    mode_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        config = stack.enter_context(shared_tier(mode_dir))
        engines = [
            stack.enter_context(
                engine_process(
                    opts,
                    mode_dir,
                    f"{mode}-{role}{i}",
                    args.fleet_kv_tokens,
                    connector=config,
                    role=role,
                )
            )
            for i, role in enumerate(roles)
        ]
        yield list(zip(engines, roles, strict=True))


def run_pd(
    args: argparse.Namespace,
    opts: FleetOptions,
    count: Callable[[str], int],
    workdir: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("colocated", "pd"):
        with pd_engines(args, opts, workdir, mode) as engines:
            policy = "least_loaded" if mode == "colocated" else "cache_aware"
            say(f"{mode}: engines up at {[(e.url, role) for e, role in engines]}")
            with RouterProcess(engines, policy, workdir / f"router-{mode}.log") as router:
                _warm(router.url, count, say)
                workload = long_prompts(args, count, args.seed)
                say(f"  {mode}: {workload.planned} requests")
                out[mode] = measure(router.url, [e.url for e, _ in engines], workload, args)
                legs = scrape(router.url) or {}
                out[mode]["router_legs"] = {
                    dict(labels)["leg"]: v
                    for (name, labels), v in legs.items()
                    if name == "kvtier_router_leg_seconds_count"
                }
                out[mode]["workload"] = workload.params
    return out


def _ms(v: float | None) -> str:
    return f"{v * 1e3:.0f}" if v is not None else "-"


def _pct(v: float | None) -> str:
    return f"{v:.1%}" if v is not None else "-"


def report(results: dict[str, Any]) -> str:
    """The table: the policy and P/D runs, then failover and warm start."""
    headers = ["run", "req", "err", "G1 hit", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]  # fmt: skip
    runs = [(k, v) for k, v in results.get("policies", {}).items() if k in POLICIES]
    runs += [(f"pd/{k}", v) for k, v in results.get("pd", {}).items()]
    runs += [(f"warm_start/{k}", v) for k, v in results.get("warm_start", {}).items()
             if k in ("with", "without")]  # fmt: skip
    rows = [
        [name, s.get("requests"), s.get("errors"), _pct(s.get("hit_rate")), _ms(s.get("ttft_p50_s")),
         _ms(s.get("ttft_p99_s")), _ms(s.get("itl_p50_s")), _ms(s.get("itl_p99_s"))]
        for name, s in runs
    ]  # fmt: skip
    text = table(headers, rows)
    rate = results.get("warm_start", {}).get("rate")
    if rate:
        cap = rate.get("capacity") or {}
        how = (f"{rate.get('load')} x the fleet engine's measured capacity "
               f"{cap.get('requests_per_s', 0):.2f} req/s" if rate.get("source") == "measured"
               else "given")  # fmt: skip
        text += f"\nwarm start window: {rate.get('qps', 0):.2f} req/s for both replicas ({how})"
    fo = results.get("failover")
    if fo:
        text += (
            f"\nfailover: killed {fo.get('killed_engine')} with "
            f"{fo.get('streams_mid_stream_at_kill')} streams mid-stream; router: "
            f"interrupted {fo.get('streams_interrupted')}, completed {fo.get('streams_completed')}, "
            f"failed requests {fo.get('failed_requests')}, continuation prompt tokens loaded from "
            f"the tier {fo.get('tokens_loaded_from_tier')}, recomputed {fo.get('tokens_recomputed')}; "
            f"texts equal to the survivor's {fo.get('texts_equal')} of {fo.get('texts_compared')}"
        )
    return text


def _le(a: float | None, b: float | None, factor: float = 1.0) -> bool | None:
    return None if a is None or b is None else a <= factor * b


def bars(results: dict[str, Any]) -> dict[str, bool | None]:
    """The issue's bars over whichever phases ran (None: a figure is missing)."""
    out: dict[str, bool | None] = {}
    pol = results.get("policies", {})
    rr, ca = pol.get("round_robin"), pol.get("cache_aware")
    if rr and ca:
        hr, hc = rr.get("hit_rate"), ca.get("hit_rate")
        out["cache_aware_hit_rate_ge_round_robin_plus_0.15"] = (
            None if hr is None or hc is None else hc >= hr + 0.15
        )
        out["cache_aware_ttft_p99_le_round_robin"] = _le(ca.get("ttft_p99_s"), rr.get("ttft_p99_s"))
    fo = results.get("failover")
    if fo:
        failed, done, cut = (fo.get(k) for k in ("failed_requests", "streams_completed",
                                                  "streams_interrupted"))  # fmt: skip
        out["failover_no_failed_requests"] = None if failed is None else failed == 0
        out["failover_streams_completed_eq_interrupted"] = (
            None if done is None or not cut else done == cut
        )
    warm = results.get("warm_start", {})
    w, c = warm.get("with"), warm.get("without")
    if w and c:
        out["warm_ttft_p99_le_half_cold"] = _le(w.get("ttft_p99_s"), c.get("ttft_p99_s"), 0.5)
    pd = results.get("pd", {})
    co, p = pd.get("colocated"), pd.get("pd")
    if co and p:
        ic, ip = co.get("itl_p99_s"), p.get("itl_p99_s")
        out["pd_itl_p99_lt_colocated"] = None if ic is None or ip is None else ip < ic
    return out


RUNNERS = {
    "policies": run_policies,
    "failover": run_failover,
    "warm_start": run_warm_start,
    "pd": run_pd,
}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from kvtier.bench.lib.serve_workloads import token_counter

    opts = fleet_options(args)
    count = token_counter(args.tokenizer)
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-router-bench-"))
    t0 = time.monotonic()
    loads = [load_average()[0]]

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:5.0f} s] {msg}", flush=True)

    say(
        f"{opts.engine} engines, {opts.dtype}, phases {','.join(args.phase_list)}; logs in {workdir}"
    )
    results: dict[str, Any] = {}
    for phase in args.phase_list:
        try:
            results[phase] = RUNNERS[phase](args, opts, count, workdir, say)
        except (RuntimeError, OSError, httpx.HTTPError, TimeoutError, SystemStartError) as e:
            # NOTE: a phase that cannot run (an engine that did not start, a router
            # that refused) is reported, and the other phases still run
            say(f"{phase} failed: {type(e).__name__}: {e}")
            results[phase] = {"error": f"{type(e).__name__}: {e}"}
        loads.append(load_average()[0])
    checked = bars(results)
    print(f"\n{(__doc__ or '').splitlines()[0]} ({opts.engine}, {opts.dtype})")
    print(report(results))
    for name, ok in checked.items():
        print(f"bar {name}: {ok}")
    print(f"logs in {workdir}")
    emit(
        {
            "bench": "serve_router",
            "quick": args.quick,
            "engine": opts.engine,
            "dtype": opts.dtype,
            "phases": args.phase_list,
            **results,
            "bars": checked,
            "checks": checked,  # the name before issue 21
            "threads_per_engine": args.threads,
            "kv_tokens_per_engine": args.kv_tokens,
            "g1_tokens_per_engine": opts.g1_tokens(args.kv_tokens),
            "fleet_kv_tokens_per_engine": args.fleet_kv_tokens,
            "load_average_1m": {"min": min(loads), "max": max(loads)},
            "cpu": cpu_flags(),
            "elapsed_s": time.monotonic() - t0,
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
