"""Triton kernels that move KV between the paged cache and chunks.

Imported lazily by :mod:`kvtier.kernels.triton_kv` (this module needs triton).
``TRITON_INTERPRET=1`` must be set before this module is first imported for
the kernels to run in Triton's CPU interpreter.

One program handles one token ``t``, one (layer, K/V) pair ``lkv`` and a block
of ``BLOCK_H`` heads, all of ``head_dim`` (``BLOCK_D >= D``, masked)::

    grid = (T, L * 2, cdiv(H, BLOCK_H))
    cache element: layer*s_layer + kv*s_kv + block*s_block + offset*s_offset + h*s_head + d
    chunk element: ((lkv * T + t) * H + h) * D + d          # [L, 2, T, H, D] contiguous
    scale element: (lkv * T + t) * H + h                    # [L, 2, T, H] contiguous

A slot outside ``[0, num_slots)`` (``-1``) is skipped: no cache access, zeros
in a gathered chunk, nothing written by a scatter.

NOTE on exactness. The quantizing kernels must give the torch reference's
bits on every backend. Triton's ``/`` is an approximate division on CUDA,
and the interpreter's float downcasts truncate (bf16) or mis-round (fp8), so:
divisions use ``div_rn`` (IEEE), int8 rounding is an explicit
round-half-to-even, fp8 codes are built from exact power-of-two arithmetic
and stored as uint8 bits (which also works on GPUs without native fp8), and
float32 -> bfloat16 rounds to nearest even on the integer bits before a cast
that is then exact.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _pow2(exponent):
    """2.0 ** exponent for an int32 exponent in the normal float32 range."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_half_even(y):
    """Rounds float32 ``y`` to the nearest integer, ties to even (== torch.round)."""
    r = tl.floor(y)
    frac = y - r  # exact
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return r + up.to(tl.float32)


@triton.jit
def _fp8_e4m3_code(y):
    """float8_e4m3fn bits (int32 in [0, 255]) of float32 ``y``, saturating at 448.

    Round to nearest even, as torch's ``.to(torch.float8_e4m3fn)`` of
    ``y.clamp(-448, 448)``. A magnitude ``a`` with exponent ``e`` (at least -6,
    the subnormal range) is ``k * 2**(e-3)`` with ``k`` an integer in [0, 16];
    its code is ``(e + 6) * 8 + k`` (k == 16 carries into the next exponent).
    """
    negative = y.to(tl.int32, bitcast=True) < 0
    a = tl.minimum(tl.abs(y), 448.0)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    k = _round_half_even(a * _pow2(3 - e))  # exact: scaling by a power of two
    code = (e + 6) * 8 + k.to(tl.int32)
    return tl.where(negative, code | 0x80, code)


@triton.jit
def _fp8_e4m3_value(code):
    """float32 value of float8_e4m3fn bits ``code`` (int32 in [0, 255])."""
    magnitude = code & 0x7F
    e = magnitude >> 3
    m = magnitude & 0x7
    normal = e > 0
    significand = tl.where(normal, m + 8, m).to(tl.float32)
    value = significand * _pow2(tl.where(normal, e - 10, -9))
    value = tl.where(magnitude == 0x7F, float("nan"), value)
    # NOTE: the sign goes on as a bit. Compiled for CUDA, ``-value`` is ``0 - value``, which
    # turns code 0x80 (-0.0) into +0.0 (seen on an H200; the interpreter keeps -0.0).
    sign = (code & 0x80) << 24
    return (value.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_round(x):
    """Rounds float32 ``x`` to bfloat16 precision, nearest even (finite or inf)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _slot_address(
    slots_ptr,
    slot_stride,
    num_slots,
    block_size,
    s_layer,
    s_kv,
    s_block,
    s_offset,
    num_heads,
):
    """(live heads, element offset of the slot's (layer, K/V) row) for this program.

    ``live heads`` is ``num_heads`` for a valid slot and 0 for a skipped one, so
    ``heads < live`` masks a skipped token out entirely.
    """
    t = tl.program_id(0).to(tl.int64)
    lkv = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + t * slot_stride).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    # NOTE: a scalar int, not a scalar bool: the interpreter mis-types
    # (tensor bool) & (scalar bool) as int32, which tl.load rejects as a mask.
    live = tl.where(valid, num_heads, 0)
    slot = tl.where(valid, slot, 0)
    base = (
        (lkv // 2) * s_layer
        + (lkv % 2) * s_kv
        + (slot // block_size) * s_block
        + (slot % block_size) * s_offset
    )
    return live, base


@triton.jit
def gather_kv_kernel(
    cache_ptr,
    slots_ptr,
    out_ptr,
    slot_stride,
    num_slots,
    block_size,
    s_layer,
    s_kv,
    s_block,
    s_offset,
    s_head,
    num_tokens,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[l, kv, t, h, :] = cache[l, kv, block(t), offset(t), h, :] (zeros if skipped)."""
    live, base = _slot_address(
        slots_ptr, slot_stride, num_slots, block_size, s_layer, s_kv, s_block, s_offset, num_heads
    )
    t = tl.program_id(0).to(tl.int64)
    lkv = tl.program_id(1).to(tl.int64)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    in_dims = dims[None, :] < head_dim
    mask = (heads[:, None] < num_heads) & in_dims  # [BLOCK_H, BLOCK_D]
    x = tl.load(
        cache_ptr + base + heads[:, None] * s_head + dims[None, :],
        mask=(heads[:, None] < live) & in_dims,
        other=0.0,
    )
    row = (lkv * num_tokens + t) * num_heads + heads  # [BLOCK_H]
    tl.store(out_ptr + row[:, None] * head_dim + dims[None, :], x, mask=mask)


@triton.jit
def scatter_kv_kernel(
    chunk_ptr,
    slots_ptr,
    cache_ptr,
    slot_stride,
    num_slots,
    block_size,
    s_layer,
    s_kv,
    s_block,
    s_offset,
    s_head,
    num_tokens,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """cache[l, kv, block(t), offset(t), h, :] = chunk[l, kv, t, h, :] unless skipped."""
    live, base = _slot_address(
        slots_ptr, slot_stride, num_slots, block_size, s_layer, s_kv, s_block, s_offset, num_heads
    )
    t = tl.program_id(0).to(tl.int64)
    lkv = tl.program_id(1).to(tl.int64)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < live) & (dims[None, :] < head_dim)
    row = (lkv * num_tokens + t) * num_heads + heads
    x = tl.load(chunk_ptr + row[:, None] * head_dim + dims[None, :], mask=mask, other=0.0)
    tl.store(cache_ptr + base + heads[:, None] * s_head + dims[None, :], x, mask=mask)


@triton.jit
def gather_quantize_kernel(
    cache_ptr,
    slots_ptr,
    data_ptr,
    scales_ptr,
    slot_stride,
    num_slots,
    block_size,
    s_layer,
    s_kv,
    s_block,
    s_offset,
    s_head,
    num_tokens,
    num_heads,
    head_dim,
    QMAX: tl.constexpr,
    SCALE_FLOOR: tl.constexpr,
    IS_FP8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Gathers one token's heads and quantizes each head with its own scale.

    ``data_ptr`` is int8 (int8 codes) or uint8 (fp8 e4m3 bits).
    """
    live, base = _slot_address(
        slots_ptr, slot_stride, num_slots, block_size, s_layer, s_kv, s_block, s_offset, num_heads
    )
    t = tl.program_id(0).to(tl.int64)
    lkv = tl.program_id(1).to(tl.int64)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_mask = heads < num_heads
    in_dims = dims[None, :] < head_dim
    mask = head_mask[:, None] & in_dims
    x = tl.load(
        cache_ptr + base + heads[:, None] * s_head + dims[None, :],
        mask=(heads[:, None] < live) & in_dims,
        other=0.0,
    ).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    amax = tl.max(tl.abs(x), axis=1)  # [BLOCK_H]
    scale = tl.maximum(tl.math.div_rn(amax, QMAX), SCALE_FLOOR)  # [BLOCK_H]
    y = tl.math.div_rn(x, scale[:, None])
    if IS_FP8:
        q = _fp8_e4m3_code(y).to(tl.uint8)
    else:
        q = tl.minimum(tl.maximum(_round_half_even(y), -127.0), 127.0).to(tl.int8)
    row = (lkv * num_tokens + t) * num_heads + heads
    tl.store(data_ptr + row[:, None] * head_dim + dims[None, :], q, mask=mask)
    tl.store(scales_ptr + row, scale, mask=head_mask)


@triton.jit
def dequantize_scatter_kernel(
    data_ptr,
    scales_ptr,
    slots_ptr,
    cache_ptr,
    slot_stride,
    num_slots,
    block_size,
    s_layer,
    s_kv,
    s_block,
    s_offset,
    s_head,
    num_tokens,
    num_heads,
    head_dim,
    IS_FP8: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Dequantizes one token's heads (``code * scale``) into the cache dtype and scatters them.

    ``data_ptr`` is int8 (int8 codes) or uint8 (fp8 e4m3 bits).
    """
    live, base = _slot_address(
        slots_ptr, slot_stride, num_slots, block_size, s_layer, s_kv, s_block, s_offset, num_heads
    )
    t = tl.program_id(0).to(tl.int64)
    lkv = tl.program_id(1).to(tl.int64)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_mask = heads < live
    mask = head_mask[:, None] & (dims[None, :] < head_dim)
    row = (lkv * num_tokens + t) * num_heads + heads
    q = tl.load(data_ptr + row[:, None] * head_dim + dims[None, :], mask=mask, other=0)
    # value: [BLOCK_H, BLOCK_D] float32
    value = _fp8_e4m3_value(q.to(tl.int32)) if IS_FP8 else q.to(tl.float32)
    scale = tl.load(scales_ptr + row, mask=head_mask, other=0.0)
    x = value * scale[:, None]
    if OUT_BF16:
        x = _bf16_round(x)
    dst = cache_ptr + base + heads[:, None] * s_head + dims[None, :]
    tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)
