"""The connector seam: save in engine A, load in a fresh engine B, survive failures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.engine import LLM, SamplingParams
from kvtier.engine.connector import NullConnector, make_connector
from tests.engine.kv_test_connector import InMemoryConnector

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [
    [(7 * i + 3) % 300 + 3 for i in range(29)],  # 3 full chunks of 8 + 5
    [(11 * i + 5) % 300 + 3 for i in range(16)],  # exactly 2 chunks: last token still computed
]


def _llm(path: Path, connector=None, **kw) -> LLM:
    base = dict(dtype="float32", device="cpu", block_size=4, num_threads=1)
    base.update(kw)
    return LLM(str(path), connector=connector, **base)


@pytest.fixture(scope="module")
def cold(tiny_llama: Path) -> list[list[int]]:
    llm = _llm(tiny_llama, enable_prefix_caching=False)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def saved_store(tiny_llama: Path) -> dict:
    store: dict = {}
    a = _llm(tiny_llama, InMemoryConnector(store=store))
    a.generate(PROMPTS, GREEDY)
    assert len(store) == 3 + 2
    return store


def test_fresh_engine_loads_instead_of_computing(tiny_llama: Path, cold, saved_store) -> None:
    conn = InMemoryConnector(store=dict(saved_store))
    b = _llm(tiny_llama, conn)
    outs = b.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == cold
    assert [o.num_external_tokens for o in outs] == [24, 15]  # never the last prompt token
    assert [o.num_cached_tokens for o in outs] == [0, 0]  # B's own G1 was empty
    s = b.engine.stats()
    assert s.external_loaded_tokens == 39 and s.load_failures == 0
    assert s.prompt_tokens_computed == (29 - 24) + (16 - 15)
    assert s.recomputed_after_load_failure_tokens == 0


def test_g1_hit_then_external_load_from_mid_chunk(tiny_llama: Path, cold, saved_store) -> None:
    conn = InMemoryConnector(store=dict(saved_store))
    b = _llm(tiny_llama, conn)
    # warm B's G1 with the first 6 tokens of prompt 0 (one full block of 4)
    b.generate(PROMPTS[0][:6], SamplingParams(temperature=0.0, max_tokens=1))
    out = b.generate(PROMPTS[0], GREEDY)[0]
    assert out.token_ids == cold[0]
    assert out.num_cached_tokens == 4 and out.num_external_tokens == 20


@pytest.mark.parametrize("mode", ["raise", "partial", "silent", "lookup-raises"])
def test_failed_loads_recompute_and_are_counted(
    tiny_llama: Path, cold, saved_store, mode: str
) -> None:
    conn = InMemoryConnector(store=dict(saved_store), mode=mode)
    b = _llm(tiny_llama, conn)
    outs = b.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == cold  # a cache failure never fails a request
    s = b.engine.stats()
    assert s.load_failures == 2
    if mode == "partial":
        assert s.external_loaded_tokens == 12 + 7
        assert s.recomputed_after_load_failure_tokens == 12 + 8
    elif mode == "lookup-raises":
        assert s.external_matched_tokens == 0 and s.connector_errors == 2
    else:
        assert s.external_loaded_tokens == 0
        assert s.recomputed_after_load_failure_tokens == 24 + 15
    assert s.kv_blocks_used == 0


def test_call_order_and_block_ownership(tiny_llama: Path) -> None:
    conn = InMemoryConnector()
    llm = _llm(tiny_llama, conn)
    bm = llm.engine.block_manager
    conn.engine_block_refs = lambda ids: [bm.blocks[b].ref_count for b in ids]
    assert conn.layout is not None and conn.kv is llm.engine.kv_cache
    lay = conn.layout
    assert tuple(conn.kv.shape) == lay.shape
    assert lay.fingerprint == llm.engine.fingerprint and lay.model_id == llm.engine.model_id
    assert lay.dtype == "float32" and lay.block_size == 4
    llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    kinds = [k for k, _ in conn.calls.log]
    assert kinds[:2] == ["match", "alloc"]
    assert kinds.index("save") > kinds.index("alloc")
    assert kinds[-1] == "finished"
    assert "load" not in kinds  # nothing was stored yet: nothing to load
    # request_finished saw the blocks before they were freed
    assert conn.finished_refcounts and all(r >= 1 for r in conn.finished_refcounts)
    # a save per prefill step, then one whenever decode completes a block (29 + 4 = 33 -> block 8)
    phases = [(s.phase, s.num_computed_tokens) for s in conn.saved_specs]
    assert phases[0] == ("prefill", 29) and conn.saved_specs[0].prefill_done
    assert ("decode", 32) in phases
    assert all(p == "prefill" or n % 4 == 0 for p, n in phases)


def test_abort_tells_the_connector(tiny_llama: Path) -> None:
    conn = InMemoryConnector()
    llm = _llm(tiny_llama, conn)
    rid = llm.engine.add_request(PROMPTS[0], GREEDY)
    llm.engine.step()
    assert llm.engine.abort(rid) is not None
    assert conn.calls.log[-1] == ("finished", rid)
    assert len(conn.finished_blocks[rid]) > 0
    assert llm.engine.stats().kv_blocks_used == 0


def test_chunked_prefill_saves_each_chunk(tiny_llama: Path, cold) -> None:
    store: dict = {}
    conn = InMemoryConnector(store=store)
    llm = _llm(tiny_llama, conn, max_num_batched_tokens=10, enable_prefix_caching=False)
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == cold[0]
    prefill = [s.num_computed_prompt_tokens for s in conn.saved_specs if s.phase == "prefill"]
    assert prefill == [10, 20, 29]
    assert len(store) == 3


def test_registry_builds_connectors_by_name_or_path() -> None:
    assert isinstance(make_connector(None), NullConnector)
    assert isinstance(make_connector("null"), NullConnector)
    c = make_connector("tests.engine.kv_test_connector:InMemoryConnector", "/tmp/cfg.yaml")
    assert isinstance(c, InMemoryConnector)


def test_kv_layout_matches_the_cache_tensor(tiny_llama: Path) -> None:
    llm = _llm(tiny_llama, num_kv_blocks=10)
    kv = llm.engine.kv_cache
    assert kv.shape == (3, 2, 10, 4, 2, 16)
    assert kv.is_contiguous() and kv.dtype == torch.float32
    # layer i uses the views kv_cache[i, 0] / kv_cache[i, 1]
    assert kv[1, 0].data_ptr() == kv.data_ptr() + kv.stride(0) * kv.element_size()
