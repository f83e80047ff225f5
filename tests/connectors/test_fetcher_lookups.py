"""Lookups never queue behind loads: a hit's lookup is answered while every load thread reads."""

from __future__ import annotations

import time

from kvtier.connectors.load_job import Fetcher
from kvtier.metrics import StoreMetrics
from kvtier.store import TieredStore
from tests.connectors.test_async_kvtier_loads import StallTier


def test_a_lookup_is_answered_while_every_load_thread_is_busy() -> None:
    tier = StallTier({b"k" * 16: b"v"}, stall_s=30.0)  # a get blocks until released
    fetcher = Fetcher(TieredStore([tier], metrics=StoreMetrics()), workers=2)
    try:
        far = time.monotonic() + 60
        loads = [fetcher.submit([b"k" * 16], far) for _ in range(4)]  # 2 reading, 2 queued
        t0 = time.monotonic()
        lookup = fetcher.submit_contains([b"k" * 16, b"x" * 16], far)
        assert lookup.result(timeout=5) == [True, False]
        assert time.monotonic() - t0 < 5 and not any(f.done() for f in loads)
        for f in loads[2:]:
            fetcher.abandon(f)  # not started: cancelled, holds nothing
        assert fetcher.stuck == 0 and not fetcher.saturated and not fetcher.lookups_saturated
        for f in loads[:2]:
            fetcher.abandon(f)  # reading: they hold the load threads, not the lookup ones
        assert fetcher.saturated and not fetcher.lookups_saturated and fetcher.stuck == 2
        assert fetcher.submit_contains([b"k" * 16], far).result(timeout=5) == [True]
    finally:
        tier.release.set()
        fetcher.shutdown()
    deadline = time.monotonic() + 10
    while fetcher.stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fetcher.stuck == 0
