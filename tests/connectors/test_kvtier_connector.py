"""The kvtier connector inside the bundled engine, on a tiny random Llama.

KV saved by one engine is loaded by a fresh engine (empty G1 cache) and the
greedy tokens are exactly those of a cold run; every failure of the store —
blocks deleted, corrupted, a tier that hangs — still gives the cold tokens,
with the recomputation counted.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.config import CpuTierConfig, DiskTierConfig, KvtierConfig
from kvtier.connectors.kvtier_connector import KvtierConnector
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.kv_events import attach_recorder
from kvtier.keys import PrefixKeys
from kvtier.metrics import StoreMetrics
from kvtier.store import TieredStore
from kvtier.tiers.cpu import CpuTier
from tests.engine.tiny_models import write_tiny_model
from tests.kvtier.helpers import FlakyTier

CHUNK = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=11)
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    doc = torch.randint(3, 380, (100,), generator=g).tolist()
    return [
        doc + torch.randint(3, 380, (n,), generator=g).tolist()  # shared document, other questions
        for n in (7, 20, 33)
    ] + [torch.randint(3, 380, (70,), generator=g).tolist()]


@pytest.fixture(scope="module")
def cold(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = _llm(model_dir)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def _llm(model_dir: Path, connector: KvtierConnector | None = None) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=16,
        num_threads=2,
        connector=connector,
    )


def _config(
    tmp: Path, *, encoding: str = "raw", partial: bool = False, **connector: object
) -> KvtierConfig:
    return KvtierConfig(
        chunk_size=CHUNK,
        save_partial_chunks=partial,
        block={"encoding": encoding},
        tiers=[
            CpuTierConfig(capacity=64 << 20),
            DiskTierConfig(path=tmp / "blocks", capacity=256 << 20),
        ],
        connector={"min_load_tokens": 16, **connector},
    )


def _save(model_dir: Path, config: KvtierConfig, prompts: list[list[int]]) -> KvtierConnector:
    conn = KvtierConnector(config=config)
    llm = _llm(model_dir, conn)
    llm.generate(prompts, GREEDY)
    llm.engine.shutdown()  # flushes the saver and closes the store
    return conn


def test_fresh_engine_loads_and_matches_cold(
    model_dir: Path, prompts: list[list[int]], cold: list[list[int]], tmp_path: Path
) -> None:
    cfg = _config(tmp_path)
    saver = _save(model_dir, cfg, prompts)
    assert saver.save_stats.chunks_saved > 0

    conn = KvtierConnector(config=cfg)  # a new store over the same disk directory: empty CPU tier
    llm = _llm(model_dir, conn)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == cold
    for o, p in zip(outs, prompts, strict=True):
        # whole chunks came from kvtier (or, for a prompt admitted a step after another over
        # the same document — a lookup deferred on a busy host —, from this engine's own
        # G1), the rest was computed
        assert o.num_cached_tokens + o.num_external_tokens == (len(p) // CHUNK) * CHUNK
    assert outs[0].num_external_tokens == (len(prompts[0]) // CHUNK) * CHUNK
    assert conn.stats.load_failures == 0
    assert conn.metrics.value("kvtier_load_tokens_total", {"outcome": "loaded"}) == sum(
        o.num_external_tokens for o in outs
    )
    assert (
        conn.metrics.value("kvtier_tier_ops_total", {"tier": "disk", "op": "get", "outcome": "hit"})
        > 0
    )
    llm.engine.shutdown()


def test_whole_prompt_cached_loads_all_but_the_last_token(
    model_dir: Path, prompts: list[list[int]], cold: list[list[int]], tmp_path: Path
) -> None:
    cfg = _config(tmp_path, partial=True)
    _save(model_dir, cfg, prompts)
    conn = KvtierConnector(config=cfg)
    llm = _llm(model_dir, conn)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == cold
    assert [o.num_external_tokens for o in outs] == [len(p) - 1 for p in prompts]
    llm.engine.shutdown()


def test_in_process_cpu_tier_and_g1_together(
    model_dir: Path, prompts: list[list[int]], cold: list[list[int]]
) -> None:
    store = TieredStore([CpuTier(64 << 20)])
    cfg = KvtierConfig(chunk_size=CHUNK, connector={"min_load_tokens": 16})
    a = _llm(model_dir, KvtierConnector(config=cfg, store=store))
    a.generate(prompts[:1], GREEDY)
    a.engine.connector.flush()
    b = _llm(model_dir, KvtierConnector(config=cfg, store=store))
    outs = b.generate(prompts, GREEDY)  # 0 from kvtier; 1 and 2 share its document chunks
    assert [o.token_ids for o in outs] == cold
    assert outs[0].num_external_tokens > 0 and outs[1].num_external_tokens > 0
    # Within B, G1 now holds the document: a repeat needs no external load.
    again = b.generate(prompts[:1], GREEDY)[0]
    assert (
        again.token_ids == cold[0]
        and again.num_cached_tokens > 0
        and again.num_external_tokens == 0
    )


def _flip_every_block(root: Path) -> int:
    n = 0
    for f in root.rglob("*.kvb"):
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x40
        f.write_bytes(bytes(data))
        n += 1
    return n


@pytest.mark.parametrize("damage", ["deleted", "corrupted"])
def test_damaged_disk_tier_recomputes_correctly(
    damage: str, model_dir: Path, prompts: list[list[int]], cold: list[list[int]], tmp_path: Path
) -> None:
    cfg = _config(tmp_path)
    _save(model_dir, cfg, prompts)
    conn = KvtierConnector(config=cfg)  # indexes the directory at start ...
    if damage == "deleted":
        shutil.rmtree(tmp_path / "blocks" / "blocks")  # ... which then vanishes mid-run
    else:
        assert _flip_every_block(tmp_path / "blocks") > 0
    llm = _llm(model_dir, conn)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == cold
    assert all(o.num_external_tokens == 0 for o in outs)
    failed = conn.metrics.value("kvtier_load_tokens_total", {"outcome": "failed"})
    assert failed > 0 and conn.stats.load_failures > 0
    if damage == "corrupted":
        assert conn.metrics.value("kvtier_corrupt_blocks_total", {"tier": "disk"}) > 0
    # What could not be loaded was recomputed and saved again: the next engine loads it.
    assert conn.save_stats.chunks_saved > 0
    llm.engine.shutdown()
    again = _llm(model_dir, KvtierConnector(config=cfg))
    outs = again.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == cold
    assert all(o.num_external_tokens > 0 for o in outs)
    again.engine.shutdown()


def test_slow_tier_times_out_and_recomputes(
    model_dir: Path, prompts: list[list[int]], cold: list[list[int]]
) -> None:
    # Fill a fast store, then serve the same blocks from a tier that hangs longer than the timeout.
    fast = TieredStore([CpuTier(64 << 20)])
    cfg = KvtierConfig(chunk_size=CHUNK, connector={"min_load_tokens": 16, "load_timeout_s": 0.2})
    a = _llm(model_dir, KvtierConnector(config=cfg, store=fast))
    a.generate(prompts, GREEDY)
    a.engine.connector.flush()
    slow = FlakyTier("remote", delay=0.0)
    slow.data.update({k: b for k, b in fast.tiers[0].drain()})
    store = TieredStore([slow], metrics=StoreMetrics())
    conn = KvtierConnector(config=cfg, store=store)
    llm = _llm(model_dir, conn)
    slow.delay = 0.5  # lookups and gets now take 0.5 s each; the load deadline is 0.2 s
    t0 = time.perf_counter()
    outs = llm.generate(prompts[:1], GREEDY)
    assert [o.token_ids for o in outs] == cold[:1]
    assert outs[0].num_external_tokens == 0
    assert conn.stats.load_failures == 1 and "timed out" in conn.stats.last_errors[-1]
    assert time.perf_counter() - t0 < 10
    slow.delay = 0.0
    llm.engine.shutdown()


def test_failing_store_never_fails_a_request(
    model_dir: Path, prompts: list[list[int]], cold: list[list[int]]
) -> None:
    from kvtier.errors import TransientError

    bad = FlakyTier("remote")
    bad.fail = TransientError("connection refused")
    conn = KvtierConnector(config=KvtierConfig(chunk_size=CHUNK), store=TieredStore([bad]))
    llm = _llm(model_dir, conn)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == cold
    assert (
        conn.metrics.value("kvtier_tier_errors_total", {"tier": "remote", "kind": "transient"}) > 0
    )
    llm.engine.shutdown()


def test_int8_blocks_load_and_decode(
    model_dir: Path, prompts: list[list[int]], tmp_path: Path
) -> None:
    cfg = _config(tmp_path, encoding="int8")
    saver = _save(model_dir, cfg, prompts)
    assert saver.save_stats.chunks_saved > 0
    conn = KvtierConnector(config=cfg)
    llm = _llm(model_dir, conn)
    outs = llm.generate(prompts, GREEDY)
    assert all(o.num_external_tokens > 0 for o in outs)
    assert conn.stats.load_failures == 0
    llm.engine.shutdown()


def test_save_decode_saves_generated_chunks(
    model_dir: Path, prompts: list[list[int]], tmp_path: Path
) -> None:
    cfg = _config(tmp_path, save_decode=True)
    long_gen = SamplingParams(temperature=0.0, max_tokens=2 * CHUNK, ignore_eos=True)
    conn = KvtierConnector(config=cfg)
    llm = _llm(model_dir, conn)
    out = llm.generate(prompts[3:], long_gen)[0]
    conn.flush()
    total = len(prompts[3]) + len(out.token_ids) - 1  # the last token's KV is never computed
    assert conn.save_stats.chunks_saved == total // CHUNK
    llm.engine.shutdown()


def test_a_request_is_hashed_once(
    model_dir: Path, prompts: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """G1, the connector and the KV events read one set of keys per request."""
    made: list[PrefixKeys] = []
    init = PrefixKeys.__init__

    def counting(self: PrefixKeys, *args: Any, **kwargs: Any) -> None:
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(PrefixKeys, "__init__", counting)
    conn = KvtierConnector(config=_config(tmp_path))
    llm = _llm(model_dir, conn)
    recorder = attach_recorder(llm.engine)
    llm.generate(prompts[:2], GREEDY)
    assert len(made) == 2  # one per request, made when the engine first considered it
    assert all(k.namespace == conn.namespace for k in made)
    events = recorder.drain()
    assert any(e.kind == "stored" for e in events) and any(e.kind == "saved" for e in events)
    llm.engine.shutdown()
