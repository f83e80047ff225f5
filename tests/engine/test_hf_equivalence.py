"""Greedy generations and prefill logits equal Hugging Face transformers on tiny random models.

Every variant is run alone, batched, with chunked prefill forced small, with
prefix-cache hits, and under block pressure that forces preemption: all must
give the same tokens as transformers' own forward pass with its own KV cache.

Logit tolerance (fp32): the engine computes the same math as transformers but
in a different order (fused QKV and gate/up matmuls, a fused RMSNorm, paged
gathers, a different SDPA kernel for GQA and tiles), so results differ by
float32 rounding: a few ulps per op, compounding over 3 layers, i.e. ~1e-6
relative. With logits of magnitude ~1-30 here, ``atol=1e-4, rtol=1e-4`` is ~100x
that noise yet ~100x below the smallest effect of any real mistake (a wrong
RoPE position, a missing bias or norm changes logits by >1e-2).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.engine import LLM, SamplingParams
from tests.engine.tiny_models import hf_greedy, hf_logits, write_tiny_model

VARIANTS = {
    "llama": ("llama", {}),
    "llama3-rope-tied-bias": (
        "llama",
        {
            "tie_word_embeddings": True,
            "attention_bias": True,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}
ATOL = 1e-4
RTOL = 1e-4
MAX_TOKENS = 10


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    shared = torch.randint(3, vocab, (21,), generator=g).tolist()
    lens = [5, 19, 37]
    out = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    out.append(shared + torch.randint(3, vocab, (6,), generator=g).tolist())
    out.append(shared + torch.randint(3, vocab, (9,), generator=g).tolist())
    return out


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch, overrides = VARIANTS[request.param]
    path, model = write_tiny_model(
        tmp_path_factory.mktemp(request.param), arch, seed=7, **overrides
    )
    prompts = _prompts(model.config.vocab_size)
    refs = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    return path, model, prompts, refs


def _llm(path: Path, **kw) -> LLM:
    base = dict(dtype="float32", device="cpu", block_size=4, num_threads=1)
    base.update(kw)
    return LLM(str(path), **base)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_prefill_logits_match_cold_and_with_cached_prefix(variant) -> None:
    path, model, prompts, _ = variant
    llm = _llm(path)
    for p in prompts[:4]:
        ref = hf_logits(model, p)
        cold = llm.engine.score(p, use_prefix_cache=False)
        assert cold.start == 0
        torch.testing.assert_close(cold.logits, ref, atol=ATOL, rtol=RTOL)
    # prompts[4] shares 21 tokens (5 full blocks of 4) with prompts[3], scored above
    warm = llm.engine.score(prompts[4])
    assert warm.start == 20
    torch.testing.assert_close(warm.logits, hf_logits(model, prompts[4])[20:], atol=ATOL, rtol=RTOL)


def test_greedy_alone_and_batched(variant) -> None:
    path, _, prompts, refs = variant
    llm = _llm(path, enable_prefix_caching=False)
    for p, ref in zip(prompts, refs, strict=True):
        assert llm.generate(p, GREEDY)[0].token_ids == ref
    batched = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in batched] == refs


def test_greedy_chunked_prefill_prefix_hits_and_preemption(variant) -> None:
    path, _, prompts, refs = variant
    # 7-token steps force chunked prefill mixed with decodes; 20 blocks of 4
    # tokens cannot hold all five sequences at once, so requests get preempted.
    llm = _llm(path, max_num_batched_tokens=7, num_kv_blocks=20, max_model_len=80)
    first = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in first] == refs
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0
    second = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in second] == refs
    assert llm.engine.stats().prefix_cache_hit_tokens > stats.prefix_cache_hit_tokens
    assert any(o.num_cached_tokens > 0 for o in second)
