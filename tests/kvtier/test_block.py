from __future__ import annotations

import ctypes
import struct

import pytest
import torch

from kvtier.block import (
    HEADER_SIZE,
    BlockSpec,
    Compression,
    Encoding,
    activation_like_kv,
    decode_block,
    encode_block,
    read_header,
    verify_block,
)
from kvtier.errors import (
    BadHeaderError,
    BadLengthError,
    BadMagicError,
    BadShapeError,
    ChecksumError,
    CorruptBlockError,
    UnsupportedVersionError,
)

SHAPE = (3, 2, 32, 2, 16)  # [layers, 2, tokens, kv_heads, head_dim]
KEY = bytes(range(16))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("compression", [Compression.NONE, Compression.LZ4])
def test_raw_round_trip_is_bitwise(dtype: torch.dtype, compression: Compression) -> None:
    kv = activation_like_kv(SHAPE, dtype, seed=3)
    kv.view(-1)[5] = float("nan")  # special values survive too
    kv.view(-1)[6] = float("-inf")
    block = encode_block(kv, key=KEY, compression=compression)
    out = decode_block(block)
    assert out.header.kv_dtype == dtype and out.header.shape == SHAPE
    assert out.scales is None
    assert torch.equal(_bits(out.payload), _bits(kv))


def test_uncompressed_decode_is_zero_copy() -> None:
    kv = activation_like_kv(SHAPE)
    block = encode_block(kv, key=KEY)
    out = decode_block(block)
    # The tensor views the block's buffer: its address lies inside it.
    base = ctypes.cast(ctypes.c_char_p(block), ctypes.c_void_p).value
    assert base is not None
    assert base <= out.payload.data_ptr() < base + len(block)


@pytest.mark.parametrize("encoding", [Encoding.INT8, Encoding.FP8_E4M3])
def test_quantized_round_trip_keeps_scales(encoding: Encoding) -> None:
    dtype = torch.int8 if encoding == Encoding.INT8 else torch.float8_e4m3fn
    data = torch.randint(-127, 128, SHAPE, dtype=torch.int8)
    if dtype != torch.int8:
        data = torch.randn(SHAPE).to(dtype)
    scales = torch.rand(SHAPE[:4])
    block = encode_block(data, key=KEY, encoding=encoding, scales=scales, kv_dtype=torch.bfloat16)
    out = decode_block(block)
    assert out.header.encoding == encoding and out.header.kv_dtype == torch.bfloat16
    assert out.scales is not None and torch.equal(out.scales, scales)
    assert torch.equal(_bits(out.payload), _bits(data))


def test_encode_rejects_inconsistent_input() -> None:
    with pytest.raises(ValueError):
        encode_block(torch.zeros(2, 3, 4, 5, 6), key=KEY)
    with pytest.raises(ValueError):
        encode_block(torch.zeros(SHAPE, dtype=torch.int32), key=KEY)
    with pytest.raises(ValueError):
        encode_block(
            torch.zeros(SHAPE, dtype=torch.int8),
            key=KEY,
            encoding=Encoding.INT8,
            kv_dtype=torch.float16,
        )
    with pytest.raises(ValueError):
        encode_block(torch.zeros(SHAPE), key=KEY, scales=torch.zeros(SHAPE[:4]))
    with pytest.raises(ValueError, match="16 bytes"):
        encode_block(torch.zeros(SHAPE), key=b"short")


@pytest.fixture(params=[Compression.NONE, Compression.LZ4])
def block(request: pytest.FixtureRequest) -> bytes:
    return encode_block(activation_like_kv(SHAPE, seed=1), key=KEY, compression=request.param)


def test_flipped_payload_byte_is_rejected(block: bytes) -> None:
    for pos in (HEADER_SIZE, len(block) // 2, len(block) - 1):
        bad = bytearray(block)
        bad[pos] ^= 0x01
        with pytest.raises(ChecksumError):
            decode_block(bytes(bad))


def test_flipped_dtype_field_is_rejected_even_with_consistent_lengths(block: bytes) -> None:
    bad = bytearray(block)
    bad[10] = 1  # bfloat16 -> float16: same item size, so only the checksum can tell
    with pytest.raises(ChecksumError):
        decode_block(bytes(bad))


def test_truncated_block_is_rejected(block: bytes) -> None:
    for n in (0, 3, HEADER_SIZE - 1, HEADER_SIZE, len(block) - 1):
        with pytest.raises(CorruptBlockError):
            decode_block(block[:n])
    with pytest.raises(BadLengthError):
        decode_block(block[:-1])


def test_extra_bytes_are_rejected(block: bytes) -> None:
    with pytest.raises(BadLengthError):
        decode_block(block + b"\0")


def test_wrong_magic_is_rejected(block: bytes) -> None:
    with pytest.raises(BadMagicError):
        decode_block(b"XXXX" + block[4:])
    with pytest.raises(BadMagicError):
        decode_block(b"junk")


def test_wrong_version_is_rejected(block: bytes) -> None:
    with pytest.raises(UnsupportedVersionError):
        decode_block(block[:4] + struct.pack("<H", 99) + block[6:])


def test_lying_length_is_rejected(block: bytes) -> None:
    # Declares a longer payload than the bytes present.
    bad = bytearray(block)
    payload_len = struct.unpack_from("<Q", bad, 28)[0]
    struct.pack_into("<Q", bad, 28, payload_len + 64)
    with pytest.raises(BadLengthError):
        decode_block(bytes(bad))
    # Declares a shape the payload length does not match.
    bad = bytearray(block)
    struct.pack_into("<I", bad, 20, SHAPE[2] + 1)
    with pytest.raises(BadLengthError):
        read_header(bytes(bad))


def test_unknown_enum_is_rejected(block: bytes) -> None:
    bad = bytearray(block)
    bad[8] = 9
    with pytest.raises(BadHeaderError):
        decode_block(bytes(bad))


def test_expected_layout_mismatch_is_rejected(block: bytes) -> None:
    decode_block(block, expect=BlockSpec(3, 2, 16, torch.bfloat16))
    with pytest.raises(BadShapeError):
        decode_block(block, expect=BlockSpec(4, 2, 16, torch.bfloat16))
    with pytest.raises(BadShapeError):
        decode_block(block, expect=BlockSpec(3, 2, 16, torch.float16))


def test_verify_returns_header(block: bytes) -> None:
    h = verify_block(block)
    assert h.shape == SHAPE and h.total_len == len(block)


def test_activation_like_kv_is_not_uniform_noise() -> None:
    kv = activation_like_kv((2, 2, 256, 4, 64), torch.float32)
    per_channel = kv.abs().mean(dim=(2,))  # [layers, 2, heads, dim]
    spread = per_channel.max() / per_channel.median()
    assert spread > 4  # outlier channels exist
