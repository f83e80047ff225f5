"""``kvtier demo``: a realistic KV workload through the CPU and disk tiers.

Requests share long document prefixes, as RAG and chat traffic do. Each
request looks up its chunks, loads the hits (get + verify + decode), "computes"
the misses (activation-like KV, deterministic per chunk so loads can be
checked bit for bit) and saves them. The store is then closed and reopened on
the same directory to show the disk tier surviving a restart.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from kvtier.block import BlockSpec, Compression, decode_block, encode_block
from kvtier.config import CpuTierConfig, DiskTierConfig, KvtierConfig, load_config
from kvtier.factory import build_store
from kvtier.keys import CacheNamespace, chunk_keys
from kvtier.metrics import StoreMetrics
from kvtier.store import TieredStore
from kvtier.units import format_bytes, parse_bytes

# SmolLM2-135M's KV layout: 30 layers, 3 KV heads of 64, bfloat16.
DEMO_NAMESPACE = CacheNamespace(
    model_id="SmolLM2-135M-Instruct (simulated KV)",
    weights_fingerprint="demo",
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
    kv_dtype="bfloat16",
)


@dataclass
class PhaseReport:
    """What one pass of the workload did."""

    name: str
    requests: int = 0
    chunks_requested: int = 0
    chunks_hit: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_seconds: float = 0.0
    tier_hits: dict[str, int] = field(default_factory=dict)
    wrong_blocks: int = 0
    elapsed: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.chunks_hit / self.chunks_requested if self.chunks_requested else 0.0


def _chunk_kv(key: bytes, ns: CacheNamespace, tokens: int) -> torch.Tensor:
    """Deterministic activation-like KV for one chunk (the "prefill" of the demo)."""
    from kvtier.block import activation_like_kv

    shape = (ns.num_layers, 2, tokens, ns.num_kv_heads, ns.head_dim)
    return activation_like_kv(
        shape, torch.bfloat16, seed=int.from_bytes(key[:8], "little") & 0x7FFFFFFF
    )


def _workload(num_requests: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    docs = [
        [rng.randrange(1, 49152) for _ in range(rng.choice((2048, 3072, 4096)))] for _ in range(6)
    ]
    weights = [1 / (i + 1) for i in range(len(docs))]  # Zipf-like popularity
    prompts = []
    for _ in range(num_requests):
        doc = rng.choices(docs, weights)[0]
        question = [rng.randrange(1, 49152) for _ in range(rng.randrange(16, 200))]
        prompts.append(doc + question)
    return prompts


def run_phase(
    name: str,
    store: TieredStore,
    prompts: list[list[int]],
    ns: CacheNamespace,
    compression: Compression,
) -> PhaseReport:
    """Serve each prompt: look up, load hits, compute and save misses."""
    report = PhaseReport(name)
    spec = BlockSpec(ns.num_layers, ns.num_kv_heads, ns.head_dim, torch.bfloat16)
    before = {
        t.name: store.metrics.value(
            "kvtier_tier_ops_total", {"tier": t.name, "op": "get", "outcome": "hit"}
        )
        for t in store.tiers
    }
    start = time.perf_counter()
    for tokens in prompts:
        keys = chunk_keys(tokens, ns)
        hit = store.lookup(keys)
        t0 = time.perf_counter()
        blocks = store.get_prefix(keys[:hit])
        decoded = [
            decode_block(block, key=k, expect=spec).payload
            for k, block in zip(keys, blocks, strict=False)
        ]
        report.load_seconds += time.perf_counter() - t0
        report.bytes_loaded += sum(len(b) for b in blocks)
        for key, payload in zip(keys, decoded, strict=False):
            if not torch.equal(payload, _chunk_kv(key, ns, ns.chunk_size)):
                report.wrong_blocks += 1
        loaded = len(blocks)
        new = [
            (k, encode_block(_chunk_kv(k, ns, ns.chunk_size), key=k, compression=compression))
            for k in keys[loaded:]
        ]
        store.put(new)
        report.bytes_saved += sum(len(b) for _, b in new)
        report.requests += 1
        report.chunks_requested += len(keys)
        report.chunks_hit += loaded
    store.flush(timeout=60)
    report.elapsed = time.perf_counter() - start
    for t in store.tiers:
        now = store.metrics.value(
            "kvtier_tier_ops_total", {"tier": t.name, "op": "get", "outcome": "hit"}
        )
        report.tier_hits[t.name] = int(now - before[t.name])
    return report


def _demo_config(config_path: str | None, tmp: str) -> KvtierConfig:
    if config_path is not None:
        return load_config(config_path)
    return load_config(
        env={},
        overrides={
            "tiers": [
                CpuTierConfig(capacity=parse_bytes("256MiB")).model_dump(),
                DiskTierConfig(path=f"{tmp}/blocks", capacity=parse_bytes("2GiB")).model_dump(),
            ]
        },
    )


def run_store_demo(
    *, config_path: str | None, num_requests: int, seed: int, echo: Callable[[str], None] = print
) -> list[PhaseReport]:
    """Run the demo and print its report; returns the per-phase figures."""
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        cfg = _demo_config(config_path, tmp)
        ns = replace(DEMO_NAMESPACE, chunk_size=cfg.chunk_size)
        compression = Compression.parse(cfg.block.compression)
        prompts = _workload(num_requests, seed)
        tiers = ", ".join(
            f"{t.name} ({t.type}, {format_bytes(getattr(t, 'capacity', 0))})" for t in cfg.tiers
        )
        echo(
            f"kvtier demo: {num_requests} requests sharing 6 documents of 2-4k tokens, chunk {cfg.chunk_size} tokens"
        )
        echo(
            f"KV layout {ns.num_layers} layers x {ns.num_kv_heads} KV heads x {ns.head_dim} bf16 "
            f"= {format_bytes(ns.num_layers * 2 * ns.num_kv_heads * ns.head_dim * 2 * cfg.chunk_size)} per chunk; tiers: {tiers}"
        )
        reports = []
        with build_store(cfg, StoreMetrics()) as store:
            reports.append(run_phase("first pass", store, prompts, ns, compression))
        # Restart: a new process would see exactly this — an empty CPU tier and the disk directory.
        with build_store(cfg, StoreMetrics()) as store:
            reports.append(
                run_phase(
                    "after restart", store, prompts[: max(1, num_requests // 2)], ns, compression
                )
            )
            usage = store.usage()
            store.check_integrity()
    _print_reports(reports, usage, echo)
    return reports


def _print_reports(reports: list[PhaseReport], usage: dict, echo: Callable[[str], None]) -> None:
    names = list(reports[0].tier_hits)
    head = f"{'phase':<14} {'requests':>8} {'chunks':>7} {'hit':>6} {'hit rate':>8} " + " ".join(
        f"{n + ' hits':>10}" for n in names
    )
    head += f" {'loaded':>10} {'saved':>10} {'load GB/s':>9} {'wrong':>5}"
    echo("")
    echo(head)
    echo("-" * len(head))
    for r in reports:
        gbps = r.bytes_loaded / r.load_seconds / 1e9 if r.load_seconds else 0.0
        row = f"{r.name:<14} {r.requests:>8} {r.chunks_requested:>7} {r.chunks_hit:>6} {r.hit_rate:>8.1%} "
        row += " ".join(f"{r.tier_hits.get(n, 0):>10}" for n in names)
        row += f" {format_bytes(r.bytes_loaded):>10} {format_bytes(r.bytes_saved):>10} {gbps:>9.2f} {r.wrong_blocks:>5}"
        echo(row)
    echo("")
    for name, u in usage.items():
        cap = format_bytes(u.capacity_bytes) if u.capacity_bytes else "?"
        echo(f"tier {name}: {u.num_blocks} blocks, {format_bytes(u.used_bytes)} of {cap}")
    wrong = sum(r.wrong_blocks for r in reports)
    echo(
        "every loaded block matched the KV that was saved"
        if wrong == 0
        else f"ERROR: {wrong} loaded blocks differed"
    )
