"""Fixtures shared by the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.tiny_models import write_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint directory (with a byte-level BPE tokenizer)."""
    path, _ = write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=21)
    return path


@pytest.fixture(scope="session")
def smollm2_llm():
    """The real SmolLM2 GGUF in the engine (float32, one thread), loaded once per session."""
    from kvtier.engine import LLM
    from tests.conftest import smollm2_path

    path = smollm2_path()
    if not path.exists():
        pytest.skip(f"needs {path}")
    return LLM(str(path), dtype="float32", device="cpu", num_threads=1)
