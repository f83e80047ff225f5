"""Argument checks shared by the torch reference and the Triton kernels.

Every public kernel validates its arguments here before touching memory, so a
bad call raises :class:`KernelInputError` and leaves the cache untouched. The
checks read only tensor metadata (shape, dtype, device, strides) with one
exception: the slot range check (``check_slots=True``) must look at the slot
values. On a CPU tensor that is a cheap ``aminmax``; on a CUDA tensor it is one
small device-to-host copy, i.e. a device sync. Callers on the hot path whose
slots come from their own block manager may pass ``check_slots=False``: the
kernels then still never touch memory out of bounds, because both backends
treat any slot outside ``[0, num_slots)`` exactly like ``-1`` (skipped).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.kernels.errors import KernelInputError
from kvtier.kernels.quant import (
    DATA_DTYPES,
    Encoding,
    QuantizedChunk,
    check_encoding,
    encoding_of,
)

__all__ = [
    "CACHE_DTYPES",
    "SLOT_DTYPES",
    "CacheGeometry",
    "check_cache",
    "check_gather",
    "check_gather_quantized",
    "check_scatter",
    "check_scatter_dequantized",
    "check_slot_mapping",
]

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SLOT_DTYPES = (torch.int64, torch.int32)


@dataclass(frozen=True)
class CacheGeometry:
    """The dimensions of a paged cache and of the chunk moved in or out of it.

    Attributes:
        num_layers: L.
        num_blocks: blocks in the cache.
        block_size: tokens per block.
        num_kv_heads: H.
        head_dim: D.
        num_tokens: T, the length of the slot mapping (tokens in the chunk).
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int

    @property
    def num_slots(self) -> int:
        """Valid slots are ``0 <= slot < num_slots``."""
        return self.num_blocks * self.block_size

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        """``[L, 2, T, H, D]``."""
        return (self.num_layers, 2, self.num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def scales_shape(self) -> tuple[int, int, int, int]:
        """``[L, 2, T, H]``."""
        return (self.num_layers, 2, self.num_tokens, self.num_kv_heads)


def _require_tensor(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise KernelInputError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def check_cache(kv_cache: torch.Tensor, *, writable: bool) -> tuple[int, ...]:
    """Checks the paged cache and returns its shape ``(L, 2, NB, BS, H, D)``.

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
        writable: the kernel writes into it (an expanded view, with a zero
            stride on a dimension longer than one, cannot be written).

    Raises:
        KernelInputError: on a wrong rank, K/V dimension, dtype or stride.
    """
    _require_tensor(kv_cache, "kv_cache")
    if kv_cache.dim() != 6:
        raise KernelInputError(
            "kv_cache: expected 6 dims [num_layers, 2, num_blocks, block_size, "
            f"num_kv_heads, head_dim], got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.shape[1] != 2:
        raise KernelInputError(f"kv_cache: expected dim 1 == 2 (K, V), got {kv_cache.shape[1]}")
    if min(kv_cache.shape[0], kv_cache.shape[4], kv_cache.shape[5]) < 1:
        raise KernelInputError(
            "kv_cache: expected num_layers, num_kv_heads and head_dim >= 1, "
            f"got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in CACHE_DTYPES:
        raise KernelInputError(
            f"kv_cache: expected dtype float16, bfloat16 or float32, got {kv_cache.dtype}"
        )
    if kv_cache.shape[-1] > 1 and kv_cache.stride(-1) != 1:
        raise KernelInputError(
            f"kv_cache: expected head_dim contiguous (stride 1), got strides {kv_cache.stride()}"
        )
    if writable:
        for size, stride in zip(kv_cache.shape, kv_cache.stride(), strict=True):
            if size > 1 and stride == 0:
                raise KernelInputError(
                    f"kv_cache: cannot write into an expanded view (strides {kv_cache.stride()})"
                )
    return tuple(kv_cache.shape)


def check_slot_mapping(
    slot_mapping: torch.Tensor, kv_cache: torch.Tensor, num_slots: int, *, check_slots: bool
) -> int:
    """Checks the slot mapping and returns its length.

    Args:
        slot_mapping: ``[num_tokens]`` int64 or int32; ``-1`` skips a token.
        kv_cache: the cache the slots index (for its device).
        num_slots: ``num_blocks * block_size``.
        check_slots: also check every slot is ``-1`` or in ``[0, num_slots)``.
            On CUDA this costs one device sync (see the module docstring).

    Raises:
        KernelInputError: on a wrong rank, dtype or device, or a slot out of range.
    """
    _require_tensor(slot_mapping, "slot_mapping")
    if slot_mapping.dim() != 1:
        raise KernelInputError(
            f"slot_mapping: expected 1 dim [num_tokens], got shape {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in SLOT_DTYPES:
        raise KernelInputError(
            f"slot_mapping: expected dtype int64 or int32, got {slot_mapping.dtype}"
        )
    if slot_mapping.device != kv_cache.device:
        raise KernelInputError(
            f"slot_mapping: expected device {kv_cache.device} (the cache's), "
            f"got {slot_mapping.device}"
        )
    num_tokens = slot_mapping.shape[0]
    if check_slots and num_tokens > 0:
        # One host round trip for both bounds (a sync on CUDA).
        low, high = torch.stack(torch.aminmax(slot_mapping)).tolist()
        if low < -1 or high >= num_slots:
            raise KernelInputError(
                f"slot_mapping: expected slots in [0, {num_slots}) or -1, got min {low}, max {high}"
            )
    return num_tokens


def _check_chunk_like(
    tensor: torch.Tensor,
    name: str,
    shape: tuple[int, ...],
    dtype_ok: bool,
    dtype_expected: str,
    device: torch.device,
) -> None:
    _require_tensor(tensor, name)
    if tuple(tensor.shape) != shape:
        raise KernelInputError(f"{name}: expected shape {shape}, got {tuple(tensor.shape)}")
    if not dtype_ok:
        raise KernelInputError(f"{name}: expected dtype {dtype_expected}, got {tensor.dtype}")
    if tensor.device != device:
        raise KernelInputError(f"{name}: expected device {device}, got {tensor.device}")
    if not tensor.is_contiguous():
        raise KernelInputError(
            f"{name}: expected a contiguous tensor, got strides {tensor.stride()}"
        )


def _geometry(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *, writable: bool, check_slots: bool
) -> CacheGeometry:
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = check_cache(
        kv_cache, writable=writable
    )
    num_tokens = check_slot_mapping(
        slot_mapping, kv_cache, num_blocks * block_size, check_slots=check_slots
    )
    return CacheGeometry(num_layers, num_blocks, block_size, num_kv_heads, head_dim, num_tokens)


def check_gather(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    out: torch.Tensor | None,
    *,
    check_slots: bool,
) -> CacheGeometry:
    """Checks the arguments of ``gather_kv``.

    Raises:
        KernelInputError: naming the first bad argument.
    """
    geom = _geometry(kv_cache, slot_mapping, writable=False, check_slots=check_slots)
    if out is not None:
        _check_chunk_like(
            out,
            "out",
            geom.chunk_shape,
            out.dtype == kv_cache.dtype,
            f"{kv_cache.dtype} (the cache's)",
            kv_cache.device,
        )
    return geom


def check_scatter(
    chunk: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *, check_slots: bool
) -> CacheGeometry:
    """Checks the arguments of ``scatter_kv``.

    Raises:
        KernelInputError: naming the first bad argument.
    """
    geom = _geometry(kv_cache, slot_mapping, writable=True, check_slots=check_slots)
    _require_tensor(chunk, "chunk")
    _check_chunk_like(
        chunk,
        "chunk",
        geom.chunk_shape,
        chunk.dtype == kv_cache.dtype,
        f"{kv_cache.dtype} (the cache's)",
        kv_cache.device,
    )
    return geom


def check_gather_quantized(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    encoding: Encoding | str,
    out: QuantizedChunk | None,
    *,
    check_slots: bool,
) -> tuple[CacheGeometry, Encoding]:
    """Checks the arguments of ``gather_kv_quantized``.

    Raises:
        KernelInputError: naming the first bad argument.
    """
    checked = check_encoding(encoding)
    geom = _geometry(kv_cache, slot_mapping, writable=False, check_slots=check_slots)
    if out is not None:
        if not isinstance(out, QuantizedChunk):
            raise KernelInputError(f"out: expected a QuantizedChunk, got {type(out).__name__}")
        data_dtype = DATA_DTYPES[checked]
        _check_chunk_like(
            out.data,
            "out.data",
            geom.chunk_shape,
            out.data.dtype == data_dtype,
            f"{data_dtype} (encoding {checked.label})",
            kv_cache.device,
        )
        _check_chunk_like(
            out.scales,
            "out.scales",
            geom.scales_shape,
            out.scales.dtype == torch.float32,
            "float32",
            kv_cache.device,
        )
    return geom, checked


def check_scatter_dequantized(
    data: torch.Tensor,
    scales: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_slots: bool,
) -> tuple[CacheGeometry, Encoding]:
    """Checks the arguments of ``scatter_kv_dequantized``.

    Raises:
        KernelInputError: naming the first bad argument.
    """
    geom = _geometry(kv_cache, slot_mapping, writable=True, check_slots=check_slots)
    _require_tensor(data, "data")
    encoding = encoding_of(data.dtype, "data")
    _check_chunk_like(data, "data", geom.chunk_shape, True, "", kv_cache.device)
    _require_tensor(scales, "scales")
    _check_chunk_like(
        scales,
        "scales",
        geom.scales_shape,
        scales.dtype == torch.float32,
        "float32",
        kv_cache.device,
    )
    return geom, encoding
