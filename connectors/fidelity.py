"""How close quantized KV stays to the original: KV error and next-token agreement."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.block import Encoding, decode_block
from kvtier.kernels import dequantize_chunk, quantize_chunk


def kv_relative_error(raw_blocks: Sequence[bytes], encoding: str) -> float:
    """Mean over (layer, K/V, token, head) vectors of ``‖x - deq(q(x))‖ / ‖x‖``.

    Args:
        raw_blocks: Blocks in the ``raw`` encoding (the original KV).
        encoding: ``int8`` or ``fp8_e4m3``.
    """
    total, count = 0.0, 0
    for block in raw_blocks:
        d = decode_block(block)
        if d.header.encoding != Encoding.RAW:
            raise ValueError("kv_relative_error needs raw blocks")
        x = d.payload.float()
        q = quantize_chunk(d.payload, encoding)
        y = dequantize_chunk(q.data, q.scales, d.payload.dtype).float()
        err = (x - y).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-12)
        total += float(err.sum())
        count += err.numel()
    return total / count if count else 0.0


def top1_agreement(
    reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]
) -> tuple[float, int]:
    """Share of greedy next-token choices that agree while both runs saw the same tokens.

    Greedy decoding feeds each run its own tokens, so position ``k`` compares
    the same input only while every earlier token agreed; comparison stops at
    the first disagreement (which is counted).

    Returns:
        (agreement, positions compared).
    """
    agree = compared = 0
    for ref, cand in zip(reference, candidate, strict=True):
        for r, c in zip(ref, cand, strict=False):
            compared += 1
            if r != c:
                break
            agree += 1
    return (agree / compared if compared else 1.0), compared
