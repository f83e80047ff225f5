"""The vLLM connector's scheduler and worker sides, driven like vLLM 0.32 drives them (no vLLM needed).

Two fake "vLLM processes" on one disk tier: the first computes a prompt
cold and saves it; the second loads it, synchronously or not, and what its
cache holds must equal what the cold forward computed. Then failures: a
corrupt object, a missing one, a load never offered twice, saves held back
after a failed load, release of a finished request's blocks.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvtier.keys import PrefixKeys
from kvtier.tiers.disk_files import block_path
from tests.vllm.fakes import (
    BS,
    NS,
    CachedReqs,
    FakeRequest,
    FakeVllm,
    NewReq,
    SchedOut,
    kvtier_config,
    true_kv,
)

PROMPT = [(i * 7919) % 5000 + 3 for i in range(150)]  # 2 chunks of 64 + a 22-token tail


def _cold(v: FakeVllm, req: FakeRequest) -> list[int]:
    """Admits ``req`` with no hit and computes its whole prompt in one step (saving it)."""
    n, _ = v.match(req, 0)
    assert n == 0
    blocks = v.alloc(len(req.prompt_token_ids))
    v.scheduler.update_state_after_alloc(req, blocks, 0)
    rid, p = req.request_id, len(req.prompt_token_ids)
    v.step(
        SchedOut([NewReq(rid, (blocks,), 0)], num_scheduled_tokens={rid: p}), [(req, blocks, 0, p)]
    )
    assert v.worker.flush(30)
    return blocks


def _stored(tmp_path: Path) -> Path:
    """A disk tier holding PROMPT, saved by a first (cold) process."""
    first = FakeVllm(kvtier_config(tmp_path))
    _cold(first, FakeRequest("a-0", PROMPT))
    assert first.counters.totals["saved_chunks"] == 3  # [0,64) [64,128) and the tail [128,150)
    first.close()
    return tmp_path


def _admit_with_load(v: FakeVllm, req: FakeRequest, n_local: int = 0) -> tuple[list[int], int]:
    n, _ = v.match(req, n_local)
    assert n > 0
    blocks = v.alloc(len(req.prompt_token_ids))
    v.scheduler.update_state_after_alloc(req, blocks, n)
    return blocks, n


@pytest.mark.parametrize("n_local", [0, BS])
def test_a_second_process_loads_the_prefix_synchronously_and_holds_the_cold_kv(tmp_path, n_local):
    v = FakeVllm(kvtier_config(_stored(tmp_path)))
    req = FakeRequest("b-0", PROMPT)
    blocks, n = _admit_with_load(v, req, n_local)
    assert n == len(PROMPT) - 1 - n_local  # all but the last token, beyond vLLM's own hit
    if n_local:  # what vLLM's prefix cache had, written by vLLM itself
        v.layout.scatter(true_kv(PROMPT, 0, n_local), blocks, 0)
    rid, p = req.request_id, len(PROMPT)
    out = SchedOut(
        [NewReq(rid, (blocks,), n_local + n)], num_scheduled_tokens={rid: p - n - n_local}
    )
    plan = v.step(out, [(req, blocks, n_local + n, p)])
    assert [(s.start, s.end, s.sync) for s in plan.loads] == [(n_local, p - 1, True)]
    assert not v.errors
    assert torch.equal(v.layout.gather(blocks, 0, p), true_kv(PROMPT, 0, p))
    assert v.counters.totals["loaded_tokens"] == n and v.counters.totals["failed_tokens"] == 0
    assert not plan.saves  # everything it computed was stored already
    v.close()


def test_an_asynchronous_load_is_placed_over_steps_and_reported_once(tmp_path) -> None:
    v = FakeVllm(kvtier_config(_stored(tmp_path)), load_async=True)
    req = FakeRequest("b-1", PROMPT)
    n, is_async = v.match(req, 0)
    assert (n, is_async) == (len(PROMPT) - 1, True)
    blocks = v.alloc(len(PROMPT))
    v.scheduler.update_state_after_alloc(req, blocks, n)
    v.step(SchedOut(), [])  # the load starts in an empty step
    deadline = time.monotonic() + 30
    while "b-1" not in v.recvd:
        assert time.monotonic() < deadline, "the load never finished"
        time.sleep(0.01)
        v.step(SchedOut(), [])
    assert not v.errors
    assert torch.equal(v.layout.gather(blocks, 0, n), true_kv(PROMPT, 0, n))
    # vLLM's second call after the load: no new load, and no second offer
    v.scheduler.update_state_after_alloc(req, blocks, 0)
    assert v.match(req, 0) == (0, False)
    v.close()


def test_a_corrupt_object_ends_the_load_and_its_blocks_are_reported_failed(tmp_path) -> None:
    root = _stored(tmp_path)
    keys = PrefixKeys(NS, 16)
    keys.extend(PROMPT)
    path = block_path(root / "blocks", keys.key(128))  # the second chunk, [64, 128)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    v = FakeVllm(kvtier_config(root))
    req = FakeRequest("b-2", PROMPT)
    blocks, n = _admit_with_load(v, req)
    rid, p = req.request_id, len(PROMPT)
    v.step(
        SchedOut([NewReq(rid, (blocks,), n)], num_scheduled_tokens={rid: 1}), [(req, blocks, n, p)]
    )
    # the first chunk was placed; every block from token 64 to the end of the load failed
    assert v.errors == set(blocks[64 // BS : -(-n // BS)])
    assert torch.equal(v.layout.gather(blocks, 0, 64), true_kv(PROMPT, 0, 64))
    assert v.counters.totals["loaded_tokens"] == 64
    assert v.counters.totals["failed_tokens"] == n - 64
    assert v.metrics.value("kvtier_corrupt_blocks_total", {"tier": "disk"}) == 1
    # never offered again (vLLM asks again after a failed load)
    assert v.match(req, 0) == (0, False)
    v.close()


def test_saves_after_a_failed_load_wait_until_the_scheduler_knows(tmp_path) -> None:
    """KV computed in the step of a failed load attended to unwritten blocks: never saved."""
    root = _stored(tmp_path)
    v = FakeVllm(kvtier_config(root))
    prompt = PROMPT + [17 + i for i in range(40)]  # the stored chunks, then 62 new tokens
    req = FakeRequest("b-3", prompt)
    n, _ = v.match(req, 0)
    assert n == 128  # the two stored chunks
    for f in (root / "blocks").rglob("*.kvb"):
        f.unlink()  # the tier loses them between the lookup and the load
    blocks = v.alloc(len(prompt))
    v.scheduler.update_state_after_alloc(req, blocks, n)
    rid, p = req.request_id, len(prompt)
    out = SchedOut([NewReq(rid, (blocks,), n)], num_scheduled_tokens={rid: p - n})
    plan = v.step(out, [(req, blocks, n, p)])
    assert v.errors == set(blocks[: n // BS])  # nothing placed: every block of the load
    # the prompt's tail computed in that step was planned, and dropped by the worker
    assert [(o.start, o.end) for o in plan.saves[0].objects] == [(128, p)]
    assert v.counters.totals["saved_chunks"] == 0 and v.counters.totals["dropped_saves"] == 1
    # vLLM rewinds to token 0 and recomputes the prompt: now all of it is saved
    out = SchedOut(
        scheduled_cached_reqs=CachedReqs([rid], set(), [None], [0]), num_scheduled_tokens={rid: p}
    )
    plan = v.step(out, [(req, blocks, 0, p)])
    assert [(o.start, o.end) for o in plan.saves[0].objects] == [(0, 64), (64, 128), (128, p)]
    assert plan.saves[0].after_failed_load
    assert v.counters.totals["saved_chunks"] == 3
    v.close()


def test_a_finished_request_keeps_its_blocks_until_its_last_saves_are_gathered(tmp_path) -> None:
    v = FakeVllm(kvtier_config(tmp_path))
    req = FakeRequest("c-0", PROMPT[:100])
    blocks = _cold(v, req)
    # it generates 45 tokens, one per step: the answer completes chunk [64, 128) while decoding
    computed = 100
    for i in range(45):
        req.all_token_ids.append(11 + i)
        new_blocks = None
        if computed % BS == 0 and computed // BS == len(blocks):
            new_blocks = (v.alloc(1),)
            blocks.extend(new_blocks[0])
        out = SchedOut(
            scheduled_cached_reqs=CachedReqs([req.request_id], set(), [new_blocks], [computed]),
            num_scheduled_tokens={req.request_id: 1},
        )
        plan = v.step(out, [(req, blocks, computed, computed + 1)])
        computed += 1
        if computed == 128:
            assert [(o.start, o.end) for o in plan.saves[0].objects] == [(64, 128)]
    req.num_computed_tokens = computed
    # the tail of prompt + answer, to its last 16-token block: [128, 144)
    assert v.scheduler.request_finished(req, blocks) is True
    assert v.scheduler.num_tracked == 0
    v.step(SchedOut(), [])  # the step that gathers it, before vLLM says the request finished
    assert v.sent == set()
    v.finished_ids = {req.request_id}
    v.step(SchedOut(), [])
    assert v.sent == {req.request_id}  # now vLLM may free the blocks
    assert v.worker.flush(30)
    keys = PrefixKeys(NS, 16)
    keys.extend(req.all_token_ids)
    assert v.worker_store.contains([keys.key(e) for e in (64, 128, 144)]) == [True] * 3
    v.close()


def test_uncacheable_requests_and_short_hits_are_misses(tmp_path) -> None:
    root = _stored(tmp_path)
    v = FakeVllm(kvtier_config(root))
    lora = FakeRequest("d-0", PROMPT, lora_request=object())
    assert v.match(lora, 0) == (0, False)
    assert v.counters.totals["skipped_requests"] == 1
    salted = FakeRequest("d-1", PROMPT, cache_salt="tenant-b")
    assert v.match(salted, 0) == (0, False)  # another namespace
    plain = FakeRequest("d-2", PROMPT)
    assert v.match(plain, len(PROMPT) - 8) == (0, False)  # < 16
    v.close()
