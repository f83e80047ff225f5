"""Workload generation of bench/serve.py: arrivals, prompt sizes, conversation structure."""

from __future__ import annotations

import math
import random
import re
from collections import Counter

import pytest

from kvtier.bench.lib.serve_workloads import (
    Conversation,
    DocQaConfig,
    MultiRoundConfig,
    SustainedConfig,
    TextMaker,
    build_doc_qa,
    build_multi_round,
    build_sustained,
    doc_lengths,
    poisson_arrivals,
    sustained_user_rate,
    zipf_choices,
)

_PIECE = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> int:
    """A stand-in tokenizer: one token per word or punctuation mark."""
    return len(_PIECE.findall(text))


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from tests.conftest import smollm2_path

    path = smollm2_path()
    if not path.exists():
        pytest.skip(f"needs {path}")
    from kvtier.engine.models.loader import load_tokenizer

    return load_tokenizer(path)


def test_poisson_mean_and_variance() -> None:
    qps, n = 0.6, 20_000
    times = poisson_arrivals(qps, n, random.Random(11))
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert all(g > 0 for g in gaps)
    mean = sum(gaps) / n
    # Exponential gaps: sd = mean = 1/qps, so the sample mean's sd is 1/(qps*sqrt(n)) (0.7%);
    # 5 standard errors is a tolerance a correct generator misses once in ~3.5 million seeds.
    assert abs(mean - 1 / qps) < 5 / (qps * math.sqrt(n))
    # Var = mean^2 for an exponential; the sample variance's relative sd is sqrt(8/n) (2%).
    var = sum((g - mean) ** 2 for g in gaps) / (n - 1)
    assert abs(var * qps**2 - 1) < 5 * math.sqrt(8 / n)


def test_poisson_is_deterministic_per_seed() -> None:
    a = poisson_arrivals(1.0, 50, random.Random(1))
    assert a == poisson_arrivals(1.0, 50, random.Random(1))
    assert a != poisson_arrivals(1.0, 50, random.Random(2))
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 5, random.Random(1))


@pytest.mark.parametrize("n", [1, 2, 17, 256, 1000])
def test_text_maker_hits_the_token_count(n: int) -> None:
    maker = TextMaker(words)
    text = maker.text(n, random.Random(n))
    assert words(text) == n
    assert text == maker.text(n, random.Random(n))


def _small_multi_round(**kw: int) -> MultiRoundConfig:
    base = {"users": 3, "rounds": 3, "system_tokens": 120, "context_tokens": 90}
    return MultiRoundConfig(**{**base, **kw})


def test_multi_round_structure() -> None:
    cfg = _small_multi_round()
    w = build_multi_round(cfg, words)
    assert w.planned == cfg.users * cfg.rounds and w.max_tokens == cfg.answer_tokens
    convs = [lane.session for lane in w.lanes]
    assert all(isinstance(c, Conversation) for c in convs)
    first = [c.messages() for c in convs]
    # the same system message for everyone, and nothing else in common
    assert len({m[0]["content"] for m in first}) == 1
    assert words(first[0][0]["content"]) == cfg.system_tokens
    contexts = [c.context for c in convs]
    assert len(set(contexts)) == cfg.users
    assert all(words(c) == cfg.context_tokens for c in contexts)
    # round r = round r-1 + the server's answer + a new question
    conv = convs[0]
    prev = conv.messages()
    for r in range(1, cfg.rounds):
        answer = f"answer number {r}"
        conv.answered(answer)
        cur = conv.messages()
        assert cur[: len(prev)] == prev
        assert cur[len(prev)] == {"role": "assistant", "content": answer}
        assert cur[len(prev) + 1]["role"] == "user"
        assert len(cur) == len(prev) + 2
        prev = cur


def test_multi_round_arrivals_interleave_users() -> None:
    cfg = _small_multi_round(users=4, rounds=5)
    w = build_multi_round(cfg, words)
    merged = sorted(t for lane in w.lanes for t in lane.arrivals)
    # the k-th arrival of the one Poisson stream is round k // users of user k % users
    for k, t in enumerate(merged):
        assert w.lanes[k % cfg.users].arrivals[k // cfg.users] == t
    again = build_multi_round(cfg, words)
    assert [lane.arrivals for lane in again.lanes] == [lane.arrivals for lane in w.lanes]
    assert again.lanes[1].session.messages() == w.lanes[1].session.messages()


def test_multi_round_arrival_seed_keeps_the_times_and_changes_the_texts() -> None:
    def build(seed: int, arrival_seed: int | None) -> list:
        cfg = MultiRoundConfig(users=3, rounds=2, system_tokens=20, context_tokens=20,
                               seed=seed, arrival_seed=arrival_seed)  # fmt: skip
        return build_multi_round(cfg, words).lanes

    a, b, c = build(100, 0), build(200, 0), build(200, None)
    assert [x.arrivals for x in a] == [x.arrivals for x in b]  # one burst for both runs
    assert [x.session.context for x in a] != [x.session.context for x in b]
    assert [x.arrivals for x in b] != [x.arrivals for x in c]  # default: the seed's own


def test_doc_qa_lengths_popularity_and_lanes() -> None:
    cfg = DocQaConfig(documents=40, min_tokens=100, max_tokens=400, questions=30, seed=5)
    lengths = doc_lengths(cfg)
    assert all(n % 16 for n in lengths)
    assert all(cfg.min_tokens <= n <= cfg.max_tokens for n in lengths)
    assert lengths == doc_lengths(cfg)
    w = build_doc_qa(cfg, words)
    assert len(w.lanes) == cfg.questions and all(len(lane.arrivals) == 1 for lane in w.lanes)
    assert sum(w.params["doc_requests"]) == cfg.questions
    times = [lane.arrivals[0] for lane in w.lanes]
    assert times == sorted(times)


def test_zipf_popularity_ranks() -> None:
    counts = Counter(zipf_choices(10, 20_000, 1.1, random.Random(0)))
    assert [d for d, _ in counts.most_common(3)] == [0, 1, 2]
    # P(0) / P(1) = 2 ** 1.1 = 2.14
    assert counts[0] / counts[1] == pytest.approx(2**1.1, rel=0.1)


def test_configs_reject_bad_values() -> None:
    with pytest.raises(ValueError):
        MultiRoundConfig(qps=0)
    with pytest.raises(ValueError):
        MultiRoundConfig(users=0)
    with pytest.raises(ValueError):
        DocQaConfig(min_tokens=1000, max_tokens=1005)


@pytest.mark.smollm2
def test_sizes_in_real_tokens(smollm2_tokenizer) -> None:
    def count(text: str) -> int:
        return len(smollm2_tokenizer.encode(text, add_special_tokens=False))

    w = build_multi_round(MultiRoundConfig(users=2, rounds=2), count)
    conv = w.lanes[0].session
    assert abs(count(conv.system) - 1000) <= 2
    assert abs(count(conv.context) - 1000) <= 2
    d = build_doc_qa(DocQaConfig(documents=4, questions=4), count)
    for lane in d.lanes:
        doc = int(lane.name.split("doc")[1])
        content = lane.session.messages()[0]["content"]
        body = content.split("\n\n")[1]
        assert abs(count(body) - d.params["doc_tokens"][doc]) <= 2


@pytest.mark.smollm2
def test_rendered_prompts_extend_and_share_only_the_system_prompt(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    w_cfg = MultiRoundConfig(users=2, rounds=3, system_tokens=200, context_tokens=150)

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    w = build_multi_round(w_cfg, count)
    conv = w.lanes[0].session
    prev = tok.apply_chat_template(conv.messages())
    for r in range(1, 3):
        answer = f" the reply of round {r}"
        conv.answered(answer)
        cur = tok.apply_chat_template(conv.messages())
        assert cur.startswith(prev + answer)
        prev = cur
    # two users' first prompts, in tokens: common up to the context, which differs at once
    w = build_multi_round(w_cfg, count)
    a, b = (tok.apply_chat_template(lane.session.messages()) for lane in w.lanes)
    ta, tb = tok.encode(a), tok.encode(b)
    common = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), len(ta))
    context = w.lanes[0].session.context
    before_context = a[: a.index(context)]
    assert common == len(tok.encode(before_context))
    assert w.lanes[0].session.system in tok.decode(ta[:common], skip_special_tokens=False)


def test_sustained_users_keep_joining_through_the_window() -> None:
    cfg = SustainedConfig(user_rate=0.5, duration_s=200.0, rounds=3, think_s=2.0, seed=4)
    w = build_sustained(cfg, words)
    joins = [lane.arrivals[0] for lane in w.lanes]
    assert joins == sorted(joins) and all(0 < t < 200.0 for t in joins)
    assert 70 <= len(w.lanes) <= 130  # Poisson: 100 expected
    # as many joins in the second half of the window as in the first: the load does not fade
    first = sum(t < 100.0 for t in joins)
    assert abs(first - (len(joins) - first)) < 0.35 * len(joins)
    lane = w.lanes[0]
    assert lane.arrivals == [joins[0]] * 3 and lane.think_s == 2.0
    assert w.planned == 3 * len(w.lanes) and w.params["users"] == len(w.lanes)
    # every user shares the system prompt and has its own context
    first_msgs = [lane.session.messages() for lane in w.lanes[:3]]
    assert len({m[0]["content"] for m in first_msgs}) == 1
    assert len({m[1]["content"] for m in first_msgs}) == 3
    assert build_sustained(cfg, words).params == w.params  # deterministic per seed


def test_sustained_rate_scales_with_the_hosts_speed() -> None:
    cfg = SustainedConfig(user_rate=1.0)
    p, g = cfg.prefill_tokens_per_user, cfg.generated_tokens_per_user
    assert p > cfg.context_tokens and g == cfg.rounds * cfg.answer_tokens
    slow = sustained_user_rate(p, g, 500.0, 100.0, load=0.75)
    fast = sustained_user_rate(p, g, 1000.0, 200.0, load=0.75)
    assert fast == pytest.approx(2 * slow)
    # the offered work per second is the load: rate x (prefill + decode seconds per user)
    assert slow * (p / 500.0 + g / 100.0) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        sustained_user_rate(p, g, 0.0, 100.0)
    with pytest.raises(ValueError):
        SustainedConfig(user_rate=0.0)
    with pytest.raises(ValueError):
        SustainedConfig(user_rate=1.0, think_s=-1.0)


def test_a_small_budget_holds_one_last_round_at_a_time() -> None:
    cfg = SustainedConfig(user_rate=1.0)
    last = cfg.longest_prompt_tokens
    assert cfg.system_tokens + cfg.context_tokens + cfg.rounds * cfg.question_tokens < last
    assert 4096 // last == 1  # the quick run's small budget: one user decodes at a time
    assert 46592 // last > 8
