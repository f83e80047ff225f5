"""The load generator of bench/serve.py against a fake streaming server (no wall-clock assertions)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import pytest

from kvtier.bench.lib.serve_client import (
    Limits,
    RequestRecord,
    chat_payload,
    run_workload,
    stream_chat,
    warm_up,
)
from kvtier.bench.lib.serve_metrics import delta, run_metrics, scrape
from kvtier.bench.lib.serve_stats import summarize
from kvtier.bench.lib.serve_systems import free_port
from kvtier.bench.lib.serve_workloads import Conversation, Lane, SingleTurn, Workload
from tests.bench.fake_openai import FakeOpenAI


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    with FakeOpenAI(tokens=5, cached_fraction=0.5) as server:
        yield server


def _one(url: str, model: str, content: str = "hello", timeout_s: float = 30.0) -> RequestRecord:
    async def go() -> RequestRecord:
        import httpx

        payload = chat_payload(model, [{"role": "user", "content": content}], 5)
        async with httpx.AsyncClient(trust_env=False) as client:
            return await stream_chat(
                client,
                url + "/v1/chat/completions",
                payload,
                timeout_s=timeout_s,
                origin=0.0,
            )

    return asyncio.run(go())


def test_a_streamed_request_is_recorded(fake: FakeOpenAI) -> None:
    rec = _one(fake.url, "ok", content="x" * 40)
    assert rec.error is None
    assert rec.completion_tokens == 5 and rec.content_chunks == 5
    assert len(rec.itl_s) == 4  # one gap between each pair of content chunks
    assert rec.prompt_tokens == 40 and rec.cached_tokens == 20
    assert rec.text == " t0 t1 t2 t3 t4" and rec.finish_reason == "length"
    assert rec.ttft_s is not None and 0 < rec.ttft_s <= rec.e2e_s
    assert all(g >= 0 for g in rec.itl_s)
    assert rec.tpot_s is not None and rec.tpot_s >= 0
    sent = fake.requests[-1]
    assert sent["stream"] is True and sent["ignore_eos"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["temperature"] == 0 and sent["max_tokens"] == 5


def test_packed_chunks_give_one_gap_per_chunk(fake: FakeOpenAI) -> None:
    rec = _one(fake.url, "packed")
    assert rec.error is None
    assert rec.completion_tokens == 5 and rec.content_chunks == 3  # 2 + 2 + 1 tokens
    assert len(rec.itl_s) == 2


@pytest.mark.parametrize(
    ("behaviour", "kind"),
    [
        ("http500", "http_500"),
        ("drop", "dropped"),
        ("error_event", "server_error"),
    ],
)
def test_failures_are_records_not_exceptions(fake: FakeOpenAI, behaviour: str, kind: str) -> None:
    rec = _one(fake.url, behaviour)
    assert rec.error is not None and rec.error_kind() == kind


def test_timeout_and_refused_connection_are_errors() -> None:
    with FakeOpenAI(slow_s=2.0) as slow:
        rec = _one(slow.url, "slow", timeout_s=0.2)
    assert rec.error_kind() == "timeout"
    rec = _one(f"http://127.0.0.1:{free_port()}", "ok")
    assert rec.error_kind() == "connect"


def _workload(lanes: list[Lane]) -> Workload:
    return Workload("test", lanes, max_tokens=5)


def test_run_mixes_failures_and_successes(fake: FakeOpenAI) -> None:
    lanes = [
        Lane("good", Conversation("sys", "ctx", ["q0", "q1", "q2"]), [0.0, 0.01, 0.02]),
        Lane("bad", Conversation("sys", "ctx", ["behaviour=drop", "q1", "q2"]), [0.0, 0.01, 0.02]),
        Lane("err", SingleTurn([{"role": "user", "content": "behaviour=http500"}]), [0.0]),
    ]
    result = asyncio.run(run_workload(fake.url, "ok", _workload(lanes), Limits(duration_s=60)))
    by_lane: dict[str, list[RequestRecord]] = {}
    for r in result.records:
        by_lane.setdefault(r.lane, []).append(r)
    assert [r.error for r in by_lane["good"]] == [None, None, None]
    assert [r.turn for r in by_lane["good"]] == [0, 1, 2]
    assert [r.error_kind() for r in by_lane["bad"]] == ["dropped"]  # its later rounds are not sent
    assert [r.error_kind() for r in by_lane["err"]] == ["http_500"]
    assert result.not_sent == 2
    s = summarize(result)
    assert s["requests"] == 3 and s["errors"] == 2 and s["not_sent"] == 2
    assert s["error_kinds"] == {"dropped": 1, "http_500": 1}


def test_multi_round_resends_the_servers_answers(fake: FakeOpenAI) -> None:
    conv = Conversation("sys", "ctx", ["q0", "q1", "q2"])
    lanes = [Lane("u", conv, [0.0, 0.0, 0.0])]
    result = asyncio.run(run_workload(fake.url, "ok", _workload(lanes), Limits(duration_s=60)))
    assert [r.error for r in result.records] == [None] * 3
    assert conv.answers == [" t0 t1 t2 t3 t4"] * 3
    last = fake.requests[-1]["messages"]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert last[2]["content"] == " t0 t1 t2 t3 t4"
    # the prompt grows by the answer and the question each round (prompt_tokens = characters)
    prompts = [r.prompt_tokens for r in result.records]
    assert prompts[0] is not None and prompts[0] < prompts[1] < prompts[2]  # type: ignore[operator]
    # a round leaves only after the previous one completed
    recs = result.records
    for a, b in itertools.pairwise(recs):
        assert b.sent_s >= a.sent_s + a.e2e_s - 1e-6


def test_a_users_next_round_waits_its_think_time(fake: FakeOpenAI) -> None:
    conv = Conversation("sys", "ctx", ["q0", "q1"])
    lanes = [Lane("u", conv, [0.0, 0.0], think_s=0.3)]
    result = asyncio.run(run_workload(fake.url, "ok", _workload(lanes), Limits(duration_s=60)))
    a, b = result.records
    assert b.sent_s >= a.sent_s + a.e2e_s + 0.3 - 1e-6


def test_bounds_request_cap_and_duration(fake: FakeOpenAI) -> None:
    lanes = [
        Lane(f"q{i}", SingleTurn([{"role": "user", "content": "hi"}]), [0.0]) for i in range(6)
    ]
    result = asyncio.run(run_workload(fake.url, "ok", _workload(lanes), Limits(max_requests=2)))
    assert len(result.records) == 2 and result.not_sent == 4
    # arrivals after the duration are never sent (and the run does not wait for them)
    late = [Lane("late", SingleTurn([{"role": "user", "content": "hi"}]), [3600.0])]
    result = asyncio.run(run_workload(fake.url, "ok", _workload(late), Limits(duration_s=1.0)))
    assert result.records == [] and result.not_sent == 1


def test_metrics_deltas_give_the_hit_rate(fake: FakeOpenAI) -> None:
    asyncio.run(warm_up(fake.url, "ok", [{"role": "user", "content": "w" * 8}]))  # moves counters
    before = scrape(fake.url)
    lanes = [
        Lane(f"u{i}", SingleTurn([{"role": "user", "content": "y" * (10 * (i + 1))}]), [0.0])
        for i in range(4)
    ]
    result = asyncio.run(run_workload(fake.url, "ok", _workload(lanes), Limits()))
    after = scrape(fake.url)
    assert before is not None and after is not None
    m = run_metrics(delta(before, after))
    assert m["metrics_source"] == "kvtier"
    assert m["queried_tokens"] == 10 + 20 + 30 + 40
    assert m["g1_hit_tokens"] == 5 + 10 + 15 + 20
    assert m["hit_rate"] == pytest.approx(0.5)
    assert summarize(result)["hit_rate_usage"] == pytest.approx(m["hit_rate"])


def test_scrape_of_a_server_without_metrics() -> None:
    assert scrape(f"http://127.0.0.1:{free_port()}") is None
