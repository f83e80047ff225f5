"""Two ``kvtier engine serve`` processes behind ``kvtier router``: routing policies, and P/D.

    python -m bench.serve_router --quick        # also: python -m bench.serve --quick --router
    python -m bench.serve_router --quick --no-pd

**Policies** (one run, the same two engines, one after the other):
``round_robin`` then ``cache_aware`` on the multi-round workload
(``bench/lib/serve_workloads.py``: users share a system prompt, each has a
context, every round re-sends the history). Each policy gets its own seed
(no text of one policy's run is in the other's), and ``round_robin`` goes
first, so it starts with empty caches and ``cache_aware`` with the caches
full of the other run's text. The engines have a G1 of ``--kv-tokens``
tokens each and no connector: about half the users fit in one engine, so
what one engine holds depends on where the router sent them. An odd number
of users keeps round robin from sending a user to the same engine every
round by accident. **Hit rate** = prompt tokens served from G1 / prompt
tokens looked up, summed over both engines' ``/metrics`` over the run.

**P/D** (the same two engines, started again for each mode, with the kvtier
connector on one ``kvtier serve`` cache server, new for each mode):
``colocated`` (both engines ``--role both``, the router ``least_loaded``)
then ``pd`` (``--role prefill`` and ``--role decode``, the router sending
each prompt to the prefill engine and the request to the decode engine),
on long-prompt arrivals: unique documents of ``--pd-prompt-tokens`` tokens,
Poisson at ``--pd-qps``, ``--pd-answer-tokens`` tokens each. ITL = gaps
between streamed chunks of every request (the decoding requests).

Each engine gets one torch thread (two engines on a small host).
A table, then one JSON line last: ``policies.{round_robin,cache_aware}.
{hit_rate,ttft_p50_s,ttft_p99_s,...}``, ``pd.{colocated,pd}.{itl_p99_s,...}``
and the bars (``checks``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from kvtier.bench.lib.common import emit, machine, table
from kvtier.bench.lib.serve_calibrate import host_fastest_dtype
from kvtier.bench.lib.serve_client import Limits, run_workload, warm_up
from kvtier.bench.lib.serve_metrics import Samples, delta, run_metrics, scrape
from kvtier.bench.lib.serve_stats import summarize
from kvtier.bench.lib.serve_systems import (
    REPO,
    KvtierEngineServer,
    SystemOptions,
    free_port,
    kv_bytes_per_token,
    stop_process,
    tier_config,
    wait_healthy,
)
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="the reduced workloads (10-20 min on 2 vCPUs)"
    )
    ap.add_argument("--no-pd", action="store_true", help="policies only")
    ap.add_argument("--no-policies", action="store_true", help="P/D only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--users", type=int, default=None, help="default 7 (--quick 5); odd")
    ap.add_argument("--rounds", type=int, default=None, help="default 5 (--quick 4)")
    ap.add_argument("--system-tokens", type=int, default=300)
    ap.add_argument("--context-tokens", type=int, default=900)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--qps", type=float, default=1.0)
    ap.add_argument(
        "--kv-tokens", type=int, default=3600, help="G1 of each engine in the policy runs"
    )
    ap.add_argument("--pd-requests", type=int, default=None, help="default 16 (--quick 10)")
    ap.add_argument("--pd-prompt-tokens", type=int, default=1500)
    ap.add_argument("--pd-answer-tokens", type=int, default=48)
    ap.add_argument("--pd-qps", type=float, default=0.4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each engine")
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
    return args


class RouterProcess:
    """``kvtier router`` in a subprocess on a free port."""

    def __init__(self, engines: list[tuple[str, str]], policy: str, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        flag = {"both": "--engine", "prefill": "--prefill", "decode": "--decode"}
        cmd = [sys.executable, "-m", "kvtier.cli", "router", "--port", str(self.port)]
        cmd += ["--policy", policy, "--health-interval", "0.5"]
        for url, role in engines:
            cmd += [flag[role], url]
        self.cmd = cmd
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RouterProcess:
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self.cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            wait_healthy(self.url, self._proc, 120.0)
        except BaseException:
            stop_process(self._proc, grace_s=5)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            stop_process(self._proc, grace_s=10)


def engine(
    args: argparse.Namespace,
    workdir: Path,
    name: str,
    kv_tokens: int,
    *,
    role: str = "both",
    kvtier_config: Path | None = None,
) -> KvtierEngineServer:
    server = KvtierEngineServer(
        kv_tokens * kv_bytes_per_token(host_fastest_dtype()),  # the engine's "auto" dtype
        workdir / f"{name}.log",
        kvtier_config=kvtier_config,
        threads=args.threads,
        start_timeout_s=args.start_timeout_s,
    )
    if role != "both":
        server.cmd += ["--role", role]
    return server


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
    out["hit_rate"] = server.get("hit_rate")
    out["server_metrics"] = server
    routed = scrape(router_url) or {}
    out["router_decisions"] = {
        dict(labels).get("reason", "?"): v
        for (name, labels), v in routed.items()
        if name == "kvtier_router_decisions_total"
    }
    return out


def multi_round(args: argparse.Namespace, count: Callable[[str], int], seed: int) -> Workload:
    cfg = MultiRoundConfig(
        users=args.users,
        rounds=args.rounds,
        system_tokens=args.system_tokens,
        context_tokens=args.context_tokens,
        answer_tokens=args.answer_tokens,
        qps=args.qps,
        seed=seed,
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


def run_policies(
    args: argparse.Namespace, count: Callable[[str], int], workdir: Path, say: Callable[[str], None]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with ExitStack() as stack:
        engines = [
            stack.enter_context(engine(args, workdir, f"policy-engine{i}", args.kv_tokens))
            for i in range(2)
        ]
        urls = [e.url for e in engines]
        say(f"policies: engines up at {urls}")
        for i, policy in enumerate(POLICIES):
            with RouterProcess(
                [(u, "both") for u in urls], policy, workdir / f"router-{policy}.log"
            ) as router:
                warm = asyncio.run(warm_up(router.url, "smollm2", warmup_messages(count)))
                if warm.error:
                    say(f"  note: warm-up failed: {warm.error}")
                workload = multi_round(args, count, args.seed + 100 * (i + 1))
                say(f"  {policy}: {workload.planned} requests")
                out[policy] = measure(router.url, urls, workload, args)
                out[policy]["workload"] = workload.params
    return out


@contextmanager
def pd_engines(
    args: argparse.Namespace, workdir: Path, mode: str, kv_tokens: int
) -> Iterator[list[tuple[str, str]]]:
    from kvtier.bench.lib.peers import ServerProcess

    roles = ("prefill", "decode") if mode == "pd" else ("both", "both")
    with ExitStack() as stack:
        cache = stack.enter_context(ServerProcess(2 << 30))
        opts = SystemOptions(max_model_len=2048)
        mode_dir = workdir / mode
        mode_dir.mkdir(parents=True, exist_ok=True)
        config = tier_config("server", opts, mode_dir, cache.address)
        engines = [
            stack.enter_context(
                engine(
                    args, mode_dir, f"{mode}-{role}{i}", kv_tokens, role=role, kvtier_config=config
                )
            )
            for i, role in enumerate(roles)
        ]
        yield [(e.url, role) for e, role in zip(engines, roles, strict=True)]


def run_pd(
    args: argparse.Namespace, count: Callable[[str], int], workdir: Path, say: Callable[[str], None]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    kv_tokens = 16_000  # G1 large enough: the comparison is about interference, not capacity
    for mode in ("colocated", "pd"):
        with pd_engines(args, workdir, mode, kv_tokens) as engines:
            policy = "least_loaded" if mode == "colocated" else "cache_aware"
            say(f"{mode}: engines up at {engines}")
            with RouterProcess(engines, policy, workdir / f"router-{mode}.log") as router:
                warm = asyncio.run(warm_up(router.url, "smollm2", warmup_messages(count)))
                if warm.error:
                    say(f"  note: warm-up failed: {warm.error}")
                workload = long_prompts(args, count, args.seed)
                say(f"  {mode}: {workload.planned} requests")
                out[mode] = measure(router.url, [u for u, _ in engines], workload, args)
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


def report(policies: dict[str, Any], pd: dict[str, Any]) -> str:
    headers = ["run", "req", "err", "hit", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]
    rows = [
        [name, s["requests"], s["errors"], _pct(s.get("hit_rate")), _ms(s["ttft_p50_s"]),
         _ms(s["ttft_p99_s"]), _ms(s["itl_p50_s"]), _ms(s["itl_p99_s"])]
        for name, s in [*policies.items(), *pd.items()]
    ]  # fmt: skip
    return table(headers, rows)


def checks(policies: dict[str, Any], pd: dict[str, Any]) -> dict[str, bool | None]:
    out: dict[str, bool | None] = {}
    rr, ca = policies.get("round_robin"), policies.get("cache_aware")
    if rr and ca:
        hr, hc = rr.get("hit_rate"), ca.get("hit_rate")
        out["cache_aware_hit_rate_ge_round_robin_plus_0.15"] = (
            None if hr is None or hc is None else hc >= hr + 0.15
        )
        tr, tc = rr.get("ttft_p99_s"), ca.get("ttft_p99_s")
        out["cache_aware_ttft_p99_le_round_robin"] = None if tr is None or tc is None else tc <= tr
    co, p = pd.get("colocated"), pd.get("pd")
    if co and p:
        ic, ip = co.get("itl_p99_s"), p.get("itl_p99_s")
        out["pd_itl_p99_lt_colocated"] = None if ic is None or ip is None else ip < ic
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from kvtier.bench.lib.serve_workloads import token_counter

    count = token_counter(args.tokenizer)
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-router-bench-"))
    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:5.0f} s] {msg}", flush=True)

    policies = {} if args.no_policies else run_policies(args, count, workdir, say)
    pd = {} if args.no_pd else run_pd(args, count, workdir, say)
    print(f"\n{(__doc__ or '').splitlines()[0]}")
    print(report(policies, pd))
    bars = checks(policies, pd)
    for name, ok in bars.items():
        print(f"{name}: {ok}")
    print(f"logs in {workdir}")
    emit(
        {
            "bench": "serve_router",
            "quick": args.quick,
            "policies": policies,
            "pd": pd,
            "checks": bars,
            "threads_per_engine": args.threads,
            "kv_tokens_per_engine": args.kv_tokens,
            "elapsed_s": time.monotonic() - t0,
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
