"""The real SmolLM2-135M-Instruct (Q4_1 GGUF) against transformers on the same weights.

Weights: the engine's dequantized and un-permuted Q/K tensors are checked
against transformers' own GGUF processing (``LlamaTensorProcessor``, which
reverses llama.cpp's permutation independently of this engine) applied to
the gguf library's dequantization. The model is then exported to a
transformers ``LlamaForCausalLM`` (float32, SDPA) and compared end to end.

Tolerance: fp32 on a 30-layer model; both sides run the same math in a
different order (fused projections, paged gathers, different SDPA kernels),
so rounding differences compound to ~1e-5..1e-4 absolute on logits of
magnitude ~10-30; ``atol=2e-3`` leaves a wide margin while a real bug (wrong
position, wrong permutation, wrong norm) moves logits by whole units.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import LLM, SamplingParams
from kvtier.engine.models.hf_export import to_transformers
from tests.engine.tiny_models import hf_greedy, hf_logits

pytestmark = pytest.mark.smollm2
ATOL = 2e-3
RTOL = 1e-4
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def smol(smollm2_llm: LLM):
    return smollm2_llm, to_transformers(smollm2_llm.engine.runner.model)


def _chat_prompts(llm: LLM) -> list[list[int]]:
    tok = llm.engine.tokenizer
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers.",
    ]
    out = []
    for q in questions:
        text = tok.apply_chat_template([{"role": "user", "content": q}])
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def test_smollm2_qk_unpermutation_matches_transformers_gguf_processing(smol, smollm2) -> None:
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    llm, _ = smol
    cfg = llm.engine.model_config
    proc = LlamaTensorProcessor(
        config={"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads}
    )
    reader = gguf.GGUFReader(str(smollm2))
    tensors = {t.name: t for t in reader.tensors}
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    for layer in (0, 17, cfg.num_layers - 1):
        ours = llm.engine.runner.model.layers[layer].attn.qkv_proj.weight
        for name, rows in (("attn_q", slice(0, q)), ("attn_k", slice(q, q + kv))):
            t = tensors[f"blk.{layer}.{name}.weight"]
            deq = gguf.quants.dequantize(t.data, t.tensor_type)
            ref = proc.process(deq, f"blk.{layer}.{name}.weight").weights
            assert torch.equal(ours[rows], torch.from_numpy(ref.copy()).float())


def test_smollm2_prefill_logits_match(smol) -> None:
    llm, ref = smol
    p = _chat_prompts(llm)[0]
    torch.testing.assert_close(
        llm.engine.score(p, use_prefix_cache=False).logits, hf_logits(ref, p), atol=ATOL, rtol=RTOL
    )


def test_smollm2_greedy_matches_alone_batched_cached_and_chunked(smol) -> None:
    llm, ref = smol
    prompts = _chat_prompts(llm)
    refs = [hf_greedy(ref, p, MAX_TOKENS) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert llm.generate(prompts[0], params)[0].token_ids == refs[0]
    batched = llm.generate(prompts, params)
    assert [o.token_ids for o in batched] == refs
    # the shared system prompt is now in the prefix cache
    assert all(o.num_cached_tokens >= 16 for o in batched[1:])
    # chunked prefill of whole prompts: 11-token steps, prefix cache off (the
    # same engine, to avoid loading the model again; only the knobs change)
    sched, bm = llm.engine.scheduler, llm.engine.block_manager
    sched.max_num_batched_tokens, bm.enable_prefix_caching = 11, False
    try:
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == refs
        assert all(o.num_cached_tokens == 0 for o in outs)
    finally:
        sched.max_num_batched_tokens = llm.engine.config.max_num_batched_tokens
        bm.enable_prefix_caching = True


def test_smollm2_chat_answer_is_sensible(smol) -> None:
    llm, _ = smol
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=20),
    )[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == llm.engine.tokenizer.eos_token_id
