"""The public KV kernels: CUDA tensors go to Triton, everything else to torch.

The rule, decided per call by the cache's device:

* ``kv_cache.is_cuda`` and triton importable -> :mod:`kvtier.kernels.triton_kv`
* otherwise (CPU, or CUDA without triton)   -> :mod:`kvtier.kernels.reference`

The torch path is correct on any device (on CUDA it is slower and syncs on
``-1`` slots); :func:`backend_for` tells which one a call would take. Both
paths run the same argument checks and raise :class:`KernelInputError`.
"""

from __future__ import annotations

from typing import Literal

import torch

from kvtier.kernels import reference, triton_kv
from kvtier.kernels.quant import Encoding, QuantizedChunk

__all__ = [
    "backend_for",
    "gather_kv",
    "gather_kv_quantized",
    "scatter_kv",
    "scatter_kv_dequantized",
]

Backend = Literal["triton", "torch"]


def backend_for(kv_cache: torch.Tensor) -> Backend:
    """The backend a kernel call on ``kv_cache`` takes: ``"triton"`` or ``"torch"``."""
    if isinstance(kv_cache, torch.Tensor) and kv_cache.is_cuda and triton_kv.triton_available():
        return "triton"
    return "torch"


def gather_kv(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    check_slots: bool = True,
) -> torch.Tensor:
    """Copies the slots' K and V, all layers, into a chunk (one launch on CUDA).

    Args:
        kv_cache: ``[L, 2, num_blocks, block_size, H, D]`` float16/bfloat16/
            float32, head_dim contiguous, other strides arbitrary.
        slot_mapping: ``[T]`` int64/int32; ``slot = block * block_size + offset``;
            ``-1`` leaves the token's rows zero.
        out: optional ``[L, 2, T, H, D]`` contiguous buffer in the cache dtype.
        check_slots: check the slot range (one device sync on CUDA). With
            False, out-of-range slots are skipped like ``-1``.

    Returns:
        The chunk ``[L, 2, T, H, D]``, contiguous, in the cache dtype.

    Raises:
        KernelInputError: on a bad argument (nothing is written).
    """
    if backend_for(kv_cache) == "triton":
        return triton_kv.gather_kv(kv_cache, slot_mapping, out, check_slots=check_slots)
    return reference.gather_kv(kv_cache, slot_mapping, out, check_slots=check_slots)


def scatter_kv(
    chunk: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_slots: bool = True,
) -> None:
    """Writes a chunk into the cache slots in place (one launch on CUDA).

    Args:
        chunk: ``[L, 2, T, H, D]`` contiguous, in the cache dtype.
        kv_cache: the paged cache, written in place.
        slot_mapping: ``[T]``; ``-1`` writes nothing for that token. Duplicate
            slots write one of their tokens (unspecified which).
        check_slots: as in :func:`gather_kv`.

    Raises:
        KernelInputError: on a bad argument (nothing is written).
    """
    if backend_for(kv_cache) == "triton":
        triton_kv.scatter_kv(chunk, kv_cache, slot_mapping, check_slots=check_slots)
    else:
        reference.scatter_kv(chunk, kv_cache, slot_mapping, check_slots=check_slots)


def gather_kv_quantized(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    encoding: Encoding | str,
    out: QuantizedChunk | None = None,
    *,
    check_slots: bool = True,
) -> QuantizedChunk:
    """Gathers and quantizes a chunk in one pass (see :mod:`kvtier.kernels.quant`).

    Args:
        kv_cache: as in :func:`gather_kv`.
        slot_mapping: as in :func:`gather_kv`; a ``-1`` token gets zero codes
            and the floor scale.
        encoding: ``Encoding.INT8`` or ``Encoding.FP8_E4M3`` (or its label).
        out: optional preallocated ``QuantizedChunk`` (contiguous data in the
            encoding's dtype and float32 scales) to write into.
        check_slots: as in :func:`gather_kv`.

    Returns:
        ``QuantizedChunk(data [L, 2, T, H, D] int8/float8_e4m3fn,
        scales [L, 2, T, H] float32)`` (``out`` when given).

    Raises:
        KernelInputError: on a bad argument or an unknown encoding.
    """
    if backend_for(kv_cache) == "triton":
        return triton_kv.gather_kv_quantized(
            kv_cache, slot_mapping, encoding, out, check_slots=check_slots
        )
    return reference.gather_kv_quantized(
        kv_cache, slot_mapping, encoding, out, check_slots=check_slots
    )


def scatter_kv_dequantized(
    data: torch.Tensor,
    scales: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_slots: bool = True,
) -> None:
    """Dequantizes a chunk to the cache dtype and scatters it in one pass.

    Args:
        data: ``[L, 2, T, H, D]`` int8 or float8_e4m3fn, contiguous.
        scales: ``[L, 2, T, H]`` float32, contiguous.
        kv_cache: the paged cache, written in place.
        slot_mapping: as in :func:`scatter_kv`.
        check_slots: as in :func:`gather_kv`.

    Raises:
        KernelInputError: on a bad argument (nothing is written).
    """
    if backend_for(kv_cache) == "triton":
        triton_kv.scatter_kv_dequantized(
            data, scales, kv_cache, slot_mapping, check_slots=check_slots
        )
    else:
        reference.scatter_kv_dequantized(
            data, scales, kv_cache, slot_mapping, check_slots=check_slots
        )
