"""The text a continued stream sends: exactly the uninterrupted engine's, whatever the
boundary splits (a UTF-8 character across tokens, a stop string across engines)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from kvtier.engine.models.loader import load_tokenizer
from kvtier.engine.tokenizer import Tokenizer
from kvtier.router.continuation import Transcript, continuable

TEXT = "naïve café: 世界 and ünïcödé, 🙂 end"


def engine_events(
    tok: Tokenizer, context: list[int], ids: list[int], stop: list[str], final: bool
) -> list[dict[str, Any]]:
    """The chunks an engine streams for ``ids`` after ``context`` (its detokenizer and hold-back)."""
    det, matcher = IncrementalDetokenizer(tok, context), StopStringMatcher(stop)
    text, sent, events = "", 0, []
    for i, t in enumerate(ids):
        last = final and i == len(ids) - 1
        prev = len(text)
        text += det.add(t)
        if last:
            text += det.flush()
        hit = matcher.find(text, prev)
        finish = "stop" if hit else ("length" if last else None)
        if hit:
            text = text[: hit[0]]
        end = len(text) if finish else matcher.streamable(len(text))
        choice = {"index": 0, "text": text[sent:end], "logprobs": None, "finish_reason": finish}
        sent = max(sent, end)
        events.append({"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m",
                       "choices": [{**choice, "token_ids": [t]}]})  # fmt: skip
        if finish:
            break
    return events


def client_text(
    tok: Tokenizer, prompt: list[int], ids: list[int], k: int, stop: list[str]
) -> tuple[str, str | None]:
    """What the client gets when engine 1 is lost after ``k`` tokens and engine 2 finishes."""
    body = {"prompt": prompt, "stream": True, "stop": stop}
    t = Transcript("/v1/completions", body, prompt)
    got = ""
    for e in engine_events(tok, prompt, ids[:k], stop, final=False):
        out = t.relayed(e)
        assert out is not None and "token_ids" not in out["choices"][0]
        got += out["choices"][0]["text"]
    if t.finish_reason is not None:
        return got, "engine 1 finished"
    assert t.ids == ids[:k]
    t.start_rendering(tok)
    assert t.renderer is not None
    # engine 2 detokenizes from its own prompt: wrong at a split character, which the
    # router must not pass on
    for e in engine_events(tok, prompt + ids[:k], ids[k:], stop, final=True):
        for out in t.continued(e):
            assert out["id"] == "cmpl-x"
            got += out["choices"][0]["text"]
        if t.finish_reason is not None:
            break
    return got, t.finish_reason


def test_the_continued_text_is_the_uninterrupted_text_at_every_boundary(tiny_model: Path) -> None:
    tok = load_tokenizer(tiny_model)
    prompt = tok.encode("Say it: ")
    ids = tok.encode(TEXT, add_special_tokens=False)
    whole = "".join(e["choices"][0]["text"] for e in engine_events(tok, prompt, ids, [], True))
    assert whole.endswith("end") and "世界" in whole
    splits_a_character = 0
    for k in range(1, len(ids)):
        if "\ufffd" in tok.decode(ids[:k]):
            splits_a_character += 1
        got, finish = client_text(tok, prompt, ids, k, [])
        assert got == whole, k
        assert finish == "length"
    assert splits_a_character > 0  # the boundary fell inside a character at least once


def test_a_stop_string_across_the_boundary_ends_the_stream_where_one_engine_would(
    tiny_model: Path,
) -> None:
    tok = load_tokenizer(tiny_model)
    prompt = tok.encode("Say it: ")
    ids = tok.encode(TEXT, add_special_tokens=False)
    stop = ["世界 a"]
    whole = "".join(e["choices"][0]["text"] for e in engine_events(tok, prompt, ids, stop, True))
    assert whole == TEXT[: TEXT.index("世界 a")]
    across = 0
    for k in range(1, len(ids)):
        got, finish = client_text(tok, prompt, ids, k, stop)
        if finish == "engine 1 finished":
            continue
        across += len(whole) < len(tok.decode(ids[:k])) < len(whole) + len(stop[0])
        assert (got, finish) == (whole, "stop"), k
    assert across > 0  # the boundary fell inside the stop string at least once


def test_what_cannot_be_continued() -> None:
    assert continuable("/v1/completions", {"stream": True, "prompt": "a"}) is None
    assert continuable("/v1/chat/completions", {"stream": True, "messages": []}) is None
    assert continuable("/v1/completions", {"prompt": "a"}) == "not streamed"
    assert continuable("/v1/completions", {"stream": True, "n": 2}) == "several choices"
    assert continuable("/v1/completions", {"stream": True, "logprobs": 1}) == "logprobs"
    assert (
        continuable("/v1/completions", {"stream": True, "prompt": ["a", "b"]}) == "several prompts"
    )


def test_a_client_that_asked_for_token_ids_gets_every_id_once(tiny_model: Path) -> None:
    tok = load_tokenizer(tiny_model)
    prompt = tok.encode("Say it: ")
    ids = tok.encode(TEXT, add_special_tokens=False)
    k = len(ids) // 2
    body = {"prompt": prompt, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t = Transcript("/v1/completions", body, prompt)
    got: list[int] = []
    for e in engine_events(tok, prompt, ids[:k], [], final=False):
        out = t.relayed(e)
        assert out is not None
        got += out["choices"][0]["token_ids"]
    t.start_rendering(tok)
    for e in engine_events(tok, prompt + ids[:k], ids[k:], [], final=True):
        for out in t.continued(e):
            got += out["choices"][0].get("token_ids", [])
    assert got == ids
    usage = t.usage_chunk()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), len(ids))
