"""Scheduler: token budget, sequence cap, chunked prefill, FIFO admission, preemption, abort."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.block_manager import BlockManager
from kvtier.engine.connector import NullConnector
from kvtier.engine.request import RequestStatus
from kvtier.engine.scheduler import Scheduler
from tests.engine.fakes import fake_step, live_requests, make_request

BS = 4


def _sched(num_blocks: int = 64, max_seqs: int = 8, budget: int = 16) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), NullConnector(), max_seqs, budget)


def _tokens(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def test_token_budget_and_chunked_prefill() -> None:
    s = _sched(budget=16)
    reqs = [make_request(f"r{i}", _tokens(10, 100 * i)) for i in range(3)]
    for r in reqs:
        s.add(r)
    out = fake_step(s)
    assert out.num_batched_tokens == 16
    assert [(c.request.request_id, c.compute_start, c.num_tokens) for c in out.chunks] == [
        ("r0", 0, 10),
        ("r1", 0, 6),
    ]
    assert reqs[0].num_output_tokens == 1 and reqs[1].num_output_tokens == 0
    out = fake_step(s)
    # r0 decodes, r1 finishes its prompt, r2 gets the rest of the budget
    assert [(c.request.request_id, c.compute_start, c.num_tokens) for c in out.chunks] == [
        ("r0", 10, 1),
        ("r1", 6, 4),
        ("r2", 0, 10),
    ]
    assert out.num_batched_tokens <= 16
    s.block_manager.check_integrity(live_requests(s))


def test_max_num_seqs_caps_the_running_batch() -> None:
    s = _sched(max_seqs=2, budget=64)
    for i in range(4):
        s.add(make_request(f"r{i}", _tokens(3, 10 * i), max_tokens=3))
    fake_step(s)
    assert [r.request_id for r in s.running] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2", "r3"]
    while s.has_unfinished():
        out = fake_step(s)
        assert len(out.chunks) <= 2
    s.block_manager.check_integrity([])


def test_fifo_head_of_line_is_not_overtaken() -> None:
    s = _sched(num_blocks=8, budget=64)
    big0 = make_request("big0", _tokens(20), max_tokens=8)  # 5 blocks + growth
    s.add(big0)
    fake_step(s)
    big1 = make_request("big1", _tokens(20, 500))  # needs 5 blocks, 3 free
    small = make_request("small", _tokens(3, 900))  # would fit in 1 block
    s.add(big1)
    s.add(small)
    fake_step(s)
    assert [r.request_id for r in s.waiting] == ["big1", "small"]
    assert small.status == RequestStatus.WAITING
    while big0.status != RequestStatus.FINISHED:
        fake_step(s)
    fake_step(s)
    assert big1.status == RequestStatus.RUNNING and small.status == RequestStatus.RUNNING


def test_preemption_frees_the_newest_and_recomputes_it_later() -> None:
    s = _sched(num_blocks=6, budget=64)
    a = make_request("a", _tokens(8), max_tokens=10)  # grows to 18 tokens: 5 blocks
    b = make_request("b", _tokens(4, 50), max_tokens=6)
    s.add(a)
    s.add(b)
    fake_step(s)  # a: 2 blocks + b: 1 block (+1 once b decodes)
    preempted = []
    steps = 0
    while s.has_unfinished():
        out = fake_step(s)
        preempted += [r.request_id for r in out.preempted]
        s.block_manager.check_integrity(live_requests(s))
        steps += 1
        assert steps < 100
    assert preempted and preempted[0] == "b"  # the newest goes first
    assert b.num_preemptions >= 1 and s.counters.num_preemptions >= 1
    assert a.num_output_tokens == 10 and b.num_output_tokens == 6
    # b was recomputed from scratch: prompt + its generated tokens so far
    assert s.block_manager.num_used_blocks == 0


def test_a_request_that_cannot_grow_preempts_itself_when_alone_newest() -> None:
    s = _sched(num_blocks=3, budget=64)
    a = make_request("a", _tokens(4), max_tokens=7)  # needs 3 blocks at the end
    b = make_request("b", _tokens(4, 50), max_tokens=2)
    s.add(a)
    s.add(b)
    while s.has_unfinished():
        fake_step(s)
        s.block_manager.check_integrity(live_requests(s))
    assert a.num_output_tokens == 7 and b.num_output_tokens == 2


def test_abort_anywhere_frees_everything() -> None:
    s = _sched(num_blocks=32, budget=8)
    running = make_request("running", _tokens(4), max_tokens=50)
    prefilling = make_request("prefilling", _tokens(20, 100), max_tokens=5)
    waiting = make_request("waiting", _tokens(6, 200))
    for r in (running, prefilling, waiting):
        s.add(r)
    fake_step(s)  # running: whole prompt (4); prefilling: first 4 tokens
    fake_step(s)
    assert prefilling.status == RequestStatus.RUNNING
    assert 0 < prefilling.num_computed_tokens < prefilling.num_prompt_tokens
    assert waiting.status == RequestStatus.WAITING
    for r in (prefilling, waiting, running):
        s.finish(r, "abort")
        assert r.status == RequestStatus.FINISHED and r.block_ids == []
        s.block_manager.check_integrity(live_requests(s))
    assert not s.has_unfinished()
    assert s.block_manager.num_used_blocks == 0


def test_prefix_hit_is_counted_and_leaves_one_token_to_compute() -> None:
    s = _sched(budget=64)
    a = make_request("a", _tokens(12), max_tokens=1)
    s.add(a)
    fake_step(s)
    assert a.status == RequestStatus.FINISHED
    b = make_request("b", _tokens(12), max_tokens=1)
    s.add(b)
    out = fake_step(s)
    (chunk,) = out.chunks
    assert chunk.compute_start == 8 and chunk.num_tokens == 4  # 2 of 3 full blocks hit
    assert b.num_cached_tokens == 8
    bm = s.block_manager
    assert bm.prefix_cache_queries_tokens == 24 and bm.prefix_cache_hit_tokens == 8


@settings(max_examples=40, deadline=None)
@given(
    num_blocks=st.integers(8, 40),
    budget=st.integers(1, 24),
    max_seqs=st.integers(1, 6),
    requests=st.lists(
        st.tuples(st.integers(1, 20), st.integers(1, 8), st.integers(0, 5)),
        min_size=1,
        max_size=10,
    ),
    aborts=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 9)), max_size=4),
)
def test_random_workloads_keep_invariants(num_blocks, budget, max_seqs, requests, aborts) -> None:
    """Any mix of prompts, budgets, block pressure and aborts: integrity after every
    step, budget and seat limits respected, FIFO first admission, everything finishes."""
    s = _sched(num_blocks=num_blocks, max_seqs=max_seqs, budget=budget)
    # every request must fit alone: prompt + max_tokens <= capacity
    reqs = []
    for i, (plen, gen, base) in enumerate(requests):
        plen = min(plen, num_blocks * BS - gen)
        reqs.append(make_request(f"r{i}", [(base * 7 + j) % 50 for j in range(plen)], gen))
    for r in reqs:
        s.add(r)
    abort_at = {step: idx for step, idx in aborts}
    admitted: list[str] = []
    step = 0
    while s.has_unfinished():
        assert step < 2000, "no progress"
        if step in abort_at:
            victim = reqs[abort_at[step] % len(reqs)]
            if victim.status != RequestStatus.FINISHED:
                s.finish(victim, "abort")
        if not s.has_unfinished():
            break
        out = fake_step(s)
        assert out.chunks, "a step with work pending must schedule something"
        assert out.num_batched_tokens <= budget
        assert len(s.running) <= max_seqs
        for c in out.chunks:
            if c.request.request_id not in admitted:
                admitted.append(c.request.request_id)
        s.block_manager.check_integrity(live_requests(s))
        step += 1
    arrival = [r.request_id for r in reqs if r.request_id in admitted]
    assert admitted == arrival
    for r in reqs:
        assert r.status == RequestStatus.FINISHED
        if r.finish_reason == "length":
            assert r.num_output_tokens == r.params.max_tokens
    assert s.block_manager.num_used_blocks == 0
