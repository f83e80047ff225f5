"""Two engine processes share prefixes through one ``kvtier serve`` (the remote tier).

Each engine has its own CPU tier and the remote tier behind it, no shared
disk: engine B, a new process, finds engine A's chunks on the cache server.
With tenants configured, an engine with another tenant's token finds nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvtier.config import KvtierConfig
from kvtier.connectors.demo import _spawn
from tests.connectors.demo_prompts import shared_chunk_tokens
from tests.engine.tiny_models import write_tiny_model
from tests.server.helpers import TOKENS, running_server, server_config, tenants

CHUNK = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = write_tiny_model(tmp_path_factory.mktemp("tiny-remote"), "llama", seed=17)
    return path


def _config(tmp_path: Path, name: str, address: str, token: str | None) -> Path:
    cfg = tmp_path / f"{name}.yaml"
    remote: dict[str, object] = {"type": "remote", "address": address}
    if token is not None:
        remote["token"] = token
    data = {
        "chunk_size": CHUNK,
        "tiers": [{"type": "cpu", "capacity": "64MiB"}, remote],
        # exact load counts: no sampled verification (on by default with a remote tier)
        "connector": {"min_load_tokens": CHUNK, "verify_fraction": 0},
    }
    KvtierConfig.model_validate(data)  # the file below is valid
    # NOTE: written by hand, not model_dump_json(): that masks the token (a SecretStr).
    cfg.write_text(yaml.safe_dump(data))
    return cfg


def test_two_engine_processes_share_prefixes_through_the_cache_server(
    tiny: Path, tmp_path: Path
) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("A chunk is addressed by a chained hash of its tokens. " * 8)
    with running_server(server_config(tenants=tenants())) as server:
        alpha = _config(tmp_path, "alpha", server.address, TOKENS["alpha"])
        a = _spawn(str(tiny), str(alpha), "What addresses a chunk?", 4, str(doc), "A", 3)
        assert a["chunks_saved"] > 0 and a["loaded_tokens"] == 0
        b = _spawn(str(tiny), str(alpha), "What is chained?", 4, str(doc), "B", 4)
        shared = shared_chunk_tokens(
            tiny, doc.read_text(), "What addresses a chunk?", "What is chained?", CHUNK
        )
        assert b["loaded_tokens"] == shared > 0  # every chunk B shares with A came back
        assert b["load_failures"] == 0
        assert b["cpu_hits"] == 0  # a new process: everything came over the wire
        # Another tenant, same prompt: tenants never see each other's KV.
        beta = _config(tmp_path, "beta", server.address, TOKENS["beta"])
        c = _spawn(str(tiny), str(beta), "What addresses a chunk?", 4, str(doc), "C", 5)
        assert c["loaded_tokens"] == 0 and c["hit_tokens"] == 0
