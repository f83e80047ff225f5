"""The engine's serving costs in CPU seconds, for this checkout or another one (before/after).

    python -m bench.engine_probes --dtype float32
    git worktree add /tmp/kv-before 5d2cc36
    python -m bench.engine_probes --dtype float32 --checkout /tmp/kv-before

Probes on SmolLM2-135M, ``LLMEngine.step()`` timed with
``time.process_time()`` on one thread (steady while other jobs share the
host), each the minimum of ``--repeat`` runs:

* ``cold_prefill_s``: a fresh 2,000-token prompt, ``max_tokens=1``;
* ``prefill_after_prefix_s``: 1,000 new tokens after a 1,000-token prefix
  held in the engine's prefix cache;
* ``decode_b1_s`` / ``decode_b6_s``: the median decode step of 1 / 6
  requests with 1,000-token contexts;
* ``decode_b6_with_chunk_s``: the step in which a fresh 1,000-token prompt
  is prefilled beside those 6 decodes.

``--checkout DIR`` imports ``kvtier`` from another checkout of this
repository (for example a ``git worktree`` of an older commit): the
package's folders are linked into a temporary directory in the layout
``setup.py`` maps them to, and the editable install's finder is set aside.
A table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOTS = {"engine", "kernels", "connectors", "server", "router"}  # kvtier.<name> -> <name>/


def import_from(checkout: Path) -> None:
    """Makes ``import kvtier`` load ``checkout``'s sources (see the module docstring)."""
    farm = Path(tempfile.mkdtemp(prefix="kvtier-checkout-")) / "kvtier"
    farm.mkdir()
    for item in (checkout / "kvtier").iterdir():
        (farm / item.name).symlink_to(item)
    for name in ROOTS:
        if (checkout / name).is_dir():
            (farm / name).symlink_to(checkout / name)
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, str(farm.parent))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    ap.add_argument("--checkout", type=Path, default=None, help="another checkout's sources")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args(argv)
    if args.checkout is not None:
        import_from(args.checkout.resolve())
    from kvtier.bench.lib.common import emit, machine, table
    from kvtier.bench.lib.serve_calibrate import cpu_flags
    from kvtier.bench.lib.serve_workloads import TextMaker
    from kvtier.engine import SamplingParams
    from kvtier.engine.config import EngineConfig
    from kvtier.engine.llm_engine import LLMEngine

    source = os.path.dirname(sys.modules["kvtier.engine"].__file__ or "")
    config = EngineConfig(
        model="smollm2",
        dtype=args.dtype,
        kv_cache_memory=2 << 30,
        max_model_len=4096,
        num_threads=1,
    )
    eng = LLMEngine(config)
    tok = eng.tokenizer
    maker = TextMaker(lambda t: len(tok.encode(t, add_special_tokens=False)))
    salt = [0]

    def text(n: int) -> str:
        salt[0] += 1
        return maker.text(n, random.Random(f"probe-{salt[0]}"))

    one = SamplingParams(temperature=0, max_tokens=1)

    def prefill(prompt: str) -> float:
        eng.add_request(prompt, one)
        c = time.process_time()
        while eng.has_unfinished():
            eng.step()
        return time.process_time() - c

    def decode(batch: int, chunk: int = 0) -> float:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for _ in range(batch):
            eng.add_request(text(1000), params)
        started: set[str] = set()
        while len(started) < batch:
            started.update(o.request_id for o in eng.step())
        if chunk:
            eng.add_request(text(chunk), one)
            c = time.process_time()
            eng.step()
            spent = time.process_time() - c
            while eng.has_unfinished():
                eng.step()
            return spent
        steps = []
        while eng.has_unfinished():
            c = time.process_time()
            eng.step()
            steps.append(time.process_time() - c)
        return statistics.median(steps)

    prefill(text(300))  # warm-up
    prefix = text(1000)
    prefill(prefix)
    r = args.repeat
    res: dict[str, Any] = {
        "cold_prefill_s": min(prefill(text(2000)) for _ in range(r)),
        "prefill_after_prefix_s": min(prefill(prefix + " " + text(1000)) for _ in range(r)),
        "decode_b1_s": min(decode(1) for _ in range(r)),
        "decode_b6_s": min(decode(6) for _ in range(r)),
        "decode_b6_with_chunk_s": min(decode(6, 1000) for _ in range(r)),
    }
    cpu = cpu_flags()
    print(f"sources {source}; {args.dtype}, one thread, CPU seconds; host {cpu['model']}")
    print(table(["figure", "s"], [[k, v] for k, v in res.items()]))
    emit(
        {
            "bench": "engine_probes",
            "dtype": args.dtype,
            "sources": source,
            **res,
            "machine": {**machine(), "cpu": cpu},
        }
    )


if __name__ == "__main__":
    main()
