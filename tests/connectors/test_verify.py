"""Sampled verification of hits (connectors/verify.py), alone and inside the bundled engine.

A stored block whose KV values are wrong — re-encoded under its own key, so
checksum and key binding pass — is caught when it is sampled: counted,
deleted from every tier, quarantined (not saved again), and the engine's
greedy output stays that of a cold run. Right blocks, raw or int8 loaded
before the sampled chunk, match.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvtier.block import BlockSpec, Encoding, decode_block, encode_block
from kvtier.config import (
    CpuTierConfig,
    DiskTierConfig,
    KvtierConfig,
    effective_verify_fraction,
    load_config,
)
from kvtier.connectors.kvtier_connector import KvtierConnector
from kvtier.connectors.request_state import RequestState
from kvtier.connectors.verify import Quarantine, compare_chunk, random_sampler, tolerance
from kvtier.engine import LLM, SamplingParams
from kvtier.errors import ConfigError
from kvtier.factory import build_store
from kvtier.kernels import dequantize_chunk, quantize_chunk
from kvtier.keys import CacheNamespace, PrefixKeys
from kvtier.prefix import ObjectRef, StoredPrefix
from tests.engine.tiny_models import write_tiny_model

CHUNK = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SHAPE = (3, 2, CHUNK, 2, 16)  # [layers, 2, tokens, kv_heads, head_dim]
SPEC = BlockSpec(3, 2, 16, torch.float32)
KEY = bytes(range(16))


# ---- comparison, quarantine, sampling, planning (no engine) -------------------


def _kv(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g)


def _int8_block(kv: torch.Tensor, key: bytes = KEY) -> bytes:
    q = quantize_chunk(kv, "int8")
    return encode_block(
        q.data, key=key, encoding=Encoding.INT8, scales=q.scales, kv_dtype=torch.float32
    )


def test_raw_block_of_the_same_kv_matches_exactly() -> None:
    kv = _kv()
    verdict = compare_chunk(kv, encode_block(kv, key=KEY), KEY, SPEC)
    assert verdict.ok and verdict.error == 0.0 and verdict.describe() == "identical"


def test_raw_block_one_value_off_does_not_match() -> None:
    kv = _kv()
    wrong = kv.clone()
    wrong[2, 1, 5, 0] *= 1.5  # one token's V of one head in the last layer
    verdict = compare_chunk(kv, encode_block(wrong, key=KEY), KEY, SPEC)
    assert not verdict.ok and (verdict.layer, verdict.kv) == (2, 1)
    assert "layer 2 V" in verdict.describe()


def test_int8_block_within_its_bound_matches_and_wrong_values_do_not() -> None:
    kv = _kv()
    assert compare_chunk(kv, _int8_block(kv), KEY, SPEC).ok
    drifted = kv + 0.03 * _kv(1)  # recompute drift well inside int8's tolerance
    assert compare_chunk(drifted, _int8_block(kv), KEY, SPEC).ok
    other = _kv(2)  # KV of other tokens: off by ~100 %
    verdict = compare_chunk(other, _int8_block(kv), KEY, SPEC)
    assert not verdict.ok and verdict.error > 5 * verdict.tolerance


def test_block_of_another_key_or_shape_does_not_match() -> None:
    kv = _kv()
    assert not compare_chunk(kv, encode_block(kv, key=bytes(16)), KEY, SPEC).ok
    short = compare_chunk(kv, encode_block(kv[:, :, :16].contiguous(), key=KEY), KEY, SPEC)
    assert not short.ok and "shape" in short.reason


def test_tolerances() -> None:
    assert tolerance(Encoding.RAW, torch.float32) == 1e-4  # the floor, not 10 epsilons
    assert tolerance(Encoding.RAW, torch.float16) < 0.01
    assert tolerance(Encoding.RAW, torch.bfloat16) < tolerance(Encoding.INT8, torch.bfloat16)
    assert tolerance(Encoding.INT8, torch.bfloat16) < tolerance(Encoding.FP8_E4M3, torch.bfloat16)


def _drifted(kv: torch.Tensor, plane: tuple[int, int], error: float) -> torch.Tensor:
    """``kv`` with noise of relative RMS ``error`` added to one (layer, K/V) plane."""
    noise = _kv(7)[plane]
    out = kv.clone()
    out[plane] += noise * (error * kv[plane].norm() / noise.norm())
    return out


def test_a_bf16_block_from_another_engines_kernels_matches_and_wrong_kv_does_not() -> None:
    """bf16 KV that two vLLM-CPU engines computed for the same tokens differed by up to 2.2 %
    at layer 19 V (a chunk computed on a cached prefix against a whole prefill): a correct
    block, which one epsilon (0.78 %) had deleted from the shared tier. It matches now; KV of
    other tokens, or one token's values doubled, still does not."""
    spec = BlockSpec(3, 2, 16, torch.bfloat16)
    computed = _kv().to(torch.bfloat16)
    other_kernels = _drifted(_kv(), (2, 1), 0.022).to(torch.bfloat16)
    verdict = compare_chunk(computed, encode_block(other_kernels, key=KEY), KEY, spec)
    assert verdict.ok and 0.015 < verdict.error < verdict.tolerance
    assert verdict.error > float(torch.finfo(torch.bfloat16).eps)  # the old rule deleted it
    wrong = compare_chunk(computed, encode_block(_kv(2).to(torch.bfloat16), key=KEY), KEY, spec)
    assert not wrong.ok and wrong.error > 5 * wrong.tolerance
    one_off = computed.clone()
    one_off[2, 1, 5] *= 2.0  # one token's V in the last layer, every head
    assert not compare_chunk(computed, encode_block(one_off, key=KEY), KEY, spec).ok


def test_quarantine_expires_and_is_bounded() -> None:
    now = [0.0]
    q = Quarantine(max_keys=2, ttl_s=10.0, clock=lambda: now[0])
    q.add(b"a")
    q.add(b"b")
    assert b"a" in q and b"b" in q and len(q) == 2
    q.add(b"c")  # the oldest is forgotten
    assert b"a" not in q and b"c" in q
    now[0] = 10.0
    assert b"b" not in q and len(q) == 0
    with pytest.raises(ValueError, match="max_keys"):
        Quarantine(max_keys=0)


def test_random_sampler_draws_its_fraction() -> None:
    sample = random_sampler(0.25, random.Random(7))
    hits = sum(sample(KEY) for _ in range(4000))
    assert 800 < hits < 1200
    assert not any(random_sampler(0.0)(KEY) for _ in range(100))
    assert all(random_sampler(1.0)(KEY) for _ in range(100))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        random_sampler(1.5)


@pytest.mark.parametrize("value", ["1.5", "-0.1", "nan", "often"])
def test_verify_fraction_is_validated(value: str) -> None:
    with pytest.raises(ConfigError, match=r"connector\.verify_fraction"):
        load_config(env={"KVTIER_CONNECTOR__VERIFY_FRACTION": value})
    default = load_config(env={})
    assert default.connector.verify_fraction is None  # auto: on where a tier is shared
    assert effective_verify_fraction(KvtierConfig(tiers=[CpuTierConfig()])) == 0.0


def test_plan_stops_the_load_at_the_first_sampled_object() -> None:
    ns = CacheNamespace("m", "f", 1, 1, 8, "float32", chunk_size=CHUNK)
    state = RequestState.new(PrefixKeys(ns, 16), 16, list(range(3, 3 + 4 * CHUNK)))
    objs = tuple(
        ObjectRef(s, s + CHUNK, state.keys.key(s + CHUNK)) for s in range(0, 3 * CHUNK, CHUNK)
    )
    state.remember_lookup(StoredPrefix(3 * CHUNK, objs))
    draws: list[bytes] = []

    def sample(key: bytes) -> bool:
        draws.append(key)
        return key == objs[1].key

    assert state.plan_verification(0, 3 * CHUNK, sample) == CHUNK
    assert state.verify == list(objs[1:])
    assert state.plan_verification(0, 3 * CHUNK, sample) == CHUNK  # asked again: not redrawn
    assert draws == [objs[0].key, objs[1].key]
    assert state.verifiable(2 * CHUNK - 1) == []
    assert state.verifiable(2 * CHUNK) == [objs[1]] and state.verify == [objs[2]]
    # what the engine already holds (G1) is neither sampled nor verified
    assert state.plan_verification(2 * CHUNK, 3 * CHUNK, lambda k: True) == 2 * CHUNK
    assert state.verify == [objs[2]]


# ---- inside the engine ---------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=11)
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    doc = torch.randint(3, 380, (100,), generator=g).tolist()  # 3 full chunks, shared
    return [doc + torch.randint(3, 380, (n,), generator=g).tolist() for n in (7, 20)]


@pytest.fixture(scope="module")
def cold(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = _llm(model_dir)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def _llm(model_dir: Path, connector: KvtierConnector | None = None) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=16,
        num_threads=2,
        connector=connector,
    )


def _config(tmp: Path, *, encoding: str = "raw", verify: float = 0.0) -> KvtierConfig:
    return KvtierConfig(
        chunk_size=CHUNK,
        save_partial_chunks=False,
        block={"encoding": encoding},
        tiers=[
            CpuTierConfig(capacity=64 << 20),
            DiskTierConfig(path=tmp / "blocks", capacity=256 << 20),
        ],
        connector={"min_load_tokens": 16, "verify_fraction": verify},
    )


def _save_all(model_dir: Path, cfg: KvtierConfig, prompts: list[list[int]]) -> CacheNamespace:
    conn = KvtierConnector(config=cfg)
    llm = _llm(model_dir, conn)
    llm.generate(prompts, GREEDY)
    llm.engine.shutdown()  # flushes the saver and closes the store
    assert conn.namespace is not None
    return conn.namespace


def _chunk_key(ns: CacheNamespace, prompt: list[int], chunk: int) -> bytes:
    keys = PrefixKeys(ns, 16)
    keys.extend(prompt[: (chunk + 1) * CHUNK])
    return keys.key((chunk + 1) * CHUNK)


def _alter(cfg: KvtierConfig, key: bytes) -> None:
    """Replaces the block under ``key`` by a valid block of the same key with wrong KV."""
    store = build_store(cfg)
    try:
        block = store.get([key])[0]
        assert block is not None
        stored = decode_block(block, key=key)
        if stored.scales is None:
            kv = stored.payload.clone()
        else:
            kv = dequantize_chunk(stored.payload, stored.scales, stored.header.kv_dtype)
        g = torch.Generator().manual_seed(3)
        kv = 0.5 * kv + kv.std() * torch.randn(kv.shape, generator=g)
        if stored.header.encoding == Encoding.RAW:
            altered = encode_block(kv, key=key)
        else:
            altered = _int8_block(kv, key)
        decode_block(altered, key=key)  # checksum and key binding pass
        store.delete([key])
        store.put([(key, altered)])
        assert store.flush(30.0)
    finally:
        store.close()


@pytest.mark.parametrize("encoding", ["raw", "int8"])
def test_verifier_catches_an_altered_block_and_output_stays_cold(
    encoding: str,
    model_dir: Path,
    prompts: list[list[int]],
    cold: list[list[int]],
    tmp_path: Path,
) -> None:
    ns = _save_all(model_dir, _config(tmp_path, encoding=encoding), prompts)
    bad = _chunk_key(ns, prompts[0], 1)
    _alter(_config(tmp_path), bad)

    # Control: loaded without verification, the altered block changes the answer.
    plain = KvtierConnector(config=_config(tmp_path))
    llm = _llm(model_dir, plain)
    out = llm.generate(prompts[:1], GREEDY)[0]
    assert out.num_external_tokens == 3 * CHUNK and out.token_ids != cold[0]
    llm.engine.shutdown()

    conn = KvtierConnector(config=_config(tmp_path, verify=1.0))
    llm = _llm(model_dir, conn)
    out = llm.generate(prompts[:1], GREEDY)[0]
    assert out.token_ids == cold[0]
    assert out.num_external_tokens == 0  # the first chunk was sampled: the whole prefix computed
    assert conn.flush(60.0)
    stats = conn.verify_stats
    assert (stats.mismatched, stats.matched, stats.dropped) == (1, 2, 0)
    assert conn.metrics.value("kvtier_verify_checks_total", {"outcome": "mismatch"}) == 1
    assert conn.metrics.value("kvtier_verify_checks_total", {"outcome": "match"}) == 2
    assert bad in conn.quarantine
    assert all(t.contains([bad]) == [False] for t in conn.store.tiers)  # deleted from every tier

    # Another request over the same document computes that chunk again: it is not re-saved.
    out = llm.generate(prompts[1:2], GREEDY)[0]
    assert out.token_ids == cold[1]
    assert conn.flush(60.0)
    assert conn.store.contains([bad]) == [False]
    llm.engine.shutdown()


def test_right_blocks_match_and_nothing_is_deleted(
    model_dir: Path, prompts: list[list[int]], cold: list[list[int]], tmp_path: Path
) -> None:
    ns = _save_all(model_dir, _config(tmp_path), prompts)
    conn = KvtierConnector(config=_config(tmp_path, verify=1.0))
    llm = _llm(model_dir, conn)
    out = llm.generate(prompts[:1], GREEDY)[0]
    assert out.token_ids == cold[0]
    assert conn.flush(60.0)
    stats = conn.verify_stats
    assert (stats.matched, stats.mismatched, stats.missing) == (3, 0, 0)
    assert len(conn.quarantine) == 0
    keys = [_chunk_key(ns, prompts[0], c) for c in range(3)]
    assert conn.store.contains(keys) == [True] * 3
    llm.engine.shutdown()


def test_int8_chunk_computed_on_int8_loads_passes(
    model_dir: Path, prompts: list[list[int]], tmp_path: Path
) -> None:
    cfg = _config(tmp_path, encoding="int8")
    ns = _save_all(model_dir, cfg, prompts)
    last = _chunk_key(ns, prompts[0], 2)
    # Only the last chunk is sampled: chunks 0 and 1 load as int8, so chunk 2 is computed on
    # dequantized KV and drifts from what the writer quantized; it must still match.
    conn = KvtierConnector(config=cfg, verify_sampler=lambda key: key == last)
    llm = _llm(model_dir, conn)
    out = llm.generate(prompts[:1], GREEDY)[0]
    assert out.num_external_tokens == 2 * CHUNK
    assert conn.flush(60.0)
    stats = conn.verify_stats
    assert (stats.matched, stats.mismatched) == (1, 0)
    assert conn.store.contains([last]) == [True]
    llm.engine.shutdown()


def test_off_by_default_loads_everything(
    model_dir: Path, prompts: list[list[int]], cold: list[list[int]], tmp_path: Path
) -> None:
    _save_all(model_dir, _config(tmp_path), prompts)
    conn = KvtierConnector(config=_config(tmp_path))
    llm = _llm(model_dir, conn)
    out = llm.generate(prompts[:1], GREEDY)[0]
    assert out.token_ids == cold[0] and out.num_external_tokens == 3 * CHUNK
    assert conn.flush(60.0)
    assert conn.verify_stats.matched == 0
    assert conn.metrics.value("kvtier_verify_checks_total", {"outcome": "match"}) == 0
    llm.engine.shutdown()


def test_a_float32_block_from_another_engines_kernels_matches_and_wrong_kv_does_not() -> None:
    """float32 KV that two vLLM-CPU engines computed for the same tokens differed by up to
    2.25e-6 at layer 19 V (19 epsilons): a correct block, which ten epsilons had deleted
    from the shared tier. It matches now; one token's values doubled still does not."""
    spec = BlockSpec(3, 2, 16, torch.float32)
    computed = _kv()
    other_kernels = _drifted(computed, (2, 1), 2.25e-6)
    verdict = compare_chunk(computed, encode_block(other_kernels, key=KEY), KEY, spec)
    assert verdict.ok and verdict.error > 10 * float(torch.finfo(torch.float32).eps)
    one_off = computed.clone()
    one_off[2, 1, 5] *= 2.0  # one token's V in the last layer, every head
    verdict = compare_chunk(computed, encode_block(one_off, key=KEY), KEY, spec)
    assert not verdict.ok and verdict.error > 100 * verdict.tolerance
