"""A hostile lz4 size is refused before anything is decompressed or allocated."""

from __future__ import annotations

import struct

import lz4.block
import pytest
import torch
import xxhash

from kvtier.block import (
    BlockSpec,
    Compression,
    activation_like_kv,
    decode_block,
    encode_block,
    verify_block,
)
from kvtier.config import KvtierConfig
from kvtier.connectors.layouts import EngineKV
from kvtier.connectors.plan import Counters, PlannedLoad
from kvtier.connectors.worker_side import ConnectorWorker
from kvtier.errors import BadLengthError, BadShapeError
from kvtier.metrics import StoreMetrics
from kvtier.prefix import ObjectRef
from kvtier.store import TieredStore
from tests.kvtier.helpers import FlakyTier

KEY = bytes(range(16))
SHAPE = (2, 2, 32, 2, 8)  # [layers, 2, tokens, kv_heads, head_dim]
SPEC = BlockSpec(2, 2, 8, torch.bfloat16, max_tokens=32)


def lying(block: bytes, tokens: int) -> bytes:
    """``block`` with its header declaring ``tokens`` tokens (raw length to match) and a
    valid checksum: what a writer who means harm can produce."""
    out = bytearray(block)
    layers, heads, head_dim = struct.unpack_from("<HHH", out, 12)
    struct.pack_into("<I", out, 20, tokens)
    struct.pack_into("<Q", out, 36, layers * 2 * tokens * heads * head_dim * 2)  # bf16
    struct.pack_into("<Q", out, 44, 0)
    struct.pack_into("<Q", out, 44, xxhash.xxh64(bytes(out)).intdigest())
    return bytes(out)


@pytest.fixture
def no_decompress(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> bytes:
        raise AssertionError("decompressed a block whose size should have been refused")

    monkeypatch.setattr(lz4.block, "decompress", refuse)


def test_a_size_its_compressed_bytes_cannot_reach_is_refused(no_decompress: None) -> None:
    # zeros compress ~100x: the honest block is tiny, the lie asks for 64 GiB
    block = encode_block(
        torch.zeros(SHAPE, dtype=torch.bfloat16), key=KEY, compression=Compression.LZ4
    )
    hostile = lying(block, 1 << 30)
    with pytest.raises(BadLengthError, match="cannot decompress"):
        decode_block(hostile)
    with pytest.raises(BadLengthError):
        verify_block(hostile)  # the store and the server refuse it too, without decoding


def test_a_size_beyond_the_readers_chunk_is_refused(no_decompress: None) -> None:
    # random KV hardly compresses, so 8x its tokens stays within lz4's reach: the
    # reader's layout (tokens per chunk) is what bounds it
    kv = activation_like_kv(SHAPE, seed=4)
    hostile = lying(encode_block(kv, key=KEY, compression=Compression.LZ4), 256)
    verify_block(hostile)  # a well-formed header with a valid checksum
    with pytest.raises(BadShapeError, match="more than the 32"):
        decode_block(hostile, key=KEY, expect=SPEC)


def test_an_honest_lz4_block_still_decodes() -> None:
    kv = activation_like_kv(SHAPE, seed=5)
    block = encode_block(kv, key=KEY, compression=Compression.LZ4)
    assert torch.equal(decode_block(block, key=KEY, expect=SPEC).payload, kv)
    zeros = torch.zeros(SHAPE, dtype=torch.bfloat16)
    packed = encode_block(zeros, key=KEY, compression=Compression.LZ4)
    assert len(packed) < 200  # compresses well, and still within the bound
    assert torch.equal(decode_block(packed, key=KEY).payload, zeros)


def test_the_loader_reports_a_hostile_block_as_corrupt_and_places_nothing(
    no_decompress: None,
) -> None:
    kv = activation_like_kv(SHAPE, seed=6)
    hostile = lying(encode_block(kv, key=KEY, compression=Compression.LZ4), 256)
    tier = FlakyTier()  # hands the block over as it is: its checksum is valid anyway
    tier.data[KEY] = hostile
    store = TieredStore([tier], metrics=StoreMetrics())
    worker = ConnectorWorker(
        config=KvtierConfig(chunk_size=32), store=store, counters=Counters(), metrics=store.metrics
    )
    cache = torch.zeros(2, 2, 4, 16, 2, 8, dtype=torch.bfloat16)  # [L, 2, blocks, 16, H, D]
    worker.register(EngineKV(cache))
    try:
        worker.start_loads([PlannedLoad("r", 0, 32, (ObjectRef(0, 32, KEY),), (0, 1), sync=True)])
        (result,) = worker.take_results()
        assert result.placed == 0 and result.failed
        assert result.error is not None and "more than the 32" in result.error
        assert (
            store.metrics.value(
                "kvtier_corrupt_block_reasons_total", {"tier": "load", "reason": "shape"}
            )
            == 1
        )
        assert not cache.any()
    finally:
        worker.close()
        store.close()
