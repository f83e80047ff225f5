"""A small stand-in for vLLM around the connector's two sides: requests, scheduler outputs, a forward.

``FakeVllm`` drives the connector core's two sides (``ConnectorScheduler``,
``ConnectorWorker``) through vLLM's adapter code the way vLLM 0.32
does (``../shared/reference/vllm-connector.md``, section 2) on a hand-built
CPU cache (``PackedCpuKV``) and a real store on a temporary directory. Its
"forward pass" writes a deterministic KV for each token (a function of the
token id, its position, layer, K/V, head and dim), so what a load placed can
be checked against what a cold run computes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtier.config import DiskTierConfig, KvtierConfig
from kvtier.connectors.layouts import PackedCpuKV
from kvtier.connectors.plan import Counters, StepPlan
from kvtier.connectors.scheduler_side import ConnectorScheduler
from kvtier.connectors.vllm_steps import build_step_plan
from kvtier.connectors.worker_side import ConnectorWorker
from kvtier.factory import build_store
from kvtier.keys import CacheNamespace
from kvtier.metrics import StoreMetrics
from kvtier.store import TieredStore

L, H, D, BS, NB = 2, 2, 8, 32, 24
CHUNK = 64
NS = CacheNamespace("fake-model", "fp0", L, H, D, "float32", chunk_size=CHUNK)


def kvtier_config(path: Path, **connector: Any) -> KvtierConfig:
    """One disk tier at ``path``, 64-token chunks, 16-token key blocks."""
    return KvtierConfig(
        chunk_size=CHUNK,
        page_tokens=16,
        tiers=[DiskTierConfig(path=path, capacity=64 << 20)],
        connector={"min_load_tokens": 16, **connector},
    )


def true_kv(tokens: list[int], start: int, end: int) -> torch.Tensor:
    """The KV a cold forward computes for tokens ``[start, end)``: ``[L, 2, T, H, D]``."""
    pos = torch.arange(start, end, dtype=torch.float32)
    tok = torch.tensor(tokens[start:end], dtype=torch.float32)
    grid = torch.arange(L * 2 * H * D, dtype=torch.float32).view(L, 2, 1, H, D)
    return torch.sin(grid + tok.view(1, 1, -1, 1, 1) * 0.37 + pos.view(1, 1, -1, 1, 1) * 0.011)


@dataclass
class FakeRequest:
    """The attributes of vLLM's ``Request`` the scheduler side reads."""

    request_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_request: Any = None
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)


@dataclass
class NewReq:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedReqs:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedOut:
    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: CachedReqs = field(default_factory=CachedReqs)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)


class FakeVllm:
    """One vLLM "process": a scheduler side, a worker side, a CPU cache and a block allocator."""

    def __init__(
        self, config: KvtierConfig, *, load_async: bool = False, store: TieredStore | None = None
    ) -> None:
        self.config = config
        self.counters = Counters()
        # each side opens its own store, as in vLLM's two processes (or both use ``store``,
        # which the caller closes)
        self._owns_stores = store is None
        self.metrics = StoreMetrics() if store is None else store.metrics
        self.sched_store = build_store(config, StoreMetrics()) if store is None else store
        self.worker_store = build_store(config, self.metrics) if store is None else store
        self.scheduler = ConnectorScheduler(
            config=config,
            namespace=NS,
            store=self.sched_store,
            load_async=load_async,
            counters=self.counters,
            metrics=StoreMetrics(),
        )
        self.worker = ConnectorWorker(
            config=config, store=self.worker_store, counters=self.counters, metrics=self.metrics
        )
        self.buf = torch.zeros(L, NB, H, BS, 2 * D)
        self.layout = PackedCpuKV([self.buf[i] for i in range(L)], D)
        self.worker.register(self.layout)
        self.free = list(range(NB - 1, -1, -1))  # LIFO, unsorted block tables like vLLM's
        self.errors: set[int] = set()
        self.finished_ids: set[str] = set()

    def alloc(self, n_tokens: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-n_tokens // BS))]

    def step(
        self, out: SchedOut, forward: list[tuple[FakeRequest, list[int], int, int]]
    ) -> StepPlan:
        """One step: plan, sync loads, the forward (writes true KV), saves, finished, reports."""
        out.finished_req_ids |= self.finished_ids
        self.finished_ids = set()
        plan = build_step_plan(self.scheduler, out)
        self.worker.start_loads(plan.loads)
        for req, blocks, lo, hi in forward:
            if hi > lo:
                self.layout.scatter(true_kv(req.all_token_ids, lo, hi), blocks, lo)
        self.worker.save(plan.saves)
        sent, recvd = self.worker.finished(out.finished_req_ids)
        self.results = self.worker.take_results()
        self.sent, self.recvd = sent, recvd
        self.errors = self.worker.take_load_errors()
        self.scheduler.update(recvd, self.worker.report())
        return plan

    def match(self, request: Any, n_local: int) -> tuple[int, bool]:
        """``get_num_new_matched_tokens``, asked again while the lookup is in flight (as vLLM does)."""
        deadline = time.monotonic() + 30.0
        while True:
            n, load_async = self.scheduler.get_num_new_matched_tokens(request, n_local)
            if n is not None:
                return n, load_async
            assert time.monotonic() < deadline, "the lookup never answered"
            time.sleep(0.001)

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()
        if self._owns_stores:
            self.worker_store.close()
            self.sched_store.close()
