"""The connector's behaviours, run alike through the bundled engine's adapter and vLLM's.

Both engines drive the same core (``scheduler_side.py`` + ``worker_side.py``);
these tests hold each behaviour for both adapters by running the same
scenario twice:

* ``engine``: ``KvtierConnector`` called as the bundled engine calls it
  (``engine/connector.py``), over the engine's one-tensor cache (``EngineKV``);
* ``vllm``: the core driven through vLLM's adapter code (``vllm_steps.py``) the
  way vLLM 0.32 drives its connector (``tests/vllm/fakes.py``), over vLLM's
  packed CPU cache (``PackedCpuKV``).

No model runs: a "forward pass" writes a deterministic KV per token
(``true_kv``), so what a load placed is compared with what a cold run
computes. Every process of a test shares one disk directory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.block import encode_block
from kvtier.config import KvtierConfig
from kvtier.connectors.kvtier_connector import KvtierConnector
from kvtier.connectors.layouts import EngineKV
from kvtier.engine.connector import (
    ConnectorRequest,
    LoadMetadata,
    LoadSpec,
    SaveMetadata,
    SaveSpec,
)
from kvtier.engine.kv_cache import KVCacheLayout
from kvtier.factory import build_store
from kvtier.keys import PrefixKeys
from kvtier.metrics import StoreMetrics
from kvtier.store import TieredStore
from kvtier.tiers.disk import DiskTier
from tests.vllm.fakes import (
    BS,
    CHUNK,
    NS,
    CachedReqs,
    FakeRequest,
    FakeVllm,
    NewReq,
    SchedOut,
    kvtier_config,
    true_kv,
)

L, H, D = NS.num_layers, NS.num_kv_heads, NS.head_dim
ENGINE_BS, ENGINE_BLOCKS = 16, 64
PROMPT = [(i * 7919) % 5000 + 3 for i in range(150)]  # 2 chunks of 64 + a 22-token tail
WAIT_S = 30.0


@dataclass
class Served:
    """What one request got."""

    loaded: int  # tokens placed from the store
    kv_true: bool  # the cache holds the cold KV of every token with KV
    deferred: int  # times the lookup answered "ask again next step"


class EngineProcess:
    """A bundled-engine process: ``KvtierConnector`` called as ``LLMEngine`` calls it."""

    def __init__(self, config: KvtierConfig, store: TieredStore | None = None, **kw: Any) -> None:
        self.conn = KvtierConnector(config=config, store=store, **kw)
        self.cache = torch.zeros(L, 2, ENGINE_BLOCKS, ENGINE_BS, H, D)
        self.layout = EngineKV(self.cache)
        self.conn.register_kv_caches(
            self.cache,
            KVCacheLayout(
                NS.model_id,
                NS.weights_fingerprint,
                L,
                H,
                D,
                "float32",
                ENGINE_BS,
                ENGINE_BLOCKS,
                "cpu",
            ),
        )
        self.free = list(range(ENGINE_BLOCKS))

    @property
    def quarantine(self) -> Any:
        return self.conn.quarantine

    @property
    def verify_stats(self) -> Any:
        return self.conn.verify_stats

    def set_sampler(self, sample: Callable[[bytes], bool]) -> None:
        assert self.conn.scheduler is not None
        self.conn.scheduler._sample = sample

    def serve(self, rid: str, prompt: list[int], answer: Sequence[int] = ()) -> Served:
        tokens = list(prompt)
        p = len(prompt)
        blocks = [self.free.pop() for _ in range(-(-(p + len(answer)) // ENGINE_BS))]

        keys = PrefixKeys(NS, ENGINE_BS)  # the engine's own, as its block manager makes them
        keys.extend(prompt)

        def view(computed: int) -> ConnectorRequest:
            return ConnectorRequest(rid, prompt, tokens, blocks, computed, keys)

        deferred, deadline = 0, time.monotonic() + WAIT_S
        while (answer_n := self.conn.get_num_new_matched_tokens(view(0), 0)) is None:
            deferred += 1
            assert time.monotonic() < deadline, "the lookup never answered"
            self.conn.wait_for_async_loads(0.005)
        n, is_async = answer_n if isinstance(answer_n, tuple) else (answer_n, False)
        n = max(0, min(n, p - 1))
        self.conn.update_state_after_alloc(view(0), blocks, n)
        loaded = 0
        if n:
            self.conn.start_load_kv(LoadMetadata([LoadSpec(rid, tokens, blocks, 0, n, is_async)]))
            outcome = self.conn.wait_for_load().results.get(rid)
            while outcome is None:
                assert time.monotonic() < deadline, "the load never ended"
                self.conn.wait_for_async_loads(0.005)
                outcome = self.conn.get_finished().results.get(rid)
            loaded = outcome.loaded_tokens
        # the forward pass computes the rest of the prompt (G1 had nothing: start 0)
        self.layout.scatter(true_kv(tokens, loaded, p), blocks, loaded)
        self.conn.save_kv(SaveMetadata([SaveSpec(rid, tokens, blocks, p, p, p, "prefill", True)]))
        computed = p
        for tok in answer:  # one decode step per generated token
            tokens.append(tok)
            if computed < len(tokens) - 1:
                self.layout.scatter(true_kv(tokens, computed, computed + 1), blocks, computed)
                computed += 1
                if computed % ENGINE_BS == 0:
                    spec = SaveSpec(rid, tokens, blocks, p, computed, p, "decode", True)
                    self.conn.save_kv(SaveMetadata([spec]))
        kv_true = torch.equal(self.layout.gather(blocks, 0, computed), true_kv(tokens, 0, computed))
        self.conn.request_finished(view(computed), blocks)
        self.free.extend(blocks)
        return Served(loaded, kv_true, deferred)

    def offers_around_a_preemption(self, rid: str, prompt: list[int]) -> tuple[int, int]:
        """The offer for a new request, which is loaded; then the offer when the engine
        asks again after preempting it (its blocks freed, nothing computed)."""
        keys = PrefixKeys(NS, ENGINE_BS)
        keys.extend(prompt)
        blocks = [self.free.pop() for _ in range(-(-len(prompt) // ENGINE_BS))]
        view = ConnectorRequest(rid, prompt, list(prompt), blocks, 0, keys)
        first = self._offer(view)
        self.conn.update_state_after_alloc(view, blocks, first)
        self.conn.start_load_kv(LoadMetadata([LoadSpec(rid, prompt, blocks, 0, first, True)]))
        deadline = time.monotonic() + WAIT_S
        while rid not in self.conn.get_finished().results:
            assert time.monotonic() < deadline, "the load never ended"
            self.conn.wait_for_async_loads(0.005)
        second = self._offer(view)
        self.conn.request_finished(view, blocks)
        self.free.extend(blocks)
        return first, second

    def _offer(self, view: ConnectorRequest) -> int:
        deadline = time.monotonic() + WAIT_S
        while (answer := self.conn.get_num_new_matched_tokens(view, 0)) is None:
            assert time.monotonic() < deadline, "the lookup never answered"
            self.conn.wait_for_async_loads(0.005)
        return answer[0] if isinstance(answer, tuple) else answer

    def flush(self) -> None:
        assert self.conn.flush(WAIT_S)

    def close(self) -> None:
        self.conn.shutdown()


class VllmProcess:
    """A vLLM process: the core driven through vLLM's adapter code (``FakeVllm``)."""

    def __init__(self, config: KvtierConfig, store: TieredStore | None = None, **kw: Any) -> None:
        self.v = FakeVllm(config, load_async=True, store=store)

    @property
    def quarantine(self) -> Any:
        return self.v.scheduler.quarantine

    @property
    def verify_stats(self) -> Any:
        return self.v.worker.verify_stats

    def set_sampler(self, sample: Callable[[bytes], bool]) -> None:
        self.v.scheduler._sample = sample

    def serve(self, rid: str, prompt: list[int], answer: Sequence[int] = ()) -> Served:
        v, p = self.v, len(prompt)
        req = FakeRequest(rid, prompt)
        deferred, deadline = 0, time.monotonic() + WAIT_S
        while True:
            n, _ = v.scheduler.get_num_new_matched_tokens(req, 0)
            if n is not None:
                break
            deferred += 1
            assert time.monotonic() < deadline, "the lookup never answered"
            time.sleep(0.005)
        blocks = v.alloc(p + len(answer))
        v.scheduler.update_state_after_alloc(req, blocks, n)
        computed = 0
        if n:  # an asynchronous load: vLLM steps the others meanwhile
            v.step(SchedOut(), [])
            while rid not in v.recvd:
                assert time.monotonic() < deadline, "the load never ended"
                time.sleep(0.005)
                v.step(SchedOut(), [])
            placed = sum(r.placed for r in v.results if r.request_id == rid)
            # vLLM recomputes from the block of the first token not placed
            computed = placed if placed == n else (placed // BS) * BS
            v.scheduler.update_state_after_alloc(req, blocks, 0)
        out = SchedOut([NewReq(rid, (blocks,), computed)], num_scheduled_tokens={rid: p - computed})
        v.step(out, [(req, blocks, computed, p)])
        loaded = computed
        computed = p
        for tok in answer:
            req.all_token_ids.append(tok)
            if computed < len(req.all_token_ids) - 1:
                out = SchedOut(
                    scheduled_cached_reqs=CachedReqs([rid], set(), [None], [computed]),
                    num_scheduled_tokens={rid: 1},
                )
                v.step(out, [(req, blocks, computed, computed + 1)])
                computed += 1
        kv_true = torch.equal(
            v.layout.gather(blocks, 0, computed), true_kv(req.all_token_ids, 0, computed)
        )
        req.num_computed_tokens = computed
        if v.scheduler.request_finished(req, blocks):
            v.step(SchedOut(), [])  # gathers its last saves
        v.finished_ids = {rid}
        v.step(SchedOut(), [])
        v.free.extend(blocks)
        return Served(loaded, kv_true, deferred)

    def offers_around_a_preemption(self, rid: str, prompt: list[int]) -> tuple[int, int]:
        """The offer for a new request, which is loaded; then vLLM's question again after
        it preempted the request."""
        v = self.v
        req = FakeRequest(rid, prompt)
        first, _ = v.match(req, 0)
        blocks = v.alloc(len(prompt))
        v.scheduler.update_state_after_alloc(req, blocks, first)
        v.step(SchedOut(), [])
        deadline = time.monotonic() + WAIT_S
        while rid not in v.recvd:
            assert time.monotonic() < deadline, "the load never ended"
            v.step(SchedOut(), [])
        v.scheduler.update_state_after_alloc(req, blocks, 0)
        second, _ = v.match(req, 0)
        v.scheduler.request_finished(req, blocks)
        v.free.extend(blocks)
        return first, second

    def flush(self) -> None:
        assert self.v.worker.flush(WAIT_S)
        self.v.step(SchedOut(), [])  # the worker's report reaches the scheduler side

    def close(self) -> None:
        self.v.close()


ADAPTERS = {"engine": EngineProcess, "vllm": VllmProcess}


@pytest.fixture(params=sorted(ADAPTERS))
def process(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """Starts a process of the adapter under test (closed at the end)."""
    started: list[Any] = []

    def start(config: KvtierConfig, **kw: Any) -> Any:
        proc = ADAPTERS[request.param](config, **kw)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.close()


def _keys(tokens: list[int]) -> PrefixKeys:
    keys = PrefixKeys(NS, 16)
    keys.extend(tokens)
    return keys


def _stored(process: Callable[..., Any], root: Path, prompt: list[int] = PROMPT) -> None:
    first = process(kvtier_config(root, verify_fraction=0.0))
    assert first.serve("a-0", prompt).loaded == 0
    first.flush()


def test_a_hit_loads_all_but_the_last_token(process, tmp_path) -> None:
    _stored(process, tmp_path)
    got = process(kvtier_config(tmp_path)).serve("b-0", PROMPT)
    assert got.loaded == len(PROMPT) - 1 and got.kv_true


def test_a_partial_hit_loads_the_shared_full_chunks(process, tmp_path) -> None:
    _stored(process, tmp_path)
    fork = PROMPT[:100] + [4000 + i for i in range(30)]  # forks inside the stored tail
    got = process(kvtier_config(tmp_path)).serve("b-1", fork)
    assert got.loaded == CHUNK and got.kv_true


def test_a_corrupt_object_is_a_miss_from_there_on(process, tmp_path) -> None:
    _stored(process, tmp_path)
    disk = DiskTier(tmp_path, 64 << 20)
    second = _keys(PROMPT).key(2 * CHUNK)
    assert disk.delete([second]) == 1
    disk.put([(second, b"not a block at all" * 100)])
    disk.close()
    got = process(kvtier_config(tmp_path)).serve("b-2", PROMPT)
    assert got.loaded == CHUNK and got.kv_true  # the first chunk, the rest recomputed


def test_verification_computes_a_sampled_object_and_quarantines_a_wrong_one(
    process, tmp_path
) -> None:
    _stored(process, tmp_path)
    bad = _keys(PROMPT).key(2 * CHUNK)
    disk = DiskTier(tmp_path, 64 << 20)
    assert disk.delete([bad]) == 1
    disk.put([(bad, encode_block(true_kv(PROMPT, CHUNK, 2 * CHUNK) + 0.5, key=bad))])
    disk.close()
    proc = process(kvtier_config(tmp_path, verify_fraction=1.0))
    proc.set_sampler(lambda key: key == bad)
    got = proc.serve("b-3", PROMPT)
    assert got.loaded == CHUNK and got.kv_true  # the load stopped before the sampled object
    proc.flush()
    stats = proc.verify_stats
    assert (stats.mismatched, stats.matched) == (1, 1)  # the wrong chunk, then the right tail
    assert bad in proc.quarantine
    store = build_store(kvtier_config(tmp_path), StoreMetrics())
    assert store.contains([bad]) == [False]  # deleted from the tier
    store.close()


def test_decode_saves_serve_the_next_round(process, tmp_path) -> None:
    first = process(kvtier_config(tmp_path))
    prompt = PROMPT[:70]
    answer = [900 + i for i in range(45)]
    first.serve("a-1", prompt, answer)
    first.flush()
    history = prompt + answer
    next_round = history + [3000 + i for i in range(9)]
    got = process(kvtier_config(tmp_path)).serve("b-4", next_round)
    # up to the last full block of prompt + answer whose KV was computed (all but the
    # answer's last token): the first chunk, then the tail saved when the request ended
    assert got.loaded == ((len(history) - 1) // 16) * 16 and got.kv_true


class _SlowLookups(DiskTier):
    """A disk tier whose ``contains`` waits until ``release`` is set (deaf to deadlines)."""

    release = threading.Event()

    def contains(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bool]:
        self.release.wait(WAIT_S)
        return super().contains(keys)


@pytest.mark.parametrize("answers", [True, False])
def test_lookups_run_off_the_step_thread(process, tmp_path, answers: bool) -> None:
    _stored(process, tmp_path)
    slow = _SlowLookups(tmp_path, 64 << 20)
    slow.release = threading.Event()
    timeout = 0.2 if not answers else WAIT_S
    cfg = kvtier_config(tmp_path, lookup_timeout_s=timeout)
    proc = process(cfg, store=TieredStore([slow], metrics=StoreMetrics()))
    if answers:  # the tier answers a little later: the request waits, then loads
        threading.Timer(0.1, slow.release.set).start()
    try:
        got = proc.serve("b-5", PROMPT)
    finally:
        slow.release.set()
    assert got.deferred >= 1 and got.kv_true  # asked again while the lookup ran
    assert got.loaded == (len(PROMPT) - 1 if answers else 0)  # past its deadline: a miss
    slow.close()


def test_a_preempted_request_is_offered_its_hit_again_but_not_under_vllm(process, tmp_path) -> None:
    """The bundled engine asks again only after preempting a request: its hit is loaded
    again. vLLM asks again after a failed load too, and loops when offered the same hit
    (``scheduler_side.py``): it is offered a load once."""
    _stored(process, tmp_path)
    proc = process(kvtier_config(tmp_path))
    first, second = proc.offers_around_a_preemption("b-6", PROMPT)
    assert first == len(PROMPT) - 1
    assert second == (len(PROMPT) - 1 if isinstance(proc, EngineProcess) else 0)
