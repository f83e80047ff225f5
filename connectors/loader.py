"""The load path: place fetched blocks into the engine's paged cache.

Fetching (network/disk I/O) runs on a worker thread with a deadline; decoding,
dequantizing and scattering run on the engine's thread after the fetch
returned in time. A fetch that misses its deadline is abandoned — its result
is never written into the cache, so the tokens it would have covered can be
recomputed safely.

Which tokens of which chunk go where::

    chunk c covers tokens [c*C, c*C + n_c)           (C = chunk size)
    the request needs     [start, end)               (start: what G1 had)
    chunk c writes        [max(start, c*C), min(end, c*C + n_c))
    token t goes to slot  block_ids[t // B] * B + t % B   (B = block size)

A chunk's tokens outside the needed window get slot -1 (not written).

Each block is decoded for the key it was fetched under: a block that carries
another key, or whose header is hostile (an lz4 size its compressed bytes or
the engine's chunk cannot hold), stops the placement there and is reported in
``Placement.corrupt`` for the caller to count; what follows is recomputed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvtier.block import BlockSpec, Encoding, decode_block
from kvtier.errors import CorruptBlockError
from kvtier.kernels import KernelInputError, scatter_kv, scatter_kv_dequantized, slots_for_tokens

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Result of placing one request's chunks."""

    loaded_tokens: int  # from ``start``, contiguous
    bytes_loaded: int
    error: str | None = None
    corrupt: str | None = None  # the reason (``CorruptBlockError.reason``) of a rejected block


def slot_mapping(
    block_ids: list[int],
    block_size: int,
    chunk_start: int,
    chunk_tokens: int,
    lo: int,
    hi: int,
    device: torch.device,
) -> torch.Tensor:
    """Slots for the tokens of a chunk starting at ``chunk_start``; -1 outside ``[lo, hi)``."""
    # Only the tokens in [lo, hi) need a block: the block table may end before the chunk does.
    slots = torch.full((chunk_tokens,), -1, dtype=torch.int64)
    if hi > lo:
        slots[lo - chunk_start : hi - chunk_start] = slots_for_tokens(
            block_ids, block_size, lo, hi - lo
        )
    return slots.to(device)


def place_chunks(
    blocks: list[bytes | None],
    *,
    keys: list[bytes],
    first_chunk: int,
    chunk_size: int,
    start: int,
    end: int,
    block_ids: list[int],
    block_size: int,
    kv_cache: torch.Tensor,
    spec: BlockSpec,
) -> Placement:
    """Decode ``blocks`` (chunks ``first_chunk, first_chunk+1, ...``) and scatter tokens ``[start, end)``.

    ``keys[i]`` is the key ``blocks[i]`` was fetched under; its header must
    carry it. Stops at the first missing or invalid block; reports how many
    tokens from ``start`` were placed.
    """
    placed_to = start
    nbytes = 0
    device = kv_cache.device
    for i, block in enumerate(blocks):
        c = first_chunk + i
        chunk_start = c * chunk_size
        if chunk_start >= end:
            break
        if block is None:
            return Placement(placed_to - start, nbytes, f"chunk {c} is missing")
        try:
            decoded = decode_block(block, key=keys[i], expect=spec, verify=False)
        except CorruptBlockError as e:
            return Placement(placed_to - start, nbytes, f"chunk {c} is invalid: {e}", e.reason)
        n = decoded.header.num_tokens
        hi = min(end, chunk_start + n)
        if hi <= placed_to:
            return Placement(placed_to - start, nbytes, f"chunk {c} holds {n} tokens, too few")
        slots = slot_mapping(
            block_ids, block_size, chunk_start, n, max(start, chunk_start), hi, device
        )
        try:
            if decoded.header.encoding == Encoding.RAW:
                scatter_kv(decoded.payload.to(device, non_blocking=True), kv_cache, slots)
            else:
                assert decoded.scales is not None
                scatter_kv_dequantized(
                    decoded.payload.to(device), decoded.scales.to(device), kv_cache, slots
                )
        except KernelInputError as e:
            return Placement(placed_to - start, nbytes, f"chunk {c} does not fit the cache: {e}")
        nbytes += len(block)
        placed_to = hi
    return Placement(
        placed_to - start, nbytes, None if placed_to >= end else "fewer chunks than tokens to load"
    )
