"""KV encodings (the one ``Encoding`` of the project), quantization constants, the result type.

:class:`Encoding` is what the block format records in a header (``kvtier.block``)
and what the kernels take: ``raw`` KV in the cache dtype, or one of the
quantized encodings below.

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

import enum
from typing import NamedTuple

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


class Encoding(enum.IntEnum):
    """How KV values are represented (the value is the block header's byte)."""

    RAW = 0
    INT8 = 1
    FP8_E4M3 = 2

    @property
    def label(self) -> str:
        """The name in configuration files (``raw``, ``int8``, ``fp8_e4m3``)."""
        return self.name.lower()

    @property
    def quantized(self) -> bool:
        """Stored as codes plus scales."""
        return self is not Encoding.RAW

    @classmethod
    def parse(cls, name: str | Encoding) -> Encoding:
        """The encoding called ``name`` (or ``name`` itself).

        Raises:
            ValueError: for an unknown name.
        """
        if isinstance(name, Encoding):
            return name
        for enc in cls:
            if enc.label == name:
                return enc
        raise ValueError(f"unknown encoding {name!r}; expected one of {[e.label for e in cls]}")


# NOTE: a normal float32 (not a denormal) so that a GPU that flushes denormals
# computes the same scale as the CPU reference.
SCALE_FLOOR = 1e-12

QMAX: dict[Encoding, float] = {Encoding.INT8: 127.0, Encoding.FP8_E4M3: 448.0}

DATA_DTYPES: dict[Encoding, torch.dtype] = {
    Encoding.INT8: torch.int8,
    Encoding.FP8_E4M3: torch.float8_e4m3fn,
}


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


def check_encoding(encoding: Encoding | str) -> Encoding:
    """The quantized encoding ``encoding`` names (an ``Encoding`` or its label).

    Raises:
        KernelInputError: for ``raw`` or any other value.
    """
    quantized = [e.label for e in DATA_DTYPES]
    try:
        enc = Encoding.parse(encoding)
    except ValueError:
        enc = Encoding.RAW
    if enc not in DATA_DTYPES:
        raise KernelInputError(f"encoding: expected one of {quantized}, got {encoding!r}")
    return enc


def encoding_of(dtype: torch.dtype, name: str) -> Encoding:
    """Maps a quantized data dtype back to its encoding name.

    Raises:
        KernelInputError: if ``dtype`` is neither int8 nor float8_e4m3fn.
    """
    for encoding, data_dtype in DATA_DTYPES.items():
        if dtype == data_dtype:
            return encoding
    raise KernelInputError(f"{name}: expected dtype int8 or float8_e4m3fn, got {dtype}")
