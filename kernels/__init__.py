"""KV movement kernels: paged cache <-> content-addressed chunks.

Layouts::

    kv_cache:     [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]
    chunk:        [num_layers, 2, num_tokens, num_kv_heads, head_dim]   contiguous
    slot_mapping: [num_tokens] int64/int32, slot = block_id * block_size + offset, -1 = skip
    scales:       [num_layers, 2, num_tokens, num_kv_heads] float32     (quantized chunks)

CUDA tensors run the Triton kernels (:mod:`kvtier.kernels.triton_kv`), all
others the torch reference (:mod:`kvtier.kernels.reference`); see
:mod:`kvtier.kernels.dispatch`. Importing this package does not import triton.
"""

from __future__ import annotations

from kvtier.kernels.checks import CacheGeometry
from kvtier.kernels.dispatch import (
    backend_for,
    gather_kv,
    gather_kv_quantized,
    scatter_kv,
    scatter_kv_dequantized,
)
from kvtier.kernels.errors import KernelInputError, KernelUnavailableError
from kvtier.kernels.quant import SCALE_FLOOR, Encoding, QuantizedChunk
from kvtier.kernels.reference import dequantize_chunk, quantize_chunk
from kvtier.kernels.slots import slots_for_tokens

__all__ = [
    "SCALE_FLOOR",
    "CacheGeometry",
    "Encoding",
    "KernelInputError",
    "KernelUnavailableError",
    "QuantizedChunk",
    "backend_for",
    "dequantize_chunk",
    "gather_kv",
    "gather_kv_quantized",
    "quantize_chunk",
    "scatter_kv",
    "scatter_kv_dequantized",
    "slots_for_tokens",
]
