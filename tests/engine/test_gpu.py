"""The same engine on CUDA tensors (skipped without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PROMPTS = [[5, 9, 13, 21, 8, 40, 2, 77, 31], [77, 3, 3, 90], [11] * 23]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_cuda_matches_cpu_in_float32(tiny_llama: Path) -> None:
    cpu = LLM(str(tiny_llama), dtype="float32", device="cpu", block_size=4, num_threads=1)
    gpu = LLM(str(tiny_llama), dtype="float32", device="cuda", block_size=4)
    assert gpu.engine.kv_cache.is_cuda
    for p in PROMPTS:
        torch.testing.assert_close(
            gpu.engine.score(p, use_prefix_cache=False).logits.cpu(),
            cpu.engine.score(p, use_prefix_cache=False).logits,
            atol=1e-3,
            rtol=1e-3,
        )
    assert [o.token_ids for o in gpu.generate(PROMPTS, GREEDY)] == [
        o.token_ids for o in cpu.generate(PROMPTS, GREEDY)
    ]


def test_cuda_bf16_prefix_cache_and_seeded_sampling(tiny_llama: Path) -> None:
    gpu = LLM(str(tiny_llama), dtype="bfloat16", device="cuda", block_size=4)
    gpu.generate(PROMPTS, GREEDY)
    second = gpu.generate(PROMPTS, GREEDY)
    # bf16: a cached prefix may round differently from a full prefill, so
    # only the cache use and the lengths are asserted here (fp32 equality is
    # the test above)
    assert all(len(o.token_ids) == 10 for o in second)
    assert any(o.num_cached_tokens > 0 for o in second)
    assert gpu.engine.stats().kv_blocks_used == 0
    p = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=7, ignore_eos=True)
    assert gpu.generate(PROMPTS[0], p)[0].token_ids == gpu.generate(PROMPTS[0], p)[0].token_ids
