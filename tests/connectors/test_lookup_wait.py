"""When a request waits a step for its lookup (``connectors/scheduler_side.py``).

A lookup can add at most the prompt past the engine's own hit (less the last
token). A request waits a step for a slow answer only when that is at least a
chunk; below ``min_load_tokens`` it is not looked up at all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from kvtier.connectors.plan import Counters
from kvtier.connectors.scheduler_side import ConnectorScheduler
from kvtier.metrics import StoreMetrics
from kvtier.store import TieredStore
from kvtier.tiers.disk import DiskTier
from tests.vllm.fakes import CHUNK, NS, FakeRequest, kvtier_config

PROMPT = [(i * 7919) % 5000 + 3 for i in range(150)]  # 2 chunks of 64 + a 22-token tail


class _HeldLookups(DiskTier):
    """A disk tier whose ``contains`` waits until ``release`` is set; counts its calls."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, 64 << 20)
        self.release = threading.Event()
        self.calls = 0

    def contains(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bool]:
        self.calls += 1
        self.release.wait(30.0)
        return super().contains(keys)


@pytest.fixture
def held(tmp_path: Path) -> Iterator[tuple[ConnectorScheduler, _HeldLookups, Counters]]:
    tier = _HeldLookups(tmp_path)
    counters = Counters()
    sched = ConnectorScheduler(
        config=kvtier_config(tmp_path, lookup_timeout_s=30.0),
        namespace=NS,
        store=TieredStore([tier], metrics=StoreMetrics()),
        load_async=True,
        counters=counters,
        metrics=StoreMetrics(),
    )
    yield sched, tier, counters
    tier.release.set()
    sched.close()
    tier.close()


def test_a_request_waits_for_a_slow_lookup_only_when_a_chunk_or_more_is_left(
    held: tuple[ConnectorScheduler, _HeldLookups, Counters],
) -> None:
    sched, tier, counters = held
    # nothing in G1: the lookup may find 149 tokens, so the request waits a step
    assert sched.get_num_new_matched_tokens(FakeRequest("cold", PROMPT), 0) == (None, False)
    assert counters.totals["lookups_deferred"] == 1
    # G1 holds all but 37 tokens (less than a chunk of 64): admitted now, no load
    local = 2 * CHUNK - 16
    assert sched.get_num_new_matched_tokens(FakeRequest("warm", PROMPT), local) == (0, False)
    assert counters.totals["lookups_not_waited"] == 1  # looked up, and not waited for
    assert counters.totals["lookups_deferred"] == 1
    assert sched.lookup_stats.not_waited == 1
    # G1 holds all but 9 tokens (below min_load_tokens, 16): not even looked up
    assert sched.get_num_new_matched_tokens(FakeRequest("hot", PROMPT), 140) == (0, False)
    _wait_until(lambda: tier.calls >= 2)  # the two lookup threads took "cold" and "warm"
    threading.Event().wait(0.1)
    assert tier.calls == 2  # and "hot" submitted none
    # the cold request still waits for its answer, and gets it once the tier answers
    tier.release.set()
    deadline = time.monotonic() + 10.0
    offer = sched.get_num_new_matched_tokens(FakeRequest("cold", PROMPT), 0)
    while offer[0] is None and time.monotonic() < deadline:  # the engine asks every step
        time.sleep(0.01)
        offer = sched.get_num_new_matched_tokens(FakeRequest("cold", PROMPT), 0)
    assert offer == (0, False)  # answered: nothing is stored here
    assert counters.totals["lookups"] == 1  # "cold"'s; "warm" was admitted without one


def _wait_until(done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
