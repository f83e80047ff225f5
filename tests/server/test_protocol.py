"""The wire protocol: committed stubs match the .proto; the frame codec matches protobuf."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.wire import kvtier_cache_pb2 as pb
from kvtier.wire.frames import (
    FrameError,
    batches,
    decode_get_batch,
    decode_get_frame,
    decode_put_batch,
    decode_put_frame,
    encode_batch,
    encode_frame,
    get_frame,
    put_frame,
)
from kvtier.wire.generate import HERE, OUTPUTS, generate

# Lines that record which grpcio-tools/protobuf version generated a file: a
# different tool version is not a stale .proto.
_VERSION_STAMPS = [
    re.compile(r"^# Protobuf Python Version: .*$", re.M),
    re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.M),
    re.compile(r"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)", re.S),
]


def _normalise(text: str) -> str:
    for pattern in _VERSION_STAMPS:
        text = pattern.sub("<version>", text)
    return text


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    generate(tmp_path)
    for name in OUTPUTS:
        fresh = _normalise((tmp_path / name).read_text())
        committed = _normalise((HERE / name).read_text())
        assert fresh == committed, (
            f"kvtier/wire/{name} is stale against kvtier_cache.proto: run scripts/gen_proto.sh"
        )


def test_stale_check_detects_an_edited_proto(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvtier.wire.generate as gen

    edited = tmp_path / "kvtier_cache.proto"
    edited.write_text(
        gen.PROTO.read_text().replace("uint32 prefix_length = 1;", "uint64 prefix_length = 1;")
    )
    monkeypatch.setattr(gen, "PROTO", edited)
    out = tmp_path / "out"
    generate(out)
    assert _normalise((out / "kvtier_cache_pb2.py").read_text()) != _normalise(
        (HERE / "kvtier_cache_pb2.py").read_text()
    )


def test_generated_grpc_module_imports_as_a_package_module() -> None:
    from kvtier.wire import kvtier_cache_pb2_grpc as pbg

    assert pbg.kvtier_dot_wire_dot_kvtier__cache__pb2 is pb
    assert hasattr(pbg, "KvCacheStub") and hasattr(pbg, "KvCacheServicer")


u32 = st.integers(0, (1 << 32) - 1)
u64 = st.integers(0, (1 << 64) - 1)


@settings(max_examples=200, deadline=None)
@given(u32, st.booleans(), u64, u64, st.binary(max_size=300))
def test_get_frame_codec_matches_protobuf(
    index: int, found: bool, size: int, offset: int, data: bytes
) -> None:
    wire = encode_frame(get_frame(index, found, size, offset, data))
    assert (
        wire
        == pb.GetFrame(
            index=index, found=found, size=size, offset=offset, data=data
        ).SerializeToString()
    )
    f = decode_get_frame(wire)
    assert (f.index, f.found, f.size, f.offset, bytes(f.data)) == (index, found, size, offset, data)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=40), u64, st.binary(max_size=300))
def test_put_frame_codec_matches_protobuf(key: bytes, size: int, data: bytes) -> None:
    wire = encode_frame(put_frame(key, size, data))
    assert wire == pb.PutFrame(key=key, size=size, data=data).SerializeToString()
    f = decode_put_frame(wire)
    assert (bytes(f.key), f.size, bytes(f.data)) == (key, size, data)


frame_args = st.tuples(u32, st.booleans(), u64, u64, st.binary(max_size=100))


@settings(max_examples=100, deadline=None)
@given(st.lists(frame_args, max_size=6))
def test_get_batch_codec_matches_protobuf(frames: list[tuple[int, bool, int, int, bytes]]) -> None:
    wire = encode_batch([get_frame(*f) for f in frames])
    expected = pb.GetBatch(
        frames=[
            pb.GetFrame(index=i, found=fd, size=s, offset=o, data=d) for i, fd, s, o, d in frames
        ]
    )
    assert wire == expected.SerializeToString()
    got = [(f.index, f.found, f.size, f.offset, bytes(f.data)) for f in decode_get_batch(wire)]
    assert got == frames


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=20), u64, st.binary(max_size=100)), max_size=6))
def test_put_batch_codec_matches_protobuf(frames: list[tuple[bytes, int, bytes]]) -> None:
    wire = encode_batch([put_frame(*f) for f in frames])
    expected = pb.PutBatch(frames=[pb.PutFrame(key=k, size=s, data=d) for k, s, d in frames])
    assert wire == expected.SerializeToString()
    assert [(bytes(f.key), f.size, bytes(f.data)) for f in decode_put_batch(wire)] == frames


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=20), st.integers(1, 6000))
def test_batches_respect_the_data_budget(sizes: list[int], budget: int) -> None:
    frames = [get_frame(i, True, n, 0, b"x" * n) for i, n in enumerate(sizes)]
    out = [decode_get_batch(m) for m in batches(frames, budget)]
    assert [f.index for batch in out for f in batch] == list(range(len(sizes)))  # order kept
    for batch in out:
        assert batch, "no empty batches"
        assert len(batch) == 1 or sum(len(f.data) for f in batch) <= budget


def test_decoder_accepts_any_field_order_and_skips_unknown_fields() -> None:
    a = pb.GetFrame(data=b"xyz").SerializeToString()
    b = pb.GetFrame(index=7, found=True, size=3).SerializeToString()
    unknown = bytes([0x38, 0x05]) + bytes([0x42, 0x02]) + b"hi"  # field 7 varint, field 8 bytes
    f = decode_get_frame(a + unknown + b)
    assert (f.index, f.found, f.size, bytes(f.data)) == (7, True, 3, b"xyz")
    assert pb.GetFrame.FromString(a + unknown + b).index == 7


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_decoder_never_crashes_on_garbage(garbage: bytes) -> None:
    for decode in (decode_get_frame, decode_put_frame, decode_get_batch, decode_put_batch):
        with contextlib.suppress(FrameError):
            decode(garbage)


@pytest.mark.parametrize(
    "wire",
    [
        b"\x2a\x05ab",  # data declares 5 bytes, 2 remain
        b"\x08",  # truncated varint
        b"\x08" + b"\xff" * 11,  # varint over 10 bytes
        b"\x2b",  # wire type 3 (groups)
        b"\x00\x01",  # field number 0
        b"\x28\x01",  # data (field 5) sent as a varint
    ],
)
def test_decoder_rejects_malformed_frames(wire: bytes) -> None:
    with pytest.raises(FrameError):
        decode_get_frame(wire)
