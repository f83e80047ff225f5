"""The vLLM connector verifies too: a sampled object is computed by vLLM and compared.

Driven like vLLM 0.32 drives the two sides (``tests/vllm/fakes.py``, no vLLM
needed): a first process stores a prompt, one of its objects is then
replaced on disk by a wrong block (valid, bound to its key: only recomputing
shows it), and a second process with verification on loads the prompt.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvtier.block import encode_block
from kvtier.config import DiskTierConfig, KvtierConfig, effective_verify_fraction
from kvtier.keys import PrefixKeys
from kvtier.tiers.disk import DiskTier
from tests.vllm.fakes import NS, FakeRequest, FakeVllm, NewReq, SchedOut, kvtier_config, true_kv

PROMPT = [(i * 7919) % 5000 + 3 for i in range(150)]  # 2 chunks of 64 + a 22-token tail


def _store_prompt(root: Path) -> None:
    first = FakeVllm(kvtier_config(root, verify_fraction=0.0))
    req = FakeRequest("a-0", PROMPT)
    assert first.match(req, 0) == (0, False)
    blocks = first.alloc(len(PROMPT))
    first.scheduler.update_state_after_alloc(req, blocks, 0)
    p = len(PROMPT)
    first.step(SchedOut([NewReq("a-0", (blocks,), 0)], num_scheduled_tokens={"a-0": p}),
               [(req, blocks, 0, p)])  # fmt: skip
    assert first.worker.flush(30)
    first.close()


def test_a_wrong_stored_object_is_computed_compared_deleted_and_quarantined(tmp_path) -> None:
    _store_prompt(tmp_path)
    keys = PrefixKeys(NS, 16)
    keys.extend(PROMPT)
    bad = keys.key(128)  # the second chunk, [64, 128)
    disk = DiskTier(tmp_path, 64 << 20)
    assert disk.delete([bad]) == 1
    wrong = true_kv(PROMPT, 64, 128) + 0.5  # valid block, right key, wrong values
    disk.put([(bad, encode_block(wrong, key=bad))])
    disk.close()

    # sample the second chunk only: the first is loaded, vLLM computes the rest
    v = FakeVllm(kvtier_config(tmp_path, verify_fraction=1.0))
    v.scheduler._sample = lambda key: key == bad
    req = FakeRequest("b-0", PROMPT)
    n, _ = v.match(req, 0)
    assert n == 64  # the load stops before the sampled object
    blocks = v.alloc(len(PROMPT))
    v.scheduler.update_state_after_alloc(req, blocks, n)
    p = len(PROMPT)
    plan = v.step(SchedOut([NewReq("b-0", (blocks,), n)], num_scheduled_tokens={"b-0": p - n}),
                  [(req, blocks, n, p)])  # fmt: skip
    assert [(s.start, s.end) for s in plan.loads] == [(0, 64)]
    assert [[(o.start, o.end) for o in s.verify] for s in plan.saves] == [[(64, 128), (128, 150)]]
    assert torch.equal(v.layout.gather(blocks, 0, 64), true_kv(PROMPT, 0, 64))
    assert v.worker.flush(30)
    verifier = v.worker.verifier
    assert verifier is not None
    assert (verifier.stats.mismatched, verifier.stats.matched) == (1, 1)
    assert v.counters.totals["verify_chunks"] == 2
    # deleted from the tier, not only quarantined in the worker ...
    check = DiskTier(tmp_path, 64 << 20)
    assert check.contains([bad, keys.key(64)]) == [False, True]
    check.close()
    # ... and the scheduler side, told by the worker's next report, does not offer it again
    v.step(SchedOut(), [])
    assert bad in v.scheduler.quarantine
    again = FakeRequest("b-1", PROMPT)
    assert v.match(again, 0)[0] == 64  # the good first chunk only
    v.close()


def test_verification_is_on_by_default_where_a_tier_is_shared(tmp_path) -> None:
    private = KvtierConfig(tiers=[DiskTierConfig(path=tmp_path / "mine")])
    (tmp_path / "team").mkdir(mode=0o770)
    (tmp_path / "team").chmod(0o770)
    shared_disk = KvtierConfig(tiers=[DiskTierConfig(path=tmp_path / "team")])
    remote = KvtierConfig(tiers=[{"type": "remote", "address": "127.0.0.1:1"}])
    assert effective_verify_fraction(private) == 0.0
    assert effective_verify_fraction(shared_disk) == 0.01
    assert effective_verify_fraction(remote) == 0.01
    pinned = KvtierConfig(
        tiers=[{"type": "remote", "address": "127.0.0.1:1"}], connector={"verify_fraction": 0}
    )
    assert effective_verify_fraction(pinned) == 0.0
    v = FakeVllm(kvtier_config(tmp_path / "team"))  # the default: null, a shared directory
    assert v.scheduler._sample is not None
    v.close()
