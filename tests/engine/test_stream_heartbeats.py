"""A started stream that waits for its next output gets ``: keep-alive`` comments while the
engine steps, and none once its steps stop (engine/server/streaming.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvtier.engine.server.streaming import Progress, with_heartbeats


async def _slow(items: list[int], gap_s: float, closed: list[bool]) -> AsyncIterator[int]:
    try:
        for x in items:
            await asyncio.sleep(gap_s)
            yield x
    finally:
        closed.append(True)


def _collect(alive: bool, gap_s: float, every_s: float) -> tuple[list[int | None], list[bool]]:
    closed: list[bool] = []

    async def run() -> list[int | None]:
        items = with_heartbeats(_slow([1, 2], gap_s, closed), every_s, lambda: alive)
        return [x async for x in items]

    return asyncio.run(run()), closed


def test_heartbeats_fill_the_waits_while_the_engine_steps_and_keep_every_item() -> None:
    got, closed = _collect(alive=True, gap_s=0.35, every_s=0.1)
    assert [x for x in got if x is not None] == [1, 2]  # nothing lost, nothing reordered
    assert got.count(None) >= 4  # ~3 a gap
    assert got.index(1) > 0 and got[-1] == 2
    assert closed == [True]


def test_no_heartbeat_when_the_engine_does_not_step_or_outputs_come_fast() -> None:
    assert _collect(alive=False, gap_s=0.3, every_s=0.05)[0] == [1, 2]
    assert _collect(alive=True, gap_s=0.0, every_s=0.5)[0] == [1, 2]


def test_closing_the_stream_cancels_the_pending_output() -> None:
    closed: list[bool] = []

    async def run() -> None:
        items = with_heartbeats(_slow([1], 30.0, closed), 0.05, lambda: True)
        assert await anext(items) is None  # a heartbeat while the output is pending
        await items.aclose()  # the client went away

    asyncio.run(asyncio.wait_for(run(), 10))
    assert closed == [True]


def test_progress_is_a_step_within_the_window() -> None:
    steps = [0]
    progress = Progress(lambda: steps[0], window_s=0.2)
    assert progress()  # just started
    asyncio.run(asyncio.sleep(0.3))
    assert not progress()  # no step for longer than the window
    steps[0] += 1
    assert progress()  # a step: the engine works again
