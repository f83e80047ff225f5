"""A block moved to another key, inside a running engine: rejected, counted, deleted, recomputed.

Two prompts are saved to a disk tier; then the file of the second prompt's
first chunk is replaced by the first prompt's (a file moved onto another
key, as a bug, a copy tool or a writer could). A fresh engine asked for the
second prompt finds the key, reads the block, and must refuse it: the
output is the cold one, the block is counted and gone.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvtier.block import verify_block
from kvtier.config import CpuTierConfig, DiskTierConfig, KvtierConfig
from kvtier.connectors.kvtier_connector import KvtierConnector
from kvtier.engine import LLM, SamplingParams
from kvtier.keys import chunk_keys
from tests.engine.tiny_models import write_tiny_model

CHUNK = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=11)
    return path


def _llm(model_dir: Path, connector: KvtierConnector | None = None) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=16,
        num_threads=2,
        connector=connector,
    )


def test_a_block_moved_onto_another_key_is_recomputed(model_dir: Path, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(7)
    first, second = (torch.randint(3, 380, (70,), generator=g).tolist() for _ in range(2))
    cold = _llm(model_dir).generate([second], GREEDY)[0].token_ids
    cfg = KvtierConfig(
        chunk_size=CHUNK,
        save_partial_chunks=False,
        tiers=[
            CpuTierConfig(capacity=64 << 20),
            DiskTierConfig(path=tmp_path / "blocks", capacity=256 << 20),
        ],
        connector={"min_load_tokens": 16},
    )
    saver = KvtierConnector(config=cfg)
    llm = _llm(model_dir, saver)
    llm.generate([first, second], GREEDY)
    llm.engine.shutdown()  # flushes the saver and closes the store
    ns = saver.namespace
    assert ns is not None
    key_a, key_b = chunk_keys(first, ns)[0], chunk_keys(second, ns)[0]
    (file_a,) = (tmp_path / "blocks").rglob(key_a.hex() + "*")
    (file_b,) = (tmp_path / "blocks").rglob(key_b.hex() + "*")
    os.replace(file_a, file_b)  # the first prompt's chunk 0 now answers for the second's

    conn = KvtierConnector(config=cfg)  # a fresh store over the directory: empty CPU tier
    llm = _llm(model_dir, conn)
    out = llm.generate([second], GREEDY)[0]
    assert out.token_ids == cold
    assert out.num_external_tokens == 0  # nothing of the prompt came from the cache
    reasons = {"tier": "disk", "reason": "key_mismatch"}
    assert conn.metrics.value("kvtier_corrupt_block_reasons_total", reasons) == 1
    assert conn.metrics.value("kvtier_corrupt_blocks_total", {"tier": "disk"}) == 1
    assert conn.stats.load_failures == 1
    llm.engine.shutdown()
    # the moved block was deleted; what is there now is the recomputed chunk, saved anew
    if file_b.exists():
        verify_block(file_b.read_bytes(), key=key_b)
