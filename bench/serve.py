"""Multi-user serving: a load generator for OpenAI-compatible servers, and the systems it compares.

    python bench/serve.py --quick                          # 5 systems, the reference workload (< 10 min)
    python bench/serve.py --target http://127.0.0.1:8000   # any running server
    python bench/serve.py --systems kvtier,kvtier_small_g1,kvtier_small_g1_cpu_tier
    python bench/serve.py --systems kvtier,vllm --sweep-qps 0.3,0.6,1.2
    python bench/serve.py --workload doc-qa --systems kvtier_small_g1,kvtier_small_g1_cpu_tier
    python bench/serve.py --systems vllm_small_kv,vllm_small_kv_lmcache,kvtier_small_g1_cpu_tier
    python bench/serve.py --quick --router                 # two engines behind kvtier router

Workloads (``bench/serve_workloads.py``): ``multi-round`` — by default the
reference workload: 6 users, a 1,000-token system prompt shared by all,
1,000 tokens of context per user, 4 rounds each re-sending the whole history
(earlier questions and the server's actual answers), 20-token answers
(``ignore_eos``), Poisson arrivals at 0.6 requests/s; a user's next round
leaves at its arrival time or when its previous answer completed, whichever
is later. ``doc-qa`` — documents of 1,000-3,000 tokens (never a multiple of
16), questions drawn by Zipf popularity. ``--sweep-qps`` repeats the
workload at each rate against the same server; each rate uses its own seed
(``--seed`` + its index), so no rate starts with the text of another cached.

``--systems`` starts each system itself (``bench/serve_systems.py``), warms
it up with one request of its own 600-token text (so a KV connector has
saved once before the measurement), runs the workload, and stops it; a system
whose peer is not installed (vLLM; LMCache, ``scripts/setup_lmcache.sh``) is
skipped with a note. ``--target`` measures a server that is already running.

Per request (``bench/serve_client.py``): TTFT, inter-token gaps (one per
streamed content chunk), end-to-end latency, prompt / completion / cached
tokens. Per run (``bench/serve_stats.py``): p50/p90/p99 of TTFT, ITL and
end-to-end latency (linear interpolation, as numpy), requests/s and prompt
and output tokens/s over the run's duration (start to last completion).

**Hit rate** = prompt tokens served from any cache (the engine's own prefix
cache plus tokens loaded by a KV connector) / prompt tokens looked up, from
the server's ``/metrics`` counters before and after the run
(``bench/serve_metrics.py`` names them). ``hit_rate_usage`` is the same
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
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from common import emit, machine, table
from serve_client import Limits, RunResult, run_workload, warm_up
from serve_metrics import delta, run_metrics, scrape
from serve_stats import summarize
from serve_systems import (
    SERVED_NAME,
    Running,
    SystemOptions,
    SystemSpec,
    SystemStartError,
    SystemUnavailable,
    log_tail,
    running_system,
)
from serve_workloads import (
    DocQaConfig,
    MultiRoundConfig,
    Workload,
    build_doc_qa,
    build_multi_round,
    warmup_messages,
)

from kvtier.units import parse_bytes

QUICK_SYSTEMS = "vllm,kvtier,vllm_small_kv,kvtier_small_g1,kvtier_small_g1_cpu_tier"
PLOTS = Path(__file__).resolve().parent / "plots"
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="reduced workload, the 5-system preset")
    ap.add_argument(
        "--router",
        action="store_true",
        help="two engines behind `kvtier router`: policies and P/D (bench/serve_router.py)",
    )
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--target", default=None, help="base URL of a running server")
    where.add_argument("--systems", default=None, help="comma-separated systems to start")
    ap.add_argument("--workload", choices=("multi-round", "doc-qa"), default="multi-round")
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
    sy.add_argument("--kv-cache-gib", type=int, default=1, help="KV memory of kvtier and vllm")
    sy.add_argument(
        "--small-kv-blocks", type=int, default=32, help="small KV budget in 128-token blocks"
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
    if args.duration_s is None:
        args.duration_s = 75.0 if args.quick else 600.0
    if args.request_timeout_s is None:
        args.request_timeout_s = 120.0 if args.quick else 300.0
    if args.target is None and args.systems is None:
        args.systems = QUICK_SYSTEMS if args.quick else "kvtier"
    return args


def token_counter(tokenizer: str) -> Callable[[str], int]:
    """Counts tokens of a text with the model's tokenizer (no weights are loaded)."""
    from kvtier.engine.fetch import lookup_known, resolve_model
    from kvtier.engine.models.loader import load_tokenizer

    path = resolve_model(tokenizer) if lookup_known(tokenizer) else Path(tokenizer)
    tok = load_tokenizer(path)
    return lambda text: len(tok.encode(text, add_special_tokens=False))


def make_workload(
    args: argparse.Namespace, count: Callable[[str], int], qps: float, seed: int
) -> Workload:
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


def run_system(
    args: argparse.Namespace,
    sys_: Running,
    workloads: Callable[[], list[tuple[float, Workload]]],
    warmup: list[dict[str, str]],
    limits: Limits,
    records: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Warms ``sys_`` up and runs a fresh workload per QPS point; one summary per point.

    ``workloads`` builds them anew: a conversation keeps the answers of the
    server it ran against.
    """
    model = args.model or served_model(sys_.url)
    warm = asyncio.run(warm_up(sys_.url, model, warmup))
    if warm.error:
        print(f"  note: warm-up request failed: {warm.error}", flush=True)
    points = []
    for qps, workload in workloads():
        print(
            f"  {sys_.name}: {workload.name} at {qps:g} req/s ({workload.planned} requests planned)",
            flush=True,
        )
        summary, result = measure(sys_.url, model, workload, limits)
        summary.update({"qps": qps, "model": model, "config": sys_.info})
        summary["ttft_samples_s"] = sorted(r.ttft_s for r in result.ok if r.ttft_s is not None)
        points.append(summary)
        records += [{"system": sys_.name, "qps": qps, **r.to_dict()} for r in result.records]
        print(
            f"  {sys_.name}: {summary['requests']} ok, {summary['errors']} errors, "
            f"{summary['not_sent']} not sent in {summary['duration_s']:.1f} s",
            flush=True,
        )
    return points


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


def plot(sweeps: dict[str, list[dict[str, Any]]], main_qps: float, out_dir: Path) -> list[str]:
    """The TTFT CDF per system (at ``main_qps``) and, with several rates, TTFT against QPS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in sweeps.items():
        s = min(points, key=lambda p: abs(p["qps"] - main_qps))
        xs = s["ttft_samples_s"]
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF at {main_qps:g} req/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "serve-ttft-cdf.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(str(path))
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


@dataclass
class Plan:
    """What one invocation runs: systems (or a target), rates, options and bounds."""

    runs: list[tuple[str, Callable[[Path], AbstractContextManager[Running]]]]
    qps_points: list[float]
    main_qps: float
    limits: Limits


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
        runs: list[tuple[str, Callable[[Path], AbstractContextManager[Running]]]]
        if args.target:
            runs = [("target", lambda _: target(args.target))]
        else:
            opts = SystemOptions(
                big_kv_gib=args.kv_cache_gib,
                small_kv_blocks=args.small_kv_blocks,
                tier_bytes=parse_bytes(args.tier_capacity),
                slow_get_ms=args.slow_get_ms,
                max_model_len=args.max_model_len,
                threads=args.threads,
                vllm_omp_threads=args.vllm_omp_threads,
                vllm_venv=args.vllm_venv,
                vllm_model_dir=args.vllm_model_dir.expanduser() if args.vllm_model_dir else None,
                start_timeout_s=args.start_timeout_s,
            )
            names = [n.strip() for n in args.systems.split(",") if n.strip()]
            specs = [SystemSpec.named(n) for n in names]
            runs = [(s.name, partial(running_system, s, opts)) for s in specs]
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    main_qps = args.qps if args.qps in qps_points else qps_points[0]
    return Plan(runs, qps_points, main_qps, limits)


def print_report(
    args: argparse.Namespace,
    workload: Workload,
    sweeps: dict[str, list[dict[str, Any]]],
    systems: dict[str, dict[str, Any]],
    not_measured: dict[str, str],
) -> dict[str, float]:
    """The human-readable part: workload, table, ratio lines; returns the ratios."""
    params = {k: v for k, v in workload.params.items() if k not in ("doc_tokens", "doc_requests")}
    print(f"\n{(__doc__ or '').splitlines()[0]}")
    print(f"{workload.name}: {json.dumps(params)}")
    print(
        f"limits: {args.duration_s:g} s of sending per run, "
        f"{args.max_requests or 'no'} request cap, {args.request_timeout_s:g} s per request"
    )
    print(report_table(sweeps))
    rat = ratios(systems)
    for key, num, den, fig in RATIOS:
        if key in rat:
            print(f"{num} / {den} {fig.removesuffix('_s')}: {rat[key]:.2f}x")
    for name, why in not_measured.items():
        print(f"not measured: {name}: {why}")
    return rat


def _terminate(signum: int, _frame: object) -> None:
    """SIGTERM (``timeout``, a CI runner) unwinds like Ctrl-C: the servers started are stopped."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _terminate)
    args = parse_args(argv)
    if args.router:
        from serve_router import main as router_main

        router_main(["--quick"] if args.quick else [])
        return
    plan = make_plan(args)
    count = token_counter(args.tokenizer)

    def workloads() -> list[tuple[float, Workload]]:
        return [
            (q, make_workload(args, count, q, args.seed + i)) for i, q in enumerate(plan.qps_points)
        ]

    warmup = warmup_messages(count)
    try:
        workloads()  # a bad workload option fails before anything starts
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-serve-bench-"))
    sweeps: dict[str, list[dict[str, Any]]] = {}
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    records: list[dict[str, Any]] = []
    started = time.monotonic()
    for name, start in plan.runs:
        print(f"[{time.monotonic() - started:5.0f} s] {name}: starting", flush=True)
        try:
            with start(workdir / name) as sys_:
                print(f"[{time.monotonic() - started:5.0f} s] {name}: up at {sys_.url}", flush=True)
                sweeps[name] = run_system(args, sys_, workloads, warmup, plan.limits, records)
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
        p = min(points, key=lambda p: abs(p["qps"] - plan.main_qps))
        return {k: v for k, v in p.items() if k != "ttft_samples_s"}

    systems = {name: at_main_qps(pts) for name, pts in sweeps.items()}
    plots = [] if args.no_plots or not sweeps else plot(sweeps, plan.main_qps, args.plots_dir)
    if args.records is not None:
        args.records.write_text("".join(json.dumps(r) + "\n" for r in records))
    if failed or args.keep_logs:
        print(f"server logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    workload = next(w for q, w in workloads() if q == plan.main_qps)
    rat = print_report(args, workload, sweeps, systems, {**skipped, **failed})
    sweep_out = {
        name: [{k: v for k, v in p.items() if k not in ("ttft_samples_s", "config")} for p in pts]
        for name, pts in sweeps.items()
        if len(pts) > 1
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
            "systems": systems,
            "ran": list(sweeps),
            "ratios": rat,
            "skipped": skipped,
            "failed": failed,
            "sweep": sweep_out,
            "plots": plots,
            "elapsed_s": elapsed,
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
