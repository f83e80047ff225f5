"""Chunk keys chained with a cryptographic hash by default, xxh3 on request; the namespace says which."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys

import pytest

from kvtier.config import KvtierConfig, load_config
from kvtier.errors import ConfigError
from kvtier.keys import CacheNamespace, KeyHash, PrefixKeys, chunk_keys

NS = CacheNamespace("SmolLM2-135M-Instruct", "a" * 64, 30, 3, 64, "bfloat16", 256)
TOKENS = [(i * 7919) % 49152 for i in range(600)]

# Computed once with SHA-256 and hard-coded: if these change, every stored
# block turns cold (a format break) — that must be a decision, never an accident.
PINNED = [
    "f242849c1498c794459e42359bb76ea6",  # tokens [0, 256)
    "550099736764afd90b41f7f17d7a2c68",  # [0, 512)
    "c8439fc9f1f8e43dd2848aad849bbf88",  # [0, 600): the partial last chunk
]
PINNED_PREFIX_304 = "1d3013eb7f22d758b06e1a1b7df1f270"  # PrefixKeys.key(304), off a chunk

_SCRIPT = """
from kvtier.keys import CacheNamespace, PrefixKeys, chunk_keys
ns = CacheNamespace("SmolLM2-135M-Instruct", "a" * 64, 30, 3, 64, "bfloat16", 256)
toks = [(i * 7919) % 49152 for i in range(600)]
keys = PrefixKeys(ns, 16)
keys.extend(toks)
print(" ".join(k.hex() for k in chunk_keys(toks, ns, include_partial=True)), keys.key(304).hex())
"""


def test_sha256_is_the_default_and_its_keys_are_pinned() -> None:
    assert NS.key_hash is KeyHash.SHA256
    assert [k.hex() for k in chunk_keys(TOKENS, NS, include_partial=True)] == PINNED
    keys = PrefixKeys(NS, 16)
    keys.extend(TOKENS)
    assert keys.key(304).hex() == PINNED_PREFIX_304


def test_sha256_keys_are_the_same_in_other_processes() -> None:
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        assert out.stdout.split() == [*PINNED, PINNED_PREFIX_304]


def test_the_chain_is_truncated_sha256_of_the_documented_bytes() -> None:
    prev = hashlib.sha256(NS.encode()).digest()[:16]
    for i, want in enumerate(PINNED[:2]):
        data = b"".join(t.to_bytes(4, "little") for t in TOKENS[256 * i : 256 * (i + 1)])
        prev = hashlib.sha256(prev + data).digest()[:16]
        assert prev.hex() == want


@pytest.mark.parametrize("key_hash", ["sha256", "xxh3"])
def test_prefix_keys_grown_in_any_steps_equal_hashing_each_prefix_whole(key_hash: str) -> None:
    ns = CacheNamespace("m", "f", 2, 2, 8, "bfloat16", 64, key_hash=key_hash)  # type: ignore[arg-type]
    rng = random.Random(key_hash)
    toks = [rng.randrange(50_000) for _ in range(300)]
    grown = PrefixKeys(ns, 16)
    at = 0
    while at < len(toks):
        step = rng.randrange(1, 70)
        grown.extend(toks[at : at + step])
        at += step
        grown.keys_at(grown.lookup_ends(grown.num_tokens))  # hash as it grows
    for end in range(1, len(toks) + 1):
        # the plain definition: H(key of the last full chunk before ‖ tokens up to end)
        c0 = ((end - 1) // 64) * 64
        whole = chunk_keys(toks[:end], ns, include_partial=True)
        assert grown.key(end) == whole[-1], end
        assert len(whole) == c0 // 64 + 1


def test_the_namespace_records_the_hash_so_keys_never_mix() -> None:
    xxh = CacheNamespace(**{**NS.__dict__, "key_hash": "xxh3"})
    assert xxh.key_hash is KeyHash.XXH3 and xxh.encode() != NS.encode()
    pinned = {bytes.fromhex(h) for h in PINNED}
    assert not set(chunk_keys(TOKENS, xxh, include_partial=True)) & pinned


def test_an_unknown_hash_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown key hash 'md5'.*sha256.*xxh3"):
        CacheNamespace("m", "f", 1, 1, 1, "bfloat16", key_hash="md5")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"keys\.hash"):
        load_config(env={}, overrides={"keys": {"hash": "md5"}})


def test_the_configuration_selects_the_hash() -> None:
    assert KvtierConfig().keys.hash == "sha256"
    cfg = load_config(env={"KVTIER_KEYS__HASH": "xxh3"})
    assert cfg.keys.hash == "xxh3"
    assert KeyHash.parse(cfg.keys.hash) is KeyHash.XXH3
