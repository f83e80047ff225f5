"""``KVTIER_STEP_TRACE``: one JSON line per forward pass, off by default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.engine import LLM, SamplingParams
from kvtier.engine.step_trace import ENV


def test_every_step_is_traced_with_its_chunks(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv(ENV, str(trace))
    llm = LLM(str(tiny_llama), dtype="float32", num_threads=1, max_num_batched_tokens=32)
    llm.generate([[5] * 50, [7] * 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.engine.shutdown()
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len(lines) == llm.engine.stats().num_steps
    assert lines[0]["prefill"] == [[0, 32]]  # the first chunk of the 50-token prompt
    assert sum(n for line in lines for _, n in line["prefill"]) == 53
    assert all(line["forward_s"] > 0 and line["threads"] == 1 for line in lines)
    assert sum(line["decodes"] for line in lines) == 2 * 3  # tokens after each first one


def test_no_trace_without_the_variable_and_a_bad_path_is_a_warning(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert LLM(str(tiny_llama), dtype="float32", num_threads=1).engine._trace is None
    monkeypatch.setenv(ENV, str(tmp_path / "no-such-dir" / "steps.jsonl"))
    llm = LLM(str(tiny_llama), dtype="float32", num_threads=1)
    assert llm.engine._trace is None
    assert llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2))[0].token_ids
