"""AsyncLLMEngine: concurrent streams, cancellation frees blocks, errors reach the caller."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvtier.engine import (
    LLM,
    AsyncLLMEngine,
    EngineConfig,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
)
from kvtier.engine.metrics import EngineMetrics

PROMPTS = [[5, 9, 13, 21, 8, 40, 2, 77], [77, 3, 3, 90], [11] * 9, [100, 101, 102]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _config(path: Path, **kw) -> EngineConfig:
    base = dict(dtype="float32", device="cpu", block_size=4, num_threads=1)
    base.update(kw)
    return EngineConfig(model=str(path), **base)


@pytest.fixture(scope="module")
def engine(tiny_llama: Path):
    registry = CollectorRegistry()
    eng = AsyncLLMEngine(_config(tiny_llama), metrics=EngineMetrics(registry))
    eng.start()
    eng.registry = registry  # type: ignore[attr-defined]
    yield eng
    eng.shutdown()
    assert not eng.is_running


async def _collect(eng: AsyncLLMEngine, prompt, params, rid=None) -> list[RequestOutput]:
    return [o async for o in eng.generate(prompt, params, request_id=rid)]


def _wait_idle(eng: AsyncLLMEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = eng.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_used == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"engine did not go idle: {eng.stats()}")


def test_concurrent_streams_match_offline_generation(
    engine: AsyncLLMEngine, tiny_llama: Path
) -> None:
    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(_collect(engine, p, GREEDY) for p in PROMPTS))

    streams = asyncio.run(main())
    offline = LLM(str(tiny_llama), dtype="float32", device="cpu", block_size=4, num_threads=1)
    expected = [o.token_ids for o in offline.generate(PROMPTS, GREEDY)]
    for outs, exp in zip(streams, expected, strict=True):
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert outs[-1].token_ids == exp
        assert [t for o in outs for t in o.delta_token_ids] == exp
        assert "".join(o.delta_text for o in outs) == outs[-1].text
        assert outs[-1].ttft_s is not None and outs[-1].ttft_s >= 0
    _wait_idle(engine)


def test_cancelling_the_consumer_aborts_and_frees_blocks(engine: AsyncLLMEngine) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main() -> int:
        seen = 0

        async def consume() -> None:
            nonlocal seen
            async for _ in engine.generate(PROMPTS[0], long, request_id="to-cancel"):
                seen += 1

        task = asyncio.create_task(consume())
        while seen < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen

    before = engine.stats().num_aborted
    seen = asyncio.run(main())
    assert seen >= 3
    _wait_idle(engine)
    s = engine.stats()
    assert s.num_aborted == before + 1 and s.kv_blocks_used == 0


def test_breaking_out_early_and_explicit_abort(engine: AsyncLLMEngine) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main() -> RequestOutput:
        async for _ in engine.generate(PROMPTS[1], long):
            break
        last = None
        async for out in engine.generate(PROMPTS[2], long, request_id="abort-me"):
            last = out
            if len(out.token_ids) == 2:
                engine.abort("abort-me")
        assert last is not None
        return last

    last = asyncio.run(main())
    assert last.finished and last.finish_reason == "abort"
    _wait_idle(engine)


def test_invalid_requests_raise_in_the_caller(engine: AsyncLLMEngine) -> None:
    async def main() -> None:
        with pytest.raises(InvalidRequestError):
            await _collect(engine, [], GREEDY)
        with pytest.raises(InvalidRequestError) as e:
            await _collect(engine, [1, 2], SamplingParams(top_p=2.0))
        assert e.value.field == "top_p"

        async def slow(rid: str) -> list[RequestOutput]:
            return await _collect(
                engine, [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), rid
            )

        first = asyncio.create_task(slow("same"))
        await asyncio.sleep(0)
        with pytest.raises(InvalidRequestError, match="already in use"):
            await slow("same")
        await first

    asyncio.run(main())
    _wait_idle(engine)


def test_metrics_are_exported(engine: AsyncLLMEngine) -> None:
    asyncio.run(_collect(engine, PROMPTS[3], GREEDY))
    _wait_idle(engine)
    reg: CollectorRegistry = engine.registry  # type: ignore[attr-defined]
    get = reg.get_sample_value
    assert get("kvtier_engine_time_to_first_token_seconds_count") >= 1
    assert get("kvtier_engine_inter_token_latency_seconds_count") >= 7
    assert get("kvtier_engine_generation_tokens_total") == engine.stats().generation_tokens
    assert get("kvtier_engine_prompt_tokens_total") == engine.stats().prompt_tokens_computed
    assert get("kvtier_engine_prefix_cache_queries_tokens_total") >= 3
    assert get("kvtier_engine_kv_blocks_used") == 0
    assert get("kvtier_engine_kv_blocks_total") == engine.stats().kv_blocks_total
    assert get("kvtier_engine_requests_running") == 0
    assert get("kvtier_engine_external_loaded_tokens_total") == 0


def test_idle_engine_thread_does_not_spin(engine: AsyncLLMEngine) -> None:
    _wait_idle(engine)
    thread = engine._thread
    assert thread is not None and thread.is_alive()
    t0 = time.thread_time()  # this thread's CPU time: a control
    start = time.process_time()
    time.sleep(0.3)
    used = time.process_time() - start - (time.thread_time() - t0)
    assert used < 0.1, f"idle engine used {used:.3f}s CPU in 0.3s"


def test_shutdown_ends_open_streams_with_abort(tiny_llama: Path) -> None:
    import threading

    eng = AsyncLLMEngine(_config(tiny_llama))
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main() -> RequestOutput:
        outs: list[RequestOutput] = []
        async for out in eng.generate(PROMPTS[0], long):
            outs.append(out)
            if len(outs) == 2:
                threading.Thread(target=eng.shutdown).start()
        return outs[-1]

    last = asyncio.run(main())
    assert last.finished and last.finish_reason == "abort"
    deadline = time.monotonic() + 10
    while eng.is_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not eng.is_running
    assert eng.engine.stats().kv_blocks_used == 0


def test_stats_never_report_idle_while_a_request_is_queued(engine: AsyncLLMEngine) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main() -> None:
        _wait_idle(engine)

        async def consume() -> None:
            async for _ in engine.generate(PROMPTS[0], long, request_id="queued"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)  # the task has submitted the request (maybe not yet picked up)
        for _ in range(50):
            s = engine.stats()
            assert s.num_waiting + s.num_running >= 1, s
            await asyncio.sleep(0.001)
        engine.abort("queued")
        await task

    asyncio.run(main())
    _wait_idle(engine)


def test_a_fresh_engine_reports_its_kv_capacity_before_its_first_step(tiny_llama: Path) -> None:
    # a router sizes a joining engine's warm-up by it (router/warmup.py)
    registry = CollectorRegistry()
    eng = AsyncLLMEngine(_config(tiny_llama), metrics=EngineMetrics(registry))
    try:
        blocks = registry.get_sample_value("kvtier_engine_kv_blocks_total")
        assert blocks is not None and blocks > 0 and blocks == eng.stats().kv_blocks_total
    finally:
        eng.shutdown()
