"""A started stream that waits for its next output gets ``: keep-alive`` comments while the
engine steps, and none once its steps stop (engine/server/generation.py, streaming.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvtier.engine.outputs import EngineStats, RequestOutput
from kvtier.engine.sampling_params import SamplingParams
from kvtier.engine.server.generation import Generation
from kvtier.engine.server.streaming import Progress


def _out(rid: str, i: int, last: bool) -> RequestOutput:
    return RequestOutput(rid, [1], list(range(i + 1)), "x" * (i + 1), [i], "x", last,
                         "length" if last else None, 1, 0, 0)  # fmt: skip


class SlowEngine:
    """Outputs ``n`` tokens ``gap_s`` apart; records aborts."""

    def __init__(self, n: int, gap_s: float) -> None:
        self.n, self.gap_s, self.aborted, self.closed = n, gap_s, [], []

    def generate(self, prompt, params, request_id=None) -> AsyncIterator[RequestOutput]:
        async def run() -> AsyncIterator[RequestOutput]:
            try:
                for i in range(self.n):
                    await asyncio.sleep(self.gap_s)
                    yield _out(str(request_id), i, i == self.n - 1)
            finally:
                self.closed.append(request_id)

        return run()

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats()


def _collect(n: int, gap_s: float, wait_s: float | None) -> list:
    engine = SlowEngine(n, gap_s)

    async def run() -> list:
        g = Generation(engine, "r", [[1]], SamplingParams(max_tokens=n))  # type: ignore[arg-type]
        items = [x async for x in g.outputs(wait_s)]
        await g.close()
        return items

    return asyncio.run(run())


def test_waits_become_heartbeats_and_every_output_still_arrives_in_order() -> None:
    got = _collect(2, gap_s=0.35, wait_s=0.1)
    outs = [x for x in got if x is not None]
    assert [o.delta_token_ids for _, o in outs] == [[0], [1]]  # nothing lost, nothing reordered
    assert got.count(None) >= 4  # ~3 a gap
    assert got[0] is None and got[-1] is not None


def test_no_heartbeat_without_a_wait_or_when_outputs_come_fast() -> None:
    assert None not in _collect(2, gap_s=0.2, wait_s=None)  # /v1 answers collected whole
    assert None not in _collect(3, gap_s=0.0, wait_s=0.5)


def test_closing_mid_wait_aborts_the_request_and_closes_its_stream() -> None:
    engine = SlowEngine(1, 30.0)

    async def run() -> None:
        g = Generation(engine, "r", [[1]], SamplingParams(max_tokens=1))  # type: ignore[arg-type]
        outputs = g.outputs(0.05)
        assert await anext(outputs) is None  # a heartbeat while the output is pending
        await outputs.aclose()  # the client went away
        await g.close()

    asyncio.run(asyncio.wait_for(run(), 10))
    assert engine.aborted == ["r-0"] and engine.closed == ["r-0"]


def test_progress_is_a_step_within_the_window() -> None:
    steps = [0]
    progress = Progress(lambda: steps[0], window_s=0.2)
    assert progress()  # just started
    asyncio.run(asyncio.sleep(0.3))
    assert not progress()  # no step for longer than the window
    steps[0] += 1
    assert progress()  # a step: the engine works again
