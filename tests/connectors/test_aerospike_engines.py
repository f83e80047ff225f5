"""Engines sharing KV through the Aerospike tier.

* Two engine processes with only an Aerospike tier (no shared disk) reuse
  each other's prefixes (on the test run's real server: tests/support/aerospike_target.py).
* With the server stopped, an engine still answers correctly, its TTFT bounded
  by the configured timeouts plus the cold prefill, and it uses the tier again
  once the server is back (the emulator, stopped and restarted with its
  records; a real cluster losing nodes under engines: tests/kvtier/test_aerospike_cluster.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvtier.config import KvtierConfig
from kvtier.connectors.demo import _spawn
from kvtier.connectors.kvtier_connector import KvtierConnector
from kvtier.engine import LLM, SamplingParams
from tests.connectors.demo_prompts import shared_chunk_tokens
from tests.engine.tiny_models import write_tiny_model
from tests.support.aerospike_server import AerospikeTestServer
from tests.support.aerospike_target import make_target
from tests.support.timeouts import aerospike_timeouts, scaled

CHUNK = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = write_tiny_model(tmp_path_factory.mktemp("tiny-as"), "llama", seed=21)
    return path


def _tier(address: str, **kw: object) -> dict[str, object]:
    return {
        "type": "aerospike",
        "hosts": [address],
        "ttl_s": 3600,
        "connect_timeout_ms": 300,
        "total_timeout_ms": 300,
        "socket_timeout_ms": 300,
        "write_timeout_ms": 300,
        "max_retries": 1,
        "breaker_threshold": 2,
        "breaker_cooldown_s": 0.5,
        **kw,
    }


def test_two_engine_processes_share_prefixes_through_aerospike(tiny: Path, tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("Paged attention stores keys and values in fixed-size blocks. " * 8)
    target = make_target()
    try:
        cfg = tmp_path / "kvtier.yaml"
        names = {"namespace": target.namespace, "set_name": target.set_name}
        cfg.write_text(
            KvtierConfig.model_validate(
                {
                    "chunk_size": CHUNK,
                    # Generous timeouts: a busy host must not turn saves into drops here.
                    "tiers": [_tier(target.address, **names, **aerospike_timeouts())],
                    "connector": {"min_load_tokens": CHUNK, "verify_fraction": 0},
                }
            ).model_dump_json()
        )
        a = _spawn(str(tiny), str(cfg), "What is stored?", 4, str(doc), "A", 3)
        assert a["chunks_saved"] > 0 and a["loaded_tokens"] == 0
        assert target.record_count() >= a["chunks_saved"]  # one record per small block
        b = _spawn(str(tiny), str(cfg), "Which blocks?", 4, str(doc), "B", 4)
        shared = shared_chunk_tokens(
            tiny, doc.read_text(), "What is stored?", "Which blocks?", CHUNK
        )
        assert b["loaded_tokens"] == shared > 0  # every chunk B shares with A came back
        assert b["load_failures"] == 0
    finally:
        target.close()


@pytest.mark.aerospike_emulator("the whole server down, then back on its port with its records")
def test_engine_survives_a_stopped_server_and_recovers(tiny: Path) -> None:
    g = torch.Generator().manual_seed(3)
    p1 = torch.randint(3, 380, (100,), generator=g).tolist()
    p2 = torch.randint(3, 380, (100,), generator=g).tolist()
    plain = LLM(str(tiny), dtype="float32", device="cpu", block_size=16, num_threads=2)
    cold1, cold2 = (o.token_ids for o in plain.generate([p1, p2], GREEDY))
    t0 = time.perf_counter()
    plain.generate([p2], GREEDY)
    cold_prefill = time.perf_counter() - t0

    with AerospikeTestServer() as srv:
        cfg = KvtierConfig.model_validate(
            {
                "chunk_size": CHUNK,
                "tiers": [_tier(srv.address)],
                "connector": {
                    "min_load_tokens": CHUNK,
                    "load_timeout_s": 1.0,
                    "verify_fraction": 0,
                },
            }
        )
        conn = KvtierConnector(config=cfg)
        llm = LLM(
            str(tiny),
            dtype="float32",
            device="cpu",
            block_size=16,
            num_threads=2,
            connector=conn,
            enable_prefix_caching=False,
        )
        assert llm.generate([p1], GREEDY)[0].token_ids == cold1  # saves p1's chunks
        conn.flush()

        srv.stop()
        t0 = time.perf_counter()
        out = llm.generate([p2], GREEDY)[0]
        elapsed = time.perf_counter() - t0
        assert out.token_ids == cold2 and out.num_external_tokens == 0
        # Lookup (2 attempts x 300 ms) + load deadline (1 s) + the cold work, with slack for a loaded machine.
        assert elapsed < 0.6 + 1.0 + 3 * cold_prefill + scaled(0.5)
        errors = sum(
            conn.metrics.value("kvtier_tier_errors_total", {"tier": "aerospike", "kind": k})
            for k in ("transient", "unavailable")
        )
        assert errors > 0

        srv.start()  # same port, records kept
        deadline = time.monotonic() + 20
        loaded = 0
        while loaded == 0 and time.monotonic() < deadline:
            time.sleep(0.6)  # past the breaker's cool-down: the next call probes the server
            out = llm.generate([p1], GREEDY)[0]
            assert out.token_ids == cold1
            loaded = out.num_external_tokens
        assert loaded == len(p1) - 1  # stored whole (chunks + its exact tail): all but the last
        llm.engine.shutdown()
