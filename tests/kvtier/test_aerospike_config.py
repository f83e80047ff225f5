"""AerospikeTierConfig validation, the record layout (manifest format) and the namespace
rules (record limits, TTL), without a server."""

from __future__ import annotations

import os

import aerospike
import pytest
import torch
from pydantic import ValidationError

from kvtier.block import activation_like_kv, encode_block, verify_block
from kvtier.errors import ChecksumError, ConfigError
from kvtier.tiers.aerospike_config import AerospikeHost, AerospikeTierConfig
from kvtier.tiers.aerospike_layout import (
    CHECKSUM_KVTB,
    CHECKSUM_XXH3,
    HEAD_BYTES,
    Manifest,
    ManifestError,
    segment_key,
)
from kvtier.tiers.aerospike_namespace import (
    RecordLimits,
    check_ttl,
    client_config,
    parse_info,
    record_limits,
)


def test_defaults() -> None:
    c = AerospikeTierConfig()
    assert c.type == "aerospike"
    assert c.namespace == "kvcache" and c.set_name == "kvblocks"
    assert c.host_list() == [("127.0.0.1", 3000)]
    assert c.segment_size is None
    assert c.skip_existing is False  # a put is one request; a held block is found by it
    assert c.cleanup_grace_s * 1000 >= c.write_timeout_ms


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("db1", ("db1", 3000)),
        ("db1:3100", ("db1", 3100)),
        ("[::1]:3200", ("::1", 3200)),
        ("[fe80::1]", ("fe80::1", 3000)),
        ({"host": "db2", "port": 4000}, ("db2", 4000)),
    ],
)
def test_hosts_accept_strings_and_objects(spec: object, want: tuple[str, int]) -> None:
    c = AerospikeTierConfig(hosts=[spec])  # type: ignore[list-item]
    assert c.host_list() == [want]


@pytest.mark.parametrize(
    "spec", ["", "db:", "db:abc", "::1:3000", "[::1", "db:0", "db:70000", ":3000"]
)
def test_bad_hosts_are_rejected(spec: str) -> None:
    with pytest.raises(ValidationError):
        AerospikeTierConfig(hosts=[spec])  # type: ignore[list-item]


def test_host_str_round_trips() -> None:
    assert str(AerospikeHost(host="::1", port=3000)) == "[::1]:3000"
    assert str(AerospikeHost(host="db", port=3001)) == "db:3001"


def test_byte_sizes_accept_units() -> None:
    c = AerospikeTierConfig(
        segment_size="512KiB", record_size_margin="8KiB", max_batch_bytes="16MiB"
    )  # type: ignore[arg-type]
    assert c.segment_size == 512 * 1024
    assert c.record_size_margin == 8192
    assert c.max_batch_bytes == 16 * 1024 * 1024


@pytest.mark.parametrize(
    "kwargs",
    [
        {"segment_size": "12 parsecs"},
        {"segment_size": "16MiB"},  # over the server's 8 MiB ceiling
        {"segment_size": 100},
        {"max_batch_bytes": "100MiB"},  # must stay well under the 128 MiB request limit
        {"ttl_s": -2},
        {"ttl_s": 11 * 365 * 24 * 3600},
        {"recency": "sometimes"},
        {"read_touch_ttl_percent": 0},
        {"breaker_threshold": 0},
        {"breaker_cooldown_s": 0},
        {"max_retries": -1},
        {"retry_backoff_ms": 50, "retry_backoff_cap_ms": 10},
        {"namespace": ""},
        {"unknown_key": 1},
        {"type": "disk"},
        {"cleanup_grace_s": -1},
        {"cleanup_grace_s": 1, "write_timeout_ms": 2000},  # could remove a write in flight
    ],
)
def test_bad_values_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        AerospikeTierConfig(**kwargs)  # type: ignore[arg-type]


def test_bad_unit_error_names_the_value() -> None:
    with pytest.raises(ValidationError, match="12 parsecs"):
        AerospikeTierConfig(segment_size="12 parsecs")  # type: ignore[arg-type]


def test_manifest_round_trip_and_split() -> None:
    block = os.urandom(10_000)
    m = Manifest.for_block(block, 3000)
    assert m.n_segments == 4
    assert len(m.nonce) == 8
    parts = m.split(block)
    assert [len(p) for p in parts] == [3000, 3000, 3000, 1000]
    decoded = Manifest.decode(m.encode())
    assert decoded == m
    assert decoded.assemble(parts) == block
    assert decoded.head == block[:HEAD_BYTES]


def test_assemble_rejects_wrong_segments() -> None:
    block = os.urandom(7000)
    m = Manifest.for_block(block, 3000)
    parts = m.split(block)
    assert m.assemble(parts[:2]) is None  # missing
    assert m.assemble([parts[0], parts[1], parts[2] + b"x"]) is None  # wrong length
    flipped = bytearray(parts[1])
    flipped[5] ^= 1
    assert m.assemble([parts[0], bytes(flipped), parts[2]]) is None  # checksum
    other = Manifest.for_block(os.urandom(7000), 3000)
    assert other.assemble(parts) is None


def kv_block(key: bytes, seed: int) -> bytes:
    """A kvtier block of 24,656 bytes (an 80-byte header and a float32 payload)."""
    return encode_block(activation_like_kv((2, 2, 16, 3, 32), torch.float32, seed=seed), key=key)


def test_a_kvtier_block_is_checked_by_its_identity_and_tags_not_its_body() -> None:
    key = os.urandom(16)
    block = kv_block(key, 1)
    m = Manifest.for_block(block, 3000)
    assert m.kind == CHECKSUM_KVTB and Manifest.decode(m.encode()) == m
    assert Manifest.for_block(os.urandom(len(block)), 3000).kind == CHECKSUM_XXH3
    parts = m.split(block)
    tags = [m.tag] * len(parts)
    assert m.assemble(parts, tags) == block
    # the identity covers the header (with the body's checksum), not the body: no pass over it
    body_flipped = bytearray(block)
    body_flipped[5000] ^= 1
    assert Manifest.for_block(bytes(body_flipped), 3000).checksum == m.checksum
    # so a flipped body bit passes the tier and is the consumer's checksum mismatch
    flipped = bytearray(parts[1])
    flipped[5000 - 3000] ^= 1
    got = m.assemble([parts[0], bytes(flipped), *parts[2:]], tags)
    assert got is not None
    with pytest.raises(ChecksumError):
        verify_block(got, key=key)


def test_segments_of_another_writers_block_are_refused_by_their_tags() -> None:
    """Two writers of one key with other bytes (engines need not compute bit-identical KV)
    cut at one size: segments of both, joined, would pass lengths and head; the tags tell."""
    key = os.urandom(16)
    a, b = kv_block(key, 1), kv_block(key, 2)
    ma, mb = Manifest.for_block(a, 3000), Manifest.for_block(b, 3000)
    assert ma.tag != mb.tag and not ma.same_block(mb)
    pa, pb = ma.split(a), mb.split(b)
    mixed, mixed_tags = [pa[0], pb[1], *pa[2:]], [ma.tag, mb.tag, *[ma.tag] * (len(pa) - 2)]
    assert ma.assemble(mixed, mixed_tags) is None
    assert ma.assemble(pa, None) is None  # untagged (a kind-1 writer's segments)
    assert ma.assemble(pa, [ma.tag] * (len(pa) - 1) + [None]) is None
    # the same block cut at another size: other tags
    assert Manifest.for_block(a, 4000).tag != ma.tag
    # a trailer (a cache server's provenance stamp) is part of the identity
    stamped = a + b"KVTW" + bytes(100)
    assert Manifest.for_block(stamped, 3000).checksum != ma.checksum


def test_each_write_gets_its_own_segment_keys() -> None:
    block = os.urandom(5000)
    a, b = Manifest.for_block(block, 1000), Manifest.for_block(block, 1000)
    key = os.urandom(16)
    assert a.nonce != b.nonce
    assert not set(a.segment_keys(key)) & set(b.segment_keys(key))
    assert segment_key(key, a.nonce, 1) == a.segment_keys(key)[1]
    assert all(len(k) == 28 for k in a.segment_keys(key))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b[:10],
        lambda b: b"XXXX" + b[4:],
        lambda b: b[:4] + b"\x09" + b[5:],  # version
        lambda b: b[:8] + (99).to_bytes(4, "little") + b[12:],  # segment count
        lambda b: b + b"extra",
    ],
)
def test_decode_rejects_bad_manifests(mutate) -> None:
    raw = Manifest.for_block(os.urandom(5000), 1000).encode()
    with pytest.raises(ManifestError):
        Manifest.decode(mutate(raw))


def test_parse_info_strips_the_command_and_splits_pairs() -> None:
    replies = {
        "A": (None, "namespace/kvcache\tobjects=3;max-record-size=1048576\n"),
        "B": (None, "objects=4;max-record-size=524288;junk\n"),
    }
    infos = parse_info("namespace/kvcache", replies, ";")
    assert infos == [
        {"objects": "3", "max-record-size": "1048576"},
        {"objects": "4", "max-record-size": "524288"},
    ]
    assert parse_info(
        "sets/kvcache/s", {"A": (None, "objects=1:data_used_bytes=64:x=y;\n")}, ":"
    ) == [{"objects": "1", "data_used_bytes": "64", "x": "y"}]
    with pytest.raises(ValueError, match="node B"):
        parse_info("build", {"B": ("timeout", None)}, ";")


def test_record_limits_take_the_smallest_cap_minus_the_margin() -> None:
    cfg = AerospikeTierConfig(record_size_margin="4KiB")  # type: ignore[arg-type]
    limits = record_limits(
        cfg, [{"max-record-size": "1048576"}, {"max-record-size": "524288"}], "h"
    )
    assert limits == RecordLimits(524288, 524288 - 4096, "max-record-size")
    legacy = record_limits(cfg, [{"storage-engine.write-block-size": "131072"}], "h")
    assert legacy == RecordLimits(131072, 131072 - 4096, "write-block-size")
    assumed = record_limits(cfg, [{"objects": "0"}], "h")
    assert assumed.source == "assumed" and assumed.max_record_size == 1024 * 1024
    tiny_margin = record_limits(
        AerospikeTierConfig(record_size_margin=0), [{"max-record-size": "65536"}], "h"
    )
    assert (
        tiny_margin.segment_size <= 65536 - 52
    )  # never closer to the cap than the record overhead


def test_record_limits_reject_what_cannot_fit() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        record_limits(AerospikeTierConfig(), [{"type": "unknown"}], "h")
    with pytest.raises(ConfigError, match="segment_size"):
        record_limits(
            AerospikeTierConfig(segment_size="1MiB"), [{"max-record-size": "1048576"}], "h"
        )  # type: ignore[arg-type]
    ok = record_limits(
        AerospikeTierConfig(segment_size="512KiB"), [{"max-record-size": "1048576"}], "h"
    )  # type: ignore[arg-type]
    assert ok == RecordLimits(1048576, 512 * 1024, "override")
    with pytest.raises(ConfigError, match="record_size_margin"):
        record_limits(
            AerospikeTierConfig(record_size_margin="1MiB"), [{"max-record-size": "1048576"}], "h"
        )  # type: ignore[arg-type]


def test_check_ttl_follows_the_nsup_rule() -> None:
    nsup_on = [{"nsup-period": "60", "default-ttl": "0"}]
    nsup_off = [{"nsup-period": "0", "default-ttl": "0"}]
    assert check_ttl(AerospikeTierConfig(ttl_s=100), nsup_on)
    with pytest.raises(ConfigError, match="nsup-period"):
        check_ttl(AerospikeTierConfig(ttl_s=100), nsup_off)
    allowed = [{"nsup-period": "0", "allow-ttl-without-nsup": "true"}]
    assert not check_ttl(AerospikeTierConfig(ttl_s=100), allowed)  # accepted, but nothing expires
    assert not check_ttl(AerospikeTierConfig(ttl_s=-1), nsup_on)
    assert not check_ttl(AerospikeTierConfig(ttl_s=0), nsup_on)  # namespace default-ttl 0: never
    assert check_ttl(AerospikeTierConfig(ttl_s=0), [{"nsup-period": "60", "default-ttl": "3600"}])


def test_client_config_retries_reads_on_the_replica_only() -> None:
    cfg = client_config(
        AerospikeTierConfig(hosts=["db:3100"], cluster_name="kv", total_timeout_ms=123)
    )
    assert cfg["hosts"] == [("db", 3100)] and cfg["cluster_name"] == "kv"
    policies = cfg["policies"]
    for name in ("read", "batch"):  # a dead or paused master: the client asks the replica
        assert policies[name]["max_retries"] == 1
        assert policies[name]["replica"] == aerospike.POLICY_REPLICA_SEQUENCE
    writes = ("write", "operate", "remove", "batch_parent_write")
    assert all(policies[name].get("max_retries", 0) == 0 for name in writes)  # the tier retries
    assert policies["batch"]["total_timeout"] == 123
    off = client_config(AerospikeTierConfig(replica_retries=0))["policies"]
    assert off["read"]["max_retries"] == off["batch"]["max_retries"] == 0
