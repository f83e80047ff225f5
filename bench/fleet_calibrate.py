"""Calibrate the fleet simulation's step-cost model on the bundled engine (SmolLM2-135M).

    python -m bench.fleet_calibrate --threads 1 --clock cpu     # ~1 min on a 2-core CPU
    python -m bench.fleet_sim --calibration <(python -m bench.fleet_calibrate | tail -1)

Times single engine steps of known shape and fits, by least squares,

    step_s = base + a·prefill_tokens + b·attention_pairs + s·decode_seqs + c·decode_context_tokens

(``bench/fleet/costs.py``) where ``attention_pairs`` of a prefill chunk of ``n`` tokens after ``p`` computed
ones is ``n·p + n·(n+1)/2`` (each new token attends to everything before it).
Shapes: fresh prompts of 256 / 1,024 / 2,048 tokens (one step each), a
3,072-token prompt (its second step is a 1,024-token chunk after 2,048), and
decode-only steps at batch 1 / 8 with 128-token contexts and batch 1 / 6 with
~2,048-token contexts (the long contexts share a G1-cached prefix, so setting
them up costs one prefill). Each prefill shape is the best of two fresh
prompts; each decode shape the median of its steps.

The ``cpu-smollm2`` profile of ``bench/fleet/costs.py`` takes its per-context
decode term from one run of this script (docs/fleet.md); its JSON line, given to
``bench/fleet_sim.py --calibration``, replaces a profile's engine constants.
A table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.fleet.costs import StepCosts, StepFigure, chunk_pairs, fit_step_costs
from kvtier.bench.lib.common import emit, machine, table
from kvtier.connectors.demo import default_model_path
from kvtier.engine import LLMEngine, SamplingParams
from kvtier.engine.config import EngineConfig

SOURCE = "bench/fleet_calibrate.py"


class Probe:
    """Drives one engine step by step and times steps of chosen shapes."""

    def __init__(self, engine: LLMEngine, clock: Callable[[], float]) -> None:
        self.engine = engine
        self.clock = clock
        self.gen = torch.Generator().manual_seed(0)
        self.vocab = engine.model_config.vocab_size

    def tokens(self, n: int) -> list[int]:
        return torch.randint(100, self.vocab - 100, (n,), generator=self.gen).tolist()

    def timed_step(self) -> float:
        t = self.clock()
        self.engine.step()
        return self.clock() - t

    def prefill(self, n: int, repeat: int = 2) -> list[StepFigure]:
        """One sample per step of an ``n``-token prompt (chunked at the step budget)."""
        budget = self.engine.config.max_num_batched_tokens
        best: list[float] | None = None
        for _ in range(repeat):
            self.engine.add_request(self.tokens(n), SamplingParams(temperature=0.0, max_tokens=1))
            times = []
            while self.engine.has_unfinished():
                times.append(self.timed_step())
            best = times if best is None else [min(a, b) for a, b in zip(best, times, strict=True)]
        assert best is not None
        out = []
        for i, t in enumerate(best):
            start, size = i * budget, min(budget, n - i * budget)
            label = f"prefill {n}" + (f" (chunk {i + 1})" if len(best) > 1 else "")
            out.append(StepFigure(label, SOURCE, size, chunk_pairs(start, size), 0, 0, t))
        return out

    def decode(self, batch: int, context: int, steps: int) -> StepFigure:
        """Median decode-only step of ``batch`` sequences of ~``context`` tokens each."""
        shared = self.tokens(max(0, context - 16))
        params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
        e = self.engine
        for _ in range(batch):
            e.add_request(shared + self.tokens(context - len(shared)), params)
        while e.stats().num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in e.scheduler.running
        ):
            e.step()
        times, ctx = [], []
        while e.has_unfinished():
            ctx.append(sum(r.num_tokens for r in e.scheduler.running))
            times.append(self.timed_step())
        mid = len(times) // 2
        return StepFigure(
            f"decode b{batch} ctx {context}",
            SOURCE,
            0,
            0,
            batch,
            ctx[mid],
            statistics.median(times[:-1]),  # the last step finishes every request
        )


def cpu_model() -> str:
    """The CPU's model name (the step costs depend on it: AMX or not, for bf16 matmuls)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def predict(costs: StepCosts, f: StepFigure) -> float:
    """Seconds the fitted model gives a figure's shape."""
    return costs.step_s(f.prefill_tokens, f.pairs, f.decode_seqs, f.decode_ctx)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per decode shape")
    args = ap.parse_args()
    model = args.model or str(default_model_path())
    if not Path(model).exists():
        raise SystemExit(f"{model} not found: run `kvtier model fetch smollm2` first")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    engine = LLMEngine(EngineConfig(model=model, num_threads=args.threads))
    probe = Probe(engine, clock)
    probe.prefill(64, repeat=1)  # warm-up (and the C decode kernel's build)
    probe.decode(2, 64, 2)

    samples: list[StepFigure] = []
    for n in (256, 1024, 2048, 3072):
        samples += probe.prefill(n)
    for batch, context in ((1, 128), (8, 128), (1, 2048), (6, 2048)):
        samples.append(probe.decode(batch, context, args.steps))
    costs = fit_step_costs(samples)
    decode_only = fit_step_costs([f for f in samples if f.decode_seqs])
    layout = engine.layout
    kv_bytes_per_token = (
        engine.kv_cache.element_size()
        * 2
        * layout.num_layers
        * layout.num_kv_heads
        * layout.head_dim
    )
    engine.shutdown()

    rows = [
        [
            f.label,
            f.prefill_tokens,
            f.pairs,
            f.decode_seqs,
            f.decode_ctx,
            f.seconds * 1e3,
            predict(costs, f) * 1e3,
        ]
        for f in samples
    ]
    print((__doc__ or "").split("\n")[0])
    print(f"clock {args.clock}, threads {args.threads or 'default'}, CPU {cpu_model()}")
    print(table(["shape", "prefill tok", "pairs", "decodes", "ctx", "ms", "fit ms"], rows))
    print("\nfit (all rows): " + ", ".join(f"{k} = {v:.4g}" for k, v in asdict(costs).items()))
    print(
        "fit (decode rows): " + ", ".join(f"{k} = {v:.4g}" for k, v in asdict(decode_only).items())
    )
    print(f"KV {kv_bytes_per_token} bytes/token, G1 {layout.num_blocks * layout.block_size} tokens")
    summary: dict[str, Any] = {
        "bench": "fleet_calibrate",
        "clock": args.clock,
        "threads": args.threads,
        "model": Path(model).name,
        "machine": {**machine(), "cpu_model": cpu_model()},
        "samples": [asdict(s) for s in samples],
        "fit": asdict(costs),
        "fit_decode_rows": asdict(decode_only),
        "kv_bytes_per_token": kv_bytes_per_token,
        "g1_capacity_tokens": layout.num_blocks * layout.block_size,
    }
    emit(summary)


if __name__ == "__main__":
    main()
