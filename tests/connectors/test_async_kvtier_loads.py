"""The kvtier connector's asynchronous loads: a stalled tier never stalls a token.

Also block-granular reuse: any prompt length, and multi-round conversations,
load all but what G1 would recompute, with the cold run's greedy output.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kvtier.config import KvtierConfig
from kvtier.connectors.kvtier_connector import KvtierConnector
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.request import RequestStatus
from kvtier.metrics import StoreMetrics
from kvtier.store import TieredStore
from kvtier.tiers.base import Tier, TierUsage
from kvtier.tiers.cpu import CpuTier
from tests.engine.tiny_models import write_tiny_model
from tests.support.timeouts import scaled

CHUNK = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
STALL_S = 3.0


class StallTier(Tier):
    """Answers ``contains`` at once; a ``get`` blocks for ``stall_s`` (deaf to its deadline)."""

    name = "stall"

    def __init__(self, data: dict[bytes, bytes], stall_s: float) -> None:
        self.data = dict(data)
        self.stall_s = stall_s
        self.gets = 0
        self.release = threading.Event()

    def contains(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bool]:
        return [k in self.data for k in keys]

    def get(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bytes | None]:
        self.gets += 1
        self.release.wait(self.stall_s)  # a tier stuck far past any deadline
        return [self.data.get(k) for k in keys]

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        return [False] * len(items)  # read-only: nothing is saved back into it

    def delete(self, keys: Sequence[bytes]) -> int:
        return 0

    def usage(self) -> TierUsage:
        return TierUsage(0, None, len(self.data))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=11)
    return path


def _llm(model_dir: Path, connector: KvtierConnector | None = None, **kw) -> LLM:
    base = dict(dtype="float32", device="cpu", block_size=16, num_threads=1)
    base.update(kw)
    return LLM(str(model_dir), connector=connector, **base)


def _config(**connector: object) -> KvtierConfig:
    return KvtierConfig(chunk_size=CHUNK, connector={"min_load_tokens": 16, **connector})


def _filled_cpu_store(model_dir: Path, prompts: list[list[int]]) -> TieredStore:
    store = TieredStore([CpuTier(64 << 20)])
    a = _llm(model_dir, KvtierConnector(config=_config(), store=store))
    a.generate(prompts, GREEDY)
    a.engine.connector.flush()
    return store


def test_a_stalled_load_never_stalls_running_requests(model_dir: Path) -> None:
    g = torch.Generator().manual_seed(1)
    stored = torch.randint(3, 380, (100,), generator=g).tolist()
    other = torch.randint(3, 380, (12,), generator=g).tolist()
    cold = _llm(model_dir).generate([stored], GREEDY)[0].token_ids
    cpu = _filled_cpu_store(model_dir, [stored]).tiers[0]
    stall = StallTier(dict(cpu.drain()), STALL_S)  # type: ignore[attr-defined]
    conn = KvtierConnector(
        config=_config(load_timeout_s=0.3), store=TieredStore([stall], metrics=StoreMetrics())
    )
    eng = _llm(model_dir, conn).engine
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    eng.add_request(other, long, "running")
    eng.step()  # "running" is prefilled and decoding
    eng.add_request(stored, GREEDY, "stuck")
    steps_loading = missed = 0
    t0 = time.monotonic()
    final = None
    while final is None and time.monotonic() - t0 < 60:
        stuck = eng.scheduler.find("stuck")
        loading = stuck is not None and stuck.status == RequestStatus.LOADING
        decoding = eng.scheduler.find("running") is not None
        outs = eng.step()
        if loading and decoding:
            steps_loading += 1
            missed += not any(o.request_id == "running" for o in outs)
        final = next((o for o in outs if o.request_id == "stuck" and o.finished), None)
    stall.release.set()
    assert stall.gets >= 1  # the load really went to the stalled tier
    # while "stuck" waited for its KV, every step gave "running" its next token
    assert steps_loading >= 2 and missed == 0
    # the stuck request ended after its deadline by recomputing: the cold output
    assert final is not None and final.token_ids == cold
    assert final.num_external_tokens == 0
    assert conn.stats.load_failures == 1 and "deadline" in conn.stats.last_errors[-1]
    assert eng.stats().recomputed_after_load_failure_tokens == 99  # all but the last token
    eng.abort("running")
    eng.shutdown()


class SlowLookupTier(StallTier):
    """A ``contains`` blocks for ``stall_s`` (deaf to its deadline); a ``get`` answers at once."""

    def __init__(self, data: dict[bytes, bytes], stall_s: float) -> None:
        super().__init__(data, stall_s)
        self.lookups = 0

    def contains(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bool]:
        self.lookups += 1
        self.release.wait(self.stall_s)
        return [k in self.data for k in keys]

    def get(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bytes | None]:
        return [self.data.get(k) for k in keys]


def _run_beside_a_decode(eng, prompt: list[int]) -> tuple[object, int, int]:
    """Steps until ``prompt`` ("new") ends while "running" decodes: (output, steps it waited, misses).

    A waited step is one where "new" was still waiting for its lookup while
    "running" was decoding; a miss is such a step that gave "running" no token.
    """
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    eng.add_request(prompt[:12], long, "running")
    t0 = time.monotonic()
    while not any(o.request_id == "running" for o in eng.step()):  # its own lookup, then prefill
        assert time.monotonic() - t0 < 60
    eng.add_request(prompt, GREEDY, "new")
    waited = missed = 0
    final = None
    t0 = time.monotonic()
    while final is None and time.monotonic() - t0 < 60:
        new = eng.scheduler.find("new")
        pending = new is not None and new.status == RequestStatus.WAITING
        decoding = eng.scheduler.find("running") is not None
        outs = eng.step()
        if pending and decoding:
            waited += 1
            missed += not any(o.request_id == "running" for o in outs)
        final = next((o for o in outs if o.request_id == "new" and o.finished), None)
    eng.abort("running")
    return final, waited, missed


def test_a_stalled_lookup_never_stalls_running_requests(model_dir: Path) -> None:
    g = torch.Generator().manual_seed(3)
    stored = torch.randint(3, 380, (100,), generator=g).tolist()
    cold = _llm(model_dir).generate([stored], GREEDY)[0].token_ids
    cpu = _filled_cpu_store(model_dir, [stored]).tiers[0]
    slow = SlowLookupTier(dict(cpu.drain()), STALL_S)  # type: ignore[attr-defined]
    conn = KvtierConnector(
        config=_config(lookup_timeout_s=0.3), store=TieredStore([slow], metrics=StoreMetrics())
    )
    eng = _llm(model_dir, conn).engine
    try:
        final, waited, missed = _run_beside_a_decode(eng, stored)
    finally:
        slow.release.set()
    assert slow.lookups >= 1  # the lookup really went to the stalled tier
    # while "new" waited for its lookup, every step gave "running" its next token
    assert waited >= 2 and missed == 0
    # past its deadline the lookup is a miss: "new" is computed, the cold output
    assert final is not None and final.token_ids == cold and final.num_external_tokens == 0
    # ("running", 12 tokens, is not looked up: it could load less than min_load_tokens)
    assert conn.lookup_stats.timeouts == 1 and conn.lookup_stats.deferred >= 2
    eng.shutdown()


def test_a_slow_lookup_defers_the_request_then_loads(model_dir: Path) -> None:
    g = torch.Generator().manual_seed(4)
    stored = torch.randint(3, 380, (100,), generator=g).tolist()
    cold = _llm(model_dir).generate([stored], GREEDY)[0].token_ids
    cpu = _filled_cpu_store(model_dir, [stored]).tiers[0]
    slow = SlowLookupTier(dict(cpu.drain()), 0.2)  # answers well within its deadline
    conn = KvtierConnector(
        config=_config(lookup_timeout_s=scaled(30.0)),
        store=TieredStore([slow], metrics=StoreMetrics()),
    )
    eng = _llm(model_dir, conn).engine
    final, waited, missed = _run_beside_a_decode(eng, stored)
    assert waited >= 1 and missed == 0 and conn.lookup_stats.deferred >= 1
    assert final is not None and final.token_ids == cold
    assert final.num_external_tokens == 99  # all but the last token, once the lookup answered
    assert conn.lookup_stats.timeouts == 0
    eng.shutdown()


def test_loads_are_refused_while_every_io_thread_is_stuck(model_dir: Path) -> None:
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 380, (70,), generator=g).tolist() for _ in range(3)]
    cpu = _filled_cpu_store(model_dir, prompts).tiers[0]
    stall = StallTier(dict(cpu.drain()), 30.0)  # type: ignore[attr-defined]
    conn = KvtierConnector(
        config=_config(load_timeout_s=0.2, load_workers=1),
        store=TieredStore([stall], metrics=StoreMetrics()),
    )
    llm = _llm(model_dir, conn)
    cold = [o.token_ids for o in _llm(model_dir).generate(prompts, GREEDY)]
    try:
        # the first load takes the only I/O thread and stalls past its deadline
        assert llm.generate(prompts[:1], GREEDY)[0].token_ids == cold[0]
        assert conn.stats.load_failures == 1 and conn._fetcher.stuck == 1
        # while that thread is stuck, later loads are refused at once: no wait, no queue
        outs = llm.generate(prompts[1:], GREEDY)
        assert [o.token_ids for o in outs] == cold[1:]
        assert conn.stats.loads_refused == 2 and conn.stats.load_requests == 1
        assert stall.gets == 1
    finally:
        stall.release.set()
    deadline = time.monotonic() + 10
    while conn._fetcher.stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert conn._fetcher.stuck == 0  # the tier came back: the thread is free again
    llm.engine.shutdown()


@pytest.mark.parametrize("seed", [0, 1])
def test_random_lengths_load_all_but_the_last_token(model_dir: Path, seed: int) -> None:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randrange(20, 300))] for _ in range(5)]
    cold = [o.token_ids for o in _llm(model_dir).generate(prompts, GREEDY)]
    store = _filled_cpu_store(model_dir, prompts)
    conn = KvtierConnector(config=_config(), store=store)
    b = _llm(model_dir, conn)
    outs = b.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == cold
    for o, p in zip(outs, prompts, strict=True):
        assert o.num_external_tokens == len(p) - 1  # stored whole: only the last token computed
    assert conn.stats.load_failures == 0


def test_multi_round_conversation_loads_the_last_round_and_its_answer(model_dir: Path) -> None:
    """Each round re-sends the history plus a new question; a fresh engine per round."""
    g = torch.Generator().manual_seed(4)
    store = TieredStore([CpuTier(64 << 20)])
    history = torch.randint(3, 380, (45,), generator=g).tolist()
    answer_params = SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True)
    for rnd in range(4):
        prompt = history + torch.randint(3, 380, (5 + rnd,), generator=g).tolist()
        cold = _llm(model_dir).generate([prompt], answer_params)[0]
        conn = KvtierConnector(config=_config(), store=store)
        llm = _llm(model_dir, conn)  # a new engine: G1 is empty, only kvtier helps
        out = llm.generate([prompt], answer_params)[0]
        assert out.token_ids == cold.token_ids
        if rnd > 0:
            # everything up to the last full block of the previous prompt + answer whose KV
            # was computed (all but the answer's last token) is loaded
            previous = len(history)
            assert out.num_external_tokens == ((previous - 1) // 16) * 16, (rnd, previous)
        conn.flush()
        history = prompt + out.token_ids
