"""Incremental detokenization: multi-byte UTF-8 split across tokens never leaks U+FFFD."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from kvtier.engine.models.loader import load_model, load_tokenizer
from kvtier.engine.tokenizer import Tokenizer

TEXTS = [
    "Héllo wörld, naïve café",
    "日本語のテキスト",
    "emoji 🤖🚀 and 👩‍👩‍👧 family",
    "mixed: ǅ ﬁ Ω ≈ ∑ → 😀!",
]


@pytest.fixture(scope="module")
def tok(tiny_llama: Path) -> Tokenizer:
    return load_model(tiny_llama, torch.float32, torch.device("cpu")).tokenizer


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    d = IncrementalDetokenizer(tok, prompt or [])
    pieces = [d.add(t) for t in ids]
    pieces.append(d.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_text_streams_without_replacement_chars(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    # the byte-level vocabulary must actually split some characters across tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids) or text.isascii()
    pieces = _stream(tok, ids, prompt=tok.encode("prefix ", add_special_tokens=False))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_any_text_roundtrips_incrementally(tiny_llama: Path, text: str) -> None:
    tok = _TOK_CACHE.setdefault(
        "t", load_model(tiny_llama, torch.float32, torch.device("cpu")).tokenizer
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert "".join(_stream(tok, ids)) == tok.decode(ids)


_TOK_CACHE: dict[str, Tokenizer] = {}


def test_incomplete_sequence_is_held_until_flush(tok: Tokenizer) -> None:
    ids = tok.encode("🤖", add_special_tokens=False)
    assert len(ids) > 1
    d = IncrementalDetokenizer(tok, [])
    assert [d.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.add(ids[-1]) == "🤖"
    d2 = IncrementalDetokenizer(tok, [])
    d2.add(ids[0])
    assert d2.flush() == tok.decode(ids[:1])  # at the very end, what is there is returned


def test_stop_matcher_holds_back_possible_prefixes() -> None:
    m = StopStringMatcher(["STOP", "x"])
    assert m.holdback == 3
    assert m.streamable(10) == 7
    assert m.find("abcST", 0) is None
    assert m.find("abcSTOPdef", 5) == (3, "STOP")
    assert m.find("axSTOP", 0) == (1, "x")
    assert StopStringMatcher([]).streamable(10) == 10


@pytest.mark.smollm2
def test_smollm2_tokenizer_streams_emoji_and_cjk(smollm2: Path) -> None:
    tok = load_tokenizer(smollm2)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        pieces = _stream(tok, ids)
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == text
