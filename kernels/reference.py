"""Pure-torch reference of the KV kernels (the CPU path).

These functions define what the Triton kernels must compute, bit for bit, and
are the path every CPU tensor takes. They are vectorised (``index_select`` /
``index_copy_`` over the token dimension, all layers and K/V at once) and work
on any device, but on CUDA a ``-1`` slot costs a device sync (a boolean mask
is turned into indices), which is one reason CUDA tensors go to Triton.

Slots: ``slot = block_id * block_size + offset``. A slot outside
``[0, num_slots)`` (``-1`` in a checked call, anything when
``check_slots=False``) skips its token: gather writes zeros for it, scatter
writes nothing. Duplicate slots in a scatter write one of the tokens, which one
is unspecified (as in the Triton kernel).
"""

from __future__ import annotations

import torch

from kvtier.kernels.checks import (
    CacheGeometry,
    check_gather,
    check_gather_quantized,
    check_scatter,
    check_scatter_dequantized,
)
from kvtier.kernels.quant import (
    DATA_DTYPES,
    QMAX,
    SCALE_FLOOR,
    Encoding,
    QuantizedChunk,
    check_encoding,
)

__all__ = [
    "dequantize_chunk",
    "gather_kv",
    "gather_kv_quantized",
    "quantize_chunk",
    "scatter_kv",
    "scatter_kv_dequantized",
]


def _slot_view(kv_cache: torch.Tensor) -> torch.Tensor | None:
    """Returns ``kv_cache`` as ``[L, 2, NB*BS, H, D]`` when that is a view, else None.

    The block and offset dims merge into one slot dim when
    ``stride(block) == block_size * stride(offset)`` (true for any cache whose
    blocks are laid out back to back, contiguous or not elsewhere).
    """
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    mergeable = (
        num_blocks == 1 or block_size == 1 or kv_cache.stride(2) == block_size * kv_cache.stride(3)
    )
    if not mergeable:
        return None
    return kv_cache.view(num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim)


def _block_rows(
    kv_cache: torch.Tensor, slots: torch.Tensor, geom: CacheGeometry
) -> torch.Tensor | None:
    """Block ids when ``slots`` is a run of whole blocks and each block is one contiguous row.

    The common case of a chunk aligned to the engine's blocks: moving whole
    ``[block_size, H, D]`` rows (one index per block instead of one per token)
    is about 1.5x faster on the CPU. Returns ``None`` when it does not apply.
    """
    bs = geom.block_size
    t = geom.num_tokens
    if t % bs or slots.device.type != "cpu":
        return None
    row = geom.num_kv_heads * geom.head_dim
    if kv_cache.stride(3) != row or kv_cache.stride(4) != geom.head_dim:
        return None
    grid = slots.view(t // bs, bs)
    first = grid[:, 0]
    if bool((first < 0).any()) or bool((first % bs).any()) or bool((first >= geom.num_slots).any()):
        return None
    if not torch.equal(grid, first[:, None] + torch.arange(bs, dtype=slots.dtype)):
        return None
    return first // bs


def _as_rows(t: torch.Tensor, num_rows: int, geom: CacheGeometry) -> torch.Tensor:
    """``[L, 2, rows * block_size, H, D]`` or ``[L, 2, rows, block_size, H, D]`` as ``[L, 2, rows, block_size*H*D]``."""
    return t.as_strided(
        (geom.num_layers, 2, num_rows, geom.block_size * geom.num_kv_heads * geom.head_dim),
        (t.stride(0), t.stride(1), t.stride(2) * (geom.block_size if t.dim() == 5 else 1), 1),
    )


def _valid_slots(slot_mapping: torch.Tensor, geom: CacheGeometry) -> torch.Tensor:
    # valid: [T] bool, True where the token is read or written.
    return (slot_mapping >= 0) & (slot_mapping < geom.num_slots)


@torch.no_grad()
def gather_kv(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    check_slots: bool = True,
) -> torch.Tensor:
    """Copies the slots' K and V, all layers, into a chunk.

    Args:
        kv_cache: ``[L, 2, num_blocks, block_size, H, D]``, head_dim contiguous.
        slot_mapping: ``[T]`` int64/int32 slots; ``-1`` leaves zeros.
        out: optional ``[L, 2, T, H, D]`` contiguous buffer in the cache dtype.
        check_slots: check every slot is ``-1`` or in range (see ``checks``).

    Returns:
        The chunk ``[L, 2, T, H, D]`` (``out`` when given).

    Raises:
        KernelInputError: on a bad argument.
    """
    geom = check_gather(kv_cache, slot_mapping, out, check_slots=check_slots)
    if out is None:
        out = torch.empty(geom.chunk_shape, dtype=kv_cache.dtype, device=kv_cache.device)
    if geom.num_tokens == 0:
        return out
    slots = slot_mapping.long()
    blocks = _block_rows(kv_cache, slots, geom)
    if blocks is not None:
        rows = len(blocks)
        torch.index_select(
            _as_rows(kv_cache, geom.num_blocks, geom), 2, blocks, out=_as_rows(out, rows, geom)
        )
        return out
    valid = _valid_slots(slots, geom)
    all_valid = bool(valid.all())
    if not all_valid and not bool(valid.any()):
        return out.zero_()
    index = slots if all_valid else torch.where(valid, slots, 0)
    flat = _slot_view(kv_cache)
    if flat is not None:
        torch.index_select(flat, 2, index, out=out)
    else:
        out.copy_(kv_cache[:, :, index // geom.block_size, index % geom.block_size])
    if not all_valid:
        out.masked_fill_(~valid.view(1, 1, -1, 1, 1), 0)
    return out


@torch.no_grad()
def scatter_kv(
    chunk: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_slots: bool = True,
) -> None:
    """Writes a chunk's K and V, all layers, into the cache slots (in place).

    Args:
        chunk: ``[L, 2, T, H, D]`` contiguous, in the cache dtype.
        kv_cache: ``[L, 2, num_blocks, block_size, H, D]``, head_dim contiguous.
        slot_mapping: ``[T]`` int64/int32 slots; ``-1`` writes nothing.
        check_slots: check every slot is ``-1`` or in range (see ``checks``).

    Raises:
        KernelInputError: on a bad argument.
    """
    geom = check_scatter(chunk, kv_cache, slot_mapping, check_slots=check_slots)
    if geom.num_tokens == 0:
        return
    slots = slot_mapping.long()
    blocks = _block_rows(kv_cache, slots, geom)
    if blocks is not None:
        rows = _as_rows(kv_cache, geom.num_blocks, geom)
        rows.index_copy_(2, blocks, _as_rows(chunk, len(blocks), geom))
        return
    valid = _valid_slots(slots, geom)
    if bool(valid.all()):
        index, source = slots, chunk
    else:
        keep = valid.nonzero().squeeze(1)
        if keep.numel() == 0:
            return
        index, source = slots[keep], chunk.index_select(2, keep)
    flat = _slot_view(kv_cache)
    if flat is not None:
        flat.index_copy_(2, index, source)
    else:
        kv_cache[:, :, index // geom.block_size, index % geom.block_size] = source


@torch.no_grad()
def quantize_chunk(
    chunk: torch.Tensor, encoding: Encoding | str, out: QuantizedChunk | None = None
) -> QuantizedChunk:
    """Quantizes a chunk with one scale per (layer, K/V, token, head).

    Works one layer at a time (a Python loop over layers, never tokens) so the
    float32 temporaries stay small and cache-resident.

    Args:
        chunk: ``[L, 2, T, H, D]`` float16/bfloat16/float32.
        encoding: ``Encoding.INT8`` or ``Encoding.FP8_E4M3`` (or its label).
        out: optional preallocated result (already checked).

    Returns:
        ``data`` ``[L, 2, T, H, D]`` int8/float8_e4m3fn and ``scales``
        ``[L, 2, T, H]`` float32, both contiguous (``out`` when given).
    """
    encoding = check_encoding(encoding)
    if out is None:
        out = QuantizedChunk(
            torch.empty(chunk.shape, dtype=DATA_DTYPES[encoding], device=chunk.device),
            torch.empty(chunk.shape[:-1], dtype=torch.float32, device=chunk.device),
        )
    qmax_value = QMAX[encoding]
    # NOTE: divide by a tensor, not a Python scalar: on CUDA torch turns a
    # scalar divisor into a reciprocal multiply, which is not the IEEE
    # quotient the Triton kernel computes.
    qmax = torch.full((), qmax_value, device=chunk.device)
    for layer in range(chunk.shape[0]):
        # copy=True: for a float32 chunk .float() would alias it, and x is divided in place.
        x = chunk[layer].to(torch.float32, copy=True)  # [2, T, H, D]
        low, high = torch.aminmax(x, dim=-1)
        amax = torch.maximum(low.neg_(), high)  # [2, T, H] == |x|.amax(-1)
        scale = torch.clamp_min_(amax.div_(qmax), SCALE_FLOOR)
        out.scales[layer] = scale
        y = x.div_(scale.unsqueeze(-1))
        if encoding is Encoding.INT8:
            y = y.round_().clamp_(-127, 127)  # round: half to even
        else:
            y = y.clamp_(-qmax_value, qmax_value)  # the cast rounds to nearest even
        out.data[layer] = y
    return out


_DEQUANT_TEMP_ELEMENTS = 16 << 20  # float32 temporary of at most 64 MiB


@torch.no_grad()
def dequantize_chunk(
    data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`quantize_chunk`: ``float32(data) * scale`` rounded to ``dtype``.

    Args:
        data: ``[L, 2, T, H, D]`` int8/float8_e4m3fn.
        scales: ``[L, 2, T, H]`` float32.
        dtype: the output dtype (the cache's).
        out: optional ``[L, 2, T, H, D]`` buffer in ``dtype``.

    Returns:
        ``[L, 2, T, H, D]`` in ``dtype``, contiguous (``out`` when given).
    """
    if out is None:
        out = torch.empty(data.shape, dtype=dtype, device=data.device)
    # NOTE: a few large ops, not one per layer: each op wakes torch's thread
    # pool, and 90 small ones cost 8x more than 3 large ones inside a busy
    # engine. Layers go in groups so the float32 temporary stays bounded.
    per_layer = max(1, data[0].numel())
    group = max(1, _DEQUANT_TEMP_ELEMENTS // per_layer)
    for first in range(0, data.shape[0], group):
        last = first + group
        out[first:last] = data[first:last].float().mul_(scales[first:last].unsqueeze(-1))
    return out


@torch.no_grad()
def gather_kv_quantized(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    encoding: Encoding | str,
    out: QuantizedChunk | None = None,
    *,
    check_slots: bool = True,
) -> QuantizedChunk:
    """Gathers the slots (as :func:`gather_kv`) and quantizes the chunk.

    A ``-1`` slot yields zero codes with the floor scale.

    Args:
        kv_cache: the paged cache.
        slot_mapping: ``[T]`` slots.
        encoding: ``Encoding.INT8`` or ``Encoding.FP8_E4M3`` (or its label).
        out: optional preallocated ``QuantizedChunk`` to write into.
        check_slots: check the slot range.

    Returns:
        The quantized chunk (``out`` when given).

    Raises:
        KernelInputError: on a bad argument or an unknown encoding.
    """
    _, checked = check_gather_quantized(
        kv_cache, slot_mapping, encoding, out, check_slots=check_slots
    )
    chunk = gather_kv(kv_cache, slot_mapping, check_slots=False)
    return quantize_chunk(chunk, checked, out)


@torch.no_grad()
def scatter_kv_dequantized(
    data: torch.Tensor,
    scales: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_slots: bool = True,
) -> None:
    """Dequantizes a chunk to the cache dtype and scatters it (as :func:`scatter_kv`).

    Raises:
        KernelInputError: on a bad argument.
    """
    check_scatter_dequantized(data, scales, kv_cache, slot_mapping, check_slots=check_slots)
    chunk = dequantize_chunk(data, scales, kv_cache.dtype)
    scatter_kv(chunk, kv_cache, slot_mapping, check_slots=False)
