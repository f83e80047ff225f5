"""The warm-start phase of ``bench/serve_router.py``: a fresh replica joins, warmed or cold.

One engine (the fleet) with the kvtier connector on a ``kvtier serve`` cache
server, behind ``kvtier router --policy cache_aware``. **Priming**: questions
about the fleet's hot documents (each a shared prefix; every document asked
``prime_rounds`` times: rounds of all documents, each round in a shuffled
order), so the fleet's G1, the shared tier and the router's hit statistics
know them all. Priming is a closed loop of ``prime_concurrency`` requests in
flight, each sent when one before it completed: it is not measured, and must
not overload the engine it primes. (It used to arrive at a fixed 2 req/s. On
a 2-vCPU host without native bf16, 24 questions on 3,000-token documents
then arrived within 12 s, one float32 engine computing ~50 prompt tokens a
second shared its steps among all of them, and the 12 requests of the
capacity measurement after them failed too: the phase failed.) Then, twice:

1. a fresh engine (the same build, connector on the same tier) is started
   and joins through ``POST /engines`` — ``"warm": false`` the first time,
   ``"warm": true`` the second (then the phase waits until ``GET
   /warm_start`` says it is no longer warming: it takes no traffic before);
   a vLLM joiner brings its ZMQ KV events in the body (``vllm_kv_events``);
2. it **replaces** the engine before it: that one is killed while idle and
   the phase waits until the router has taken it out, so the new replica
   takes all the traffic at once (a rolling replacement, or a replica that
   replaces a failed one under load; with the old engine still in, the
   router would keep the hot prefixes where they are and the joiner would
   see a share of the misses that depends on routing, not on warm-up);
3. for ``window_s`` (a minute) new questions about the same documents
   arrive at the window rate (below: the same for both replicas); **TTFT of
   the requests the new replica answered** (``x-kvtier-engine``): its first
   minute.

Each pass asks its own questions (another seed), so the second does not
find the first one's prompts in the tier. A cold replica loads each hot
document from the tier at its first request for it, and its first requests
pay what a fresh process pays once (its first forward passes); a warmed one
did both during warm-up, before it took traffic. Per request the JSON keeps
its arrival, document, TTFT and whether it was the replica's first request
for its document (``first_for_document``: a cold replica's tier load).

**The workload** (``WarmLoad``; the first design, kept as ``--warm-documents
4 --warm-document-tokens 1200``, had 4 hot documents of 1,200 tokens: only 4
of a cold replica's 120 requests were misses, each one local tier load of
~0.15 s, so both replicas' TTFT p99 was set by Poisson queueing, not by
warm-up). A replica joins a fleet that serves many shared prefixes, and
those are long: RAG documents and agent or tool system prompts of 2-4k
tokens, several per tenant. The default is 8 hot documents of 3,000 tokens
(24k tokens: the hot set no single request shows), a G1 per engine of
``kv_tokens`` (64,000: the router warms at most ``--warm-fraction`` 0.5 of
it, and the 8 documents fit) and a context of ``max_model_len`` 4,096.
Everything else (questions of 24 tokens, answers of 16, one minute) is as
before; the same seeds give the same window questions.

**The rate** (``router_capacity.py``). The phase measures what warm-up
changes in a replica's first minute, so the arrival rate must be one the
engine serves: at a rate near its capacity both replicas' tails are set by
the queue, not by the cache. At the fixed 2 req/s of the earlier runs the
bundled engine's warmed replica answered every request within 0.58 s, but
one vLLM-CPU engine with 3,000-token contexts was near saturation (the warmed replica: 9 requests over 1 s spread over the
whole minute, up to 14 in flight after a burst of arrivals; the cold one: 46,
its backlog from the misses draining slowly), so the vLLM figure measured
the queue. As ``bench/serve.py`` sizes its sustained workload from the
host's measured speed, the phase now measures the engine under test: after
priming, ``capacity_requests`` new questions on the hot documents (their own
seed) go to the primed fleet engine, ``capacity_concurrency`` at a time in a
closed loop, and capacity = completed requests / elapsed seconds (hits, as a
fleet engine serves them, with the engine's own batching). Both replicas get
``load`` (0.5) x that rate: a fleet sized with headroom (the router's scaling
target plans 0.4 of an engine's measured prefill capacity, bench/serve.py's
sustained workload offers 0.75 of the calibrated work). Poisson bursts still
queue at 0.5 — that stays in the figure, for both replicas alike — but a
queue drains, so a replica's tail shows what it had to load. The same rate
for the cold and the warmed replica; the rate, the measurement and the load
are printed and in the JSON (``rate``). ``qps`` given (``--warm-qps``)
skips the measurement (``rate.source: given``). Fewer arrivals in the minute
make p99 closer to the slowest request: the JSON keeps each one.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from kvtier.bench.lib.router_capacity import Capacity, send_closed_loop, sized_rate
from kvtier.bench.lib.router_failover import Stream, stream_request
from kvtier.bench.lib.router_fleet import (
    EngineProcess,
    FleetOptions,
    RouterProcess,
    engine_process,
    shared_tier,
)
from kvtier.bench.lib.serve_metrics import run_metrics, scrape
from kvtier.bench.lib.serve_stats import percentile
from kvtier.bench.lib.serve_workloads import TextMaker, poisson_arrivals


@dataclass(frozen=True)
class WarmLoad:
    """Hot documents, the priming and the measured window (the reasons: module docstring)."""

    documents: int = 8
    document_tokens: int = 3000
    question_tokens: int = 24
    answer_tokens: int = 16
    prime_rounds: int = 3  # every document is asked this many times while priming
    prime_concurrency: int = 2  # priming's requests in flight (a closed loop; not measured)
    qps: float | None = None  # the window's arrivals; None: load x the measured capacity
    load: float = 0.5  # share of the fleet engine's measured capacity the window offers
    capacity_requests: int = 12
    capacity_concurrency: int = 4
    window_s: float = 60.0
    kv_tokens: int = 64_000  # G1 per engine
    max_model_len: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.documents < 1 or self.prime_rounds < 2:
            raise ValueError("at least one document, primed at least twice (a hit counts)")
        if self.prime_concurrency < 1:
            raise ValueError(f"priming needs a concurrency >= 1, got {self.prime_concurrency}")
        if self.qps is not None and self.qps <= 0:
            raise ValueError("arrival rates must be positive")
        if not 0 < self.load <= 1:
            raise ValueError(f"load must be in (0, 1], got {self.load}")
        if self.capacity_requests < 1 or self.capacity_concurrency < 1:
            raise ValueError("the capacity measurement needs a request and a concurrency >= 1")
        if self.document_tokens + self.question_tokens + self.answer_tokens + 64 > (
            self.max_model_len
        ):
            raise ValueError(f"a {self.document_tokens}-token document needs a larger "
                             f"max_model_len than {self.max_model_len}")  # fmt: skip


def _prime_order(load: WarmLoad, rng: random.Random) -> list[int]:
    """Every document ``prime_rounds`` times, in rounds of all documents (each shuffled): each
    is hot, none by chance alone, and no document is asked again before all were asked once
    (two requests for a document nobody has computed yet would both compute it)."""
    order: list[int] = []
    for _ in range(load.prime_rounds):
        round_ = list(range(load.documents))
        rng.shuffle(round_)
        if order and len(round_) > 1 and round_[0] == order[-1]:
            round_[0], round_[-1] = round_[-1], round_[0]
        order += round_
    return order


def _questions(
    maker: TextMaker, docs: list[str], n: int, tokens: int, rng: random.Random,
    order: list[int] | None = None,
) -> tuple[list[list[dict[str, str]]], list[int]]:  # fmt: skip
    """``n`` questions, each on a document (``order``, else a random one); and which."""
    out, which = [], []
    for i in range(n):
        d = order[i] if order is not None else rng.randrange(len(docs))
        question = maker.text(tokens, rng)
        out.append([{"role": "system", "content": docs[d]}, {"role": "user", "content": question}])
        which.append(d)
    return out, which


def _per_request(
    streams: list[Stream], which: list[int], at: list[float], joiner: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each request the joiner answered (arrival, document, TTFT, first for its document) and
    the TTFT of first requests against the others."""
    seen: set[int] = set()
    rows = []
    for s, d, t in zip(streams, which, at, strict=False):
        if s.engine != joiner or s.ttft_s is None:
            continue
        rows.append({"at_s": round(t, 3), "document": d, "ttft_s": round(s.ttft_s, 4),
                     "first_for_document": d not in seen})  # fmt: skip
        seen.add(d)
    first = [r["ttft_s"] for r in rows if r["first_for_document"]]
    rest = [r["ttft_s"] for r in rows if not r["first_for_document"]]
    split = {
        "first_for_document": {"requests": len(first), "ttft_p50_s": percentile(first, 50),
                               "ttft_max_s": max(first, default=None)},
        "later": {"requests": len(rest), "ttft_p50_s": percentile(rest, 50),
                  "ttft_p99_s": percentile(rest, 99)},
    }  # fmt: skip
    return rows, split


async def _send_all(
    url: str,
    messages: list[list[dict[str, str]]],
    arrivals: list[float],
    max_tokens: int,
    timeout_s: float,
) -> list[Stream]:
    streams = [Stream(i, m) for i, m in enumerate(messages)]
    t0 = time.perf_counter()
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:

        async def one(s: Stream, at: float) -> None:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            await stream_request(client, url, s, "smollm2", max_tokens)

        await asyncio.gather(*(one(s, at) for s, at in zip(streams, arrivals, strict=True)))
    return streams


def _connector_counts(samples: dict[Any, float]) -> dict[str, float]:
    """The joiner's connector lookups and loads by outcome (the bundled engine's /metrics)."""
    out = {}
    for (name, labels), value in samples.items():
        if name.startswith(("kvtier_lookups", "kvtier_load_tokens")) and not name.endswith(
            "_created"
        ):
            out[name + "{" + ",".join(f"{k}={v}" for k, v in labels) + "}"] = value
    return out


def _window_rate(
    url: str,
    maker: TextMaker,
    docs: list[str],
    load: WarmLoad,
    timeout_s: float,
    say: Callable[[str], None],
) -> tuple[float, dict[str, Any]]:
    """The window's arrival rate (module docstring: "The rate") and how it was found.

    Raises:
        RuntimeError: the capacity measurement failed.
    """
    if load.qps is not None:
        say(f"  window rate {load.qps:g} req/s (given: no capacity measurement)")
        return load.qps, {"source": "given", "qps": load.qps}
    rng = random.Random(f"{load.seed}:warm-capacity")
    msgs, _ = _questions(maker, docs, load.capacity_requests, load.question_tokens, rng)
    streams, elapsed_s = asyncio.run(
        send_closed_loop(url, msgs, concurrency=load.capacity_concurrency,
                         max_tokens=load.answer_tokens, timeout_s=timeout_s)
    )  # fmt: skip
    capacity = Capacity.of(streams, elapsed_s, load.capacity_concurrency)
    try:
        qps = sized_rate(capacity, load.load)
    except ValueError as e:
        raise RuntimeError(str(e)) from e
    c = capacity.to_json()
    say(f"  capacity of the primed fleet engine: {capacity.requests_per_s:.2f} req/s "
        f"({c['completed']} questions on the hot documents, {capacity.concurrency} at a time; "
        f"e2e p50 {c['e2e_p50_s']:.2f} s); window rate {load.load:g} x that = {qps:.2f} req/s, "
        "for both replicas")  # fmt: skip
    return qps, {"source": "measured", "qps": qps, "load": load.load, "capacity": c}


def _join(router_url: str, engine: EngineProcess, warm: bool, deadline_s: float) -> dict[str, Any]:
    """Adds the engine to the router; with ``warm``, waits until it takes traffic."""
    engine_url = engine.url
    body: dict[str, Any] = {"url": engine_url, "warm": warm}
    events = engine.info.get("kv_events_config")  # vLLM: its ZMQ KV events
    if events:
        body["vllm_kv_events"] = {"endpoint": events["endpoint"],
                                  "replay": events["replay_endpoint"]}  # fmt: skip
    r = httpx.post(router_url + "/engines", json=body, timeout=30.0, trust_env=False)
    if r.status_code != 201:
        raise RuntimeError(f"POST /engines answered {r.status_code}: {r.text[:300]}")
    t0 = time.monotonic()
    state: dict[str, Any] = {}
    while warm and time.monotonic() - t0 < deadline_s:
        snap = httpx.get(router_url + "/warm_start", timeout=30.0, trust_env=False).json()
        state = snap.get("engines", {}).get(engine_url, {})
        if state.get("state") not in (None, "waiting", "warming"):
            break
        time.sleep(0.5)
    state["wait_s"] = time.monotonic() - t0
    return state


def _wait_out(router_url: str, engine_url: str, timeout_s: float) -> None:
    """Waits until the router's health checks have taken ``engine_url`` out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = httpx.get(router_url + "/health", timeout=10.0, trust_env=False).json()
        if not health.get("engines", {}).get(engine_url, {}).get("healthy", False):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the router still routes to {engine_url} {timeout_s:g} s after it died")


def run_warm_start(
    opts: FleetOptions,
    workdir: Path,
    load: WarmLoad,
    count: Callable[[str], int],
    args: argparse.Namespace,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """Runs the phase; returns ``{"with": {...}, "without": {...}, ...}``."""
    workdir.mkdir(parents=True, exist_ok=True)
    opts = replace(opts, max_model_len=max(opts.max_model_len, load.max_model_len))
    maker = TextMaker(count)
    rng = random.Random(f"{load.seed}:warm-docs")
    docs = [maker.text(load.document_tokens, rng) for _ in range(load.documents)]
    out: dict[str, Any] = {}
    with ExitStack() as stack:
        config = stack.enter_context(shared_tier(workdir, capacity=4 << 30))
        fleet = stack.enter_context(
            engine_process(opts, workdir, "fleet0", load.kv_tokens, connector=config)
        )
        router = stack.enter_context(
            RouterProcess([(fleet, "both")], "cache_aware", workdir / "router.log")
        )
        order = _prime_order(load, rng)
        say(f"warm start: fleet engine up at {fleet.url}; priming {len(order)} requests "
            f"on {load.documents} documents of {load.document_tokens} tokens")  # fmt: skip
        prime, _ = _questions(maker, docs, len(order), load.question_tokens, rng, order)
        primed, prime_s = asyncio.run(
            send_closed_loop(router.url, prime, concurrency=load.prime_concurrency,
                             max_tokens=load.answer_tokens, timeout_s=args.request_timeout_s)
        )  # fmt: skip
        failed = [s.error for s in primed if s.error is not None]
        out["prime_errors"] = len(failed)
        out["prime_s"] = prime_s
        say(f"  primed in {prime_s:.0f} s ({load.prime_concurrency} at a time), "
            f"{len(failed)} failed" + (f" (first: {failed[0]})" if failed else ""))  # fmt: skip
        if len(failed) * 3 > len(primed):
            raise RuntimeError(f"priming failed: {len(failed)} of {len(primed)} requests "
                               f"(first: {failed[0]})")  # fmt: skip
        qps, out["rate"] = _window_rate(fleet.url, maker, docs, load, args.request_timeout_s, say)
        out["workload"] = {**vars(load), "qps": qps}
        previous = fleet
        for variant, warm in (("without", False), ("with", True)):
            joiner = stack.enter_context(
                engine_process(opts, workdir, f"joiner-{variant}", load.kv_tokens,
                               connector=config)
            )  # fmt: skip
            state = _join(router.url, joiner, warm, 120.0)
            say(f"  {variant} warm-up: {joiner.url} joined ({state.get('state', 'cold')})")
            # it replaces the engine before it (killed while idle), so it takes all the traffic
            previous.kill()
            _wait_out(router.url, previous.url, 30.0)
            n = max(1, round(qps * load.window_s))
            qrng = random.Random(f"{load.seed}:warm-{variant}")
            msgs, which = _questions(maker, docs, n, load.question_tokens, qrng)
            at = poisson_arrivals(qps, n, random.Random(f"{load.seed}:at-{variant}"))
            at = [t for t in at if t < load.window_s] or at[:1]
            streams = asyncio.run(
                _send_all(router.url, msgs[: len(at)], at, load.answer_tokens,
                          args.request_timeout_s)
            )  # fmt: skip
            mine = [s for s in streams if s.engine == joiner.url and s.ttft_s is not None]
            ttft = [s.ttft_s for s in mine if s.ttft_s is not None]
            rows, split = _per_request(streams, which, at, joiner.url)
            samples = scrape(joiner.url) or {}
            out[variant] = {
                "requests": len(mine),
                "ttft_s": ttft,  # in arrival order
                "per_request": rows,
                "by_first_for_document": split,
                "joiner_counters": run_metrics(samples),  # since it started
                "joiner_connector": _connector_counts(samples),
                "errors": sum(1 for s in streams if s.error is not None),
                "first_errors": [s.error for s in streams if s.error is not None][:3],
                "sent": len(streams),
                "ttft_p50_s": percentile(ttft, 50),
                "ttft_p99_s": percentile(ttft, 99),
                "ttft_first_s": mine[0].ttft_s if mine else None,
                "warm_up": state,
                "engine": joiner.info,
            }
            previous = joiner
    return out
