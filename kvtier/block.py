"""The block format: one chunk of KV as one self-describing byte string.

Layout (little-endian)::

    offset size  field
    0      4     magic  b"KVTB"
    4      2     format version (2)
    6      2     header size (80)
    8      1     encoding      0 raw · 1 int8 · 2 fp8_e4m3
    9      1     compression   0 none · 1 lz4
    10     1     kv dtype      1 float16 · 2 bfloat16 · 3 float32 (what the KV decodes to)
    11     1     flags (0)
    12     2     layers
    14     2     kv heads
    16     2     head dim
    18     2     reserved (0)
    20     4     tokens
    24     4     scales length (bytes; 0 for raw)
    28     8     stored payload length (after compression)
    36     8     raw payload length (before compression)
    44     8     xxh64 checksum of header (this field zeroed) ‖ scales ‖ stored payload
    52     16    key: the 16-byte chunk key the block was encoded for
    68     12    reserved (0)
    80     ...   scales: float32 [layers, 2, tokens, kv_heads]   (quantized encodings only)
    ...    ...   payload: [layers, 2 (K,V), tokens, kv_heads, head_dim]
    ...    104   optional provenance trailer (magic ``KVTW``): who wrote the block,
                 stamped by the cache server (:mod:`kvtier.provenance`)

The checksum covers the header too, so a flipped dtype or shape field is
caught even when the lengths still agree. A reader validates magic, version,
every enum and dimension, every length against the actual buffer and against
the declared shape, and the checksum, and raises a subclass of
:class:`~kvtier.errors.CorruptBlockError` for the first thing that is wrong.
Decoding an uncompressed block is zero-copy: the returned tensors view the
input buffer.

**Key binding.** The header carries the key the block was encoded for, and a
reader that asks for a key passes it (``key=``): a valid block found under
another key — a moved file, a re-put under the wrong key, a race — raises
:class:`~kvtier.errors.KeyMismatchError` instead of handing another prefix's
KV to the model. Version 1 blocks (64-byte header, no key) raise
:class:`~kvtier.errors.UnsupportedVersionError`: a miss, never a guess.

**Provenance trailer.** A block may end with a fixed-size trailer naming
its writer and an HMAC tag over the rest (:mod:`kvtier.provenance` stamps
and checks it). The header's lengths and the checksum cover the *body*
(header, scales, payload) only, so a stamp can be added or replaced without
re-encoding; :func:`read_header` accepts a block of exactly its body's
length, or of its body plus one trailer that starts with the trailer magic.

**Bounded decompression.** Before an lz4 payload is decompressed, its
declared size must equal what its shape implies (checked for every block),
be reachable from its compressed length (lz4 expands at most ~255x) and,
when the reader states its layout (:class:`BlockSpec`), fit the most tokens
it expects: a hostile size is a :class:`~kvtier.errors.BadLengthError` /
:class:`~kvtier.errors.BadShapeError`, never a large allocation.
"""

from __future__ import annotations

import enum
import struct
import warnings
from dataclasses import dataclass
from typing import Any

import lz4.block
import torch
import xxhash

from kvtier.errors import (
    BadHeaderError,
    BadLengthError,
    BadMagicError,
    BadShapeError,
    ChecksumError,
    CorruptBlockError,
    KeyMismatchError,
    UnsupportedVersionError,
)
from kvtier.kernels.quant import Encoding
from kvtier.keys import KEY_BYTES

MAGIC = b"KVTB"
VERSION = 2
HEADER_SIZE = 80
_HEADER = struct.Struct("<4sHHBBBBHHHHIIQQQ16s12s")
_PREAMBLE = struct.Struct("<4sHH")  # magic, version, header size: the same in every version
_CHECKSUM_OFFSET = 44
# NOTE: an lz4 sequence of n bytes can describe at most ~255 n bytes of output
# (one byte of match length per 255 bytes matched), so a declared size above
# this bound cannot be what the stored bytes decompress to.
_LZ4_MAX_RATIO = 255
_LZ4_SLACK = 64
assert _HEADER.size == HEADER_SIZE

TRAILER_MAGIC = b"KVTW"
TRAILER_SIZE = 104
"""Bytes of the optional provenance trailer after a block's body (:mod:`kvtier.provenance`)."""


class Compression(enum.IntEnum):
    """How the payload is compressed."""

    NONE = 0
    LZ4 = 1

    @classmethod
    def parse(cls, name: str) -> Compression:
        try:
            return {"none": cls.NONE, "lz4": cls.LZ4}[name]
        except KeyError:
            raise ValueError(f"unknown compression {name!r}; expected 'none' or 'lz4'") from None


_DTYPE_CODES: dict[torch.dtype, int] = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_ENCODED_DTYPES = {Encoding.INT8: torch.int8, Encoding.FP8_E4M3: torch.float8_e4m3fn}


@dataclass(frozen=True)
class BlockHeader:
    """The decoded header of one block."""

    encoding: Encoding
    compression: Compression
    kv_dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    scales_len: int
    payload_len: int
    raw_payload_len: int
    checksum: int
    key: bytes  # the KEY_BYTES key the block was encoded for

    @property
    def payload_dtype(self) -> torch.dtype:
        """The dtype of the stored payload elements."""
        return _ENCODED_DTYPES.get(self.encoding, self.kv_dtype)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``[layers, 2, tokens, kv_heads, head_dim]``."""
        return (self.num_layers, 2, self.num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def total_len(self) -> int:
        """Length of the encoded block's body (header, scales, payload) in bytes.

        A stamped block is :data:`TRAILER_SIZE` bytes longer (its provenance trailer).
        """
        return HEADER_SIZE + self.scales_len + self.payload_len


@dataclass(frozen=True)
class BlockSpec:
    """What a reader expects of a block: the KV layout of its engine.

    ``max_tokens`` (the chunk size, when given) also bounds the tokens a block
    may declare, so a hostile header cannot make a reader decompress more
    than one chunk of this layout.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: torch.dtype
    max_tokens: int | None = None


@dataclass(frozen=True)
class DecodedBlock:
    """A decoded block. ``payload`` may view the encoded buffer (read-only: do not write)."""

    header: BlockHeader
    payload: torch.Tensor  # [layers, 2, tokens, kv_heads, head_dim], header.payload_dtype
    scales: torch.Tensor | None  # [layers, 2, tokens, kv_heads] float32, quantized only


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _as_bytes_view(t: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor, without copying."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    arr: Any = t.view(torch.uint8).reshape(-1).numpy()
    return memoryview(arr)


def encode_block(
    payload: torch.Tensor,
    *,
    key: bytes,
    encoding: Encoding = Encoding.RAW,
    scales: torch.Tensor | None = None,
    kv_dtype: torch.dtype | None = None,
    compression: Compression = Compression.NONE,
) -> bytes:
    """Serialise one chunk of KV.

    Args:
        payload: ``[layers, 2, tokens, kv_heads, head_dim]``. For ``RAW`` a
            float16/bfloat16/float32 tensor; for ``INT8`` int8; for
            ``FP8_E4M3`` float8_e4m3fn.
        key: The 16-byte key the block will be stored under (its header
            carries it; readers check it).
        encoding: The encoding of ``payload``.
        scales: ``[layers, 2, tokens, kv_heads]`` float32; required for
            quantized encodings, forbidden for raw.
        kv_dtype: The dtype the KV dequantizes to; required for quantized
            encodings, ignored (taken from ``payload``) for raw.
        compression: Payload compression.

    Returns:
        The encoded block.

    Raises:
        ValueError: The tensors do not form a valid block.
    """
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a block key is {KEY_BYTES} bytes, got {key!r}")
    if payload.dim() != 5 or payload.shape[1] != 2:
        raise ValueError(
            f"payload must be [layers, 2, tokens, kv_heads, head_dim], got {tuple(payload.shape)}"
        )
    layers, _, tokens, heads, head_dim = payload.shape
    if min(layers, heads, head_dim) <= 0 or max(layers, heads, head_dim) > 0xFFFF:
        raise ValueError(f"payload dimensions out of range: {tuple(payload.shape)}")
    if encoding == Encoding.RAW:
        if payload.dtype not in _DTYPE_CODES:
            raise ValueError(
                f"raw payload dtype must be float16/bfloat16/float32, got {payload.dtype}"
            )
        if scales is not None:
            raise ValueError("raw blocks carry no scales")
        kv_dtype = payload.dtype
        scales_view = memoryview(b"")
    else:
        expected = _ENCODED_DTYPES[encoding]
        if payload.dtype != expected:
            raise ValueError(f"{encoding.label} payload must be {expected}, got {payload.dtype}")
        if kv_dtype not in _DTYPE_CODES:
            raise ValueError(f"kv_dtype must be float16/bfloat16/float32, got {kv_dtype}")
        want = (layers, 2, tokens, heads)
        if scales is None or tuple(scales.shape) != want or scales.dtype != torch.float32:
            got = None if scales is None else (tuple(scales.shape), scales.dtype)
            raise ValueError(
                f"{encoding.label} blocks need float32 scales of shape {want}, got {got}"
            )
        scales_view = _as_bytes_view(scales)
    assert kv_dtype is not None

    raw_view = _as_bytes_view(payload)
    stored: bytes | memoryview = raw_view
    if compression == Compression.LZ4:
        stored = lz4.block.compress(raw_view, store_size=False)
    header = _HEADER.pack(
        MAGIC,
        VERSION,
        HEADER_SIZE,
        int(encoding),
        int(compression),
        _DTYPE_CODES[kv_dtype],
        0,
        layers,
        heads,
        head_dim,
        0,
        tokens,
        len(scales_view),
        len(stored),
        len(raw_view),
        0,
        key,
        bytes(12),
    )
    h = xxhash.xxh64(header)
    h.update(scales_view)
    h.update(stored)
    header = (
        header[:_CHECKSUM_OFFSET]
        + struct.pack("<Q", h.intdigest())
        + header[_CHECKSUM_OFFSET + 8 :]
    )
    return b"".join((header, scales_view, stored))


def read_header(data: bytes | bytearray | memoryview) -> BlockHeader:
    """Parse and validate the header and the lengths (not the checksum, not the key).

    Raises:
        CorruptBlockError: a subclass naming what is wrong.
    """
    if len(data) < _PREAMBLE.size:
        if bytes(data[:4]) != MAGIC[: min(4, len(data))]:
            raise BadMagicError("not a kvtier block (bad magic)")
        raise BadLengthError(f"block is {len(data)} bytes, shorter than its header")
    magic, version, header_size = _PREAMBLE.unpack_from(data, 0)
    if magic != MAGIC:
        raise BadMagicError(f"not a kvtier block (magic {magic!r})")
    if version != VERSION or header_size != HEADER_SIZE:
        older = " (written before blocks carried their key)" if version < VERSION else ""
        raise UnsupportedVersionError(
            f"block format version {version} (header {header_size} B){older} is not "
            f"supported; this reader reads version {VERSION}"
        )
    if len(data) < HEADER_SIZE:
        raise BadLengthError(
            f"block is {len(data)} bytes, shorter than its {HEADER_SIZE}-byte header"
        )
    (
        _magic,
        _version,
        _header_size,
        enc,
        comp,
        dtype_code,
        flags,
        layers,
        heads,
        head_dim,
        reserved16,
        tokens,
        scales_len,
        payload_len,
        raw_len,
        checksum,
        key,
        reserved,
    ) = _HEADER.unpack_from(data, 0)
    try:
        encoding = Encoding(enc)
        compression = Compression(comp)
    except ValueError as e:
        raise BadHeaderError(str(e)) from None
    if dtype_code not in _CODE_DTYPES:
        raise BadHeaderError(f"unknown kv dtype code {dtype_code}")
    if flags or reserved16 or any(reserved):
        raise BadHeaderError("reserved header fields are not zero")
    if min(layers, heads, head_dim) == 0:
        raise BadHeaderError(
            f"zero dimension in header: layers={layers} heads={heads} head_dim={head_dim}"
        )
    header = BlockHeader(
        encoding=encoding,
        compression=compression,
        kv_dtype=_CODE_DTYPES[dtype_code],
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        num_tokens=tokens,
        scales_len=scales_len,
        payload_len=payload_len,
        raw_payload_len=raw_len,
        checksum=checksum,
        key=key,
    )
    itemsize = header.payload_dtype.itemsize
    if raw_len != _numel(header.shape) * itemsize:
        raise BadLengthError(
            f"raw payload length {raw_len} does not match shape {header.shape} of {header.payload_dtype}"
        )
    want_scales = 0 if encoding == Encoding.RAW else layers * 2 * tokens * heads * 4
    if scales_len != want_scales:
        raise BadLengthError(f"scales length {scales_len}, expected {want_scales}")
    if compression == Compression.NONE and payload_len != raw_len:
        raise BadLengthError(f"uncompressed payload length {payload_len} != raw length {raw_len}")
    if compression == Compression.LZ4 and raw_len > payload_len * _LZ4_MAX_RATIO + _LZ4_SLACK:
        raise BadLengthError(
            f"lz4 payload of {payload_len} bytes cannot decompress to the {raw_len} bytes "
            f"its shape {header.shape} declares"
        )
    body = header.total_len
    if len(data) != body and not (
        len(data) == body + TRAILER_SIZE and bytes(data[body : body + 4]) == TRAILER_MAGIC
    ):
        raise BadLengthError(f"block is {len(data)} bytes but its header declares {body}")
    return header


def has_trailer(data: bytes | bytearray | memoryview, header: BlockHeader) -> bool:
    """Whether a block that passed :func:`read_header` ends with a provenance trailer."""
    return len(data) > header.total_len


def check_key(header: BlockHeader, key: bytes) -> None:
    """Check that a block was encoded for ``key``.

    Raises:
        KeyMismatchError: it carries another key.
    """
    if header.key != key:
        raise KeyMismatchError(
            f"block was encoded for key {header.key.hex()}, not for key {bytes(key).hex()}"
        )


def verify_block(data: bytes | bytearray | memoryview, *, key: bytes | None = None) -> BlockHeader:
    """Validate header, lengths and checksum (and the key, if given) without decoding the payload.

    Raises:
        CorruptBlockError: a subclass naming what is wrong
            (:class:`~kvtier.errors.KeyMismatchError` for a block of another key).
    """
    header = read_header(data)
    if key is not None:
        check_key(header, key)
    view = memoryview(data)
    h = xxhash.xxh64(view[:_CHECKSUM_OFFSET])
    h.update(b"\0" * 8)
    h.update(view[_CHECKSUM_OFFSET + 8 : HEADER_SIZE])
    h.update(view[HEADER_SIZE : header.total_len])
    if h.intdigest() != header.checksum:
        raise ChecksumError("block checksum mismatch")
    return header


def _frombuffer(
    buf: bytes | bytearray | memoryview, dtype: torch.dtype, offset: int, count: int
) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        # NOTE: torch warns that a read-only buffer gives a tensor it cannot
        # protect; DecodedBlock documents that its tensors must not be written.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype, offset=offset, count=count)


def decode_block(
    data: bytes | bytearray | memoryview,
    *,
    key: bytes | None = None,
    expect: BlockSpec | None = None,
    verify: bool = True,
) -> DecodedBlock:
    """Parse a block into tensors.

    Args:
        data: The encoded block. For uncompressed blocks the returned tensors
            view this buffer, which must then outlive them and not change.
        key: If given, the key the block must have been encoded for (checked
            whether or not ``verify`` is set: it costs a 16-byte compare).
        expect: If given, the block's layout must match it (checked before
            any decompression).
        verify: Check the checksum (skip only for bytes verified before).

    Raises:
        CorruptBlockError: a subclass naming what is wrong.
    """
    header = verify_block(data) if verify else read_header(data)
    if key is not None:
        check_key(header, key)
    if expect is not None:
        got = (header.num_layers, header.num_kv_heads, header.head_dim, header.kv_dtype)
        want = (expect.num_layers, expect.num_kv_heads, expect.head_dim, expect.kv_dtype)
        if got != want:
            raise BadShapeError(
                f"block layout (layers, kv_heads, head_dim, dtype) {got} != expected {want}"
            )
        if expect.max_tokens is not None and header.num_tokens > expect.max_tokens:
            raise BadShapeError(
                f"block declares {header.num_tokens} tokens, more than the {expect.max_tokens} "
                "of a chunk"
            )
    scales = None
    if header.scales_len:
        count = header.scales_len // 4
        scales = _frombuffer(data, torch.float32, HEADER_SIZE, count).view(header.shape[:4])
    start = HEADER_SIZE + header.scales_len
    dtype = header.payload_dtype
    itemsize = dtype.itemsize
    if header.compression == Compression.LZ4:
        try:
            raw: bytes | bytearray | memoryview = lz4.block.decompress(
                memoryview(data)[start : header.total_len],
                uncompressed_size=header.raw_payload_len,
            )
        except lz4.block.LZ4BlockError as e:
            raise CorruptBlockError(f"lz4 payload does not decompress: {e}") from None
        if len(raw) != header.raw_payload_len:
            raise BadLengthError("lz4 payload decompressed to the wrong length")
        start = 0
    else:
        raw = data
    payload = _frombuffer(raw, dtype, start, header.raw_payload_len // itemsize).view(header.shape)
    return DecodedBlock(header=header, payload=payload, scales=scales)


def activation_like_kv(
    shape: tuple[int, int, int, int, int], dtype: torch.dtype = torch.bfloat16, *, seed: int = 0
) -> torch.Tensor:
    """Random KV that looks like real activations, for demos, tests and benchmarks.

    Real K/V are roughly normal per channel with channel-dependent scales and a
    few outlier channels (keys especially, after RoPE). Uniform noise would
    make compression and quantization look different from reality.

    Args:
        shape: ``[layers, 2, tokens, kv_heads, head_dim]``.
    """
    g = torch.Generator().manual_seed(seed)
    layers, _, _, heads, head_dim = shape
    channel_scale = torch.exp(torch.randn(layers, 2, 1, heads, head_dim, generator=g) * 0.5)
    outliers = torch.rand(layers, 2, 1, heads, head_dim, generator=g) < 0.02
    channel_scale = torch.where(outliers, channel_scale * 8.0, channel_scale)
    x = torch.randn(shape, generator=g) * channel_scale
    return x.to(dtype)
