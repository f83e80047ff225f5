from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.keys import KEY_BYTES, CacheNamespace, chunk_keys

NS = CacheNamespace(
    "m", "fp", num_layers=2, num_kv_heads=2, head_dim=8, kv_dtype="bfloat16", chunk_size=16
)
tokens_st = st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=200)


def test_counts_and_sizes() -> None:
    toks = list(range(50))
    keys = chunk_keys(toks, NS)
    assert len(keys) == 3
    assert all(len(k) == KEY_BYTES for k in keys)
    partial = chunk_keys(toks, NS, include_partial=True)
    assert len(partial) == 4
    assert partial[:3] == keys
    assert chunk_keys(list(range(48)), NS, include_partial=True) == chunk_keys(list(range(48)), NS)
    assert chunk_keys([], NS) == []


def test_partial_key_differs_from_full_key() -> None:
    short = chunk_keys(list(range(40)), NS, include_partial=True)
    full = chunk_keys(list(range(48)), NS)
    assert short[2] != full[2]


def test_accepts_numpy_and_lists_alike() -> None:
    toks = list(range(100))
    assert chunk_keys(np.array(toks, dtype=np.int64), NS) == chunk_keys(toks, NS)
    assert chunk_keys(np.array(toks, dtype=np.int32), NS) == chunk_keys(toks, NS)


def test_rejects_bad_tokens() -> None:
    with pytest.raises(ValueError):
        chunk_keys([1, -2, 3], NS)
    with pytest.raises(ValueError):
        chunk_keys([2**31], NS)
    with pytest.raises(ValueError):
        chunk_keys([1.5, 2.0], NS)


def test_namespace_validation() -> None:
    with pytest.raises(ConfigError, match="num_layers"):
        CacheNamespace("m", "f", 0, 2, 8, "bf16")
    with pytest.raises(ConfigError, match="model_id"):
        CacheNamespace("", "f", 1, 2, 8, "bf16")


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_id", "other"),
        ("weights_fingerprint", "fp2"),
        ("num_layers", 3),
        ("num_kv_heads", 4),
        ("head_dim", 16),
        ("kv_dtype", "float16"),
        ("chunk_size", 32),
        ("tenant_salt", b"tenant-a"),
        ("key_hash", "xxh3"),
    ],
)
def test_every_namespace_field_changes_every_key(field: str, value: object) -> None:
    other = CacheNamespace(**{**NS.__dict__, field: value})
    toks = list(range(64))
    a = set(chunk_keys(toks, NS))
    b = set(chunk_keys(toks, other))
    assert not (a & b)


def test_encoding_is_unambiguous() -> None:
    # Length prefixes stop "ab"+"c" from colliding with "a"+"bc".
    a = CacheNamespace("ab", "c", 1, 1, 1, "x")
    b = CacheNamespace("a", "bc", 1, 1, 1, "x")
    assert a.encode() != b.encode()


def test_tenants_are_isolated() -> None:
    toks = list(range(32))
    assert not set(chunk_keys(toks, NS.with_tenant("a"))) & set(
        chunk_keys(toks, NS.with_tenant("b"))
    )


@settings(max_examples=60, deadline=None)
@given(tokens_st, st.integers(0, 199), st.integers(0, 2**31 - 1))
def test_change_in_chunk_i_changes_keys_i_and_after_only(
    toks: list[int], pos: int, new: int
) -> None:
    if not toks:
        return
    pos %= len(toks)
    if toks[pos] == new:
        new = (new + 1) % (2**31)
    changed = list(toks)
    changed[pos] = new
    a = chunk_keys(toks, NS, include_partial=True)
    b = chunk_keys(changed, NS, include_partial=True)
    i = pos // NS.chunk_size
    assert a[:i] == b[:i]
    assert all(x != y for x, y in zip(a[i:], b[i:], strict=True))


@settings(max_examples=40, deadline=None)
@given(tokens_st, tokens_st)
def test_keys_depend_only_on_prefix(prefix: list[int], suffix: list[int]) -> None:
    n = len(prefix) // NS.chunk_size
    assert chunk_keys(prefix + suffix, NS)[:n] == chunk_keys(prefix, NS)


_SCRIPT = """
from kvtier.keys import CacheNamespace, chunk_keys
ns = CacheNamespace("SmolLM2", "abc", 30, 3, 64, "bfloat16", 256, b"t")
print(b"".join(chunk_keys(list(range(1000, 3000)), ns, include_partial=True)).hex())
"""


def test_identical_across_processes_and_hash_seeds() -> None:
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True
        )
        outs.add(out.stdout.strip())
    assert len(outs) == 1
    ns = CacheNamespace("SmolLM2", "abc", 30, 3, 64, "bfloat16", 256, b"t")
    assert (
        outs.pop() == b"".join(chunk_keys(list(range(1000, 3000)), ns, include_partial=True)).hex()
    )


@pytest.mark.parametrize(
    "key_hash,digest,pinned",
    [
        ("sha256", lambda b: hashlib.sha256(b).digest()[:16], "b9e5d36dcbad329cdf544359886b57f2"),
        ("xxh3", xxhash.xxh3_128_digest, "f49dc954ec49f245130a95112bfac703"),
    ],
)
def test_chain_matches_the_documented_scheme(
    key_hash: str, digest: Callable[[bytes], bytes], pinned: str
) -> None:
    ns = CacheNamespace("m", "f", 1, 1, 1, "bfloat16", 16, key_hash=key_hash)  # type: ignore[arg-type]
    toks = list(range(40))
    prev = digest(ns.encode())
    expected = []
    for i in range(2):
        prev = digest(prev + struct.pack("<16i", *toks[16 * i : 16 * (i + 1)]))
        expected.append(prev)
    assert chunk_keys(toks, ns) == expected
    # Pins the namespace encoding too: changing it is a format break (old caches go cold).
    assert expected[0].hex() == pinned
