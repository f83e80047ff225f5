"""ProcessEngine: the engine core in its own process behaves like the in-process engine."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.engine import (
    LLM,
    EngineConfig,
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    ModelLoadError,
    RequestOutput,
    SamplingParams,
)
from kvtier.engine.process_engine import ProcessEngine

PROMPTS = [[5, 9, 13, 21, 8, 40, 2, 77], [77, 3, 3, 90], [11] * 9, [100, 101, 102]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def _config(path: Path, **kw) -> EngineConfig:
    base = dict(dtype="float32", device="cpu", block_size=4, num_threads=1)
    base.update(kw)
    return EngineConfig(model=str(path), **base)


@pytest.fixture(scope="module")
def engine(tiny_llama: Path):
    eng = ProcessEngine(_config(tiny_llama), start_timeout_s=120).start()
    yield eng
    eng.shutdown()
    assert not eng.is_running


async def _collect(eng: ProcessEngine, prompt, params, rid=None) -> list[RequestOutput]:
    return [o async for o in eng.generate(prompt, params, request_id=rid)]


def _wait_idle(eng: ProcessEngine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = eng.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_used == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"engine did not go idle: {eng.stats()}")


def test_runs_in_another_process_and_matches_offline_generation(
    engine: ProcessEngine, tiny_llama: Path
) -> None:
    assert engine.pid is not None and engine.pid != os.getpid()
    assert engine.num_threads == 1

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(_collect(engine, p, GREEDY) for p in PROMPTS))

    streams = asyncio.run(main())
    offline = LLM(str(tiny_llama), dtype="float32", device="cpu", block_size=4, num_threads=1)
    expected = [o.token_ids for o in offline.generate(PROMPTS, GREEDY)]
    for prompt, outs, exp in zip(PROMPTS, streams, expected, strict=True):
        last = outs[-1]
        assert last.finished and last.finish_reason == "length"
        assert last.token_ids == exp
        assert last.prompt_token_ids == prompt
        assert [t for o in outs for t in o.delta_token_ids] == exp
        assert "".join(o.delta_text for o in outs) == last.text
        assert last.ttft_s is not None and last.ttft_s >= 0
    _wait_idle(engine)


def test_text_prompts_are_tokenized_here_and_logprobs_arrive(engine: ProcessEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    outs = asyncio.run(_collect(engine, "hello world", params))
    last = outs[-1]
    assert last.prompt_token_ids == engine.tokenizer.encode("hello world")
    assert last.logprobs is not None and len(last.logprobs) == 4
    assert [lp.token_id for lp in last.logprobs] == last.token_ids
    assert all(len(lp.top_logprobs) == 2 for lp in last.logprobs)


def test_cancelling_the_consumer_aborts_and_frees_blocks(engine: ProcessEngine) -> None:
    async def main() -> int:
        seen = 0

        async def consume() -> None:
            nonlocal seen
            async for _ in engine.generate(PROMPTS[0], LONG, request_id="to-cancel"):
                seen += 1

        task = asyncio.create_task(consume())
        while seen < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen

    before = engine.stats().num_aborted
    assert asyncio.run(main()) >= 3
    _wait_idle(engine)
    s = engine.stats()
    assert s.num_aborted == before + 1 and s.kv_blocks_used == 0


def test_explicit_abort_ends_the_stream_with_abort(engine: ProcessEngine) -> None:
    async def main() -> RequestOutput:
        last = None
        async for out in engine.generate(PROMPTS[2], LONG, request_id="abort-me"):
            last = out
            if len(out.token_ids) == 2:
                engine.abort("abort-me")
        assert last is not None
        return last

    last = asyncio.run(main())
    assert last.finished and last.finish_reason == "abort"
    _wait_idle(engine)


def test_invalid_requests_raise_in_the_caller(engine: ProcessEngine) -> None:
    async def main() -> None:
        with pytest.raises(InvalidRequestError):
            await _collect(engine, [], GREEDY)
        with pytest.raises(InvalidRequestError) as e:
            await _collect(engine, [1, 2], SamplingParams(top_p=2.0))
        assert e.value.field == "top_p"
        too_long = [1] * engine.max_model_len
        with pytest.raises(InvalidRequestError, match="at most"):
            await _collect(engine, too_long, GREEDY)

        first = asyncio.create_task(_collect(engine, [1, 2, 3], LONG, "same"))
        await asyncio.sleep(0.05)
        with pytest.raises(InvalidRequestError, match="already in use"):
            await _collect(engine, [1, 2, 3], GREEDY, "same")
        engine.abort("same")
        await first

    asyncio.run(main())
    _wait_idle(engine)


def test_metrics_text_comes_from_the_engine_process(engine: ProcessEngine) -> None:
    asyncio.run(_collect(engine, PROMPTS[3], GREEDY))
    _wait_idle(engine)
    text = asyncio.run(engine.metrics_text()).decode()
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    stats = engine.stats()
    assert samples["kvtier_engine_time_to_first_token_seconds_count"] >= 1
    assert samples["kvtier_engine_generation_tokens_total"] == stats.generation_tokens
    assert samples["kvtier_engine_prompt_tokens_total"] == stats.prompt_tokens_computed
    assert samples["kvtier_engine_kv_blocks_total"] == stats.kv_blocks_total


def test_stats_never_report_idle_while_a_request_is_queued(engine: ProcessEngine) -> None:
    async def main() -> None:
        _wait_idle(engine)

        async def consume() -> None:
            async for _ in engine.generate(PROMPTS[0], LONG, request_id="queued"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)
        for _ in range(50):
            s = engine.stats()
            assert s.num_waiting + s.num_running >= 1, s
            await asyncio.sleep(0.001)
        engine.abort("queued")
        await task

    asyncio.run(main())
    _wait_idle(engine)


def test_shutdown_ends_open_streams_with_abort(tiny_llama: Path) -> None:
    import threading

    eng = ProcessEngine(_config(tiny_llama), start_timeout_s=120).start()

    async def main() -> RequestOutput:
        outs: list[RequestOutput] = []
        async for out in eng.generate(PROMPTS[0], LONG):
            outs.append(out)
            if len(outs) == 2:
                threading.Thread(target=eng.shutdown).start()
        return outs[-1]

    last = asyncio.run(main())
    assert last.finished and last.finish_reason == "abort"
    deadline = time.monotonic() + 30
    while eng.is_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not eng.is_running


def test_a_dead_engine_process_fails_streams_and_later_requests(tiny_llama: Path) -> None:
    eng = ProcessEngine(_config(tiny_llama), start_timeout_s=120).start()
    assert eng.pid is not None
    try:

        async def main() -> None:
            with pytest.raises(EngineDeadError):
                async for out in eng.generate(PROMPTS[0], LONG):
                    if len(out.token_ids) == 2:
                        os.kill(eng.pid, signal.SIGKILL)  # type: ignore[arg-type]

        asyncio.run(main())
        assert not eng.is_running
        with pytest.raises(EngineDeadError):
            asyncio.run(_collect(eng, PROMPTS[1], GREEDY))
        assert asyncio.run(eng.metrics_text()) == b""
    finally:
        eng.shutdown(timeout=5)


def test_start_reports_a_model_that_does_not_load(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model.gguf"
    with pytest.raises((ModelLoadError, EngineError)):
        ProcessEngine(EngineConfig(model=str(missing), device="cpu"), start_timeout_s=60).start()
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    eng = ProcessEngine(EngineConfig(model=str(bad), device="cpu"), start_timeout_s=60)
    with pytest.raises(EngineError):
        eng.start()
    assert not eng.is_running
