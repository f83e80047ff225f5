"""Sampling: greedy, top-k/top-p masks, seeded reproducibility, logprobs, stop conditions."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvtier.engine import LLM, SamplingParams
from kvtier.engine.sampler import apply_top_k_top_p, sample

NEG = float("-inf")


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    out = apply_top_k_top_p(logits, top_k=2, top_p=1.0)
    assert out.tolist() == [[NEG, 5.0, NEG, 4.0, NEG]]
    assert torch.equal(apply_top_k_top_p(logits, 0, 1.0), logits)
    assert torch.equal(apply_top_k_top_p(logits, 5, 1.0), logits)


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    kept = lambda p: torch.isfinite(apply_top_k_top_p(logits, 0, p)).tolist()  # noqa: E731
    assert kept(0.5) == [True, False, False, False]
    assert kept(0.6) == [True, True, False, False]
    assert kept(0.8) == [True, True, False, False]
    assert kept(0.81) == [True, True, True, False]
    assert kept(1e-6) == [True, False, False, False]  # the top token always survives
    shuffled = logits[[2, 0, 3, 1]]
    assert torch.isfinite(apply_top_k_top_p(shuffled, 0, 0.6)).tolist() == [
        False,
        True,
        False,
        True,
    ]


def test_greedy_and_seeded_sampling() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    greedy = SamplingParams(temperature=0.0)
    res = sample(logits, [greedy] * 3, [None] * 3)
    assert [r.token_id for r in res] == logits.argmax(-1).tolist()

    hot = SamplingParams(temperature=1.0, top_k=20, top_p=0.9)

    def draw(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [sample(logits[:1], [hot], [gen])[0].token_id for _ in range(40)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)
    allowed = torch.isfinite(apply_top_k_top_p(logits[0], 20, 0.9))
    assert all(allowed[t] for t in draw(3))


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().unsqueeze(0)
    gen = torch.Generator().manual_seed(5)
    p = SamplingParams(temperature=1.0)
    counts = [0, 0, 0]
    n = 3000
    for _ in range(n):
        counts[sample(logits, [p], [gen])[0].token_id] += 1
    for c, q in zip(counts, probs.tolist(), strict=True):
        assert abs(c / n - q) < 4 * math.sqrt(q * (1 - q) / n)


def test_logprobs_are_raw_log_softmax_with_sorted_alternatives() -> None:
    logits = torch.tensor([[2.0, 0.5, 1.0, -1.0]])
    res = sample(logits, [SamplingParams(temperature=0.0, logprobs=2)], [None])[0]
    ref = torch.log_softmax(logits[0], -1)
    assert res.token_id == 0
    assert res.logprob == pytest.approx(float(ref[0]))
    assert [t for t, _ in res.top_logprobs or []] == [0, 2]
    assert [v for _, v in res.top_logprobs or []] == pytest.approx([float(ref[0]), float(ref[2])])


# ---- through the engine (tiny random model) ---------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", device="cpu", block_size=4, num_threads=1)


PROMPTS = [[5, 9, 13, 21, 8, 40], [77, 3, 3, 90], [11] * 9]


def test_seeded_request_is_reproducible_alone_or_batched(llm: LLM) -> None:
    p = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, max_tokens=12, seed=1234, ignore_eos=True
    )
    alone = llm.generate(PROMPTS[0], p)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batched = llm.generate(PROMPTS, [p, others, others])[0].token_ids
    assert alone == batched
    other_seed = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, max_tokens=12, seed=99, ignore_eos=True
    )
    assert llm.generate(PROMPTS[0], other_seed)[0].token_ids != alone


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    base = llm.generate(
        PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    )[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 10
    stop_id = base.token_ids[3]
    first = base.token_ids.index(stop_id)
    out = llm.generate(
        PROMPTS[1],
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_id]),
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == base.token_ids[: first + 1]  # the stop token is reported ...
    tok = llm.engine.tokenizer
    assert out.text == tok.decode(base.token_ids[:first])  # ... but not rendered


def test_stop_string_across_tokens_is_never_streamed(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = llm.generate(PROMPTS[2], params)[0]
    tok = llm.engine.tokenizer
    # a stop string spanning a token boundary: end of token 4's text + start of token 5's
    a = tok.decode(full.token_ids[:5])
    b = tok.decode(full.token_ids[:6])
    assert len(b) > len(a) >= 2, "needs two tokens that render text"
    stop = a[-2:] + b[len(a) : len(a) + 1]
    idx = full.text.find(stop)
    assert idx >= 0
    stopped = SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop, "never-seen"]
    )
    deltas = []
    final = None
    for out in llm.stream(PROMPTS[2], stopped):
        deltas.append(out.delta_text)
        assert stop not in out.text
        final = out
    assert final is not None and final.finished
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == full.text[:idx]
    assert "".join(deltas) == final.text


def test_logprobs_through_the_engine(llm: LLM) -> None:
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3, logprobs=3))[0]
    assert out.logprobs is not None and len(out.logprobs) == 3
    for lp, tid in zip(out.logprobs, out.token_ids, strict=True):
        assert lp.token_id == tid
        assert lp.top_logprobs[0][0] == tid  # greedy: the chosen token is the most likely
        assert lp.logprob == pytest.approx(lp.top_logprobs[0][1])
        assert len(lp.top_logprobs) == 3 and lp.logprob <= 0
        assert isinstance(lp.token_bytes, bytes)
