"""What ``bench/tier_load.py`` reports is what it says: percentiles, objects, bars."""

from __future__ import annotations

import os

import pytest
import torch

from kvtier.bench.tier_load import bars, p99_ratio_interval
from kvtier.bench.tier_load_clients import (
    CHUNKS,
    ModelChunk,
    bound_to,
    object_block,
    percentile,
    same_object,
)
from kvtier.block import HEADER_SIZE, verify_block
from kvtier.errors import KeyMismatchError


def test_percentile_is_the_nearest_rank() -> None:
    samples = [float(i) for i in range(1, 201)]  # 1..200
    assert percentile(samples, 0.5) == 100.0
    assert percentile(samples, 0.99) == 198.0
    assert percentile(samples, 0.999) == 200.0  # fewer than 1,000 samples: the largest
    assert percentile([5.0], 0.99) == 5.0


def test_model_chunks_have_the_sizes_the_issue_names() -> None:
    mib = 1024 * 1024
    sizes = {
        name: c.layers * 2 * c.tokens * c.kv_heads * c.head_dim * c.dtype.itemsize
        for name, c in CHUNKS.items()
    }
    assert sizes == {"smollm2": 11.25 * mib, "llama3-8b": 32 * mib}


def test_a_block_bound_to_a_key_verifies_for_that_key_only() -> None:
    small = ModelChunk("tiny", 2, 1, 8, torch.float32, tokens=4)
    block = object_block(small)
    key, other = os.urandom(16), os.urandom(16)
    bound = bound_to(block, key)
    verify_block(bound, key=key)
    with pytest.raises(KeyMismatchError):
        verify_block(bound, key=other)
    assert same_object(bound, block, key)
    assert not same_object(bound, block, other)
    for at in (HEADER_SIZE, len(bound) - 1):  # the body's first and last byte
        damaged = bound[:at] + bytes([bound[at] ^ 1]) + bound[at + 1 :]
        assert not same_object(damaged, block, key)
    assert not same_object(bound[:-1], block, key)
    assert not same_object(None, block, key)


def _row(tier: str, clients: int, p99: float, op: str = "get") -> dict[str, object]:
    return {"tier": tier, "nodes": 1, "object_mib": 11.25, "op": op, "clients": clients,
            "p99_ms": p99}  # fmt: skip


def test_the_bar_compares_the_tier_with_the_raw_client_row_by_row() -> None:
    rows = [_row("aerospike-raw", 1, 10.0), _row("aerospike", 1, 11.9),
            _row("aerospike-raw", 8, 50.0), _row("aerospike", 8, 55.0), _row("redis", 8, 90.0)]  # fmt: skip
    kill = {"lost_acknowledged_writes": 0, "wrong_bytes_returned": 0, "failed_requests": 0}
    out = bars(rows, kill)
    assert [r["p99_ratio"] for r in out["tier_p99_over_raw"]] == [1.19, 1.1]
    assert out["tier_within_1_2x_of_raw_p99"] and out["node_kill_clean"]
    rows.append(_row("aerospike", 8, 61.0, op="put"))
    rows.append(_row("aerospike-raw", 8, 50.0, op="put"))
    assert not bars(rows, {**kill, "failed_requests": 1})["node_kill_clean"]
    assert not bars(rows, kill)["tier_within_1_2x_of_raw_p99"]  # 61 / 50 = 1.22


def test_the_p99_ratio_interval_is_wide_for_few_samples_and_holds_a_clear_gap() -> None:
    import random

    rng = random.Random(0)
    same = [rng.expovariate(1.0) for _ in range(400)]
    other = [rng.expovariate(1.0) for _ in range(400)]
    lo, hi = p99_ratio_interval(same, other)
    assert lo < 1.0 < hi  # one distribution: the interval holds 1
    assert hi - lo > 0.3  # and 400 samples leave it wide
    width = hi - lo
    slow = [3 * x for x in same]
    assert p99_ratio_interval(slow, other)[0] > 1.5  # three times slower is told apart
    many = [rng.expovariate(1.0) for _ in range(4000)]
    many2 = [rng.expovariate(1.0) for _ in range(4000)]
    lo4, hi4 = p99_ratio_interval(many, many2)
    assert lo4 < 1.0 < hi4 and hi4 - lo4 < 0.6 * width  # 10x the samples, a narrower one
