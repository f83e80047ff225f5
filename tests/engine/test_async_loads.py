"""Asynchronous connector loads: a loading request waits in its own state while others step."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.engine import LLM, SamplingParams
from kvtier.engine.request import RequestStatus
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
    _llm(tiny_llama, InMemoryConnector(store=store)).generate(PROMPTS, GREEDY)
    return store


def test_async_loads_give_the_cold_output(tiny_llama: Path, cold, saved_store) -> None:
    conn = InMemoryConnector(store=dict(saved_store), asynchronous=True, hold=3)
    b = _llm(tiny_llama, conn)
    outs = b.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == cold
    assert [o.num_external_tokens for o in outs] == [24, 15]
    s = b.engine.stats()
    assert s.external_loaded_tokens == 39 and s.load_failures == 0
    assert s.prompt_tokens_computed == (29 - 24) + (16 - 15)
    assert s.num_loading == 0
    assert conn.waits >= 1  # with nothing else to run, the engine waited instead of spinning
    b.engine.block_manager.check_integrity([])


def test_running_requests_keep_stepping_while_a_load_is_pending(
    tiny_llama: Path, cold, saved_store
) -> None:
    """A load that takes 30 steps does not delay the decode of a request already running."""
    conn = InMemoryConnector(store=dict(saved_store), asynchronous=True, hold=30)
    eng = _llm(tiny_llama, conn).engine
    other = [(13 * i + 1) % 300 + 3 for i in range(5)]  # shorter than a chunk: never loads
    eng.add_request(other, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), "run")
    eng.step()  # "run" is prefilled and running
    eng.add_request(PROMPTS[0], GREEDY, "load")
    tokens_while_loading = 0
    steps = 0
    while eng.scheduler.find("load") is not None and steps < 100:
        outs = eng.step()
        steps += 1
        req = eng.scheduler.find("load")
        if req is not None and req.status == RequestStatus.LOADING:
            assert eng.stats().num_loading == 1
            tokens_while_loading += sum(1 for o in outs if o.request_id == "run")
        for o in outs:
            if o.request_id == "load" and o.finished:
                assert o.token_ids == cold[0]
                assert o.num_external_tokens == 24
    # one token per step for "run" while "load" waited: its decode never stalled
    assert tokens_while_loading >= 19
    while eng.has_unfinished():
        eng.step()
    eng.block_manager.check_integrity([])


@pytest.mark.parametrize("mode", ["partial", "silent", "raise"])
def test_failed_async_loads_recompute_and_are_counted(
    tiny_llama: Path, cold, saved_store, mode: str
) -> None:
    conn = InMemoryConnector(store=dict(saved_store), mode=mode, asynchronous=True, hold=2)
    b = _llm(tiny_llama, conn)
    outs = b.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == cold  # garbage in the cache was recomputed
    s = b.engine.stats()
    assert s.load_failures == 2
    loaded = s.external_loaded_tokens
    assert s.recomputed_after_load_failure_tokens == 39 - loaded
    assert loaded == (12 + 7 if mode == "partial" else 0)


def test_abort_while_loading_frees_blocks_and_nothing_is_written_later(
    tiny_llama: Path, saved_store
) -> None:
    conn = InMemoryConnector(store=dict(saved_store), asynchronous=True, hold=5)
    eng = _llm(tiny_llama, conn).engine
    eng.add_request(PROMPTS[0], GREEDY, "gone")
    eng.step()
    assert eng.scheduler.find("gone").status == RequestStatus.LOADING  # type: ignore[union-attr]
    assert eng.stats().kv_blocks_used > 0
    out = eng.abort("gone")
    assert out is not None and out.finish_reason == "abort"
    assert "gone" not in conn.pending  # the connector was told: it will never place it
    assert eng.stats().kv_blocks_used == 0 and not eng.has_unfinished()
    eng.block_manager.check_integrity([])
