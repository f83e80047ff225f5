"""How far a correct block is from its recomputation: the margin of sampled verification.

    python -m bench.verify_drift --quick    # 2 chunks of 128 (about a minute on 2 cores)
    python -m bench.verify_drift            # 4 chunks of 256, every split point
    python -m bench.verify_drift --cost     # also what verification costs (below)

For each stored encoding (raw, int8, fp8_e4m3) an engine (its own prefix
cache off) computes a prompt and saves its chunks in that encoding. Then,
for each split point s, the prompt runs again with chunk s sampled for
verification: the engine loads chunks ``0..s-1`` (decoded, dequantized),
computes the rest, and the connector's verifier compares every recomputed
chunk with its stored block (:func:`kvtier.connectors.verify.compare_chunk`:
the worst (layer, K/V) plane's relative RMS error, against the encoding's
tolerance). ``margin`` = tolerance / worst error ("exact": bit-exact).

**Cost** (``--cost``, raw encoding): a request whose load stops at chunk j
computes the chunks from j on. Its time to first token ``T_j`` is measured
for every j (and ``T_none``, the whole prefix loaded; ``T_cold``, nothing
stored), median of ``--repeat`` runs; with each object sampled with
probability f the first sampled one is j with probability f(1-f)^j, so the
expected extra time per request is ``sum_j f(1-f)^j (T_j - T_none)``,
reported for f = 0.01 (the default on shared tiers) and 0.05 as a share of
``T_none``. The verifier's own work per chunk (decode the stored block,
compare every plane; on its own thread, off the request's path) is timed
separately.

A table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.lib.common import machine, table
from kvtier.block import decode_block
from kvtier.config import KvtierConfig
from kvtier.connectors.kvtier_connector import KvtierConnector
from kvtier.connectors.verify import compare_chunk
from kvtier.engine import LLM, SamplingParams
from kvtier.keys import PrefixKeys
from kvtier.store import TieredStore
from kvtier.tiers.cpu import CpuTier

DEFAULT_MODEL = Path("~/.cache/kvtier/models/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser()
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def measure(
    model: str, dtype: str, encoding: str, chunk: int, chunks: int, splits: list[int], seed: int
) -> list[dict[str, Any]]:
    """The verifier's verdict on each recomputed chunk, per split point."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(100, 20000, (chunks * chunk + 5,), generator=g).tolist()
    store = TieredStore([CpuTier(4 << 30)])
    cfg = KvtierConfig(chunk_size=chunk, block={"encoding": encoding})
    target: list[bytes | None] = [None]  # the one key sampled by the next request
    conn = KvtierConnector(config=cfg, store=store, verify_sampler=lambda key: key == target[0])
    # G1 off: every run of the prompt looks its chunks up in kvtier
    llm = LLM(
        model,
        dtype=dtype,
        device="cpu",
        block_size=16,
        enable_prefix_caching=False,
        connector=conn,
    )
    llm.generate([prompt], ONE)  # nothing stored yet: computes and saves every chunk
    conn.flush()
    assert conn.namespace is not None and conn.verifier is not None
    keys = PrefixKeys(conn.namespace, cfg.page_tokens)
    keys.extend(prompt)
    chunk_keys = [keys.key((c + 1) * chunk) for c in range(chunks)]
    rows = []
    for split in splits:
        target[0] = chunk_keys[split]
        seen = len(conn.verifier.recent)
        out = llm.generate([prompt], ONE)[0]
        conn.flush()
        for key, v in list(conn.verifier.recent)[seen:]:
            rows.append(
                {
                    "encoding": encoding,
                    "loaded_chunks": split,
                    "loaded_tokens": out.num_external_tokens,
                    "chunk": chunk_keys.index(key) if key in chunk_keys else "tail",
                    "error": v.error,
                    "layer": v.layer,
                    "kv": "KV"[v.kv] if v.kv >= 0 else "",
                    "tolerance": v.tolerance,
                    "ok": v.ok,
                }
            )
    llm.engine.shutdown()
    store.close()
    return rows


def _median_s(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_cost(
    model: str, dtype: str, chunk: int, chunks: int, seed: int, repeat: int
) -> dict[str, Any]:
    """TTFT with the load stopped at each chunk, the expected cost per fraction, compare time."""
    g = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(100, 20000, (chunks * chunk + 5,), generator=g).tolist()
    store = TieredStore([CpuTier(4 << 30)])
    cfg = KvtierConfig(chunk_size=chunk)
    target: list[bytes | None] = [None]
    conn = KvtierConnector(config=cfg, store=store, verify_sampler=lambda key: key == target[0])
    llm = LLM(
        model, dtype=dtype, device="cpu", block_size=16, enable_prefix_caching=False, connector=conn
    )

    def run() -> None:
        llm.generate([prompt], ONE)
        conn.flush()

    run()  # stores every chunk (and warms up)
    assert conn.namespace is not None and conn.verifier is not None and conn.worker.spec is not None
    keys = PrefixKeys(conn.namespace, cfg.page_tokens)
    keys.extend(prompt)
    chunk_keys = [keys.key((c + 1) * chunk) for c in range(chunks)]
    t_none = _median_s(run, repeat)
    t_stop = []
    for key in chunk_keys:
        target[0] = key
        t_stop.append(_median_s(run, repeat))
        target[0] = None
    cold = LLM(model, dtype=dtype, device="cpu", block_size=16, enable_prefix_caching=False)
    t_cold = _median_s(lambda: cold.generate([prompt], ONE), repeat)
    cold.engine.shutdown()
    # the verifier's own work on one chunk: decode the stored block and compare every plane
    block = store.get([chunk_keys[0]])[0]
    assert block is not None
    computed = decode_block(block).payload.clone()
    t_compare = _median_s(
        lambda: compare_chunk(computed, block, chunk_keys[0], conn.worker.spec), 10
    )
    llm.engine.shutdown()
    store.close()
    expected = {}
    for f in (0.01, 0.05):
        extra = sum(f * (1 - f) ** j * (t - t_none) for j, t in enumerate(t_stop))
        expected[str(f)] = {"extra_ms": extra * 1000, "share_of_loaded_ttft": extra / t_none}
    return {
        "prompt_tokens": len(prompt),
        "ttft_all_loaded_ms": t_none * 1000,
        "ttft_stopped_at_chunk_ms": [t * 1000 for t in t_stop],
        "ttft_cold_ms": t_cold * 1000,
        "expected_per_request": expected,
        "compare_ms_per_chunk": t_compare * 1000,
        "chunk_bytes": len(block),
        "repeat": repeat,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true", help="2 chunks of 128, one split")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--cost", action="store_true", help="also measure what verification costs")
    ap.add_argument("--repeat", type=int, default=3, help="--cost: runs per time (median)")
    args = ap.parse_args()
    chunk, chunks = (128, 2) if args.quick else (256, 4)
    splits = [1] if args.quick else list(range(1, chunks))
    rows: list[dict[str, Any]] = []
    for encoding in ("raw", "int8", "fp8_e4m3"):
        rows += measure(args.model, args.dtype, encoding, chunk, chunks, splits, args.seed)
    print(f"model {args.model} ({args.dtype}), chunk {chunk}, {chunks} chunks + 5 tokens")
    print(
        table(
            ["encoding", "loaded", "chunk", "worst error", "at", "tolerance", "ok"],
            [
                [
                    r["encoding"],
                    r["loaded_chunks"],
                    r["chunk"],
                    r["error"],
                    f"layer {r['layer']} {r['kv']}" if r["layer"] >= 0 else "-",
                    r["tolerance"],
                    r["ok"],
                ]
                for r in rows
            ],
        )
    )
    summary = {}
    for encoding in ("raw", "int8", "fp8_e4m3"):
        mine = [r for r in rows if r["encoding"] == encoding]
        worst = max(r["error"] for r in mine)
        summary[encoding] = {
            "worst_error": worst,
            "tolerance": mine[0]["tolerance"],
            "margin": (mine[0]["tolerance"] / worst) if worst > 0 else None,  # None: bit-exact
            "all_ok": all(r["ok"] for r in mine),
        }
    print()
    print(
        table(
            ["encoding", "worst error", "tolerance", "margin"],
            [
                [
                    e,
                    s["worst_error"],
                    s["tolerance"],
                    "exact" if s["margin"] is None else s["margin"],
                ]
                for e, s in summary.items()
            ],
        )
    )
    cost = None
    if args.cost:
        cost = measure_cost(args.model, args.dtype, chunk, chunks, args.seed, args.repeat)
        print()
        print(
            table(
                ["load stops at", "TTFT ms"],
                [
                    ["(nothing stored: cold)", cost["ttft_cold_ms"]],
                    *[[f"chunk {j}", t] for j, t in enumerate(cost["ttft_stopped_at_chunk_ms"])],
                    ["(all loaded)", cost["ttft_all_loaded_ms"]],
                ],
            )
        )
        print(
            table(
                ["verify_fraction", "expected extra ms / request", "share of loaded TTFT"],
                [
                    [f, e["extra_ms"], e["share_of_loaded_ttft"]]
                    for f, e in cost["expected_per_request"].items()
                ],
            )
        )
        print(
            f"verifier: {cost['compare_ms_per_chunk']:.2f} ms per chunk of {cost['chunk_bytes']} B"
        )
    print(
        json.dumps(
            {
                "model": args.model,
                "dtype": args.dtype,
                "chunk": chunk,
                "chunks": chunks,
                "summary": summary,
                "cost": cost,
                "rows": rows,
                "machine": machine(),
            },
            default=str,
        )
    )


if __name__ == "__main__":
    main()
