"""Quantized chunk encodings: names, constants and the result type.

Both encodings are symmetric with one float32 scale per
(layer, K/V, token, head), taken over ``head_dim``::

    scale = max(amax(|x|) / QMAX, SCALE_FLOOR)      # QMAX: 127 (int8), 448 (fp8)
    int8:     q = clamp(round_half_even(x / scale), -127, 127)
    fp8_e4m3: q = float8_e4m3fn(clamp(x / scale, -448, 448))   # round to nearest even
    dequantize: x' = float32(q) * scale, rounded to the cache dtype

The floor keeps an all-zero vector from dividing by zero: its scale is the
floor, its codes are 0 and it dequantizes back to exact zeros.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch

from kvtier.kernels.errors import KernelInputError

__all__ = [
    "DATA_DTYPES",
    "QMAX",
    "SCALE_FLOOR",
    "Encoding",
    "QuantizedChunk",
    "check_encoding",
    "encoding_of",
]

Encoding = Literal["int8", "fp8_e4m3"]

# NOTE: a normal float32 (not a denormal) so that a GPU that flushes denormals
# computes the same scale as the CPU reference.
SCALE_FLOOR = 1e-12

QMAX: dict[str, float] = {"int8": 127.0, "fp8_e4m3": 448.0}

DATA_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


class QuantizedChunk(NamedTuple):
    """A quantized KV chunk.

    Attributes:
        data: ``[layers, 2, tokens, kv_heads, head_dim]`` int8 or float8_e4m3fn,
            contiguous.
        scales: ``[layers, 2, tokens, kv_heads]`` float32, contiguous.
    """

    data: torch.Tensor
    scales: torch.Tensor

    @property
    def encoding(self) -> Encoding:
        """The encoding name implied by ``data.dtype``."""
        return encoding_of(self.data.dtype, "data")


def check_encoding(encoding: str) -> Encoding:
    """Returns ``encoding`` if it names a supported encoding.

    Raises:
        KernelInputError: for any other value.
    """
    if encoding not in get_args(Encoding):
        raise KernelInputError(
            f"encoding: expected one of {list(get_args(Encoding))}, got {encoding!r}"
        )
    return encoding  # type: ignore[return-value]


def encoding_of(dtype: torch.dtype, name: str) -> Encoding:
    """Maps a quantized data dtype back to its encoding name.

    Raises:
        KernelInputError: if ``dtype`` is neither int8 nor float8_e4m3fn.
    """
    for encoding, data_dtype in DATA_DTYPES.items():
        if dtype == data_dtype:
            return encoding  # type: ignore[return-value]
    raise KernelInputError(f"{name}: expected dtype int8 or float8_e4m3fn, got {dtype}")
