"""vLLM's own KV event classes, encoded as its publisher does, read by the router's subscriber.

Runs a short script in ``.venv-vllm`` (no server): it builds a
``KVEventBatch`` of ``BlockStored`` (two calls, the second chained on the
first's last hash, with vLLM's own SHA-256 block hashes), ``BlockRemoved``
and ``AllBlocksCleared``, and encodes it with the encoder of
``ZmqEventPublisher``. The router decodes it and names the blocks by the
keys it computes from the same tokens.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from kvtier.bench.lib.vllm_peer import find_vllm
from kvtier.router.index import prompt_keys
from kvtier.router.vllm_blocks import VllmBlockMap, local_namespace
from kvtier.router.vllm_events import decode_batch

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

SCRIPT = textwrap.dedent(
    """
    import sys
    import msgspec
    from vllm.distributed.kv_events import (
        AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
    )
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    init_none_hash(sha256_cbor)
    B = 16
    tokens = list(range(3000, 3000 + 4 * B))
    hashes, parent = [], None
    for i in range(4):
        parent = hash_block_tokens(sha256_cbor, parent, tokens[i * B:(i + 1) * B])
        hashes.append(bytes(parent))

    def stored(first, n, parent):
        return BlockStored(block_hashes=hashes[first:first + n], parent_block_hash=parent,
                           token_ids=tokens[first * B:(first + n) * B], block_size=B,
                           lora_id=None, medium="GPU", lora_name=None, group_idx=0)

    batches = [
        KVEventBatch(ts=1.0, events=[stored(0, 2, None), stored(2, 2, hashes[1])]),
        KVEventBatch(ts=2.0, events=[BlockRemoved(block_hashes=[hashes[3]], medium="GPU")]),
        KVEventBatch(ts=3.0, events=[AllBlocksCleared()], data_parallel_rank=0),
    ]
    enc = msgspec.msgpack.Encoder()  # what ZmqEventPublisher packs each batch with
    for b in batches:
        sys.stdout.write(enc.encode(b).hex() + "\\n")
    """
)


def test_the_router_reads_what_vllm_publishes(tmp_path: Path) -> None:
    python = find_vllm()
    if python is None:
        pytest.skip("no vLLM venv: run scripts/setup_vllm.sh (builds .venv-vllm)")
    venv = python.parent.parent
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    iomp = sorted(venv.glob("lib/libiomp5.so"))
    if iomp:
        env["LD_PRELOAD"] = str(iomp[0])
    env.pop("VIRTUAL_ENV", None)
    script = tmp_path / "events.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [str(python), str(script)], env=env, capture_output=True, text=True, timeout=250
    )
    assert out.returncode == 0, out.stderr[-3000:]
    payloads = [bytes.fromhex(line) for line in out.stdout.split()]
    assert len(payloads) == 3
    m = VllmBlockMap()
    stored = m.apply(decode_batch(payloads[0]))
    tokens = list(range(3000, 3064))
    want = prompt_keys([*tokens, 1], local_namespace(16), 16).boundary_keys
    assert list(stored.stored) == want and stored.skipped_blocks == 0
    assert list(m.apply(decode_batch(payloads[1])).evicted) == want[3:]
    cleared = m.apply(decode_batch(payloads[2]))
    assert cleared.cleared and len(m) == 0
