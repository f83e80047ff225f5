from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.connectors.demo import QUESTIONS, run_demo
from tests.connectors.demo_prompts import shared_chunk_tokens
from tests.engine.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = write_tiny_model(tmp_path_factory.mktemp("tiny-demo"), "llama", seed=3)
    return path


def test_demo_engine_b_loads_what_engine_a_saved(tiny: Path, tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    lines: list[str] = []
    a, b = run_demo(
        str(tiny), max_tokens=4, document_path=str(doc), chunk_size=32, echo=lines.append
    )
    assert a["loaded_tokens"] == 0 and a["chunks_saved"] > 0
    # everything B's lookup found came back: every full chunk B shares with A's prompt
    # (A's tails end after the two questions part ways, so they do not serve B)
    shared = shared_chunk_tokens(tiny, doc.read_text(), *QUESTIONS, chunk=32)
    assert b["loaded_tokens"] == b["hit_tokens"] == shared > 0
    assert b["disk_hits"] > 0 and b["load_failures"] == 0
    text = "\n".join(lines)
    assert "TTFT" in text and "engine B (fresh process, kvtier)" in text and "[B] A:" in text
