"""Triton implementations of the KV kernels (the CUDA path).

Same signatures and semantics as :mod:`kvtier.kernels.reference`, which they
are tested against bit for bit. Importing this module does not import triton:
the kernels are loaded on the first launch, so the package and its CPU path
work without triton installed.

Tensors must be on a CUDA device, or on the CPU with ``TRITON_INTERPRET=1``
set before the first launch (Triton's interpreter, used by the tests).
fp8 codes are written as raw bits, so fp8 needs no native fp8 support on the
GPU (see ``_triton_kernels``).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import NamedTuple

import torch

from kvtier.kernels.checks import (
    CacheGeometry,
    check_gather,
    check_gather_quantized,
    check_scatter,
    check_scatter_dequantized,
)
from kvtier.kernels.errors import KernelUnavailableError
from kvtier.kernels.quant import DATA_DTYPES, QMAX, SCALE_FLOOR, Encoding, QuantizedChunk

__all__ = [
    "gather_kv",
    "gather_kv_quantized",
    "kernels_interpreted",
    "scatter_kv",
    "scatter_kv_dequantized",
    "triton_available",
]

# Elements of one program's [BLOCK_H, BLOCK_D] tile, at most; heads are split
# across programs beyond this. 8 elements per thread at the chosen num_warps.
_MAX_TILE = 4096
_ELEMENTS_PER_THREAD = 8


def triton_available() -> bool:
    """Whether triton can be imported here (does not import it)."""
    return importlib.util.find_spec("triton") is not None


def _kernels() -> ModuleType:
    """Imports (once; Python caches the module) and returns the kernel module.

    Raises:
        KernelUnavailableError: if triton is not installed or fails to import.
    """
    if not triton_available():
        raise KernelUnavailableError(
            "triton is not installed; install kvtier[kernels] or use kvtier.kernels.reference"
        )
    try:
        return importlib.import_module("kvtier.kernels._triton_kernels")
    except ImportError as exc:  # installed but unusable (e.g. a broken build)
        raise KernelUnavailableError(f"triton cannot be imported: {exc}") from exc


def kernels_interpreted() -> bool:
    """Whether the loaded kernels run in Triton's interpreter (``TRITON_INTERPRET=1``).

    Loads the kernel module if needed; the answer is fixed from then on.
    """
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_kernels().gather_kv_kernel, InterpretedFunction)


# NOTE: every launch passes enable_fp_fusion=False: the kernels must compute
# exactly the IEEE operations the reference does. (Their products are exact,
# so contraction into FMAs could not change a bit today; this keeps it so.)


class _Launch(NamedTuple):
    grid: tuple[int, int, int]
    block_h: int
    block_d: int
    num_warps: int


def _launch(geom: CacheGeometry) -> _Launch:
    block_d = _next_pow2(geom.head_dim)
    block_h = min(_next_pow2(geom.num_kv_heads), max(1, _MAX_TILE // block_d))
    tile = block_h * block_d
    num_warps = min(8, max(1, tile // (32 * _ELEMENTS_PER_THREAD)))
    head_blocks = -(-geom.num_kv_heads // block_h)
    return _Launch((geom.num_tokens, geom.num_layers * 2, head_blocks), block_h, block_d, num_warps)


def _next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1); ``triton.next_power_of_2`` without triton."""
    return 1 << (n - 1).bit_length()


def _require_runnable(kv_cache: torch.Tensor, kernels: ModuleType) -> None:
    if kv_cache.is_cuda:
        return
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernels.gather_kv_kernel, InterpretedFunction):
        raise KernelUnavailableError(
            f"the Triton kernels need CUDA tensors (got {kv_cache.device}) or "
            "TRITON_INTERPRET=1 set before the first launch; use kvtier.kernels.reference"
        )


def _cache_args(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, geom: CacheGeometry
) -> tuple[int, ...]:
    """The scalar arguments every kernel takes after its pointers."""
    return (
        slot_mapping.stride(0),
        geom.num_slots,
        geom.block_size,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        geom.num_tokens,
        geom.num_kv_heads,
        geom.head_dim,
    )


def gather_kv(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    check_slots: bool = True,
) -> torch.Tensor:
    """Triton :func:`kvtier.kernels.reference.gather_kv`: one launch, all layers.

    Raises:
        KernelInputError: on a bad argument.
        KernelUnavailableError: if triton cannot run these tensors.
    """
    geom = check_gather(kv_cache, slot_mapping, out, check_slots=check_slots)
    if out is None:
        out = torch.empty(geom.chunk_shape, dtype=kv_cache.dtype, device=kv_cache.device)
    if geom.num_tokens == 0:
        return out
    kernels = _kernels()
    _require_runnable(kv_cache, kernels)
    launch = _launch(geom)
    kernels.gather_kv_kernel[launch.grid](
        kv_cache,
        slot_mapping,
        out,
        *_cache_args(kv_cache, slot_mapping, geom),
        BLOCK_H=launch.block_h,
        BLOCK_D=launch.block_d,
        num_warps=launch.num_warps,
        enable_fp_fusion=False,
    )
    return out


def scatter_kv(
    chunk: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_slots: bool = True,
) -> None:
    """Triton :func:`kvtier.kernels.reference.scatter_kv`: one launch, all layers.

    Raises:
        KernelInputError: on a bad argument.
        KernelUnavailableError: if triton cannot run these tensors.
    """
    geom = check_scatter(chunk, kv_cache, slot_mapping, check_slots=check_slots)
    if geom.num_tokens == 0:
        return
    kernels = _kernels()
    _require_runnable(kv_cache, kernels)
    launch = _launch(geom)
    kernels.scatter_kv_kernel[launch.grid](
        chunk,
        slot_mapping,
        kv_cache,
        *_cache_args(kv_cache, slot_mapping, geom),
        BLOCK_H=launch.block_h,
        BLOCK_D=launch.block_d,
        num_warps=launch.num_warps,
        enable_fp_fusion=False,
    )


def gather_kv_quantized(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    encoding: Encoding | str,
    out: QuantizedChunk | None = None,
    *,
    check_slots: bool = True,
) -> QuantizedChunk:
    """Triton :func:`kvtier.kernels.reference.gather_kv_quantized`: gather + quantize fused.

    Raises:
        KernelInputError: on a bad argument or an unknown encoding.
        KernelUnavailableError: if triton cannot run these tensors.
    """
    geom, checked = check_gather_quantized(
        kv_cache, slot_mapping, encoding, out, check_slots=check_slots
    )
    is_fp8 = checked is Encoding.FP8_E4M3
    if out is None:
        data = torch.empty(geom.chunk_shape, dtype=DATA_DTYPES[checked], device=kv_cache.device)
        scales = torch.empty(geom.scales_shape, dtype=torch.float32, device=kv_cache.device)
    else:
        data, scales = out
    if geom.num_tokens == 0:
        return QuantizedChunk(data, scales)
    kernels = _kernels()
    _require_runnable(kv_cache, kernels)
    launch = _launch(geom)
    kernels.gather_quantize_kernel[launch.grid](
        kv_cache,
        slot_mapping,
        data.view(torch.uint8) if is_fp8 else data,
        scales,
        *_cache_args(kv_cache, slot_mapping, geom),
        QMAX=QMAX[checked],
        SCALE_FLOOR=SCALE_FLOOR,
        IS_FP8=is_fp8,
        BLOCK_H=launch.block_h,
        BLOCK_D=launch.block_d,
        num_warps=launch.num_warps,
        enable_fp_fusion=False,
    )
    return QuantizedChunk(data, scales)


def scatter_kv_dequantized(
    data: torch.Tensor,
    scales: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_slots: bool = True,
) -> None:
    """Triton :func:`kvtier.kernels.reference.scatter_kv_dequantized`: dequantize + scatter fused.

    Raises:
        KernelInputError: on a bad argument.
        KernelUnavailableError: if triton cannot run these tensors.
    """
    geom, encoding = check_scatter_dequantized(
        data, scales, kv_cache, slot_mapping, check_slots=check_slots
    )
    if geom.num_tokens == 0:
        return
    kernels = _kernels()
    _require_runnable(kv_cache, kernels)
    launch = _launch(geom)
    is_fp8 = encoding is Encoding.FP8_E4M3
    kernels.dequantize_scatter_kernel[launch.grid](
        data.view(torch.uint8) if is_fp8 else data,
        scales,
        slot_mapping,
        kv_cache,
        *_cache_args(kv_cache, slot_mapping, geom),
        IS_FP8=is_fp8,
        OUT_BF16=kv_cache.dtype == torch.bfloat16,
        BLOCK_H=launch.block_h,
        BLOCK_D=launch.block_d,
        num_warps=launch.num_warps,
        enable_fp_fusion=False,
    )
