"""The bundled engine beside transformers (same weights, dtype, threads, SDPA attention).

    python -m bench.engine --quick                 # SmolLM2 GGUF, under a minute
    python -m bench.engine --model PATH --dtype float32 --threads 1

Figures:

* ``prefill N``: tokens per second to the first token of a fresh N-token
  prompt. Ours: a request with ``max_tokens=1`` through the engine (chunked
  at ``max_num_batched_tokens``, default 2048). transformers: one forward pass
  with ``logits_to_keep=1`` under ``inference_mode``. Full runs add
  ``prefill 4096 (1 step)``: the same with a 4,096-token step budget.
* ``decode bB``: generated tokens per second of B concurrent 128-token
  prompts, decode steps only (after every prompt produced its first token).
  transformers: greedy loop over its own ``DynamicCache``, batch B (equal
  lengths, no padding), argmax on the last logits — no ``generate()``
  overhead, so the baseline is the strongest transformers offers.
* ``ttft 2048 cold/warm``: time to first token of a 2,048-token prompt, then of
  the same prompt again (served from the engine's own prefix cache, G1).

Each figure is the best of ``--repeat`` runs (noise on a shared host only
ever slows a run down). A table is printed, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.lib.common import emit, machine, table
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.models.hf_export import to_transformers

DEFAULT_MODEL = (
    Path(os.environ.get("KVTIER_MODEL_DIR") or "~/.cache/kvtier/models").expanduser()
    / "SmolLM2-135M-Instruct.Q4_1.gguf"
)


class Bench:
    """Runs the figures for one model; each method times one run and returns seconds."""

    def __init__(self, llm: LLM, hf: Any, clock: Callable[[], float]) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.hf = hf
        self.clock = clock
        self.gen = torch.Generator().manual_seed(0)
        self.vocab = self.engine.model_config.vocab_size

    def prompt(self, n: int) -> list[int]:
        """A fresh random prompt (never a prefix-cache hit)."""
        return torch.randint(100, self.vocab - 100, (n,), generator=self.gen).tolist()

    def ours_prefill(self, n: int) -> float:
        p = self.prompt(n)
        t = self.clock()
        self.llm.generate(p, SamplingParams(temperature=0.0, max_tokens=1))
        return self.clock() - t

    @torch.inference_mode()
    def hf_prefill(self, n: int) -> float:
        ids = torch.tensor([self.prompt(n)])
        t = self.clock()
        self.hf(input_ids=ids, logits_to_keep=1, use_cache=True).logits.argmax(-1)
        return self.clock() - t

    def ours_decode(self, batch: int, steps: int) -> float:
        """Seconds per generated token."""
        e = self.engine
        params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
        for _ in range(batch):
            e.add_request(self.prompt(128), params)
        while e.stats().num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in e.scheduler.running
        ):
            e.step()
        t = self.clock()
        n = 0
        while e.has_unfinished():
            n += sum(len(o.delta_token_ids) for o in e.step())
        return (self.clock() - t) / n

    @torch.inference_mode()
    def hf_decode(self, batch: int, steps: int) -> float:
        """Seconds per generated token."""
        ids = torch.tensor([self.prompt(128) for _ in range(batch)])
        out = self.hf(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache = out.cache
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        t = self.clock()
        for _ in range(steps):
            out = self.hf(input_ids=nxt, cache=cache, use_cache=True)
            cache = out.cache
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        return (self.clock() - t) / (steps * batch)

    def ttft(self, n: int) -> tuple[float, float]:
        """(cold, warm) seconds to the first token of the same n-token prompt."""
        p = self.prompt(n)
        params = SamplingParams(temperature=0.0, max_tokens=1)
        t = self.clock()
        self.llm.generate(p, params)
        cold = self.clock() - t
        t = self.clock()
        warm_out = self.llm.generate(p, params)[0]
        warm = self.clock() - t
        assert warm_out.num_cached_tokens > 0
        return cold, warm


def best_of(
    repeat: int, ours: Callable[[], float], ref: Callable[[], float]
) -> tuple[float, float]:
    """Best (smallest) seconds of each, runs interleaved so drift hits both alike."""
    a, b = float("inf"), float("inf")
    for _ in range(repeat):
        a = min(a, ours())
        b = min(b, ref())
    return a, b


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats (< 1 minute)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: perf_counter; cpu: this thread's CPU time (only meaningful with --threads 1, "
        "robust to other jobs on a shared host)",
    )
    args = ap.parse_args()
    if not args.model.exists():
        raise SystemExit(f"model not found: {args.model} (run: kvtier model fetch smollm2)")

    t0 = time.perf_counter()
    llm = LLM(
        str(args.model),
        dtype=args.dtype,
        device="cpu",
        num_threads=args.threads,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory="1GiB",
    )
    load_s = time.perf_counter() - t0
    hf = to_transformers(llm.engine.runner.model)
    repeat = args.repeat or (2 if args.quick else 3)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        raise SystemExit("--clock cpu needs --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    b = Bench(llm, hf, clock)
    prefill_sizes = [512, 2048, 4096]
    decode_steps = 16 if args.quick else 64

    # warm up both (first calls pay for oneDNN primitive creation)
    b.llm.generate(b.prompt(64), SamplingParams(temperature=0.0, max_tokens=2))
    with torch.inference_mode():
        hf(input_ids=torch.tensor([b.prompt(64)]), logits_to_keep=1)

    rows: list[list[Any]] = []
    summary: dict[str, Any] = {
        "bench": "engine",
        "model": llm.engine.model_id,
        "dtype": str(llm.engine.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "repeat": repeat,
        "load_s": round(load_s, 2),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "machine": machine(),
    }
    for n in prefill_sizes:
        t_ours, t_ref = best_of(repeat, lambda n=n: b.ours_prefill(n), lambda n=n: b.hf_prefill(n))
        ours, ref = n / t_ours, n / t_ref
        rows.append([f"prefill {n}", "tok/s", ours, ref, ours / ref])
        summary[f"prefill_{n}_tok_s"] = round(ours, 1)
        summary[f"prefill_{n}_hf_tok_s"] = round(ref, 1)
        summary[f"prefill_{n}_ratio"] = round(ours / ref, 3)
    if not args.quick and args.max_num_batched_tokens < 4096:
        # the same 4,096-token prefill as one engine step (a larger step budget)
        sched = llm.engine.scheduler
        sched.max_num_batched_tokens = 4096
        try:
            t_ours, t_ref = best_of(
                repeat, lambda: b.ours_prefill(4096), lambda: b.hf_prefill(4096)
            )
        finally:
            sched.max_num_batched_tokens = args.max_num_batched_tokens
        ours, ref = 4096 / t_ours, 4096 / t_ref
        rows.append(["prefill 4096 (1 step)", "tok/s", ours, ref, ours / ref])
        summary["prefill_4096_one_step_tok_s"] = round(ours, 1)
        summary["prefill_4096_one_step_hf_tok_s"] = round(ref, 1)
        summary["prefill_4096_one_step_ratio"] = round(ours / ref, 3)
    for batch in (1, 8):
        t_ours, t_ref = best_of(
            repeat,
            lambda batch=batch: b.ours_decode(batch, decode_steps),
            lambda batch=batch: b.hf_decode(batch, decode_steps),
        )
        ours, ref = 1 / t_ours, 1 / t_ref
        rows.append([f"decode b{batch}", "tok/s", ours, ref, ours / ref])
        summary[f"decode_b{batch}_tok_s"] = round(ours, 1)
        summary[f"decode_b{batch}_hf_tok_s"] = round(ref, 1)
        summary[f"decode_b{batch}_ratio"] = round(ours / ref, 3)
    cold, warm = b.ttft(2048)
    rows.append(["ttft 2048 cold", "s", cold, "", ""])
    rows.append(["ttft 2048 warm (G1)", "s", warm, "", cold / warm])
    summary["ttft_2048_cold_s"] = round(cold, 4)
    summary["ttft_2048_warm_s"] = round(warm, 4)
    summary["ttft_2048_speedup"] = round(cold / warm, 2)

    print(
        f"model {llm.engine.model_id}  dtype {summary['dtype']}  threads {summary['threads']}  "
        f"clock {args.clock}  repeat {repeat}  load {load_s:.1f}s  "
        f"loadavg {summary['loadavg_1m']}"
    )
    print(table(["figure", "unit", "kvtier", "transformers", "ratio"], rows))
    emit(summary)


if __name__ == "__main__":
    main()
